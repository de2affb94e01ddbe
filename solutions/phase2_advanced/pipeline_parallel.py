"""Pipeline-parallel training put together (exercise 2.5's demo), and the library way beside it.

A deep MLP is cut into balanced stages (``pipeline_partition``), dealt to the ranks, and
trained with SGD by the hand-made executor (``pipeline_executor``) under any schedule
(``pipeline_schedules``). Every step prints the pipeline's loss next to the loss of the whole
model trained on one device from the same seed, and at the end each stage's measured bubble
(idle share of the step) next to the formula; the run is a few SGD steps, there to show the
equality, not to reach an accuracy. ``--engine torch`` runs the same stages with
``torch.distributed.pipelining`` (``PipelineStage`` + ``ScheduleGPipe`` / ``Schedule1F1B``).

Instructor commands (any --nproc_per_node from 2; interleaved needs m a multiple of it):

    uv run torchrun --standalone --nproc_per_node=4 -m solutions.phase2_advanced.pipeline_parallel \
        --schedule 1f1b --microbatches 8
    uv run torchrun --standalone --nproc_per_node=2 -m solutions.phase2_advanced.pipeline_parallel \
        --schedule interleaved --microbatches 4 --chunks 2
    uv run torchrun --standalone --nproc_per_node=2 -m solutions.phase2_advanced.pipeline_parallel \
        --schedule gpipe --engine torch

Stage bubbles are measured on one time axis: ``time.perf_counter`` is one clock for all the
processes of a machine (see ``solutions/common/events.py``). On a machine with fewer cores than
ranks the stages also wait for a core, which the timelines count as work.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from solutions.common.cli import parse_config, refuse_before_start
from solutions.common.datasets import PatternSpec, make_pattern_dataset
from solutions.common.distributed import (
    current_info,
    distributed_session,
    env_int,
)
from solutions.common.events import Event, idle_fraction
from solutions.common.models import MLP
from solutions.common.rank_logging import log0
from solutions.phase2_advanced.pipeline_executor import PipelineExecutor, rank_chunks
from solutions.phase2_advanced.pipeline_partition import (
    measure_layer_costs,
    parameter_costs,
    partition_model,
)
from solutions.phase2_advanced.pipeline_schedules import (
    BACKWARD,
    FORWARD,
    SCHEDULE_NAMES,
    check_interleaved_sizes,
    chunks_per_rank,
    make_schedule,
)
from solutions.phase2_advanced.pipeline_simulation import gpipe_bubble, interleaved_bubble

ENGINES = ("ours", "torch")
DTYPES = {"float64": torch.float64, "float32": torch.float32}


@dataclass
class PipelineConfig:
    """One pipeline run; every rank builds the same model and batches from ``seed``."""

    schedule: str = "1f1b"
    microbatches: int = 8
    chunks: int = 2  # model chunks per rank (v), interleaved only
    microbatch_size: int = 32
    steps: int = 4
    depth: int = 8  # hidden blocks of the MLP (Linear + ReLU each)
    width: int = 512
    lr: float = 0.05
    balance: str = "params"  # or "time": measured per-layer forward + backward
    checkpoint: bool = False
    engine: str = "ours"
    dtype: str = "float64"
    seed: int = 0

    @property
    def batch_size(self) -> int:
        return self.microbatches * self.microbatch_size


@dataclass
class PipelineRun:
    """What one rank saw: losses per step (the same on every rank) and the recorded events."""

    losses: list[float] = field(default_factory=list)
    events: list[list[Event]] = field(default_factory=list)  # per step
    peak_stashed: int = 0


def validate_config(config: PipelineConfig, world_size: int) -> None:
    """Refuse a run that cannot work, before any process group exists."""
    if config.schedule not in SCHEDULE_NAMES:
        raise ValueError(
            f"unknown schedule {config.schedule!r}: choose one of {', '.join(SCHEDULE_NAMES)}"
        )
    if config.engine not in ENGINES:
        raise ValueError(f"unknown engine {config.engine!r}: choose one of {', '.join(ENGINES)}")
    if config.engine == "torch" and config.schedule == "interleaved":
        raise ValueError("--engine torch is wired for gpipe and 1f1b here, not interleaved")
    if config.engine == "torch" and config.schedule == "1f1b" and config.microbatches < world_size:
        raise ValueError(
            f"torch's Schedule1F1B needs at least as many micro-batches as stages: "
            f"--microbatches {config.microbatches} < {world_size}"
        )
    if config.dtype not in DTYPES:
        raise ValueError(f"unknown dtype {config.dtype!r}: choose one of {', '.join(DTYPES)}")
    if config.balance not in ("params", "time"):
        raise ValueError(f"--balance {config.balance!r}: choose params or time")
    if config.schedule == "interleaved":
        check_interleaved_sizes(world_size, config.microbatches, config.chunks)
    stages = world_size * chunks_per_rank(config.schedule, config.chunks)
    layers = 2 + 2 * config.depth
    if stages > layers:
        raise ValueError(
            f"{stages} stages but the model has {layers} layers: raise --depth or use fewer ranks"
        )


def build_model(config: PipelineConfig) -> nn.Sequential:
    """The deep MLP on the built-in 16x16 images; the same weights on every rank."""
    torch.manual_seed(config.seed)
    spec = PatternSpec()
    model = MLP(spec.image_size**2, config.width, spec.num_classes, config.depth)
    return model.to(DTYPES[config.dtype])


def make_batches(config: PipelineConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``config.steps`` batches of the built-in data, the same on every rank."""
    data = make_pattern_dataset(config.steps * config.batch_size, PatternSpec(), split_seed=0)
    images, labels = data.tensors
    images = images.to(DTYPES[config.dtype])
    size = config.batch_size
    return [(images[i : i + size], labels[i : i + size]) for i in range(0, len(images), size)]


