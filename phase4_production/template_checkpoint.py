# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase4.py
"""Exercise 4.1: checkpoints that survive crashes, and hold everything a bitwise resume needs.

A checkpoint is only useful if, after any crash, the newest one that *looks* complete *is*
complete. Three mechanisms give that:

* **atomic files**: each file is written to a temporary name in the same directory, flushed,
  ``fsync``-ed, then ``os.replace``-d onto its final name (a rename within one filesystem is
  atomic in POSIX), and the directory is ``fsync``-ed so the rename itself survives a power loss.
  A reader sees the old file or the new one, never half of one. ``torch.distributed.checkpoint``
  does the same in its file system writer (torch/distributed/checkpoint/filesystem.py: it writes
  ``.tmp`` files and renames ``.metadata`` last).
* **a manifest written last**: ``manifest.json`` lists every file with its size and sha256. A
  checkpoint directory without one is a save that did not finish (a rank was killed mid-write,
  the disk filled up); a file whose size or hash disagrees was truncated or corrupted later.
* **keep the last K, load the newest valid**: on load the directories are tried newest first;
  one that fails verification is skipped with a log line naming it and the reason, and the next
  older one is used. Keeping K > 1 is what makes the fallback possible.

What a bitwise resume needs (Section 4.1 of the guidelines): model, optimizer, LR scheduler, loss
scaler, step, epoch and the sampler's position, and the RNG states of *every* rank (each rank's
dropout masks differ), under per-rank keys, as tensors and ints so that
``torch.load(path, weights_only=True)`` reads the file: no pickled objects, nothing executed.
"""

from __future__ import annotations

import hashlib
import json
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

MANIFEST = "manifest.json"
STEP_PREFIX = "step_"
Log = Callable[[str], None]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """The hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def fsync_directory(directory: Path) -> None:
    """Make a rename inside ``directory`` durable (POSIX: the directory entry is data too)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[Any], None]) -> None:
    """Write ``path`` so that a crash at any moment leaves the old file or the new, never half.

    ``write(f)`` receives a binary file object to write into (``torch.save(obj, f)``,
    ``f.write(data)``).
    """
    path = Path(path)
    # TODO 4.1: write to a temporary file in the same directory, make it durable, then rename.
    # Invariant: at every instant `path` is absent, the complete old file or the complete new
    #   file; a crash leaves at most a stray temporary file, never a partial `path`.
    # Hint 1: the temporary file must live in path's own directory (a rename is atomic only
    #   within one filesystem); flush Python's buffer, then os.fsync the descriptor.
    # More hints: uv run python -m tests.hint 4.1
    # See guidelines.md#41-atomic-complete-checkpoints
    raise NotImplementedError(
        "TODO 4.1: write to a temporary file in the same directory, make it durable, then rename "
        "(see phase4_production/guidelines.md#41-atomic-complete-checkpoints)"
    )


def atomic_save(obj: object, path: Path) -> None:
    """``torch.save(obj, path)``, atomically (see :func:`atomic_write`)."""
    atomic_write(Path(path), lambda f: torch.save(obj, f))


def write_manifest(directory: Path, step: int, names: list[str]) -> dict[str, Any]:
    """Hash ``names`` (files in ``directory``) and write ``manifest.json`` atomically, last."""
    files = {
        name: {"bytes": (directory / name).stat().st_size, "sha256": sha256_file(directory / name)}
        for name in sorted(names)
    }
    manifest = {"step": step, "files": files}
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    atomic_write(directory / MANIFEST, lambda f: f.write(data))
    return manifest


def verify_checkpoint(directory: Path) -> str | None:
    """None when ``directory`` is a complete, intact checkpoint; else why not, in a few words.

    Reasons look like ``"no manifest.json (the save did not finish)"``, ``"train_state.pt is
    missing"``, ``"train_state.pt has 100 bytes, the manifest says 2048 (truncated)"``,
    ``"train_state.pt sha256 differs from the manifest (corrupted)"``.
    """
    directory = Path(directory)
    # TODO 4.1: check the manifest, then every file it lists: present, right size, right hash.
    # Invariant: only a directory whose every listed file matches its size and sha256 is valid;
    #   a missing or unreadable manifest means the save never finished.
    # Hint 1: the manifest is JSON: {"step": S, "files": {name: {"bytes": n, "sha256": hex}}};
    #   compare the size first (cheap, and names truncation), then sha256_file.
    # More hints: uv run python -m tests.hint 4.1
    # See guidelines.md#41-atomic-complete-checkpoints
    raise NotImplementedError(
        "TODO 4.1: check the manifest, then every file it lists: present, right size, right hash "
        "(see phase4_production/guidelines.md#41-atomic-complete-checkpoints)"
    )


