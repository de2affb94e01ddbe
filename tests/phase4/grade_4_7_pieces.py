"""Exercise 4.7, the pieces of the composition: ``uv run pytest tests/test_phase4.py -m ex4_7``.

Each function you write is first tried alone, on chosen inputs, before the training grader
(``grade_4_7_training.py``) runs whole layouts; a wrong group or a wrong normalization is named
here, where it is still one function, at the line that defines it. What a difference means is
decided by ``lm_namers.py``: a cause is named only when the measurement singles it out among the
realistic mistakes; otherwise the message says what was measured and lists the causes that fit.

* ``token_positions`` in this process: every cp rank's true positions under zig-zag for cp 1, 2, 4;
* ``all_gather_sequence`` and ``reduce_scatter_sequence`` on the tp groups of tp2 x dp2 in a world
  of 4 (a strict subgroup: a collective that forgot ``group=`` shows): values, the tensor handed
  in left unchanged, and every collective's kind, group and bytes (a reduce-scatter done as an
  all-reduce moves twice the bytes);
* ``enter_tensor_parallel`` and ``leave_tensor_parallel`` there, with and without sequence
  parallelism: values, the gradients that reach the input, and the collectives of both passes;
* ``count_valid_tokens`` with uneven masks on dp2 x cp2 and cp2 x tp2;
* ``loss_share`` in this process (value and gradient), on a topology that answers sizes only;
* ``balance_loss_share`` on dp2 x cp2, cp4 and cp2 x tp2 (with and without sequence
  parallelism), top-3 of 5 experts: every rank's share and its gradient, against one process and
  against the usual mistakes (k, E, dp, cp, tp differ in some layout, so a share off by one of
  them is told from a share off by another);
* ``finish_gradients`` on synthetic gradients: dp2 x cp2 with experts on ep2, dp2 x tp2 with
  sequence parallelism (ZeRO slices among them) and without (experts on ep2: the world is not
  dp x cp), pp2 x tp2 with sequence parallelism (tp x dp x cp is not the world), pp2 x dp2 with
  a tied embedding and with an untied embedding and head, pp4 with a tie, dp4 x pp2 for the
  tie's bits; which ranks' parts each result sums is read off the result, and a cause is named
  only when it explains every case; again with a hand-made all-reduce (only the data-parallel
  sums may go through it);
* ``gradient_placements`` in this process, for every kind of gradient, tied or not.

A later check that needs an earlier one (the regions need the collectives, the hand-made run
needs the plain one) steps aside while that one fails. Settings that cannot run are refused
before any process starts (a reference check: the refusals are given code).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any, NoReturn

import pytest
import torch
import torch.nn.functional as F
from grading import current_test, defined_at, exercise, impl, learner_line, load
from lm_helpers import DENSE, FAILED_PIECES, MOE, at, lm_parallel, piece_failed
from lm_namers import (
    BalanceMeasured,
    FinishEntry,
    HeldKind,
    LossCase,
    RegionCase,
    all_gather_problem,
    balance_problem,
    communication_problem,
    count_problem,
    finish_consistent,
    finish_deviations,
    finish_problem,
    finish_right,
    hand_made_problem,
    loss_problem,
    placements_verdict,
    positions_fitting,
    positions_problem,
    reduce_scatter_problem,
    region_problem,
    same,
)
from lm_pieces_helpers import (
    BALANCE_LAYOUTS,
    BATCH,
    COUNT_LAYOUTS,
    EXPERTS,
    FINISH_CASES,
    HAND_MADE,
    NORM_SHARDS,
    PP4_DEGREES,
    SEQ,
    SP_SHAPE,
    SP_TP,
    TIE_DEGREES,
    TIE_SHAPE,
    TIE_WORLD,
    WIRE,
    WORLD,
    K,
    balance_reference,
    count_grid,
    entry_inputs,
    finish_grid,
    group_names,
    held_name,
    norm_shard_value,
    pieces_worker,
    pp4_tie_worker,
    region_shapes,
    routing,
    sp_grid,
    sp_input,
    sp_weight,
    tie_expected,
    tie_order_worker,
    tie_value,
)
from phase4_helpers import fail

from course.impl import unwritten_todo
from course.language_model import IGNORE_INDEX
from course.topology import RankGrid, Topology
from course.world import Frame, RankFailed, WorldHung
from phase4_production.lm_layout import ParallelSettings
from phase4_production.lm_support import HeldGradient

PHASE = "phase4_production"
# the earlier exercises the pieces use: 2.6's f and g, 2.7's layout, 3.6's global norm
NEEDED = [
    ("phase2_advanced", "tensor_parallel_ops"),
    ("phase2_advanced", "context_parallel_layout"),
    ("phase3_multi_node", "grad_clipping"),
]
_WORLD: list[dict[str, Any]] | BaseException | None = None
PART_FUNCTIONS = {"global_norm": "your 3.6 global_grad_norm", "regions": "the regions' part"}


def needs_earlier_exercises() -> None:
    """Stop at the first unwritten TODO of an earlier exercise these pieces call, by name."""
    for phase, module in NEEDED:
        todo = unwritten_todo(phase, module, impl())
        if todo is not None:
            raise NotImplementedError(f"4.7 needs {todo}")


def world_part(name: str) -> list[Any]:
    """One part of the shared world of 4 (started on first use), per rank."""
    global _WORLD
    needs_earlier_exercises()
    if _WORLD is None:
        from grading import world

        try:
            _WORLD = world(pieces_worker, WORLD)
        except WorldHung as exc:
            exc.args = (
                "4.7's pieces hung. A collective that only some ranks call, or one on a group "
                "that other ranks reach with another collective (a reduction on the world "
                "instead of a group, a group built on some ranks only), leaves the others "
                f"waiting. Details:\n{exc}",
            )
            _WORLD = exc
        except BaseException as exc:
            _WORLD = exc
    if isinstance(_WORLD, BaseException):
        raise _WORLD
    parts = [rank_results[name] for rank_results in _WORLD]
    stop_if_stopped(PART_FUNCTIONS.get(name, name), parts)
    return parts


def fail_piece(functions: str | list[str], message: str) -> NoReturn:
    """Fail, and note the functions at fault for the training grader (its layouts that use them
    step aside)."""
    piece_failed(functions, current_test())
    fail(message)


def stop_if_stopped(function: str, values: list[Any], records: list[Any] | None = None) -> None:
    """Raise a rank's unwritten TODO as the harness reports one (at its template line), or fail
    with the first rank's error at the learner's line."""
    for rank, value in enumerate(values):
        if isinstance(value, dict) and "todo" in value:
            piece_failed(function, current_test())  # the training layouts that run it step aside
            frames = [Frame(f, line, fn) for f, line, fn in value["where"]]
            raise RankFailed(rank, "NotImplementedError", value["todo"], frames)
    for rank, value in enumerate(values):
        if isinstance(value, dict) and "error" in value:
            frames = [Frame(f, line, fn) for f, line, fn in value["where"]]
            theirs = [f for f in frames if f.location.startswith(("phase", "solutions"))]
            where = (theirs or frames)[-1:]
            lines = "".join(f"\n  at {frame.location}" for frame in where)
            calls = records[rank] if records else []
            outside = communication_problem(calls, _tp_group(rank), WORLD, float("inf"), "")
            note = f"\n  ({outside})" if outside else ""
            error = value["error"].splitlines()[0]
            fail_piece(function, f"4.7 {function}: rank {rank} raised {error}{lines}{note}")


def merge_ranks(problems: list[tuple[int, str]]) -> list[str]:
    """``(rank, remark)`` pairs with the same remark merged into one line naming every rank."""
    ranks: dict[str, list[int]] = {}
    for rank, text in problems:
        ranks.setdefault(text, []).append(rank)
    lines = []
    for text, who in ranks.items():
        prefix = f"rank{'s' if len(who) > 1 else ''} {', '.join(map(str, who))}: "
        lines.append(prefix + text)
    return lines


def blocked_by(functions: list[str]) -> None:
    """Step aside while an earlier check of a function this one needs (or grades again, on
    another case) fails: one story at a time."""
    for function in functions:
        test = FAILED_PIECES.get(function)
        if test is not None:
            pytest.skip(f"blocked by {function} (fix it first: {test} fails on it)")


# ----------------------------------------------------------------------------- positions


POSITION_CASES = ((16, 1), (16, 2), (24, 2), (16, 4))  # (seq_len, cp), graded in this order


def positions_message(got: Sequence[Sequence[Any]]) -> str | None:
    """The words of token_positions' failure: ``got[i][r]`` is cp rank r's positions in
    ``POSITION_CASES[i]``; the first case with wrong values is told (a wrong dtype alone only
    when every value is right), a mistake named only if it fits every case; None when all are
    right."""
    allowed = positions_fitting(POSITION_CASES, got)
    problems = [positions_problem(seq, cp, per_rank, allowed)
                for (seq, cp), per_rank in zip(POSITION_CASES, got, strict=True)]  # fmt: skip
    told = [p for p in problems if p]
    values = [p for p in told if "returned the right positions" not in p]
    return f"4.7 {(values or told)[0]}" if told else None


@exercise("4.7")
def test_token_positions_are_the_tokens_true_places_under_zigzag() -> None:
    lm = lm_parallel()
    returned = []
    for seq, cp in POSITION_CASES:
        got = []
        for rank in range(cp):
            try:
                got.append(lm.token_positions(seq, rank, cp))
            except NotImplementedError:
                piece_failed("token_positions", current_test())
                raise
            except Exception as exc:
                fail_piece(
                    "token_positions",
                    f"4.7 token_positions(seq_len={seq}, cp_rank={rank}, cp={cp}) raised "
                    f"{type(exc).__name__}: {exc}{learner_line(exc)}",
                )
        returned.append(got)
    message = positions_message(returned)
    if message:
        fail_piece("token_positions", f"{message}{at('token_positions')}")


# ----------------------------------------------------------------------------- sequence parallel


def _tp_group(rank: int) -> tuple[int, ...]:
    return sp_grid().group_of("tp", rank)


def _layout_words() -> str:
    groups = " and ".join(str(g) for g in sp_grid().tp_groups())
    return f"the tp groups {groups} of a world of {WORLD} (tp{SP_TP} x dp{WORLD // SP_TP})"


def _whole_bytes() -> int:
    return SP_SHAPE[0] * SP_TP * SP_SHAPE[1] * SP_SHAPE[2] * 8  # float64


def _collective_problem(function: str, rank: int, got: Any, records: list[Any],
                        unchanged: bool) -> str | None:  # fmt: skip
    group = _tp_group(rank)
    n = len(group)
    whole_tokens = SP_TP * SP_SHAPE[1]
    if function == "all_gather_sequence":
        problem = all_gather_problem(
            got, [sp_input(q) for q in group], [sp_input(q) for q in range(WORLD)]
        )
        kind = "an all-gather"
    else:
        problem = reduce_scatter_problem(
            got,
            [sp_input(q, whole_tokens) for q in group],
            [sp_input(q, whole_tokens) for q in range(WORLD)],
            group.index(rank),
            rank,
        )
        kind = "a reduce-scatter"
    outside = communication_problem(records, group, WORLD, float("inf"), kind)
    if problem and outside:  # the wrong group explains the values
        return f"{problem} ({outside})"
    if problem:
        return problem
    if not unchanged:
        in_place = any(r.op == "all_reduce" for r in records)
        return (
            "it changed the tensor it was handed"
            + (" (an all_reduce on it, in place)" if in_place else "")
            + ": its input belongs to the caller (the row-parallel layer's partial sums, which "
            "autograd may still need); let the collective write into a new output"
            if function == "reduce_scatter_sequence"
            else "it changed the tensor it was handed: its input belongs to the caller"
        )
    return communication_problem(records, group, WORLD, (n - 1) / n * _whole_bytes(), kind)


SEQUENCE_COLLECTIVES = (  # (function, the part's key, what it is handed), graded in this order
    ("all_gather_sequence", "all_gather", f"shares {list(SP_SHAPE)}"),
    ("reduce_scatter_sequence", "reduce_scatter",
     f"[{SP_SHAPE[0]}, {SP_TP * SP_SHAPE[1]}, {SP_SHAPE[2]}] partial sums"),
)  # fmt: skip


def collective_message(function: str, results: Sequence[tuple[Any, list[Any], bool]]) -> str | None:
    """The words of one sequence collective's failure: ``results[rank]`` is (what it returned,
    the collectives it issued, whether the tensor handed in was left unchanged); the learner's
    line goes after the first line. None when every rank is right."""
    problems = []
    for rank, (got, records, unchanged) in enumerate(results):
        problem = _collective_problem(function, rank, got, records, unchanged)
        if problem:
            problems.append((rank, problem))
    if not problems:
        return None
    shape = next(s for f, _, s in SEQUENCE_COLLECTIVES if f == function)
    return f"4.7 {function} of {shape} on {_layout_words()}:\n  " + "\n  ".join(
        merge_ranks(problems)[:3]
    )


@exercise("4.7")
def test_sequence_collectives_gather_and_reduce_scatter_along_the_sequence() -> None:
    parts = world_part("sequence_collectives")
    messages, wrong = [], []
    for function, key, _ in SEQUENCE_COLLECTIVES:
        results = [part[key] for part in parts]
        stop_if_stopped(function, [r[0] for r in results], [r[1] for r in results])
        message = collective_message(function, results)
        if message:
            wrong.append(function)
            first, _, rest = message.partition("\n")
            messages.append(f"{first}{at(function)}\n{rest}")
    if messages:
        fail_piece(wrong, "\n".join(messages))


@exercise("4.7")
@pytest.mark.parametrize("sp", [True, False], ids=["with-sp", "without-sp"])
def test_tensor_parallel_regions_enter_and_leave_with_the_right_collectives(sp: bool) -> None:
    blocked_by(["enter_tensor_parallel", "leave_tensor_parallel"])  # failed the other mode
    if sp:
        blocked_by(["all_gather_sequence", "reduce_scatter_sequence"])
    parts = world_part("regions")
    messages, wrong = [], []
    for which, function in REGION_FUNCTIONS:
        results = [part[f"{which}_{sp}"] for part in parts]
        stop_if_stopped(function, [r[0] for r in results], [r[1] for r in results])
        message = region_message(which, sp, results)
        if message:
            wrong.append(function)
            first, _, rest = message.partition("\n")
            messages.append(f"{first}{at(function)}\n{rest}")
    if messages:
        fail_piece(wrong, "\n".join(messages))


REGION_FUNCTIONS = (("enter", "enter_tensor_parallel"), ("leave", "leave_tensor_parallel"))


def region_message(which: str, sp: bool, results: Sequence[Any]) -> str | None:
    """The words of one region function's failure in one mode: ``results[rank]`` is ((its
    output, the gradient that reached its input), the collectives of both passes); the
    learner's line goes after the first line. None when every rank is right."""
    function = dict(REGION_FUNCTIONS)[which]
    tokens_in, tokens_out = region_shapes(which, sp)
    problems = []
    for rank, ((out, grad), records) in enumerate(results):
        group = _tp_group(rank)
        case = RegionCase(
            which, sp, group.index(rank),
            [sp_input(q, tokens_in) for q in group], [sp_weight(q, tokens_out) for q in group],
            [sp_input(q, tokens_in) for q in range(WORLD)],
            [sp_weight(q, tokens_out) for q in range(WORLD)],
        )  # fmt: skip
        problem = region_problem(case, out, grad)
        outside = communication_problem(records, group, WORLD, float("inf"), "")
        if problem and outside:
            problem = f"{problem} ({outside})"
        elif not problem:
            n = len(group)
            budget = 2 * (n - 1) / n * _whole_bytes()  # one collective each way, or f / g
            problem = communication_problem(
                records, group, WORLD, budget, "the region's collectives (forward and backward)"
            )
        if problem:
            problems.append((rank, problem))
    if not problems:
        return None
    return (
        f"4.7 {function}({'x' if which == 'enter' else 'y'}, group, sequence_parallel={sp}) "
        f"on {_layout_words()}, then sum(output * weight) backpropagated:\n  "
        + "\n  ".join(merge_ranks(problems)[:3])
    )


