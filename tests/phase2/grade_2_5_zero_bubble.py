"""Exercise 2.5, zero bubble: the backward split into B and W, ZB-H1, and the V-shaped ZB-V.

Schedules first, in this process: ZB-H1 keeps the paper's rules (every W after its B, the F's
and B's in 1F1B's order, at most p micro-batches in flight, a unit-cost simulation that finishes
with the paper's bubble (p-1)(F+B-W)) and equals the action lists PyTorch generates for it
(``ScheduleInterleavedZeroBubble`` with one stage per rank, its ZB1P); ZB-V runs on its V
placement (rank r holds stages r and 2p-1-r) and equals ``ScheduleZBVZeroBubble``'s lists. Then
the executor, in worlds of 2 and 4 processes, for m in {p, 2p, 3p}: the loss and every gradient
equal the single-device model's (float64), each B leaves the parameters' gradients alone and
each W adds them, the stash and the weight stash are empty after the step, and the recorded
events are the schedule's. The library way (torch's own zero-bubble schedules on the same
stages) and the timeline command are checked beside them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from grade_2_5_pipeline import (
    HANG_HINT,
    case_label,
    check_executor_case,
    executor_module,
    keys,
    link_orders,
    pipeline_batch,
    pipeline_training_worker,
    run_case,
    schedules_module,
    single_device_reference,
    small_config,
    tiny_pipeline_model,
)
from grading import exercise
from p2p_grading import fail, remarks, run

from phase2_advanced.pipeline_layout import stage_chunk, virtual_stage
from solutions.phase2_advanced.demos import pipeline as pipeline_parallel
from solutions.phase2_advanced.pipeline_study import timeline as pipeline_timeline
from solutions.phase2_advanced.pipeline_study.simulation import (
    ScheduleDeadlock,
    simulate,
    zero_bubble_h1_bubble,
    zero_bubble_v_bubble,
)

# its ranks run torch's pipelining too: imported once in the fork server (tests/conftest.py)
WORLD_PRELOAD = ("torch.distributed.pipelining",)

ZB_HINT = HANG_HINT + (
    " A W neither receives nor sends: if the ranks hang only under zb-h1 or zb-v, look at what "
    "_backward_input returns (the gradient of the input, for stage - 1)."
)

# ============================================================================ torch's lists


def torch_actions(schedule: str, p: int, m: int, v: int) -> list[list[tuple[str, int, int]]]:
    """Each rank's (F/B/W, virtual stage, micro-batch) as torch's ``schedule`` class generates
    them, in our letters: torch's I (backward of the input) is our B, its W our W, its full B our
    B. Built on mock stages, as ``_schedule_visualizer.get_schedule_ops`` does (which refuses one
    stage per rank for a multi-stage schedule class, so the mock is made here). torch's
    pipelining is imported here, not with the module: it costs about 2 s of CPU, and only these
    tests need it (the first message of a run comes sooner)."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining.stage import PipelineStage

    schedule_class = getattr(schedules, schedule)
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod, stage.num_stages = 0, p, None, p * v
    order = schedule_class([stage] * v, m).pipeline_order
    letters = {"FORWARD": "F", "BACKWARD_INPUT": "B", "FULL_BACKWARD": "B", "BACKWARD_WEIGHT": "W"}
    return [
        [
            (letters[a.computation_type.name], a.stage_index, a.microbatch_index)
            for a in order[rank]
            if a is not None
        ]
        for rank in range(p)
    ]


def ours(schedule: Sequence[Sequence[Any]], placement: str) -> list[list[tuple[str, int, int]]]:
    p = len(schedule)
    return [
        [(str(a)[0], virtual_stage(rank, a.chunk, p, placement), a.microbatch) for a in actions]
        for rank, actions in enumerate(schedule)
    ]


def spelled(actions: Sequence[tuple[str, int, int]], p: int) -> str:
    """(letter, stage, micro-batch) written as our actions are (F3, B3c1, ...), with ``p`` ranks."""
    out = []
    for letter, stage, mb in actions:
        chunk = stage_chunk(stage, p)
        out.append(f"{letter}{mb}" + (f"c{chunk}" if chunk else ""))
    return " ".join(out)


# ============================================================================ the rules


