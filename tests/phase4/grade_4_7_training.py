"""Exercise 4.7, training on every axis: ``uv run pytest tests/test_phase4.py -m ex4_7``.

The language model of course/language_model.py (tiny, float64; MoE on layers 1-2 where a layout
has experts) trains 3 AdamW steps on a global batch of 8 sequences whose targets are masked
unevenly (replicas and context shards hold different numbers of valid targets). One process
computes the reference; every layout must give, at every step, the same cross-entropy, balance
loss, gradient norm (where it clips) and count of valid targets, and on every rank its pieces of
the same parameters (relative 1e-10). The layouts, one world per world size, run one after the
other in it:

* 2 ranks, each axis alone: dp2 (clipped), tp2 (tied), tp2 with sequence parallelism (clipped),
  pp2 1F1B (tied across the two stages), cp2 (clipped), ep2 over dp2 (MoE, clipped), pp2 zb-v
  (tied, the V holds both ends on one rank), dp2 with 3.2's halving-doubling as its all-reduce
  (tied), cp2 with every layer recomputed in backward (2.3's checkpoint; tied);
* 4 ranks: pp2 x cp2 x ep2 (MoE, tied), dp4 x ep4 (MoE, clipped), pp2 interleaved x tp2 (tied,
  clipped), pp4 ZB-H1 (clipped), dp2 x cp2 ZeRO-2 (tied, clipped), dp2 x pp2 ZeRO-1 (tied),
  dp2 x cp2 with 3.1's ring as its all-reduce (clipped), pp2 x tp2+sp recomputed (clipped);
* 8 ranks: dp2 x tp2 x pp2 (tied, clipped), cp2 x tp2 x pp2, dp2 x cp2 x tp2 with sequence
  parallelism (tied, clipped), ZeRO-3 x tp2 x pp2 (tied, clipped), FSDP-style x tp2 x pp2
  (clipped).

A wrong first loss (before any update) points at the forward (positions, the regions, the loss's
normalization); a right first loss with wrong parameters afterwards names the parameters that
differ and the ranks that hold them, by kind (norms, tied copies, experts, shards).
"""

from __future__ import annotations

import pytest
from grading import exercise, impl, world
from lm_helpers import (
    STEPS,
    TOLERANCE,
    Layout,
    RankRun,
    expected_piece,
    layout,
    reference,
    relative_error,
    run_layouts,
)
from phase4_helpers import fail

from course.impl import unwritten_todo
from course.world import WorldHung, world_timeout
from phase4_production.lm_functions import COMPOSITION_MODULES

CLIP = 0.05
WORLDS: dict[int, list[Layout]] = {
    2: [
        layout(dp=2, max_norm=CLIP),
        layout(tp=2, tied=True),
        layout(tp=2, sequence_parallel=True, max_norm=CLIP),
        layout(pp=2, microbatches=2, tied=True),
        layout(cp=2, max_norm=CLIP),
        layout(dp=2, ep=2, moe=True, max_norm=CLIP),
        layout(pp=2, schedule="zb-v", microbatches=2, tied=True),
        layout(dp=2, communication="tree", tied=True),
        layout(cp=2, activation_checkpointing=True, tied=True),
    ],
    4: [
        layout(pp=2, cp=2, ep=2, microbatches=2, moe=True, tied=True),
        layout(dp=4, ep=4, moe=True, max_norm=CLIP),
        layout(pp=2, tp=2, schedule="interleaved", microbatches=2, tied=True, max_norm=CLIP),
        layout(pp=4, schedule="zb-h1", microbatches=4, max_norm=CLIP),
        layout(dp=2, cp=2, zero=2, tied=True, max_norm=CLIP),
        layout(dp=2, pp=2, zero=1, microbatches=2, tied=True),
        layout(dp=2, cp=2, communication="ring", max_norm=CLIP),
        layout(pp=2, tp=2, sequence_parallel=True, microbatches=2, activation_checkpointing=True,
               max_norm=CLIP),
    ],
    8: [
        layout(dp=2, tp=2, pp=2, microbatches=2, tied=True, max_norm=CLIP),
        layout(cp=2, tp=2, pp=2, microbatches=2),
        layout(dp=2, cp=2, tp=2, sequence_parallel=True, tied=True, max_norm=CLIP),
        layout(dp=2, tp=2, pp=2, microbatches=2, zero=3, tied=True, max_norm=CLIP),
        layout(dp=2, tp=2, pp=2, microbatches=2, zero="fsdp", max_norm=CLIP),
    ],
}
CASES = [(size, index) for size, layouts in WORLDS.items() for index in range(len(layouts))]
_RUNS: dict[int, list[list[RankRun]] | BaseException] = {}

HANG_ADVICE = (
    "The ranks hung. In a composition the usual cause is a collective on a group that other "
    "ranks reach with another collective, or not at all: a reduction over the world where a "
    "group was meant, a count or a gradient reduced on some stages only (every rank of a group "
    "must call it), or a stage that raised while its neighbours wait for its activations. "
    "Where each rank stood:\n"
)


def needs_every_piece() -> None:
    """Stop before any world at the first unwritten TODO the composition would run into."""
    for phase, module in COMPOSITION_MODULES:
        todo = unwritten_todo(phase, module, impl())
        if todo is not None:
            raise NotImplementedError(f"4.7 needs {todo}" if "4.7" not in todo else todo)


