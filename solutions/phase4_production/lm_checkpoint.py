"""The language-model framework's checkpoints: saved at one layout, resumed at any other.

A checkpoint is the one-process model's whole state, AdamW's two moments in the same one-process
shapes, the optimizer's step count and the data position (the batch sampler's generator and the
global step), written with ``torch.distributed.checkpoint`` (DCP) into ``<dir>/step_00000040``,
plus a small ``manifest.json`` that names the model's shape and the layout. What makes it
layout-free is where the tensors come from and go to:

* **saving**: every rank's pieces are assembled into one-process tensors (the runtime's
  ``full_state``: ZeRO's and FSDP-style units' flat slices all-gathered over dp x cp and cut
  into parameters, tp shards concatenated, experts from their holders; the moments the same
  way, from ``local_optimizer_state``). Every rank offers the same whole tensors, and DCP writes
  each once (its default planner de-duplicates replicated tensors:
  ``torch/distributed/checkpoint/default_planner.py``, ``dedup_save_plans``);
* **resuming**: the new layout's runtime is built from the saved one-process model, like any
  run. The moments are cut the same way by building a second runtime from a one-process model
  whose weights are the moments and taking the values of what its optimizer steps, in order
  (whole parameters, or under ZeRO and FSDP-style sharding each unit's slice): the runtime's
  construction is the one function from one process's tensors to a rank's pieces, so nothing
  here knows how tp, pp, cp, ep or a ZeRO stage cut a weight. (A slice's padding holds zeros in
  both: padding has no gradient, so its moments stay 0.)

Before DCP reads a byte, the manifest's model shape is compared with this run's: a checkpoint of
another model is refused by name (``model.width=64 in the checkpoint, 32 in this run``). A
checkpoint folder appears whole or not at all: DCP writes into ``step_N.tmp``, rank 0 adds the
manifest and renames it after every rank has finished (4.1's rule), and older ones beyond
``keep`` are removed.

Limits, said: every rank holds the whole state while saving and loading (a few MiB at the
course's sizes; torchtitan instead saves each rank's DTensor shards and lets DCP reshard them on
load), which undoes ZeRO's memory saving for the moment of a save.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from course.language_model import LMConfig, build_language_model
from phase4_production.lm_layout import ParallelSettings

STEP_PREFIX = "step_"
MANIFEST = "manifest.json"
MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class CheckpointPlan:
    """Where and how often a run saves, and whether it resumes from the newest checkpoint."""

    directory: str
    every: int  # optimizer steps between saves; the last step is always saved
    keep: int = 2
    resume: bool = True


class CheckpointMismatch(ValueError):
    """A checkpoint of another model (or an unreadable one): refused before anything loads."""


# ----------------------------------------------------------------------------- gathering


def optimizer_params(runtime: Any) -> list[torch.nn.Parameter]:
    """The parameters AdamW steps, in its order (the same order for the same layout)."""
    return [p for group in runtime.optimizer.param_groups for p in group["params"]]


def gathered_moments(runtime: Any) -> tuple[dict[str, dict[str, torch.Tensor]], int]:
    """AdamW's moments as one-process tensors (a collective over the world), and its step.

    Each moment is gathered as the weights are (``full_state`` of the runtime's
    ``local_optimizer_state``): ZeRO's and FSDP-style units' slices all-gathered over dp x cp
    and cut into parameters, then tp shards concatenated and experts fetched from their holders.
    """
    params = optimizer_params(runtime)
    state = runtime.optimizer.state
    step = int(next((float(state[p]["step"]) for p in params if p in state), 0))
    moments = {key: runtime.full_state(runtime.local_optimizer_state(key)) for key in MOMENTS}
    return moments, step


def model_record(config: LMConfig) -> dict[str, Any]:
    return {key: list(v) if isinstance(v, tuple) else v
            for key, v in dataclasses.asdict(config).items()}  # fmt: skip


# ----------------------------------------------------------------------------- folders


def step_folders(directory: Path) -> list[Path]:
    """Complete checkpoints (a manifest inside), oldest first."""
    if not directory.is_dir():
        return []
    done = [p for p in directory.glob(f"{STEP_PREFIX}*") if (p / MANIFEST).is_file()]
    return sorted(done, key=lambda p: int(p.name.removeprefix(STEP_PREFIX)))


def latest(directory: str | Path) -> Path | None:
    folders = step_folders(Path(directory))
    return folders[-1] if folders else None


def save(
    plan: CheckpointPlan,
    runtime: Any,
    progress: dict[str, torch.Tensor],
    config: LMConfig,
    settings: ParallelSettings,
) -> Path:
    """Save the run on every rank (a collective): ``progress`` holds the data position."""
    moments, step = gathered_moments(runtime)
    state = {"model": runtime.full_state(), **moments,
             "optimizer_step": torch.tensor(step), "progress": progress}  # fmt: skip
    root = Path(plan.directory)
    final = root / f"{STEP_PREFIX}{int(progress['global_step']):08d}"
    staging = final.with_name(final.name + ".tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
    dist.barrier()
    dcp.save(state, checkpoint_id=staging)
    dist.barrier()
    if dist.get_rank() == 0:
        manifest = {"model": model_record(config), "layout": settings.label(),
                    "global_step": int(progress["global_step"]),
                    "optimizer_step": step}  # fmt: skip
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        for old in step_folders(root)[: -plan.keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def check_model(folder: Path, config: LMConfig) -> dict[str, Any]:
    """The manifest, or CheckpointMismatch naming each model setting that differs."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        saved = manifest["model"]
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointMismatch(f"{folder}: no readable {MANIFEST} ({err})") from None
    mine = model_record(config)
    differ = [f"model.{key}={saved.get(key)!r} in the checkpoint, {value!r} in this run"
              for key, value in mine.items() if saved.get(key) != value]  # fmt: skip
    if differ:
        raise CheckpointMismatch(
            f"{folder} holds another model: {'; '.join(differ)}. Resume with the checkpoint's "
            "model settings, or point checkpoint.dir elsewhere"
        )
    return dict(manifest)


