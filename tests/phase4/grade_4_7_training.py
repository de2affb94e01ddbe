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

Each step is checked in the order things happen: the count of valid targets, the losses (before
any update they point at the forward: positions under cp, the regions under tp, the loss's
normalization), the gradients ``finish_gradients`` left (compared with one process's, piece by
piece, ZeRO slices aside), the gradient norm (with right gradients a wrong norm is the
placements'), then the parameters. Every message names the functions that can cause it in THIS
layout (never a tp sum without tp, nor a tie on one stage), each at its line in your code. A
layout that runs a function whose own check in ``grade_4_7_pieces.py`` failed steps aside
("blocked by finish_gradients"): that check says why, once.
"""

from __future__ import annotations

import os

import pytest
import torch
from grading import exercise, impl, world
from lm_helpers import (
    FAILED_PIECES,
    STEPS,
    TOLERANCE,
    Layout,
    RankRun,
    Reference,
    at,
    expected_piece,
    layout,
    reference,
    relative_error,
    run_layouts,
)
from lm_namers import LayoutFacts, parameter_causes
from phase4_helpers import fail

from course.impl import unwritten_todo
from course.world import WorldError, WorldHung, world_timeout
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


def facts(lay: Layout) -> LayoutFacts:
    s = lay.settings
    return LayoutFacts(
        dp=s.dp, cp=s.cp, tp=s.tp, pp=s.pp, ep=s.ep, sp=s.sequence_parallel, tied=lay.tied,
        moe=lay.moe, zero=s.zero,
        tie_across_ranks=lay.tied and s.pp > 1 and s.schedule != "zb-v",
    )  # fmt: skip


def uses(lay: Layout) -> list[str]:
    """The 4.7 functions a layout runs (and whose own failure it would only repeat)."""
    s = lay.settings
    out = ["token_positions", "count_valid_tokens", "loss_share", "finish_gradients"]
    if lay.moe:
        out.append("balance_loss_share")
    if s.tp > 1:
        out += ["enter_tensor_parallel", "leave_tensor_parallel"]
        if s.sequence_parallel:
            out += ["all_gather_sequence", "reduce_scatter_sequence"]
    if s.max_norm is not None:
        out += ["gradient_placements", "your 3.6 global_grad_norm"]
    return out


def step_aside_for_pieces(lay: Layout) -> None:
    """A layout that runs a function whose own check failed steps aside: that check says why."""
    for function in uses(lay):
        if function in FAILED_PIECES:
            pytest.skip(f"blocked by {function} (fix it first: {FAILED_PIECES[function]} fails "
                        "on it)")  # fmt: skip


def candidates(names: list[str]) -> str:
    """``loss_share (phase4_production/template_lm_parallel.py:94 in loss_share)``, listed."""
    return "; ".join(f"{name}{at(name)}" for name in names)


def ratio_text(got: torch.Tensor, want: torch.Tensor) -> str:
    """``2x one process's`` when the difference is one factor, else how far it is."""
    mask = want.abs() > 1e-12 * max(1.0, float(want.abs().max()))
    if got.shape == want.shape and bool(mask.any()):
        ratios = (got[mask] / want[mask]).double()
        if float(ratios.max() - ratios.min()) < 1e-9 * max(1.0, float(ratios.abs().max())):
            return f"{float(ratios[0]):.4g}x one process's"
    return f"off by up to {relative_error(got, want):.3g} of its scale"


def gradient_problems(lay: Layout, per_rank: list[RankRun], step: int, ref: Reference) -> list[str]:
    """What finish_gradients left at ``step`` against one process's gradients (whole pieces)."""
    problems = []
    f = facts(lay)
    for rank, run in enumerate(per_rank):
        if step >= len(run.grads):
            continue
        pp, dp, cp, tp = run.coords
        wrong: dict[str, str] = {}
        for name, grad in run.grads[step].items():
            how, parts = run.pieces[name]
            want = expected_piece(ref.grads[step][name], how, parts, tp, run.tp_size)
            if relative_error(grad, want) > TOLERANCE:
                wrong[name] = ratio_text(grad, want)
        if wrong:
            kinds = sorted({kind_of(n) for n in wrong})
            named = ", ".join(f"{n} ({r})" for n, r in list(wrong.items())[:3]) + (
                f" and {len(wrong) - 3} more" if len(wrong) > 3 else ""
            )
            causes = [c for k in kinds for c in parameter_causes(k, f)]
            upstream = []
            if f.tp > 1:
                upstream.append("the backward of the tensor-parallel regions")
            if f.moe:
                upstream.append("balance_loss_share's gradient")
            problems.append(
                f"rank {rank} (pp={pp}, dp={dp}, cp={cp}, tp={tp}), step {step}: after "
                f"finish_gradients{at('finish_gradients')}, {named} differ from its pieces of one "
                "process's gradients. What this layout needs of them: "
                + ("; ".join(dict.fromkeys(causes)) or "no reduction should touch them")
                + (f" (or, before it, {' or '.join(upstream)})" if upstream else "")
            )
    return problems


def layout_problems(lay: Layout, per_rank: list[RankRun]) -> list[str]:
    ref = reference(lay)
    f = facts(lay)
    for run in per_rank:
        if run.error is not None:
            raise NotImplementedError(run.error)
    for step in range(STEPS):
        want_ce, want_balance = ref.losses[step]
        ce, balance, norm, valid = per_rank[0].reports[step]
        if valid != ref.valid[step]:
            return [
                f"step {step} counted {valid} valid targets; the global batch holds "
                f"{ref.valid[step]}: {candidates(['count_valid_tokens'])}"
            ]
        if abs(ce - want_ce) > TOLERANCE * abs(want_ce):
            if step == 0:
                suspects = (["token_positions"] if f.cp > 1 else []) + (
                    ["enter_tensor_parallel", "leave_tensor_parallel"] if f.tp > 1 else []
                ) + ["loss_share"]  # fmt: skip
                return [
                    f"the cross-entropy of step 0 (before any update) is {ce:.12g}; one "
                    f"process's is {want_ce:.12g} ({ce / want_ce:.4g}x). In this layout it "
                    f"depends on your {candidates(suspects)}"
                ]
            return [
                f"the cross-entropy of step {step} is {ce:.12g}; one process's is {want_ce:.12g}: "
                "the step before updated the weights differently (the gradients' reductions)"
            ]
        if abs(balance - want_balance) > TOLERANCE * max(abs(want_balance), 1e-30):
            return [
                f"the balance loss of step {step} is {balance:.12g}; one process's is "
                f"{want_balance:.12g}: {candidates(['balance_loss_share'])} (the counts of whole "
                "sequences, each rank's own part of P, scaled like loss_share)"
            ]
        problems = gradient_problems(lay, per_rank, step, ref)
        if problems:
            return problems
        want_norm = ref.norms[step]
        if want_norm is not None and (norm is None or abs(norm - want_norm) > 1e-9 * want_norm):
            seen = "the gradients it clipped equal one process's" + (
                " (the ZeRO slices aside, which this check cannot see)" if f.zero else ""
            )
            return [
                f"the gradient norm of step {step} is {norm}; one process's clip_grad_norm_ "
                f"returns {want_norm:.12g}, and {seen}: the placements handed to 3.6's norm count "
                f"a copy twice or drop a piece: {candidates(['gradient_placements'])}"
            ]
        if len({r.reports[step] for r in per_rank}) != 1:
            counts = sorted({r.reports[step][3] for r in per_rank})
            return [
                f"step {step}: the ranks reported different losses or counts (valid targets "
                f"counted: {counts}): every rank must divide by the same global count: "
                f"{candidates(['count_valid_tokens'])}"
            ]
        problems = []
        for rank, run in enumerate(per_rank):
            pp, dp, cp, tp = run.coords
            wrong = []
            for name, (how, parts) in run.pieces.items():
                want = expected_piece(ref.states[step][name], how, parts, tp, run.tp_size)
                if relative_error(run.states[step][name], want) > TOLERANCE:
                    wrong.append(name)
            if wrong:
                names = ", ".join(wrong[:3]) + (
                    f" and {len(wrong) - 3} more" if len(wrong) > 3 else ""
                )
                checked = step < len(run.grads) and all(n in run.grads[step] for n in wrong)
                if checked:  # their gradients were right: the update went wrong
                    why = (
                        "their gradients after finish_gradients equal one process's, the update "
                        "did not" + (
                            f": clipping scales the tensors gradient_placements hands it, which "
                            f"must be the held gradients themselves{at('gradient_placements')}"
                            if lay.settings.max_norm is not None else ""
                        )
                    )  # fmt: skip
                else:
                    kinds = sorted({kind_of(n) for n in wrong})
                    causes = list(dict.fromkeys(c for k in kinds for c in parameter_causes(k, f)))
                    why = (
                        "what this layout needs of their gradients: "
                        f"{'; '.join(causes) or 'no reduction should touch them'}"
                        f"{at('finish_gradients')}"
                    )
                problems.append(
                    f"rank {rank} (pp={pp}, dp={dp}, cp={cp}, tp={tp}) after step {step}: "
                    f"{names} differ from its pieces of one process's parameters: {why}"
                )
        if problems:
            return problems
    return []


@exercise("4.7")
@pytest.mark.parametrize(
    ("size", "index"), CASES, ids=[WORLDS[s][i].label.replace(" ", "") for s, i in CASES]
)
def test_layout_trains_like_one_process(size: int, index: int) -> None:
    lay = WORLDS[size][index]
    try:
        every = runs(size)
    except WorldError:
        # the world stopped (an error or a hang on any of its layouts): after a piece's own
        # check failed, it most likely stopped on that piece; else one report per world
        for other in WORLDS[size]:
            step_aside_for_pieces(other)
        first = _STOPPED.setdefault(size, current_test_id())
        if first != current_test_id():
            pytest.skip(f"blocked by the failure above ({first}): the same world of {size} ranks")
        raise
    per_rank = [rank_runs[index] for rank_runs in every]
    problems = layout_problems(lay, per_rank)
    if problems:
        step_aside_for_pieces(lay)
        unique = list(dict.fromkeys(problems))
        fail(
            f"4.7 {lay.label} ({size} ranks), against one process in float64: {unique[0]}"
            + "".join(f"\n  {p}" for p in unique[1:3])
            + (f"\n  ... and {len(unique) - 3} more" if len(unique) > 3 else "")
        )


_STOPPED: dict[int, str] = {}  # world size -> the test that reported its error or hang


def current_test_id() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[-1].split(" ")[0]
