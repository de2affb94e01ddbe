"""Pipeline-parallel training put together (exercise 2.5's demo), and the library way beside it.

A deep MLP is cut into balanced stages (``pipeline_partition``), dealt to the ranks
(``pipeline_layout``), and trained with SGD by the hand-made executor (``pipeline_executor``)
under any schedule (``pipeline_schedules``: GPipe, 1F1B, interleaved 1F1B, and the zero-bubble
ZB-H1 and ZB-V, whose backwards are split into B and W). Every step prints the pipeline's loss
next to the loss of the whole model trained on one device from the same seed, and at the end
each stage's measured bubble (idle share of the step) next to the formula; the run is a few SGD
steps, there to show the equality, not to reach an accuracy. ``--engine torch`` runs the same
stages with ``torch.distributed.pipelining`` (``PipelineStage`` + ``ScheduleGPipe`` /
``Schedule1F1B``, and for the zero-bubble schedules ``ScheduleInterleavedZeroBubble`` with one
stage per rank / ``ScheduleZBVZeroBubble`` with its V placement). ``--impl templates`` runs your
own schedules, partition, messages and executor.

Instructor commands (any --nproc_per_node from 2; interleaved needs m a multiple of it):

    uv run torchrun --standalone --nproc_per_node=4 -m solutions.phase2_advanced.demos.pipeline \
        --schedule 1f1b --microbatches 8
    uv run torchrun --standalone --nproc_per_node=2 -m solutions.phase2_advanced.demos.pipeline \
        --schedule interleaved --microbatches 4 --chunks 2
    uv run torchrun --standalone --nproc_per_node=4 -m solutions.phase2_advanced.demos.pipeline \
        --schedule zb-h1 --microbatches 8
    uv run torchrun --standalone --nproc_per_node=2 -m solutions.phase2_advanced.demos.pipeline \
        --schedule zb-v --microbatches 4
    uv run torchrun --standalone --nproc_per_node=2 -m solutions.phase2_advanced.demos.pipeline \
        --schedule gpipe --engine torch
    uv run torchrun --standalone --nproc_per_node=2 -m solutions.phase2_advanced.demos.pipeline \
        --impl templates

Stage bubbles are measured on one time axis: ``time.perf_counter`` is one clock for all the
processes of a machine (see ``course/events.py``). On a machine with fewer cores than
ranks the stages also wait for a core, which the timelines count as work.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course.cli import parse_config, refuse_before_start, run_main
from course.datasets import PatternSpec, make_pattern_dataset
from course.distributed import current_info, distributed_session, env_int
from course.events import Event, idle_fraction
from course.impl import IMPLS, load_impl
from course.models import MLP
from course.rank_logging import log0
from phase2_advanced.pipeline_layout import rank_chunks, rank_stages, stage_rank
from solutions.phase2_advanced.demos.support import bound_problems
from solutions.phase2_advanced.pipeline_schedules import (
    BACKWARD,
    FORWARD,
    SCHEDULE_NAMES,
    WEIGHT,
    ZERO_BUBBLE_NAMES,
    chunks_per_rank,
    placement_of,
)
from solutions.phase2_advanced.pipeline_study.simulation import formula_bubble as schedule_bubble

PHASE = "phase2_advanced"
ENGINES = ("ours", "torch")
TORCH_SCHEDULES = ("gpipe", "1f1b", "zb-h1", "zb-v")  # what --engine torch is wired for
BALANCES = ("params", "time")
DTYPES = {"float64": torch.float64, "float32": torch.float32}


@dataclass
class PipelineConfig:
    """One pipeline run; every rank builds the same model and batches from ``seed``."""

    schedule: str = field(default="1f1b", metadata={"choices": SCHEDULE_NAMES})
    microbatches: int = field(
        default=8,
        metadata={"help": "m, micro-batches per step", "bounds": {"ge": 1, "fix": "e.g. 8"}},
    )
    chunks: int = field(
        default=2,
        metadata={
            "help": "v, model chunks per rank (interleaved)",
            "bounds": {"ge": 1, "fix": "e.g. 2"},
        },
    )
    microbatch_size: int = field(
        default=32, metadata={"bounds": {"ge": 1, "fix": "e.g. 32 samples"}}
    )
    steps: int = field(default=4, metadata={"bounds": {"ge": 1, "fix": "at least one step"}})
    depth: int = field(
        default=8,
        metadata={
            "help": "hidden blocks of the MLP (Linear + ReLU)",
            "bounds": {"ge": 1, "fix": "e.g. 8"},
        },
    )
    width: int = field(default=512, metadata={"bounds": {"ge": 1, "fix": "e.g. --width 512"}})
    lr: float = field(
        default=0.05,
        metadata={
            "fix": "a positive learning rate, e.g. 0.05",
            "bounds": {"gt": 0, "fix": "a positive learning rate, e.g. 0.05"},
        },
    )
    balance: str = field(
        default="params",
        metadata={"choices": BALANCES, "help": "cut by parameter count or measured layer time"},
    )
    checkpoint: bool = field(
        default=False, metadata={"help": "recompute each stage's activations in backward"}
    )
    engine: str = field(
        default="ours", metadata={"choices": ENGINES, "help": "our executor or torch's"}
    )
    dtype: str = field(default="float64", metadata={"choices": tuple(DTYPES)})
    seed: int = field(default=0, metadata={"bounds": {"ge": 0, "fix": "a seed >= 0"}})
    impl: str = field(
        default="solutions",
        metadata={"choices": IMPLS, "help": "run the reference or your phase2_advanced templates"},
    )

    @property
    def batch_size(self) -> int:
        return self.microbatches * self.microbatch_size

    @property
    def num_chunks(self) -> int:
        """Model chunks per rank: v for the interleaved schedule, 2 for zb-v, 1 otherwise."""
        return chunks_per_rank(self.schedule, self.chunks)

    @property
    def placement(self) -> str:
        """The schedule's stage-to-rank rule: "v" for zb-v, "loop" otherwise."""
        return placement_of(self.schedule)


