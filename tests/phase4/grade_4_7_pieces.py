"""Exercise 4.7, the pieces of the composition: ``uv run pytest tests/test_phase4.py -m ex4_7``.

Each function you write is first tried alone, on chosen inputs, before the training grader
(``grade_4_7_training.py``) runs whole layouts; a wrong group or a wrong normalization is named
here, where it is still one function:

* ``token_positions`` in this process: every rank's true positions under zig-zag for cp 1, 2, 4
  (local indices are named as such);
* ``all_gather_sequence``, ``reduce_scatter_sequence``, ``enter_tensor_parallel`` and
  ``leave_tensor_parallel`` on a tp group of 4, with and without sequence parallelism: values and
  the gradients that reach the input (f/g where sequence parallelism is off);
* ``count_valid_tokens`` with uneven masks on dp2 x cp2 and cp2 x tp2 (a rank's own count, dp
  only, and tp copies counted are named);
* ``loss_share`` in this process against the sum over valid targets / the global count x dp x cp
  (a mean of per-rank means is named);
* ``balance_loss_share`` on dp2 x cp2 and cp2 x tp2 (with and without sequence parallelism): the
  shares add up to one process's per-sequence balance loss, and their gradients to its gradient
  (a whole sequence's loss on every cp or tp rank is named);
* ``finish_gradients`` on synthetic gradients: dp2 x cp2 with experts on ep2, dp2 x tp2 with and
  without sequence parallelism (ZeRO slices among them), pp2 x dp2 with a tied embedding; each
  wrong group (cp forgotten, norms not summed over tp, the tie not summed, experts divided by
  their group's size) is named;
* ``gradient_placements`` in this process, for every kind of gradient.

Settings that cannot run are refused before any process starts (a reference check: the
refusals are given code).
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from grading import exercise, impl
from lm_helpers import DENSE, MOE, lm_parallel
from lm_pieces_helpers import (
    BATCH,
    EXPERTS,
    FINISH_CASES,
    HAND_MADE,
    NORM_SHARDS,
    SEQ,
    SP_SHAPE,
    balance_reference,
    count_targets,
    expected_finish,
    local_slice,
    norm_shard_value,
    pieces_worker,
    sp_input,
    sp_share,
    sp_weight,
    zigzag_positions,
)
from phase4_helpers import fail

from course.impl import unwritten_todo
from course.language_model import IGNORE_INDEX
from course.world import WorldHung
from phase4_production.lm_layout import ParallelSettings
from phase4_production.lm_support import HeldGradient

PHASE = "phase4_production"
TOLERANCE = 1e-12
# the earlier exercises the pieces use: 2.6's f and g, 2.7's layout, 3.6's global norm
NEEDED = [
    ("phase2_advanced", "tensor_parallel_ops"),
    ("phase2_advanced", "context_parallel_layout"),
    ("phase3_multi_node", "grad_clipping"),
]
_WORLD: list[dict[str, Any]] | BaseException | None = None


def needs_earlier_exercises() -> None:
    """Stop at the first unwritten TODO of an earlier exercise these pieces call, by name."""
    for phase, module in NEEDED:
        todo = unwritten_todo(phase, module, impl())
        if todo is not None:
            raise NotImplementedError(f"4.7 needs {todo}")


def world_part(name: str) -> Any:
    """One part of the shared world of 4 (started on first use), per rank; a TODO the part
    stopped at is raised here."""
    global _WORLD
    needs_earlier_exercises()
    if _WORLD is None:
        from grading import world

        try:
            _WORLD = world(pieces_worker, 4)
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
    if isinstance(parts[0], dict) and "todo" in parts[0]:
        raise NotImplementedError(parts[0]["todo"])
    errors = [(r, p) for r, p in enumerate(parts) if isinstance(p, dict) and "error" in p]
    if errors:
        rank, part = errors[0]
        where = "\n  at ".join(part["where"])
        fail(
            f"4.7 ({name}): rank {rank} raised {part['error']}"
            + (f"\n  at {where}" if where else "")
        )
    return parts


def merge_ranks(problems: list[str]) -> list[str]:
    """``rank r: remark`` lines with the same remark merged into one naming every rank."""
    ranks: dict[str, list[str]] = {}
    for problem in problems:
        head, sep, text = problem.partition(": ")
        if not sep or not head.startswith("rank "):
            head, text = "", problem
        ranks.setdefault(text, []).append(head.removeprefix("rank "))
    lines = []
    for text, who in ranks.items():
        named = [w for w in who if w]
        prefix = f"rank{'s' if len(named) > 1 else ''} {', '.join(named)}: " if named else ""
        lines.append(prefix + text)
    return lines


def close(a: torch.Tensor, b: torch.Tensor, tol: float = TOLERANCE) -> bool:
    if a.shape != b.shape:
        return False
    return bool((a.double() - b.double()).abs().max() <= tol * max(1.0, float(b.abs().max())))


# ----------------------------------------------------------------------------- positions


@exercise("4.7")
def test_token_positions_are_the_tokens_true_places_under_zigzag() -> None:
    lm = lm_parallel()
    problems = []
    for seq, cp in ((16, 1), (16, 2), (24, 2), (16, 4)):
        for rank in range(cp):
            want = zigzag_positions(seq, rank, cp)
            got = lm.token_positions(seq, rank, cp)
            got_list = got.tolist() if isinstance(got, torch.Tensor) else got
            if isinstance(got, torch.Tensor) and got.dtype == torch.int64 and got_list == want:
                continue
            if got_list == list(range(seq // cp)) and cp > 1:
                why = (
                    f"its local indices 0..{seq // cp - 1}: the rotary angles would treat rank {rank}'s tokens as "
                    "the start of the sequence, so q·k of two tokens would see a distance that "
                    "is not theirs"
                )
            elif got_list == list(range(rank * seq // cp, (rank + 1) * seq // cp)):
                why = "the contiguous layout's positions: the tokens were sharded zig-zag (2.7)"
            elif sorted(got_list) == sorted(want):
                why = "the right positions in another order: the i-th position must be the i-th local token's"
            else:
                why = "positions this rank does not hold"
            dtype = got.dtype if isinstance(got, torch.Tensor) else type(got).__name__
            problems.append(
                f"token_positions(seq_len={seq}, cp_rank={rank}, cp={cp}) returned {got_list} "
                f"({dtype}); rank {rank} holds zig-zag chunks {[rank, 2 * cp - 1 - rank]}, whose "
                f"positions are {want} (int64): {why}"
            )
            break
    if problems:
        fail("4.7 token_positions:\n  " + "\n  ".join(problems[:3]))


# ----------------------------------------------------------------------------- sequence parallel


def _sp_expectations(rank: int, tp: int = 4) -> dict[str, Any]:
    tokens = SP_SHAPE[1]
    whole = [sp_input(r, tokens=tp * tokens) for r in range(tp)]
    summed = sum(whole, torch.zeros_like(whole[0]))
    gathered = torch.cat([sp_input(r) for r in range(tp)], dim=1)
    weights_whole = [sp_weight(r, tp * tokens) for r in range(tp)]
    weights_share = [sp_weight(r, tokens) for r in range(tp)]
    grad_enter_sp = sum(w[:, rank * tokens : (rank + 1) * tokens] for w in weights_whole)
    return {
        "all_gather": gathered,
        "reduce_scatter": sp_share(summed, rank, tp),
        "enter_True": (gathered, grad_enter_sp),
        "leave_True": (sp_share(summed, rank, tp), torch.cat(weights_share, dim=1)),
        "enter_False": (whole[rank], sum(weights_whole, torch.zeros_like(whole[0]))),
        "leave_False": (summed, weights_whole[rank]),
    }


@exercise("4.7")
def test_sequence_collectives_gather_and_reduce_scatter_along_the_sequence() -> None:
    parts = world_part("sequence_collectives")
    problems = []
    for rank, got in enumerate(parts):
        want = _sp_expectations(rank)
        gathered = got["all_gather"]
        if not close(gathered, want["all_gather"]):
            if gathered.shape == (SP_SHAPE[0] * 4, *SP_SHAPE[1:]):
                why = "the shares were stacked along dimension 0 (the batch): the sequence is dimension 1"
            elif gathered.shape == want["all_gather"].shape:
                why = "the right shape, other values: the shares must be side by side in group-rank order"
            else:
                why = f"shape {tuple(gathered.shape)}, expected {tuple(want['all_gather'].shape)}"
            problems.append(f"rank {rank}: all_gather_sequence of [4, 3, 5] shares on tp=4: {why}")
        scattered = got["reduce_scatter"]
        if not close(scattered, want["reduce_scatter"]):
            if scattered.shape[0] != SP_SHAPE[0]:
                why = f"shape {tuple(scattered.shape)}: the cut must be along the sequence (dimension 1), not the batch"
            elif close(
                scattered, sp_input(rank, tokens=4 * SP_SHAPE[1])[:, rank * 3 : rank * 3 + 3]
            ):
                why = "this rank's own share of its own input: the shares must be SUMMED over the group"
            else:
                why = "the sum over the group of every rank's input, this rank's contiguous share of the sequence (tokens [3r, 3r+3))"
            problems.append(f"rank {rank}: reduce_scatter_sequence of [4, 12, 5] on tp=4: {why}")
        if not got["input_unchanged"]:
            problems.append(f"rank {rank}: reduce_scatter_sequence changed its input in place")
    if problems:
        fail("4.7 sequence-parallel collectives:\n  " + "\n  ".join(merge_ranks(problems)[:4]))


@exercise("4.7")
@pytest.mark.parametrize("sp", [True, False], ids=["with-sp", "without-sp"])
def test_tensor_parallel_regions_enter_and_leave_with_the_right_collectives(sp: bool) -> None:
    parts = world_part("regions")
    problems = []
    mode = "with sequence parallelism" if sp else "without sequence parallelism"
    for rank, got in enumerate(parts):
        want = _sp_expectations(rank)
        for which, role in (("enter", "enter_tensor_parallel"), ("leave", "leave_tensor_parallel")):
            out, grad = got[f"{which}_{sp}"]
            want_out, want_grad = want[f"{which}_{sp}"]
            if not close(out, want_out):
                if which == "enter" and sp:
                    why = (
                        f"output of shape {tuple(out.shape)}: a column-parallel layer needs the "
                        "whole sequence, gathered from every tp rank's share (in group-rank order)"
                    )
                elif which == "enter":
                    why = "its forward must be the identity (2.6's f): every rank already holds the whole x"
                elif sp:
                    why = (
                        f"output of shape {tuple(out.shape)}: the row-parallel partial sums, summed "
                        "over the group, this rank's share of the tokens (a reduce-scatter)"
                    )
                else:
                    why = "the sum over the group of every rank's partial output (2.6's g)"
                problems.append(f"rank {rank}: {role}(..., sequence_parallel={sp}): {why}")
                continue
            if grad is None or not close(grad, want_grad):
                if which == "enter":
                    why = (
                        "the gradient reaching x must SUM every rank's contribution (each rank's "
                        "weight slice used all of x)"
                        + (", this rank's share of the tokens" if sp else "")
                    )
                else:
                    why = (
                        "every rank's partial must receive the gradient of the whole sequence"
                        if sp
                        else "the gradient of a replicated sum is the same on every rank: nothing to reduce"
                    )
                problems.append(f"rank {rank}: {role}(..., sequence_parallel={sp}) backward: {why}")
    if problems:
        fail(
            f"4.7 tensor-parallel regions {mode} (tp=4):\n  "
            + "\n  ".join(merge_ranks(problems)[:4])
        )


# ----------------------------------------------------------------------------- counts and loss


@exercise("4.7")
def test_count_valid_tokens_counts_the_whole_batch_once() -> None:
    parts = world_part("count_valid_tokens")
    targets = count_targets()
    want = int((targets != IGNORE_INDEX).sum())
    problems = []
    for label, (dp, cp, tp) in (("dp2 x cp2", (2, 2, 1)), ("cp2 x tp2", (1, 2, 2))):
        locals_ = [per_rank[label][1] for per_rank in parts]

        def coord(r: int, dp: int = dp, cp: int = cp, tp: int = tp) -> tuple[int, int, int]:
            return (r // (cp * tp)) % dp, (r // tp) % cp, r % tp  # (dp, cp, tp), tp fastest

        for rank, per_rank in enumerate(parts):
            got, own = per_rank[label]
            if got == want:
                continue
            d, c, t = coord(rank)
            dp_only = sum(locals_[q] for q in range(4) if coord(q)[1:] == (c, t))
            cp_only = sum(locals_[q] for q in range(4) if (coord(q)[0], coord(q)[2]) == (d, t))
            if got == own:
                why = (
                    "its own count: a mean over this rank's targets gives a rank with few valid "
                    "targets the weight of one with many; sum the counts of the ranks holding "
                    "other targets"
                )
            elif dp > 1 and got == dp_only:
                why = "summed over dp only: the cp ranks hold the other positions of the same sequences"
            elif cp > 1 and got == cp_only:
                why = "summed over cp only: the dp ranks hold other sequences"
            elif got == sum(locals_):
                why = (
                    f"summed over all 4 ranks: the {tp} tp ranks of a position hold the same "
                    "targets and were counted tp times"
                )
            else:
                why = "neither this rank's count nor a sum over one group"
            problems.append(
                f"{label}: rank {rank} returned {got}; the global batch holds {want} valid "
                f"targets: {why}"
            )
            break
    if problems:
        fail("4.7 count_valid_tokens (uneven masks):\n  " + "\n  ".join(problems))


@exercise("4.7")
def test_loss_share_is_the_ranks_sum_over_the_global_count() -> None:
    lm = lm_parallel()
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 8, 256, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 256, (2, 8), generator=g)
    targets[0, 3:] = IGNORE_INDEX
    local_valid = int((targets != IGNORE_INDEX).sum())
    summed = F.cross_entropy(logits.view(-1, 256), targets.view(-1), ignore_index=IGNORE_INDEX,
                             reduction="sum")  # fmt: skip
    for dp_cp, global_valid in ((1, local_valid), (4, 37), (8, 101)):
        topology = SimpleNamespace(size_of=lambda name, n=dp_cp: n if name == "dp_cp" else 1)
        got = lm.loss_share(logits, targets, global_valid, topology)
        want = summed * dp_cp / global_valid
        if isinstance(got, torch.Tensor) and got.dim() == 0 and close(got, want):
            continue
        value = float(got) if isinstance(got, torch.Tensor) and got.numel() == 1 else got
        mean_of_means = float(summed / local_valid)
        if isinstance(value, float) and abs(value - mean_of_means) < 1e-9 * abs(mean_of_means):
            why = (
                "the mean over this rank's own valid targets: with uneven counts a mean of the "
                "ranks' means is not the mean over the batch; divide the sum by the GLOBAL count"
            )
        elif isinstance(value, float) and abs(value - float(summed / global_valid)) < 1e-9:
            why = (
                f"the share of the global mean, not scaled for the average over dp x cp = "
                f"{dp_cp} ranks that its gradients go through: they would be {dp_cp}x too small"
            )
        elif isinstance(value, float) and abs(value - mean_of_means * dp_cp) < 1e-9 * abs(value):
            why = "a local mean times dp x cp: still a mean of per-rank means"
        else:
            why = "expected (sum of the cross-entropy over this rank's valid targets) x dp_cp / global count"
        fail(
            f"4.7 loss_share(8 tokens of which {local_valid} valid, global_valid={global_valid}, "
            f"dp x cp = {dp_cp}) returned {value}; expected {float(want):.10g}: {why}"
        )


@exercise("4.7")
def test_balance_loss_shares_add_up_to_one_process_balance_loss() -> None:
    parts = world_part("balance_loss_share")
    want, want_grad = balance_reference()
    problems = []
    layouts = (
        ("dp2 x cp2", (2, 2, 1), False),
        ("cp2 x tp2 with sequence parallelism", (1, 2, 2), True),
        ("cp2 x tp2 without sequence parallelism", (1, 2, 2), False),
    )
    for label, (dp, cp, tp), sp in layouts:
        shares = [per_rank[label][0] for per_rank in parts]
        # ranks holding other tokens: dp x cp, and tp under sequence parallelism
        holders = [r for r in range(4) if sp or r % tp == 0]
        total = sum(shares[r] for r in holders) / (dp * cp)
        if abs(total - want) > 1e-10 * abs(want):
            ratio = total / want if want else float("nan")
            if abs(ratio - cp) < 1e-6 or (sp and abs(ratio - cp * tp) < 1e-6):
                why = (
                    "every rank holding tokens of a sequence added that whole sequence's loss: "
                    "sum the COUNTS over those ranks, but let each add only its own tokens' part of P"
                )
            elif abs(ratio * dp * cp - 1) < 1e-6:
                why = "the shares were not scaled by dp x cp for the gradient average (as loss_share is)"
            elif abs(ratio - 1 / cp) < 1e-3 or abs(ratio - 1 / (cp * tp)) < 1e-3:
                why = (
                    "f came from this rank's tokens only: f needs the counts of the whole sequence "
                    "(summed over the ranks holding its other tokens)"
                )
            else:
                why = "the per-sequence loss E · sum_e f[e]·P[e], averaged over the global batch's sequences"
            problems.append(
                f"{label}: the shares, summed over the ranks holding other tokens and divided by "
                f"dp x cp, give {total:.10g}; one process's balance loss is {want:.10g} "
                f"({ratio:.3g}x): {why}"
            )
            continue
        for rank, per_rank in enumerate(parts):
            grad = per_rank[label][1]
            coords_dp, coords_cp, coords_tp = (rank // (cp * tp)) % dp, (rank // tp) % cp, rank % tp
            mine = local_slice(want_grad, coords_dp, dp, coords_cp, cp)
            if sp:
                mine = sp_share(mine, coords_tp, tp)
            if grad is None or not close(grad, mine * dp * cp, 1e-10):
                problems.append(
                    f"{label}: rank {rank}'s gradient with respect to its probabilities is not its "
                    "part of one process's gradient (times dp x cp): only the P-part may carry a "
                    "gradient, the counts f carry none"
                )
                break
    if problems:
        fail(f"4.7 balance_loss_share ({BATCH} sequences of {SEQ} tokens, {EXPERTS} experts):\n  "
             + "\n  ".join(problems[:3]))  # fmt: skip


# ----------------------------------------------------------------------------- gradients


def _finish_mistakes(case: str, grids: dict[int, Any], rank: int, name: str,
                     got: torch.Tensor) -> str:  # fmt: skip
    """Name the mistake a wrong gradient after finish_gradients matches."""
    spec = FINISH_CASES[case]
    place = grids[rank]
    want = expected_finish(case, grids, rank)[name]
    entry = next(h for h in spec["held"] if h[0] in (name, "TIED") or (h[4] and "experts" in name))
    _, _, tp_rep, tied, expert, reduced = entry
    if close(got, want * len(place["dp_cp"])):
        return "summed but not divided by the dp x cp size (the reductions of the course average)"
    if expert and close(got, want * len(place["dp_cp"]) / len(place["edp"])):
        return (
            "divided by the edp group's size: an expert's gradient already holds its ep "
            "group's tokens, so the mean over every rank's loss divides by the dp x cp size"
        )
    if reduced and not close(got, want):
        return "this slice was averaged by ZeRO during backward already: leave dp x cp alone"
    if spec["sp"] and tp_rep and len(place["tp"]) > 1:
        return (
            "under sequence parallelism each tp rank computed this replicated weight's "
            "gradient from its own share of the tokens: sum it over the tp group"
        )
    if not spec["sp"] and tp_rep and len(place["tp"]) > 1:
        return (
            "without sequence parallelism every tp rank computed this weight from the same "
            "tokens: its gradient is complete, summing it over tp counts it tp times"
        )
    if tied:
        return (
            "the two copies of the tied embedding (first and last stage) must both hold the "
            "sum of both uses: all-reduce over the embedding group"
        )
    return (
        "averaged over the wrong ranks: the non-expert gradients over dp x cp (the ranks "
        "holding the same weights and other tokens: with cp > 1, dp alone misses the cp ranks)"
    )


@exercise("4.7")
@pytest.mark.parametrize("case", list(FINISH_CASES))
def test_finish_gradients_reduces_each_gradient_on_its_groups(case: str) -> None:
    parts = world_part("finish_gradients")
    grids = {rank: per_rank[case][0] for rank, per_rank in enumerate(parts)}
    for rank, per_rank in enumerate(parts):
        got = per_rank[case][1]
        for name, want in expected_finish(case, grids, rank).items():
            if not close(got[name], want):
                fail(
                    f"4.7 finish_gradients, {case}: rank {rank}'s {name} is not complete: "
                    f"{_finish_mistakes(case, grids, rank, name, got[name])}"
                )


def data_parallel_groups(case: str, place: dict[str, Any]) -> list[tuple[int, ...]]:
    """The groups whose sums must go through the hand-made all-reduce, in call order: dp x cp
    when a non-expert gradient is left to average there, edp when experts are held (groups of one
    rank send nothing)."""
    held = FINISH_CASES[case]["held"]
    groups = []
    if any(not expert and not reduced for *_, expert, reduced in held):
        groups.append(tuple(place["dp_cp"]))
    if any(expert for *_, expert, _ in held):
        groups.append(tuple(place["edp"]))
    return [g for g in groups if len(g) > 1]


@exercise("4.7")
@pytest.mark.parametrize("case", list(FINISH_CASES))
def test_finish_gradients_hands_the_data_parallel_sums_to_the_given_all_reduce(case: str) -> None:
    parts = world_part("finish_gradients")
    grids = {rank: per_rank[case][0] for rank, per_rank in enumerate(parts)}
    for rank, per_rank in enumerate(parts):
        place, got, seen = per_rank[case + HAND_MADE]
        for name, want in expected_finish(case, grids, rank).items():
            if not close(got[name], want):
                fail(
                    f"4.7 finish_gradients, {case}, given all_reduce_fn: rank {rank}'s {name} is "
                    "not complete, although it is with torch's all-reduce: hand the buffer to "
                    "all_reduce_flat(..., all_reduce_fn=...) and let it reduce in place"
                )
        want_groups = data_parallel_groups(case, place)
        if sorted(seen) != sorted(want_groups):
            others = [g for g in seen if g not in want_groups]
            missing = [g for g in want_groups if g not in seen]
            fail(
                f"4.7 finish_gradients, {case}: rank {rank} handed all_reduce_fn (the config's "
                f"communication, a ring or a tree) the groups {sorted(seen)}; expected the "
                f"data-parallel ones {sorted(want_groups)} (dp x cp, and edp for experts). "
                + (
                    f"{others} are not data-parallel: like a DDP communication hook (3.4) it "
                    "replaces the data-parallel all-reduce only; the tp and embedding sums keep "
                    "torch's"
                    if others
                    else f"It never saw {missing}: pass it to all_reduce_flat for every "
                    "data-parallel sum (the dense gradients on dp x cp, the experts' on edp)"
                    if missing
                    else "Each data-parallel sum goes through it once."
                )
            )


@exercise("4.7")
def test_gradient_placements_name_every_group_holding_copies() -> None:
    lm = lm_parallel()
    cases = [
        (HeldGradient("blocks.0.attention.qkv.weight", torch.zeros(1)), {"dp_cp"},
         "a tp shard, averaged over dp x cp: every dp x cp rank holds the same shard"),
        (HeldGradient("blocks.0.mlp_norm.weight", torch.zeros(1), tp_replicated=True),
         {"dp_cp", "tp"}, "a norm: whole on every tp rank and every dp x cp rank"),
        (HeldGradient("embedding.weight", torch.zeros(1), tp_replicated=True, tied=True),
         {"dp_cp", "tp", "embedding"}, "a tied copy: also on the other end of the pipeline"),
        (HeldGradient("blocks.1.mlp.experts.2.fc1.weight", torch.zeros(1), tp_replicated=True,
                      expert=True), {"edp", "tp"},
         "an expert: its copies are its edp group's ranks (the other ranks of dp x cp hold other experts)"),
        (HeldGradient("blocks.0.mlp.down.weight", torch.zeros(1), reduced=True), set(),
         "a ZeRO slice: every dp x cp rank holds another slice"),
        (HeldGradient("final_norm.weight", torch.zeros(1), tp_replicated=True, reduced=True),
         {"tp"}, "a ZeRO slice of a norm: the tp ranks hold the same slice"),
    ]  # fmt: skip
    topology = SimpleNamespace()
    for held, want, what in cases:
        shards = lm.gradient_placements([held], topology)
        got = set(shards[0].replicated_on) if shards else None
        if got != want:
            missing, extra = sorted(want - (got or set())), sorted((got or set()) - want)
            detail = (f"missing {missing} (a copy counted several times)" if missing else "") + (
                f"{'; ' if missing else ''}extra {extra} (distinct pieces dropped from the norm)"
                if extra else "")  # fmt: skip
            fail(
                f"4.7 gradient_placements: {held.name} ({what}) got replicated_on="
                f"{sorted(got) if got is not None else None}, expected {sorted(want)}: {detail}"
            )
        if shards and shards[0].grad is not held.grad:
            fail(f"4.7 gradient_placements: the GradShard of {held.name} must carry the same "
                 "tensor (clipping scales it in place)")  # fmt: skip


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
        fail(
            f"4.7 uses your 3.6 global_grad_norm on a cp2 x tp2 topology: the ranks returned "
            f"{', '.join(f'{g:.6g}' for g in got)} for the {p:g}-norm, one process's is "
            f"{want:.6g}. The topology has four axes (course.topology.AXES: pp, dp, cp, tp) and "
            "their groups together span the world: reduce over each of them (3.6's grader ran "
            "with cp = 1, where a missing cp reduction cannot show)"
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