def step_of(directory: Path) -> int:
    """``step_00000030`` -> 30."""
    return int(Path(directory).name.removeprefix(STEP_PREFIX))


class CheckpointManager:
    """Checkpoints in ``directory/step_XXXXXXXX/``: atomic files, manifest last, keep the last K.

    Only the rank that calls :meth:`save` writes (rank 0 in the trainer); every rank may call
    :meth:`latest_valid` and :meth:`load` (the directory is on a filesystem they share).
    """

    def __init__(self, directory: Path | str, keep: int = 3, *, log: Log = _stderr) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep}: keep at least the newest checkpoint (keep >= 1)")
        self.directory = Path(directory)
        self.keep = keep
        self.log = log

    def path_for(self, step: int) -> Path:
        return self.directory / f"{STEP_PREFIX}{step:08d}"

    def checkpoints(self) -> list[Path]:
        """Every checkpoint directory, complete or not, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [
            p
            for p in self.directory.iterdir()
            if p.is_dir() and p.name.startswith(STEP_PREFIX) and p.name[5:].isdigit()
        ]
        return sorted(found, key=step_of)

    def save(
        self,
        step: int,
        files: Mapping[str, object],
        *,
        before_manifest: Callable[[], object] | None = None,
    ) -> Path:
        """Write ``files`` ({name: object for torch.save}) as the checkpoint of ``step``.

        ``before_manifest`` runs after the files and before the manifest (failure injection:
        a crash there must leave the previous checkpoint the newest valid one).
        """
        target = self.path_for(step)
        target.mkdir(parents=True, exist_ok=True)
        (target / MANIFEST).unlink(missing_ok=True)  # re-saving a step: invalid until done
        for name, obj in files.items():
            atomic_save(obj, target / name)
        if before_manifest is not None:
            before_manifest()
        write_manifest(target, step, list(files))
        self.prune(step)
        return target

    def prune(self, newest: int) -> None:
        """Keep the ``keep`` newest complete checkpoints; remove older ones and older debris."""
        complete = [p for p in self.checkpoints() if (p / MANIFEST).exists()]
        kept = set(complete[-self.keep :])
        for path in self.checkpoints():
            if path not in kept and step_of(path) <= newest:
                shutil.rmtree(path, ignore_errors=True)

    def latest_valid(self) -> Path | None:
        """The newest checkpoint that verifies; each newer one that does not is logged, skipped."""
        # TODO 4.1: try the checkpoints newest first; return the first that verifies.
        # Invariant: a corrupted, truncated or unfinished newest checkpoint is never returned,
        #   and each one skipped is named in one log line with the reason.
        # Hint 1: self.checkpoints() is oldest first; verify_checkpoint says why one is bad.
        # More hints: uv run python -m tests.hint 4.1
        # See guidelines.md#41-atomic-complete-checkpoints
        raise NotImplementedError(
            "TODO 4.1: try the checkpoints newest first; return the first that verifies "
            "(see phase4_production/guidelines.md#41-atomic-complete-checkpoints)"
        )

    @staticmethod
    def load(path: Path, name: str, map_location: str | torch.device = "cpu") -> Any:
        """``torch.load`` one file of a checkpoint with ``weights_only=True`` (no pickled code)."""
        return torch.load(Path(path) / name, map_location=map_location, weights_only=True)


# ----------------------------------------------------------------------------- per-rank RNG


def rank_key(rank: int, name: str) -> str:
    """The key of one rank's value: ``rank_key(1, "torch_cpu") == "rank1/torch_cpu"``."""
    return f"rank{rank}/{name}"


def capture_rng(rank: int) -> dict[str, Any]:
    """This process's RNG states (torch CPU and CUDA, NumPy, Python) under ``rank<r>/`` keys.

    Every value is a tensor, a number, a string, None or a list of tensors, so that
    ``torch.load(..., weights_only=True)`` reads it back.
    """
    # TODO 4.1: capture every generator a training step can draw from, under this rank's keys.
    # Invariant: restore_rng(capture_rng(r), r) puts every generator back exactly, and the
    #   result holds only tensors, numbers, strings, None and lists of tensors.
    # Hint 1: four generators: torch's CPU one, CUDA's (one per GPU), NumPy's and Python's;
    #   rng_state.py converts the last two to tensors and ints.
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
    # Invariant: after restore_rng, torch, NumPy and Python draw exactly what the saved
    #   process would have drawn next.
    # Hint 1: strip the "rank<r>/" prefix from this rank's keys; the rng_state.set_* functions
    #   take the stripped dictionary.
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