# ----------------------------------------------------------------------------- counts and loss


def count_message(
    results: Mapping[str, Sequence[tuple[Any, int]]],
    wires: Mapping[str, Sequence[Sequence[tuple[str, str]]]],
) -> str | None:
    """The words of count_valid_tokens' failure, None when it passes: ``results[label][rank]``
    is (what the rank returned, its own count), ``wires[label][rank]`` the (collective, dtype)
    pairs it sent."""
    problem = count_problem(results, {label: count_grid(label) for label in COUNT_LAYOUTS})
    if problem:
        label, rank, want, why = problem
        got, mine = results[label][rank]
        return (
            f"4.7 count_valid_tokens on {label} (uneven masks): rank {rank}, holding {mine} "
            f"valid targets, returned {got!r}; the global batch holds {want}: {why}"
        )
    for label in COUNT_LAYOUTS:
        for rank, sent in enumerate(wires[label]):
            inexact = [(op, dtype) for op, dtype in sent if dtype in INEXACT_COUNTS]
            if inexact:
                op, dtype = inexact[0]
                return (
                    f"4.7 count_valid_tokens on {label}: every rank returned the right count, "
                    f"but rank {rank}'s {op} carried it as {dtype}, which holds whole numbers "
                    f"exactly only up to {INEXACT_COUNTS[dtype]:,}: a global batch of 4,096 "
                    "sequences of 8,192 tokens holds 33,554,432 targets, and the count, the "
                    "loss's divisor, would be off. Which dtype carries every count exactly?"
                )
    return None


