# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase4.py
"""Exercise 4.1: checkpoints that survive crashes, and hold everything a bitwise resume needs.

A checkpoint is only useful if, after any crash, the newest one that *looks* complete *is*
complete. Three ideas give that:

* **atomic files**: a reader must only ever see a file's complete old version or its complete new
  one, whatever moment the writer dies at, power loss included. POSIX gives exactly one
  operation with that property (a rename within one filesystem); the rest is making sure that
  what a reader finds under the final name survives a power loss.
  ``torch.distributed.checkpoint`` relies on the same property in its file system writer
  (torch/distributed/checkpoint/filesystem.py).
* **a manifest written last**: ``manifest.json`` lists every file with its size and sha256. A
  checkpoint directory without one is a save that did not finish (a rank was killed mid-write,
  the disk filled up); a file whose size or hash disagrees was truncated or corrupted later; a
  manifest that does not read is damaged itself (phase4_production/checkpoint_files.py parses it
  and says why).
* **keep the last K, load the newest valid**: a folder that fails verification is passed over
  with a log line naming it and the reason, and an older one is used. Keeping K > 1 is what
  makes the fallback possible.

What a bitwise resume needs (Section 4.1 of the guidelines): model, optimizer, LR scheduler, loss
scaler, step, epoch and the sampler's position, and the RNG states of *every* rank (each rank's
dropout masks differ), under per-rank keys, as tensors and ints so that
``torch.load(path, weights_only=True)`` reads the file: no pickled objects, nothing executed.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from phase4_production import rng_state
from phase4_production.checkpoint_files import (
    MANIFEST,
    STEP_PREFIX,
    FileEntry,
    ManifestError,
    Setting,
    check_settings,
    fsync_directory,
    is_step_folder,
    manifest_json,
    read_manifest,
    recover_switches,
    sha256_file,
    staging_folder,
    stale_folders,
    step_of,
    switch_in,
)

__all__ = ["MANIFEST", "STEP_PREFIX", "ManifestError", "sha256_file", "step_of"]
Log = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def atomic_write(path: Path, write: Callable[[Any], None]) -> None:
    """Write ``path`` so that a crash at any moment leaves the old file or the new, never half.

    ``write(f)`` receives a binary file object to write into (``torch.save(obj, f)``,
    ``f.write(data)``).
    """
    path = Path(path)
    # TODO 4.1: write ``path`` atomically: the old file or the new one, never a part of either.
    # Invariant: at every instant, a power loss included, `path` is absent, the complete old file or
    #   the complete new file; a crash leaves at most a stray temporary file, never a partial
    #   `path`; a write that raises leaves the old file and nothing else, and the error goes on.
    # Hint 1: only a rename is atomic, and only within one filesystem; and bytes a program has
    #   written are not on the disk when its write returns.
    # More hints: uv run python -m tests.hint 4.1
    # See guidelines.md#41-atomic-complete-checkpoints
    raise NotImplementedError(
        "TODO 4.1: write ``path`` atomically: the old file or the new one, never a part of either "
        "(see phase4_production/guidelines.md#41-atomic-complete-checkpoints)"
    )


def atomic_save(obj: object, path: Path) -> None:
    """``torch.save(obj, path)``, atomically (see :func:`atomic_write`)."""
    atomic_write(Path(path), lambda f: torch.save(obj, f))


def write_manifest(
    directory: Path, step: int, names: list[str], settings: Mapping[str, Setting] | None = None
) -> dict[str, FileEntry]:
    """Hash ``names`` (files in ``directory``) and write ``manifest.json`` atomically, last.

    ``settings`` (flag or key -> value) are the settings that shaped the state; a run that
    differs is refused by name before anything is loaded (``CheckpointManager(settings=...)``).
    """
    files = {
        name: FileEntry((directory / name).stat().st_size, sha256_file(directory / name))
        for name in sorted(names)
    }
    data = manifest_json(step, files, settings or {})
    atomic_write(directory / MANIFEST, lambda f: f.write(data))
    return files


def verify_checkpoint(directory: Path) -> str | None:
    """None when ``directory`` is a complete, intact checkpoint; else why not, in a few words.

    Reasons look like ``"no manifest.json (the save did not finish)"``, ``"manifest.json is
    malformed: it lists no files"`` (any manifest :func:`read_manifest` refuses, in its words),
    ``"train_state.pt is missing"``, ``"train_state.pt has 100 bytes, the manifest says 2048
    (truncated)"``, ``"train_state.pt sha256 differs from the manifest (corrupted)"``.
    Never raises: whatever the folder holds, the answer is None or a reason.
    """
    directory = Path(directory)
    # TODO 4.1: decide whether the folder is exactly what its manifest says, and if not, why.
    # Invariant: None only for a folder whose manifest reads and whose every listed file has the
    #   listed size and sha256; otherwise the reason in the docstring's words (a file of another
    #   size is truncated, a file of the listed size with other contents corrupted); never raises,
    #   whatever the folder holds.
    # Hint 1: four things can be wrong: no manifest, a manifest that cannot be trusted, a listed
    #   file absent, a listed file that differs. Which of them can be seen without reading a file?
    # More hints: uv run python -m tests.hint 4.1
    # See guidelines.md#41-atomic-complete-checkpoints
    raise NotImplementedError(
        "TODO 4.1: decide whether the folder is exactly what its manifest says, and if not, why "
        "(see phase4_production/guidelines.md#41-atomic-complete-checkpoints)"
    )


class CheckpointManager:
    """Checkpoints in ``directory/step_XXXXXXXX/``: atomic files, manifest last, keep the last K.

    Only the rank that calls :meth:`save` writes (rank 0 in the trainer); every rank may call
    :meth:`latest_valid` and :meth:`load` (the directory is on a filesystem they share).
    ``settings`` (flag or key -> value, e.g. ``{"--train-samples": 512}``) are recorded in every
    manifest this manager writes, and :meth:`load` refuses a checkpoint that recorded others.
    """

    def __init__(
        self,
        directory: Path | str,
        keep: int = 3,
        *,
        log: Log = _stderr,
        settings: Mapping[str, Setting] | None = None,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep}: keep at least the newest checkpoint (keep >= 1)")
        self.directory = Path(directory)
        self.keep = keep
        self.log = log
        self.settings = dict(settings or {})

    def path_for(self, step: int) -> Path:
        return self.directory / f"{STEP_PREFIX}{step:08d}"

    def checkpoints(self) -> list[Path]:
        """Every checkpoint directory, complete or not, oldest first (after finishing any
        re-save a crash interrupted: see checkpoint_files.switch_in)."""
        if not self.directory.is_dir():
            return []
        recover_switches(self.directory)
        found = [p for p in self.directory.iterdir() if is_step_folder(p) and p.is_dir()]
        return sorted(found, key=step_of)

    def save(
        self,
        step: int,
        files: Mapping[str, object],
        *,
        before_manifest: Callable[[], object] | None = None,
    ) -> Path:
        """Write ``files`` ({name: object for torch.save}) as the checkpoint of ``step``.

        A new step is written in its own folder, manifest last. A step that already has a
        folder (a run that resumed at its last step saves it again) is written beside it and
        switched in only once complete, so its previous state stays valid until the new one is.
        ``before_manifest`` runs after the files and before the manifest (failure injection:
        a crash there must leave the previous checkpoint the newest valid one).
        """
        target = self.path_for(step)
        folder = staging_folder(target) if target.exists() else target
        folder.mkdir(parents=True, exist_ok=True)
        for name, obj in files.items():
            atomic_save(obj, folder / name)
        if before_manifest is not None:
            before_manifest()
        write_manifest(folder, step, list(files), self.settings)
        if folder != target:
            switch_in(folder, target)
        self.prune(step)
        return target

    def prune(self, newest: int) -> None:
        """Keep the ``keep`` newest complete checkpoints; remove older ones and older debris."""
        complete = [p for p in self.checkpoints() if (p / MANIFEST).exists()]
        kept = set(complete[-self.keep :])
        for path in self.checkpoints():
            if path not in kept and step_of(path) <= newest:
                shutil.rmtree(path, ignore_errors=True)
        for stale in stale_folders(self.directory):
            shutil.rmtree(stale, ignore_errors=True)

    def latest_valid(self) -> Path | None:
        """The newest checkpoint that verifies; each newer one that does not is logged, skipped."""
        # TODO 4.1: find the newest checkpoint that is safe to resume from.
        # Invariant: the newest checkpoint that verifies is returned, never a corrupted, truncated,
        #   unfinished or malformed one; each newer one passed over is named in one log line with
        #   its reason ("checkpoint <name> skipped: <reason>"); with nothing valid the answer is
        #   None.
        # Hint 1: self.checkpoints() lists the folders oldest first; verify_checkpoint says why one
        #   cannot be used; self.log writes one line.
        # More hints: uv run python -m tests.hint 4.1
        # See guidelines.md#41-atomic-complete-checkpoints
        raise NotImplementedError(
            "TODO 4.1: find the newest checkpoint that is safe to resume from "
            "(see phase4_production/guidelines.md#41-atomic-complete-checkpoints)"
        )

    def load(self, path: Path, name: str, map_location: str | torch.device = "cpu") -> Any:
        """``torch.load`` one file of a checkpoint with ``weights_only=True`` (no pickled code).

        Refuses (:class:`SettingsMismatch`, naming each setting) a checkpoint whose manifest
        records other settings than this manager's, before anything is read from the file.
        """
        check_settings(Path(path), self.settings)
        return torch.load(Path(path) / name, map_location=map_location, weights_only=True)


# ----------------------------------------------------------------------------- per-rank RNG


def rank_key(rank: int, name: str) -> str:
    """The key of one rank's value: ``rank_key(1, "torch_cpu") == "rank1/torch_cpu"``."""
    return f"rank{rank}/{name}"


