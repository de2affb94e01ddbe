"""Grader of exercise 4.5, monitoring and profiling: ``uv run pytest tests/test_phase4.py -m ex4_5``.

The step breakdown is graded on a fake clock (the sections must tile the step, micro-batches add
up, and on CUDA the clock is read after the kernels finish); the FLOPs against
``FlopCounterMode``'s forward + backward and the arithmetic of a chain of Linear layers; MFU on
round numbers; the straggler rule on step times the test chooses, in worlds of 2 and 4 and in
subgroups (one mistake, one wrong answer: a mean, no all-gather, the group's rank). Then real
training runs with the monitor attached: a rank that sleeps in its forward is named in every
report, the others are seen waiting for it in ``sync``, and with ordinary noise nobody is named.
The given plumbing (the loop's timing points, TensorBoard, JSONL, profiler traces, the demo and
the plot) is checked beside it (``reference``).
"""

from __future__ import annotations

import json
import math
import resource
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from grading import defined_at, exercise, learner_line, world
from monitoring_helpers import (
    PEAK_FLOPS,
    FakeClock,
    RunSpec,
    Scenario,
    demo_worker,
    loop_points_worker,
    monitored_run,
    monitoring,
    read_jsonl,
    stragglers_worker,
)
from phase4_helpers import fail
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

SECTIONS = ("data", "forward", "backward", "sync", "optimizer", "other")


def ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f} ms"


# ----------------------------------------------------------------------------- the step breakdown


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    for name in ("perf_counter", "monotonic", "time", "process_time"):
        monkeypatch.setattr(time, name, fake)
    for name in ("perf_counter_ns", "monotonic_ns", "time_ns"):
        monkeypatch.setattr(time, name, fake.ns)
    return fake


# one step: (seconds the section runs, the timing point that closes it); two micro-batches
PLAN = [
    (0.030, "data"),
    (0.010, "forward"),
    (0.020, "backward"),
    (0.010, "forward"),
    (0.020, "backward"),
    (0.005, "sync"),
    (0.003, "optimizer"),
    (0.0005, "other"),
]
EXPECTED = {
    "data": 0.030,
    "forward": 0.020,
    "backward": 0.040,
    "sync": 0.005,
    "optimizer": 0.003,
    "other": 0.0005,
}


def run_plan(timer: Any, clock: FakeClock, plan: list[tuple[float, str]]) -> Any:
    timer.start()
    for seconds, section in plan:
        clock.advance(seconds)
        timer.mark(section)
    return timer.finish()


def describe(sections: dict[str, float]) -> str:
    return ", ".join(f"{k} {ms(v)}" for k, v in sections.items())


@exercise("4.5")
def test_the_sections_tile_the_step(clock: FakeClock) -> None:
    timer = monitoring().StepTimer("cpu")
    for attempt in range(2):
        clock.advance(0.250)  # time between steps (callbacks) belongs to no step
        times = run_plan(timer, clock, PLAN)
        got = {k: float(v) for k, v in times.sections.items()}
        wall = sum(seconds for seconds, _ in PLAN)
        total = sum(got.values())
        if total > times.total + 1e-9 or total > wall + 1e-9:
            fail(
                f"4.5 StepTimer.mark: the sections add up to {ms(total)} but the step took "
                f"{ms(wall)}: they overlap. Each timing point closes only the section since the "
                f"previous point (self.last), not since start(); got {describe(got)}"
            )
        if got.get("forward") == pytest.approx(0.010) or got.get("backward") == pytest.approx(0.02):
            fail(
                "4.5 StepTimer.mark: forward and backward ran twice in this step (two "
                f"micro-batches) and must add up (20 ms and 40 ms); got {describe(got)}"
            )
        wrong = {
            k: v for k, v in EXPECTED.items() if not math.isclose(got.get(k, -1), v, abs_tol=1e-9)
        }
        if wrong or set(got) != set(EXPECTED):
            fail(
                f"4.5 StepTimer.mark (step {attempt + 1}): expected {describe(EXPECTED)}; got "
                f"{describe(got)}. A mark adds the time since the previous timing point to its "
                "section, then makes now the previous point"
            )
        if not math.isclose(times.total, wall, abs_tol=1e-9):
            fail(
                f"4.5 StepTimer: the step took {ms(wall)} from start() to the last mark, but "
                f"finish() says {ms(times.total)}: mark must move self.last to now"
            )


