"""The phase 4 trainer: checkpoints every N steps, resumes by itself under torchrun, and is elastic.

Run it under ``torchrun --max-restarts=N`` and kill a rank: torchrun restarts the group, every
rank loads the newest valid checkpoint (exercise 4.1's manager, 4.2's :func:`resume`) and the
run ends with the same weights, bit for bit on CPU, as a run that never failed::

    uv run torchrun --standalone --nproc_per_node=2 --max-restarts=2 \
        -m solutions.phase4_production.resilience.trainer --fail kill:rank=1:step=30 --compare

Each failure is one line (the injected one, then what the other ranks saw and what happens
next), the loss is printed per epoch, and ``--compare`` ends with whether the final weights equal
an uninterrupted run's (trained again at the end, in a temporary folder).

``--fail`` takes failure specs (course/failure_injection.py), comma-separated: the i-th
one fires on restart attempt i, so ``--fail kill:rank=1:step=6,raise:rank=0:step=13,
hang:rank=1:step=17`` crashes three attempts in a row. ``hang`` is caught by the collective
timeout (``--collective-timeout``, seconds): the waiting rank's all-reduce fails, torchrun
restarts the group. ``--fail-during-save`` fires inside the checkpoint write instead (after the
state file, before the manifest), so that checkpoint must be skipped on resume.

With ``--elastic`` (exercise 4.3) the data comes from :class:`ElasticSampler` at the saved global
sample position and the batch follows ``--policy``, so the run survives world-size changes::

    uv run torchrun --nnodes=1:2 --nproc-per-node=1 --rdzv-backend=c10d \
        --rdzv-endpoint=127.0.0.1:29500 --rdzv-conf=last_call_timeout=2,join_timeout=60 \
        --max-restarts=3 -m solutions.phase4_production.resilience.trainer --elastic

Every step's sample indices are audited (all-gathered, marked in a per-epoch mask that is saved
in the checkpoint): a sample seen twice, or one skipped at the end of an epoch, stops the run.
``--impl templates`` runs your own checkpoint, fault_tolerance and elastic templates.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from course.cli import parse_config, refuse_before_start, run_main
from course.datasets import PatternSpec, make_pattern_dataset
from course.distributed import (
    DistInfo,
    choose_backend,
    cleanup_distributed,
    current_info,
    setup_distributed,
)
from course.failure_injection import ATTEMPT_ENV, FAIL_ENV, maybe_fail, parse_failure
from course.impl import IMPLS, load_impl
from course.training import (
    AutocastPrecision,
    Callback,
    EpochTotals,
    StepEvent,
    StepOutput,
    TrainingLoop,
)
from phase4_production.checkpoint_files import (
    Setting,
    SettingsMismatch,
    folder_problem,
    newest_settings_problem,
)
from solutions.phase1_data_parallel.data_loader import DistributedShardSampler
from solutions.phase1_data_parallel.trainer import average_gradients

PHASE = "phase4_production"


@dataclass
class ResilientConfig:
    epochs: int = field(default=2, metadata={"ge": 1, "fix": "train at least one epoch"})
    train_samples: int = field(
        default=512, metadata={"ge": 1, "fix": "a positive multiple of --global-batch"}
    )
    global_batch: int = field(
        default=32, metadata={"ge": 1, "help": "samples per optimizer step, all ranks together"}
    )
    micro_batch: int = field(
        default=8, metadata={"ge": 1, "help": "--elastic: samples per rank per forward"}
    )
    lr: float = field(default=0.05, metadata={"gt": 0, "fix": "a positive rate, e.g. --lr 0.05"})
    checkpoint_dir: str = field(
        default="checkpoints/resilient", metadata={"help": "where checkpoints go (shared)"}
    )
    checkpoint_every: int = field(default=5, metadata={"ge": 1, "help": "optimizer steps"})
    keep: int = field(default=3, metadata={"ge": 1, "help": "checkpoints kept (newest K)"})
    fail: str = field(
        default="",
        metadata={"help": "failure specs, comma-separated; the i-th fires on attempt i"},
    )
    fail_during_save: bool = field(
        default=False, metadata={"help": "fire --fail inside the checkpoint write"}
    )
    collective_timeout: float = field(
        default=30.0, metadata={"gt": 0, "help": "seconds before a hung collective fails"}
    )
    elastic: bool = field(default=False, metadata={"help": "global-position sampler (4.3)"})
    policy: str = field(default="keep-global", metadata={"choices": ("keep-global", "scale-lr")})
    leave_after: int = field(
        default=-1,
        metadata={
            "ge": -1,
            "help": "elastic demo: this node's agent leaves after this many steps in a world "
            "of more than one (give it to one agent only)",
        },
    )
    step_sleep: float = field(
        default=0.0, metadata={"ge": 0, "help": "seconds per step (for live demos)"}
    )
    seed: int = field(default=0, metadata={"ge": 0})
    compare: bool = field(
        default=False,
        metadata={"help": "at the end, train again without failures and compare the weights"},
    )
    impl: str = field(default="solutions", metadata={"choices": IMPLS})


def validate(config: ResilientConfig, world_size: int) -> None:
    """Refuse bad values before the process group exists, naming the flag, the value and the fix.

    parse_config has already refused non-finite and out-of-range numbers (the fields' metadata);
    here: what depends on several flags, on the world size, on the checkpoint folder and on the
    checkpoints already in it.
    """
    problems = []
    if config.train_samples < config.global_batch:
        problems.append(
            f"--train-samples {config.train_samples} is smaller than --global-batch "
            f"{config.global_batch}: an epoch would have no step (fix: more samples or a "
            "smaller batch)"
        )
    elif config.train_samples % config.global_batch:
        problems.append(
            f"--train-samples {config.train_samples} is not a multiple of --global-batch "
            f"{config.global_batch} (partial batches would make epochs uneven)"
        )
    if not config.elastic and config.global_batch % world_size:
        problems.append(
            f"--global-batch {config.global_batch} is not divisible by the world size {world_size}"
        )
    unit = world_size * config.micro_batch
    if config.elastic and config.policy == "keep-global" and config.global_batch % unit:
        problems.append(
            f"--global-batch {config.global_batch} is not divisible by the world size "
            f"{world_size} x --micro-batch {config.micro_batch} = {unit} (fix: with "
            "--policy keep-global a global batch every world size of the run divides)"
        )
    if config.elastic and config.policy == "scale-lr" and config.train_samples < unit:
        problems.append(
            f"--train-samples {config.train_samples} is smaller than one step of {world_size} "
            f"ranks x --micro-batch {config.micro_batch}"
        )
    if config.compare and config.elastic:
        problems.append(
            "--compare needs a fixed world: an elastic run is reproducible but not bitwise "
            "equal to a fixed-world one (fix: drop --compare or --elastic)"
        )
    folder = folder_problem(config.checkpoint_dir, "--checkpoint-dir")
    if folder is not None:
        problems.append(folder)
    try:
        failure_specs(config.fail)
    except ValueError as err:
        problems.append(f"--fail: {err}")
    if not problems:
        mismatch = newest_settings_problem(
            Path(config.checkpoint_dir), checkpoint_settings(config, world_size)
        )
        if mismatch is not None:
            problems.append(f"--checkpoint-dir {config.checkpoint_dir}: {mismatch}")
    if problems:
        raise ValueError("; ".join(problems))


def checkpoint_settings(config: ResilientConfig, world_size: int) -> dict[str, Setting]:
    """The settings that shape the saved state: recorded in every manifest, and a run whose
    settings differ is refused by name before anything is loaded (elastic runs may change the
    world size, fixed ones may not: their shards depend on it)."""
    settings: dict[str, Setting] = {
        "--train-samples": config.train_samples,
        "--global-batch": config.global_batch,
        "--lr": config.lr,
        "--seed": config.seed,
        "--elastic": config.elastic,
    }
    if config.elastic:
        settings |= {"--micro-batch": config.micro_batch, "--policy": config.policy}
    else:
        settings["world size"] = world_size
    return settings


def failure_specs(text: str) -> list[str]:
    """``--fail a,b,c`` -> [a, b, c], each checked by failure_injection's parser."""
    specs = [s.strip() for s in text.split(",") if s.strip()]
    for spec in specs:
        parse_failure(spec)
    return specs


def arm_failure(specs: list[str], attempt: int) -> None:
    """Point failure_injection at the spec of this restart attempt (none left: no failure)."""
    if attempt < len(specs):
        os.environ[FAIL_ENV] = specs[attempt]
        os.environ[ATTEMPT_ENV] = str(attempt)
    elif specs:
        os.environ.pop(FAIL_ENV, None)


# ----------------------------------------------------------------------------- data and model


class IndexedDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """(image, [label, index]): the index rides along so every step can be audited."""

    def __init__(self, base: Any) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.base[index]
        return x, torch.stack([torch.as_tensor(y), torch.tensor(index)])


def build_model(seed: int) -> nn.Module:
    """A small MLP with dropout, so that resuming without the RNG states changes the result."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Flatten(), nn.Linear(256, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 10)
    )


class ScaledFp32(AutocastPrecision):
    """fp32 compute with a loss scaler (its state is part of the checkpoint)."""

    def autocast(self) -> Any:
        import contextlib

        return contextlib.nullcontext()


def journal(path: Path | None, line: str) -> None:
    """Print ``line`` and append it to the run's journal (``<checkpoint dir>/journal.txt``):
    torchrun's per-attempt logs are overwritten when a membership change restarts the workers
    (the restart count does not change), the journal keeps every attempt's lines."""
    print(line, flush=True)
    if path is not None:
        with open(path, "a") as f:
            f.write(line + "\n")


# ----------------------------------------------------------------------------- callbacks


class SampleAudit(Callback):
    """Every step: all-gather the sample indices, mark them in this epoch's mask; a sample
    seen twice or an epoch that ends with samples unseen raises. The mask is checkpointed."""

    def __init__(
        self,
        size: int,
        epoch_samples: int,
        group: dist.ProcessGroup | None,
        device: torch.device | None = None,
    ) -> None:
        self.device = device or torch.device("cpu")
        self.seen = torch.zeros(size, dtype=torch.int8)
        self.epoch = 0
        self.worlds: list[int] = []
        self.epoch_samples, self.group = epoch_samples, group
        self.pending: list[torch.Tensor] = []
        self.reports: list[str] = []
        self.journal: Path | None = None
        self.quiet = False  # --compare's uninterrupted run prints nothing

    def record(self, indices: torch.Tensor) -> None:
        self.pending.append(indices.to("cpu", torch.int64))

    def state(self) -> dict[str, Any]:
        return {
            "audit_seen": self.seen.clone(),
            "audit_epoch": self.epoch,
            "audit_worlds": self.worlds,
        }

    def load(self, saved: dict[str, Any]) -> None:
        if "audit_seen" in saved:
            self.seen.copy_(saved["audit_seen"])
            self.epoch = int(saved["audit_epoch"])
            self.worlds = [int(w) for w in saved["audit_worlds"]]

    def on_step_end(self, loop: TrainingLoop, event: StepEvent) -> None:
        if event.epoch != self.epoch:
            self.seen.zero_()
            self.epoch, self.worlds = event.epoch, []
        world = dist.get_world_size(self.group)
        if not self.worlds or self.worlds[-1] != world:
            self.worlds.append(world)
        mine = torch.cat(self.pending) if self.pending else torch.empty(0, dtype=torch.int64)
        self.pending = []
        mine = mine.to(self.device)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=self.group)
        indices = torch.cat(gathered).cpu()
        again = indices[self.seen[indices] > 0].tolist()
        if again or len(set(indices.tolist())) != len(indices):
            raise RuntimeError(
                f"sample audit: epoch {event.epoch} step {event.global_step} trained on samples "
                f"already seen this epoch: {sorted(set(again))[:10]}"
            )
        self.seen[indices] = 1
        if int(self.seen.sum()) == self.epoch_samples:
            # Closed here, not in on_epoch_end: the checkpoint saved after this step already says
            # "next epoch", so a restart right after it would never reach on_epoch_end.
            self.close_epoch(event.epoch)

    def close_epoch(self, epoch: int) -> None:
        worlds = ", ".join(map(str, self.worlds))
        line = (
            f"AUDIT epoch {epoch}: {self.epoch_samples} samples, each exactly once "
            f"(world sizes: {worlds})"
        )
        self.reports.append(line)
        if dist.get_rank() == 0 and not self.quiet:
            journal(self.journal, line)
        self.seen.zero_()
        self.epoch, self.worlds = epoch + 1, []

    def on_epoch_end(self, loop: TrainingLoop, result: EpochTotals) -> None:
        if self.epoch != result.epoch + 1:  # the last step did not complete the epoch
            raise RuntimeError(
                f"sample audit: epoch {result.epoch} ended after {int(self.seen.sum())} distinct "
                f"samples, expected {self.epoch_samples}: samples were skipped"
            )