def zero_bubble_problems(schedule: Sequence[Sequence[Any]], p: int, m: int, v: int) -> list[str]:
    """The paper's rules for one schedule, each problem named: F and B once per (micro-batch,
    chunk), W once and after its B, in micro-batch order per chunk."""
    problems = []
    if len(schedule) != p:
        return [f"expected one action list per rank ({p}), got {len(schedule)}"]
    for rank, actions in enumerate(schedule):
        seen: set[tuple[str, int, int]] = set()
        for a in actions:
            key = (a.kind, a.microbatch, a.chunk)
            if a.kind == "weight" and ("backward", a.microbatch, a.chunk) not in seen:
                problems.append(
                    f"W before B: rank {rank} runs {a} before B{str(a)[1:]} (W computes the "
                    "weights' gradients from the gradient of the output, which arrives for B)"
                )
            if a.kind == "backward" and ("forward", a.microbatch, a.chunk) not in seen:
                problems.append(f"rank {rank} runs {a} before its forward F{str(a)[1:]}")
            if key in seen:
                problems.append(f"rank {rank} runs {a} twice")
            seen.add(key)
        for kind, letter in (("forward", "F"), ("backward", "B"), ("weight", "W")):
            missing = [
                f"{letter}{mb}" + (f"c{c}" if c else "")
                for mb in range(m)
                for c in range(v)
                if (kind, mb, c) not in seen
            ]
            if missing:
                problems.append(
                    f"rank {rank} never runs {', '.join(missing[:4])}"
                    + (
                        " (every micro-batch needs its W: without it its weights get no gradient)"
                        if kind == "weight"
                        else ""
                    )
                )
        for c in range(v):
            order = [a.microbatch for a in actions if a.kind == "weight" and a.chunk == c]
            if order != sorted(order):
                problems.append(
                    f"rank {rank} runs the W's of chunk {c} in the order {order}: oldest first"
                )
    return problems


def deadlock(schedule: Sequence[Sequence[Any]], placement: str) -> str:
    """Why the unit-cost simulation cannot finish ``schedule`` on ``placement``, or ""."""
    try:
        simulate(schedule, placement=placement)
    except ScheduleDeadlock as err:
        return str(err)
    return ""


def h1(p: int, m: int) -> list[list[Any]]:
    return schedules_module().make_schedule("zb-h1", p, m)


@exercise("2.5")
def test_zb_h1_runs_every_w_after_its_b_and_keeps_1f1b_order_and_memory() -> None:
    peak = schedules_module().peak_in_flight
    for p in range(1, 6):
        for m in range(1, 11):
            schedule = h1(p, m)
            label = f"2.5 zb-h1 p={p} m={m}"
            problems = zero_bubble_problems(schedule, p, m, 1)
            if problems:
                fail(f"{label}: " + "\n  ".join(problems[:4]))
            one_f = schedules_module().make_schedule("1f1b", p, m)
            for rank, actions in enumerate(schedule):
                f_and_b = [str(a) for a in actions if a.kind != "weight"]
                if f_and_b != keys(one_f[rank]):
                    fail(
                        f"{label}: rank {rank}'s F's and B's should be its 1F1B order "
                        f"{' '.join(keys(one_f[rank]))} (B keeps 1F1B's place; only the W's "
                        f"are new), got {' '.join(f_and_b)}"
                    )
            peaks = [peak(actions) for actions in schedule]
            if max(peaks) > p:
                fail(
                    f"{label}: ranks hold up to {peaks} micro-batches (forwarded, W not yet run); "
                    f"ZB-H1 keeps 1F1B's peak, p = {p}: a rank can keep only as many W's waiting "
                    "as 1F1B leaves it below p"
                )
            stuck = deadlock(schedule, "loop")
            if stuck:
                fail(f"{label} would hang: {stuck}")


def no_deferral_hint(actions: Sequence[tuple[str, int, int]]) -> str:
    """A remark when every W runs right after its own B (1F1B cut in two: the same bubble)."""
    pairs = list(itertools.pairwise(actions))
    weights = [b for a, b in pairs if b[0] == "W"]
    right_after = [b for a, b in pairs if b[0] == "W" and a == ("B", b[1], b[2])]
    if (
        weights
        and len(right_after) == len(weights)
        and len(weights) == sum(1 for a in actions if a[0] == "W")
    ):
        return (
            "\n  (every W runs right after its own B: that is 1F1B with its backward cut in two, "
            "with 1F1B's bubble; ZB-H1 keeps some W's waiting, to run where 1F1B idles)"
        )
    return ""


