"""Exercise 4.7's judged functions: their realistic mistakes, the factor or group each is off by,
and the graded case that tells it from the others (issue 49; run by tests/test_mistake_tables.py,
printed by ``python -m tests.mistake_tables``).

Each table measures what the grader measures, on the cases the grader runs (its own constants),
and names through the grader's own wording function. The mistakes are planted here by code of
their own (a zig-zag cut done the wrong way, a count summed over another group, a simulated
finish_gradients with one group changed), not by the namers' reproductions, except the balance
loss, whose simulation (lm_namers.balance_way) is the only one there is. The neighbours of a
mistake change one factor or one group of it, taken from the function's factor list.
"""

# (no ``from __future__ import annotations``: mistake_tables loads this file without registering
# it in sys.modules, and dataclasses then cannot resolve string annotations)
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from functools import cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

_HERE = Path(__file__).resolve().parent
for _path in (_HERE, _HERE.parent):
    if str(_path) not in sys.path:
        sys.path.append(str(_path))

from grade_4_7_pieces import (  # noqa: E402
    INEXACT_COUNTS,
    PLACEMENT_CASES,
    POSITION_CASES,
    REGION_FUNCTIONS,
    balance_message,
    collective_message,
    count_message,
    finish_message,
    loss_cases,
    loss_inputs,
    loss_message,
    placements_message,
    positions_message,
    region_message,
)
from lm_namers import (  # noqa: E402
    BALANCE_MISTAKES,
    BALANCE_RIGHT,
    BalanceMeasured,
    BalanceWay,
    balance_way,
)
from lm_pieces_helpers import (  # noqa: E402
    BALANCE_LAYOUTS,
    BATCH,
    COUNT_LAYOUTS,
    EXPERTS,
    FINISH_CASES,
    SP_SHAPE,
    SP_TP,
    WORLD,
    count_grid,
    count_targets,
    entry_inputs,
    finish_grid,
    group_names,
    held_name,
    local_slice,
    region_shapes,
    routing,
    sp_grid,
    sp_input,
    sp_weight,
)
from mistake_tables import KnownMistake, NamerTable, one_factor_away, same_measurement  # noqa: E402

from course.comm_counter import CommRecord  # noqa: E402
from course.language_model import IGNORE_INDEX  # noqa: E402
from course.topology import RankGrid  # noqa: E402

# ----------------------------------------------------------------------------- token_positions


@dataclass(frozen=True)
class PositionsCode:
    """A way to cut ``arange(seq_len)`` for cp rank r: into ``chunks`` ("2cp" or "cp") equal
    chunks, taking chunk ``first`` then chunk ``second`` (index rules), or the contiguous span,
    the local indices, the whole sequence; returned as ``dtype``."""

    cut: str = "zigzag"  # zigzag, contiguous, local, whole
    first: str = "r"  # r, r+1, 2cp-1-r
    second: str = "2cp-1-r"  # 2cp-1-r, 2cp-r, cp+r, r
    chunks: str = "2cp"  # 2cp or cp
    dtype: str = "int64"


def _index(rule: str, r: int, cp: int) -> int:
    return {"r": r, "r+1": r + 1, "2cp-1-r": 2 * cp - 1 - r, "2cp-r": 2 * cp - r,
            "cp+r": cp + r}[rule]  # fmt: skip