def capture_rng(rank: int) -> dict[str, Any]:
    """This process's generator states, every key made with :func:`rank_key` for ``rank``.

    Every value is a tensor, a number, a string, None or a list of tensors, so that
    ``torch.load(..., weights_only=True)`` reads it back.
    """
    # TODO 4.1: capture every generator a training step can draw from, under this rank's keys.
    # Invariant: restore_rng(capture_rng(r), r) puts every generator back exactly; the keys of two
    #   ranks never collide (one file holds every rank's states), and the values are only tensors,
    #   numbers, strings, None and lists of tensors (weights_only=True reads them).
    # Hint 1: a dropout mask, a random crop, a shuffle in NumPy or in plain Python: which generator
    #   does each draw from, on a CPU rank and on a GPU rank?
    # More hints: uv run python -m tests.hint 4.1
    # See guidelines.md#41-atomic-complete-checkpoints
    raise NotImplementedError(
        "TODO 4.1: capture every generator a training step can draw from, under this rank's keys "
        "(see phase4_production/guidelines.md#41-atomic-complete-checkpoints)"
    )


def restore_rng(states: Mapping[str, Any], rank: int) -> None:
    """Put back the RNG states :func:`capture_rng` saved for ``rank``.

    Raises KeyError naming the rank when ``states`` holds nothing for it.
    """
    # TODO 4.1: restore this rank's generators from its own keys (never another rank's).
    # Invariant: after restore_rng, torch, NumPy and Python draw exactly what the saved process of
    #   this rank would have drawn next, whatever other ranks' states the dictionary holds; a rank
    #   with no states of its own is a KeyError naming it, never a fallback.
    # Hint 1: this is capture_rng backwards: select this rank's entries, undo the renaming, and give
    #   each generator its state (rng_state.py has the setters for the converted ones).
    # More hints: uv run python -m tests.hint 4.1
    # See guidelines.md#41-atomic-complete-checkpoints
    raise NotImplementedError(
        "TODO 4.1: restore this rank's generators from its own keys (never another rank's) "
        "(see phase4_production/guidelines.md#41-atomic-complete-checkpoints)"
    )


def gather_rng(group: dist.ProcessGroup | None = None, dst: int = 0) -> dict[str, Any] | None:
    """Every rank's :func:`capture_rng`, merged on group rank ``dst`` (None elsewhere)."""
    rank = dist.get_rank(group)
    mine = capture_rng(dist.get_global_rank(group, rank) if group is not None else rank)
    gathered: list[Any] | None = [None] * dist.get_world_size(group) if rank == dst else None
    dst_global = dist.get_global_rank(group, dst) if group is not None else dst
    dist.gather_object(mine, gathered, dst=dst_global, group=group)
    if gathered is None:
        return None
    merged: dict[str, Any] = {}
    for states in gathered:
        merged.update(states)
    return merged