@exercise("2.5")
def test_zb_h1_equals_torchs_zero_bubble_schedule() -> None:
    for p, m in [(1, 3), (2, 1), (2, 2), (2, 4), (3, 6), (4, 2), (4, 4), (4, 8), (5, 10)]:
        expected = torch_actions("ScheduleInterleavedZeroBubble", p, m, 1)
        got = ours(h1(p, m), "loop")
        for rank in range(p):
            if got[rank] != expected[rank]:
                fail(
                    f"2.5 zb-h1 p={p} m={m}: rank {rank} should run (as torch's "
                    "ScheduleInterleavedZeroBubble with one stage per rank, its ZB1P, generates)"
                    f"\n  expected {spelled(expected[rank], p)}\n  got      "
                    f"{spelled(got[rank], p)}" + no_deferral_hint(got[rank])
                )


@exercise("2.5")
@pytest.mark.parametrize("costs", [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (2.0, 1.0, 1.0)])
def test_zb_h1_simulated_bubble_is_the_papers(costs: tuple[float, float, float]) -> None:
    f, b, w = costs
    for p in (2, 3, 4):
        for m in (p, 2 * p, 3 * p):
            bubbles = simulate(h1(p, m), f, b + w, w).bubble_fractions()
            formula = zero_bubble_h1_bubble(p, m, f, b, w)
            if bubbles != pytest.approx([formula] * p, rel=1e-12):
                fail(
                    f"2.5 zb-h1 p={p} m={m}, F={f:g} B={b:g} W={w:g}: each stage should idle "
                    f"(p-1)(F+B-W) of the step, {formula:.4f}; simulated "
                    f"{[round(x, 4) for x in bubbles]} (1F1B's would be "
                    f"{(p - 1) / (m + p - 1):.4f})"
                )


@exercise("2.5")
def test_zb_v_runs_on_its_v_placement_and_equals_torchs_zbv() -> None:
    schedules = schedules_module()
    placement = schedules.placement_of("zb-v")
    chunks = schedules.chunks_per_rank("zb-v")
    for p, m in [(2, 4), (4, 8)]:
        schedule = schedules.make_schedule("zb-v", p, m)
        stuck = deadlock(schedule, placement)
        if stuck:
            fail(
                f"2.5 zb-v p={p} m={m} with the {placement!r} placement cannot finish ({stuck}): "
                "ZB-V is written for the V placement, rank r holding stages r and 2p-1-r "
                "(placement_of('zb-v') should be 'v'); with 1F1B's loop placement rank r would "
                "hold stages r and p + r, and a V schedule waits for activations that never come"
            )
    if placement != "v" or chunks != 2:
        fail(
            f"2.5 zb-v: placement_of('zb-v') is {placement!r} and chunks_per_rank('zb-v') is "
            f"{chunks}; ZB-V runs 2 chunks per rank in a V: 'v'"
        )
    for p in (1, 2, 3, 4):
        for m in range(1, 3 * p + 1):
            expected = torch_actions("ScheduleZBVZeroBubble", p, m, 2)
            got = ours(schedules.make_schedule("zb-v", p, m), placement)
            for rank in range(p):
                if got[rank] != expected[rank]:
                    fail(
                        f"2.5 zb-v p={p} m={m}: rank {rank} should run (torch's "
                        f"ScheduleZBVZeroBubble)\n  expected {spelled(expected[rank], p)}\n  "
                        f"got      {spelled(got[rank], p)}"
                    )