def positions_by(code: PositionsCode, seq: int, r: int, cp: int) -> torch.Tensor:
    whole = torch.arange(seq)
    if code.cut == "local":
        out = torch.arange(seq // cp)
    elif code.cut == "whole":
        out = whole
    elif code.cut == "contiguous":
        out = whole.chunk(cp)[r]
    else:
        n = 2 * cp if code.chunks == "2cp" else cp
        pieces = whole.chunk(n)
        picked = [_index(code.first, r, cp), _index(code.second, r, cp)]
        out = torch.cat([pieces[i % n] for i in picked])
    return out.to(getattr(torch, code.dtype))


POSITIONS_MISTAKES = {
    "local indices": (PositionsCode(cut="local"), "a factor 1/cp: the local indices",
                      "every rank returned its local indices"),
    "contiguous": (PositionsCode(cut="contiguous"), "the layout: contiguous for zig-zag",
                   "contiguous layout's positions"),
    "chunks swapped": (PositionsCode(first="2cp-1-r", second="r"), "the order of the two chunks",
                       "two zig-zag chunks in the wrong order"),
    "whole sequence": (PositionsCode(cut="whole"), "a factor cp: every position",
                       "the positions of the whole sequence"),
    "float positions": (PositionsCode(dtype="float32"), "the dtype",
                        "as torch.float32"),
}  # fmt: skip


def _positions_measure(code: PositionsCode) -> list[list[torch.Tensor]]:
    return [[positions_by(code, seq, r, cp) for r in range(cp)] for seq, cp in POSITION_CASES]


def _positions_neighbours(key: str) -> Iterator[tuple[str, Any]]:
    """A cut's neighbours: one choice of the cut changed; the dtype mistake's: other dtypes."""
    code = POSITIONS_MISTAKES[key][0]
    choices = {"cut": ("zigzag", "contiguous", "local", "whole"),
               "first": ("r", "r+1", "2cp-1-r"), "second": ("2cp-1-r", "2cp-r", "cp+r", "r"),
               "chunks": ("2cp", "cp")}  # fmt: skip
    if key == "float positions":
        choices = {"dtype": ("int32", "float64", "bfloat16")}
    for name, values in choices.items():
        for value in values:
            if getattr(code, name) != value:
                yield f"{key}, {name}={value}", _positions_measure(replace(code, **{name: value}))


POSITIONS_TABLE = NamerTable(
    exercise="4.7",
    function="token_positions",
    factors=(
        "cp (a rank's share)",
        "2·cp (the chunks)",
        "the chunks' indices",
        "their order",
        "the dtype",
    ),
    cases=tuple(f"seq {s}, cp {c}" for s, c in POSITION_CASES),
    mistakes=tuple(
        KnownMistake(key, off_by, "seq 16, cp 2", says)
        for key, (_, off_by, says) in POSITIONS_MISTAKES.items()
    ),
    right=lambda: _positions_measure(PositionsCode()),
    plant=lambda key: _positions_measure(POSITIONS_MISTAKES[key][0]),
    name=positions_message,
    neighbours=lambda key: list(_positions_neighbours(key)),
)


# ----------------------------------------------------------------------------- sequence collectives


@dataclass(frozen=True)
class CollectiveCode:
    """A way to write all_gather_sequence or reduce_scatter_sequence: the group it runs on,
    the dimension it joins or cuts, the order of the shares, which share it keeps, a sum or a
    mean, whether it gives the whole (an all-reduce) or a share, the collective it issues, and
    whether it writes into the tensor it was handed."""

    group: str = "tp"  # tp, dp or world (no group=)
    dim: int = 1
    reversed: bool = False
    share: str = "mine"  # mine or next (another group rank's)
    mean: bool = False
    whole: bool = False  # the whole sum (reduce-scatter only)
    own_only: bool = False  # its own input, not summed (reduce-scatter only)
    transposed: bool = False  # the sequence left in dimension 0 (reduce-scatter only)
    op: str = "right"  # right, all_reduce, twice
    in_place: bool = False


def _group_of(code: CollectiveCode, rank: int) -> tuple[int, ...] | None:
    return None if code.group == "world" else sp_grid().group_of(code.group, rank)


def _records(code: CollectiveCode, kind: str, rank: int, nbytes: int) -> list[Any]:
    """What CommCounter records for ``code``: the op, the bytes, the group's ranks."""
    ranks = _group_of(code, rank)
    whole = SP_SHAPE[0] * SP_TP * SP_SHAPE[1] * SP_SHAPE[2] * 8
    if code.op == "all_reduce":
        return [CommRecord("all_reduce", whole, None, ranks)]
    op = "all_gather" if kind == "gather" else "reduce_scatter_tensor"
    return [CommRecord(op, nbytes, None, ranks)] * (2 if code.op == "twice" else 1)


def _gather_measure(code: CollectiveCode) -> list[Any]:
    """Every rank's (result, records, input unchanged) for all_gather_sequence written ``code``."""
    out = []
    for rank in range(WORLD):
        ranks = _group_of(code, rank) or tuple(range(WORLD))
        shares = [sp_input(q) for q in ranks]
        if code.reversed:
            shares = shares[::-1]
        got = torch.cat(shares, dim=code.dim)
        out.append((got, _records(code, "gather", rank, got.numel() * 8), not code.in_place))
    return out


def _scatter_measure(code: CollectiveCode) -> list[Any]:
    """Every rank's (result, records, input unchanged) for reduce_scatter_sequence."""
    tokens = SP_TP * SP_SHAPE[1]
    out = []
    for rank in range(WORLD):
        ranks = _group_of(code, rank) or tuple(range(WORLD))
        wholes = [sp_input(q, tokens) for q in ranks]
        total = wholes[ranks.index(rank)] if code.own_only else torch.stack(wholes).sum(0)
        if code.mean:
            total = total / len(ranks)
        tp_group = sp_grid().group_of("tp", rank)
        n, place = len(tp_group), tp_group.index(rank)
        if code.share == "next":
            place = (place + 1) % n
        got = total if code.whole else total.chunk(n, dim=code.dim)[place]
        if code.transposed:
            got = got.transpose(0, 1)
        out.append((got, _records(code, "scatter", rank, got.numel() * 8), not code.in_place))
    return out


GATHER_MISTAKES = {
    "batch": (CollectiveCode(dim=0), "the dimension: 0 for 1", "dimension 0 (the batch)"),
    "world": (CollectiveCode(group="world"), "the group: the world for tp",
              "a collective without group= runs on the world"),
    "reversed": (CollectiveCode(reversed=True), "the order", "reverse group-rank order"),
    "as an all-reduce": (CollectiveCode(op="all_reduce"), "the collective: twice the bytes",
                         "an all-gather done as an all-reduce"),
    "input changed": (CollectiveCode(in_place=True), "the input written",
                      "changed the tensor it was handed"),
}  # fmt: skip
SCATTER_MISTAKES = {
    "not transposed back": (CollectiveCode(transposed=True), "the dimension: left in 0",
                            "with the sequence left in dimension 0"),
    "batch": (CollectiveCode(dim=0), "the dimension: 0 for 1", "cut along dimension 0"),
    "whole sum": (CollectiveCode(whole=True), "a factor tp: the whole sum",
                  "the whole sum over the group (an all-reduce)"),
    "own input": (CollectiveCode(own_only=True), "the sum: none",
                  "share of its own input: the shares must be SUMMED"),
    "mean": (CollectiveCode(mean=True), "a factor 1/tp: a mean", "the mean over the group"),
    "world sum": (CollectiveCode(group="world"), "the group: the world for tp",
                  "sum over all 4 ranks of the world, not over"),
    "another share": (CollectiveCode(share="next"), "the share: another rank's",
                      "the share of group rank"),
    "as an all-reduce": (CollectiveCode(op="all_reduce"), "the collective: twice the bytes",
                         "a reduce-scatter done as an all-reduce"),
    "input changed": (CollectiveCode(in_place=True), "the input written",
                      "changed the tensor it was handed"),
}  # fmt: skip
_COLLECTIVE_CHOICES: dict[str, tuple[Any, ...]] = {
    "group": ("tp", "dp", "world"),
    "dim": (0, 1, 2),
    "reversed": (False, True),
    "op": ("right", "all_reduce", "twice"),
    "in_place": (False, True),
}
_SCATTER_CHOICES: dict[str, tuple[Any, ...]] = {
    **_COLLECTIVE_CHOICES,
    "share": ("mine", "next"),  # a 1/world share: 6 tokens do not cut into 4
    "mean": (False, True),
    "whole": (False, True),
    "own_only": (False, True),
    "transposed": (False, True),
}
_SCATTER_CHOICES.pop("reversed")
_SCATTER_CHOICES["dim"] = (0, 1)  # dimension 2 (5 wide) does not cut into the shares


def _collective_neighbours(
    key: str, known: dict[str, tuple[Any, ...]], choices: dict[str, tuple[Any, ...]],
    measure: Callable[[CollectiveCode], Any],
) -> Iterator[tuple[str, Any]]:  # fmt: skip
    """One choice changed within the mistake's own family: a value mistake's neighbours change
    the values (the group, the dimension, the order, the share, the sum); the collective's
    (twice the bytes) change the collective; the input written has none."""
    code = known[key][0]
    family = {"op": ("op",), "in_place": ()}
    changed = [f.name for f in fields(CollectiveCode) if getattr(code, f.name) != f.default]
    own = family.get(changed[0], tuple(n for n in choices if n not in ("op", "in_place")))
    known_values = [[got for got, *_ in measure(c)] for c, *_ in known.values()]
    for name in own:
        for value in choices[name]:
            if getattr(code, name) != value:
                other = measure(replace(code, **{name: value}))
                values = [got for got, *_ in other]
                if changed[0] not in family and any(
                    same_measurement(values, v) for v in known_values
                ):
                    continue  # a known mistake's values, the collective on another group (its
                    # own input, summed nowhere): the message names both, as it should
                yield f"{key}, {name}={value}", other


def _collective_table(
    function: str, known: dict[str, tuple[Any, ...]], choices: dict[str, tuple[Any, ...]],
    measure: Callable[[CollectiveCode], Any],
) -> NamerTable:  # fmt: skip
    return NamerTable(
        exercise="4.7",
        function=function,
        factors=tuple(f"{name}: {', '.join(map(str, values))}" for name, values in choices.items()),
        cases=("tp2 x dp2",),
        mistakes=tuple(
            KnownMistake(k, off, "tp2 x dp2", says) for k, (_, off, says) in known.items()
        ),
        right=lambda: measure(CollectiveCode()),
        plant=lambda key: measure(known[key][0]),
        name=lambda measured: collective_message(function, measured),
        neighbours=lambda key: list(_collective_neighbours(key, known, choices, measure)),
    )


GATHER_TABLE = _collective_table(
    "all_gather_sequence", GATHER_MISTAKES, _COLLECTIVE_CHOICES, _gather_measure
)
SCATTER_TABLE = _collective_table(
    "reduce_scatter_sequence", SCATTER_MISTAKES, _SCATTER_CHOICES, _scatter_measure
)


# ----------------------------------------------------------------------------- the regions


@dataclass(frozen=True)
class RegionCode:
    """One branch of enter_tensor_parallel or leave_tensor_parallel (one sequence_parallel
    value): what its forward does to x (identity, gather, sum, rs: a reduce-scatter), what
    its backward does to the output's gradient (sum, identity, rs, gather, slice: its own
    share of its own gradient, own: its own gradient at its own share, zeros elsewhere), and
    the groups they run on (tp, dp, or world: no group=)."""

    forward: str
    backward: str
    forward_group: str = "tp"
    backward_group: str = "tp"


REGION_RIGHT = {
    ("enter", True): RegionCode("gather", "rs"),
    ("enter", False): RegionCode("identity", "sum"),
    ("leave", True): RegionCode("rs", "gather"),
    ("leave", False): RegionCode("sum", "identity"),
}
_REGION_OPS = {"gather": "all_gather", "sum": "all_reduce", "rs": "reduce_scatter_tensor"}


class ImpossibleCode(Exception):
    """A simulated branch whose backward autograd would refuse (a gradient of another shape)."""


def _region_run(which: str, sp: bool, code: RegionCode) -> list[Any]:
    """Every rank's ((output, gradient at its input), records) as the grader's part records
    them: the gradient only when the output has the weight's shape."""
    tokens_in, tokens_out = region_shapes(which, sp)
    grid = sp_grid()

    def members(group: str, rank: int) -> tuple[int, ...]:
        return tuple(range(WORLD)) if group == "world" else grid.group_of(group, rank)

    def apply(op: str, values: list[torch.Tensor], group: str, rank: int) -> torch.Tensor:
        ranks = members(group, rank)
        tp = grid.group_of("tp", rank)
        if op == "identity":
            return values[rank]
        if op == "gather":
            return torch.cat([values[q] for q in ranks], dim=1)
        total = torch.stack([values[q] for q in ranks]).sum(0)
        if op == "sum":
            return total
        if op == "rs":
            return total.chunk(len(tp), dim=1)[tp.index(rank)]
        if op == "slice":
            return values[rank].chunk(len(tp), dim=1)[tp.index(rank)]
        mine = values[rank]  # "own": its own gradient at its own share of the input, zeros else
        out = torch.zeros(mine.shape[0], tokens_in, mine.shape[2], dtype=mine.dtype)
        width = mine.shape[1]
        out[:, tp.index(rank) * width : (tp.index(rank) + 1) * width] = mine  # "own"
        return out

    xs = [sp_input(q, tokens_in) for q in range(WORLD)]
    ws = [sp_weight(q, tokens_out) for q in range(WORLD)]
    results = []
    for rank in range(WORLD):
        out = apply(code.forward, xs, code.forward_group, rank)
        grad = None
        if out.shape == ws[rank].shape:
            try:
                grad = apply(code.backward, ws, code.backward_group, rank)
            except RuntimeError as exc:  # a gradient of no shape: autograd refuses the code
                raise ImpossibleCode(str(exc)) from exc
            if grad.shape != xs[rank].shape:
                raise ImpossibleCode(f"a gradient of shape {tuple(grad.shape)} for x")
        records = []
        for op, group, value in ((code.forward, code.forward_group, out),
                                 (code.backward, code.backward_group, grad)):  # fmt: skip
            if op in _REGION_OPS and value is not None:
                ranks = None if group == "world" else grid.group_of(group, rank)
                nbytes = value.numel() * 8  # the output's bytes (CommCounter's first tensor)
                records.append(CommRecord(_REGION_OPS[op], nbytes, None, ranks))
        results.append(((out, grad), records))
    return results


def _region_measure(which: str, changed: dict[bool, RegionCode]) -> dict[bool, list[Any]]:
    """Both modes of one region function: each branch right unless ``changed`` says."""
    return {sp: _region_run(which, sp, changed.get(sp, REGION_RIGHT[(which, sp)]))
            for sp in (True, False)}  # fmt: skip


REGION_MISTAKES: dict[str, dict[str, tuple[bool, RegionCode, str, str]]] = {
    # function -> key -> (the branch, its code, off by, the words)
    "enter": {
        "sp: identity": (True, RegionCode("identity", "sum"), "the gather (2.6's f under sp)",
                         "x came back as it was (2.6's f is the identity)"),
        "sp: gathered from the world": (True, RegionCode("gather", "rs", "world", "world"),
                                        "the group: the world for tp",
                                        "gathered from all 4 ranks of the world"),
        "sp: own part back": (True, RegionCode("gather", "slice"), "the backward's sum",
                              "the gradient that reached x is only this rank's own part: every"),
        "sp: backward on the world": (True, RegionCode("gather", "rs", "tp", "world"),
                                      "the backward's group", "reduce-scattered over all 4 ranks of the world"),
        "backward on the world": (False, RegionCode("identity", "sum", "tp", "world"),
                                  "the backward's group", "all-reduced over all 4 ranks of the world"),
        "gathered without sp": (False, RegionCode("gather", "rs"), "the gather without sp",
                                "gathered the group's tensors along the sequence though"),
        "summed forward": (False, RegionCode("sum", "identity"), "f for g",
                           "summed x over the group in forward"),
        "own part back": (False, RegionCode("identity", "identity"), "the backward's sum (f)",
                          "2.6's f all-reduces the gradient in backward"),
    },
    "leave": {
        "sp: whole sum": (True, RegionCode("sum", "identity"), "the reduce-scatter (g under sp)",
                          "the whole sum over the group (2.6's g)"),
        "sp: own share": (True, RegionCode("slice", "own"), "the sum",
                          "this rank's share of its own partial sums"),
        "sp: summed over the world": (True, RegionCode("rs", "gather", "world", "tp"),
                                      "the group: the world for tp",
                                      "reduce-scattered over all 4 ranks of the world"),
        "sp: own share back": (True, RegionCode("rs", "own"), "the backward's gather",
                               "its own share of the tokens only (zeros"),
        "identity": (False, RegionCode("identity", "identity"), "the sum (g)",
                     "y came back as it was"),
        "share without sp": (False, RegionCode("rs", "gather"), "the reduce-scatter without sp",
                             "only this rank's share of the tokens, though"),
        "summed over the world": (False, RegionCode("sum", "identity", "world"),
                                  "the group: the world for tp",
                                  "all-reduced over all 4 ranks of the world"),
        "summed back": (False, RegionCode("sum", "sum"), "g's backward: a sum for the identity",
                        "summed over the group in backward too"),
    },
}  # fmt: skip


def _region_neighbours(which: str, key: str) -> Iterator[tuple[str, Any]]:
    """One choice of the mistaken branch changed: its forward, its backward, or a group."""
    sp, code, *_ = REGION_MISTAKES[which][key]
    right = REGION_RIGHT[(which, sp)]
    if (code.forward, code.forward_group) != (right.forward, right.forward_group):
        # a forward mistake (the one the grader tells first): its forward changed
        choices = {"forward": ("identity", "gather", "sum", "rs", "slice"),
                   "forward_group": ("tp", "dp", "world")}  # fmt: skip
    else:  # a backward mistake: its backward changed
        choices = {"backward": ("sum", "identity", "rs", "gather", "slice", "own"),
                   "backward_group": ("tp", "dp", "world")}  # fmt: skip
    known = [c for s, c, *_ in REGION_MISTAKES[which].values() if s == sp]
    outputs = [[out for (out, _), _ in _region_run(which, sp, c)] for c in known]
    for name, values in choices.items():
        for value in values:
            other = replace(code, **{name: value})
            if getattr(code, name) == value or other in known or other == REGION_RIGHT[(which, sp)]:
                continue
            try:
                measured = _region_measure(which, {sp: other})
            except ImpossibleCode:
                continue  # it would raise in the learner's run, not measure
            forward = [out for (out, _), _ in measured[sp]]
            if "forward" in choices and any(same_measurement(forward, o) for o in outputs):
                continue  # a known mistake's forward (named, as it should be), another backward
            yield f"{key}, {name}={value}", measured


def _region_table(which: str) -> NamerTable:
    function = dict(REGION_FUNCTIONS)[which]
    mistakes = REGION_MISTAKES[which]
    return NamerTable(
        exercise="4.7",
        function=function,
        factors=(
            "the forward: identity, gather, sum, reduce-scatter",
            "the backward: sum, identity, reduce-scatter, gather, its own part",
            "the group of each: tp, dp, the world",
            "the branch: with or without sp",
        ),
        cases=("with-sp", "without-sp"),
        mistakes=tuple(
            KnownMistake(k, off, "with-sp" if sp else "without-sp", says)
            for k, (sp, _, off, says) in mistakes.items()
        ),
        right=lambda: _region_measure(which, {}),
        plant=lambda key: _region_measure(which, {mistakes[key][0]: mistakes[key][1]}),
        name=lambda measured: (
            region_message(which, True, measured[True])
            or region_message(which, False, measured[False])
        ),
        neighbours=lambda key: list(_region_neighbours(which, key)),
    )


ENTER_TABLE = _region_table("enter")
LEAVE_TABLE = _region_table("leave")


# ----------------------------------------------------------------------------- count_valid_tokens

COUNT_GROUPS = ("own", "dp", "cp", "tp", "dp_cp", "world", "pp", "dp+tp", "cp+tp")


def _count_ranks(grid: RankGrid, group: str, rank: int) -> set[int]:
    if group == "own":
        return {rank}
    if group == "world":
        return set(range(grid.world_size))
    members = {rank}
    for name in group.split("+"):
        members = {q for m in members for q in grid.group_of(name, m)}
    return members


def _count_measure(group: str = "dp_cp", dtype: str = "int64", mean: bool = False) -> Any:
    """What the grader records when every rank sums its own count over ``group`` (carried as
    ``dtype``; divided by the group's size when ``mean``)."""
    targets = count_targets()
    results, wires = {}, {}
    for label in COUNT_LAYOUTS:
        grid = count_grid(label)
        own = []
        for rank in range(grid.world_size):
            c = grid.coords(rank)
            mine = local_slice(targets, c.dp, grid.dp, c.cp, grid.cp)
            own.append(int((mine != IGNORE_INDEX).sum()))
        per_rank, sent = [], []
        for rank in range(grid.world_size):
            ranks = _count_ranks(grid, group, rank)
            total = sum(own[q] for q in ranks)
            per_rank.append((total // len(ranks) if mean else total, own[rank]))
            sent.append([("all_reduce", dtype)])  # own: on a group of one (pp here)
        results[label], wires[label] = per_rank, sent
    return results, wires


COUNT_MISTAKES = {
    # "own", like "local sequences" and "counts over cp only" of the balance loss, is told from
    # every other mistake by the two layouts together, not by one alone (a world of 4 has no
    # layout with dp, cp and tp all above 1); separated_by names the one it fails first
    "own": ("dp x cp: no sum", "dp2 x cp2", "its own count: the loss divides"),
    "dp": ("cp: over dp only", "dp2 x cp2", "the sum over dp only"),
    "cp": ("dp: over cp only", "dp2 x cp2", "the sum over cp only"),
    "tp": ("dp x cp for tp", "cp2 x tp2", "the sum over tp"),
    "world": ("tp (counted tp times)", "cp2 x tp2", "every rank of the world"),
    "float32 on the wire": ("the dtype", "dp2 x cp2", "carried it as float32"),
}


def _count_plant(key: str) -> Any:
    if key == "float32 on the wire":
        return _count_measure(dtype="float32")
    return _count_measure(group=key)


def _count_neighbours(key: str) -> Iterator[tuple[str, Any]]:
    """A group mistake's neighbours: the other groups, and a mean for the sum; the dtype
    mistake's: the other inexact dtypes (the exact ones, int32 and float64, are right)."""
    if key == "float32 on the wire":
        for dtype in INEXACT_COUNTS:
            yield f"as {dtype}", _count_measure(dtype=dtype)
        return
    for other in COUNT_GROUPS:
        if other != key:
            yield f"summed over {other}", _count_measure(group=other)
    yield f"{key}, averaged", _count_measure(group=key, mean=True)


COUNT_TABLE = NamerTable(
    exercise="4.7",
    function="count_valid_tokens",
    factors=(
        "the group summed over: " + ", ".join(COUNT_GROUPS),
        "a mean for a sum",
        "the dtype on the wire: " + ", ".join(["int64", *INEXACT_COUNTS]),
    ),
    cases=tuple(COUNT_LAYOUTS),
    mistakes=tuple(
        KnownMistake(k, off, sep, says) for k, (off, sep, says) in COUNT_MISTAKES.items()
    ),
    right=_count_measure,
    plant=_count_plant,
    name=lambda measured: count_message(*measured),
    neighbours=lambda key: list(_count_neighbours(key)),
)


# ----------------------------------------------------------------------------- loss_share

LOSS_FACTORS = ("dp", "cp", "tp", "dp_cp", "world")


def _loss_measure(key: str) -> list[float]:
    """loss_share's value in every case, computed ``key``'s way from the logits themselves."""
    logits, targets = loss_inputs()
    flat, goal = logits.view(-1, logits.shape[-1]), targets.view(-1)
    summed = float(F.cross_entropy(flat, goal, ignore_index=IGNORE_INDEX, reduction="sum"))
    mean = float(F.cross_entropy(flat, goal, ignore_index=IGNORE_INDEX))  # torch's default
    out = []
    for case in loss_cases():
        s = case.sizes
        out.append({
            "right": summed * s["dp_cp"] / case.global_valid,
            "local mean": mean,
            "local mean x dp_cp": mean * s["dp_cp"],
            "unscaled": summed / case.global_valid,
            "all targets": summed / goal.numel(),
            "all targets x dp_cp": summed / goal.numel() * s["dp_cp"],
            **{f"scaled by {n}": summed * s[n] / case.global_valid for n in ("world", "dp", "cp", "tp")},
        }[key])  # fmt: skip
    return out


LOSS_MISTAKES = {
    "local mean": ("the global count: divided by its own", "dp2 x cp3 x tp4",
                   "the mean over this rank's own valid targets"),
    "local mean x dp_cp": ("the global count, scaled", "dp2 x cp3 x tp4",
                           "a local mean times dp x cp"),
    "unscaled": ("a factor dp x cp", "dp2 x cp3 x tp4", "not scaled for the average"),
    "all targets": ("the masked targets counted", "dp2 x cp3 x tp4", "masked ones counted: divide"),
    "all targets x dp_cp": ("the masked targets counted, scaled", "dp2 x cp3 x tp4",
                            "(masked ones counted) and scaled by dp x cp"),
    "scaled by world": ("tp (the world for dp x cp)", "dp2 x cp3 x tp4",
                        "scaled by the world size instead of dp x cp"),
    "scaled by dp": ("cp (dp for dp x cp)", "dp2 x cp3 x tp4",
                     "scaled by the dp size instead of dp x cp"),
    "scaled by cp": ("dp (cp for dp x cp)", "dp2 x cp3 x tp4",
                     "scaled by the cp size instead of dp x cp"),
    "scaled by tp": ("tp for dp x cp", "dp2 x cp3 x tp4",
                     "scaled by the tp size instead of dp x cp"),
}  # fmt: skip


def _loss_neighbours(key: str) -> Iterator[tuple[str, Any]]:
    values = _loss_measure(key)
    cases = loss_cases()
    for name in LOSS_FACTORS:
        for power in (1, -1):
            label = f"{key}, {'times' if power == 1 else 'divided by'} {name}"
            yield label, [v * c.sizes[name] ** power for v, c in zip(values, cases, strict=True)]


LOSS_TABLE = NamerTable(
    exercise="4.7",
    function="loss_share",
    factors=(*LOSS_FACTORS, "the count divided by (global valid, own valid, own targets)"),
    cases=tuple(c.label for c in loss_cases()),
    mistakes=tuple(
        KnownMistake(k, off, sep, says) for k, (off, sep, says) in LOSS_MISTAKES.items()
    ),
    right=lambda: _loss_measure("right"),
    plant=_loss_measure,
    name=loss_message,
    neighbours=lambda key: list(_loss_neighbours(key)),
)


# ----------------------------------------------------------------------------- balance_loss_share

_WAY_GROUPS = {"holders": ("cp", "tp_if_sp"), "own": (), "cp": ("cp",), "dp": ("dp",),
               "tp": ("tp",), "cp_tp": ("cp", "tp"), "dp_cp": ("dp_cp",), "world": (None,)}  # fmt: skip


def _balance_measure(way: BalanceWay) -> dict[str, tuple[Any, ...]]:
    """Every layout's shares and gradients computed ``way``, and the groups the grader would read
    off the collectives (through its own group_names)."""
    probs, experts = routing()
    out = {}
    for layout in BALANCE_LAYOUTS:
        values, grads = balance_way(way, layout, probs, experts, EXPERTS, BATCH)
        grid = RankGrid.for_world(WORLD, layout.dp, layout.tp, cp=layout.cp)
        groups = []
        for rank in range(WORLD):
            records = []
            for name in _WAY_GROUPS[way.counts_over]:
                if name == "tp_if_sp":
                    if not layout.sp:
                        continue
                    name = "tp"
                ranks = None if name is None else grid.group_of(name, rank)
                records.append(CommRecord("all_reduce", 8, None, ranks))
            groups.append(group_names(records, grid, rank))
        out[layout.label] = (values, grads, groups)  # a BalanceMeasured's fields
    return out


def _balance_name(measured: dict[str, tuple[Any, ...]]) -> str | None:
    return balance_message({label: BalanceMeasured(*m) for label, m in measured.items()})


BALANCE_BY_KEY = {w.key: w for w in BALANCE_MISTAKES}
BALANCE_OFF_BY = {
    "whole sequence on each": ("cp (tp under sp): P of the whole sequence", "dp2 x cp2"),
    "own counts": ("cp: f from own counts", "dp2 x cp2"),
    "own fraction": ("cp: f over its own tokens", "dp2 x cp2"),
    "P over local tokens": ("cp (tp under sp): P over t", "cp4"),
    "counts over cp only": ("tp under sp", "cp2 x tp2 with sequence parallelism"),
    "counts over tp too": ("tp without sp", "cp2 x tp2 without sequence parallelism"),
    "counts over dp x cp": ("dp", "dp2 x cp2"),
    "counts over the world": ("the world for cp", "cp2 x tp2 without sequence parallelism"),
    "unscaled": ("a factor dp x cp", "cp4"),
    "scaled by the world": ("tp: the world for dp x cp", "cp2 x tp2 with sequence parallelism"),
    "local sequences": ("dp: b for the global batch", "dp2 x cp2"),
    "f without k": ("a factor k", "cp4"),
    "without E": ("a factor E", "cp4"),
}
_BALANCE_CHOICES: dict[str, tuple[Any, ...]] = {
    "counts_over": ("holders", "own", "cp", "dp", "tp", "cp_tp", "dp_cp", "world"),
    "scale": ("dp_cp", "1", "world", "dp", "cp", "tp"),
    "f_tokens": ("seq", "local"),
    "p_tokens": ("seq", "local"),
    "whole_p": (False, True),
    "sequences": ("global", "local"),
}
BALANCE_FACTORS = ("k", "E", "dp", "cp", "tp", "dp_cp", "world")


def _balance_neighbours(key: str) -> Iterator[tuple[str, Any]]:
    way = BALANCE_BY_KEY[key]
    for name, values in _BALANCE_CHOICES.items():
        for value in values:
            if getattr(way, name) != value:
                yield f"{key}, {name}={value}", _balance_measure(replace(way, **{name: value}))
    for factor in BALANCE_FACTORS:  # one more factor off, or one off factor replaced
        for power in (1, -1):
            yield (f"{key}, {'times' if power == 1 else 'divided by'} {factor}",
                   _balance_measure(replace(way, off=(*way.off, (factor, power)))))  # fmt: skip
        for i, (old, power) in enumerate(way.off):
            if old != factor:
                off = (*way.off[:i], (factor, power), *way.off[i + 1 :])
                yield f"{key}, {factor} for {old}", _balance_measure(replace(way, off=off))


BALANCE_TABLE = NamerTable(
    exercise="4.7",
    function="balance_loss_share",
    factors=(
        "k (top-k)",
        "E (experts)",
        "dp",
        "cp",
        "tp (with and without sp)",
        "dp x cp",
        "the world",
        "the groups f's counts visit",
        "t for seq_len",
        "b for the batch",
    ),
    cases=tuple(layout.label for layout in BALANCE_LAYOUTS),
    mistakes=tuple(KnownMistake(w.key, *BALANCE_OFF_BY[w.key], w.says) for w in BALANCE_MISTAKES),
    right=lambda: _balance_measure(BALANCE_RIGHT),
    plant=lambda key: _balance_measure(BALANCE_BY_KEY[key]),
    name=_balance_name,
    neighbours=lambda key: list(_balance_neighbours(key)),
)


# ----------------------------------------------------------------------------- finish_gradients


@dataclass(frozen=True)
class FinishCode:
    """A simulated finish_gradients (the reference's steps), each step's group a parameter:
    None skips a sum or a division; "world" is a collective without ``group=``."""

    tp_when: str = "sp"  # sp, always, never
    tp_which: str = "replicated"  # replicated or all
    tp_group: str | None = "tp"
    dense_group: str | None = "dp_cp"
    dense_divisor: str | None = "dp_cp"
    zero_too: bool = False  # ZeRO slices summed (and divided) with the dense ones
    zero_divided: bool = False  # ZeRO slices divided again
    expert_group: str | None = "edp"
    expert_divisor: str | None = "dp_cp"
    tie_group: str | None = "embedding"
    tie_which: str = "tied"  # tied, ends (by name), all
    unchanged: bool = False  # worked on copies


FINISH_GROUPS = ("tp", "dp", "cp", "dp_cp", "ep", "edp", "embedding", "pp", "world", None)


@cache
def _members(grid: RankGrid, group: str, rank: int) -> tuple[int, ...]:
    return tuple(range(grid.world_size)) if group == "world" else grid.group_of(group, rank)


class _Simulated:
    """Every rank's gradients of one case while a simulated finish_gradients runs on them."""

    def __init__(self, case: str) -> None:
        self.grid, self.held = finish_grid(case), FINISH_CASES[case]["held"]
        inputs = [entry_inputs(case, e) for e in self.held]
        self.values = [[x[rank].clone() for x in inputs] for rank in range(self.grid.world_size)]
        self.on_world = [False] * self.grid.world_size

    def reduce(self, pick: Callable[[tuple[Any, ...]], bool], group: str | None) -> None:
        """An all-reduce on ``group`` of the entries ``pick`` takes, on every rank at once."""
        chosen = [i for i, e in enumerate(self.held) if pick(e)]
        if group is None or not chosen:
            return
        before = [[v.clone() for v in per] for per in self.values]
        for rank in range(self.grid.world_size):
            self.on_world[rank] |= group == "world"
            for i in chosen:
                members = _members(self.grid, group, rank)
                self.values[rank][i] = sum((before[q][i] for q in members), torch.zeros(()))

    def divide(self, pick: Callable[[tuple[Any, ...]], bool], group: str | None) -> None:
        for rank in range(self.grid.world_size):
            n = 1 if group is None else len(_members(self.grid, group, rank))
            for i, e in enumerate(self.held):
                if pick(e):
                    self.values[rank][i] = self.values[rank][i] / n


@cache
def _finish_measure(code: FinishCode) -> dict[str, tuple[torch.Tensor, tuple[bool, ...]]]:
    """What the grader records for every case (packed): per rank, every gradient after the
    simulated finish_gradients, and whether a collective ran on the world group."""

    def dense(e: tuple[Any, ...]) -> bool:
        return not e[4] and (not e[5] or code.zero_too)

    tie = {"tied": lambda e: e[3], "ends": lambda e: e[0] in ("TIED", "END"),
           "all": lambda e: True}[code.tie_which]  # fmt: skip
    out = {}
    for case, spec in FINISH_CASES.items():
        run = _Simulated(case)
        if not code.unchanged:
            if {"sp": spec["sp"], "always": True, "never": False}[code.tp_when]:
                run.reduce(lambda e: code.tp_which == "all" or e[2], code.tp_group)
            run.reduce(dense, code.dense_group)
            run.reduce(lambda e: e[4], code.expert_group)
            run.divide(dense, code.dense_divisor)
            run.divide(lambda e: e[4], code.expert_divisor)
            if code.zero_divided:
                run.divide(lambda e: e[5], "dp_cp")
            run.reduce(tie, code.tie_group)
        flat = torch.cat([v.reshape(-1) for per in run.values for v in per])
        out[case] = (flat, tuple(run.on_world))  # packed: one tensor compares faster than 12
    return out


def _finish_unpack(measured: dict[str, Any]) -> dict[str, list[Any]]:
    """The packed measurement as the grader holds it: per case, per rank, (name -> gradient,
    whether a collective ran on the world group)."""
    out = {}
    for case, (flat, on_world) in measured.items():
        grid, held = finish_grid(case), FINISH_CASES[case]["held"]
        sizes = [torch.Size(e[1]).numel() for e in held] * grid.world_size
        pieces = iter(flat.split(sizes))
        out[case] = [
            ({held_name(e[0], grid, rank, e[4]): next(pieces).view(e[1]) for e in held},
             on_world[rank])
            for rank in range(grid.world_size)
        ]  # fmt: skip
    return out


FINISH_MISTAKES: dict[str, tuple[FinishCode, str, str, str]] = {
    # key: (the code, off by, separated by, the words)
    "unchanged": (FinishCode(unchanged=True), "every sum", "dp2 x cp2, experts on ep2",
                  "left unchanged: finish_gradients works in place"),
    "tp extra": (FinishCode(tp_when="always"), "tp without sp", "dp2 x tp2, no sequence parallelism, experts on ep2",
                 "summed over tp although sequence parallelism is off"),
    "tp missing": (FinishCode(tp_when="never"), "tp under sp",
                   "dp2 x tp2, sequence parallel, ZeRO slices", "not summed over tp: under sequence"),
    "tp world": (FinishCode(tp_group="world"), "the world for tp", "pp2 x tp2, sequence parallel",
                 "instead of tp: the tp sum's collective"),
    "tp on a shard": (FinishCode(tp_which="all"), "tp on a tp shard",
                      "dp2 x tp2, sequence parallel, ZeRO slices", "though it is a tensor-parallel shard"),
    "dp only": (FinishCode(dense_group="dp", dense_divisor="dp"), "cp (dp for dp x cp)",
                "dp2 x cp2, experts on ep2", "averaged over dp only"),
    "dp only, dp x cp divisor": (FinishCode(dense_group="dp"), "cp in the sum",
                                 "dp2 x cp2, experts on ep2", "summed over dp only"),
    "cp only": (FinishCode(dense_group="cp", dense_divisor="cp"), "dp (cp for dp x cp)",
                "dp2 x cp2, experts on ep2", "averaged over cp only"),
    "not averaged": (FinishCode(dense_group=None, dense_divisor=None), "dp x cp, sum and divisor",
                     "dp2 x cp2, experts on ep2", "not averaged over dp x cp"),
    "world": (FinishCode(dense_group="world"), "the world for dp x cp",
              "dp2 x tp2, sequence parallel, ZeRO slices",
              "summed over the whole world instead of dp x cp"),
    "world averaged": (FinishCode(dense_group="world", dense_divisor="world"),
                       "the world for dp x cp, sum and divisor", "pp2 x dp2, tied embedding",
                       "averaged over the whole world instead of dp x cp"),
    "expert world": (FinishCode(expert_group="world"), "the world for edp",
                     "dp2 x tp2, no sequence parallelism, experts on ep2", "summed over the whole world instead of edp"),
    "expert world averaged": (FinishCode(expert_group="world", expert_divisor="world"),
                              "the world for edp, and its size",
                              "dp2 x tp2, no sequence parallelism, experts on ep2",
                              "averaged over the whole world instead of edp"),
    "not divided": (FinishCode(dense_divisor=None, expert_divisor=None), "the dp x cp divisor",
                    "dp2 x cp2, experts on ep2", "summed but not divided by the dp x cp size"),
    "divided by the world": (FinishCode(dense_divisor="world", expert_divisor="world"),
                             "the world for the dp x cp divisor",
                             "dp2 x tp2, no sequence parallelism, experts on ep2",
                             "divided by the world size instead of the dp x cp size"),
    "expert over dp x cp": (FinishCode(expert_group="dp_cp"), "dp x cp for edp",
                            "dp2 x cp2, experts on ep2", "summed over all of dp x cp"),
    "expert over ep": (FinishCode(expert_group="ep"), "ep for edp", "dp2 x cp2, experts on ep2",
                       "summed over its ep group"),
    "expert divided by edp": (FinishCode(expert_divisor="edp"), "edp for the dp x cp divisor",
                              "dp2 x cp2, experts on ep2", "divided by the edp group's size"),
    "expert not summed": (FinishCode(expert_group=None), "edp", "dp2 x cp2, experts on ep2",
                          "not summed over its edp group"),
    "zero averaged again": (FinishCode(zero_too=True), "dp x cp on a ZeRO slice",
                            "dp2 x tp2, sequence parallel, ZeRO slices",
                            "averaged over dp x cp again"),
    "zero divided again": (FinishCode(zero_divided=True), "the dp x cp divisor on a ZeRO slice",
                           "dp2 x tp2, sequence parallel, ZeRO slices",
                           "divided by the dp x cp size again"),
    "tie missing": (FinishCode(tie_group=None), "the embedding group", "pp2 x dp2, tied embedding",
                    "it was not summed over the embedding group"),
    "untied summed": (FinishCode(tie_which="ends"), "the tie by name, not by the flag",
                      "pp2 x dp2, untied embedding and head", "though this model's head is untied"),
    "tie on another weight": (FinishCode(tie_which="all"), "the tie on every gradient",
                              "pp2 x dp2, untied embedding and head",
                              "only the two copies of a tied embedding"),
}  # fmt: skip


def _finish_content(measured: dict[str, tuple[torch.Tensor, tuple[bool, ...]]]) -> bytes:
    """The numbers of a measurement, as a key (equal numbers, equal keys)."""
    return b"".join(
        flat.numpy().tobytes() + bytes(on_world) for flat, on_world in measured.values()
    )


def _fields_apart(a: FinishCode, b: FinishCode) -> int:
    return sum(getattr(a, f.name) != getattr(b, f.name) for f in fields(FinishCode))


def _finish_neighbours(key: str) -> Iterator[tuple[str, Any]]:
    """One step (one field) from ``key``'s code; a code one step from several known mistakes
    is tried once, as the neighbour of the first of them."""
    code = FINISH_MISTAKES[key][0]
    codes = [c for c, *_ in FINISH_MISTAKES.values()]
    seen = {_finish_content(_finish_measure(FinishCode()))}  # the right numbers: nothing to try
    choices: dict[str, tuple[Any, ...]] = {
        "tp_when": ("sp", "always", "never"),
        "tp_which": ("replicated", "all"),
        "tie_which": ("tied", "ends", "all"),
    }
    for f in fields(FinishCode):
        if f.name.endswith(("_group", "_divisor")):
            choices[f.name] = FINISH_GROUPS
    for name, values in choices.items():
        for value in values:
            if getattr(code, name) == value:
                continue
            other = replace(code, **{name: value})
            if other in codes or next(c for c in codes if _fields_apart(c, other) == 1) != code:
                continue
            measured = _finish_measure(other)
            content = _finish_content(measured)
            if content in seen:
                continue  # another group of the same size and ranks here: the same numbers
            seen.add(content)
            yield f"{key}, {name}={value}", measured


FINISH_TABLE = NamerTable(
    exercise="4.7",
    function="finish_gradients",
    factors=(
        "the groups tp, dp, cp, dp x cp, ep, edp, embedding, pp, the world (or none) of each sum",
        "the divisor (the same groups' sizes)",
        "when the tp sum runs (sp)",
        "which gradients each sum takes (the flags)",
    ),
    cases=tuple(FINISH_CASES),
    mistakes=tuple(
        KnownMistake(k, off, sep, says) for k, (_, off, sep, says) in FINISH_MISTAKES.items()
    ),
    right=lambda: _finish_measure(FinishCode()),
    plant=lambda key: _finish_measure(FINISH_MISTAKES[key][0]),
    name=lambda measured: finish_message(_finish_unpack(measured)),
    neighbours=lambda key: list(_finish_neighbours(key)),
)


# ----------------------------------------------------------------------------- gradient_placements

# A way of writing gradient_placements, one value per factor: the groups a whole dense gradient,
# an expert and a ZeRO slice start from; which gradients get tp and embedding; which kinds skip
# those extras. The right way is PLACEMENT_RIGHT; every factor's other values are its realistic
# slips ("" is no group).
PLACEMENT_RIGHT = {"dense": "dp_cp", "expert": "edp", "slice": "", "tp": "tp-replicated",
                   "embedding": "tied", "bare": "none"}  # fmt: skip
PLACEMENT_FACTORS = {
    "dense": ("dp_cp", "dp", "cp", ""),
    "expert": ("edp", "dp_cp", "edp+dp_cp", "ep", ""),
    "slice": ("", "dp_cp", "dp"),
    "tp": ("tp-replicated", "never", "always", "not tp-replicated"),
    "embedding": ("tied", "never", "embedding or head", "always"),
    "bare": ("none", "slice", "expert", "slice and expert"),
}


def _placement_measure(changed: dict[str, str]) -> list[frozenset[str] | None]:
    """The replicated_on a gradient_placements written ``changed``'s way gives every graded
    gradient, worked out here from the held gradient's flags (not by the namer's ways)."""
    way = {**PLACEMENT_RIGHT, **changed}
    out: list[frozenset[str] | None] = []
    for kind, _ in PLACEMENT_CASES:
        base = way["expert"] if kind.expert else way["slice"] if kind.reduced else way["dense"]
        axes = {g for g in base.split("+") if g}
        bare = (kind.reduced and "slice" in way["bare"]) or (
            kind.expert and "expert" in way["bare"]
        )
        gets_tp = {"tp-replicated": kind.tp_replicated, "never": False, "always": True,
                   "not tp-replicated": not kind.tp_replicated}[way["tp"]]  # fmt: skip
        named = kind.name in ("embedding.weight", "head.weight")
        gets_tie = {"tied": kind.tied, "never": False, "embedding or head": named,
                    "always": True}[way["embedding"]]  # fmt: skip
        if gets_tp and not bare:
            axes.add("tp")
        if gets_tie and not bare:
            axes.add("embedding")
        out.append(frozenset(axes))
    return out


# key: (its way, off by, separated by, words); the words are those of lm_namers.PLACEMENT_WAYS
PLACEMENT_MISTAKES = {
    "no tp": ({"tp": "never"}, "the tp group missing", "a norm, averaged over dp x cp",
              "tp left out for every tp-replicated weight"),
    "no embedding": ({"embedding": "never"}, "the embedding group missing",
                     "the tied embedding's copy", "embedding left out for the two tied copies"),
    "tp for all": ({"tp": "always"}, "the tp group extra", "a tp shard, averaged over dp x cp",
                   "tp given to the tp shards as well"),
    "embedding by name": ({"embedding": "embedding or head"}, "the embedding group extra",
                          "an untied embedding",
                          "embedding given by name, to the untied embedding and head too"),
    "expert on dp_cp": ({"expert": "dp_cp"}, "dp x cp for edp", "an expert's weight",
                        "an expert placed on dp_cp instead of edp"),
    "expert on dp_cp and edp": ({"expert": "edp+dp_cp"}, "the dp x cp group extra",
                                "an expert's weight", "an expert given dp_cp beside edp"),
    "slice on dp_cp": ({"slice": "dp_cp"}, "the dp x cp group extra",
                       "a ZeRO slice of a tp shard",
                       "ZeRO slices given dp_cp, as if every dp x cp rank held the same slice"),
    "dp for dp_cp": ({"dense": "dp"}, "cp (dp for dp x cp)", "a tp shard, averaged over dp x cp",
                     "dp alone where dp_cp belongs"),
    "slice bare": ({"bare": "slice"}, "the tp group missing", "a ZeRO slice of a norm",
                   "ZeRO slices given no group at all, their tp dropped too"),
    "expert bare": ({"bare": "expert"}, "the tp group missing", "an expert's weight",
                    "an expert given edp alone, its tp dropped"),
}  # fmt: skip


def _placement_neighbours(key: str) -> list[tuple[str, Any]]:
    return one_factor_away(
        PLACEMENT_MISTAKES[key][0],
        [m[0] for m in PLACEMENT_MISTAKES.values()],
        PLACEMENT_RIGHT,
        PLACEMENT_FACTORS,
        _placement_measure,
    )


PLACEMENTS_TABLE = NamerTable(
    exercise="4.7",
    function="gradient_placements",
    factors=tuple(
        f"{f} ({' / '.join(v or 'none' for v in vs)})" for f, vs in PLACEMENT_FACTORS.items()
    ),
    cases=tuple(what for _, what in PLACEMENT_CASES),
    mistakes=tuple(
        KnownMistake(k, off, sep, says) for k, (_, off, sep, says) in PLACEMENT_MISTAKES.items()
    ),
    right=lambda: _placement_measure({}),
    plant=lambda key: _placement_measure(PLACEMENT_MISTAKES[key][0]),
    name=placements_message,
    neighbours=_placement_neighbours,
)


TABLES: Sequence[NamerTable] = (
    POSITIONS_TABLE,
    GATHER_TABLE,
    SCATTER_TABLE,
    ENTER_TABLE,
    LEAVE_TABLE,
    COUNT_TABLE,
    LOSS_TABLE,
    BALANCE_TABLE,
    FINISH_TABLE,
    PLACEMENTS_TABLE,
)
