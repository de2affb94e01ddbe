"""The mistake-namers of exercise 4.7's graders: pure functions from what a check measured to the
words of its failure.

A namer names a cause only when the measurement singles it out among the realistic mistakes for
that function. Each namer reproduces those mistakes on the check's own inputs (the positions of
every rank, the collectives' sums over each group, a balance loss computed the wrong way, a
gradient summed over another set of ranks) and compares them with what came back: one fits, it
is named; several fit, the message says what was measured and lists them, most likely first;
none fits, it says what was measured and what one process expects. A mistake that cannot show
in the layout of the check (a tp sum with no tp, a tie on one pipeline stage) gives the right
answer there, so it never fits and is never listed.

Where a check spans several cases (layouts, sizes, finish_gradients' cases), a mistake is named
only when it gives every case, the right ones included: one that fits a single case is
mentioned by its short key only, as a partial fit. A fallback says what differs (the ranks, the
elements and positions, the ratio, the one size every case is off by, the shapes and dtypes),
never only what should have been computed. tests/phase4/mistakes_ex4_7.py lists, per function,
the known mistakes, the factor each is off by and the case that separates it, and
tests/test_mistake_tables.py plants each and its neighbours (one factor or group away).

Nothing here starts a process or talks to ``torch.distributed``: tests/test_4_7_namers.py tries
every named branch with a mistake that must get its name and its nearest neighbours that must
not.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from course.topology import RankGrid

# ----------------------------------------------------------------------------- common


@dataclass(frozen=True)
class Mistake:
    """A realistic mistake a measurement fits: a short key (for tests) and what to say."""

    key: str
    says: str


def verdict(fits: Sequence[Mistake]) -> str:
    """The cause when one mistake fits; the candidates, most likely first, when several do."""
    if len(fits) == 1:
        return fits[0].says
    listed = "; or ".join(f"({i}) {m.says}" for i, m in enumerate(fits, 1))
    return f"this fits {len(fits)} mistakes, most likely first: {listed}"


def same(a: Any, b: Any, tol: float = 1e-9) -> bool:
    """Equal shapes and values (relative to the larger magnitude; inputs are small integers)."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    if a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    scale = max(1.0, float(b.double().abs().max()))
    return bool((a.double() - b.double()).abs().max() <= tol * scale)


def close_number(a: float, b: float, tol: float = 1e-9) -> bool:
    return abs(a - b) <= tol * max(abs(a), abs(b), 1e-300)


def spans(values: Sequence[int]) -> str:
    """``[0, 1, 2, 3, 12, 13]`` -> ``"0-3, 12-13"``: positions, readable."""
    out: list[str] = []
    start = prev = None
    for v in values:
        if prev is not None and v == prev + 1:
            prev = v
            continue
        if start is not None:
            out.append(f"{start}-{prev}" if prev != start else f"{start}")
        start = prev = v
    if start is not None:
        out.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ", ".join(out)


def difference(got: Any, want: torch.Tensor, seq_dim: int | None = None) -> str:
    """What differs between ``got`` and ``want``, in words: the type, the shape, the dtype, or
    how many elements differ, by how much, a common ratio, and (``seq_dim``) which positions of
    the sequence."""
    if not isinstance(got, torch.Tensor):
        return f"a {type(got).__name__}, expected a tensor of shape {tuple(want.shape)}"
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    dtype = f" (and {got.dtype}, expected {want.dtype})" if got.dtype != want.dtype else ""
    x, y = got.detach().double(), want.detach().double()
    wrong = (x - y).abs() > 1e-9 * max(1.0, float(y.abs().max()))
    n = int(wrong.sum())
    if n == 0:
        return f"the right values as {got.dtype}, expected {want.dtype}"
    text = f"{n} of {want.numel()} elements differ, by up to {float((x - y).abs().max()):.4g}"
    nonzero = y.abs() > 0
    if bool(nonzero.any()):
        ratios = (x[nonzero] / y[nonzero]).unique()
        if ratios.numel() == 1 and bool((x[~nonzero] == 0).all()):
            text += f": {float(ratios[0]):.4g} times the expected values"
    if seq_dim is not None and n < want.numel():
        other = [d for d in range(want.dim()) if d != seq_dim]
        positions = wrong.any(dim=other) if other else wrong
        text += (
            f" (sequence positions {spans(positions.nonzero().reshape(-1).tolist())} of "
            f"0-{want.shape[seq_dim] - 1})"
        )
    return text + dtype


def ranks_text(ranks: Iterable[int]) -> str:
    return "(" + ", ".join(str(r) for r in ranks) + ")"


# ----------------------------------------------------------------------------- token_positions


def zigzag(rank: int, cp: int) -> list[int]:
    """The grader's own zig-zag chunks (2.7): rank r holds chunk r and chunk 2cp-1-r."""
    return [rank, 2 * cp - 1 - rank]


def zigzag_positions(seq: int, rank: int, cp: int) -> list[int]:
    size = seq // (2 * cp)
    return [p for c in zigzag(rank, cp) for p in range(c * size, (c + 1) * size)]


def _positions_list(value: Any) -> list[int] | None:
    if isinstance(value, torch.Tensor) and value.dim() == 1:
        return [int(v) if float(v).is_integer() else float(v) for v in value.tolist()]  # type: ignore[misc]
    if isinstance(value, (list, tuple, range)):
        return [v for v in value]
    return None


def _positions_text(values: list[int] | None, value: Any) -> str:
    return spans(values) if values is not None else _kind(value)


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype}, shape {tuple(value.shape)}"
    return type(value).__name__


