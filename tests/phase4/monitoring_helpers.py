"""What the 4.5 grader runs inside its ranks: the straggler rule on chosen numbers, and monitored
training runs with one rank slowed on purpose.

The straggler rule is graded on step times the test chooses (no sleeping, no noise: the numbers
decide), so that each realistic mistake (a mean instead of a median, no all-gather, the group's
rank instead of the global one) gives a different, predictable answer. The monitored runs then
check the whole chain on real time: a rank that sleeps in its forward is named, the others wait
for it in ``sync``, and no rank is named when every rank only has ordinary noise.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from grading import impl, load
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from course.comm_counter import CommCounter
from course.impl import load_impl

PHASE = "phase4_production"
PEAK_FLOPS = 1e12  # a round peak for the runs' MFU (no measurement)


def monitoring() -> ModuleType:
    """``phase4_production/monitoring`` as ``--impl`` chose it."""
    return load(PHASE, "monitoring")


class FakeClock:
    """Stands in for ``time.perf_counter`` (and the other clocks): moves only when told."""

    def __init__(self, start: float = 100.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def ns(self) -> int:
        return int(self.now * 1e9)

    def advance(self, seconds: float) -> None:
        self.now += seconds


# ----------------------------------------------------------------------------- the rule alone


@dataclass(frozen=True)
class Scenario:
    """Each global rank's window of step times (ms); ``groups``: split the world into these."""

    windows_ms: dict[int, list[float]]
    groups: tuple[tuple[int, ...], ...] | None = None
    threshold: float = 1.5


def stragglers_worker(scenarios: Sequence[Scenario]) -> list[dict[str, Any]]:
    """Per scenario: the stragglers this rank was told about, and the collectives it issued."""
    ex = monitoring()
    rank = dist.get_rank()
    out = []
    for scenario in scenarios:
        group = None
        members: tuple[int, ...] = tuple(range(dist.get_world_size()))
        if scenario.groups is not None:
            for ranks in scenario.groups:  # every rank creates every group, in the same order
                created = dist.new_group(list(ranks))
                if rank in ranks:
                    group, members = created, ranks
        window = [ms / 1e3 for ms in scenario.windows_ms[rank]]
        with CommCounter() as comm:
            found = ex.find_stragglers(window, threshold=scenario.threshold, group=group)
        out.append(
            {
                "named": [int(s.rank) for s in found],
                "details": [
                    (int(s.rank), float(s.seconds), float(s.median_seconds)) for s in found
                ],
                "lines": [str(s) for s in found],
                "collectives": sum(comm.calls.values()),
                "crossing": [r.describe(rank) for r in comm.crossing(members)],
            }
        )
    return out


# ----------------------------------------------------------------------------- monitored runs


class Sleepy(nn.Module):
    """A small MLP whose forward first sleeps: ``base`` +- ``noise`` (uniform), + ``extra``."""

    def __init__(self, base: float, noise: float, extra: float, seed: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.base, self.noise, self.extra = base, noise, extra
        self.rng = random.Random(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.base * (1 + self.noise * self.rng.uniform(-1, 1)) + self.extra)
        out: torch.Tensor = self.net(x)
        return out


def _average_gradients(model: nn.Module) -> None:
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


@dataclass(frozen=True)
class RunSpec:
    slow_rank: int = -1  # -1: nobody
    base_ms: float = 20.0
    noise: float = 0.2
    slow_ms: float = 60.0
    steps: int = 12
    every: int = 4
    per_rank_batch: int = 8
    output_dir: str | None = None
    tensorboard: bool = False
    profile: tuple[int, int] | None = None  # global steps [a, b)
    impl: str | None = None  # None: --impl's


def monitored_run(spec: RunSpec) -> dict[str, Any]:
    """Train ``spec.steps`` steps with the monitor; what the writing rank recorded, and more."""
    from course.training import TrainingLoop
    from phase4_production.training_monitor import TrainingMonitor

    rank, world = dist.get_rank(), dist.get_world_size()
    which = spec.impl or impl()
    ex = load_impl(PHASE, "monitoring", which)
    extra = spec.slow_ms / 1e3 if rank == spec.slow_rank else 0.0
    model = Sleepy(spec.base_ms / 1e3, spec.noise, extra, seed=1000 + rank)
    g = torch.Generator().manual_seed(0)
    samples = spec.steps * spec.per_rank_batch * world
    data = TensorDataset(torch.randn(samples, 16, generator=g), torch.randint(4, (samples,)))
    sampler: DistributedSampler[int] = DistributedSampler(data, shuffle=False)
    loader = DataLoader(data, batch_size=spec.per_rank_batch, sampler=sampler)
    x, y = next(iter(loader))
    flops = float(
        ex.count_training_flops(model.net, x, lambda o: nn.functional.cross_entropy(o, y))
    )
    lines: list[str] = []
    monitor = TrainingMonitor(
        spec.output_dir,
        every_n_steps=spec.every,
        tensorboard=spec.tensorboard,
        jsonl=spec.output_dir is not None,
        flops_per_step=flops,
        peak_flops=PEAK_FLOPS,
        profile_steps=range(*spec.profile) if spec.profile else None,
        log=lines.append,
        impl=which,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loop = TrainingLoop(
        model,
        optimizer,
        loader,
        device=torch.device("cpu"),
        sampler=sampler,
        sync_gradients=_average_gradients,
        callbacks=[monitor],
    )
    with monitor:
        loop.run_epoch(0)
        summary = monitor.summary()
    return {
        "rank": rank,
        "flops": flops,
        "reports": monitor.reports,
        "named": [(step, int(s.rank)) for step, s in monitor.stragglers],
        "lines": lines,
        "summary": summary,
        "traces": [str(p) for p in monitor.traces],
        "steps": loop.global_step,
    }


def loop_points_worker(accumulation: int, custom_step: bool) -> list[list[str]]:
    """The timing points a recording callback sees, one list per step (world of 1)."""
    from course.training import Callback, StepOutput, TrainingLoop

    class Recorder(Callback):
        def __init__(self) -> None:
            self.steps: list[list[str]] = []

        def on_step_begin(self, loop: TrainingLoop) -> None:
            self.steps.append(["begin"])

        def on_section_end(self, loop: TrainingLoop, section: str) -> None:
            self.steps[-1].append(section)

    from course.distributed import current_info

    device = current_info().device  # a one-rank world on a GPU machine runs NCCL on cuda:0
    torch.manual_seed(0)
    model = nn.Linear(4, 2).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(torch.randn(6, 4), torch.randint(2, (6,))) for _ in range(3)]

    def step(x: torch.Tensor, y: torch.Tensor) -> StepOutput:
        return StepOutput(0.0, int(y.shape[0]))

    recorder = Recorder()
    loop = TrainingLoop(
        model,
        optimizer,
        data,
        device=device,
        accumulation_steps=accumulation,
        step=step if custom_step else None,
        callbacks=[recorder],
    )
    loop.run_epoch(0)
    return recorder.steps


def demo_worker(args: list[str], output_dir: str) -> str:
    """Run the demo in this rank, with ``args``; what it printed."""
    import contextlib
    import io

    from solutions.phase4_production.demos import monitoring as monitoring_demo

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = monitoring_demo.main([*args, "--output-dir", output_dir, "--impl", impl()])
    return f"exit {code}\n" + buffer.getvalue()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    import json

    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