@dataclass
class PipelineRun:
    """What one rank saw: losses per step (the same on every rank) and the recorded events."""

    losses: list[float] = field(default_factory=list)
    events: list[list[Event]] = field(default_factory=list)  # per step
    peak_stashed: int = 0


def validate_config(config: PipelineConfig, world_size: int) -> None:
    """Refuse a run that cannot work, before any process group exists: every problem at once,
    each naming its flag."""
    problems = []
    choices = {
        "schedule": SCHEDULE_NAMES,
        "engine": ENGINES,
        "balance": BALANCES,
        "dtype": tuple(DTYPES),
        "impl": IMPLS,
    }
    for name, allowed in choices.items():
        if getattr(config, name) not in allowed:
            problems.append(
                f"--{name} {getattr(config, name)!r} is unknown: choose one of {', '.join(allowed)}"
            )
    problems += bound_problems(config)
    if any(getattr(config, name) < 1 for name in ("microbatches", "chunks", "depth")):
        raise ValueError("; ".join(problems))  # the checks below divide by these
    if config.engine == "torch" and config.schedule not in TORCH_SCHEDULES:
        problems.append(
            f"--engine torch is wired for --schedule {', '.join(TORCH_SCHEDULES)}, not "
            f"{config.schedule}"
        )
    if config.engine == "torch" and config.schedule == "zb-h1":
        rounds = max(1, config.microbatches // world_size)
        if config.microbatches % rounds:
            problems.append(
                f"--engine torch --schedule zb-h1: torch's ScheduleInterleavedZeroBubble needs "
                f"--microbatches a multiple of m // p = {rounds}, got {config.microbatches}: "
                f"use --microbatches {rounds * world_size}"
            )
    if config.checkpoint and config.schedule in ZERO_BUBBLE_NAMES:
        problems.append(
            f"--checkpoint with --schedule {config.schedule}: 2.3's checkpoint recomputes a "
            "stage inside one backward that computes the input's and the weights' gradients "
            "together, so the backward cannot be split into B and W; drop --checkpoint or use "
            "gpipe, 1f1b or interleaved"
        )
    if config.engine == "torch" and config.schedule == "1f1b" and config.microbatches < world_size:
        problems.append(
            f"--engine torch --schedule 1f1b: torch's Schedule1F1B needs at least as many "
            f"micro-batches as stages: --microbatches {config.microbatches} < {world_size} "
            "processes"
        )
    if config.schedule == "interleaved" and config.microbatches % world_size:
        multiple = world_size * max(1, round(config.microbatches / world_size))
        problems.append(
            f"--schedule interleaved needs --microbatches a multiple of the number of stages: "
            f"got m={config.microbatches} for p={world_size} processes; use --microbatches "
            f"{multiple}, or --schedule gpipe or 1f1b"
        )
    if config.schedule in ("interleaved", "zb-v") and world_size < 2:
        problems.append(f"--schedule {config.schedule} needs at least 2 processes")
    stages = world_size * config.num_chunks
    layers = 2 + 2 * config.depth
    if stages > layers:
        problems.append(
            f"{stages} stages ({world_size} processes x {config.num_chunks} chunks) but the "
            f"model has {layers} layers (--depth {config.depth}): raise --depth to at least "
            f"{(stages - 1) // 2} or use fewer processes or --chunks"
        )
    if (
        not problems
        and config.engine == "torch"
        and config.schedule in ZERO_BUBBLE_NAMES
        and config.balance == "params"
    ):
        _, partition, _ = impl_modules(config.impl)
        with torch.device("meta"):  # the cut only needs parameter counts: allocate nothing
            model = build_model(config)
        costs = [float(c) for c in partition.parameter_costs(model)]
        try:
            check_torch_split(partition.partition_model(model, stages, costs))
        except ValueError as err:
            problems.append(str(err))
    if problems:
        raise ValueError("; ".join(problems))


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


def impl_modules(impl: str) -> tuple[ModuleType, ModuleType, ModuleType]:
    """(schedules, partition, executor) of the chosen implementation ("solutions" or
    "templates")."""
    return (
        load_impl(PHASE, "pipeline_schedules", impl),
        load_impl(PHASE, "pipeline_partition", impl),
        load_impl(PHASE, "pipeline_executor", impl),
    )


def pipeline_stages(
    model: nn.Sequential,
    config: PipelineConfig,
    world_size: int,
    *,
    group: dist.ProcessGroup | None = None,
) -> list[nn.Module]:
    """All p·v stages, balanced by parameter count or by per-layer time measured on the
    group's rank 0 (``world_size`` is p, the size of ``group``)."""
    _, partition, _ = impl_modules(config.impl)
    num_stages = world_size * config.num_chunks
    costs: list[float] = [float(c) for c in partition.parameter_costs(model)]
    if config.balance == "time":
        device = next(model.parameters()).device
        example = make_batches(config)[0][0][: config.microbatch_size].to(device)
        # timings differ from rank to rank, and every rank must cut the model the same way:
        # the group's rank 0 measures (alone, so the others do not slow it down) and tells
        # the others
        measured = [0.0] * len(model)
        if dist.get_rank(group) == 0:
            measured = partition.measure_layer_costs(model, example)
            model.zero_grad(set_to_none=True)
        shared = torch.tensor(measured, dtype=torch.float64, device=device)
        dist.broadcast(shared, group=group, group_src=0)
        costs = shared.tolist()
    return list(partition.partition_model(model, num_stages, costs))


def check_torch_split(stages: Sequence[nn.Module]) -> None:
    """Refuse torch's zero-bubble schedules when stage 0 has no parameters.

    Its output then needs no gradient, so torch marks stage 1's received input as needing none,
    and its input backward (``stage_backward_input``, torch/distributed/pipelining/_backward.py)
    finds no path from stage 1's input to stage 1's weights: their W adds nothing and the
    weights silently get no gradient (measured on torch 2.15; the hand-made executor marks
    every received activation as needing a gradient, so it does not lose them).
    """
    if not any(True for _ in stages[0].parameters()):
        raise ValueError(
            "--engine torch with a zero-bubble schedule: stage 0 holds no parameters "
            f"({', '.join(type(layer).__name__ for layer in stages[0].children()) or 'empty'}), "
            "and torch's split backward then gives stage 1's weights no gradient; use --balance "
            "time, another --depth or number of processes, or --engine ours"
        )


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
    stage_modules: nn.Module | Sequence[nn.Module],
    schedule: str,
    num_microbatches: int,
    inputs: torch.Tensor | None,
    targets: torch.Tensor | None,
    *,
    group: dist.ProcessGroup | None = None,
) -> float | None:
    """One step of ``torch.distributed.pipelining`` over this rank's stages.

    ``stage_modules`` is this rank's stage (gpipe, 1f1b, zb-h1) or its two chunks (zb-v, under
    the V placement: stages r and 2p - 1 - r), as ``rank_chunks`` deals them; the ranks are
    those of ``group`` (the default group when None). The schedules are torch's
    ``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleavedZeroBubble`` (its ZB1P, which with
    one stage per rank is ZB-H1) and ``ScheduleZBVZeroBubble``. ``loss_fn`` is the micro-batch's
    mean cross-entropy and ``scale_grads=True`` divides the accumulated gradients by m, as the
    hand-made executor's 1/m does. Returns the batch's mean loss on the rank holding the last
    stage, ``None`` elsewhere.
    """
    # imported here: torch's pipelining costs about 2 s of CPU to import, and the graders that
    # import this module for its hand-made paths should not pay it (issue 29, part 1)
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.distributed.pipelining.schedules import (
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    modules = [stage_modules] if isinstance(stage_modules, nn.Module) else list(stage_modules)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    device = next((p.device for m in modules for p in m.parameters()), torch.device("cpu"))
    num_stages = world * len(modules)
    ids = rank_stages(rank, world, len(modules), placement_of(schedule))
    stages: list[Any] = [
        PipelineStage(module, index, num_stages, device, group=group)
        for module, index in zip(modules, ids, strict=True)
    ]
    runner: Any
    if schedule in ("gpipe", "1f1b"):
        schedule_class = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        runner = schedule_class(
            stages[0], num_microbatches, loss_fn=F.cross_entropy, scale_grads=True
        )
    else:
        multi_class = {"zb-h1": ScheduleInterleavedZeroBubble, "zb-v": ScheduleZBVZeroBubble}
        runner = multi_class[schedule](
            stages, num_microbatches, loss_fn=F.cross_entropy, scale_grads=True
        )
    losses: list[torch.Tensor] = []
    first, last = 0 in ids, num_stages - 1 in ids
    arguments = (inputs,) if first else ()
    keywords: dict[str, Any] = {"target": targets, "losses": losses} if last else {}
    runner.step(*arguments, **keywords)
    return float(torch.stack([loss.detach() for loss in losses]).mean()) if losses else None


def run_pipeline(config: PipelineConfig, *, group: dist.ProcessGroup | None = None) -> PipelineRun:
    """Train ``config.steps`` steps inside an existing process group (torchrun's or a world's),
    on the ranks of ``group`` (the default group when None)."""
    schedules, _, executor_module = impl_modules(config.impl)
    info = current_info()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    validate_config(config, world)
    model = build_model(config).to(info.device)
    stages = pipeline_stages(model, config, world, group=group)
    if config.engine == "torch" and config.schedule in ZERO_BUBBLE_NAMES:
        check_torch_split(stages)  # every rank cut the same stages: every rank refuses alike
    placement = schedules.placement_of(config.schedule)
    chunks = rank_chunks(stages, rank, world, placement)
    params = [p for c in chunks for p in c.parameters()]
    # a stage can hold only parameter-free layers (a ReLU): nothing to update there
    optimizer = torch.optim.SGD(params, lr=config.lr) if params else None
    executor = None
    if config.engine == "ours":
        actions = schedules.make_schedule(
            config.schedule, world, config.microbatches, config.chunks
        )[rank]
        executor = executor_module.PipelineExecutor(
            chunks,
            actions,
            config.microbatches,
            checkpoint_chunks=config.checkpoint,
            group=group,
            placement=placement,
        )
    last_rank = stage_rank(len(stages) - 1, world, placement)
    run = PipelineRun()
    for cpu_inputs, cpu_targets in make_batches(config):
        inputs, targets = cpu_inputs.to(info.device), cpu_targets.to(info.device)
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        dist.barrier(group=group)  # start every step together, so the timelines share a start
        if executor is not None:
            result = executor.step(inputs, targets)
            loss, events = result.loss, result.events
            run.peak_stashed = max(run.peak_stashed, result.peak_stashed)
        else:
            loss = torch_pipelining_step(
                chunks, config.schedule, config.microbatches, inputs, targets, group=group
            )
            events = []
        if optimizer is not None:
            optimizer.step()
        shared = torch.tensor([loss or 0.0], dtype=torch.float64, device=info.device)
        dist.broadcast(shared, group=group, group_src=last_rank)
        run.losses.append(float(shared))
        run.events.append(events)
    return run


def measured_bubbles(events_by_rank: Sequence[Sequence[Event]]) -> list[float]:
    """Each rank's share of one step spent not computing, on the window from the first forward
    of any rank to the last backward or W: the quantity (p - 1)/(m + p - 1) predicts. Waiting
    for a message and posting a send ("wait" and "send" events) count as idle."""
    work = [
        [e for e in events if e.name in (FORWARD, BACKWARD, WEIGHT)] for events in events_by_rank
    ]
    start = min(e.start for events in work for e in events)
    end = max(e.end for events in work for e in events)
    return [idle_fraction(events, start, end) for events in work]


def formula_bubble(config: PipelineConfig, world_size: int) -> float:
    """The bubble the schedule's formula predicts for this run (zero-bubble schedules: with F,
    B and W of equal cost, the paper's assumption)."""
    return schedule_bubble(config.schedule, world_size, config.microbatches, config.chunks)


def report(
    config: PipelineConfig, run: PipelineRun, *, group: dist.ProcessGroup | None = None
) -> None:
    """The group's rank 0 prints losses against one device, then each stage's measured bubble."""
    world = dist.get_world_size(group)
    steps_events = []
    for events in run.events:
        gathered: list[list[Event]] = [[] for _ in range(world)]
        dist.all_gather_object(gathered, events, group=group)
        steps_events.append(gathered)
    peaks = [0] * world
    dist.all_gather_object(peaks, run.peak_stashed, group=group)
    if dist.get_rank(group) != 0:
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
    # the first step also warms caches: measure the others
    measured = steps_events[1:] or steps_events
    bubbles = [measured_bubbles(step) for step in measured]
    formula = formula_bubble(config, world)
    v = config.num_chunks
    for rank in range(world):
        median = statistics.median(b[rank] for b in bubbles)
        held = (
            f"peak stashed micro-batches {peaks[rank]}"
            if v == 1
            else f"peak stashed (micro-batch, chunk) pairs {peaks[rank]} "
            f"= {peaks[rank] / v:g} stages' worth"
        )
        print(
            f"stage {rank}: measured bubble {median:.3f}  formula {formula:.3f}  {held}",
            flush=True,
        )


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(PipelineConfig, argv, __doc__)
    if (code := refuse_before_start(lambda world: validate_config(config, world))) is not None:
        return code
    world = env_int("WORLD_SIZE", 1)
    with distributed_session():
        log0(
            f"pipeline ({config.impl}): {world} ranks x {config.num_chunks} chunk(s), schedule "
            f"{config.schedule}, engine {config.engine}, {config.microbatches} micro-batches of "
            f"{config.microbatch_size}, MLP depth {config.depth} width {config.width}, "
            f"{config.dtype}"
        )
        run = run_pipeline(config)
        report(config, run)
    return 0


if __name__ == "__main__":
    run_main(main)