@exercise("2.5")
def test_zb_v_simulated_bubble_is_only_the_fill() -> None:
    schedules = schedules_module()
    for p in (2, 3, 4):
        for m in (2 * p, 3 * p):
            schedule = schedules.make_schedule("zb-v", p, m)
            simulation = simulate(schedule, placement="v")
            formula = zero_bubble_v_bubble(p, m)
            peaks = [schedules.peak_in_flight(actions) for actions in schedule]
            if simulation.bubble_fractions() != pytest.approx([formula] * p, rel=1e-12):
                fail(
                    f"2.5 zb-v p={p} m={m}, F=B=W per chunk: each rank should idle only the fill "
                    f"(p-1)F, {formula:.4f} of the step; simulated "
                    f"{[round(b, 4) for b in simulation.bubble_fractions()]}"
                )
            if max(peaks) > 2 * p:
                fail(
                    f"2.5 zb-v p={p} m={m}: ranks hold up to {peaks} (micro-batch, chunk) pairs; "
                    f"ZB-V holds at most 2p = {2 * p} (p stages' worth, 1F1B's peak)"
                )


@exercise("2.5")
def test_zb_h1_messages_keep_their_order_on_both_ends() -> None:
    # ZB-V's links carry activations and gradients in different orders at their two ends (the
    # receiver needs a gradient of the way up before the next activation of the way down):
    # tags pair them on gloo, and the runtime refuses the V placement on NCCL (see the guide)
    for p, m in itertools.product((2, 3, 4), (4, 8, 12)):
        for (src, dst), (sent, received) in link_orders(h1(p, m)).items():
            if sent != received:
                fail(
                    f"2.5 zb-h1 p={p} m={m}: rank {src} sends to rank {dst} in the order "
                    f"{sent[:6]}... but rank {dst} consumes {received[:6]}...: a backend that "
                    "matches messages in order (NCCL) would pair the wrong ones"
                )


# ============================================================================ the executor

SPLIT_ERRORS = [
    (
        "backward through the graph a second time",
        "W walked a graph that B had already freed: B must keep the graph for W "
        "(retain_graph=True when it differentiates with respect to the input), and only W's "
        "walk, the last one, may free it",
    ),
    (
        "One of the differentiated Tensors appears to not have been used in the graph",
        "autograd was asked for the gradient of a tensor the output does not depend on: B "
        "differentiates with respect to the input of the chunk (allow_unused=True where a chunk "
        "may ignore it), W with respect to the chunk's parameters",
    ),
]


def grads_of(module: torch.nn.Module) -> list[torch.Tensor | None]:
    return [None if q.grad is None else q.grad.clone() for q in module.parameters()]


def probe_class(base: type) -> type:
    """The executor under test, watched: what each B and each W did to the parameters' .grad."""

    class Probed(base):
        last: Any = None  # the last one built: the one a case ran

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.b_changed: list[str] = []  # B's that changed a .grad
            self.b_wrong: list[tuple[str, str]] = []  # B's that returned a wrong input gradient
            self.w_unchanged: list[str] = []  # W's that left every .grad as it was
            self.w_wrong: list[tuple[str, str]] = []  # W's that added the wrong amount
            Probed.last = self

        def _backward_input(self, state: Any, action: Any, received: Any) -> Any:
            before = grads_of(self.chunks[action.chunk])
            expected = input_gradient(state, action, received)
            out = super()._backward_input(state, action, received)
            after = grads_of(self.chunks[action.chunk])
            what = f"{action} (stage {self.stage_of(action.chunk)})"
            if any(not same_grad(a, b) for a, b in zip(before, after, strict=True)):
                self.b_changed.append(what)
            if expected is not None and isinstance(out, torch.Tensor):
                if out.shape != expected.shape:
                    self.b_wrong.append((what, f"a tensor of shape {tuple(out.shape)}"))
                elif not torch.allclose(out, expected, rtol=1e-12, atol=1e-12):
                    how = (
                        "all zeros"
                        if not out.any()
                        else f"a tensor {(out - expected).abs().max().item():.2e} away from it"
                    )
                    self.b_wrong.append((what, how))
            return out

        def _backward_weight(self, state: Any, action: Any) -> None:
            if (action.microbatch, action.chunk) not in state.weight_stash:
                raise AssertionError(
                    f"2.5 zero-bubble executor: {action} (stage {self.stage_of(action.chunk)}) "
                    f"found no entry ({action.microbatch}, {action.chunk}) in state.weight_stash: "
                    "every B, stage 0's included, must leave there what its W starts from (the "
                    "output and the gradient that came back for it)"
                )
            chunk = self.chunks[action.chunk]
            before = grads_of(chunk)
            expected = weight_gradients(
                chunk, state.weight_stash[(action.microbatch, action.chunk)]
            )
            super()._backward_weight(state, action)
            after = grads_of(chunk)
            what = f"{action} (stage {self.stage_of(action.chunk)})"
            if before and all(same_grad(a, b) for a, b in zip(before, after, strict=True)):
                self.w_unchanged.append(what)
            elif expected is not None:
                how = weight_mistake(before, after, expected)
                if how:
                    self.w_wrong.append((what, how))

    return Probed


