"""Exercise 2.5, pipeline parallelism: schedules, partition, messages and the executor.

Schedules are pure functions, so most of their checks run in this process: every micro-batch
goes forward then backward once per stage, the order can run (a unit-cost simulation finishes),
1F1B holds at most p micro-batches, and the simulated bubble is the papers' formula. The executor
runs in worlds of 2 and 4 processes and must give the single-device model's loss and gradients
(float64) for every schedule, run its schedule in order, hold exactly what the schedule holds,
send only with ``isend``, and refuse a batch that does not split on every rank before any data
moves. It also runs in the groups (0, 1) and (2, 3) of a world of 4 at once, on different data,
each equal to its own single-device model, without a message leaving its group.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from grading import defined_at, exercise, impl, load
from p2p_grading import fail, only_inside, remarks, run, run_in_subgroups
from subgroups import SubgroupInfo
from torch import nn

from course.comm_counter import CommCounter, CommRecord
from phase2_advanced.pipeline_layout import rank_chunks, stage_rank, virtual_stage
from solutions.phase2_advanced.demos import pipeline as pipeline_parallel
from solutions.phase2_advanced.pipeline_study.simulation import (
    ScheduleDeadlock,
    gpipe_bubble,
    interleaved_bubble,
    simulate,
)

PHASE = "phase2_advanced"
HANG_HINT = (
    "Every send must return without waiting for its receiver (a blocking dist.send, or an "
    "isend waited for at once, waits for the receiver, and two neighbours that both send first "
    "wait for each other forever; the executor waits for every send at the end of the step), "
    "and every receive must ask for the message that is sent: from the rank holding the "
    "neighbouring stage, with the tag links.tag(kind, RECEIVING stage, micro-batch) that the "
    "sender used too."
)

# The ranks of the library-way checks run torch's pipelining (2 s of CPU to import): the fork
# server imports it once (tests/conftest.py), though this module does not import it itself
WORLD_PRELOAD = ("torch.distributed.pipelining",)


def schedules_module() -> Any:
    return load(PHASE, "pipeline_schedules")


def partition_module() -> Any:
    return load(PHASE, "pipeline_partition")


def executor_module() -> Any:
    return load(PHASE, "pipeline_executor")


def plain_schedule(name: str, p: int, m: int) -> list[list[Any]]:
    return schedules_module().make_schedule(name, p, m)


def keys(actions: Sequence[Any]) -> list[str]:
    return [str(a) for a in actions]


# ============================================================================ schedules


def schedule_problems(schedule: Sequence[Sequence[Any]], p: int, m: int, v: int) -> list[str]:
    """Each (micro-batch, chunk) forwarded once then backwarded once on every rank."""
    problems = []
    if len(schedule) != p:
        return [f"expected one action list per rank ({p}), got {len(schedule)}"]
    expected = {
        (kind, mb, c) for kind in ("forward", "backward") for mb in range(m) for c in range(v)
    }
    for rank, actions in enumerate(schedule):
        got = [(a.kind, a.microbatch, a.chunk) for a in actions]
        if sorted(got) != sorted(expected):
            missing = sorted(expected - set(got))[:3]
            twice = sorted({g for g in got if got.count(g) > 1})[:3]
            problems.append(
                f"rank {rank}: missing {missing}, repeated {twice}, got {keys(actions)}"
            )
            continue
        for kind, mb, c in got:
            if kind == "backward" and got.index(("forward", mb, c)) > got.index((kind, mb, c)):
                problems.append(
                    f"rank {rank} runs the backward of micro-batch {mb} before its forward"
                )
    return problems


@exercise("2.5")
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_every_microbatch_goes_forward_then_backward_once_per_stage(name: str) -> None:
    for p in range(1, 6):
        for m in range(1, 11):
            try:
                schedule = plain_schedule(name, p, m)
            except ValueError as err:
                if "num_warmup" not in str(err):
                    raise
                fail(
                    f"2.5 {name} p={p} m={m}: building the schedule raised ValueError: {err}: a "
                    f"rank's warm-up asked for more forwards than the m = {m} micro-batches there "
                    "are"
                )
            problems = schedule_problems(schedule, p, m, 1)
            if problems:
                fail(f"2.5 {name} p={p} m={m}:\n  " + "\n  ".join(problems[:4]))


@exercise("2.5")
def test_gpipe_runs_all_forwards_then_all_backwards() -> None:
    for p, m in [(1, 3), (2, 1), (4, 5)]:
        expected = [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]
        for rank, actions in enumerate(plain_schedule("gpipe", p, m)):
            if keys(actions) != expected:
                fail(
                    f"2.5 GPipe p={p} m={m}: rank {rank} should run {' '.join(expected)}, "
                    f"got {' '.join(keys(actions))} (forwards, then backwards, each in "
                    "micro-batch order 0, 1, ...)"
                )


@exercise("2.5")
def test_1f1b_warms_up_then_alternates_then_drains() -> None:
    expected_p4_m6 = [
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5",
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5",
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5",
    ]
    for rank, actions in enumerate(plain_schedule("1f1b", 4, 6)):
        got = " ".join(keys(actions))
        if got != expected_p4_m6[rank]:
            fail(
                f"2.5 1F1B p=4 m=6: rank {rank} should warm up with {min(4 - rank - 1, 6)} "
                "forwards (min(p - rank - 1, m)), then alternate one forward and the oldest "
                f"backward, then drain:\n  expected {expected_p4_m6[rank]}\n  got      {got}"
            )
    few = " ".join(keys(plain_schedule("1f1b", 4, 2)[0]))
    if few != "F0 F1 B0 B1":
        fail(f"2.5 1F1B p=4 m=2: rank 0 has only 2 forwards to warm up with, got {few}")


@exercise("2.5")
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_schedules_can_run_across_stages(name: str) -> None:
    for p in range(1, 6):
        for m in range(1, 11):
            try:
                simulate(plain_schedule(name, p, m))
            except ScheduleDeadlock as err:
                fail(f"2.5 {name} p={p} m={m} would hang: {err}")


@exercise("2.5")
def test_peak_in_flight_is_m_for_gpipe_and_at_most_p_for_1f1b() -> None:
    peak = schedules_module().peak_in_flight
    for p in range(1, 6):
        for m in range(1, 11):
            gpipe_peaks = [peak(a) for a in plain_schedule("gpipe", p, m)]
            if gpipe_peaks != [m] * p:
                fail(f"2.5 GPipe p={p} m={m}: every rank holds m; got {gpipe_peaks}")
            one_f_peaks = [peak(a) for a in plain_schedule("1f1b", p, m)]
            expected = [min(p - rank, m) for rank in range(p)]
            if one_f_peaks != expected:
                fail(
                    f"2.5 1F1B p={p} m={m}: rank r should hold at most min(p - r, m) "
                    f"micro-batches ({expected}); got {one_f_peaks}"
                )


@exercise("2.5")
@pytest.mark.parametrize("costs", [(1.0, 2.0), (1.0, 1.0)], ids=["B=2F", "B=F"])
def test_simulated_bubble_is_p_minus_1_over_m_plus_p_minus_1(costs: tuple[float, float]) -> None:
    for name in ("gpipe", "1f1b"):
        for p, m in [(2, 1), (2, 5), (4, 4), (4, 9), (3, 7)]:
            bubbles = simulate(plain_schedule(name, p, m), *costs).bubble_fractions()
            formula = gpipe_bubble(p, m)
            if bubbles != pytest.approx([formula] * p, rel=1e-12):
                fail(
                    f"2.5 {name} p={p} m={m}, F={costs[0]:g} B={costs[1]:g}: each stage should "
                    f"idle (p-1)/(m+p-1) = {formula:.4f} of the step; simulated "
                    f"{[round(b, 4) for b in bubbles]}"
                )


@exercise("2.5")
def test_interleaved_schedule_cuts_the_bubble_by_v() -> None:
    schedules = schedules_module()
    for p, v in [(2, 2), (4, 2), (2, 3), (4, 3)]:
        for m in (p, 2 * p, 3 * p):
            schedule = schedules.make_schedule("interleaved", p, m, v)
            problems = schedule_problems(schedule, p, m, v)
            if problems:
                fail(f"2.5 interleaved p={p} m={m} v={v}:\n  " + "\n  ".join(problems[:4]))
            simulation = simulate(schedule, 1.0, 2.0)
            formula = interleaved_bubble(p, m, v)
            bubbles = simulation.bubble_fractions()
            # Megatron-LM's form: bubble time / ideal time = (1/v)·(p-1)/m
            ideal = m * v * (1.0 + 2.0)
            megatron = (simulation.makespan - ideal) / ideal
            if bubbles != pytest.approx([formula] * p, rel=1e-12) or megatron != pytest.approx(
                (p - 1) / (v * m)
            ):
                fail(
                    f"2.5 interleaved p={p} m={m} v={v}: expected bubble (p-1)/(v·m+p-1) = "
                    f"{formula:.4f}; simulated {[round(b, 4) for b in bubbles]} (interleaved "
                    "1F1B reuses one_f_one_b_order: check it first)"
                )


@exercise("2.5")
def test_interleaved_refuses_m_not_a_multiple_of_p() -> None:
    schedules = schedules_module()
    for p, m in [(2, 1), (2, 5), (4, 6), (4, 9)]:
        with pytest.raises(ValueError, match="multiple") as err:
            schedules.make_schedule("interleaved", p, m, 2)
        if str(m) not in str(err.value) or str(p) not in str(err.value):
            fail(f"2.5 interleaved p={p} m={m}: the refusal should name m and p: {err.value}")
    with pytest.raises(ValueError, match="'zero-bubble'"):
        schedules.make_schedule("zero-bubble", 2, 2)


def link_orders(
    schedule: Sequence[Sequence[Any]], placement: str = "loop"
) -> dict[tuple[int, int], tuple[list[Any], list[Any]]]:
    """For each directed link (src, dst) between two ranks: messages in the sender's and the
    receiver's order, when each rank receives just before an action and sends just after it
    (a W neither receives nor sends; two stages of one rank hand over without a message)."""
    p = len(schedule)
    v = 1 + max(a.chunk for actions in schedule for a in actions)  # chunks per rank
    last = p * v - 1
    links: dict[tuple[int, int], tuple[list[Any], list[Any]]] = {}
    for rank, actions in enumerate(schedule):
        for a in actions:
            if a.kind not in ("forward", "backward"):
                continue
            stage = virtual_stage(rank, a.chunk, p, placement)
            incoming = stage - 1 if a.kind == "forward" else stage + 1
            outgoing = stage + 1 if a.kind == "forward" else stage - 1
            if 0 <= incoming <= last and stage_rank(incoming, p, placement) != rank:
                links.setdefault((stage_rank(incoming, p, placement), rank), ([], []))[1].append(
                    (a.kind, stage, a.microbatch)
                )
            if 0 <= outgoing <= last and stage_rank(outgoing, p, placement) != rank:
                links.setdefault((rank, stage_rank(outgoing, p, placement)), ([], []))[0].append(
                    (a.kind, outgoing, a.microbatch)
                )
    return links


@exercise("2.5")
def test_both_ends_of_every_link_see_messages_in_the_same_order() -> None:
    schedules = schedules_module()
    for name, p, m in itertools.product(("gpipe", "1f1b", "interleaved"), (2, 3, 4), (4, 8, 12)):
        if name == "interleaved" and m % p:
            continue
        for (src, dst), (sent, received) in link_orders(
            schedules.make_schedule(name, p, m)
        ).items():
            if sent != received:
                fail(
                    f"2.5 {name} p={p} m={m}: rank {src} sends to rank {dst} in the order "
                    f"{sent[:6]}... but rank {dst} consumes {received[:6]}...: a backend that "
                    "matches messages in order (NCCL) would pair the wrong ones"
                )


# ============================================================================ partition


def brute_force_best(costs: Sequence[float], k: int) -> float:
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = [0, *cuts, n]
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


@exercise("2.5")
def test_balanced_partition_matches_brute_force() -> None:
    partition = partition_module()
    rng = random.Random(0)
    cases = [
        ([5.0], 1),
        ([1.0, 1.0, 1.0, 1.0], 2),
        ([0.0, 0.0, 7.0, 0.0], 3),
        ([9.0, 1, 1, 1, 1, 1], 2),
    ]
    cases += [
        ([float(rng.randint(0, 9)) for _ in range(n)], k)
        for n in range(1, 9)
        for k in range(1, n + 1)
    ]
    cases += [([rng.random() for _ in range(7)], k) for k in (2, 3, 5)]
    for costs, k in cases:
        parts = partition.balanced_partition(costs, k)
        indices = [i for part in parts for i in part]
        if len(parts) != k or not all(len(part) > 0 for part in parts):
            fail(f"2.5 partition of {costs} into {k}: expected {k} non-empty ranges, got {parts}")
        if indices != list(range(len(costs))):
            fail(
                f"2.5 partition of {costs} into {k}: the ranges must cover the layers in order, "
                f"once each; got {parts}"
            )
        worst = max(sum(costs[i] for i in part) for part in parts)
        best = brute_force_best(costs, k)
        if worst != pytest.approx(best, abs=1e-9):
            fail(
                f"2.5 partition of {costs} into {k}: your most expensive stage costs {worst}, "
                f"the best split's costs {best} (got {parts})"
            )


@exercise("2.5")
def test_partition_refuses_more_stages_than_layers() -> None:
    partition = partition_module()
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    with pytest.raises(ValueError, match="4 stages but the model has 3 layers"):
        partition.partition_model(model, 4)
    with pytest.raises(ValueError, match="num_stages=0"):
        partition.balanced_partition([1.0], 0)


@exercise("2.5")
def test_partition_model_balances_parameters_and_keeps_the_function() -> None:
    partition = partition_module()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 32),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.ReLU(),
        nn.Linear(32, 8),
        nn.ReLU(),
        nn.Linear(8, 8),
        nn.ReLU(),
        nn.Linear(8, 3),
    ).double()
    costs = partition.parameter_costs(model)
    if costs != [sum(p.numel() for p in layer.parameters()) for layer in model]:
        fail(f"2.5 parameter_costs should count each layer's parameters; got {costs}")
    for k in (2, 3, 4):
        stages = partition.partition_model(model, k)
        stage_params = [sum(p.numel() for p in s.parameters()) for s in stages]
        if max(stage_params) != brute_force_best(costs, k):
            fail(
                f"2.5 partition_model into {k} by parameters: largest stage {max(stage_params)}, "
                f"best possible {brute_force_best(costs, k)} (stages: {stage_params})"
            )
        layers = [layer for stage in stages for layer in stage]
        if len(layers) != len(model) or not all(
            a is b for a, b in zip(layers, model, strict=False)
        ):
            fail("2.5 the stages must hold the model's own layers, in order, each once")
        x = torch.randn(5, 4, dtype=torch.float64)
        out = x
        for stage in stages:
            out = stage(out)
        if not torch.equal(out, model(x)):
            fail("2.5 the stages one after the other must compute what the model computes")


# ============================================================================ executor

WIDTH, CLASSES, MICROBATCH_SIZE = 5, 3, 2


def tiny_pipeline_model(num_stages: int) -> nn.Sequential:
    """``num_stages`` blocks (Linear + Tanh), the last with a classifier: one block per stage."""
    torch.manual_seed(num_stages)
    blocks: list[nn.Module] = [
        nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(num_stages - 1)
    ]
    blocks.append(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, CLASSES)))
    return nn.Sequential(*blocks).double()


def pipeline_batch(m: int, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randn(m * MICROBATCH_SIZE, WIDTH, generator=g, dtype=torch.float64)
    return inputs, torch.randint(CLASSES, (m * MICROBATCH_SIZE,), generator=g)


def single_device_reference(
    num_stages: int, m: int, seed: int = 7
) -> tuple[float, list[list[torch.Tensor]]]:
    model = tiny_pipeline_model(num_stages)
    inputs, targets = pipeline_batch(m, seed)
    loss = F.cross_entropy(model(inputs), targets)
    loss.backward()
    grads = [[p.grad.clone() for p in block.parameters() if p.grad is not None] for block in model]
    return loss.item(), grads


class _NoBlockingSend(list[CommRecord]):
    """CommCounter records that stop a rank at its first blocking ``dist.send``, before it can
    deadlock the world."""

    def append(self, record: CommRecord) -> None:
        super().append(record)
        if record.op == "send":
            raise AssertionError(
                f"2.5: rank {dist.get_rank()} sent with the blocking dist.send: use dist.isend "
                "(a blocking send waits for the receiver, and two neighbours that both send "
                "first wait for each other forever; interleaved 1F1B with m >= 2p does)"
            )


def run_case(
    case: tuple[str, int, int, bool],
    rank: int,
    p: int,
    group: dist.ProcessGroup | None,
    seed: int = 7,
) -> dict[str, Any]:
    """Two steps of one (schedule, m, v, checkpoint) case on this rank: what the tests compare."""
    name, m, v, use_checkpoint = case
    schedules, executor = schedules_module(), executor_module()
    try:
        schedule = schedules.make_schedule(name, p, m, v)
    except ValueError as err:  # refused before any message: every rank refuses alike
        return {"refused": str(err)}
    chunks_here = schedules.chunks_per_rank(name, v)
    placement = schedules.placement_of(name)
    model = tiny_pipeline_model(p * chunks_here)
    chunks = rank_chunks(list(model), rank, p, placement)
    runner = executor.PipelineExecutor(
        chunks,
        schedule[rank],
        m,
        loss_fn=F.cross_entropy,
        checkpoint_chunks=use_checkpoint,
        group=group,
        placement=placement,
    )
    inputs, targets = pipeline_batch(m, seed)
    with CommCounter(records=_NoBlockingSend()):
        first = runner.step(inputs, targets)
    model.zero_grad(set_to_none=True)
    with CommCounter(records=_NoBlockingSend()) as comm:
        result = runner.step(inputs, targets)
    stages = [virtual_stage(rank, c, p, placement) for c in range(chunks_here)]
    last = p * chunks_here - 1

    def crosses(stage: int, neighbour: int) -> bool:  # a boundary between two ranks
        return 0 <= neighbour <= last and stage_rank(neighbour, p, placement) != rank

    data_sends = sum(
        m * (crosses(stage, stage + 1) + crosses(stage, stage - 1)) for stage in stages
    )
    header_sends = sum(crosses(stage, stage + 1) for stage in stages)
    return {
        "losses": (first.loss, result.loss),
        "grads": {
            stage: [q.grad.clone() for q in chunk.parameters() if q.grad is not None]
            for stage, chunk in zip(stages, chunks, strict=True)
        },
        "peak": result.peak_stashed,
        "schedule_peak": schedules.peak_in_flight(schedule[rank]),
        "left_in_stash": result.left_stashed,
        "left_in_weight_stash": getattr(result, "left_weight_stashed", 0),
        "actions": keys(schedule[rank]),
        "computed": [
            str(schedules.Action(e.name, e.labels["microbatch"], e.labels["chunk"]))
            for e in result.events
            if e.name in ("forward", "backward", "weight")
        ],
        "in_time_order": all(a.end <= b.start for a, b in itertools.pairwise(result.events)),
        "sends": comm.count("isend"),
        "expected_sends": data_sends + header_sends,
        "data_sends": data_sends,
    }


@remarks("2.5 executor")
def executor_worker(cases: list[tuple[str, int, int, bool]]) -> list[dict[str, Any]]:
    rank, p = dist.get_rank(), dist.get_world_size()
    return [run_case(case, rank, p, None) for case in cases]


def gradient_hint(got: torch.Tensor, expected: torch.Tensor, last_stage_right: bool) -> str:
    """How the wrong gradient relates to the right one: all zeros (no gradient reached it; the
    causes that fit, told apart by whether the last stage's gradients are right) or its norm's
    ratio (described: a ratio alone names none)."""
    if not got.any():
        causes = (
            "a later stage ran on its received activation without requires_grad_(), so its "
            ".grad never existed and zeros were sent back; or this stage's backward did not "
            "start from the gradient that came back"
            if last_stage_right
            else "the loss was scaled by 0 (an integer 1 // m); or no backward ran from it"
        )
        which = "the last stage's are right" if last_stage_right else "the last stage's too"
        return f" (it is all zeros, no gradient reached it, and {which}; the causes that fit: {causes})"
    ratio = float(got.norm() / expected.norm())
    return f" (its norm is {ratio:.3g} times the expected one)"


def _stage_right(
    per_rank: Sequence[dict[str, Any]], ref_grads: Sequence[Sequence[torch.Tensor]], stage: int
) -> bool:
    found = {s: grads for got in per_rank for s, grads in got["grads"].items()}
    return len(found.get(stage, [])) == len(ref_grads[stage]) and all(
        torch.allclose(g, r, rtol=1e-10, atol=1e-12)
        for g, r in zip(found[stage], ref_grads[stage], strict=True)
    )


def _later_stages_right(
    per_rank: Sequence[dict[str, Any]],
    ref_grads: Sequence[Sequence[torch.Tensor]],
    stage: int,
    num_stages: int,
) -> str:
    """A remark when every stage after ``stage`` has the right gradients: then what reached
    this stage from the next one, or what this stage did with it, is wrong."""
    found = {s: grads for got in per_rank for s, grads in got["grads"].items()}
    later = range(stage + 1, num_stages)
    if not later or not all(
        len(found.get(s, [])) == len(ref_grads[s])
        and all(
            torch.allclose(g, r, rtol=1e-10, atol=1e-12)
            for g, r in zip(found[s], ref_grads[s], strict=True)
        )
        for s in later
    ):
        return ""
    return (
        f". Every stage after {stage} has the right gradients, so the gradient that came back "
        f"to stage {stage}, or what its backward did with it, is wrong: a stage before the last "
        "starts its backward from its output with the gradient that came back for it, and "
        "returns the gradient of its input"
    )


def case_label(p: int, case: tuple[str, int, int, bool]) -> str:
    name, m, v, use_checkpoint = case
    label = f"2.5 executor, {name}, p={p}, m={m}" + (f", v={v}" if name == "interleaved" else "")
    return label + (", checkpointed chunks" if use_checkpoint else "")


def loss_verdict(label: str, step: int, loss: float | None, ref_loss: float, m: int) -> str | None:
    """What is wrong with the last stage's loss, None when it is the single-device mean. A
    cause (the sum of the micro-batches' losses, m times the mean) is named only when the ratio
    is m; the graded cases put m = 2p + 1 before m = p, so a loss off by the stage count p is
    never first seen where m = p."""
    if loss is not None and loss == pytest.approx(ref_loss, rel=1e-12):
        return None
    hint = "scale each micro-batch's loss by 1/m"
    if loss is not None and ref_loss and m > 1 and loss == pytest.approx(ref_loss * m, rel=1e-9):
        hint = f"it is m = {m} times the mean: " + hint
    elif loss is not None and ref_loss:
        hint = f"it is {loss / ref_loss:.4g} times the mean: " + hint
    return (
        f"{label}: step {step + 1} loss {loss!r} on the last stage, but the "
        f"single-device model's mean loss is {ref_loss!r} ({hint})"
    )


def check_executor_case(
    label: str,
    p: int,
    case: tuple[str, int, int, bool],
    per_rank: Sequence[dict[str, Any]],
    seed: int = 7,
) -> None:
    name, m, v, _ = case
    schedules = schedules_module()
    num_stages = p * schedules.chunks_per_rank(name, v)
    ref_loss, ref_grads = single_device_reference(num_stages, m, seed)
    last_rank = stage_rank(num_stages - 1, p, schedules.placement_of(name))
    for rank, got in enumerate(per_rank):
        if "refused" in got:
            fail(f"{label}: rank {rank} refused a schedule it should run: {got['refused']}")
        for step, loss in enumerate(got["losses"]):
            if rank == last_rank:
                verdict = loss_verdict(label, step, loss, ref_loss, m)
                if verdict:
                    fail(verdict + defined_at(executor_module().PipelineExecutor._forward))
            if rank != last_rank and loss is not None:
                fail(f"{label}: only the last stage has a loss; rank {rank} returned {loss}")
    for rank, got in enumerate(per_rank):
        if got["computed"] != got["actions"]:
            fail(
                f"{label}: rank {rank} should run its schedule {' '.join(got['actions'])}, "
                f"recorded {' '.join(got['computed'])}"
            )
        if not got["in_time_order"]:
            fail(f"{label}: rank {rank}'s recorded events overlap")
        if name == "gpipe" and got["peak"] != m:
            fail(f"{label}: GPipe holds all m={m} micro-batches; rank {rank} held {got['peak']}")
        if name == "1f1b" and got["peak"] != min(p - rank, m):
            fail(
                f"{label}: under 1F1B rank {rank} should hold at most min(p - rank, m) = "
                f"{min(p - rank, m)} micro-batches, it held {got['peak']}: its warm-up is "
                "min(p - rank - 1, m) forwards, then each forward is followed by a backward"
            )
        if got["left_in_stash"] or got["peak"] != got["schedule_peak"]:
            fail(
                f"{label}: rank {rank} held up to {got['peak']} micro-batches' activations at "
                f"once and {got['left_in_stash']} after the step; its schedule holds at most "
                f"{got['schedule_peak']} and none after: each backward must take its entry out "
                "of the stash (pop, not get), so the activations are freed as soon as they are "
                "used"
            )
    for rank, got in enumerate(per_rank):
        for stage, grads in got["grads"].items():
            ref = ref_grads[stage]
            if len(grads) != len(ref):
                fail(
                    f"{label}: stage {stage} (rank {rank}) has {len(grads)} parameter gradients, "
                    f"expected {len(ref)}"
                )
            for i, (g, r) in enumerate(zip(grads, ref, strict=True)):
                if not torch.allclose(g, r, rtol=1e-10, atol=1e-12):
                    fail(
                        f"{label}: stage {stage} (rank {rank}) parameter {i}'s gradient differs "
                        f"from the single-device model's by {(g - r).abs().max():.3e}"
                        f"{gradient_hint(g, r, _stage_right(per_rank, ref_grads, num_stages - 1))}"
                        + _later_stages_right(per_rank, ref_grads, stage, num_stages)
                    )
    for rank, got in enumerate(per_rank):
        if got["sends"] != got["expected_sends"]:
            fail(
                f"{label}: rank {rank} made {got['sends']} isend calls in a step; expected "
                f"{got['data_sends']} data messages (one activation per micro-batch to the next "
                "stage, one gradient to the previous) plus one header per stage boundary"
            )


def executor_micro_batches(p: int) -> tuple[int, ...]:
    """m per schedule: 1, then 2p + 1 (unlike p and every stage count) before m = p."""
    return (1, 2 * p + 1, p)


def executor_cases(p: int) -> list[tuple[str, int, int, bool]]:
    cases = [
        (name, m, 2, False)
        for name in ("gpipe", "1f1b", "interleaved")
        for m in executor_micro_batches(p)
    ]
    return [*cases, ("interleaved", 2 * p, 2, False)]


@exercise("2.5")
@pytest.mark.parametrize("p", [2, 4])
def test_executor_matches_the_single_device_model_for_every_schedule(p: int) -> None:
    cases = executor_cases(p)
    results = run(f"2.5 executor, p={p}", executor_worker, p, cases, hang_hint=HANG_HINT)
    for index, case in enumerate(cases):
        per_rank = [results[rank][index] for rank in range(p)]
        name, m = case[0], case[1]
        if name == "interleaved" and m % p:
            for rank, got in enumerate(per_rank):
                if "multiple" not in got.get("refused", ""):
                    fail(
                        f"2.5 interleaved p={p} m={m}: must refuse with a ValueError saying m "
                        f"must be a multiple of p, before any message; rank {rank} got {got}"
                    )
            continue
        check_executor_case(case_label(p, case), p, case, per_rank)


@exercise("2.5")
def test_executor_with_checkpointed_chunks_matches_the_single_device_model() -> None:
    cases = [("1f1b", 3, 1, True), ("interleaved", 2, 2, True)]
    results = run("2.5 checkpointed", executor_worker, 2, cases, hang_hint=HANG_HINT)
    for index, case in enumerate(cases):
        check_executor_case(case_label(2, case), 2, case, [results[r][index] for r in range(2)])


@remarks("2.5 executor in a subgroup")
def executor_subgroup_worker(
    info: SubgroupInfo, cases: list[tuple[str, int, int, bool]]
) -> dict[str, Any]:
    with only_inside(info, "2.5 pipeline"):
        results = [
            run_case(case, info.group_rank, info.size, info.group, seed=20 + info.index)
            for case in cases
        ]
    return {"group": info.index, "results": results}


@exercise("2.5")
def test_executor_runs_inside_a_subgroup() -> None:
    cases = [("1f1b", 3, 1, False), ("interleaved", 2, 2, False)]
    outcome = run_in_subgroups("2.5 executor in subgroups", executor_subgroup_worker, cases)
    for index in (0, 1):
        mine = [o["results"] for o in outcome if o["group"] == index]
        for c, case in enumerate(cases):
            label = (
                case_label(2, case) + f", in the group of ranks {2 * index}-{2 * index + 1} of "
                "a world of 4 (ranks within the group: PipelineExecutor(..., group=group))"
            )
            check_executor_case(label, 2, case, [r[c] for r in mine], seed=20 + index)


@remarks("2.5 executor refusals")
def executor_refusal_worker(num_microbatches: int, batch_microbatches: int) -> dict[str, Any]:
    executor, schedules = executor_module(), schedules_module()
    rank, p = dist.get_rank(), dist.get_world_size()
    model = tiny_pipeline_model(p)
    actions = schedules.make_schedule("1f1b", p, num_microbatches)[rank]
    messages = []
    try:
        executor.PipelineExecutor([model[rank]], actions[:-1], num_microbatches)
    except ValueError as err:
        messages.append(str(err))
    runner = executor.PipelineExecutor(
        [model[rank]], actions, num_microbatches, loss_fn=F.cross_entropy
    )
    inputs, targets = pipeline_batch(batch_microbatches)  # 2 samples per micro-batch
    with CommCounter(records=_NoBlockingSend()) as comm:
        try:
            runner.step(inputs, targets)
        except ValueError as err:
            messages.append(str(err))
    point_to_point = [r for r in comm.records if r.is_point_to_point]
    headers = (rank < p - 1) + (rank > 0)  # one header out, one in, per boundary
    return {"messages": messages, "data_messages": len(point_to_point) - headers}


@exercise("2.5")
def test_executor_refuses_unequal_microbatches_on_every_rank_before_any_data() -> None:
    # 3 ranks: the middle one holds neither the inputs nor the targets, and must refuse too
    results = run(
        "2.5 refusal of 8 samples for 3 micro-batches",
        executor_refusal_worker,
        3,
        3,
        4,
        hang_hint=(
            "A rank that does not hold the batch waited for data that never came: every rank "
            "must learn the batch size (the headers walk through every stage before the data) "
            "and refuse a batch that does not split, before any data message."
        ),
    )
    for rank, got in enumerate(results):
        messages = got["messages"]
        if len(messages) != 2 or "8 samples" not in messages[1]:
            fail(
                f"2.5 rank {rank} of 3: a schedule missing an action must raise a ValueError "
                "when the executor is built, and a batch of 8 samples for 3 micro-batches must "
                f"raise one naming '8 samples' on every rank before any data; got {messages}"
            )
        if got["data_messages"]:
            fail(
                f"2.5 rank {rank} of 3 posted {got['data_messages']} data messages before "
                "refusing a batch of 8 samples for 3 micro-batches"
            )


# ============================================================================ the library way


def torch_pipelining_worker(
    cases: list[tuple[str, int]],
) -> list[tuple[float | None, list[torch.Tensor]]]:
    rank, p = dist.get_rank(), dist.get_world_size()
    out = []
    for name, m in cases:
        stage = tiny_pipeline_model(p)[rank]
        inputs, targets = pipeline_batch(m)
        loss = pipeline_parallel.torch_pipelining_step(stage, name, m, inputs, targets)
        out.append((loss, [q.grad.clone() for q in stage.parameters() if q.grad is not None]))
    return out


@exercise("2.5")
@pytest.mark.reference
@pytest.mark.parametrize("p", [2, 4])
def test_torch_pipelining_matches_the_single_device_model(p: int) -> None:
    cases = [("gpipe", 1), ("gpipe", p), ("gpipe", 2 * p + 1), ("1f1b", p), ("1f1b", 2 * p + 1)]
    results = run(f"torch.distributed.pipelining, p={p}", torch_pipelining_worker, p, cases)
    for index, (name, m) in enumerate(cases):
        ref_loss, ref_grads = single_device_reference(p, m)
        for rank in range(p):
            loss, grads = results[rank][index]
            if rank == p - 1 and loss != pytest.approx(ref_loss, rel=1e-12):
                fail(f"torch {name} p={p} m={m}: loss {loss}, one device {ref_loss}")
            for g, r in zip(grads, ref_grads[rank], strict=True):
                if not torch.allclose(g, r, rtol=1e-10, atol=1e-12):
                    fail(
                        f"torch.distributed.pipelining {name} p={p} m={m}: stage {rank}'s "
                        f"gradient differs from the single-device model's by "
                        f"{(g - r).abs().max():.3e}"
                    )


def torch_pipelining_subgroup_worker(info: SubgroupInfo) -> dict[str, Any]:
    stage = tiny_pipeline_model(2)[info.group_rank]
    inputs, targets = pipeline_batch(4, 20 + info.index)
    with only_inside(info, "torch.distributed.pipelining"):
        loss = pipeline_parallel.torch_pipelining_step(
            stage, "1f1b", 4, inputs, targets, group=info.group
        )
    grads = [q.grad.clone() for q in stage.parameters() if q.grad is not None]
    return {"group": info.index, "rank": info.group_rank, "loss": loss, "grads": grads}


@exercise("2.5")
@pytest.mark.reference
def test_torch_pipelining_runs_inside_a_subgroup() -> None:
    results = run_in_subgroups("torch pipelining in subgroups", torch_pipelining_subgroup_worker)
    for got in results:
        ref_loss, ref_grads = single_device_reference(2, 4, 20 + got["group"])
        if got["rank"] == 1 and got["loss"] != pytest.approx(ref_loss, rel=1e-12):
            fail(f"torch 1F1B in group {got['group']}: loss {got['loss']}, one device {ref_loss}")
        for g, r in zip(got["grads"], ref_grads[got["rank"]], strict=True):
            if not torch.allclose(g, r, rtol=1e-10, atol=1e-12):
                fail(f"torch 1F1B in group {got['group']}: stage {got['rank']}'s gradient differs")


# ============================================================================ the demo


@remarks(
    "2.5 demo training",
    [
        (
            "element 0 of tensors does not require grad",
            "a backward was asked of an output without a graph. Balancing by parameters can give "
            "a stage only parameter-free layers (a Flatten, a ReLU); when its input needs no "
            "gradient either (stage 0's data), its output has no graph and its backward has "
            "nothing to backpropagate (the executor test's stages all hold parameters, so it "
            "could not show this)",
        )
    ],
)
def pipeline_training_worker(configs: list[pipeline_parallel.PipelineConfig]) -> list[list[float]]:
    return [pipeline_parallel.run_pipeline(config).losses for config in configs]


def small_config(**choices: Any) -> pipeline_parallel.PipelineConfig:
    return pipeline_parallel.PipelineConfig(
        depth=3, width=16, microbatch_size=2, steps=2, microbatches=4, impl=impl(), **choices
    )


@exercise("2.5")
def test_pipeline_training_follows_the_single_device_model() -> None:
    configs = [
        small_config(schedule="gpipe"),
        small_config(schedule="interleaved", balance="time"),
        small_config(schedule="interleaved"),  # by parameters: a stage of only a ReLU
        small_config(schedule="1f1b", engine="torch"),
    ]
    results = run("2.5 demo training", pipeline_training_worker, 2, configs, hang_hint=HANG_HINT)
    for config, losses in zip(configs, results[0], strict=True):
        reference = pipeline_parallel.single_device_losses(config)
        if losses != pytest.approx(reference, rel=1e-12):
            fail(
                f"2.5 {config.schedule} ({config.engine}, balance {config.balance}) training: "
                f"losses {losses}, one device {reference}"
            )
    if results[0] != results[1]:
        fail("2.5 demo: every rank must report the same losses")


@exercise("2.5")
@pytest.mark.reference
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--schedule", "interleaved", "--microbatches", "3"], "multiple"),
        (["--engine", "torch", "--microbatches", "1"], "Schedule1F1B"),
        (["--depth", "1", "--schedule", "interleaved", "--microbatches", "4"], "8 stages"),
        (["--microbatches", "0", "--steps", "0"], "--steps 0"),
        (["--schedule", "zb-h1", "--checkpoint"], "--checkpoint with --schedule zb-h1"),
        (["--schedule", "interleaved", "--engine", "torch", "--microbatches", "4"], "wired"),
        (
            ["--schedule", "zb-v", "--engine", "torch", "--depth", "3", "--width", "16"],
            "stage 0 holds no parameters",
        ),
    ],
)
def test_instructor_command_refuses_bad_arguments_before_starting(
    argv: list[str],
    expected: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    code = pipeline_parallel.main(argv)
    err = capsys.readouterr().err
    if code != 2 or dist.is_initialized() or expected not in err:
        fail(f"{argv}: expected exit 2 before any process group, naming {expected!r}; got {err}")
    if argv[:2] == ["--microbatches", "0"] and "--microbatches 0" not in err:
        fail(f"every bad flag is named at once: {err}")


@exercise("2.5")
@pytest.mark.reference
def test_instructor_command_refuses_unknown_choices(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exited:
        pipeline_parallel.main(["--schedule", "pipedream"])
    err = capsys.readouterr().err
    if exited.value.code != 2 or "'pipedream'" not in err:
        fail(f"--schedule pipedream: expected exit 2 naming the choice; got {err}")