@exercise("4.5")
def test_on_cuda_the_clock_is_read_after_the_kernels_finish(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    syncs: list[float] = []

    def synchronize(*args: Any, **kwargs: Any) -> None:
        clock.advance(0.007)  # the kernels queued so far take 7 ms more to finish
        syncs.append(clock.now)

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    timer = monitoring().StepTimer(torch.device("cuda", 0))
    times = run_plan(timer, clock, [(0.010, "forward"), (0.020, "backward")])
    got = {k: float(v) for k, v in times.sections.items()}
    want = {"forward": 0.017, "backward": 0.027}
    if len(syncs) < 3:
        fail(
            f"4.5 StepTimer.mark on a CUDA device called torch.cuda.synchronize {len(syncs) - 1} "
            "times for 2 marks: kernels run asynchronously, so without it a section's kernels "
            f"are timed in whichever later section waits for them; got {describe(got)}"
        )
    if any(not math.isclose(got.get(k, -1), v, abs_tol=1e-9) for k, v in want.items()):
        fail(
            f"4.5 StepTimer.mark on CUDA: expected {describe(want)} (each section's own 7 ms of "
            f"kernels included); got {describe(got)}. Synchronize first, then read the clock"
        )


# ----------------------------------------------------------------------------- FLOPs and MFU


def chain(batch_norm: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(6, 7), nn.ReLU(), nn.Linear(7, 5), nn.ReLU()]
    if batch_norm:
        layers.append(nn.BatchNorm1d(5))
    layers.append(nn.Linear(5, 3))
    return nn.Sequential(*layers)


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a, self.b = nn.Linear(6, 5), nn.Linear(3, 5)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.a(x) + self.b(z)
        return out


def library_count(model: nn.Module, inputs: tuple[torch.Tensor, ...], loss: Any) -> float:
    with FlopCounterMode(display=False) as counter:
        loss(model(*inputs)).backward()
    model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


CHAIN_DIMS = [(6, 7), (7, 5), (5, 3)]  # the Linear layers of chain()


def chain_flops(batch: int) -> tuple[int, int]:
    """(forward, forward + backward) FLOPs of chain() on a batch: a matmul of [B, i] x [i, o]
    is 2·B·i·o FLOPs; backward computes the weight gradient of every layer and the input
    gradient of every layer but the first (x needs no gradient)."""
    forward = sum(2 * batch * i * o for i, o in CHAIN_DIMS)
    return forward, forward + forward + sum(2 * batch * i * o for i, o in CHAIN_DIMS[1:])


@exercise("4.5")
def test_training_flops_are_forward_plus_backward_counted_once() -> None:
    ex = monitoring()
    batch = 4
    x, y = torch.randn(batch, 6), torch.tensor([0, 1, 2, 0])

    def ce(out: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, y)

    model = chain(batch_norm=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    got = ex.count_training_flops(model, x, ce)
    # a matmul of [B, i] x [i, o] is 2·B·i·o FLOPs; backward computes the weight gradient of
    # every layer and the input gradient of every layer but the first (x needs no gradient)
    forward, want = chain_flops(batch)
    verdict = flops_verdict(got, forward, want, batch)
    if verdict:
        fail(verdict)
    grads = [n for n, p in model.named_parameters() if p.grad is not None]
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    if grads or changed:
        fail(
            "4.5 count_training_flops changed the model it was given (gradients on "
            f"{grads[:3]}, state changed: {changed[:3]}): count on the scratch copy"
        )
    two = TwoInputs()
    inputs = (torch.randn(batch, 6), torch.randn(batch, 3))
    try:
        got = ex.count_training_flops(two, inputs, lambda out: out.square().mean())
    except TypeError as err:
        fail(
            "4.5 count_training_flops(model, (x, z), loss_fn) with a model of two inputs raised "
            f"TypeError: {err}{learner_line(err)}; example_inputs may be a tuple: call "
            "scratch(*inputs)"
        )
    want_two = library_count(TwoInputs(), inputs, lambda out: out.square().mean())
    if got != want_two:
        fail(
            "4.5 count_training_flops(model, (x, z), loss_fn) with a model of two inputs "
            f"returned {got}; FlopCounterMode says {want_two}: call scratch(*inputs)"
        )


@exercise("4.5")
def test_mfu_is_model_flops_per_second_over_the_peak() -> None:
    ex = monitoring()
    for flops, seconds, peak, want in MFU_CASES:
        returned = ex.model_flops_utilization(flops, seconds, peak)
        try:
            got = float(returned)
        except (TypeError, ValueError, RuntimeError):
            fail(
                f"4.5 model_flops_utilization({flops:g}, {seconds:g}, {peak:g}) returned "
                f"{returned!r}; expected one number, {want:g}{defined_at(ex.model_flops_utilization)}"
            )
        verdict = mfu_verdict(flops, seconds, peak, want, got)
        if verdict:
            fail(verdict)


MFU_CASES = [  # flops per step, seconds per step, peak FLOP/s, the MFU
    (3e12, 0.5, 12e12, 0.5),
    (6.2e7, 0.050, 8.0e10, 0.0155),
    (9.894e14, 1.0, 989.4e12, 1.0),
]


def mfu_verdict(flops: float, seconds: float, peak: float, want: float, got: float) -> str | None:
    if math.isclose(got, want, rel_tol=1e-9):
        return None
    return (
        f"4.5 model_flops_utilization({flops:g} FLOPs, {seconds:g} s, peak {peak:g} FLOP/s) "
        f"returned {got:g}; expected {want:g} = flops / seconds / peak{mfu_hint(got, want)}"
    )


# what a realistic MFU mistake multiplies the answer by, and the words for it
MFU_RATIOS = {
    1e-3: " (1000 times too small: the seconds were turned into milliseconds; seconds are seconds)",
    1e3: " (1000 times too large: the seconds were divided by 1000; seconds are seconds)",
    3.0: " (3 times too large: flops_per_step already counts forward + backward; multiply by "
    "nothing)",
    1 / 3: " (3 times too small: flops_per_step already counts forward + backward; divide by "
    "nothing)",
    1e-12: " (1e12 times too small: peak_flops is in FLOP/s already; it was multiplied by 1e12)",
    1e12: " (1e12 times too large: peak_flops is in FLOP/s, not TFLOP/s; it was divided by 1e12)",
}


def mfu_hint(got: float, want: float) -> str:
    """The cause of a wrong MFU when the ratio to the right one is a known mistake's; else the
    ratio itself."""
    ratio = got / want if want else math.inf
    for known, words in MFU_RATIOS.items():
        if math.isclose(ratio, known, rel_tol=1e-6):
            return words
    return f" ({ratio:.3g} times the expected value)" if math.isfinite(ratio) else ""


def flops_verdict(got: float, forward: int, want: int, batch: int) -> str | None:
    """The failure for a step's FLOP count: ``forward`` and ``want`` (forward + backward) of the
    graded chain; the cause named only where the count is one known mistake's."""
    if got == want:
        return None
    head = f"4.5 count_training_flops returned {got:.0f} for a step of {want} FLOPs"
    if got == forward:
        return (
            f"{head}: the forward pass alone; a training step runs forward and backward: run "
            "loss.backward() inside the counter"
        )
    if got == 3 * forward:
        return (
            f"{head}: 3 x the forward count, the rule of thumb (backward = 2 x forward) in place "
            "of the count: FlopCounterMode measures the backward itself; run loss.backward() "
            "inside it and multiply by nothing"
        )
    for times in (2, 3):
        if got == times * want:
            return (
                f"{head}: {times} x the forward + backward count: FlopCounterMode already counts "
                "the backward pass; multiply by nothing"
            )
    return (
        f"{head} ({got / want:.3g} x): Linear 6-7-5-3 on a batch of {batch} is {forward} FLOPs "
        f"forward and {want} forward + backward"
    )


# ----------------------------------------------------------------------------- the straggler rule


def windows(*per_rank: list[float]) -> dict[int, list[float]]:
    return dict(enumerate(per_rank))


TWO = [
    ("rank 1 four times slower", Scenario(windows([10.0] * 4, [40.0] * 4)), [1]),
    ("rank 1 three times slower", Scenario(windows([10.0] * 4, [30.0] * 4)), [1]),
    ("one hiccup on rank 0", Scenario(windows([10, 10, 10, 200, 10], [11.0] * 5)), []),
    ("ordinary noise", Scenario(windows([10, 12, 9, 11], [12, 10, 13, 11])), []),
    ("rank 1 exactly at the threshold", Scenario(windows([250.0] * 4, [375.0] * 4)), []),
]
FOUR = [
    (
        "ranks 2 and 3 slow",
        Scenario(windows([10.0] * 3, [11.0] * 3, [17.0] * 3, [100.0] * 3)),
        [2, 3],
    ),
    (
        "ranks 2 and 3 slow, a higher threshold",
        Scenario(windows([10.0] * 3, [11.0] * 3, [17.0] * 3, [100.0] * 3), threshold=3.0),
        [3],
    ),
    ("rank 0 much faster", Scenario(windows([2.0] * 3, [10.0] * 3, [10.5] * 3, [11.0] * 3)), []),
    (  # the mean across ranks (38.75 ms) hides rank 2; the average of the middle two does not
        "rank 2 slow behind a very slow rank 3",
        Scenario(windows([10.0] * 3, [10.0] * 3, [35.0] * 3, [100.0] * 3)),
        [2, 3],
    ),
    (
        "groups (0, 2) and (1, 3), rank 3 slow",
        Scenario(windows([10.0] * 3, [10.0] * 3, [11.0] * 3, [40.0] * 3), groups=((0, 2), (1, 3))),
        {0: [], 2: [], 1: [3], 3: [3]},
    ),
]


def in_two_groups(name: str, scenario: Scenario, want: list[int]) -> tuple[str, Scenario, Any]:
    """A world of 2's scenario run by the groups (0, 1) and (2, 3) of a world of 4 at once: the
    world of 4 then sees every realistic mistake, the group's rank named included."""
    w = scenario.windows_ms
    return (
        f"{name}, in the groups (0, 1) and (2, 3)",
        Scenario({0: w[0], 1: w[1], 2: w[0], 3: w[1]}, ((0, 1), (2, 3)), scenario.threshold),
        {0: want, 1: want, 2: [2 + r for r in want], 3: [2 + r for r in want]},
    )


FOUR += [in_two_groups(*case) for case in TWO]


def lower_median(values: list[float]) -> float:
    return float(torch.tensor(values, dtype=torch.float64).median())


def check_scenarios(
    results: list[list[dict[str, Any]]], cases: list[Any], world_size: int, name_causes: bool = True
) -> None:
    """Every scenario's answer on every rank; the most telling mistake is reported first."""
    for index, (name, _, _) in enumerate(cases):
        for rank in range(world_size):
            got = results[rank][index]
            if got["crossing"]:
                fail(
                    f"4.5 find_stragglers ({name}): rank {rank} talked outside its group: "
                    f"{got['crossing'][0]}; pass group=group to the collective"
                )
    told = [
        {rank: results[rank][i]["named"] for rank in range(world_size)} for i in range(len(cases))
    ]
    verdict = straggler_verdict(told, cases, world_size, name_causes)
    if verdict:
        fail(verdict)
    for index, (name, scenario, _) in enumerate(cases):
        details = [d for answers in results for d in answers[index]["details"]]
        for straggler, seconds, _median in details:
            own = lower_median(scenario.windows_ms[straggler]) / 1e3
            if not math.isclose(seconds, own, rel_tol=1e-9):
                fail(
                    f"4.5 find_stragglers ({name}): Straggler({straggler}).seconds is "
                    f"{ms(seconds)}; that rank's median step is {ms(own)}"
                )


Told = dict[int, list[int]]  # each rank's answer: the global ranks it was told are stragglers

# the realistic mistakes of the rule, each one switch away from it, with the words that name it
STRAGGLER_MISTAKES: dict[str, tuple[dict[str, str], str, str]] = {
    "mean in the window": (
        {"window": "mean"},
        "a rank's window was averaged: one slow step must not make a straggler: take the "
        "median of a rank's window, not its mean",
        "a window's mean",
    ),
    "mean across ranks": (
        {"across": "mean"},
        "the ranks were compared with their mean: the mean across ranks lets one very slow "
        "rank hide another; compare with the median of the ranks' medians",
        "the mean across ranks",
    ),
    "middle average across ranks": (
        {"across": "middle average"},
        "the ranks were compared with the average of the two middle medians: torch.median "
        "takes the lower middle value, which a slow rank cannot pull toward itself",
        "the average of the two middle values",
    ),
    "threshold ignored": (
        {"threshold": "1.5 always"},
        "the answers are those of threshold 1.5 where another was given: use the threshold "
        "you are given",
        "a fixed threshold of 1.5",
    ),
    "at the threshold": (
        {"comparison": ">="},
        "a rank exactly at threshold x the median was named: a straggler is strictly slower "
        "(>, not >=)",
        "a comparison with >=",
    ),
    "group rank": (
        {"names": "group rank"},
        "inside a group the ranks were named by their rank in the group; name global ranks "
        "(dist.get_global_rank(group, r))",
        "ranks named within their group",
    ),
    "faster too": (
        {"direction": "both ways"},
        "a rank faster than the median was named: a straggler is slower than threshold x the "
        "median rank, never faster",
        "naming ranks far from the median either way",
    ),
}


def rule_answer(scenario: Scenario, rank: int, setting: dict[str, str]) -> list[int]:
    """What ``rank`` is told by the straggler rule with ``setting``'s switches ({}: the rule)."""
    members: tuple[int, ...] = tuple(sorted(scenario.windows_ms))
    for group in scenario.groups or ():
        if rank in group:
            members = tuple(group)
    if setting.get("window") == "mean":
        medians = {r: sum(scenario.windows_ms[r]) / len(scenario.windows_ms[r]) for r in members}
    else:
        medians = {r: lower_median(scenario.windows_ms[r]) for r in members}
    values = sorted(medians.values())
    across = {
        "mean": sum(values) / len(values),
        "middle average": (values[(len(values) - 1) // 2] + values[len(values) // 2]) / 2,
    }.get(setting.get("across", ""), lower_median(values))
    threshold = 1.5 if setting.get("threshold") == "1.5 always" else scenario.threshold
    slow = [
        r
        for r in members
        if (
            medians[r] >= threshold * across
            if setting.get("comparison") == ">="
            else medians[r] > threshold * across
        )
        or (setting.get("direction") == "both ways" and medians[r] * threshold < across)
    ]
    if setting.get("names") == "group rank":
        return sorted(members.index(r) for r in slow)
    return sorted(slow)


def straggler_verdict(
    told: list[Told], cases: list[Any], world_size: int, name_causes: bool = True
) -> str | None:
    """The failure for the ranks' answers to every scenario (``told[i]``: scenario i), None when
    all are right. A mistake is named only when it gives exactly these answers, every rank's to
    every scenario; several that do are listed; none: what went wrong is said, scenario by
    scenario. ``name_causes=False`` (a world of 2, where a group's rank and a threshold other
    than 1.5 never show): what fits is said, the cause is left to the world of 4's test, which
    runs these scenarios too, in two groups."""
    wrong: list[tuple[str, Scenario, int, list[int], list[int]]] = []
    for (name, scenario, want), named in zip(cases, told, strict=True):
        if scenario.groups is None and len({tuple(v) for v in named.values()}) > 1:
            return (
                f"4.5 find_stragglers ({name}): the ranks disagree, each rank was told {named}. A "
                "rank knows only its own times: all-gather the ranks' medians over the group, so "
                "that every rank applies the rule to the same numbers and names the same ranks"
            )
        expected = want if isinstance(want, dict) else dict.fromkeys(range(world_size), want)
        wrong += [
            (name, scenario, rank, named[rank], expected[rank])
            for rank in range(world_size)
            if named[rank] != expected[rank]
        ]
    if not wrong:
        return None
    fits = [
        mistake
        for mistake, (setting, _, _) in STRAGGLER_MISTAKES.items()
        if all(
            named[rank] == rule_answer(scenario, rank, setting)
            for (_, scenario, _), named in zip(cases, told, strict=True)
            for rank in range(world_size)
        )
    ]
    name, scenario, rank, got, want = wrong[0]
    head = (
        f"4.5 find_stragglers ({name}, threshold {scenario.threshold}x): step times (ms) per "
        f"rank {scenario.windows_ms}; rank {rank} was told {got}, expected {want}: "
    )
    if len(fits) == 1 and name_causes:
        return head + STRAGGLER_MISTAKES[fits[0]][1]
    if fits and not name_causes:
        return head + (
            "on these scenarios every answer is what "
            + " or ".join(STRAGGLER_MISTAKES[m][2] for m in fits)
            + " gives; the world of 4's test runs them again beside scenarios that tell more"
        )
    if fits:
        return head + (
            "every answer is what each of these gives: "
            + "; ".join(STRAGGLER_MISTAKES[m][2] for m in fits)
            + " (these scenarios cannot tell them apart)"
        )
    scenarios = sorted({w[0] for w in wrong})
    return head + (
        f"no single known mistake gives every answer; {len(scenarios)} scenario(s) went wrong "
        f"({', '.join(scenarios)}). The rule: each rank's median step (over its window) against "
        "threshold x the median of all the ranks' medians (all-gathered over the group), "
        "strictly slower"
    )


@exercise("4.5")
def test_the_straggler_rule_in_a_world_of_two() -> None:
    results = world(stragglers_worker, 2, [case[1] for case in TWO])
    check_scenarios(results, TWO, 2, name_causes=False)
    line = results[0][0]["lines"][0]
    if not line.startswith("rank 1 is a straggler: median step 40.0 ms vs 10.0 ms across ranks"):
        fail(f"4.5: the straggler's log line reads {line!r}")


@exercise("4.5")
def test_the_straggler_rule_in_a_world_of_four_and_in_subgroups() -> None:
    results = world(stragglers_worker, 4, [case[1] for case in FOUR])
    check_scenarios(results, FOUR, 4)


# ----------------------------------------------------------------------------- monitored runs


def check_run(results: list[dict[str, Any]], spec: RunSpec, world_size: int) -> None:
    expected = [spec.slow_rank] if spec.slow_rank >= 0 else []
    report_steps = list(range(spec.every, spec.steps + 1, spec.every))
    what = (
        f"{world_size} ranks, rank {spec.slow_rank} sleeping {spec.slow_ms:.0f} ms more per forward"
        if expected
        else f"{world_size} ranks with ordinary noise ({spec.base_ms:.0f} ms +- {100 * spec.noise:.0f}%)"
    )
    for result in results:
        by_step = {
            step: sorted(r for s, r in result["named"] if s == step) for step in report_steps
        }
        wrong = {step: ranks for step, ranks in by_step.items() if ranks != expected}
        if wrong:
            fail(
                f"4.5 monitor ({what}): rank {result['rank']} was told the stragglers at steps "
                f"{by_step}; expected {expected} at every report"
            )
    writer = results[0]
    if expected and not any(f"rank {spec.slow_rank} is a straggler" in x for x in writer["lines"]):
        fail(f"4.5 monitor ({what}): rank 0 logged {writer['lines']}, naming nobody")
    records = writer["reports"]
    if len(records) != world_size * len(report_steps):
        fail(
            f"4.5 monitor: {len(records)} records for {len(report_steps)} reports of "
            f"{world_size} ranks"
        )
    for record in records:
        parts = record["breakdown_ms"]
        negative = {k: v for k, v in parts.items() if v < -1e-9}
        total = sum(parts.values())
        if negative or not math.isclose(total, record["step_ms"], rel_tol=1e-6, abs_tol=1e-6):
            fail(
                f"4.5 StepTimer in a real run (rank {record['rank']}, step {record['step']}): the "
                f"sections {parts} add up to {total:.3f} ms, the step took "
                f"{record['step_ms']:.3f} ms; the sections must tile the step"
            )
        flops = results[record["rank"]]["flops"]
        want = flops / (record["step_ms"] / 1e3) / PEAK_FLOPS
        if record["mfu"] is None or not math.isclose(record["mfu"], want, rel_tol=1e-6):
            fail(
                f"4.5 monitor: rank {record['rank']}'s MFU at step {record['step']} is "
                f"{record['mfu']}; {flops:.0f} FLOPs per step in {record['step_ms']:.2f} ms on "
                f"a peak of {PEAK_FLOPS:g} FLOP/s is {want:.3g}"
            )
        if expected and record["step"] > spec.every:
            parts = record["breakdown_ms"]
            if record["rank"] == spec.slow_rank and parts["forward"] < spec.slow_ms:
                fail(
                    f"4.5 monitor: the slow rank's forward took {parts['forward']:.1f} ms per "
                    f"step; it sleeps {spec.slow_ms:.0f} ms in every forward"
                )
            if record["rank"] != spec.slow_rank and parts["sync"] < spec.slow_ms / 2:
                fail(
                    f"4.5 monitor: rank {record['rank']} spent {parts['sync']:.1f} ms per step in "
                    f"sync; it waits there for the slow rank (about {spec.slow_ms:.0f} ms)"
                )


@exercise("4.5")
def test_a_slowed_rank_is_named_in_every_report_world_of_two() -> None:
    spec = RunSpec(slow_rank=1)
    check_run(world(monitored_run, 2, spec), spec, 2)


@exercise("4.5")
def test_a_slowed_rank_is_named_in_every_report_world_of_three() -> None:
    spec = RunSpec(slow_rank=0)
    check_run(world(monitored_run, 3, spec), spec, 3)


@exercise("4.5")
def test_nobody_is_named_with_ordinary_noise_world_of_four() -> None:
    spec = RunSpec(slow_rank=-1)
    check_run(world(monitored_run, 4, spec), spec, 4)


# ----------------------------------------------------------------------------- the given plumbing


@exercise("4.5")
@pytest.mark.reference
def test_the_training_loop_announces_its_timing_points() -> None:
    default, custom = (
        world(loop_points_worker, 1, 2, False)[0],
        world(loop_points_worker, 1, 1, True)[0],
    )
    step = [
        "begin",
        "data",
        "forward",
        "backward",
        "forward",
        "backward",
        "sync",
        "optimizer",
        "other",
    ]
    if default != [step, step, step, ["begin"]]:
        fail(
            "4.5 the training loop (course/training.py) should announce, per step of 2 "
            f"accumulated micro-batches, the timing points {step} (then 'begin' once more); "
            f"it announced {default}"
        )
    if custom != [["begin", "data", "other"]] * 3 + [["begin"]]:
        fail(
            "4.5 with a custom step function the training loop should announce only 'begin', "
            f"'data' and 'other' per step; it announced {custom}"
        )


@exercise("4.5")
@pytest.mark.reference
def test_tensorboard_jsonl_and_profiler_traces(tmp_path: Path) -> None:
    spec = RunSpec(
        slow_rank=1,
        base_ms=5.0,
        slow_ms=20.0,
        steps=6,
        every=3,
        output_dir=str(tmp_path),
        tensorboard=True,
        profile=(2, 4),
        impl="solutions",
    )
    results = world(monitored_run, 2, spec)
    records = read_jsonl(tmp_path / "metrics.jsonl")
    got = [(r["step"], r["rank"]) for r in records]
    if got != [(3, 0), (3, 1), (6, 0), (6, 1)]:
        fail(
            "4.5 metrics.jsonl (every 3 steps of 6, 2 ranks) should hold the reports of steps "
            f"3 and 6 of ranks 0 and 1, in that order; its (step, rank) pairs are {got}"
        )
    keys = {"step", "rank", "step_ms", "busy_ms", "breakdown_ms", "samples_per_second", "mfu"}
    assert keys <= set(records[0]) and {"peak_memory_bytes", "straggler", "stragglers"} <= set(
        records[0]
    )
    assert set(records[0]["breakdown_ms"]) == set(SECTIONS)
    assert records == results[0]["reports"]
    for rank in (0, 1):
        trace = json.loads((tmp_path / f"trace_rank{rank}.json").read_text())
        names = {event.get("name", "") for event in trace["traceEvents"]}
        if not any(name.startswith("aten::") for name in names):
            fail(
                f"4.5 trace_rank{rank}.json holds no aten:: operator event: the profiler did not "
                f"record the steps it was asked for; its event names include {sorted(names)[:20]}"
            )
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("step_ms/rank0", "step_ms/rank1", "breakdown_ms/sync/rank0", "mfu/rank1"):
        if tag not in tags:
            fail(f"4.5 TensorBoard has no scalar {tag!r}; it has {sorted(tags)}")
    assert [e.step for e in events.Scalars("step_ms/rank1")] == [3, 6]


@exercise("4.5")
@pytest.mark.reference
def test_the_demo_names_the_slow_rank_and_plots(tmp_path: Path) -> None:
    args = ["--epochs", "1", "--train-samples", "256", "--global-batch-size", "32"]
    args += ["--every-n-steps", "4", "--slow-rank", "1", "--slow-ms", "40", "--peak-tflops", "1"]
    outputs = world(demo_worker, 2, args, str(tmp_path))
    printed = outputs[0]
    if not printed.startswith("exit 0") or "rank 1 is a straggler" not in printed:
        fail(
            "4.5 the monitoring demo (rank 1 slowed) should exit 0 and print 'rank 1 is a "
            f"straggler'; it printed:\n{printed}"
        )
    assert (
        "| rank | data ms |" in printed and "straggler: rank 1, named in 2 of 2 reports" in printed
    )
    assert (tmp_path / "breakdown.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ddp = world(demo_worker, 2, [*args, "--ddp", "--no-plot"], str(tmp_path / "ddp"))[0]
    for part in (
        "torch DDP: sections compared between ranks leave out sync, backward",
        "rank 1 is a straggler",
    ):
        if part not in ddp:
            fail(f"4.5 the monitoring demo with --ddp should print {part!r}; it printed:\n{ddp}")


@exercise("4.5")
@pytest.mark.reference
def test_the_demo_refuses_bad_flags_all_at_once() -> None:
    from solutions.phase4_production.demos import monitoring as demo

    config = demo.DemoConfig(slow_rank=2, slow_ms=-1.0, every_n_steps=0)
    with pytest.raises(ValueError) as err:
        demo.validate(config, 2)
    for flag in ("--slow-rank 2", "--slow-ms -1.0", "--every-n-steps 0"):
        if flag not in str(err.value):
            fail(
                f"4.5 the demo's refusal should name every bad flag, {flag!r} among them; it "
                f"says: {str(err.value)!r}"
            )


@exercise("4.5")
@pytest.mark.reference
def test_plot_metrics_draws_a_png(tmp_path: Path) -> None:
    from solutions.phase4_production.demos import plot_metrics

    path = tmp_path / "metrics.jsonl"
    lines = []
    for step in (4, 8):
        for rank in (0, 1):
            parts = dict.fromkeys(SECTIONS, 1.0) | {"forward": 30.0 if rank else 5.0}
            record = {
                "step": step,
                "rank": rank,
                "breakdown_ms": parts,
                "step_ms": sum(parts.values()),
            }
            lines.append(json.dumps(record | {"busy_ms": 10.0, "straggler": rank == 1}))
    path.write_text("\n".join(lines) + "\n")
    assert plot_metrics.main(["--jsonl", str(path)]) == 0
    assert (tmp_path / "breakdown.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="no such file"):
        plot_metrics.load_records(tmp_path / "missing.jsonl")


@exercise("4.5")
@pytest.mark.reference
def test_peak_flops_come_from_the_flag_the_datasheet_or_a_measurement(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from phase4_production import device_peaks as m

    assert m.peak_flops_per_second("cpu", override=5e9) == (5e9, "given")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    assert m.peak_flops_per_second("cuda:0", torch.bfloat16)[0] == 989.4e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    assert m.peak_flops_per_second("cuda:0", torch.bfloat16)[0] == 312e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 PCIe")
    assert m.peak_flops_per_second("cuda:0", torch.float16)[0] == 756e12
    assert m.measure_matmul_flops(torch.device("cpu"), size=64, repeats=2) > 0
    assert m.peak_memory_bytes("cpu") >= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