def input_gradient(state: Any, action: Any, received: Any) -> torch.Tensor | None:
    """The gradient of a chunk's input that B must return, computed from the stash before B
    runs (None on stage 0, whose input needs none, or when the stash holds no such entry)."""
    held = state.stash.get((action.microbatch, action.chunk))
    if not isinstance(held, tuple) or len(held) != 2:
        return None
    x, output = held
    if not (isinstance(x, torch.Tensor) and x.requires_grad and output.requires_grad):
        return None
    try:
        (grad,) = torch.autograd.grad(output, x, received, retain_graph=True, allow_unused=True)
    except RuntimeError:
        return None  # a graph the forward did not keep: the executor's own checks say so
    return torch.zeros_like(x) if grad is None else grad


def weight_gradients(chunk: torch.nn.Module, entry: Any) -> list[Any] | None:
    """What one W must add to each parameter's .grad (None for a frozen one), computed from its
    weight-stash entry before W runs (None when the entry cannot be walked here)."""
    if not isinstance(entry, tuple) or len(entry) != 2:
        return None
    output, grad_output = entry
    params = list(chunk.parameters())
    trainable = [q for q in params if q.requires_grad]
    if not trainable or not isinstance(output, torch.Tensor) or not output.requires_grad:
        return None
    try:
        grads = torch.autograd.grad(
            output, trainable, grad_output, retain_graph=True, allow_unused=True
        )
    except RuntimeError:
        return None  # a graph B already freed: the executor's own error says so
    found = iter(grads)
    shares: list[Any] = []
    for q in params:
        grad = next(found) if q.requires_grad else None
        shares.append(
            None if not q.requires_grad else torch.zeros_like(q) if grad is None else grad
        )
    return shares


def weight_mistake(before: list[Any], after: list[Any], expected: list[Any]) -> str:
    """How a W's change to the parameters' .grad differs from the weights' gradient of its
    micro-batch ("" when it does not)."""
    for old, new, share in zip(before, after, expected, strict=True):
        if share is None:
            continue
        if new is None and old is None and not share.any():
            continue  # a parameter this micro-batch does not reach
        want = share if old is None else old + share
        if new is not None and torch.allclose(new, want, rtol=1e-10, atol=1e-12):
            continue
        if new is not None and old is not None and old.any() and torch.allclose(new, share):
            return (
                "replaced .grad with this micro-batch's share: W must add to .grad (accumulate), "
                "so that the m micro-batches' shares sum"
            )
        return (
            "added to .grad something other than the gradient of the chunk's output with "
            "respect to its parameters, from the gradient that came back for that output (the "
            "one B kept in the weight stash): W starts from the same output and incoming "
            "gradient as B"
        )
    return ""


def same_grad(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a, b)


@remarks("2.5 zero-bubble executor", SPLIT_ERRORS)
def zero_bubble_worker(cases: list[tuple[str, int, int, bool]]) -> dict[str, Any]:
    rank, p = dist.get_rank(), dist.get_world_size()
    executor = executor_module()
    probed = probe_class(executor.PipelineExecutor)
    results = []
    with mock.patch.object(executor, "PipelineExecutor", probed):
        for case in cases:
            results.append(run_case(case, rank, p, None))
            runner = getattr(probed, "last")  # noqa: B009  (set by each instance)
            results[-1]["b_changed"] = runner.b_changed
            results[-1]["b_wrong"] = runner.b_wrong
            results[-1]["w_wrong"] = runner.w_wrong
            results[-1]["w_unchanged"] = runner.w_unchanged
    refused = ""
    try:  # a split backward cannot be checkpointed by 2.3's checkpoint: refused at once
        schedule = schedules_module().make_schedule("zb-h1", p, p)
        executor.PipelineExecutor(
            [tiny_pipeline_model(p)[rank]], schedule[rank], p, checkpoint_chunks=True
        )
    except ValueError as err:
        refused = str(err)
    return {"cases": results, "checkpoint_refusal": refused}