def pipeline_stages(
    model: nn.Sequential, config: PipelineConfig, world_size: int
) -> list[nn.Module]:
    """All p·v stages, balanced by parameter count or by per-layer time measured on rank 0."""
    num_stages = world_size * chunks_per_rank(config.schedule, config.chunks)
    costs: list[float] = [float(c) for c in parameter_costs(model)]
    if config.balance == "time":
        device = next(model.parameters()).device
        example = make_batches(config)[0][0][: config.microbatch_size].to(device)
        # timings differ from rank to rank, and every rank must cut the model the same way:
        # rank 0 measures (alone, so the others do not slow it down) and tells the others
        measured = [0.0] * len(model)
        if dist.get_rank() == 0:
            measured = measure_layer_costs(model, example)
            model.zero_grad(set_to_none=True)
        shared = torch.tensor(measured, dtype=torch.float64, device=device)
        dist.broadcast(shared, src=0)
        costs = shared.tolist()
    return list(partition_model(model, num_stages, costs))


def single_device_losses(config: PipelineConfig) -> list[float]:
    """The reference: the whole model, the whole batch, one process, the same SGD steps."""
    model = build_model(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr)
    losses = []
    for inputs, targets in make_batches(config):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def torch_pipelining_step(
    stage_module: nn.Module,
    schedule: str,
    num_microbatches: int,
    inputs: torch.Tensor | None,
    targets: torch.Tensor | None,
) -> float | None:
    """One step of ``torch.distributed.pipelining`` over this rank's single stage.

    Rank r holds stage r. ``loss_fn`` is the micro-batch's mean cross-entropy and
    ``scale_grads=True`` divides the accumulated gradients by m, as the hand-made executor's
    1/m does. Returns the batch's mean loss on the last rank, ``None`` elsewhere.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    device = next((p.device for p in stage_module.parameters()), torch.device("cpu"))
    stage = PipelineStage(stage_module, rank, world, device)
    schedule_class = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    runner = schedule_class(stage, num_microbatches, loss_fn=F.cross_entropy, scale_grads=True)
    losses: list[torch.Tensor] = []
    if rank == 0 and rank == world - 1:
        runner.step(inputs, target=targets, losses=losses)
    elif rank == 0:
        runner.step(inputs)
    elif rank == world - 1:
        runner.step(target=targets, losses=losses)
    else:
        runner.step()
    return float(torch.stack([loss.detach() for loss in losses]).mean()) if losses else None


def run_pipeline(config: PipelineConfig) -> PipelineRun:
    """Train ``config.steps`` steps inside an existing process group (torchrun's or a world's)."""
    info = current_info()
    rank, world = info.rank, info.world_size
    validate_config(config, world)
    model = build_model(config).to(info.device)
    stages = pipeline_stages(model, config, world)
    chunks = rank_chunks(stages, rank, world)
    params = [p for c in chunks for p in c.parameters()]
    # a stage can hold only parameter-free layers (a ReLU): nothing to update there
    optimizer = torch.optim.SGD(params, lr=config.lr) if params else None
    executor = None
    if config.engine == "ours":
        actions = make_schedule(config.schedule, world, config.microbatches, config.chunks)[rank]
        executor = PipelineExecutor(
            chunks, actions, config.microbatches, checkpoint_chunks=config.checkpoint
        )
    last_rank = (len(stages) - 1) % world
    run = PipelineRun()
    for cpu_inputs, cpu_targets in make_batches(config):
        inputs, targets = cpu_inputs.to(info.device), cpu_targets.to(info.device)
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        dist.barrier()  # start every step together, so the timelines share a start
        if executor is not None:
            result = executor.step(inputs, targets)
            loss, events = result.loss, result.events
            run.peak_stashed = max(run.peak_stashed, result.peak_stashed)
        else:
            loss = torch_pipelining_step(
                chunks[0], config.schedule, config.microbatches, inputs, targets
            )
            events = []
        if optimizer is not None:
            optimizer.step()
        shared = torch.tensor([loss or 0.0], dtype=torch.float64, device=info.device)
        dist.broadcast(shared, src=last_rank)
        run.losses.append(float(shared))
        run.events.append(events)
    return run


def measured_bubbles(events_by_rank: Sequence[Sequence[Event]]) -> list[float]:
    """Each rank's share of one step spent not computing, on the window from the first forward
    of any rank to the last backward: the quantity (p - 1)/(m + p - 1) predicts. Waiting for a
    message and posting a send ("wait" and "send" events) count as idle."""
    work = [[e for e in events if e.name in (FORWARD, BACKWARD)] for events in events_by_rank]
    start = min(e.start for events in work for e in events)
    end = max(e.end for events in work for e in events)
    return [idle_fraction(events, start, end) for events in work]


def formula_bubble(config: PipelineConfig, world_size: int) -> float:
    """The bubble the schedule's formula predicts for this run."""
    if config.schedule == "interleaved":
        return interleaved_bubble(world_size, config.microbatches, config.chunks)
    return gpipe_bubble(world_size, config.microbatches)


