"""The language-model framework's checkpoints: saved at one layout, resumed at any other, and
never resumed from damage.

A checkpoint is the one-process model's whole state, AdamW's two moments in the same one-process
shapes, the optimizer's step count and the data position (the batch sampler's generator and the
global step), written with ``torch.distributed.checkpoint`` (DCP) into ``<dir>/step_00000040``,
plus exercise 4.1's ``manifest.json``: every file's size and sha256, and as settings the model's
shape (``model.width``, ...), the layout that saved it and AdamW's step. What makes it
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

**Verified before DCP reads a byte.** DCP checks nothing of what it reads: a flipped byte in a
weight or a moment loads as a wrong number, a truncated shard fails deep inside its reader, and
``.metadata`` is unpickled with the full pickle module (``read_metadata`` in
``torch/distributed/checkpoint/filesystem.py``), so a damaged one can raise anything. So a
folder is trusted only when 4.1's check passes (``verify_checkpoint``: the manifest reads, every
file it lists has its size and sha256, and ``unlisted_files``: nothing else is in the folder);
then its model settings are compared with this run's (a checkpoint of *another model* is a
setting to fix, refused by name: ``model.width=64 in the checkpoint, 32 in this run``); then,
the bytes being the ones written, ``.metadata``'s tensor shapes are compared with the model
this config builds (a manifest that says this model over another model's tensors is damage,
named by its first differing tensor). 4.1's rule picks the folder: verify the newest, fall back
to the next (:func:`newest_valid`: each skipped folder named with its reason in one line); when
folders exist and none verifies, the run refuses in one line naming ``checkpoint.dir`` and each
folder's reason, rather than start afresh over them. Rank 0 decides and every rank gets its
answer (:func:`resume_folder`), so every rank loads the same folder or raises the same refusal.

A checkpoint folder appears whole or not at all: DCP writes into ``step_N.tmp``, rank 0 adds the
manifest once every rank has finished and renames it (4.1's rule), and older ones beyond
``keep`` are removed.

Limits, said: every rank holds the whole state while saving and loading (a few MiB at the
course's sizes; torchtitan instead saves each rank's DTensor shards and lets DCP reshard them on
load), which undoes ZeRO's memory saving for the moment of a save. The manifest is not signed:
it catches damage and a folder changed without rewriting it, not someone who rewrites both
(``checkpoint_files.py`` says how to pin a manifest).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from course.cli import Refusal
from course.language_model import LMConfig, build_language_model
from course.rank_logging import log0
from phase4_production.checkpoint_files import (
    ManifestError,
    Setting,
    fsync_directory,
    is_step_folder,
    read_manifest,
    step_of,
    unlisted_files,
)
from phase4_production.lm_layout import ParallelSettings
from solutions.phase4_production.checkpoint import verify_checkpoint, write_manifest

STEP_PREFIX = "step_"
MODEL_PREFIX = "model."  # the manifest settings that hold the model's shape: model.width, ...
MOMENTS = ("exp_avg", "exp_avg_sq")
Log = Callable[[str], None]


@dataclass(frozen=True)
class CheckpointPlan:
    """Where and how often a run saves, and whether it resumes from the newest checkpoint."""

    directory: str
    every: int  # optimizer steps between saves; the last step is always saved
    keep: int = 2
    resume: bool = True


class CheckpointMismatch(Refusal):
    """A checkpoint this run cannot resume from, refused before anything loads; the message is
    one line that names the folder and why (``run_main`` prints it so, exit 2, no traceback)."""


class CheckpointDamaged(CheckpointMismatch):
    """A checkpoint that is not what its manifest says, or a folder of them none of which is."""


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


def model_settings(config: LMConfig) -> dict[str, Setting]:
    """The model's shape as 4.1's manifest settings (flat, scalar): ``model.width`` -> 16; a
    tuple as its JSON list text, which reads back with ``json.loads`` (``model.moe_layers`` ->
    ``"[1, 3]"``)."""
    return {MODEL_PREFIX + key: json.dumps(list(value)) if isinstance(value, tuple) else value
            for key, value in dataclasses.asdict(config).items()}  # fmt: skip


def manifest_settings(config: LMConfig, layout: str, optimizer_step: int) -> dict[str, Setting]:
    """What a checkpoint's manifest records besides its files."""
    return {**model_settings(config), "layout": layout, "optimizer_step": optimizer_step}


def model_differences(saved: Mapping[str, Setting], config: LMConfig) -> list[str]:
    """``model.width=32 in the checkpoint, 16 in this run`` for each model setting that differs."""
    return [f"{key}={saved[key]} in the checkpoint, {value} in this run" if key in saved
            else f"{key} is not in the checkpoint ({value} in this run)"
            for key, value in model_settings(config).items()
            if key not in saved or saved[key] != value]  # fmt: skip


# ----------------------------------------------------------------------------- folders


def step_folders(directory: Path) -> list[Path]:
    """Every ``step_XXXXXXXX`` folder, complete or not, oldest first (``step_N.tmp``, a save in
    progress, is not one)."""
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if is_step_folder(p) and p.is_dir()),
                  key=step_of)  # fmt: skip


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
        write_manifest(staging, int(progress["global_step"]), written_files(staging),
                       manifest_settings(config, settings.label(), step))  # fmt: skip
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        fsync_directory(root)
        for old in step_folders(root)[: -plan.keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def written_files(folder: Path) -> list[str]:
    """The files DCP wrote into ``folder`` (``.metadata``, ``__0_0.distcp``, ...), every one
    listed in the manifest. 4.1's manifest names only files directly in the folder, which is
    where DCP's ``FileSystemWriter`` puts them; a subfolder would be refused here, not later."""
    names = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir())
    nested = [name for name in names if os.sep in name]
    if nested:
        raise RuntimeError(f"{folder}: DCP wrote {nested[0]} in a subfolder, which 4.1's "
                           "manifest cannot list")  # fmt: skip
    return names