def zero_bubble_cases(p: int) -> list[tuple[str, int, int, bool]]:
    return [(name, m, 2, False) for name in ("zb-h1", "zb-v") for m in (p, 2 * p, 3 * p)]


def check_split(label: str, per_rank: Sequence[dict[str, Any]], ref_grads: Any) -> None:
    """The zero-bubble parts, each named: B leaves the weights to W, W adds them, the weight
    stash is emptied; then the rest is the executor's usual check."""
    for rank, got in enumerate(per_rank):
        # a B that sends back a wrong gradient spoils the W's of the stages before it, on
        # other ranks: named first
        if got.get("b_wrong"):
            what, how = got["b_wrong"][0]
            fail(
                f"{label}: rank {rank}'s {what} returned {how} as the gradient of its input, "
                "not the gradient of the chunk's output with respect to its input (from the "
                "gradient that came back): B must return the gradient it computed "
                "(torch.autograd.grad returns it; it does not fill x.grad)"
            )
    for rank, got in enumerate(per_rank):
        if "refused" in got:
            fail(f"{label}: rank {rank} refused a schedule it should run: {got['refused']}")
        if got["b_changed"]:
            fail(
                f"{label}: rank {rank}'s {got['b_changed'][0]} changed the parameters' .grad: "
                "B computes only the gradient of the input (autograd with respect to the input "
                "alone); the weights' gradients are W's, later"
            )
        if got["w_unchanged"]:
            fail(
                f"{label}: rank {rank}'s {got['w_unchanged'][0]} left every .grad of its "
                "chunk as it was: W never computed the weights' gradients, so the weights would "
                "not be updated; _backward_weight must backpropagate into the chunk's parameters"
            )
        if got["w_wrong"]:
            what, how = got["w_wrong"][0]
            fail(f"{label}: rank {rank}'s {what} {how}")
        if got["left_in_weight_stash"]:
            fail(
                f"{label}: rank {rank} still held {got['left_in_weight_stash']} weight-stash "
                "entries after the step: each W must take its entry out of the weight stash "
                "(pop), which frees the micro-batch's activations"
            )
        for stage, grads in got["grads"].items():
            if len(grads) < len(ref_grads[stage]):
                fail(
                    f"{label}: stage {stage} (rank {rank}) has {len(grads)} parameter gradients "
                    f"after the step, expected {len(ref_grads[stage])}: its W's never put the "
                    "weights' gradients in .grad"
                )


@exercise("2.5")
@pytest.mark.parametrize("p", [2, 4])
def test_zero_bubble_executor_matches_the_single_device_model(p: int) -> None:
    cases = zero_bubble_cases(p)
    results = run(
        f"2.5 zero-bubble executor, p={p}", zero_bubble_worker, p, cases, hang_hint=ZB_HINT
    )
    for index, case in enumerate(cases):
        per_rank = [results[rank]["cases"][index] for rank in range(p)]
        num_stages = p * schedules_module().chunks_per_rank(case[0], case[2])
        label = case_label(p, case)
        check_split(label, per_rank, single_device_reference(num_stages, case[1])[1])
        check_executor_case(label, p, case, per_rank)
    for rank, result in enumerate(results):
        if (
            "W" not in result["checkpoint_refusal"]
            and "checkpoint" not in result["checkpoint_refusal"]
        ):
            fail(
                f"2.5 rank {rank}: PipelineExecutor(..., checkpoint_chunks=True) with a zb-h1 "
                "schedule must refuse (2.3's checkpoint computes both gradients in one "
                f"backward); got {result['checkpoint_refusal']!r}"
            )


@exercise("2.5")
def test_zero_bubble_training_follows_the_single_device_model() -> None:
    configs = [
        small_config(schedule="zb-v"),  # the V placement: stages 0 and 3 on rank 0
        small_config(schedule="zb-h1", balance="time"),
    ]
    results = run(
        "2.5 zero-bubble demo training", pipeline_training_worker, 2, configs, hang_hint=ZB_HINT
    )
    for config, losses in zip(configs, results[0], strict=True):
        reference = pipeline_parallel.single_device_losses(config)
        if losses != pytest.approx(reference, rel=1e-12):
            fail(
                f"2.5 {config.schedule} (balance {config.balance}) training, SGD steps on the "
                f"demo's MLP: losses {losses}, one device {reference}"
            )