def report(config: PipelineConfig, run: PipelineRun) -> None:
    """Rank 0 prints losses against one device, then each stage's measured bubble."""
    world = dist.get_world_size()
    steps_events = []
    for events in run.events:
        gathered: list[list[Event]] = [[] for _ in range(world)]
        dist.all_gather_object(gathered, events)
        steps_events.append(gathered)
    peaks = [0] * world
    dist.all_gather_object(peaks, run.peak_stashed)
    if dist.get_rank() != 0:
        return
    reference = single_device_losses(config)
    for step, (loss, ref) in enumerate(zip(run.losses, reference, strict=True)):
        print(
            f"step {step + 1}/{config.steps}  pipeline loss {loss:.10f}  "
            f"single device {ref:.10f}  |diff| {abs(loss - ref):.1e}",
            flush=True,
        )
    if config.engine != "ours":
        return
    # the first step also agrees on shapes and warms caches: measure the others
    measured = steps_events[1:] or steps_events
    bubbles = [measured_bubbles(step) for step in measured]
    formula = formula_bubble(config, world)
    one_chunk = chunks_per_rank(config.schedule, config.chunks) == 1
    held = "micro-batches" if one_chunk else "(micro-batch, chunk) pairs"
    for rank in range(world):
        median = statistics.median(b[rank] for b in bubbles)
        print(
            f"stage {rank}: measured bubble {median:.3f}  formula {formula:.3f}  "
            f"peak stashed {held} {peaks[rank]}",
            flush=True,
        )


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(PipelineConfig, argv, __doc__)
    if (code := refuse_before_start(lambda world: validate_config(config, world))) is not None:
        return code
    world = env_int("WORLD_SIZE", 1)
    with distributed_session():
        v = chunks_per_rank(config.schedule, config.chunks)
        log0(
            f"pipeline: {world} ranks x {v} chunk(s), schedule {config.schedule}, engine "
            f"{config.engine}, {config.microbatches} micro-batches of {config.microbatch_size}, "
            f"MLP depth {config.depth} width {config.width}, {config.dtype}"
        )
        run = run_pipeline(config)
        report(config, run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
