# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase4.py
"""Exercise 4.2: automatic recovery: after a restart, load the newest valid checkpoint and go on.

``torchrun --max-restarts=N`` restarts *every* worker of the group when one of them fails
(torch/distributed/elastic/agent/server/api.py, ``_invoke_run``: a FAILED worker group is
stopped and started again, up to N times). The new processes know nothing; the program must find
where the previous attempt got to. That is this exercise:

* :func:`advance`: after each optimizer step, where a run resumed *after* that step would start
  (epoch, global sample position within the epoch, optimizer steps). The checkpoint stores it.
* :func:`resume`: every rank loads the *same* newest valid checkpoint, restores model,
  optimizer, scheduler, loss scaler and this rank's RNG states, and returns the progress to
  continue from.

Saving is given (:func:`save_training_state`): every rank hands its RNG states to rank 0, which
writes one ``train_state.pt`` and the manifest; the others wait at a barrier, so no rank runs
ahead of a checkpoint that might still fail.

Failures to recover from come from :mod:`course.failure_injection` (SIGKILL, an
exception, a hang caught by a short collective timeout); see guidelines.md, section 4.2.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course.training import StepEvent
from phase4_production.template_checkpoint import (
    CheckpointManager,
    gather_rng,
    restore_rng,
    step_of,
)

STATE_FILE = "train_state.pt"


@dataclass(frozen=True)
class Progress:
    """Where training resumes: ``position`` global samples of ``epoch`` are done (all ranks
    together), and ``global_step`` optimizer steps since the start of training."""

    epoch: int = 0
    position: int = 0
    global_step: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Progress:
        return cls(int(data["epoch"]), int(data["position"]), int(data["global_step"]))


def advance(
    progress: Progress, event: StepEvent, global_samples: int, epoch_samples: int
) -> Progress:
    """The progress after the step ``event`` reports, which used ``global_samples`` samples over
    every rank; an epoch holds ``epoch_samples`` samples in all.

    ``progress`` is the value after the previous step (or the one training resumed from).
    """
    # TODO 4.2: count this step's samples into the epoch's position; roll over to the next epoch.
    # Invariant: resuming from the result replays exactly the samples not yet trained on, and never
    #   an epoch with none left; position counts the samples of every rank together.
    # Hint 1: the step's epoch comes from event.epoch; progress may still be counting an older one.
    # More hints: uv run python -m tests.hint 4.2
    # See guidelines.md#42-automatic-recovery
    raise NotImplementedError(
        "TODO 4.2: count this step's samples into the epoch's position; roll over to the next "
        "epoch "
        "(see phase4_production/guidelines.md#42-automatic-recovery)"
    )


@dataclass
class TrainState:
    """The objects a checkpoint restores (the scheduler and scaler are optional)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any = None  # torch.optim.lr_scheduler.LRScheduler
    scaler: Any = None  # torch.amp.GradScaler

    def state_dicts(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def load_state_dicts(self, saved: dict[str, Any]) -> None:
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        if self.scheduler is not None and saved.get("scheduler") is not None:
            self.scheduler.load_state_dict(saved["scheduler"])
        if self.scaler is not None and saved.get("scaler") is not None:
            self.scaler.load_state_dict(saved["scaler"])


def save_training_state(
    manager: CheckpointManager,
    state: TrainState,
    progress: Progress,
    *,
    extra: dict[str, Any] | None = None,
    group: dist.ProcessGroup | None = None,
    before_manifest: Callable[[], object] | None = None,
) -> Path | None:
    """Collective: every rank's RNG to rank 0, which writes the checkpoint; all wait for it.

    ``extra`` adds entries of tensors and numbers (a sample audit, a world size). Returns the
    checkpoint's path on rank 0, None elsewhere.
    """
    rng = gather_rng(group)
    path = None
    if dist.get_rank(group) == 0:
        assert rng is not None
        payload = {
            **state.state_dicts(),
            "progress": progress.as_dict(),
            "world_size": dist.get_world_size(group),
            "rng": rng,
            **(extra or {}),
        }
        path = manager.save(
            progress.global_step, {STATE_FILE: payload}, before_manifest=before_manifest
        )
    dist.barrier(group=group)
    return path


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a tensor for a collective on ``group`` must live: this rank's GPU under NCCL."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True)
class Resumed:
    """What :func:`resume` found: the progress to go on from, the checkpoint (None: a fresh
    start) and everything it held (for extras such as the sample audit)."""

    progress: Progress
    path: Path | None
    saved: dict[str, Any]


def resume(
    manager: CheckpointManager,
    state: TrainState,
    *,
    group: dist.ProcessGroup | None = None,
    strict_rng: bool = True,
) -> Resumed:
    """Collective: load the newest valid checkpoint into ``state`` on every rank of ``group``.

    Every rank resumes from the same checkpoint: the newest valid one when the group's rank 0
    looked, whatever the other ranks would find themselves. Nothing to resume: ``Resumed(
    Progress(), None, {})``. This rank's RNG states are restored from its own keys;
    ``strict_rng=False`` (elastic runs, where the world grew) leaves the generators of a rank the
    checkpoint has no state for as they are, instead of raising KeyError.
    """
    # TODO 4.2: agree on one checkpoint, load it with weights_only=True, restore everything.
    # Invariant: every rank of group resumes from the same step, the one the group's rank 0 saw as
    #   newest; after resume the model, optimizer, scheduler, scaler and this rank's generators are
    #   exactly as they were when it was saved.
    # Hint 1: a rank's view of the folder can be a moment older than another's; between ranks a
    #   number travels only inside a tensor (where the group's backend wants it: collective_device).
    # More hints: uv run python -m tests.hint 4.2
    # See guidelines.md#42-automatic-recovery
    raise NotImplementedError(
        "TODO 4.2: agree on one checkpoint, load it with weights_only=True, restore everything "
        "(see phase4_production/guidelines.md#42-automatic-recovery)"
    )