@exercise("4.7")
def test_count_valid_tokens_counts_the_whole_batch_once() -> None:
    parts = world_part("count_valid_tokens")
    results = {}
    for label in COUNT_LAYOUTS:
        per_rank = [part[label] for part in parts]
        stop_if_stopped("count_valid_tokens", [r[0] for r in per_rank])
        results[label] = per_rank
    wires = {label: [part[label + WIRE] for part in parts] for label in COUNT_LAYOUTS}
    message = count_message(results, wires)
    if message:
        fail_piece("count_valid_tokens", f"{message}{at('count_valid_tokens')}")


# floating dtypes a count may not travel in, and the largest whole number each holds exactly
# (2**(mantissa bits + 1)); float64 (2**53) and the integer dtypes are exact for any batch
INEXACT_COUNTS = {"float16": 2**11, "bfloat16": 2**8, "float32": 2**24}


class NoCommunication(Exception):
    """loss_share asked the stand-in topology for a process group."""


class SizesOnly:
    """A topology that answers sizes and places (course.topology's names) and refuses groups:
    ``loss_share`` needs no communication, the global count is handed in."""

    def __init__(self, grid: RankGrid) -> None:
        self._topology = Topology(0, grid, {})

    def __getattr__(self, name: str) -> Any:
        if name == "group" or name.endswith("_group"):
            raise NoCommunication(
                f"topology.{name}: this check hands a topology without process groups, as the "
                "function needs no communication"
            )
        return getattr(self._topology, name)