def runs(size: int) -> list[list[RankRun]]:
    """Per rank, one RankRun per layout of the world of ``size`` (started on first use)."""
    needs_every_piece()
    if size not in _RUNS:
        try:
            # several layouts in one world: a longer deadline than one exercise's world
            _RUNS[size] = world(run_layouts, size, WORLDS[size], timeout=3 * world_timeout())
        except WorldHung as exc:
            exc.args = (f"4.7, the layouts of {size} ranks: {HANG_ADVICE}{exc}",)
            _RUNS[size] = exc
        except BaseException as exc:
            _RUNS[size] = exc
    result = _RUNS[size]
    if isinstance(result, BaseException):
        raise result
    return result


def kind_of(name: str) -> str:
    if name in ("embedding.weight", "head.weight"):
        return "embedding/head"
    if name.endswith("norm.weight"):
        return "norm"
    if ".experts." in name:
        return "expert"
    if ".router." in name:
        return "router"
    return "tp shard"


ADVICE = {
    "norm": ("the norms (and other weights whole on every tp rank) differ: under sequence "
             "parallelism their gradients must be summed over tp, without it they must not"),
    "embedding/head": ("the embedding or head differ: with a tied head on two stages both copies "
                       "must add their gradients (the embedding group)"),
    "expert": ("the experts differ: their gradients are summed over edp and divided by the dp x "
               "cp size"),
    "router": "the router differs: it is averaged over dp x cp like every non-expert weight",
    "tp shard": ("the tensor-parallel shards differ: every non-expert gradient is averaged over "
                 "dp x cp (dp alone misses the cp ranks)"),
}  # fmt: skip


def layout_problems(lay: Layout, per_rank: list[RankRun]) -> list[str]:
    ref = reference(lay)
    for run in per_rank:
        if run.error is not None:
            raise NotImplementedError(run.error)
    for step in range(STEPS):
        want_ce, want_balance = ref.losses[step]
        ce, balance, norm, valid = per_rank[0].reports[step]
        what = "before any update: the forward or the loss" if step == 0 else f"step {step}"
        if abs(ce - want_ce) > TOLERANCE * abs(want_ce):
            return [
                f"the cross-entropy of step {step} is {ce:.12g}; one process's is "
                f"{want_ce:.12g} ({what}: positions under cp, the tensor-parallel regions, "
                "loss_share or count_valid_tokens)"
                if step == 0 else
                f"the cross-entropy of step {step} is {ce:.12g}; one process's is {want_ce:.12g}: "
                "the step before updated the weights differently (the gradients' reductions)"
            ]  # fmt: skip
        if abs(balance - want_balance) > TOLERANCE * max(abs(want_balance), 1e-30):
            return [
                f"the balance loss of step {step} is {balance:.12g}; one process's is "
                f"{want_balance:.12g} (balance_loss_share: the counts of whole sequences, each "
                "rank's own part of P, scaled like loss_share)"
            ]
        if valid != ref.valid[step]:
            return [
                f"step {step} counted {valid} valid targets; the global batch holds "
                f"{ref.valid[step]} (count_valid_tokens)"
            ]
        want_norm = ref.norms[step]
        if want_norm is not None and (norm is None or abs(norm - want_norm) > 1e-9 * want_norm):
            return [
                f"the gradient norm of step {step} is {norm}; one process's clip_grad_norm_ "
                f"returns {want_norm:.12g} (gradient_placements: every distinct gradient counted "
                "once; or the gradients were not complete before clipping)"
            ]
        if len({r.reports[step] for r in per_rank}) != 1:
            return [f"step {step}: the ranks reported different losses: every rank must see the "
                    "same report"]  # fmt: skip
        problems = []
        for rank, run in enumerate(per_rank):
            pp, dp, cp, tp = run.coords
            wrong = []
            for name, (how, parts) in run.pieces.items():
                want = expected_piece(ref.states[step][name], how, parts, tp, run.tp_size)
                if relative_error(run.states[step][name], want) > TOLERANCE:
                    wrong.append(name)
            if wrong:
                kinds = sorted({kind_of(n) for n in wrong})
                names = ", ".join(wrong[:3]) + (
                    f" and {len(wrong) - 3} more" if len(wrong) > 3 else ""
                )
                advice = "; ".join(ADVICE[k] for k in kinds)
                problems.append(
                    f"rank {rank} (pp={pp}, dp={dp}, cp={cp}, tp={tp}) after step {step}: "
                    f"{names} differ from its pieces of one process's parameters: {advice}"
                )
        if problems:
            return problems
    return []


@exercise("4.7")
@pytest.mark.parametrize(
    ("size", "index"), CASES, ids=[WORLDS[s][i].label.replace(" ", "") for s, i in CASES]
)
def test_layout_trains_like_one_process(size: int, index: int) -> None:
    per_rank = [rank_runs[index] for rank_runs in runs(size)]
    lay = WORLDS[size][index]
    problems = layout_problems(lay, per_rank)
    if problems:
        unique = list(dict.fromkeys(problems))
        fail(
            f"4.7 {lay.label} ({size} ranks), against one process in float64:\n  "
            + "\n  ".join(unique[:4])
            + (f"\n  ... and {len(unique) - 4} more" if len(unique) > 4 else "")
        )
