"""The course's one training loop, with hooks (not an exercise).

Phase 1's hand-made data-parallel trainer, the phase 2 demos and the phase 4 trainer all run
:class:`TrainingLoop`. What differs between them plugs in; what is the same is written once:

* **the step** (``step=``, or override :meth:`TrainingLoop.train_step`): the default zeroes the
  gradients, runs forward and backward on ``accumulation_steps`` micro-batches, calls
  ``sync_gradients(model)`` after the last backward (phase 1's ``average_gradients``; nothing under
  DDP, which syncs inside backward), and steps the optimizer;
* **precision** (``precision=``): a :class:`Precision` wraps forward in autocast and backward and
  the optimizer step in a loss scaler; the default is plain fp32;
* **the epoch's order** (:meth:`TrainingLoop.start_epoch`): ``sampler.set_epoch(epoch,
  start_index)``, so a run resumed part-way through an epoch skips what it already saw;
* **totals** (:meth:`TrainingLoop.reduce_totals`): each rank's sums (loss x samples, samples,
  steps, and whatever the step reports in ``metrics``) are all-reduced over ``group``, so every
  rank returns the same numbers;
* **callbacks** (:class:`Callback`): ``on_step_end`` after every optimizer step (metrics, failure
  injection, checkpoints every N steps) and ``on_epoch_end`` after every epoch;
* **timing points** (optional): ``on_step_begin`` before the next batch is drawn and
  ``on_section_end(section)`` when a part of the step has just ended: ``"data"`` (the batch is
  on the device), ``"forward"`` and ``"backward"`` (once per micro-batch), ``"sync"`` (after
  ``sync_gradients``), ``"optimizer"``, and ``"other"`` when the step returns (with a custom
  ``step``, which marks nothing unless it calls :meth:`TrainingLoop.section_end`, the whole step
  is "other"). Phase 4's monitor (4.5) times the sections from them. Only callbacks that
  override one of the two are called, so an unmonitored loop pays one empty loop per point.

``train_data_parallel`` is the phase 2 demos' entry point: the built-in data, a sampler,
DistributedDataParallel, evaluation, one line per epoch on rank 0.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

from course.cli import refuse_before_start
from course.datasets import PatternSpec, make_pattern_dataset
from course.distributed import DistInfo
from course.rank_logging import log0

StepFn = Callable[[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor], float]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class StepOutput:
    """What one optimizer step on this rank produced.

    ``loss`` is the mean loss over this rank's ``samples``; ``metrics`` are numbers to sum over
    the epoch and over ranks (seconds, bytes, ...).
    """

    loss: float
    samples: int
    metrics: dict[str, float] = field(default_factory=dict)


StepHook = Callable[[torch.Tensor, torch.Tensor], StepOutput]


@dataclass(frozen=True)
class StepEvent:
    """Passed to :meth:`Callback.on_step_end`: where the loop is, and what the step produced."""

    epoch: int
    batch_index: int  # within this epoch, counting skipped batches of a resumed epoch
    global_step: int  # optimizer steps taken since the start of training, this one included
    output: StepOutput


@dataclass
class EpochTotals:
    """One epoch's sums over every rank of the group (``totals``) and over this rank (``local``).

    Keys: ``loss_sum`` (per-sample loss summed), ``samples``, ``steps``, plus the steps' metrics.
    """

    epoch: int
    totals: dict[str, float]
    local: dict[str, float]
    seconds: float

    @property
    def loss(self) -> float:
        """Mean loss over every sample every rank saw this epoch."""
        return self.totals["loss_sum"] / max(self.totals["samples"], 1.0)


class Callback:
    """Override what you need; the loop calls these on every rank."""

    def on_step_begin(self, loop: TrainingLoop) -> None:
        """Before the next batch is drawn: the step's clock starts here (timing point).

        At the end of an epoch this is followed by no step (the loader is exhausted).
        """

    def on_section_end(self, loop: TrainingLoop, section: str) -> None:
        """A part of the step has just ended (timing point): ``"data"``, ``"forward"``,
        ``"backward"``, ``"sync"``, ``"optimizer"``, ``"other"`` (see the module docstring)."""

    def on_step_end(self, loop: TrainingLoop, event: StepEvent) -> None:
        """After every optimizer step."""

    def on_epoch_end(self, loop: TrainingLoop, result: EpochTotals) -> None:
        """After every epoch, once totals are reduced."""


SECTIONS = ("data", "forward", "backward", "sync", "optimizer", "other")
"""The timing points of the default step, in order (forward/backward repeat per micro-batch)."""


def _overrides(callback: Callback, name: str) -> bool:
    return getattr(type(callback), name) is not getattr(Callback, name)


class EveryNSteps(Callback):
    """Call ``fn(loop, event)`` every ``every`` optimizer steps: checkpoints, periodic logs."""

    def __init__(self, every: int, fn: Callable[[TrainingLoop, StepEvent], None]) -> None:
        if every < 1:
            raise ValueError(f"every={every}: must be at least 1")
        self.every, self.fn = every, fn

    def on_step_end(self, loop: TrainingLoop, event: StepEvent) -> None:
        if event.global_step % self.every == 0:
            self.fn(loop, event)


class EveryNEpochs(Callback):
    """Call ``fn(loop, result)`` after every ``every``-th epoch (checkpoints at epoch ends)."""

    def __init__(self, every: int, fn: Callable[[TrainingLoop, EpochTotals], None]) -> None:
        if every < 1:
            raise ValueError(f"every={every}: must be at least 1")
        self.every, self.fn = every, fn

    def on_epoch_end(self, loop: TrainingLoop, result: EpochTotals) -> None:
        if (result.epoch + 1) % self.every == 0:
            self.fn(loop, result)


class FailureInjection(Callback):
    """Call ``maybe_fail(global_step)`` after every step (see phase 4's failure injection)."""

    def __init__(self, maybe_fail: Callable[[int], object]) -> None:
        self.maybe_fail = maybe_fail

    def on_step_end(self, loop: TrainingLoop, event: StepEvent) -> None:
        self.maybe_fail(event.global_step)


class Precision:
    """How forward, backward and the optimizer step handle precision. This one: plain fp32.

    :class:`AutocastPrecision` runs forward under ``torch.autocast`` and, with a scaler, scales
    the loss before backward and unscales before the step (skipping it on inf/NaN).
    """

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Before anything reads the gradients' true values (clipping)."""

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer; False when the step was skipped."""
        optimizer.step()
        return True


class _Scaler(Protocol):
    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None: ...
    def step(self, optimizer: torch.optim.Optimizer) -> Any: ...
    def update(self) -> None: ...
    def get_scale(self) -> float: ...


class AutocastPrecision(Precision):
    """Forward under ``torch.autocast(device_type, dtype)``; an optional loss scaler
    (``torch.amp.GradScaler`` or phase 2's hand-made one with the same methods)."""

    def __init__(self, device_type: str, dtype: torch.dtype, scaler: _Scaler | None = None) -> None:
        self.device_type, self.dtype, self.scaler = device_type, dtype, scaler

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        if self.scaler is None:
            optimizer.step()
            return True
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        return self.scaler.get_scale() >= before  # the scale drops only after a skipped step


class TrainingLoop:
    """Epochs of optimizer steps over ``loader`` on this rank; totals reduced over ``group``.

    Args:
        model, optimizer: what the default step trains.
        loader: this rank's batches (its sampler is ``sampler``, or ``loader.sampler``).
        device: batches are moved here.
        sampler: reshuffled by :meth:`start_epoch`; defaults to ``loader.sampler``.
        group: the ranks that share the data (None: the default group); totals are summed over
            it.
        loss_fn: loss of (outputs, targets), a mean over the samples.
        step: replaces the default step: ``step(inputs, targets) -> StepOutput``.
        sync_gradients: called with the model after the last backward of a step, before the
            optimizer (``average_gradients``); None under DDP.
        accumulation_steps: micro-batches per optimizer step (losses weighted by their size;
            DDP's ``no_sync`` skips the all-reduce of all but the last).
        precision: autocast and loss scaling (default: fp32).
        callbacks: step and epoch callbacks (metrics, checkpoints, failure injection), and
            timing points (``on_step_begin``, ``on_section_end``) for monitors.
    """

    _timers: Sequence[Callback] = ()  # the callbacks listening to timing points

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loader: Iterable[tuple[torch.Tensor, torch.Tensor]],
        *,
        device: torch.device,
        sampler: Any = None,
        group: dist.ProcessGroup | None = None,
        loss_fn: LossFn = nn.functional.cross_entropy,
        step: StepHook | None = None,
        sync_gradients: Callable[[nn.Module], object] | None = None,
        accumulation_steps: int = 1,
        precision: Precision | None = None,
        callbacks: Sequence[Callback] = (),
    ) -> None:
        if accumulation_steps < 1:
            raise ValueError(f"accumulation_steps={accumulation_steps}: must be at least 1")
        self.model = model
        self.optimizer = optimizer
        self.loader = loader
        self.device = device
        self.sampler: Any = sampler if sampler is not None else getattr(loader, "sampler", None)
        self.group = group
        self.loss_fn = loss_fn
        self.step_hook = step
        self.sync_gradients = sync_gradients
        self.accumulation_steps = accumulation_steps
        self.precision = precision or Precision()
        self.callbacks = list(callbacks)
        self.global_step = 0

    # ----------------------------------------------------------------- timing points

    def _find_timers(self) -> None:
        """The callbacks that listen to timing points (re-read each epoch: callbacks may change)."""
        self._timers = [
            c
            for c in self.callbacks
            if _overrides(c, "on_step_begin") or _overrides(c, "on_section_end")
        ]

    def section_end(self, section: str) -> None:
        """Timing point: ``section`` of the current step has just ended (custom steps may call
        it too, e.g. ``loop.section_end("sync")`` after their own all-reduce)."""
        for callback in self._timers:
            callback.on_section_end(self, section)

    def _step_begin(self) -> None:
        for callback in self._timers:
            callback.on_step_begin(self)

    # ----------------------------------------------------------------- the three hooks

    def start_epoch(self, epoch: int, start_index: int = 0) -> None:
        """Pick the epoch's order on every rank (``set_epoch``), skipping ``start_index``
        samples of this rank's shard when resuming part-way through an epoch."""
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if set_epoch is None:
            if start_index:
                raise ValueError(f"start_index={start_index}: the sampler has no set_epoch")
            return
        if start_index:
            set_epoch(epoch, start_index=start_index)
        else:
            set_epoch(epoch)

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> StepOutput:
        """One optimizer step on this rank's batch."""
        if self.step_hook is not None:
            return self.step_hook(inputs, targets)
        self.optimizer.zero_grad(set_to_none=True)
        total = targets.shape[0]
        loss_sum = 0.0
        chunks = list(
            zip(
                inputs.tensor_split(self.accumulation_steps),
                targets.tensor_split(self.accumulation_steps),
                strict=True,
            )
        )
        chunks = [(x, y) for x, y in chunks if y.shape[0] > 0]
        for index, (x, y) in enumerate(chunks):
            last = index == len(chunks) - 1
            with self._no_sync(not last), self.precision.autocast():
                loss = self.loss_fn(self.model(x), y)
            self.section_end("forward")
            self.precision.backward(loss * (y.shape[0] / total))
            self.section_end("backward")
            loss_sum += float(loss.detach()) * y.shape[0]
        if self.sync_gradients is not None:
            self.sync_gradients(self.model)
        self.section_end("sync")
        self.precision.unscale(self.optimizer)
        stepped = self.precision.step(self.optimizer)
        self.section_end("optimizer")
        return StepOutput(loss_sum / total, total, {"skipped_steps": float(not stepped)})

    def reduce_totals(self, totals: dict[str, float]) -> dict[str, float]:
        """Sum this rank's epoch totals over every rank of ``group``: the same on every rank."""
        keys = sorted(totals)
        values = torch.tensor([totals[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(values, group=self.group)
        return dict(zip(keys, values.tolist(), strict=True))

    # ----------------------------------------------------------------- the loop

    def _no_sync(self, skip: bool) -> contextlib.AbstractContextManager[Any]:
        if skip and isinstance(self.model, DistributedDataParallel):
            return self.model.no_sync()
        return contextlib.nullcontext()

    def _batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for inputs, targets in self.loader:
            yield inputs.to(self.device), targets.to(self.device)

    def run_epoch(self, epoch: int, start_index: int = 0) -> EpochTotals:
        """Train one epoch (from this rank's ``start_index``-th sample); totals over the group."""
        self.start_epoch(epoch, start_index)
        self._find_timers()
        local: dict[str, float] = {"loss_sum": 0.0, "samples": 0.0, "steps": 0.0}
        started = time.perf_counter()
        batches = self._batches()
        for batch_index in itertools.count():
            self._step_begin()
            batch = next(batches, None)
            if batch is None:
                break
            inputs, targets = batch
            self.section_end("data")
            output = self.train_step(inputs, targets)
            self.section_end("other")
            self.global_step += 1
            local["loss_sum"] += output.loss * output.samples
            local["samples"] += output.samples
            local["steps"] += 1
            for key, value in output.metrics.items():
                local[key] = local.get(key, 0.0) + value
            event = StepEvent(epoch, batch_index, self.global_step, output)
            for callback in self.callbacks:
                callback.on_step_end(self, event)
        totals = self.reduce_totals(dict(local))
        result = EpochTotals(epoch, totals, local, time.perf_counter() - started)
        for callback in self.callbacks:
            callback.on_epoch_end(self, result)
        return result

    def fit(self, epochs: int, start_epoch: int = 0, start_index: int = 0) -> list[EpochTotals]:
        """Epochs ``start_epoch`` .. ``epochs - 1``; the first skips ``start_index`` samples."""
        return [
            self.run_epoch(epoch, start_index if epoch == start_epoch else 0)
            for epoch in range(start_epoch, epochs)
        ]


# ----------------------------------------------------------------------------- the demos' loop


@dataclass
class LoopConfig:
    epochs: int = 3
    global_batch_size: int = 128
    lr: float = 0.05
    momentum: float = 0.9
    train_samples: int = 4096
    test_samples: int = 1024
    seed: int = 0


@dataclass
class EpochSummary:
    epoch: int
    loss: float
    test_accuracy: float
    samples_per_second: float


@torch.no_grad()
def evaluate(
    model: nn.Module,
    dataset: Dataset,
    device: torch.device,
    batch_size: int = 256,
    *,
    group: dist.ProcessGroup | None = None,
) -> float:
    """Accuracy over the whole dataset: each rank of ``group`` scores a disjoint slice, the
    counts are summed over the group (None: the default group)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    indices = list(range(rank, len(dataset), world))  # type: ignore[arg-type]
    loader = DataLoader(Subset(dataset, indices), batch_size=batch_size)
    was_training = model.training
    model.eval()
    counts = torch.zeros(2, dtype=torch.float64, device=device)
    for inputs, targets in loader:
        predictions = model(inputs.to(device)).argmax(dim=1)
        counts[0] += (predictions == targets.to(device)).sum()
        counts[1] += targets.numel()
    model.train(was_training)
    dist.all_reduce(counts, group=group)
    return float(counts[0] / counts[1])


def check_global_batch(global_batch_size: int, world_size: int, multiple_of: int = 1) -> int:
    """The per-rank batch, or a ValueError naming the bad value and a size that works."""
    unit = world_size * multiple_of
    if global_batch_size < unit or global_batch_size % unit:
        raise ValueError(
            f"global batch {global_batch_size} is not divisible by world size {world_size}"
            + (f" x {multiple_of} micro-batches" if multiple_of > 1 else "")
            + f": use a multiple of {unit}, e.g. {max(unit, global_batch_size // unit * unit)}"
        )
    return global_batch_size // world_size


def global_batch_error(global_batch_size: int) -> int | None:
    """Before joining the process group: exit code 2 (after saying why on rank 0) if the batch
    cannot be split evenly over torchrun's WORLD_SIZE; None if it can."""
    return refuse_before_start(lambda world: check_global_batch(global_batch_size, world))


def train_data_parallel(
    model: nn.Module, step: StepFn, config: LoopConfig, info: DistInfo, wrap_ddp: bool = True
) -> list[EpochSummary]:
    """Train ``model`` on the built-in data with ``step`` doing each optimizer step."""
    per_rank = check_global_batch(config.global_batch_size, info.world_size)
    spec = PatternSpec()
    train_set = make_pattern_dataset(config.train_samples, spec, split_seed=0)
    test_set = make_pattern_dataset(config.test_samples, spec, split_seed=1)
    model = model.to(info.device)
    trained: nn.Module = DistributedDataParallel(model) if wrap_ddp else model
    optimizer = torch.optim.SGD(trained.parameters(), lr=config.lr, momentum=config.momentum)
    sampler: DistributedSampler[int] = DistributedSampler(train_set, seed=config.seed)
    loader = DataLoader(train_set, batch_size=per_rank, sampler=sampler)

    def step_hook(inputs: torch.Tensor, targets: torch.Tensor) -> StepOutput:
        return StepOutput(step(trained, optimizer, inputs, targets), targets.shape[0])

    loop = TrainingLoop(trained, optimizer, loader, device=info.device, step=step_hook)
    summaries = []
    for epoch in range(config.epochs):
        result = loop.run_epoch(epoch)
        accuracy = evaluate(model, test_set, info.device)
        summary = EpochSummary(
            epoch, result.loss, accuracy, result.totals["samples"] / result.seconds
        )
        summaries.append(summary)
        log0(
            f"epoch {epoch + 1}/{config.epochs}  loss {summary.loss:.4f}  "
            f"test acc {100 * accuracy:5.1f}%  {summary.samples_per_second:8.0f} samples/s"
        )
    return summaries