LOSS_GRIDS = (RankGrid(1), RankGrid(2, 4, cp=3))  # one rank; dp2 x cp3 x tp4 (24 ranks)
LOSS_VALID = (None, 53)  # the global count handed in (None: this rank's own, the only rank)


def loss_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """The logits [2, 8, 256] (float64) and targets (the first row masked from position 3)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 8, 256, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 256, (2, 8), generator=g)
    targets[0, 3:] = IGNORE_INDEX
    return logits, targets


def loss_cases() -> list[LossCase]:
    """Every loss_share check: its layout and the numbers one process's share comes from."""
    logits, targets = loss_inputs()
    local_valid = int((targets != IGNORE_INDEX).sum())
    summed = float(F.cross_entropy(logits.view(-1, 256), targets.view(-1),
                                   ignore_index=IGNORE_INDEX, reduction="sum"))  # fmt: skip
    cases = []
    for grid, valid in zip(LOSS_GRIDS, LOSS_VALID, strict=True):
        sizes = {n: len(grid.group_of(n, 0)) for n in ("dp", "cp", "tp", "dp_cp")}
        sizes["world"] = grid.world_size
        label = " x ".join(f"{n}{sizes[n]}" for n in ("dp", "cp", "tp") if sizes[n] > 1) or "1 rank"
        cases.append(LossCase(label, summed, local_valid, targets.numel(),
                              local_valid if valid is None else valid, sizes))  # fmt: skip
    return cases


def loss_call(case: LossCase) -> str:
    return (
        f"loss_share(logits [2, 8, 256], targets with {case.local_valid} of "
        f"{case.local_targets} valid, global_valid={case.global_valid}) on {case.label} "
        f"(dp x cp = {case.sizes['dp_cp']})"
    )


def loss_message(values: Sequence[float]) -> str | None:
    """The words of loss_share's failure from its value in every case, None when all are right."""
    cases = loss_cases()
    problem = loss_problem(values, cases)
    if problem is None:
        return None
    i, why = problem
    return (
        f"4.7 {loss_call(cases[i])} returned {values[i]:.10g}; expected {cases[i].want:.10g}: {why}"
    )


