"""The capstone: a resumable, multi-node ImageNet trainer built from the course's pieces.

On a CPU laptop (the default config, ``cpu-smoke``: synthetic images, ResNet-18 at 32 px)::

    uv run torchrun --standalone --nproc_per_node=2 -m solutions.phase4_production.imagenet.trainer

On 2 nodes of 8 GPUs with ImageNet (the same command on every node; NCCL is chosen by itself)::

    uv run torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \
        --rdzv-endpoint=$HEAD:29500 --rdzv-id=imagenet --max-restarts=3 \
        -m solutions.phase4_production.imagenet.trainer --config resnet50-2node-16gpu \
        --set data.root=/shared/imagenet checkpoint.dir=/shared/ckpt/r50

What comes from where: the sampler is phase 1's (``set_epoch(epoch, start_index)``), the fp16 loss
scaler phase 2's, DDP is torch's (phase 3.4 built it), checkpoints and the resume are 4.1's and
4.2's (atomic, sha256 manifest, newest valid wins, every rank's RNG), failure injection is
``DTFS_FAIL`` (course/failure_injection.py), the loop is the course's
``TrainingLoop``. ``--set key=value`` (or a bare ``key=value``) overrides the YAML; everything
is validated before the process group starts. Run the same command again after a crash (or let
``--max-restarts`` do it): training resumes from the newest valid checkpoint, mid-epoch too,
and ends bitwise equal (on CPU) to a run that never stopped.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from course.cli import RankZeroParser, run_main
from course.distributed import cleanup_distributed, setup_distributed
from course.failure_injection import maybe_fail
from course.impl import load_impl
from course.rank_logging import log0
from course.training import (
    AutocastPrecision,
    Callback,
    EpochTotals,
    Precision,
    StepEvent,
    TrainingLoop,
)
from phase4_production.checkpoint_files import (
    SettingsMismatch,
    folder_problem,
    newest_settings_problem,
)
from solutions.phase4_production.imagenet.config import (
    DEFAULT_CONFIG,
    CapstoneConfig,
    ConfigError,
    available_configs,
    check_world,
    checkpoint_settings,
    dump,
    load_config,
)
from solutions.phase4_production.imagenet.data import (
    FolderSplits,
    Loaders,
    build_loaders,
    check_imagefolder,
)
from solutions.phase4_production.imagenet.eval import EvalResult, evaluate, sync_buffers
from solutions.phase4_production.imagenet.model import build_model, wrap_ddp
from solutions.phase4_production.imagenet.monitoring import monitor_callbacks, progress_bar
from solutions.phase4_production.imagenet.recipe import (
    build_loss,
    build_optimizer,
    build_scheduler,
    scaled_lr,
)

PHASE = "phase4_production"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


# ----------------------------------------------------------------------------- before launch


@dataclass(frozen=True)
class Launch:
    """What is known and checked before the process group exists."""

    config: CapstoneConfig
    folders: FolderSplits | None
    print_only: bool = False


def parse_args(argv: Sequence[str] | None) -> tuple[str, list[str], bool]:
    parser = RankZeroParser(description=(__doc__ or "").strip().split("\n\n")[0])
    parser.add_argument(
        "--config",
        default=DEFAULT_CONFIG,
        help=f"a config name ({', '.join(available_configs())}) or a .yaml path "
        f"(default: {DEFAULT_CONFIG})",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override, repeatable"
    )
    parser.add_argument("--print-config", action="store_true", help="print the config and exit")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="more overrides")
    args = parser.parse_intermixed_args(argv)
    return args.config, [*args.set, *args.overrides], args.print_config


def prepare(argv: Sequence[str] | None) -> Launch:
    """Parse, load, validate against the world torchrun started, check the data folder.

    Raises :class:`ConfigError` (nothing has started yet: every rank can stop cleanly).
    """
    name, overrides, print_only = parse_args(argv)
    config = load_config(name, overrides)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    check_world(config, world_size, torch.cuda.device_count())
    folders = None
    train_size = config.data.train_samples
    if config.data.source == "imagefolder":
        assert config.data.root is not None
        folders = check_imagefolder(config.data.root)
        global_batch = config.global_batch(world_size)
        if len(folders.train) < global_batch:
            raise ConfigError(
                f"data.root={config.data.root}: train/ has {len(folders.train)} images, fewer "
                f"than one global batch of {global_batch}: lower data.batch_per_gpu"
            )
        if len(folders.val) < world_size:
            raise ConfigError(
                f"data.root={config.data.root}: val/ has {len(folders.val)} images, fewer than "
                f"the {world_size} ranks: a rank would evaluate no image"
            )
        train_size = len(folders.train)
    if print_only:
        return Launch(config, folders, print_only)
    problem = folder_problem(config.checkpoint.dir, "checkpoint.dir")
    if problem is not None:
        raise ConfigError(problem)
    if config.checkpoint.resume:
        settings = checkpoint_settings(config, world_size, train_size)
        mismatch = newest_settings_problem(Path(config.checkpoint.dir), settings)
        if mismatch is not None:
            raise ConfigError(f"checkpoint.dir={config.checkpoint.dir}: {mismatch}")
    return Launch(config, folders, print_only)


# ----------------------------------------------------------------------------- the pieces


class ClippedPrecision(Precision):
    """Another precision, with the gradient norm clipped between unscale and step."""

    def __init__(self, inner: Precision, params: list[torch.nn.Parameter], max_norm: float):
        self.inner, self.params, self.max_norm = inner, params, max_norm

    def autocast(self) -> Any:
        return self.inner.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        self.inner.backward(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        self.inner.unscale(optimizer)
        torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        return self.inner.step(optimizer)


def build_precision(
    config: CapstoneConfig, device: torch.device, model: torch.nn.Module, scaler: Any
) -> Precision:
    """fp32, bf16 autocast, or fp16 autocast with phase 2's dynamic loss scaler."""
    precision: Precision = Precision()
    if config.train.precision in DTYPES:
        precision = AutocastPrecision(device.type, DTYPES[config.train.precision], scaler)
    if config.train.grad_clip_norm is not None:
        params = [p for p in model.parameters() if p.requires_grad]
        precision = ClippedPrecision(precision, params, config.train.grad_clip_norm)
    return precision


