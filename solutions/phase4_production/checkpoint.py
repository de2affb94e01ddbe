"""Exercise 4.1: checkpoints that survive crashes, and hold everything a bitwise resume needs.

A checkpoint is only useful if, after any crash, the newest one that *looks* complete *is*
complete. Three ideas give that:

* **atomic files**: a reader must only ever see a file's complete old version or its complete new
  one, whatever moment the writer dies at, power loss included. POSIX gives exactly one
  operation with that property (a rename within one filesystem); the rest is making sure the
  bytes are really on the disk before anyone can see them under the final name.
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
    # Invariant: at every instant `path` is absent, the complete old file or the complete new
    #   file; a crash leaves at most a stray temporary file, never a partial `path`; a write
    #   that fails leaves nothing behind.
    # Hint 1: only a rename is atomic, and only within one filesystem; and bytes a program has
    #   written may still sit in a buffer or the page cache when the power goes.
    # Hint 2: three moves: put the bytes in a uniquely named temporary file in the target's own
    #   folder and make them durable (Python's buffer, then the operating system's); rename that
    #   file onto the target and make the rename durable too (the folder is data as well); if any
    #   step raises, remove the temporary file and let the error go on.
    # Hint 3: tempfile.mkstemp in the target's folder gives a descriptor and a name; os.fdopen
    #   opens the descriptor for binary writing; the file object's flush, then os.fsync of its
    #   descriptor number (fileno), before os.replace moves the temporary name onto the
    #   target; then fsync_directory on the target's folder. The except branch unlinks the
    #   temporary file (missing_ok) and re-raises.
    # See guidelines.md#41-atomic-complete-checkpoints
    # >>> solution
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix="." + path.name + ".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)
    # <<< solution


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
    # Invariant: only a folder whose manifest reads and whose every listed file has the listed
    #   size and sha256 is valid; a folder without a manifest is a save that never finished; a
    #   damaged manifest makes the folder invalid, it never raises out of here.
    # Hint 1: the cheapest question first: a manifest that is absent, then one that does not
    #   read (read_manifest says why, as a ManifestError), then per file the size, which names a
    #   truncation, and only then the hash, which reads the whole file.
    # Hint 2: absent manifest -> the "did not finish" reason; read_manifest raising -> its message
    #   is the reason; then for each listed file in sorted order: absent, a size that differs, a
    #   hash that differs, each with its reason in the docstring's words; None when all match.
    # Hint 3: read_manifest(directory).files maps a name to FileEntry(bytes, sha256); compare
    #   path.stat().st_size with entry.bytes and sha256_file(path) with entry.sha256.
    # See guidelines.md#41-atomic-complete-checkpoints
    # >>> solution
    if not (directory / MANIFEST).exists():
        return f"no {MANIFEST} (the save did not finish)"
    try:
        manifest = read_manifest(directory)
    except ManifestError as err:
        return str(err)
    for name, entry in sorted(manifest.files.items()):
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != entry.bytes:
            return f"{name} has {size} bytes, the manifest says {entry.bytes} (truncated)"
        if sha256_file(path) != entry.sha256:
            return f"{name} sha256 differs from the manifest (corrupted)"
    return None
    # <<< solution


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
        # Invariant: a corrupted, truncated, unfinished or malformed newest checkpoint is never
        #   returned, and each one passed over is named in one log line with its reason; with
        #   nothing valid left the answer is None.
        # Hint 1: self.checkpoints() lists the folders oldest first; verify_checkpoint says why
        #   one cannot be used; self.log writes one line.
        # Hint 2: In which order should the folders be tried, and when may the search stop? What
        #   happens to a folder that verify_checkpoint rejects: which line is written, and does the
        #   search go on? What is left when no folder verifies?
        # Hint 3: Go from the newest folder to the oldest; a folder with a reason gets its log line
        #   (its name and the reason) and the search goes on; the first without one is the answer;
        #   None after the loop.
        # See guidelines.md#41-atomic-complete-checkpoints
        # >>> solution
        for path in reversed(self.checkpoints()):
            reason = verify_checkpoint(path)
            if reason is None:
                return path
            self.log(f"checkpoint {path.name} skipped: {reason}")
        return None
        # <<< solution

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
    """This process's RNG states (torch CPU and CUDA, NumPy, Python) under ``rank<r>/`` keys.

    Every value is a tensor, a number, a string, None or a list of tensors, so that
    ``torch.load(..., weights_only=True)`` reads it back.
    """
    # TODO 4.1: capture every generator a training step can draw from, under this rank's keys.
    # Invariant: restore_rng(capture_rng(r), r) puts every generator back exactly; the keys of
    #   two ranks never collide (one file holds every rank's states), and the values are only
    #   tensors, numbers, strings, None and lists of tensors (weights_only=True reads them).
    # Hint 1: a training step can draw from four kinds of generator (one of them per GPU);
    #   rng_state.py turns the two that torch.load would refuse into tensors and ints.
    # Hint 2: Which four generators can a step draw from? Which two would torch.load with
    #   weights_only=True refuse as they are, and which helpers of rng_state.py turn them into plain
    #   values (in what shape)? What makes one rank's keys differ from another's in a file that
    #   holds them all?
    # Hint 3: One dictionary with torch's CPU state under torch_cpu, rng_state.cuda_states() under
    #   torch_cuda, and the entries of the dictionaries rng_state.numpy_state() and
    #   rng_state.python_state() return; then every key renamed with rank_key(rank, key), so that it
    #   says which rank it belongs to.
    # See guidelines.md#41-atomic-complete-checkpoints
    # >>> solution
    state: dict[str, Any] = {
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda": rng_state.cuda_states(),
        **rng_state.numpy_state(),
        **rng_state.python_state(),
    }
    return {rank_key(rank, key): value for key, value in state.items()}
    # <<< solution


def restore_rng(states: Mapping[str, Any], rank: int) -> None:
    """Put back the RNG states :func:`capture_rng` saved for ``rank``.

    Raises KeyError naming the rank when ``states`` holds nothing for it.
    """
    # TODO 4.1: restore this rank's generators from its own keys (never another rank's).
    # Invariant: after restore_rng, torch, NumPy and Python draw exactly what the saved
    #   process would have drawn next; in a file of 12 ranks' states rank 1 takes rank 1's,
    #   not rank 10's or 11's; a rank with no states of its own is a KeyError, never a fallback.
    # Hint 1: this is capture_rng backwards: select this rank's entries, undo the renaming, and
    #   give each generator its state (rng_state.py has the setters for the converted ones).
    # Hint 2: In a file of 12 ranks' states, which keys are rank 1's, and why must the separator
    #   after the rank be part of the test (think of rank 10)? What should happen when no key
    #   belongs to this rank? Which generators are set directly, which through rng_state.py's
    #   setters?
    # Hint 3: Keep the entries whose key starts with this rank's whole prefix (rank_key of the rank
    #   and an empty name) and take the prefix off; none left -> KeyError naming the rank; then set
    #   torch's CPU and CUDA states and hand the rest to the NumPy and Python setters.
    # See guidelines.md#41-atomic-complete-checkpoints
    # >>> solution
    prefix = rank_key(rank, "")
    mine = {k.removeprefix(prefix): v for k, v in states.items() if k.startswith(prefix)}
    if not mine:
        raise KeyError(f"no RNG state for rank {rank}")
    torch.set_rng_state(mine["torch_cpu"])
    rng_state.set_cuda_states(mine["torch_cuda"])
    rng_state.set_numpy_state(mine)
    rng_state.set_python_state(mine)
    # <<< solution


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