@exercise("4.7")
def test_loss_share_is_the_ranks_sum_over_the_global_count() -> None:
    lm = lm_parallel()
    logits, targets = loss_inputs()
    returned = []
    for grid, case in zip(LOSS_GRIDS, loss_cases(), strict=True):
        call = loss_call(case)
        leaf = logits.clone().requires_grad_()
        try:
            got = lm.loss_share(leaf, targets.clone(), case.global_valid, SizesOnly(grid))
        except NotImplementedError:
            piece_failed("loss_share", current_test())
            raise
        except NoCommunication as exc:
            fail_piece(
                "loss_share",
                f"4.7 {call} asked the topology for a process group{learner_line(exc)}: a "
                "rank's share needs no communication (global_valid is handed in); the sizes "
                "come from topology.size_of",
            )
        except Exception as exc:
            fail_piece("loss_share", f"4.7 {call} raised {type(exc).__name__}: {exc}"
                       f"{learner_line(exc)}")  # fmt: skip
        if not isinstance(got, torch.Tensor) or got.dim() != 0:
            what = (
                f"shape {tuple(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
            )
            fail_piece("loss_share", f"4.7 {call} returned {what}; expected a 0-dim tensor "
                       f"(the runtime backpropagates it){at('loss_share')}")  # fmt: skip
        returned.append((leaf, got))
    message = loss_message([float(got.detach()) for _, got in returned])
    if message:
        fail_piece("loss_share", f"{message}{at('loss_share')}")
    for case, (leaf, got) in zip(loss_cases(), returned, strict=True):
        call = loss_call(case)
        if not got.requires_grad:
            fail_piece("loss_share", f"4.7 {call} returned the right value without a gradient "
                       "(detached, or built from Python numbers): the runtime backpropagates it"
                       f"{at('loss_share')}")  # fmt: skip
        got.backward()
        reference = logits.clone().requires_grad_()
        (F.cross_entropy(reference.view(-1, 256), targets.view(-1), ignore_index=IGNORE_INDEX,
                         reduction="sum") * case.sizes["dp_cp"] / case.global_valid).backward()  # fmt: skip
        if not same(leaf.grad, reference.grad):
            fail_piece("loss_share", f"4.7 {call}: the right value, but its gradient with "
                       "respect to the logits is not that of the summed cross-entropy x dp x cp "
                       f"/ global_valid (a part computed outside autograd?){at('loss_share')}")  # fmt: skip


@exercise("4.7")
def test_balance_loss_shares_add_up_to_one_process_balance_loss() -> None:
    parts = world_part("balance_loss_share")
    measured = {}
    for layout in BALANCE_LAYOUTS:
        results = [part[layout.label][0] for part in parts]
        stop_if_stopped("balance_loss_share", results)
        grid = RankGrid.for_world(WORLD, layout.dp, layout.tp, cp=layout.cp)
        groups = [group_names(part[layout.label][1], grid, rank) for rank, part in enumerate(parts)]
        measured[layout.label] = BalanceMeasured(
            [r[0] for r in results], [r[1] for r in results],
            None if any(g is None for g in groups) else groups,  # type: ignore[arg-type]
        )  # fmt: skip
    message = balance_message(measured)
    if message:
        fail_piece("balance_loss_share", f"{message}{at('balance_loss_share')}")


def balance_message(measured: Mapping[str, BalanceMeasured]) -> str | None:
    """The words of balance_loss_share's failure over every layout, None when it passes."""
    want, _ = balance_reference()
    probs, experts = routing()
    problem = balance_problem(BALANCE_LAYOUTS, measured, probs, experts, EXPERTS, BATCH, want)
    if problem is None:
        return None
    label, why = problem
    return (
        f"4.7 balance_loss_share on {label} ({BATCH} sequences of {SEQ} tokens, "
        f"{EXPERTS} experts, top-{K}): {why}"
    )


# ----------------------------------------------------------------------------- gradients


def kind_words(kind: HeldKind) -> str:
    end = {"embedding.weight": "embedding (first stage)", "head.weight": "head (last stage)"}
    if kind.expert:
        words = "an expert's weight, held by one rank of each ep group"
    elif kind.name in end:
        words = ("a tied copy: the " if kind.tied else "the untied ") + end[kind.name]
    elif kind.tp_replicated:
        words = "whole on every tp rank"
    else:
        words = "a tensor-parallel shard"
    return words + (", a ZeRO slice averaged during backward" if kind.reduced else "")


def finish_entries(case: str, results: Sequence[Any]) -> list[tuple[str, FinishEntry]]:
    """Every rank's gradients of ``case`` (per rank: name -> gradient, and whether it called a
    collective on the world group) as (the gradient's words, FinishEntry); none for a rank that
    stopped."""
    spec = FINISH_CASES[case]
    grid = finish_grid(case)
    out = []
    for rank, result in enumerate(results):
        if not isinstance(result, tuple):
            continue  # a TODO or an error: reported on its own
        got, on_world = result
        for entry in spec["held"]:
            name, _, tp_rep, tied, expert, reduced = entry
            real = held_name(name, grid, rank, expert)
            kind = HeldKind(real, tp_rep, tied, expert, reduced)
            out.append((
                f"rank {rank}'s {real} ({kind_words(kind)})",
                FinishEntry(kind, spec["sp"], grid, rank, got[real], entry_inputs(case, entry),
                            on_world),
            ))  # fmt: skip
    return out


def finish_problems(
    case: str, results: Sequence[Any], everything: Mapping[str, Sequence[Any]] | None = None
) -> list[str]:
    """Every rank's wrong gradients in ``case``, worded; ``everything`` (case -> results) is the
    evidence of the other cases: a mistake is named only if it explains them too."""
    entries = finish_entries(case, results)
    wrong = [(words, e) for words, e in entries if not finish_right(e)]
    if not wrong:
        return []
    allowed = None if everything is None else partial(_finish_evidence, everything)
    deviations = None if everything is None else partial(_finish_deviations, everything)
    words, e = wrong[0]  # worded in full; the others only counted
    problem = finish_problem(
        e.kind, e.sp, e.grid, e.rank, e.got, e.inputs, e.on_world, allowed, deviations
    )
    return [f"{words}: {problem}"] + [f"{words}: wrong" for words, _ in wrong[1:]]


def _finish_evidence(everything: Mapping[str, Sequence[Any]]) -> set[str]:
    """The mistakes that explain every gradient of every case."""
    return finish_consistent(e for c in everything for _, e in finish_entries(c, everything[c]))


def _finish_deviations(everything: Mapping[str, Sequence[Any]]) -> list[str]:
    """The one-group changes of one step that explain every gradient of every case."""
    return finish_deviations(e for c in everything for _, e in finish_entries(c, everything[c]))