class Tracker(Callback):
    """After every step: the LR schedule, 4.2's progress, a checkpoint every N steps, and the
    injected failure, in that order (a failure at a checkpoint's step comes after the save)."""

    def __init__(self, trainer: CapstoneTrainer) -> None:
        self.t = trainer

    def on_step_end(self, loop: TrainingLoop, event: StepEvent) -> None:
        t = self.t
        with warnings.catch_warnings():  # fp16: the scaler may skip the very first step
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
            t.scheduler.step()  # every step, skipped or not: the schedule counts steps
        samples = event.output.samples * t.world
        t.progress = t.fault.advance(t.progress, event, samples, t.epoch_samples)
        if event.global_step % t.config.checkpoint.every_steps == 0:
            t.save()
        maybe_fail(event.global_step)


class EpochReport(Callback):
    """At the end of an epoch: evaluate (every ``eval.every_epochs`` and at the end), one line."""

    def __init__(self, trainer: CapstoneTrainer) -> None:
        self.t = trainer

    def on_epoch_end(self, loop: TrainingLoop, result: EpochTotals) -> None:
        t = self.t
        every, last = t.config.eval.every_epochs, result.epoch == t.config.train.epochs - 1
        line = (
            f"epoch {result.epoch + 1}/{t.config.train.epochs}  loss {result.loss:.4f}  "
            f"{result.totals['samples'] / max(result.seconds, 1e-9):8.1f} img/s  "
            f"lr {t.optimizer.param_groups[0]['lr']:.4g}"
        )
        if last or (every and (result.epoch + 1) % every == 0):
            t.last_eval = t.evaluate()
            line += (
                f"  val top-1 {t.last_eval.top1:5.2f}%  top-5 {t.last_eval.top5:5.2f}%  "
                f"({t.last_eval.samples} images)"
            )
        log0(line)


# ----------------------------------------------------------------------------- the trainer