# ============================================================================ the library way


def torch_zero_bubble_worker(cases: list[tuple[str, int]]) -> list[tuple[float | None, dict]]:
    rank, p = dist.get_rank(), dist.get_world_size()
    out = []
    for name, m in cases:
        placement = "v" if name == "zb-v" else "loop"
        v = 2 if name == "zb-v" else 1
        model = tiny_pipeline_model(p * v)
        ids = [virtual_stage(rank, c, p, placement) for c in range(v)]
        inputs, targets = pipeline_batch(m)
        loss = pipeline_parallel.torch_pipelining_step(
            [model[i] for i in ids], name, m, inputs, targets
        )
        grads = {
            i: [q.grad.clone() for q in model[i].parameters() if q.grad is not None] for i in ids
        }
        out.append((loss, grads))
    return out


@exercise("2.5")
@pytest.mark.reference
@pytest.mark.parametrize("p", [2, 4])
def test_torch_zero_bubble_schedules_match_the_single_device_model(p: int) -> None:
    cases = [("zb-h1", p), ("zb-v", p), ("zb-v", 2 * p)]
    results = run(f"torch zero-bubble schedules, p={p}", torch_zero_bubble_worker, p, cases)
    for index, (name, m) in enumerate(cases):
        num_stages = p * (2 if name == "zb-v" else 1)
        ref_loss, ref_grads = single_device_reference(num_stages, m)
        for rank in range(p):
            loss, grads = results[rank][index]
            if loss is not None and loss != pytest.approx(ref_loss, rel=1e-12):
                fail(f"torch {name} p={p} m={m}: loss {loss}, one device {ref_loss}")
            for stage, stage_grads in grads.items():
                for g, r in zip(stage_grads, ref_grads[stage], strict=True):
                    if not torch.allclose(g, r, rtol=1e-10, atol=1e-12):
                        fail(
                            f"torch.distributed.pipelining {name} p={p} m={m}: stage {stage}'s "
                            f"gradient differs from the single-device model's by "
                            f"{(g - r).abs().max():.3e}"
                        )


# ============================================================================ the timeline


@exercise("2.5")
@pytest.mark.reference
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--ranks", "0"], "--ranks 0"),
        (["--microbatches", "0"], "--microbatches 0"),
        (["--forward-ms", "0"], "--forward-ms 0.0"),
        (["--forward-ms", "nan"], "--forward-ms nan"),
        (["--steps", "1"], "--steps 1"),
        (["--out", "timeline.svg"], "PNG"),
        (["--schedule", "zb-v", "--ranks", "1"], "at least 2 processes"),
        (["--schedule", "interleaved", "--microbatches", "3"], "multiple"),
    ],
)
def test_timeline_command_refuses_bad_flags_before_starting(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code: Any
    try:
        code = pipeline_timeline.main(argv)
    except SystemExit as exited:
        code = exited.code
    err = capsys.readouterr().err
    if code != 2 or expected not in err or "Traceback" in err:
        fail(f"pipeline_timeline {argv}: expected exit 2 naming {expected!r}; got {code}: {err}")


@exercise("2.5")
@pytest.mark.reference
def test_timeline_command_draws_the_run_and_prints_the_bubble(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "timeline.png"
    argv = ["--schedule", "zb-h1", "--impl", "solutions", "--forward-ms", "5", "--steps", "2"]
    code = pipeline_timeline.main([*argv, "--out", str(out)])
    printed = capsys.readouterr().out
    if code != 0 or not out.exists() or out.read_bytes()[:4] != b"\x89PNG":
        fail(f"pipeline_timeline {argv}: expected exit 0 and a PNG; got {code}: {printed}")
    for rank in (0, 1):
        if f"stage {rank}: measured bubble" not in printed or "formula 0.077" not in printed:
            fail(f"pipeline_timeline {argv}: each stage's bubble beside the formula: {printed}")