def finish_message(everything: Mapping[str, Sequence[Any]]) -> str | None:
    """The first failing case's words (the cases run in order, a later one steps aside while an
    earlier fails), None when every case passes."""
    for case in FINISH_CASES:
        message = finish_case_message(case, everything)
        if message:
            return message
    return None


def finish_case_message(case: str, everything: Mapping[str, Sequence[Any]]) -> str | None:
    problems = finish_problems(case, everything[case], everything)
    if not problems:
        return None
    return f"4.7 finish_gradients, {case} (groups {_groups_words(case)}): {problems[0]}" + (
        f"\n  and {len(problems) - 1} more wrong gradients" if len(problems) > 1 else ""
    )


def _groups_words(case: str) -> str:
    grid = finish_grid(case)
    experts = any(entry[4] for entry in FINISH_CASES[case]["held"])
    names = [n for n in ("tp", "dp_cp", "edp", "embedding")
             if len(grid.group_of(n, 0)) > 1 and (n != "edp" or experts)]  # fmt: skip
    return "; ".join(f"{n}: {' '.join(str(g) for g in grid.groups(n))}" for n in names)


@exercise("4.7")
@pytest.mark.parametrize("case", list(FINISH_CASES))
def test_finish_gradients_reduces_each_gradient_on_its_groups(case: str) -> None:
    blocked_by(["finish_gradients"])  # an earlier case failed: one story at a time
    parts = world_part("finish_gradients")
    results = [part[case] for part in parts]
    stop_if_stopped("finish_gradients", results)
    everything = {c: [part[c] for part in parts] for c in FINISH_CASES}
    message = finish_case_message(case, everything)
    if message:
        first, _, more = message.partition("\n")
        fail_piece(
            "finish_gradients", f"{first}{at('finish_gradients')}" + (f"\n{more}" if more else "")
        )


def data_parallel_groups(case: str, rank: int) -> list[tuple[int, ...]]:
    """The groups whose sums must go through the hand-made all-reduce, in call order: dp x cp
    when a non-expert gradient is left to average there, edp when experts are held (groups of one
    rank send nothing)."""
    grid = finish_grid(case)
    held = FINISH_CASES[case]["held"]
    groups = []
    if any(not expert and not reduced for *_, expert, reduced in held):
        groups.append(grid.group_of("dp_cp", rank))
    if any(expert for *_, expert, _ in held):
        groups.append(grid.group_of("edp", rank))
    return [g for g in groups if len(g) > 1]


@exercise("4.7")
@pytest.mark.parametrize("case", list(FINISH_CASES))
def test_finish_gradients_hands_the_data_parallel_sums_to_the_given_all_reduce(case: str) -> None:
    blocked_by(["finish_gradients"])
    parts = world_part("finish_gradients")
    plain = [part[case] for part in parts]
    if any(isinstance(p, dict) and ("todo" in p or "error" in p) for p in plain) or (
        finish_problems(case, plain)
    ):
        pytest.skip(
            "blocked by finish_gradients with torch's all-reduce (fix it first: "
            "test_finish_gradients_reduces_each_gradient_on_its_groups fails on it)"
        )
    results = [part[case + HAND_MADE] for part in parts]
    stop_if_stopped("finish_gradients", results)
    spec, grid = FINISH_CASES[case], finish_grid(case)
    for rank, (got, seen) in enumerate(results):
        for entry in spec["held"]:
            real = held_name(entry[0], grid, rank, entry[4])
            if not same(got[real], plain[rank][0][real]):
                fail_piece(
                    "finish_gradients",
                    f"4.7 finish_gradients, {case}, given all_reduce_fn: rank {rank}'s {real}: "
                    + hand_made_problem(grid, rank, got[real], entry_inputs(case, entry))
                    + at("finish_gradients"),
                )  # fmt: skip
        want_groups = data_parallel_groups(case, rank)
        if sorted(seen) != sorted(want_groups):
            others = [g for g in seen if g not in want_groups]
            missing = [g for g in want_groups if g not in seen]
            fail_piece(
                "finish_gradients",
                f"4.7 finish_gradients, {case}: rank {rank} handed all_reduce_fn (the config's "
                f"communication, a ring or a tree) the groups {sorted(seen)}; expected the "
                f"data-parallel ones {sorted(want_groups)} (dp x cp, and edp for experts)"
                f"{at('finish_gradients')}. "
                + (
                    f"{others} are not data-parallel: like a DDP communication hook (3.4) it "
                    "replaces the data-parallel all-reduce only; the tp and embedding sums keep "
                    "torch's"
                    if others
                    else f"It never saw {missing}: pass it to all_reduce_flat for every "
                    "data-parallel sum (the dense gradients on dp x cp, the experts' on edp)"
                    if missing
                    else "Each data-parallel sum goes through it once."
                ),
            )


_TIE_RUN: list[dict[str, Any]] | None = None


def tie_order_run() -> list[dict[str, Any]]:
    """The dp4 x pp2 world of the tie's order (started once, on first use)."""
    global _TIE_RUN
    if _TIE_RUN is None:
        from grading import world

        needs_earlier_exercises()
        _TIE_RUN = world(tie_order_worker, TIE_WORLD)
    return _TIE_RUN