# ----------------------------------------------------------------------------- verifying


def check_model(folder: Path, config: LMConfig) -> dict[str, Setting]:
    """The manifest's settings, or CheckpointMismatch naming each model setting that differs
    (reads only ``manifest.json``)."""
    try:
        saved = read_manifest(folder).settings
    except ManifestError as err:
        raise CheckpointDamaged(f"{folder}: {err}") from None
    differ = model_differences(saved, config)
    if differ:
        raise CheckpointMismatch(
            f"{folder} holds another model: {'; '.join(differ)}. Resume with the checkpoint's "
            "model settings, or point checkpoint.dir elsewhere"
        )
    return saved


def expected_shapes(config: LMConfig) -> dict[str, tuple[int, ...]]:
    """The tensors a checkpoint of ``config``'s model holds, by DCP's key
    (``model.embedding.weight``, ``exp_avg.embedding.weight``, ...), and their shapes."""
    weights = build_language_model(config, 0).state_dict()
    return {f"{part}.{name}": tuple(value.shape)
            for part in ("model", *MOMENTS) for name, value in weights.items()}  # fmt: skip


def shape_problem(folder: Path, config: LMConfig) -> str | None:
    """The first tensor whose shape in ``.metadata`` is not what ``config``'s model has, or None.

    Call it only on a folder whose files verified: it unpickles ``.metadata``.
    """
    try:
        recorded = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    except Exception as err:  # unpickling bytes that are not a Metadata can raise anything
        return f".metadata does not read ({type(err).__name__})"
    saved = {key: tuple(value.size) for key, value in recorded.items()
             if isinstance(value, TensorStorageMetadata)}  # fmt: skip
    expected = expected_shapes(config)
    lies = "(the manifest lies about the model)"
    for key, shape in expected.items():
        if key not in saved:
            return f"its tensors hold no {key}, which this run's model has {lies}"
        if saved[key] != shape:
            return f"{key} is {list(saved[key])} in its tensors, {list(shape)} in this run's {lies}"
    extra = [key for key in saved if key.startswith(("model.", *MOMENTS)) and key not in expected]
    if extra:  # DCP would load the rest and never say (its planner ignores unasked tensors)
        return f"its tensors hold {extra[0]}, which this run's model has not {lies}"
    return None


def damage(folder: Path, config: LMConfig) -> str | None:
    """Why ``folder`` is not the checkpoint its manifest says (a few words), or None.

    Raises CheckpointMismatch when it is intact but of another model: that is a setting to fix,
    not damage to fall back from. Nothing DCP would unpickle is read before the files verify.
    """
    reason = verify_checkpoint(folder)  # 4.1: the manifest, each listed file's size and sha256
    if reason is not None:
        return reason
    unlisted = unlisted_files(folder, read_manifest(folder))
    if unlisted:
        return f"{unlisted[0]} is not in the manifest (an unlisted file)"
    check_model(folder, config)
    return shape_problem(folder, config)


def newest_valid(directory: str | Path, config: LMConfig, log: Log = log0) -> Path | None:
    """The newest checkpoint in ``directory`` that verifies (4.1's rule), or None when there is
    none at all; each newer one is skipped with one ``log`` line naming it and why.

    Folders that exist with none verifying are refused (CheckpointDamaged, one line naming the
    directory and each folder's reason): starting afresh would save over them unasked.
    """
    skipped: list[tuple[Path, str]] = []
    for folder in reversed(step_folders(Path(directory))):
        reason = damage(folder, config)
        if reason is None:
            for bad, why in skipped:
                log(f"checkpoint {bad} skipped: {why}")
            return folder
        skipped.append((folder, reason))
    if skipped:
        reasons = "; ".join(f"{folder.name}: {why}" for folder, why in skipped)
        raise CheckpointDamaged(
            f"checkpoint.dir {directory}: no checkpoint verifies ({reasons}). Move the damaged "
            "folders away to start afresh, or point checkpoint.dir elsewhere"
        )
    return None


def resume_folder(plan: CheckpointPlan, config: LMConfig, log: Log = log0) -> Path | None:
    """The checkpoint a run resumes from (None: none, start afresh), on every rank (a
    collective): rank 0 verifies and broadcasts its answer, so that every rank loads the same
    folder, or raises the same refusal."""
    if not plan.resume:
        return None
    answer: list[Path | CheckpointMismatch | None] = [None]
    if dist.get_rank() == 0:
        try:
            answer = [newest_valid(plan.directory, config, log)]
        except CheckpointMismatch as err:
            answer = [err]
    dist.broadcast_object_list(answer, src=0)
    if isinstance(answer[0], CheckpointMismatch):
        raise answer[0]
    return answer[0]


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
    """Read a checkpoint on every rank (any world size, any layout), once it verifies: refused
    first by name when it is damaged (CheckpointDamaged) or of another model."""
    reason = damage(folder, config)
    if reason is not None:
        raise CheckpointDamaged(f"checkpoint {folder}: {reason}")
    layout = str(read_manifest(folder).settings.get("layout"))
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
    return Restored(state["model"], moments, step, state["progress"], layout)


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