class AuditedLoop(TrainingLoop):
    """TrainingLoop whose targets carry the sample index (see :class:`IndexedDataset`)."""

    audit: SampleAudit

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> StepOutput:
        self.audit.record(targets[:, 1])
        return super().train_step(inputs, targets[:, 0])


class Tracker(Callback):
    """Progress after every step (4.2's ``advance``), the scheduler step, periodic checkpoints,
    and the injected failures, in that order."""

    def __init__(self, trainer: Trainer) -> None:
        self.t = trainer

    def on_step_end(self, loop: TrainingLoop, event: StepEvent) -> None:
        t = self.t
        if t.scheduler is not None:
            t.scheduler.step()
        samples = event.output.samples * t.world
        t.progress = t.fault.advance(t.progress, event, samples, t.epoch_samples)
        if event.global_step % t.config.checkpoint_every == 0:
            t.save()
        if t.config.step_sleep:
            time.sleep(t.config.step_sleep)
        t.steps_here += 1
        if t.config.leave_after == t.steps_here and t.world > 1 and t.local_rank == 0:
            # the flag follows the agent it was given to, not a rank: rendezvous orders agents by
            # process id, so the agent that joined last may hold rank 0
            print(
                f"rank {t.rank} leaves: SIGTERM to its torchrun agent (a preempted node)",
                flush=True,
            )
            os.kill(os.getppid(), signal.SIGTERM)
            time.sleep(60)  # the agent stops this worker
        if not t.config.fail_during_save:
            maybe_fail(event.global_step)