@exercise("4.7")
def test_finish_gradients_sums_a_tie_so_both_copies_keep_the_same_bits() -> None:
    """dp4 x pp2 with a tied embedding: the two copies (embedding on stage 0, head on stage 1)
    must end with one value and the same bits, since AdamW then updates them apart; at dp = 2,
    where every other tied case runs, any order of the reductions gives the same bits."""
    blocked_by(["finish_gradients"])
    results = tie_order_run()
    stop_if_stopped("finish_gradients", results)
    grid = RankGrid.for_world(TIE_WORLD, TIE_DEGREES["dp"], 1, TIE_DEGREES["pp"])
    expected = tie_expected(grid)
    case = (
        "4.7 finish_gradients, dp4 x pp2 with a tied embedding (embedding group: "
        + " ".join(str(g) for g in grid.groups("embedding"))
        + ")"
    )
    for rank, got in enumerate(results):
        if not torch.allclose(got["grad"], expected, rtol=1e-12, atol=1e-12):
            error = (got["grad"] - expected).abs().max().item()
            fail_piece(
                "finish_gradients",
                f"{case}: rank {rank}'s {got['name']} is off by up to {error:.3g} from the mean "
                "of both ends' gradients over the 4 data-parallel ranks, summed (the cases at "
                "dp2 passed: which sum changes with the number of data-parallel ranks?)"
                f"{at('finish_gradients')}",
            )
    for first in range(TIE_WORLD):
        partner = next(r for r in grid.group_of("embedding", first) if r != first)
        a, b = results[first]["grad"], results[partner]["grad"]
        if first < partner and not torch.equal(a, b):
            differ = int((a != b).sum())
            fail_piece(
                "finish_gradients",
                f"{case}: rank {first}'s embedding.weight and rank {partner}'s head.weight, "
                f"the two copies of one tied weight, hold the right value but not the same bits "
                f"({differ} of {a.numel()} elements differ, by up to "
                f"{(a - b).abs().max().item():.2g}): each stage rounded its sums in its own "
                "order, and AdamW will move the copies apart, step after step (ReplicasDiffer "
                "after a few steps). At dp2 a two-term sum gave the same bits in either order. "
                "Which reduction makes the two copies equal, and does any rounding happen on "
                f"them after it?{at('finish_gradients')}",
            )


@exercise("4.7")
def test_finish_gradients_sums_a_tie_between_the_first_and_last_of_four_stages() -> None:
    """pp4 with a tied embedding: the copies live on stages 0 and 3; stages 1 and 2 hold none.
    At pp2, where the training layouts tie, the pipeline group and the embedding group are the
    same two ranks."""
    from grading import world

    blocked_by(["finish_gradients"])
    needs_earlier_exercises()
    grid = RankGrid.for_world(WORLD, PP4_DEGREES["dp"], 1, PP4_DEGREES["pp"])
    case = (
        f"4.7 finish_gradients, pp4 with a tied embedding (the embedding on rank 0, the head on "
        f"rank 3; embedding group {grid.group_of('embedding', 0)}, pipeline group "
        f"{grid.group_of('pp', 0)})"
    )
    hung: WorldHung | None = None
    try:
        results = world(pp4_tie_worker, WORLD)
    except WorldHung as exc:
        hung = exc  # reported below, not chained to the harness's report
    if hung is not None:
        pipeline = tuple(grid.group_of("pp", 0))
        on_pp = [(op, m) for op, m in hung.unjoined if tuple(op.members) == pipeline]
        if on_pp:
            op, missing = on_pp[0]
            fail_piece(
                "finish_gradients",
                f"{case}: hung. Rank {op.rank} waits in its {op.op} on the whole pipeline group "
                f"{pipeline} ({op.filename.rsplit('/', 1)[-1]}:{op.lineno}), which rank(s) "
                f"{', '.join(map(str, missing))} never enter: they hold no copy of the tied "
                "weight. At pp2 that group held exactly the two copies; which group holds "
                f"exactly the ranks with a copy, whatever the depth?{at('finish_gradients')}",
            )
        fail_piece("finish_gradients", f"{case}: hung.\n{hung}")
    stop_if_stopped("finish_gradients", results)
    first, last = results[0]["embedding.weight"], results[WORLD - 1]["head.weight"]
    want = sum(
        (tie_value(rank, end, TIE_SHAPE) for rank, end in ((0, "embedding.weight"),
                                                           (WORLD - 1, "head.weight"))),
        torch.zeros(TIE_SHAPE, dtype=torch.float64),
    )  # fmt: skip
    for rank, got in ((0, first), (WORLD - 1, last)):
        if not torch.allclose(got, want, rtol=1e-12, atol=1e-12):
            fail_piece(
                "finish_gradients",
                f"{case}: rank {rank}'s tied copy is off by up to "
                f"{(got - want).abs().max().item():.3g} from the sum of both ends' gradients"
                f"{at('finish_gradients')}",
            )
    for rank in (1, 2):
        norm = f"blocks.{rank}.mlp_norm.weight"
        if not torch.equal(results[rank][norm], tie_value(rank, norm, (6,))):
            fail_piece(
                "finish_gradients",
                f"{case}: rank {rank} (a middle stage, no copy of the tie, dp = 1) changed its "
                f"{norm}; with one data-parallel rank nothing should reduce it"
                f"{at('finish_gradients')}",
            )


PLACEMENT_GRID = RankGrid(2, 2, 2, cp=2, ep=2)  # every group of more than one rank
PLACEMENT_CASES = [
    (HeldKind("blocks.0.attention.qkv.weight"), "a tp shard, averaged over dp x cp"),
    (HeldKind("blocks.0.mlp_norm.weight", tp_replicated=True), "a norm, averaged over dp x cp"),
    (HeldKind("embedding.weight", tp_replicated=True, tied=True), "the tied embedding's copy"),
    (HeldKind("head.weight", tp_replicated=True, tied=True), "the tied head's copy"),
    (HeldKind("embedding.weight", tp_replicated=True), "an untied embedding"),
    (HeldKind("head.weight", tp_replicated=True), "an untied head"),
    (HeldKind("blocks.1.mlp.experts.2.fc1.weight", tp_replicated=True, expert=True),
     "an expert's weight"),
    (HeldKind("blocks.0.mlp.down.weight", reduced=True), "a ZeRO slice of a tp shard"),
    (HeldKind("final_norm.weight", tp_replicated=True, reduced=True), "a ZeRO slice of a norm"),
]  # fmt: skip


