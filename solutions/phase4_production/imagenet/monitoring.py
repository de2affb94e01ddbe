"""What the capstone shows while it runs: a progress bar on rank 0, and 4.5's monitor.

:func:`monitor_callbacks` is the single integration point with exercise 4.5
(``phase4_production/monitoring.py`` and the ``TrainingMonitor`` callback of the course's
``TrainingLoop``: per-rank step breakdown, MFU, straggler names, TensorBoard + JSONL, profiler, a
tqdm bar). With ``monitoring.enabled`` false the capstone shows its own progress bar
(:class:`ProgressBar`) and its one line per epoch.
"""

from __future__ import annotations

import sys
from typing import Any

import torch.distributed as dist

from course.training import Callback, EpochTotals, StepEvent, TrainingLoop
from solutions.phase4_production.imagenet.config import CapstoneConfig


class ProgressBar(Callback):
    """tqdm on rank 0: steps of the epoch, loss and learning rate (a resumed epoch starts part
    way). Rank 0 only: N bars from N ranks would overwrite each other's lines."""

    def __init__(self, steps_per_epoch: int, epochs: int, optimizer: Any) -> None:
        self.steps_per_epoch, self.epochs, self.optimizer = steps_per_epoch, epochs, optimizer
        self.bar: Any = None
        self.epoch = -1

    def on_step_end(self, loop: TrainingLoop, event: StepEvent) -> None:
        from tqdm import tqdm

        if self.bar is None or event.epoch != self.epoch:
            self.close()
            done = event.global_step - 1 - event.epoch * self.steps_per_epoch
            self.bar = tqdm(
                total=self.steps_per_epoch,
                initial=max(done, 0),
                desc=f"epoch {event.epoch + 1}/{self.epochs}",
                unit="step",
                dynamic_ncols=True,
                leave=False,
            )
            self.epoch = event.epoch
        self.bar.update(1)
        self.bar.set_postfix(
            loss=f"{event.output.loss:.3f}", lr=f"{self.optimizer.param_groups[0]['lr']:.3g}"
        )

    def on_epoch_end(self, loop: TrainingLoop, result: EpochTotals) -> None:
        self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def progress_bar(config: CapstoneConfig, trainer: Any) -> list[Callback]:
    """[ProgressBar] on rank 0 when ``monitoring.progress_bar`` asks for it (``auto``: when
    stderr is a terminal, so torchrun's log files get no carriage-return noise), else []."""
    mode = config.monitoring.progress_bar
    if config.monitoring.enabled:
        return []  # 4.5's monitor draws its own bar
    if dist.get_rank() != 0 or mode == "off" or (mode == "auto" and not sys.stderr.isatty()):
        return []
    return [ProgressBar(trainer.steps_per_epoch, config.train.epochs, trainer.optimizer)]


# ---------------------------------------------------------------- integration point (4.5)
PROFILE_STEPS = range(10, 13)  # global steps traced when monitoring.profile is on


def monitor_callbacks(config: CapstoneConfig, trainer: Any) -> list[Callback]:
    """THE integration point with exercise 4.5: its ``TrainingMonitor`` as a loop callback.

    Every rank builds one (its reports are collectives). It counts the training FLOPs of one
    step once (``count_training_flops`` on a copy of the model, for MFU), then every
    ``monitoring.log_every_steps`` steps writes each rank's breakdown to ``metrics.jsonl`` and
    TensorBoard under ``monitoring.log_dir`` and names stragglers; ``monitoring.profile`` traces
    global steps 10-12. Returns [] when ``monitoring.enabled`` is false.
    """
    if not config.monitoring.enabled:
        return []
    import torch
    from torch import nn

    from course.impl import load_impl
    from phase4_production.training_monitor import TrainingMonitor

    monitoring = load_impl("phase4_production", "monitoring", config.impl)
    size, batch = config.data.image_size, config.rank_batch()
    example = torch.zeros(batch, 3, size, size, device=trainer.device)
    if config.model.channels_last:
        example = example.contiguous(memory_format=torch.channels_last)
    targets = torch.zeros(batch, dtype=torch.long, device=trainer.device)
    flops = monitoring.count_training_flops(
        trainer.model, example, lambda out: nn.functional.cross_entropy(out, targets)
    )
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    m = config.monitoring
    return [
        TrainingMonitor(
            m.log_dir,
            group=trainer.group,
            every_n_steps=m.log_every_steps,
            tensorboard=m.tensorboard,
            jsonl=m.jsonl,
            flops_per_step=flops,
            device=trainer.device,
            dtype=dtypes.get(config.train.precision, torch.float32),
            profile_steps=PROFILE_STEPS if m.profile else None,
            progress_total=trainer.steps_per_epoch * config.train.epochs
            if m.progress_bar != "off"
            else None,
            impl=config.impl,
        )
    ]


# ---------------------------------------------------------------- end of integration point