class CapstoneTrainer:
    """Everything built from the config on this rank; :meth:`run` resumes and trains."""

    def __init__(
        self,
        config: CapstoneConfig,
        folders: FolderSplits | None = None,
        group: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.config, self.group = config, group
        self.ckpt = load_impl(PHASE, "checkpoint", config.impl)
        self.fault = load_impl(PHASE, "fault_tolerance", config.impl)
        sampling = load_impl("phase1_data_parallel", "data_loader", config.impl)
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.device = device or torch.device("cpu")
        torch.manual_seed(config.train.seed + self.rank)  # each rank its own stream
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True
        sampler_box: list[Any] = []

        def make_sampler(dataset: Any) -> Any:
            sampler_box.append(
                sampling.DistributedShardSampler(
                    dataset, num_replicas=self.world, rank=self.rank, seed=config.train.seed
                )
            )
            return sampler_box[0]

        self.loaders: Loaders = build_loaders(
            config, folders, make_sampler, self.rank, self.world, self.device
        )
        self.steps_per_epoch = len(self.loaders.train)
        self.global_batch = config.global_batch(self.world)
        self.epoch_samples = self.steps_per_epoch * self.global_batch
        self.model = build_model(config, self.loaders.num_classes, self.device)
        self.ddp = wrap_ddp(self.model, config, self.device, group)
        self.optimizer = build_optimizer(self.model, config.optim, self.global_batch)
        self.scheduler = build_scheduler(
            self.optimizer, config.optim, self.steps_per_epoch, config.train.epochs
        )
        self.scaler = None
        if config.train.precision == "fp16":
            mixed = load_impl("phase2_advanced", "mixed_precision", config.impl)
            self.scaler = mixed.DynamicLossScaler(group=group)
        self.state = self.fault.TrainState(self.model, self.optimizer, self.scheduler, self.scaler)
        Path(config.checkpoint.dir).mkdir(parents=True, exist_ok=True)
        self.manager = self.ckpt.CheckpointManager(
            config.checkpoint.dir,
            keep=config.checkpoint.keep,
            settings=checkpoint_settings(config, self.world, self.loaders.train_size),
        )
        self.progress = self.fault.Progress()
        self.last_saved = -1
        self.last_eval: EvalResult | None = None
        callbacks: list[Callback] = [Tracker(self), EpochReport(self)]
        callbacks += monitor_callbacks(config, self)
        callbacks += progress_bar(config, self)
        self.callbacks = callbacks
        self.loop = TrainingLoop(
            self.ddp,
            self.optimizer,
            self.loaders.train,
            device=self.device,
            sampler=self.loaders.train_sampler,
            group=group,
            loss_fn=build_loss(config.optim.label_smoothing),
            accumulation_steps=config.train.accumulation_steps,
            precision=build_precision(config, self.device, self.model, self.scaler),
            callbacks=callbacks,
        )

    def autocast(self) -> Any:
        dtype = DTYPES.get(self.config.train.precision)
        if dtype is None:
            return torch.autocast(self.device.type, enabled=False)
        return torch.autocast(self.device.type, dtype=dtype)

    def evaluate(self) -> EvalResult:
        """Top-1/top-5 of rank 0's weights (the ones checkpoints hold) over the whole val set."""
        sync_buffers(self.model, self.group)
        return evaluate(
            self.model, self.loaders.val, self.device, group=self.group, autocast=self.autocast
        )

    def save(self) -> None:
        extra: dict[str, Any] = {
            "config": dump(self.config),
            "steps_per_epoch": self.steps_per_epoch,
        }
        if self.last_eval is not None:
            extra["eval"] = {"top1": self.last_eval.top1, "top5": self.last_eval.top5}
        self.fault.save_training_state(
            self.manager, self.state, self.progress, extra=extra, group=self.group
        )
        self.last_saved = self.progress.global_step

    def run(self) -> dict[str, Any]:
        """Resume from the newest valid checkpoint (if any), train to the end, save."""
        c = self.config
        log0(
            f"{c.name}: {c.model.name} on {self.world} ranks ({dist.get_backend(self.group)}, "
            f"{self.device.type}), {self.loaders.train_size} train / {self.loaders.val_size} val "
            f"images, {self.loaders.num_classes} classes; global batch {self.global_batch} "
            f"({c.data.batch_per_gpu} x {c.train.accumulation_steps} x {self.world}), lr "
            f"{scaled_lr(c.optim.base_lr, self.global_batch, c.optim.reference_batch):.4g}, "
            f"{self.steps_per_epoch} steps/epoch, {c.train.precision}"
        )
        where = "no valid checkpoint: starting from scratch"
        if c.checkpoint.resume:
            resumed = self.fault.resume(self.manager, self.state, group=self.group)
            if resumed.path is not None:
                self.progress = resumed.progress
                self.last_saved = self.progress.global_step
                p = self.progress
                where = (
                    f"resumed from {resumed.path.name} (epoch {p.epoch}, sample {p.position}, "
                    f"step {p.global_step})"
                )
        log0(where)
        p = self.progress
        self.loop.global_step = p.global_step
        started = time.perf_counter()
        try:
            self.loop.fit(c.train.epochs, start_epoch=p.epoch, start_index=p.position // self.world)
            if self.last_saved != self.progress.global_step:
                self.save()
        finally:
            for callback in self.callbacks:  # progress bars, the monitor's files and profiler
                close = getattr(callback, "close", None)
                if close is not None:
                    close()
        seconds = time.perf_counter() - started
        summary: dict[str, Any] = {"global_step": self.progress.global_step, "seconds": seconds}
        if self.last_eval is not None:
            summary.update(top1=self.last_eval.top1, top5=self.last_eval.top5)
        log0(
            f"done: step {self.progress.global_step} in {seconds:.1f} s; "
            f"checkpoints in {c.checkpoint.dir}"
        )
        return summary


def main(argv: Sequence[str] | None = None) -> int:
    try:
        launch = prepare(argv)
    except ConfigError as err:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    if launch.print_only:
        if os.environ.get("RANK", "0") == "0":
            print(dump(launch.config), end="")
        return 0
    from solutions.phase4_production.resilience.trainer import describe_failure

    info = setup_distributed()
    trainer = None
    try:
        trainer = CapstoneTrainer(launch.config, launch.folders, device=info.device)
        trainer.run()
        dist.barrier()
    except NotImplementedError:
        raise
    except SettingsMismatch as err:  # a checkpoint written after prepare() looked
        if info.rank == 0:
            print(f"error: checkpoint.dir={launch.config.checkpoint.dir}: {err}", file=sys.stderr)
        return 2
    except Exception as exc:  # one clear line per rank instead of a traceback: torchrun restarts
        step = trainer.loop.global_step if trainer is not None else 0
        print(describe_failure(exc, info.rank, step), file=sys.stderr, flush=True)
        return 1
    finally:
        cleanup_distributed()
    return 0


if __name__ == "__main__":
    run_main(main)