def placements_message(got: Sequence[frozenset[str] | None]) -> str | None:
    """The failure of gradient_placements, from the ``replicated_on`` it gave every graded
    gradient (None where no GradShard came back), or None when all are right."""
    said = placements_verdict(PLACEMENT_CASES, got)
    return f"4.7 gradient_placements: {said}" if said else None


@exercise("4.7")
def test_gradient_placements_name_every_group_holding_copies() -> None:
    lm = lm_parallel()
    got: list[frozenset[str] | None] = []
    carried: list[tuple[str, bool]] = []
    for kind, what in PLACEMENT_CASES:
        held = HeldGradient(kind.name, torch.zeros(3), kind.tp_replicated, kind.tied,
                            kind.expert, kind.reduced)  # fmt: skip
        try:
            shards = lm.gradient_placements([held], SizesOnly(PLACEMENT_GRID))
        except NotImplementedError:
            piece_failed("gradient_placements", current_test())
            raise
        except Exception as exc:
            fail_piece("gradient_placements", f"4.7 gradient_placements([{what}]) raised "
                       f"{type(exc).__name__}: {exc}{learner_line(exc)}")  # fmt: skip
        got.append(frozenset(shards[0].replicated_on) if shards else None)
        carried.append((held.name, bool(shards) and shards[0].grad is held.grad))
    problem = placements_message(got)
    if problem:
        fail_piece("gradient_placements", f"{problem}{at('gradient_placements')}")
    for name, same_tensor in carried:
        if not same_tensor:
            fail_piece("gradient_placements", f"4.7 gradient_placements: the GradShard of "
                       f"{name} must carry the same tensor (clipping scales it in place)"
                       f"{at('gradient_placements')}")  # fmt: skip


@exercise("4.7")
def test_your_3_6_global_norm_reduces_over_every_axis_of_the_topology() -> None:
    parts = world_part("global_norm")
    # the grader's own norm of the distinct pieces: 2 tp shards (one per tp rank), 1 norm
    pieces = [norm_shard_value(0, n, s, a, {"tp": t, "cp": 0}) for n, s, a in NORM_SHARDS
              for t in ((0, 1) if "tp" not in a else (0,))]  # fmt: skip
    flat = torch.cat([p.reshape(-1) for p in pieces])
    for p, want in ((2.0, float(flat.norm(2))), (float("inf"), float(flat.abs().max()))):
        got = [per_rank[str(p)] for per_rank in parts]
        if all(abs(g - want) <= 1e-12 * want for g in got):
            continue
        where = defined_at(load("phase3_multi_node", "grad_clipping").global_grad_norm)
        fail_piece(
            "your 3.6 global_grad_norm",
            f"4.7 uses your 3.6 global_grad_norm on a cp2 x tp2 topology: the ranks returned "
            f"{', '.join(f'{g:.6g}' for g in got)} for the {p:g}-norm, one process's is "
            f"{want:.6g}{where}. The topology has four axes (course.topology.AXES: pp, dp, cp, "
            "tp) and their groups together span the world: reduce over each of them (3.6's "
            "grader may have run with cp = 1, where a missing cp reduction cannot show)",
        )


# ----------------------------------------------------------------------------- refusals


@pytest.mark.reference
@exercise("4.7")
@pytest.mark.parametrize(
    ("settings", "config", "message"),
    [
        ({"dp": 2, "tp": 3}, DENSE, "tp=3 does not divide heads=4"),
        ({"cp": 3}, DENSE, r"seq_len=16 does not cut into 2 x cp = 6 equal chunks"),
        (
            {"tp": 4, "cp": 2, "sequence_parallel": True},
            replace(DENSE, seq_len=12),
            "do not cut into tp=4 equal shares",
        ),
        ({"dp": 2, "ep": 3}, MOE, "ep=3 does not divide dp=2 x cp=1"),
        ({"dp": 3, "ep": 3}, MOE, "ep=3 does not divide num_experts=4"),
        ({"pp": 8}, DENSE, "4 layers cannot fill 8 pipeline stages"),
        ({"dp": 2, "ep": 2}, DENSE, "ep=2 with no MoE layer"),
        ({"dp": 2, "zero": 2}, MOE, "zero=2 with MoE layers"),
        (
            {"pp": 2, "dp": 2, "zero": 3, "schedule": "zb-h1", "microbatches": 2},
            DENSE,
            "zero=3 with schedule=zb-h1",
        ),
        ({"schedule": "zigzag"}, DENSE, "schedule='zigzag': choose one of"),
        ({"zero": 4}, DENSE, "zero=4: choose 0"),
    ],
)
def test_settings_that_cannot_run_are_refused_by_name(
    settings: dict[str, Any], config: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelSettings(**settings).check(ParallelSettings(**settings).world_size, config, 8)


@pytest.mark.reference
@exercise("4.7")
def test_a_layout_for_another_world_size_is_refused() -> None:
    with pytest.raises(ValueError, match=r"dp2 x tp2 = 4 ranks, but the world has 8"):
        ParallelSettings(dp=2, tp=2).check(8, DENSE)
    with pytest.raises(
        ValueError, match="global batch 6 does not divide by dp=2 x 2 micro-batches"
    ):
        ParallelSettings(dp=2, pp=2, microbatches=2).check(8, DENSE, 6)