class EpochLog(Callback):
    """One line per epoch on rank 0: the mean loss over the steps this process trained."""

    def __init__(self, trainer: Trainer) -> None:
        self.t = trainer

    def on_epoch_end(self, loop: TrainingLoop, result: EpochTotals) -> None:
        t = self.t
        if t.quiet or t.rank != 0:
            return
        steps = int(result.local["steps"])
        partial = int(result.totals["samples"]) < t.epoch_samples
        where = " (resumed mid-epoch: the steps after the checkpoint)" if partial else ""
        journal(
            t.journal_path,
            f"epoch {result.epoch + 1}/{t.config.epochs}: loss {result.loss:.4f} over {steps} "
            f"steps{where}",
        )


# ----------------------------------------------------------------------------- the trainer


class Trainer:
    """Builds everything from the config on this rank; :meth:`run` resumes and trains.

    ``quiet``: no journal and no per-epoch lines (``--compare``'s uninterrupted run).
    """

    def __init__(
        self, config: ResilientConfig, group: dist.ProcessGroup | None = None, quiet: bool = False
    ) -> None:
        self.config = config
        self.quiet = quiet
        self.ckpt = load_impl(PHASE, "checkpoint", config.impl)
        self.fault = load_impl(PHASE, "fault_tolerance", config.impl)
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.device = current_info().device
        base = make_pattern_dataset(config.train_samples, PatternSpec(), split_seed=0)
        dataset = IndexedDataset(base)
        self.model = build_model(config.seed).to(self.device)
        lr, accumulation = config.lr, 1
        sampler: Any
        if config.elastic:
            elastic = load_impl(PHASE, "elastic", config.impl)
            plan = elastic.plan_batches(
                config.global_batch, config.micro_batch, self.world, config.lr, config.policy
            )
            lr, accumulation = plan.lr, plan.accumulation_steps
            sampler = elastic.ElasticSampler(
                dataset, plan.global_batch, self.rank, self.world, seed=config.seed
            )
            self.epoch_samples = sampler.epoch_samples
            per_rank = plan.per_rank_batch
            self.plan = plan
        else:
            per_rank = config.global_batch // self.world
            sampler = DistributedShardSampler(
                dataset, num_replicas=self.world, rank=self.rank, seed=config.seed
            )
            self.epoch_samples = sampler.total_size
        self.sampler = sampler
        self.base_lr = lr
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=20, gamma=0.5)
        self.scaler = torch.amp.GradScaler(self.device.type, init_scale=2.0**10, growth_interval=7)
        self.state = self.fault.TrainState(self.model, self.optimizer, self.scheduler, self.scaler)
        Path(config.checkpoint_dir).mkdir(parents=True, exist_ok=True)
        self.manager = self.ckpt.CheckpointManager(
            config.checkpoint_dir,
            keep=config.keep,
            settings=checkpoint_settings(config, self.world),
            log=self.log,
        )
        loader = DataLoader(
            dataset,
            batch_size=per_rank,
            sampler=sampler,
            generator=torch.Generator().manual_seed(config.seed),  # never the global RNG
        )
        self.audit = SampleAudit(len(dataset), self.epoch_samples, group, self.device)
        self.loop = AuditedLoop(
            self.model,
            self.optimizer,
            loader,
            device=self.device,
            group=group,
            sync_gradients=lambda m: average_gradients(m, group=group),
            accumulation_steps=accumulation,
            precision=ScaledFp32(self.device.type, torch.float32, self.scaler),
            callbacks=[self.audit, Tracker(self), EpochLog(self)],
        )
        self.loop.audit = self.audit
        journal_path: Path | None = None if quiet else Path(config.checkpoint_dir) / "journal.txt"
        self.audit.quiet = quiet
        self.audit.journal = self.journal_path = journal_path
        self.progress = self.fault.Progress()
        self.last_saved = -1
        self.steps_here = 0  # steps this process ran (for --leave-after)
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # one worker per node leaves

    def log(self, line: str) -> None:
        """The checkpoint manager's lines (a checkpoint passed over, and why) in the journal."""
        if not self.quiet:
            journal(self.journal_path, line)

    def save(self) -> None:
        step = self.progress.global_step

        def crash_mid_save() -> None:
            if self.config.fail_during_save:
                maybe_fail(step)

        extra = {**self.audit.state(), "base_lr": self.base_lr}
        self.fault.save_training_state(
            self.manager, self.state, self.progress, extra=extra, group=self.group,
            before_manifest=crash_mid_save,
        )  # fmt: skip
        self.last_saved = step

    def resume(self) -> Any:
        resumed = self.fault.resume(
            self.manager, self.state, group=self.group, strict_rng=not self.config.elastic
        )
        if resumed.path is None:
            return resumed
        self.progress = resumed.progress
        self.last_saved = self.progress.global_step  # saved already: no second save of it
        self.audit.load(resumed.saved)
        saved_world = int(resumed.saved.get("world_size", self.world))
        if self.config.elastic and self.progress.position % self.plan.global_batch:
            raise RuntimeError(
                f"the checkpoint's position {self.progress.position} is not a whole number of "
                f"this world's steps of {self.plan.global_batch} samples (--policy scale-lr "
                "changed the step size mid-epoch): resume with the world that saved it, or use "
                "--policy keep-global for runs whose world changes"
            )
        if self.config.elastic and saved_world != self.world:
            # a rank the checkpoint had no RNG state for: a stream of its own, reproducibly
            torch.manual_seed(self.config.seed + 1000 * self.rank + self.progress.global_step)
            ratio = self.base_lr / float(resumed.saved.get("base_lr", self.base_lr))
            if ratio != 1.0:  # the scale-lr policy: the learning rate follows the global batch
                for group in self.optimizer.param_groups:
                    group["lr"] *= ratio
                self.scheduler.base_lrs = [lr * ratio for lr in self.scheduler.base_lrs]
        return resumed

    def run(self) -> dict[str, torch.Tensor]:
        """Resume if there is a checkpoint, train to the end, save the final state."""
        resumed = self.resume()
        p = self.progress
        if self.rank == 0 and not self.quiet:
            where = (
                f"resumed from {resumed.path.name} (epoch {p.epoch}, sample {p.position}, "
                f"step {p.global_step})"
                if resumed.path is not None
                else "no valid checkpoint: starting from scratch"
            )
            extra = ""
            if self.config.elastic:
                plan = self.plan
                extra = (
                    f"; world {self.world}: {plan.accumulation_steps} accumulation steps of "
                    f"{plan.micro_batch} per rank, global batch {plan.global_batch}, lr {plan.lr:g}"
                )
            journal(self.journal_path, f"{where}{extra}")
        self.loop.global_step = p.global_step
        start_index = p.position // self.world
        self.loop.fit(self.config.epochs, start_epoch=p.epoch, start_index=start_index)
        if self.last_saved != self.progress.global_step:
            self.save()
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def short_error(exc: BaseException) -> str:
    """The exception in one line: gloo's source location and its generic advice taken off, and a
    lost peer said as such."""
    lines = str(exc).strip().splitlines()
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", lines[0] if lines else "")
    text = text.split(". This is typically caused")[0].rstrip(".")
    if re.search(r"Connection (?:reset|closed) by peer|Broken pipe", text):
        text += " (another rank is gone: its own line says why)"
    return f"{type(exc).__name__}: {text}"