@dataclass
class Restored:
    """What a run resumes with: the one-process model, the moments, the counters."""

    model: dict[str, torch.Tensor]
    moments: dict[str, dict[str, torch.Tensor]]
    optimizer_step: int
    progress: dict[str, torch.Tensor]
    layout: str


def load(folder: Path, config: LMConfig, dtype: torch.dtype,
         progress_like: dict[str, torch.Tensor]) -> Restored:  # fmt: skip
    """Read a checkpoint on every rank (any world size, any layout): refused first by name
    when its model differs."""
    manifest = check_model(folder, config)
    like = build_language_model(config, 0, dtype).state_dict()
    state: dict[str, Any] = {
        "model": {k: torch.empty_like(v) for k, v in like.items()},
        **{key: {k: torch.empty_like(v) for k, v in like.items()} for key in MOMENTS},
        "optimizer_step": torch.tensor(0),
        "progress": {k: torch.empty_like(v) for k, v in progress_like.items()},
    }
    with warnings.catch_warnings():  # outside a process group (a test, a tool) it reads alone
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=folder, no_dist=not dist.is_initialized())
    moments = {key: state[key] for key in MOMENTS}
    step = int(state["optimizer_step"])
    return Restored(state["model"], moments, step, state["progress"], manifest["layout"])


def resumed_runtime(
    restored: Restored,
    config: LMConfig,
    dtype: torch.dtype,
    make_runtime: Callable[[torch.nn.Module], Any],
) -> Any:
    """The runtime of this run's layout, with the checkpoint's weights and AdamW's state cut
    for it (see the module docstring)."""

    def dense(values: dict[str, torch.Tensor]) -> torch.nn.Module:
        model = build_language_model(config, 0, dtype)
        model.load_state_dict(values)
        return model

    runtime = make_runtime(dense(restored.model))
    params = optimizer_params(runtime)
    pieces = {key: optimizer_params(make_runtime(dense(values)))
              for key, values in restored.moments.items()}  # fmt: skip
    step = torch.tensor(float(restored.optimizer_step), dtype=_step_dtype())
    for index, p in enumerate(params):
        runtime.optimizer.state[p] = {
            "step": step.clone(),
            **{key: pieces[key][index].detach().clone() for key in MOMENTS},
        }
    return runtime


def _step_dtype() -> torch.dtype:
    """AdamW keeps its step as a float tensor of this dtype (torch/optim/optimizer.py,
    ``_get_scalar_dtype``)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