POSITION_MISTAKES: tuple[tuple[str, Callable[[int, int, int], list[int]], str], ...] = (
    (
        "local indices",
        lambda seq, r, cp: list(range(seq // cp)),
        "every rank returned its local indices 0..seq_len/cp-1: the rotary angles would treat "
        "each rank's tokens as the start of the sequence, so q·k of two tokens would see a "
        "distance that is not theirs",
    ),
    (
        "contiguous",
        lambda seq, r, cp: list(range(r * seq // cp, (r + 1) * seq // cp)),
        "every rank returned the contiguous layout's positions (rank r: r·L/cp to "
        "(r+1)·L/cp-1): the tokens were sharded zig-zag (2.7), rank r holding chunks r and "
        "2·cp-1-r of 2·cp equal chunks",
    ),
    (
        "chunks swapped",
        lambda seq, r, cp: [
            p
            for c in reversed(zigzag(r, cp))
            for p in range(c * seq // (2 * cp), (c + 1) * seq // (2 * cp))
        ],
        "every rank returned its two zig-zag chunks in the wrong order: its tokens are chunk r "
        "first, then chunk 2·cp-1-r, and the i-th position must be the i-th token's",
    ),
    (
        "whole sequence",
        lambda seq, r, cp: list(range(seq)),
        "every rank returned the positions of the whole sequence: a rank holds seq_len/cp tokens "
        "and needs their positions only, in its local order",
    ),
)


def positions_fitting(cases: Sequence[tuple[int, int]], got: Sequence[Sequence[Any]]) -> set[str]:
    """The position mistakes that give every case's positions (``got[i][r]``: cp rank r's in
    ``cases[i]`` = (seq_len, cp)), the cases a mistake leaves right included."""
    out = set()
    for key, positions, _ in POSITION_MISTAKES:
        if all(_positions_list(g[r]) == positions(seq, r, cp)
               for (seq, cp), g in zip(cases, got, strict=True) for r in range(cp)):  # fmt: skip
            out.add(key)
    return out


def positions_problem(
    seq: int, cp: int, got: Sequence[Any], allowed: Iterable[str] | None = None
) -> str | None:
    """What is wrong with every cp rank's ``token_positions(seq, r, cp)`` (``got[r]``); None
    when each is the rank's zig-zag positions as an int64 tensor. ``allowed``: the mistakes
    that fit the other cases too (:func:`positions_fitting`), None for no other evidence."""
    want = [zigzag_positions(seq, r, cp) for r in range(cp)]
    lists = [_positions_list(g) for g in got]
    values_ok = [lists[r] == want[r] for r in range(cp)]
    types_ok = [
        isinstance(g, torch.Tensor) and g.dtype == torch.int64 and g.dim() == 1 for g in got
    ]
    if all(values_ok) and all(types_ok):
        return None
    call = f"token_positions(seq_len={seq}, cp_rank=r, cp={cp})"
    if all(values_ok):
        r = types_ok.index(False)
        return (
            f"{call} returned the right positions on every rank, but as {_kind(got[r])} (rank "
            f"{r}); the contract is an int64 tensor (torch.arange's default), the type of the "
            "token indices they stand beside"
        )
    bad = [r for r in range(cp) if not values_ok[r]]
    shown = [r for r in bad if r > 0][:1] or bad[:1]  # rank 0 tells fewer mistakes apart
    measured = "; ".join(
        f"rank {r} returned [{_positions_text(lists[r], got[r])}] "
        f"where its zig-zag chunks {zigzag(r, cp)} hold positions [{spans(want[r])}]"
        for r in shown
    )
    fits = [
        Mistake(key, says)
        for key, positions, says in POSITION_MISTAKES
        if all(lists[r] == positions(seq, r, cp) for r in range(cp))
    ]
    here_only = [] if allowed is None else [m for m in fits if m.key not in set(allowed)]
    fits = [m for m in fits if m not in here_only]
    if fits:
        why = verdict(fits)
    elif here_only:
        keys = ", ".join(f"'{m.key}'" for m in here_only)
        why = (
            f"here that is what {keys} would give, but not in the other cases (seq_len and cp "
            "of every case count): a cut of another kind"
        )
    else:
        r = shown[0]
        mine = lists[r]
        if mine is not None and sorted(mine) == sorted(want[r]):
            why = (
                f"rank {r}'s positions are the right ones in another order: the i-th position "
                "must be the i-th local token's (chunk r first, then chunk 2·cp-1-r)"
            )
        elif mine is not None and len(mine) != len(want[r]):
            why = f"{len(mine)} positions; a rank holds seq_len/cp = {seq // cp} tokens"
        else:
            strangers = sorted(set(mine or []) - set(want[r]))
            why = (
                f"positions rank {r} does not hold ({spans(strangers)}): a rank's positions "
                "are the places in the whole sequence of the tokens it holds"
            )
    if not all(types_ok):
        r = types_ok.index(False)
        why += f" (and rank {r} returned {_kind(got[r])}, where an int64 tensor is expected)"
    return f"{call} on {cp} cp rank{'s' if cp > 1 else ''}: {measured}: {why}"


# ----------------------------------------------------------------------------- communication

# bytes per rank that a bandwidth-optimal algorithm moves for one call, as a multiple of the
# bytes CommCounter records (the first tensor argument: reduce-scatter's output, all-gather's
# output, all-to-all's input), for a group of n ranks (nccl-tests' bus bandwidth factors)
_TRAFFIC: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter_tensor": lambda n: n - 1,
    "reduce_scatter": lambda n: n - 1,
    "all_gather": lambda n: (n - 1) / n,
    "all_gather_into_tensor": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "all_to_all_single": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "send": lambda n: 1.0,
    "isend": lambda n: 1.0,
}


def traffic(record: Any, world_size: int) -> float:
    """Bytes per rank a bandwidth-optimal algorithm moves for one recorded call."""
    n = len(record.group_ranks) if record.group_ranks is not None else world_size
    factor = _TRAFFIC.get(record.op)
    return 0.0 if factor is None or n <= 1 else factor(n) * record.nbytes


def _calls_text(records: Sequence[Any]) -> str:
    counts: dict[tuple[str, Any], list[int]] = {}
    for r in records:
        counts.setdefault((r.op, r.group_ranks), []).append(r.nbytes)
    parts = []
    for (op, group), sizes in counts.items():
        times = f"{len(sizes)} x " if len(sizes) > 1 else ""
        where = "the world" if group is None else f"group {ranks_text(group)}"
        parts.append(f"{times}{op} of {sum(sizes)} bytes on {where}")
    return ", ".join(parts) or "no collective"


def communication_problem(
    records: Sequence[Any],
    group: tuple[int, ...],
    world_size: int,
    budget: float,
    kind: str,
) -> str | None:
    """What is wrong with the calls a function made (CommCounter records) on ``group`` when it
    should move ``budget`` bytes per rank, like ``kind`` ("a reduce-scatter", "an all-gather",
    ...); None when every call ran on the group and moved no more than that."""
    world = tuple(range(world_size))
    outside = [r for r in records if (r.group_ranks or world) != group]
    if outside:
        call = outside[0]
        where = (
            f"the world group (all {world_size} ranks: no group= given)"
            if call.group_ranks is None
            else f"group {ranks_text(call.group_ranks)}"
        )
        return (
            f"it called {call.op} on {where}; the group handed in is ranks {ranks_text(group)}: "
            "every collective runs on the group the function receives"
        )
    moved = sum(traffic(r, world_size) for r in records)
    if moved <= budget * 1.01 + 1:
        return None
    ratio = moved / budget if budget else math.inf
    times = "twice" if abs(ratio - 2) < 0.05 else f"{ratio:.3g} times"
    ops = {r.op for r in records}
    if "all_reduce" in ops and kind == "a reduce-scatter":
        why = (
            "a reduce-scatter done as an all-reduce: the same values, "
            f"{times} the bytes (an all-reduce delivers the whole sum to every rank, "
            "2(n-1)/n of the tensor per rank on a ring; a reduce-scatter only each rank's share, "
            "(n-1)/n): use the reduce-scatter collective"
        )
    elif "all_reduce" in ops and kind == "an all-gather":
        why = (
            f"an all-gather done as an all-reduce: the same values, {times} the bytes (an "
            "all-gather sends every rank's share once, (n-1)/n of the whole per rank)"
        )
    else:
        why = f"{times} the bytes {kind} moves ({budget:.0f} per rank)"
    return f"it moved {moved:.0f} bytes per rank ({_calls_text(records)}): {why}"


# ----------------------------------------------------------------------------- sequence collectives


def _cat(parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    return torch.cat(list(parts), dim=dim)


def _total(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack(list(parts)).sum(dim=0)


def _share(x: torch.Tensor, rank: int, n: int, dim: int = 1) -> torch.Tensor:
    return x.chunk(n, dim=dim)[rank]


def _first_fit(got: Any, candidates: Sequence[tuple[str, Any, str]]) -> list[Mistake]:
    return [Mistake(key, says) for key, value, says in candidates if same(got, value)]


def all_gather_problem(
    got: Any,
    shares: Sequence[torch.Tensor],
    world_shares: Sequence[torch.Tensor],
) -> str | None:
    """``all_gather_sequence`` of the group's ``shares`` (group order) on one rank; the world's
    shares in rank order tell a forgotten ``group=``."""
    want = _cat(shares, 1)
    if same(got, want):
        return None
    n, world = len(shares), len(world_shares)
    candidates = [
        ("batch", _cat(shares, 0),
         "the shares were stacked along dimension 0 (the batch): the sequence is dimension 1"),
        ("world", _cat(world_shares, 1),
         f"the shares of all {world} ranks of the world, not of the {n} of the group handed in: "
         "a collective without group= runs on the world"),
        ("reversed", _cat(list(reversed(shares)), 1),
         "the shares in reverse group-rank order: group rank 0's share comes first"),
    ]  # fmt: skip
    fits = _first_fit(got, candidates)
    if fits:
        return verdict(fits)
    return (
        f"{difference(got, want, seq_dim=1)} from the group's {n} shares side by side along "
        "dimension 1 (group-rank order); no known mistake gives this"
    )


def reduce_scatter_problem(
    got: Any,
    wholes: Sequence[torch.Tensor],
    world_wholes: Sequence[torch.Tensor],
    group_rank: int,
    world_rank: int,
) -> str | None:
    """``reduce_scatter_sequence`` of the group's ``wholes`` (group order) on group rank
    ``group_rank``; the world's inputs tell a forgotten ``group=``."""
    n, world = len(wholes), len(world_wholes)
    summed = _total(wholes)
    want = _share(summed, group_rank, n)
    if same(got, want):
        return None
    world_sum = _total(world_wholes)
    candidates = [
        ("not transposed back", want.transpose(0, 1),
         "the right share, with the sequence left in dimension 0: after reduce-scattering the "
         "sequence-first copy, transpose dimensions 0 and 1 back"),
        ("batch", _share(summed, group_rank, n, dim=0),
         "the sum cut along dimension 0 (the batch): torch's reduce-scatter cuts the first "
         "dimension, and the sequence is dimension 1: bring it to the front first"),
        ("whole sum", summed,
         "the whole sum over the group (an all-reduce): keep only this rank's share of the "
         "tokens"),
        ("own input", _share(wholes[group_rank], group_rank, n),
         "this rank's share of its own input: the shares must be SUMMED over the group"),
        ("mean", want / n,
         f"the mean over the group ({n} times too small): a reduce-scatter sums"),
        ("world sum", _share(world_sum, group_rank, n),
         f"this rank's share of the sum over all {world} ranks of the world, not over the "
         f"{n} of the group handed in: a collective without group= runs on the world"),
    ]  # fmt: skip
    if world_sum.shape[1] % world == 0:
        candidates.append(
            ("world sum, world share", _share(world_sum, world_rank, world),
             f"a 1/{world} share of the sum over the whole world: the group handed in has {n} "
             "ranks; size the shares and run the collective on it")
        )  # fmt: skip
    candidates += [
        (f"share {q}", _share(summed, q, n),
         f"the share of group rank {q}: rank r of the group keeps tokens [r·L/n, (r+1)·L/n)")
        for q in range(n) if q != group_rank
    ]  # fmt: skip
    fits = _first_fit(got, candidates)
    if fits:
        return verdict(fits)
    return (
        f"{difference(got, want, seq_dim=1)} from this rank's contiguous share of the sequence "
        "(dimension 1) of the group's sum; no known mistake gives this"
    )


# ----------------------------------------------------------------------------- regions


@dataclass(frozen=True)
class RegionCase:
    """One rank's call of ``enter_tensor_parallel`` or ``leave_tensor_parallel``: the group's
    inputs and the weights of the loss sum(out * weight) each rank backpropagated (group order),
    the world's (rank order), and this rank's place."""

    which: str  # "enter" or "leave"
    sp: bool
    group_rank: int
    inputs: Sequence[torch.Tensor]
    weights: Sequence[torch.Tensor]
    world_inputs: Sequence[torch.Tensor]
    world_weights: Sequence[torch.Tensor]

    @property
    def n(self) -> int:
        return len(self.inputs)

    def want(self) -> tuple[torch.Tensor, torch.Tensor]:
        t, n, xs, ws = self.group_rank, self.n, self.inputs, self.weights
        if self.which == "enter" and self.sp:
            return _cat(xs, 1), _share(_total(ws), t, n)
        if self.which == "enter":
            return xs[t], _total(ws)
        if self.sp:
            return _share(_total(xs), t, n), _cat(ws, 1)
        return _total(xs), ws[t]


def region_problem(case: RegionCase, out: Any, grad: Any) -> str | None:
    """What is wrong with one region call's output and the gradient that reached its input."""
    want_out, want_grad = case.want()
    t, n, xs, ws = case.group_rank, case.n, case.inputs, case.weights
    world = len(case.world_inputs)
    if not same(out, want_out):
        if case.which == "enter" and case.sp:
            candidates = [
                ("identity", xs[t],
                 "x came back as it was (2.6's f is the identity): with sequence parallelism x "
                 "holds only this rank's share of the tokens, and a column-parallel layer needs "
                 "all of them, gathered from the group"),
                ("world", _cat(case.world_inputs, 1),
                 f"gathered from all {world} ranks of the world, not from the group handed in"),
            ]  # fmt: skip
        elif case.which == "enter":
            candidates = [
                ("gathered", _cat(xs, 1),
                 "gathered the group's tensors along the sequence though sequence_parallel=False: "
                 "x is whole on every rank already (2.6's f: the identity in forward)"),
                ("summed", _total(xs),
                 "summed x over the group in forward: 2.6's f is the identity in forward (its "
                 "backward sums)"),
            ]  # fmt: skip
        elif case.sp:
            candidates = [
                ("whole sum", _total(xs),
                 "the whole sum over the group (2.6's g): with sequence parallelism the region "
                 "after holds only this rank's share of the tokens (a reduce-scatter)"),
                ("own share", _share(xs[t], t, n),
                 "this rank's share of its own partial sums: they must be summed over the group"),
                ("world", _share(_total(case.world_inputs), t, n),
                 f"reduce-scattered over all {world} ranks of the world, not over the group handed in"),
            ]  # fmt: skip
        else:
            candidates = [
                ("identity", xs[t],
                 "y came back as it was: the row-parallel partial sums must be summed over the "
                 "group (2.6's g)"),
                ("share", _share(_total(xs), t, n),
                 "only this rank's share of the tokens, though sequence_parallel=False: without "
                 "it the result is whole on every rank"),
                ("world", _total(case.world_inputs),
                 f"all-reduced over all {world} ranks of the world, not over the group handed in"),
            ]  # fmt: skip
        fits = _first_fit(out, candidates)
        if fits:
            return verdict(fits)
        return (
            f"its output: {difference(out, want_out, seq_dim=1)} from "
            f"{_region_want_text(case)}; no known mistake gives this"
        )
    if grad is None:
        return (
            "no gradient reached its input: the collective must run inside an autograd Function "
            "(the two above), whose backward is the other collective"
        )
    if same(grad, want_grad):
        return None
    if case.which == "enter" and case.sp:
        candidates = [
            ("own part", _share(ws[t], t, n),
             "the gradient that reached x is only this rank's own part: every rank's whole "
             "output used this rank's share, so its backward sums every rank's (a reduce-scatter)"),
            ("world", _share(_total(case.world_weights), t, n),
             f"the gradient was reduce-scattered over all {world} ranks of the world, not over the group"),
        ]  # fmt: skip
    elif case.which == "enter":
        candidates = [
            ("own part", ws[t],
             "the gradient that reached x is only this rank's own part: 2.6's f all-reduces the "
             "gradient in backward (each rank's weight slice used all of x)"),
            ("world", _total(case.world_weights),
             f"the gradient was all-reduced over all {world} ranks of the world, not over the group"),
        ]  # fmt: skip
    elif case.sp:
        own_only = torch.zeros_like(want_grad)
        own_only[:, t * ws[t].shape[1] : (t + 1) * ws[t].shape[1]] = ws[t]
        candidates = [
            ("own share", own_only,
             "its partial received the gradient of its own share of the tokens only (zeros "
             "elsewhere), as slicing a sum gives: every rank's partial fed every share, so its "
             "backward gathers the whole sequence's gradient (an all-gather)"),
        ]  # fmt: skip
    else:
        candidates = [
            ("summed", _total(ws),
             "the gradient was summed over the group in backward too: 2.6's g's backward is the "
             "identity (the replicated sum's gradient is the same on every rank)"),
        ]  # fmt: skip
    fits = _first_fit(grad, candidates)
    if fits:
        return "backward: " + verdict(fits)
    return (
        f"backward: the gradient that reached its input: {difference(grad, want_grad, seq_dim=1)} "
        f"from {_region_grad_text(case)}; no known mistake gives this"
    )


def _region_want_text(case: RegionCase) -> str:
    if case.which == "enter":
        return "the whole sequence gathered from the group's shares" if case.sp else "x itself (f)"
    return (
        "this rank's share of the tokens of the group's sum" if case.sp
        else "the sum over the group (g)"
    )  # fmt: skip


def _region_grad_text(case: RegionCase) -> str:
    if case.which == "enter":
        return "the sum over the group of every rank's contribution" + (
            ", this rank's share of the tokens" if case.sp else ""
        )
    return (
        "the gradient of the whole sequence, gathered from every rank's share" if case.sp
        else "this rank's own output gradient (g's backward is the identity)"
    )  # fmt: skip


# ----------------------------------------------------------------------------- count_valid_tokens

_COUNT_WHY = {
    "own": (
        "its own count: the loss divides by the count of the whole global batch, so sum the "
        "counts of the ranks that hold other targets"
    ),
    "dp": "the sum over dp only: the cp ranks hold the other positions of the same sequences",
    "cp": "the sum over cp only: the dp ranks hold other sequences",
    "tp": (
        "the sum over tp: the tp ranks hold the same targets (counted tp times), and the ranks "
        "holding other targets were left out"
    ),
    "world": (
        "the sum over every rank of the world: the tp ranks of a position hold the same targets "
        "and were counted tp times (a collective without group= runs on the world; so does a "
        "sum over dp x cp followed by one over tp)"
    ),
}


def count_problem(
    results: Mapping[str, Sequence[tuple[Any, int]]], grids: Mapping[str, RankGrid]
) -> tuple[str, int, int, str] | None:
    """``count_valid_tokens`` in several layouts: ``results[label][rank]`` is (what the rank
    returned, its own count); ``grids[label]`` the layout. Returns (label, rank, the right
    count, what is wrong) for the first wrong rank, None when every rank of every layout
    returned the global count. A mistake is named only if it explains every layout."""

    def summed(label: str, rank: int, name: str) -> int:
        grid, own = grids[label], [r[1] for r in results[label]]
        if name == "own":
            return own[rank]
        ranks = range(grid.world_size) if name == "world" else grid.group_of(name, rank)
        return sum(own[q] for q in ranks)

    first = None
    for label, per_rank in results.items():
        for rank, (got, _) in enumerate(per_rank):
            want = summed(label, rank, "dp_cp")
            if isinstance(got, bool) or not isinstance(got, int):
                return (
                    label,
                    rank,
                    want,
                    f"returned {got!r} ({type(got).__name__}); expected an int",
                )
            if got != want and first is None:
                first = (label, rank, want)
    if first is None:
        return None
    fits = [
        Mistake(name, _COUNT_WHY[name])
        for name in ("own", "dp", "cp", "tp", "world")
        if all(
            got == summed(label, rank, name)
            for label, per_rank in results.items()
            for rank, (got, _) in enumerate(per_rank)
        )
    ]
    if fits:
        return (*first, verdict(fits))
    label, rank, want = first
    got, own = results[label][rank]
    for name in ("dp_cp", "dp", "cp", "tp", "world"):  # an average where a sum belongs

        def size(lab: str, name: str = name) -> int:
            grid = grids[lab]
            return grid.world_size if name == "world" else len(grid.group_of(name, 0))

        if all(size(lab) > 1 for lab in results) and all(
            g in (summed(lab, r, "dp_cp") // size(lab), round(summed(lab, r, "dp_cp") / size(lab)))
            for lab, per in results.items()
            for r, (g, _) in enumerate(per)
        ):
            sizes = ", ".join(f"{size(lab)} on {lab}" for lab in results)
            return (
                label,
                rank,
                want,
                f"every rank of every layout returned the global count divided by the {name} "
                f"size ({sizes}): a mean over the ranks where their sum is the count",
            )
    sums = {name: summed(label, rank, name) for name in ("dp", "cp", "tp", "world")}
    nearest = ", ".join(f"over {n}: {v}" for n, v in sums.items() if v != want)
    wrong = [f"{lab}: ranks {ranks_text(r for r, (g, _) in enumerate(per) if g != summed(lab, r, 'dp_cp'))}"
             for lab, per in results.items()
             if any(g != summed(lab, r, "dp_cp") for r, (g, _) in enumerate(per))]  # fmt: skip
    return (
        label,
        rank,
        want,
        f"{got / want:.4g}x the global count, {got - want:+d} targets (the rank holds {own}; "
        f"the sums {nearest}): neither the rank's number nor a sum over one group; wrong on "
        + "; ".join(wrong),
    )


# ----------------------------------------------------------------------------- loss_share


@dataclass(frozen=True)
class LossCase:
    """One loss_share check: the layout's label and sizes (group name -> size), the sum of the
    cross-entropy over this rank's valid targets, its valid and all targets, the global count."""

    label: str
    summed: float
    local_valid: int
    local_targets: int
    global_valid: int
    sizes: Mapping[str, int]

    @property
    def want(self) -> float:
        return self.summed * self.sizes["dp_cp"] / self.global_valid


LOSS_SCALES = ("world", "dp", "cp", "tp")  # the sizes a share can be scaled by instead of dp x cp


def loss_ways(case: LossCase) -> list[tuple[str, float, str]]:
    """(key, value, what to say) of every realistic mistake of loss_share in ``case``."""
    dp_cp, summed = case.sizes["dp_cp"], case.summed
    mean = summed / case.local_valid
    out = [
        ("local mean", mean,
         "the mean over this rank's own valid targets: with uneven counts a mean of the ranks' "
         "means is not the mean over the batch; divide the sum by the GLOBAL count"),
        ("local mean x dp_cp", mean * dp_cp,
         "a local mean times dp x cp: still a mean of per-rank means; divide the sum by the "
         "GLOBAL count"),
        ("unscaled", summed / case.global_valid,
         f"the share of the global mean, not scaled for the average over dp x cp = {dp_cp} "
         f"ranks that its gradients go through: they would be {dp_cp}x too small"),
        ("all targets", summed / case.local_targets,
         f"divided by this rank's {case.local_targets} targets, masked ones counted: divide by "
         "the GLOBAL count of valid targets"),
        ("all targets x dp_cp", summed / case.local_targets * dp_cp,
         f"divided by this rank's {case.local_targets} targets (masked ones counted) and scaled "
         "by dp x cp: divide by the GLOBAL count of valid targets"),
    ]  # fmt: skip
    for name in LOSS_SCALES:
        k = case.sizes[name]
        size_name = "the world size" if name == "world" else f"the {name} size"
        out.append(
            (f"scaled by {name}", summed * k / case.global_valid,
             f"scaled by {size_name} instead of dp x cp ({k} for {dp_cp}), the ranks its "
             "gradients are averaged over")
        )  # fmt: skip
    return out


def loss_problem(values: Sequence[float], cases: Sequence[LossCase]) -> tuple[int, str] | None:
    """(the first wrong case's index, what is wrong there) for loss_share's values in every case
    (``values[i]`` in ``cases[i]``); None when all are right. A mistake is named only when it
    gives every case's value, the right ones too."""
    wrong = [i for i, (v, c) in enumerate(zip(values, cases, strict=True))
             if not close_number(v, c.want)]  # fmt: skip
    if not wrong:
        return None
    first = wrong[0]
    ways = [loss_ways(c) for c in cases]
    fits = [
        Mistake(key, says)
        for n, (key, _, says) in enumerate(ways[first])
        if all(close_number(values[i], ways[i][n][1]) for i in range(len(cases)))
    ]
    if fits:
        return first, verdict(fits)
    case, value = cases[first], values[first]
    ratio = value / case.want if case.want else math.inf
    if abs(ratio - 1) < 1e-3:
        off = f"off by {value - case.want:.3g} (a relative {ratio - 1:.2e})"
    else:
        off = f"{ratio:.6g} times the expected value"
    right = [c.label for i, c in enumerate(cases) if i not in wrong]
    others = [cases[i].label for i in wrong[1:]]
    where = (f"; right on {', '.join(right)}" if right else "") + (
        f"; wrong on {', '.join(others)} too" if others else ""
    )
    factors = [
        f"{'times' if power == 1 else 'divided by'} the {name} size "
        f"({', '.join(str(c.sizes[name]) for c in cases)} in these cases)"
        for name in ("dp", "cp", "tp", "dp_cp", "world")
        for power in (1, -1)
        if all(close_number(v, c.want * c.sizes[name] ** power)
               for v, c in zip(values, cases, strict=True))
    ]  # fmt: skip
    if factors:
        return first, (
            f"{off}{where}: no known mistake gives every case, but in every case the value is "
            "the right one " + " or ".join(factors)
        )
    sizes = ", ".join(f"{n} {case.sizes[n]}" for n in ("dp", "cp", "tp", "dp_cp", "world"))
    return first, (
        f"{off}{where}: no known mistake gives every case, nor does one size of the layout "
        f"({sizes}) or its inverse times the right value"
    )


# ----------------------------------------------------------------------------- balance_loss_share


@dataclass(frozen=True)
class BalanceLayout:
    """One balance_loss_share check: degrees, sequence parallelism, and the sizes of the batch."""

    label: str
    dp: int
    cp: int
    tp: int
    sp: bool

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp, cp, tp) of a rank, tp fastest (course.topology's order)."""
        return (rank // (self.cp * self.tp)) % self.dp, (rank // self.tp) % self.cp, rank % self.tp

    def ranks(self, keep: Callable[[tuple[int, int, int], tuple[int, int, int]], bool],
              rank: int) -> list[int]:  # fmt: skip
        me = self.coords(rank)
        return [q for q in range(self.world) if keep(self.coords(q), me)]

    def holders(self, rank: int) -> list[int]:
        """The ranks holding this rank's sequences' other tokens: cp, and tp under sp."""
        return self.ranks(lambda q, m: q[0] == m[0] and (self.sp or q[2] == m[2]), rank)

    def summed_ranks(self, rank: int) -> list[int]:
        """The ranks whose shares the runtime adds: dp x cp, and tp under sp."""
        return [
            q for q in range(self.world) if self.sp or self.coords(q)[2] == self.coords(rank)[2]
        ]


def local_slice(x: torch.Tensor, dp_rank: int, dp: int, cp_rank: int, cp: int) -> torch.Tensor:
    """A rank's rows (dp) and zig-zag positions (cp) of a [batch, seq, ...] tensor."""
    rows = x.shape[0] // dp
    mine = x[dp_rank * rows : (dp_rank + 1) * rows]
    return mine[:, zigzag_positions(x.shape[1], cp_rank, cp)]


def balance_inputs(
    layout: BalanceLayout, probs: torch.Tensor, experts: torch.Tensor, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The probabilities and choices of one rank's tokens (its cp shard, its tp share under sp)."""
    d, c, t = layout.coords(rank)
    p = local_slice(probs, d, layout.dp, c, layout.cp)
    e = local_slice(experts, d, layout.dp, c, layout.cp)
    if layout.sp:
        p, e = _share(p, t, layout.tp), _share(e, t, layout.tp)
    return p, e


@dataclass(frozen=True)
class BalanceWay:
    """A way to compute balance_loss_share: the right one, or one realistic mistake."""

    key: str
    says: str
    counts_over: str = "holders"  # whose choices f counts: holders, own, cp, cp_tp, dp_cp, world
    f_tokens: str = "seq"  # f's denominator: seq (k·seq_len) or local (k·this rank's tokens)
    p_tokens: str = "seq"  # P's denominator: seq or local
    whole_p: bool = False  # P summed over the holders too (each adds the whole sequence's loss)
    sequences: str = "global"  # divided by the global batch's sequences, or this rank's
    scale: str = "dp_cp"  # multiplied by: dp_cp, 1, world, dp, cp or tp
    off: tuple[tuple[str, int], ...] = ()  # further factors: ("k", 1) times k, ("E", -1) over E


BALANCE_RIGHT = BalanceWay("right", "")
BALANCE_MISTAKES = (
    BalanceWay("whole sequence on each",
               "every rank holding tokens of a sequence added that whole sequence's loss (P "
               "summed over those ranks too): sum the COUNTS over them, but let each add only "
               "its own tokens' part of P", whole_p=True),
    BalanceWay("own counts",
               "f came from this rank's own choices: f needs the choices of the whole sequence, "
               "summed over the ranks that hold its other tokens", counts_over="own"),
    BalanceWay("own fraction",
               "f is this rank's own fraction of choices (its counts over its own k·t choices): "
               "f needs the whole sequence's choices over k·seq_len", counts_over="own",
               f_tokens="local"),
    BalanceWay("P over local tokens",
               "P-part divided by this rank's token count instead of seq_len: P is a mean over "
               "the whole sequence's tokens, to which each rank adds its own tokens' part",
               p_tokens="local"),
    BalanceWay("counts over cp only",
               "the counts were summed over cp but not over tp: under sequence parallelism the "
               "tp ranks hold other tokens of the sequence too", counts_over="cp"),
    BalanceWay("counts over tp too",
               "the counts were summed over tp as well: without sequence parallelism the tp "
               "ranks hold the same tokens, so every choice was counted tp times",
               counts_over="cp_tp"),
    BalanceWay("counts over dp x cp",
               "the counts were summed over dp x cp: the dp ranks hold other sequences, whose "
               "choices are not this sequence's", counts_over="dp_cp"),
    BalanceWay("counts over the world",
               "the counts were summed over the whole world: only the ranks holding this "
               "sequence's other tokens count its choices", counts_over="world"),
    BalanceWay("unscaled",
               "the shares were not scaled by dp x cp for the gradient average (as loss_share is)",
               scale="1"),
    BalanceWay("scaled by the world",
               "the shares were scaled by the world size instead of dp x cp (the ranks the "
               "gradients are averaged over)", scale="world"),
    BalanceWay("local sequences",
               "divided by this rank's number of sequences instead of the global batch's",
               sequences="local"),
    BalanceWay("f without k",
               "f was divided by seq_len only: each token makes k choices, so a sequence's "
               "counts add up to k·seq_len", off=(("k", 1),)),
    BalanceWay("without E",
               "not multiplied by the number of experts E (E · sum_e f[e]·P[e] is 1 when the "
               "routing is uniform)", off=(("E", -1),)),
)  # fmt: skip

BALANCE_SIZES = ("k", "E", "dp", "cp", "tp", "dp_cp", "world")  # what a share can be off by


def balance_size(name: str, layout: BalanceLayout, k: int, num_experts: int) -> int:
    """The size a factor name stands for in ``layout`` (top-k ``k`` of ``num_experts``)."""
    return {"k": k, "E": num_experts, "dp": layout.dp, "cp": layout.cp, "tp": layout.tp,
            "dp_cp": layout.dp * layout.cp, "world": layout.world, "1": 1}[name]  # fmt: skip


_BALANCE_WAYS: dict[tuple[Any, ...], tuple[Any, Any, tuple[list[float], list[torch.Tensor]]]] = {}


def balance_way(
    way: BalanceWay,
    layout: BalanceLayout,
    probs: torch.Tensor,
    experts: torch.Tensor,
    num_experts: int,
    global_sequences: int,
) -> tuple[list[float], list[torch.Tensor]]:
    """Every rank's share and its gradient with respect to its probabilities, computed ``way``
    (the collectives simulated by sums over the ranks they would run on). Remembered for the
    same tensors (the graders and the mistake tables ask again and again)."""
    key = (way, layout, id(probs), id(experts), num_experts, global_sequences)
    seen = _BALANCE_WAYS.get(key)
    if seen is not None and seen[0] is probs and seen[1] is experts:
        values, grads = seen[2]
        return list(values), list(grads)
    result = _balance_way(way, layout, probs, experts, num_experts, global_sequences)
    if len(_BALANCE_WAYS) > 4096:
        _BALANCE_WAYS.clear()
    _BALANCE_WAYS[key] = (probs, experts, result)
    return list(result[0]), list(result[1])


def _balance_way(
    way: BalanceWay,
    layout: BalanceLayout,
    probs: torch.Tensor,
    experts: torch.Tensor,
    num_experts: int,
    global_sequences: int,
) -> tuple[list[float], list[torch.Tensor]]:
    seq, k = probs.shape[1], experts.shape[-1]
    inputs = [balance_inputs(layout, probs, experts, r) for r in range(layout.world)]
    counts = [
        torch.nn.functional.one_hot(e, num_experts).sum(dim=(1, 2)).double() for _, e in inputs
    ]
    parts = [p.sum(dim=1) for p, _ in inputs]  # [b, E]: each rank's sum of its probabilities

    def over(rank: int, which: str) -> list[int]:
        if which == "holders":
            return layout.holders(rank)
        if which == "own":
            return [rank]
        keep = {
            "cp": lambda q, m: q[0] == m[0] and q[2] == m[2],
            "dp": lambda q, m: q[1] == m[1] and q[2] == m[2],
            "tp": lambda q, m: q[0] == m[0] and q[1] == m[1],
            "cp_tp": lambda q, m: q[0] == m[0],
            "dp_cp": lambda q, m: q[2] == m[2],
            "world": lambda q, m: True,
        }[which]
        return layout.ranks(keep, rank)

    values, grads = [], []
    for rank, (p, _) in enumerate(inputs):
        b, t = p.shape[0], p.shape[1]
        chosen = torch.stack([counts[q] for q in over(rank, way.counts_over)]).sum(dim=0)
        f = chosen / (k * (seq if way.f_tokens == "seq" else t))
        p_den = seq if way.p_tokens == "seq" else t
        holders = layout.holders(rank) if way.whole_p else [rank]
        mine = torch.stack([parts[q] for q in holders]).sum(dim=0)
        scale = balance_size(way.scale, layout, k, num_experts)
        for name, power in way.off:
            scale *= balance_size(name, layout, k, num_experts) ** power
        sequences = global_sequences if way.sequences == "global" else b
        factor = num_experts * scale / sequences / p_den
        values.append(float((f * mine).sum() * factor))
        grads.append((f * factor)[:, None, :].expand(b, t, num_experts).clone())
    return values, grads


@dataclass(frozen=True)
class BalanceMeasured:
    """What every rank of one layout returned: its share, the gradient with respect to its
    probabilities, and the names of the groups its collectives ran on (``"world"`` for no
    ``group=``; None when not recorded)."""

    shares: Sequence[float]
    grads: Sequence[Any]
    groups: Sequence[frozenset[str]] | None = None


_COUNTS_GROUPS = {  # the groups each way's collectives run on
    "holders": ("cp", "tp_if_sp"),
    "own": (),
    "cp": ("cp",),
    "dp": ("dp",),
    "tp": ("tp",),
    "cp_tp": ("cp", "tp"),
    "dp_cp": ("dp_cp",),
    "world": ("world",),
}


def _reach(layout: BalanceLayout, rank: int, groups: Iterable[str]) -> frozenset[int]:
    """The ranks whose numbers reach ``rank`` through collectives on ``groups`` in turn."""
    keep = {
        "cp": lambda q, m: q[0] == m[0] and q[2] == m[2],
        "tp": lambda q, m: q[0] == m[0] and q[1] == m[1],
        "dp": lambda q, m: q[1] == m[1] and q[2] == m[2],
        "dp_cp": lambda q, m: q[2] == m[2],
        "world": lambda q, m: True,
    }
    members = {rank}
    for name in groups:
        if name == "tp_if_sp":
            if not layout.sp:
                continue
            name = "tp"
        if name in keep:
            members = {q for m in members for q in layout.ranks(keep[name], m)}
    return frozenset(members)


def _balance_matches(
    way: BalanceWay, layout: BalanceLayout, measured: BalanceMeasured, args: tuple[Any, ...]
) -> tuple[bool, bool, bool]:
    """(values, gradients, communication) of ``way`` in ``layout`` agree with the measurement."""
    values, grads = balance_way(way, layout, *args)
    v = all(close_number(a, b) or abs(a - b) < 1e-14
            for a, b in zip(measured.shares, values, strict=True))  # fmt: skip
    g = all(same(a, b) for a, b in zip(measured.grads, grads, strict=True))
    c = True
    if measured.groups is not None:
        for rank, names in enumerate(measured.groups):
            if ("world" in names) != (way.counts_over == "world"):
                c = False
            want = _reach(layout, rank, _COUNTS_GROUPS[way.counts_over])
            if _reach(layout, rank, names) != want:
                c = False
    return v, g, c


def balance_problem(
    layouts: Sequence[BalanceLayout],
    measured: Mapping[str, BalanceMeasured],
    probs: torch.Tensor,
    experts: torch.Tensor,
    num_experts: int,
    global_sequences: int,
    want_total: float,
) -> tuple[str, str] | None:
    """(the first wrong layout's label, what is wrong there) for balance_loss_share run in
    every layout of ``layouts`` (``measured[label]``); None when every share and gradient is one
    process's part. A mistake is named only if it explains every layout, the right ones too."""
    args = (probs, experts, num_experts, global_sequences)
    wrong = []
    for layout in layouts:
        v, g, _ = _balance_matches(BALANCE_RIGHT, layout, measured[layout.label], args)
        if not (v and g):
            wrong.append((layout, v))
    if not wrong:
        return None
    layout, value_ok = wrong[0]
    mine = measured[layout.label]
    dp_cp = layout.dp * layout.cp
    total = sum(mine.shares[q] for q in layout.summed_ranks(0)) / dp_cp
    ratio = total / want_total if want_total else math.nan
    if value_ok:
        said = (
            "the shares are right, but the gradient with respect to the probabilities is not "
            "one process's (times dp x cp)"
        )
    else:
        said = (
            f"the shares, summed over the ranks holding other tokens and divided by dp x cp, "
            f"give {total:.10g}; one process's balance loss is {want_total:.10g} ({ratio:.4g}x)"
        )
    full, here = [], []
    for way in BALANCE_MISTAKES:
        everywhere = [_balance_matches(way, lay, measured[lay.label], args) for lay in layouts]
        if all(all(m) for m in everywhere):
            full.append(Mistake(way.key, way.says))
        elif all(_balance_matches(way, layout, mine, args)[:2]):
            here.append(Mistake(way.key, way.says))
    if full:
        return layout.label, f"{said}: {verdict(full)}"
    if value_ok:
        return layout.label, (
            f"{said}: only P (each rank's own tokens' probabilities, summed over them and "
            "divided by seq_len) carries a gradient; the counts f carry none"
        )
    measured_words = _balance_differences(layouts, measured, args)
    factor = _balance_factor(layouts, measured, args)
    if factor:  # the evidence of every layout: one size off everywhere
        return layout.label, (
            f"{said}; {measured_words}: no known mistake gives these numbers in every layout, "
            f"but {factor}"
        )
    if here:
        keys = ", ".join(f"'{m.key}'" for m in here)
        return layout.label, (
            f"{said}; {measured_words}; in this layout alone it fits what {keys} would give, "
            "but not the other layouts' results: perhaps two mistakes at once"
        )
    return layout.label, (
        f"{said}; {measured_words}: no single known mistake gives these numbers in every layout"
    )


def _balance_factor(
    layouts: Sequence[BalanceLayout],
    measured: Mapping[str, BalanceMeasured],
    args: tuple[Any, ...],
) -> str | None:
    """The size (k, E, dp, cp, tp, dp x cp, the world) that every share and gradient is off by
    in every layout, when one is: "each share ... divided by k (3 here)"."""
    _, experts, num_experts, _ = args
    k = experts.shape[-1]
    fits = []
    for name in BALANCE_SIZES:
        for power in (1, -1):
            ok = True
            for lay in layouts:
                mine = measured[lay.label]
                want, grads = balance_way(BALANCE_RIGHT, lay, *args)
                f = balance_size(name, lay, k, num_experts) ** power
                ok = (
                    ok
                    and all(close_number(a, b * f) for a, b in zip(mine.shares, want, strict=True))
                    and all(same(a, b * f) for a, b in zip(mine.grads, grads, strict=True))
                )
            if ok:
                sizes = sorted({balance_size(name, lay, k, num_experts) for lay in layouts})
                fits.append(f"{'times' if power == 1 else 'divided by'} {name} "
                            f"({', '.join(map(str, sizes))} in these layouts)")  # fmt: skip
    if not fits:
        return None
    return "in every layout each share and its gradient are the right ones " + " or ".join(fits)


def _balance_differences(
    layouts: Sequence[BalanceLayout],
    measured: Mapping[str, BalanceMeasured],
    args: tuple[Any, ...],
) -> str:
    """What differs, in numbers: each wrong layout's shares rank by rank as multiples of the
    right ones, and the layouts that are right."""
    parts, right_ones = [], []
    for lay in layouts:
        mine = measured[lay.label]
        want, grads = balance_way(BALANCE_RIGHT, lay, *args)
        ok_values = all(close_number(a, b) or abs(a - b) < 1e-14
                        for a, b in zip(mine.shares, want, strict=True))  # fmt: skip
        ok_grads = all(same(a, b) for a, b in zip(mine.grads, grads, strict=True))
        if ok_values and ok_grads:
            right_ones.append(lay.label)
            continue
        ratios = [f"{a / b:.4g}x" if b else f"{a:.4g} (expected 0)"
                  for a, b in zip(mine.shares, want, strict=True)]  # fmt: skip
        text = f"on {lay.label} the ranks' shares are {', '.join(ratios)} their right ones"
        if ok_values:
            text = f"on {lay.label} the shares are right but not their gradients"
        elif not ok_grads:
            text += " (the gradients off too)"
        parts.append(text)
    if right_ones:
        parts.append(f"right on {', '.join(right_ones)}")
    return "; ".join(parts)


# ----------------------------------------------------------------------------- finish_gradients

GROUP_WORDS = {
    "tp": "tp",
    "dp": "dp",
    "cp": "cp",
    "dp_cp": "dp x cp",
    "edp": "edp",
    "ep": "ep",
    "embedding": "the embedding group",
    "pp": "pp",
    "world": "the whole world",
}


@dataclass(frozen=True)
class HeldKind:
    """What a held gradient is (HeldGradient's flags) and what its name is."""

    name: str
    tp_replicated: bool = False
    tied: bool = False
    expert: bool = False
    reduced: bool = False

    @property
    def is_embedding_or_head(self) -> bool:
        return self.name in ("embedding.weight", "head.weight")


@dataclass(frozen=True)
class Recipe:
    """A way to finish one gradient: summed over the product of some groups, then divided by
    the size of one group (``None``: not divided)."""

    sums: frozenset[str]
    divisor: str | None
    unchanged: bool = False  # not touched at all (the reductions went elsewhere)

    def text(self, grid: RankGrid, rank: int) -> str:
        if self.unchanged or not self.sums:
            base = "this rank's own gradient"
        else:
            names = " and ".join(GROUP_WORDS[s] for s in sorted(self.sums, key=_ORDER.index))
            base = f"the sum over {names} {ranks_text(recipe_ranks(self, grid, rank))}"
        if self.divisor is None:
            return base
        return f"{base} divided by {group_size(grid, self.divisor, rank)} (the {GROUP_WORDS[self.divisor]} size)"


_ORDER = ["tp", "embedding", "dp", "cp", "dp_cp", "ep", "edp", "pp", "world"]
_NAMING = ["tp", "embedding", "dp_cp", "edp", "dp", "cp", "ep", "world"]  # a set's first names


@functools.cache
def group_ranks(grid: RankGrid, name: str, rank: int) -> tuple[int, ...]:
    if name == "world":
        return tuple(range(grid.world_size))
    return grid.group_of(name, rank)


def group_size(grid: RankGrid, name: str, rank: int) -> int:
    return len(group_ranks(grid, name, rank))


def recipe_ranks(recipe: Recipe, grid: RankGrid, rank: int) -> tuple[int, ...]:
    """The ranks whose gradients the recipe adds up on ``rank``: the product of its groups."""
    members = {rank}
    for name in recipe.sums:
        members = {q for m in members for q in group_ranks(grid, name, m)}
    return tuple(sorted(members))


def recipe_coefficients(recipe: Recipe, grid: RankGrid, rank: int) -> list[float]:
    """Rank ``rank``'s result as weights of every rank's input gradient. Each sum is applied in
    turn to every rank's running result (as the all-reduces run), so a sum over a group that
    contains an earlier one (the world after tp) counts those parts again, as it does."""
    return list(_recipe_coefficients(recipe, grid, rank))


@functools.cache
def _recipe_coefficients(recipe: Recipe, grid: RankGrid, rank: int) -> tuple[float, ...]:
    n = grid.world_size
    weights = torch.eye(n, dtype=torch.float64)  # row r: rank r's result
    for name in sorted(recipe.sums, key=_ORDER.index):
        summed = torch.zeros(n, n, dtype=torch.float64)
        for r in range(n):
            for q in group_ranks(grid, name, r):
                summed[r] += weights[q]
        weights = summed
    divisor = 1 if recipe.divisor is None else group_size(grid, recipe.divisor, rank)
    return tuple(float(c) / divisor for c in weights[rank])


def right_recipe(kind: HeldKind, sp: bool) -> Recipe:
    """What finish_gradients must do to one gradient: tp (sp, replicated), the tie, and the
    data-parallel average (dp x cp; edp for experts, divided by dp x cp; nothing for a ZeRO
    slice)."""
    sums = set()
    if sp and kind.tp_replicated:
        sums.add("tp")
    if kind.tied:
        sums.add("embedding")
    if kind.expert:
        sums.add("edp")
    elif not kind.reduced:
        sums.add("dp_cp")
    divisor = "dp_cp" if kind.expert or not kind.reduced else None
    return Recipe(frozenset(sums), divisor)


def _with(recipe: Recipe, add: Iterable[str] = (), drop: Iterable[str] = (),
          divisor: str | bool | None = False) -> Recipe:  # fmt: skip
    sums = (set(recipe.sums) - set(drop)) | set(add)
    new_divisor = recipe.divisor if divisor is False else divisor
    return Recipe(frozenset(sums), new_divisor)  # type: ignore[arg-type]


def finish_mistakes(kind: HeldKind, sp: bool, grid: RankGrid) -> list[tuple[Mistake, Recipe]]:
    """The realistic ways to finish ``kind`` wrongly, each as the recipe it amounts to."""
    return list(_finish_mistakes(kind, sp, grid))


@functools.cache
def _finish_mistakes(
    kind: HeldKind, sp: bool, grid: RankGrid
) -> tuple[tuple[Mistake, Recipe], ...]:
    right = right_recipe(kind, sp)
    dp_cp = "dp x cp"
    out: list[tuple[str, str, Recipe]] = []
    out.append(("unchanged", "left unchanged: finish_gradients works in place on "
                "HeldGradient.grad (all_reduce_flat copies the reduced values back)",
                Recipe(frozenset(), None, unchanged=True)))  # fmt: skip
    if kind.expert:
        out += [
            ("expert over dp x cp", "an expert's gradient summed over all of dp x cp: the other "
             "ranks of its ep group hold OTHER experts (whatever index they give them); its "
             "copies are its edp group", _with(right, add=["dp_cp"], drop=["edp"])),
            ("expert over ep", "an expert's gradient summed over its ep group, which holds the "
             "other experts: its copies are its edp group", _with(right, add=["ep"], drop=["edp"])),
            ("expert divided by edp", "divided by the edp group's size: an expert's gradient "
             "already holds the tokens its ep group routed to it, so the mean over every rank's "
             f"loss divides by the {dp_cp} size", _with(right, divisor="edp")),
            ("expert not summed", "an expert's gradient not summed over its edp group (the ranks "
             "holding the same expert, which saw other tokens)", _with(right, drop=["edp"])),
        ]  # fmt: skip
    elif not kind.reduced:
        out += [
            ("dp only", f"averaged over dp only: the cp ranks hold other positions of the same "
             f"sequences ({dp_cp})", _with(right, add=["dp"], drop=["dp_cp"], divisor="dp")),
            ("dp only, dp x cp divisor", f"summed over dp only (divided by the {dp_cp} size): "
             "the cp ranks hold other positions of the same sequences",
             _with(right, add=["dp"], drop=["dp_cp"])),
            ("cp only", f"averaged over cp only: the dp ranks hold other sequences ({dp_cp})",
             _with(right, add=["cp"], drop=["dp_cp"], divisor="cp")),
            ("not averaged", f"not averaged over {dp_cp} (the ranks holding the same weights and "
             "other tokens)", _with(right, drop=["dp_cp"], divisor=None)),
        ]  # fmt: skip
    else:
        out += [
            ("zero averaged again", f"averaged over {dp_cp} again: ZeRO averaged this slice "
             "during backward (HeldGradient.reduced), leave it", _with(right, add=["dp_cp"],
                                                                        divisor="dp_cp")),
            ("zero divided again", f"divided by the {dp_cp} size again: ZeRO averaged this slice "
             "during backward (HeldGradient.reduced)", _with(right, divisor="dp_cp")),
        ]  # fmt: skip
    if right.divisor is not None:
        out += [
            ("not divided", f"summed but not divided by the {dp_cp} size (the reductions of the "
             "course average)", _with(right, divisor=None)),
            ("divided by the world", f"divided by the world size instead of the {dp_cp} size",
             _with(right, divisor="world")),
        ]  # fmt: skip
    data_group = "edp" if kind.expert else "dp_cp"
    if data_group in right.sums:
        prefix = "expert " if kind.expert else ""
        out.append(
            (f"{prefix}world", f"summed over the whole world instead of {GROUP_WORDS[data_group]}: "
             "a collective without group= runs on the world",
             _with(right, add=["world"], drop=[data_group]))
        )  # fmt: skip
        out.append(
            (f"{prefix}world averaged", "averaged over the whole world instead of "
             f"{GROUP_WORDS[data_group]}: a collective without group= runs on the world",
             _with(right, add=["world"], drop=[data_group], divisor="world"))
        )  # fmt: skip
    if kind.tp_replicated and sp:
        out.append(("tp world", "summed over the whole world instead of tp: the tp sum's "
                    "collective without group= runs on the world", _with(right, add=["world"],
                                                                          drop=["tp"])))  # fmt: skip
        out.append(("tp missing", "not summed over tp: under sequence parallelism each tp rank "
                    "computed this replicated weight's gradient from its own share of the tokens",
                    _with(right, drop=["tp"])))  # fmt: skip
    if kind.tp_replicated and not sp:
        out.append(("tp extra", "summed over tp although sequence parallelism is off: every tp "
                    "rank computed it from the same tokens, so it was counted tp times",
                    _with(right, add=["tp"])))  # fmt: skip
    if not kind.tp_replicated and sp:  # the tp sum of sequence parallelism, on every gradient
        out.append(("tp on a shard", "summed over tp, though it is a tensor-parallel shard: each "
                    "tp rank holds another piece of the weight (only weights whole on every tp "
                    "rank are summed, and only under sequence parallelism)",
                    _with(right, add=["tp"])))  # fmt: skip
    if kind.tied:
        out.append(("tie missing", "the two copies of the tied embedding (first and last stage) "
                    "must both hold the sum of both uses: it was not summed over the embedding "
                    "group", _with(right, drop=["embedding"])))  # fmt: skip
    else:  # summed by name (the two ends, tied or not) or every gradient summed
        if kind.is_embedding_or_head:
            out.append(("untied summed", "summed over the embedding group though this model's "
                        "head is untied (HeldGradient.tied is False): the embedding and the head "
                        "are two different weights", _with(right, add=["embedding"])))  # fmt: skip
        out.append(("tie on another weight", "summed over the embedding group: only the two "
                    "copies of a tied embedding (HeldGradient.tied) are",
                    _with(right, add=["embedding"])))  # fmt: skip
    return tuple((Mistake(key, says), recipe) for key, says, recipe in out)


def solve_coefficients(
    got: torch.Tensor, inputs: Sequence[torch.Tensor]
) -> tuple[list[float], float] | None:
    """``got`` as a weighted sum of every rank's input gradient: the weights and the largest
    residual (relative); None when the inputs do not tell the ranks apart (too few elements)."""
    basis = torch.stack([x.reshape(-1).double() for x in inputs], dim=1)  # [elements, ranks]
    if got.shape != inputs[0].shape or torch.linalg.matrix_rank(basis) < basis.shape[1]:
        return None
    target = got.reshape(-1, 1).double()
    solution = torch.linalg.lstsq(basis, target).solution
    residual = float((basis @ solution - target).abs().max()) / max(1.0, float(target.abs().max()))
    return [float(c) for c in solution.reshape(-1)], residual


def _same_coefficients(a: Sequence[float], b: Sequence[float]) -> bool:
    return all(abs(x - y) < 1e-9 for x, y in zip(a, b, strict=True))


def _measured_recipe_text(
    coefficients: Sequence[float], grid: RankGrid, rank: int, expert: bool = False
) -> str:
    """The measured weights in words: "the sum over (0, 2) divided by 4", or the weights."""
    support = tuple(q for q, c in enumerate(coefficients) if abs(c) > 1e-9)
    values = {round(coefficients[q], 9) for q in support}
    if not support:
        return "zero"
    if len(values) == 1:
        (c,) = values
        names = [n for n in _NAMING if group_ranks(grid, n, rank) == support
                 and (expert or n not in ("edp", "ep"))]  # fmt: skip
        named = " = ".join(GROUP_WORDS[n] for n in names[:2])
        where = ranks_text(support) + (f" ({named})" if names else "")
        own = support == (rank,)
        base = "this rank's own gradient" if own else f"the sum over ranks {where}"
        if abs(c - 1) < 1e-9:
            return base
        inverse = 1 / c
        if abs(inverse - round(inverse)) < 1e-6:
            return f"{base} divided by {round(inverse)}"
        return f"{base} times {c:.4g}"
    weights = ", ".join(f"rank {q}: {coefficients[q]:.4g}" for q in support)
    return f"a mix of the ranks' gradients with unequal weights ({weights})"


def finish_problem(
    kind: HeldKind,
    sp: bool,
    grid: RankGrid,
    rank: int,
    got: torch.Tensor,
    inputs: Sequence[torch.Tensor],
    on_world: bool = False,
    allowed: Iterable[str] | Callable[[], Iterable[str]] | None = None,
    deviations: Callable[[], list[str]] | None = None,
) -> str | None:
    """What is wrong with one gradient on ``rank`` after finish_gradients: ``inputs`` are every
    rank's gradient of that entry before it (rank order), ``got`` this rank's after;
    ``on_world``: whether the rank called a collective on the world group (no ``group=``), which
    alone tells a forgotten group from a wrong one that spans the same ranks; ``allowed``: the
    mistakes that explain every other gradient of every case too (:func:`finish_consistent`;
    or a function giving them), None for no other evidence. A mistake that fits here but not
    there is not named. ``deviations``: when no known mistake fits, the one-group changes that
    explain every case (:func:`finish_deviations`), said as what was measured."""
    right = right_recipe(kind, sp)
    want_c = recipe_coefficients(right, grid, rank)
    want = sum((c * x.double() for c, x in zip(want_c, inputs, strict=True)), torch.zeros(()))
    if same(got, want):
        return None
    expected = f"one process's is {right.text(grid, rank)}"
    solved = solve_coefficients(got, inputs)
    if solved is None or solved[1] > 1e-9:
        return (
            f"it is not a sum of the ranks' gradients over any group (a value no reduction of "
            f"them gives: {difference(got, want)}); {expected}"
        )
    coefficients, _ = solved
    said = _measured_recipe_text(coefficients, grid, rank, kind.expert)
    measured = f"it holds {said}; {expected}"
    fits: list[Mistake] = []
    for mistake, recipe in finish_mistakes(kind, sp, grid):
        if "world" in recipe.sums and not on_world:
            continue  # no collective ran on the world group: a forgotten group= did not happen
        c = (
            [1.0 if q == rank else 0.0 for q in range(grid.world_size)]
            if recipe.unchanged
            else recipe_coefficients(recipe, grid, rank)
        )
        if _same_coefficients(c, coefficients) and not _same_coefficients(c, want_c):
            fits.append(mistake)
    if on_world:  # the collective on the world group is the likeliest cause
        fits.sort(key=lambda m: "world" not in m.key)
    if fits and callable(allowed):  # the other cases' evidence, computed when it matters
        allowed = allowed()
    here_only = [] if allowed is None else [m for m in fits if m.key not in set(allowed)]  # type: ignore[arg-type]
    fits = [m for m in fits if m not in here_only]
    if fits:
        return f"{measured}: {verdict(fits)}"
    seen = deviations() if deviations is not None else []
    if seen:
        return (
            f"{measured}: no known mistake gives every case, but every case shows "
            + " or ".join(seen)
        )
    if here_only:
        keys = ", ".join(f"'{m.key}'" for m in here_only)
        return (
            f"{measured}: here it fits what {keys} would give, but not the other gradients of "
            "the other cases (two mistakes at once, or one of another kind)"
        )
    return f"{measured} (two mistakes at once, or one of another kind)"


@dataclass(frozen=True)
class FinishEntry:
    """One gradient of one finish_gradients case on one rank: what it is, every rank's input
    of that entry (rank order), and what the rank held after."""

    kind: HeldKind
    sp: bool
    grid: RankGrid
    rank: int
    got: torch.Tensor
    inputs: Sequence[torch.Tensor]
    on_world: bool


# the steps of finishing a gradient that one group can be changed in: which gradients a step
# takes, the group or divisor it has in one process's recipe, and the words for them
_STEPS: tuple[tuple[str, Callable[[HeldKind, bool], bool], str, str], ...] = (
    ("sum", lambda k, sp: not k.expert and not k.reduced, "dp_cp",
     "the gradients that are neither experts' nor ZeRO slices"),
    ("divisor", lambda k, sp: not k.expert and not k.reduced, "dp_cp",
     "the gradients that are neither experts' nor ZeRO slices"),
    ("sum", lambda k, sp: k.expert, "edp", "the experts' gradients"),
    ("divisor", lambda k, sp: k.expert, "dp_cp", "the experts' gradients"),
    ("sum", lambda k, sp: k.tp_replicated and sp, "tp",
     "the gradients of weights whole on every tp rank (under sequence parallelism)"),
    ("sum", lambda k, sp: k.tied, "embedding", "the tied copies"),
)  # fmt: skip
_DEVIATION_GROUPS = ("tp", "dp", "cp", "dp_cp", "ep", "edp", "embedding", "pp", "world", None)


def finish_deviations(entries: Iterable[FinishEntry]) -> list[str]:
    """The changes of ONE step's group (a sum over another group, or none; a division by
    another group's size, or none) that give every entry of every case, in words."""
    entries = list(entries)
    checked: list[dict[tuple[float, ...], bool]] = [{} for _ in entries]  # per entry: c -> fits
    out = []
    for step, takes, usual, whose in _STEPS:
        for group in _DEVIATION_GROUPS:
            if group == usual:
                continue
            changed = False
            for i, e in enumerate(entries):
                right = right_recipe(e.kind, e.sp)
                recipe = right
                if takes(e.kind, e.sp):
                    if step == "sum":
                        recipe = _with(right, add=[group] if group else [], drop=[usual])
                    else:
                        recipe = _with(right, divisor=group)
                if "world" in recipe.sums and not e.on_world:
                    break
                c = _recipe_coefficients(recipe, e.grid, e.rank)
                if c not in checked[i]:
                    want = sum((x * e.inputs[q].double() for q, x in enumerate(c) if x),
                               torch.zeros(()))  # fmt: skip
                    checked[i][c] = same(e.got, want)
                if not checked[i][c]:
                    break
                changed |= recipe != right
            else:
                if not changed:
                    continue
                name = "the whole world" if group == "world" else group and GROUP_WORDS[group]
                if step == "sum":
                    how = f"summed over {name}" if group else "not summed"
                    out.append(f"{whose} {how}, where one process sums over {GROUP_WORDS[usual]}")
                else:
                    how = f"divided by the {name} size" if group else "not divided"
                    out.append(f"{whose} {how}, where one process divides by the dp x cp size")
    return out


def finish_right(e: FinishEntry) -> bool:
    """Whether the entry holds what one process's gradient gives (its right recipe)."""
    c = recipe_coefficients(right_recipe(e.kind, e.sp), e.grid, e.rank)
    want = sum((x * e.inputs[q].double() for q, x in enumerate(c)), torch.zeros(()))
    return same(e.got, want)


def finish_consistent(entries: Iterable[FinishEntry]) -> set[str]:
    """The mistakes that explain every entry (of every case): each entry holds what the mistake
    gives for its kind, or the right gradient where the mistake has no way to touch that kind."""
    entries = list(entries)
    recipes = [{m.key: r for m, r in finish_mistakes(e.kind, e.sp, e.grid)} for e in entries]
    keys = {key for r in recipes for key in r}
    checked: list[dict[tuple[float, ...], bool]] = [{} for _ in entries]  # per entry: c -> fits

    def fits(i: int, c: tuple[float, ...]) -> bool:
        if c not in checked[i]:
            e = entries[i]
            want = sum((x * e.inputs[q].double() for q, x in enumerate(c) if x),
                       torch.zeros(()))  # fmt: skip
            checked[i][c] = same(e.got, want)
        return checked[i][c]

    out = set()
    for key in sorted(keys):
        for i, (e, ways) in enumerate(zip(entries, recipes, strict=True)):
            recipe = ways.get(key, right_recipe(e.kind, e.sp))
            if "world" in recipe.sums and not e.on_world:
                break
            c = (
                tuple(1.0 if q == e.rank else 0.0 for q in range(e.grid.world_size))
                if recipe.unchanged
                else _recipe_coefficients(recipe, e.grid, e.rank)
            )
            if not fits(i, c):
                break
        else:
            out.add(key)
    return out


def hand_made_problem(
    grid: RankGrid,
    rank: int,
    got: torch.Tensor,
    inputs: Sequence[torch.Tensor],
) -> str:
    """A gradient that is complete with torch's all-reduce but not when ``all_reduce_fn`` is
    given: what the hand-made run left, in words."""
    solved = solve_coefficients(got, inputs)
    if solved is None or solved[1] > 1e-9:
        measured = "a value no sum of the ranks' gradients gives"
    else:
        measured = _measured_recipe_text(solved[0], grid, rank)
    return (
        f"with all_reduce_fn given it holds {measured}, though with torch's all-reduce it was "
        "complete: all_reduce_fn(buffer, group=...) reduces its buffer in place and returns "
        "nothing to use, so the data-parallel sums must hand it the very buffer whose values "
        "end in the gradients (all_reduce_flat(..., all_reduce_fn=...) reduces a flat copy and "
        "copies it back)"
    )


# ----------------------------------------------------------------------------- placements


def normalized_axes(axes: Iterable[str]) -> frozenset[str]:
    """Placements that count the same copies: ``{"dp", "cp"}`` is ``{"dp_cp"}``, and dp or cp
    beside dp_cp add nothing."""
    out = set(axes)
    if {"dp", "cp"} <= out:
        out -= {"dp", "cp"}
        out.add("dp_cp")
    if "dp_cp" in out:
        out -= {"dp", "cp"}
    return frozenset(out)


def right_axes(kind: HeldKind) -> frozenset[str]:
    axes = {"edp"} if kind.expert else (set() if kind.reduced else {"dp_cp"})
    if kind.tp_replicated:
        axes.add("tp")
    if kind.tied:
        axes.add("embedding")
    return frozenset(axes)


_AXIS_WHY = {
    "dp_cp": "the dp x cp ranks hold the same averaged gradient",
    "tp": "the tp ranks hold the same whole weight",
    "embedding": "the other end of the pipeline holds the tied copy",
    "edp": "the edp ranks hold the same expert",
}
_EXTRA_WHY = {
    "dp_cp": "its dp x cp ranks hold different pieces",
    "tp": "the tp ranks hold different pieces of it",
    "embedding": "no other stage holds a copy of it (only a tied embedding's two ends do)",
    "edp": "only an expert has edp copies",
    "dp": "its dp ranks hold different pieces",
    "cp": "its cp ranks hold different pieces",
}


def placements_problem(kind: HeldKind, got: Iterable[str] | None) -> str | None:
    """What is wrong with the ``replicated_on`` gradient_placements gave one gradient."""
    want = right_axes(kind)
    if got is None:
        return "no GradShard came back for it"
    have = normalized_axes(got)
    if have == want:
        return None
    missing, extra = sorted(want - have), sorted(have - want)
    parts = []
    if missing:
        parts.append(
            f"missing {missing}: copies counted several times ("
            + "; ".join(_AXIS_WHY.get(m, m) for m in missing)
            + ")"
        )
    if extra:
        why = dict(_EXTRA_WHY)
        if kind.expert:
            why["dp_cp"] = "the other ranks of its ep group, inside dp x cp, hold other experts"
        elif kind.reduced:
            why["dp_cp"] = "each dp x cp rank holds another ZeRO slice of it"
        parts.append(
            f"extra {extra}: distinct pieces dropped from the norm ("
            + "; ".join(why.get(e, e) for e in extra)
            + ")"
        )
    return f"replicated_on={sorted(got)}, expected {sorted(want)}: " + "; ".join(parts)


def _placed(
    kind: HeldKind,
    dense: Iterable[str] = ("dp_cp",),
    expert: Iterable[str] = ("edp",),
    reduced: Iterable[str] = (),
    tp: Callable[[HeldKind], bool] = lambda k: k.tp_replicated,
    embedding: Callable[[HeldKind], bool] = lambda k: k.tied,
    extras: Callable[[HeldKind], bool] = lambda k: True,
) -> frozenset[str]:
    """The groups one way of writing gradient_placements gives ``kind`` (the right way by
    default): a base set per kind of gradient, then tp and embedding where the way adds them."""
    axes = set(expert if kind.expert else (reduced if kind.reduced else dense))
    if extras(kind) and tp(kind):
        axes.add("tp")
    if extras(kind) and embedding(kind):
        axes.add("embedding")
    return frozenset(axes)


# The realistic ways of getting gradient_placements wrong, each a change of the right code, and
# the words a message says when the placements of every graded gradient fit that way and no
# other: (the way, its words). Each says what the code did in words no other way's hold.
PLACEMENT_WAYS: dict[str, tuple[Callable[[HeldKind], frozenset[str]], str]] = {
    "no tp": (functools.partial(_placed, tp=lambda k: False),
              "tp left out for every tp-replicated weight"),
    "no embedding": (functools.partial(_placed, embedding=lambda k: False),
                     "embedding left out for the two tied copies"),
    "tp for all": (functools.partial(_placed, tp=lambda k: True),
                   "tp given to the tp shards as well"),
    "embedding by name": (functools.partial(_placed, embedding=lambda k: k.is_embedding_or_head),
                          "embedding given by name, to the untied embedding and head too"),
    "expert on dp_cp": (functools.partial(_placed, expert=("dp_cp",)),
                        "an expert placed on dp_cp instead of edp"),
    "expert on dp_cp and edp": (functools.partial(_placed, expert=("edp", "dp_cp")),
                                "an expert given dp_cp beside edp"),
    "slice on dp_cp": (functools.partial(_placed, reduced=("dp_cp",)),
                       "ZeRO slices given dp_cp, as if every dp x cp rank held the same slice"),
    "dp for dp_cp": (functools.partial(_placed, dense=("dp",)),
                     "dp alone where dp_cp belongs"),
    "slice bare": (functools.partial(_placed, extras=lambda k: not k.reduced),
                   "ZeRO slices given no group at all, their tp dropped too"),
    "expert bare": (functools.partial(_placed, extras=lambda k: not k.expert),
                    "an expert given edp alone, its tp dropped"),
}  # fmt: skip


def placements_fitting(kinds: Sequence[HeldKind], got: Sequence[Iterable[str] | None]) -> list[str]:
    """The known ways (keys of PLACEMENT_WAYS) that give exactly ``got`` for every kind."""
    have = [None if g is None else normalized_axes(g) for g in got]
    return [
        key for key, (way, _) in PLACEMENT_WAYS.items()
        if all(h == way(k) for k, h in zip(kinds, have, strict=True))
    ]  # fmt: skip


def placements_verdict(
    cases: Sequence[tuple[HeldKind, str]], got: Sequence[Iterable[str] | None]
) -> str | None:
    """The words of gradient_placements' failure over every graded gradient: a known way's words
    only when the placements of every gradient fit it and no other, else which gradients are
    placed wrong and how (the groups missing and extra, with what each group's ranks hold)."""
    problems = [
        (kind, what, problem)
        for (kind, what), g in zip(cases, got, strict=True)
        if (problem := placements_problem(kind, g))
    ]
    if not problems:
        return None
    shown = "; ".join(f"{kind.name} ({what}): {problem}" for kind, what, problem in problems[:3])
    more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
    count = f"{len(problems)} of {len(cases)} gradients placed wrong"
    fitting = placements_fitting([kind for kind, _ in cases], got)
    if len(fitting) == 1:
        return f"{PLACEMENT_WAYS[fitting[0]][1]} ({count}): {shown}{more}"
    return f"{count}: {shown}{more}"


# ----------------------------------------------------------------------------- training layouts


@dataclass(frozen=True)
class LayoutFacts:
    """What a training layout has, for naming only the causes it can have."""

    dp: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    sp: bool = False
    tied: bool = False
    moe: bool = False
    zero: Any = 0
    tie_across_ranks: bool = False  # the two ends of a tied model on different ranks

    @property
    def dp_cp(self) -> int:
        return self.dp * self.cp


def parameter_causes(kind: str, facts: LayoutFacts) -> list[str]:
    """The reductions that could leave weights of ``kind`` different from one process's in
    this layout, most likely first (none of the layout's impossibilities)."""
    causes: list[str] = []
    data = (
        "averaged over dp x cp (the ranks holding the same weights and other tokens"
        + ("; dp alone misses the cp ranks" if facts.cp > 1 else "")
        + ")"
    )
    replicated = kind in ("norm", "embedding/head", "router", "expert")
    if kind == "expert":
        if facts.ep < facts.dp_cp or facts.dp_cp > 1:
            causes.append(
                "their gradients are summed over edp (the ranks holding the same expert) and "
                "divided by the dp x cp size"
            )
    elif facts.dp_cp > 1:
        if facts.zero:
            causes.append(f"under ZeRO ({facts.zero}) the slices arrive averaged already: not "
                          "averaged again")  # fmt: skip
        else:
            causes.append(f"their gradients are {data}")
    if replicated and facts.tp > 1:
        causes.append(
            "under sequence parallelism the tp ranks' gradients of weights whole on every tp "
            "rank are summed over tp"
            if facts.sp
            else "without sequence parallelism the tp ranks computed the weights whole on every "
            "tp rank from the same tokens: not summed over tp"
        )
    if kind == "embedding/head" and facts.tie_across_ranks:  # the likeliest for these
        causes.insert(
            0,
            "the two copies of the tied embedding (first and last stage) both hold the sum of "
            "both uses (the embedding group)",
        )
    if kind == "embedding/head" and not facts.tied and facts.pp > 1:
        causes.append("the embedding and the untied head are two weights: not summed together")
    return causes