def describe_failure(exc: BaseException, rank: int, step: int) -> str:
    """Two lines: what failed, and what happens next (a restart, or the end)."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    allowed = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    what = f"[rank {rank}] training failed after step {step}: {short_error(exc)}"
    if attempt < allowed:
        return (
            f"{what}\n  torchrun restarts the group (restart {attempt + 1} of {allowed}); it "
            "resumes from the newest valid checkpoint"
        )
    return (
        f"{what}\n  no restarts left (--max-restarts={allowed}, attempt {attempt}): the run "
        "stops; run the same command again to resume from the newest valid checkpoint"
    )


def uninterrupted_weights(config: ResilientConfig, group: dist.ProcessGroup) -> dict[str, Any]:
    """Collective: the same training without failures, in a folder of its own; final weights."""
    folder = Path(config.checkpoint_dir) / "uninterrupted"
    if dist.get_rank(group) == 0:
        shutil.rmtree(folder, ignore_errors=True)
    dist.barrier(group=group)
    reference = replace(
        config, checkpoint_dir=str(folder), fail="", fail_during_save=False, compare=False,
        leave_after=-1, step_sleep=0.0,
    )  # fmt: skip
    os.environ.pop(FAIL_ENV, None)
    weights = Trainer(reference, group, quiet=True).run()
    dist.barrier(group=group)
    if dist.get_rank(group) == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return weights


def compare_line(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[bool, str]:
    """Whether every tensor is bitwise equal, as the line the demo ends with."""
    differ = [name for name in want if not torch.equal(got[name], want[name])]
    if not differ:
        return True, "final weights equal an uninterrupted run: yes (bitwise, every tensor)"
    gap = max((got[n].double() - want[n].double()).abs().max().item() for n in differ)
    return False, (
        f"final weights equal an uninterrupted run: no ({len(differ)} of {len(want)} tensors "
        f"differ, by up to {gap:.3e}: {', '.join(differ[:3])})"
    )


def _join_without_shared_store(timeout: float) -> None:
    """Elastic runs set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (see guidelines.md, 4.3): then no
    agent hosts the workers' store, rank 0 must (``env://``, a fresh port every round). Its
    wait for the other ranks is ``timeout`` (the run's collective timeout), not the default
    300 s: when an agent leaves just after a rendezvous round counted it, its worker never
    comes, and the ranks that did must fail soon, so that their agents meet again without it
    (a 300 s wait outlasted the 4.3 grader's 120 s scenario)."""
    if os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1" and not dist.is_initialized():
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        dist.init_process_group(
            backend=choose_backend(local_world), timeout=timedelta(seconds=timeout)
        )


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(ResilientConfig, argv, __doc__)
    code = refuse_before_start(lambda world: validate(config, world))
    if code is not None:
        return code
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    arm_failure(failure_specs(config.fail), attempt)
    _join_without_shared_store(config.collective_timeout)
    info: DistInfo = setup_distributed()
    group = dist.new_group(timeout=timedelta(seconds=config.collective_timeout))
    assert isinstance(group, dist.ProcessGroup)
    trainer = None
    try:
        trainer = Trainer(config, group)
        weights = trainer.run()
        dist.barrier(group=group)
        if info.rank == 0:
            journal(
                trainer.journal_path,
                f"DONE step {trainer.progress.global_step} world {info.world_size}",
            )
        if config.compare:
            same, line = compare_line(weights, uninterrupted_weights(config, group))
            if info.rank == 0:
                print(line, flush=True)
            return 0 if same else 1
    except NotImplementedError:
        raise
    except SettingsMismatch as err:  # a checkpoint written between validation and the resume
        if info.rank == 0:
            print(f"error: --checkpoint-dir {config.checkpoint_dir}: {err}", file=sys.stderr)
        return 2
    except Exception as exc:  # one clear line instead of a traceback per rank: torchrun restarts
        step = trainer.loop.global_step if trainer is not None else 0
        print(describe_failure(exc, info.rank, step), file=sys.stderr, flush=True)
        return 1
    finally:
        cleanup_distributed()
    return 0


if __name__ == "__main__":
    run_main(main)
