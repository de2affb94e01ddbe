"""The file-level machinery under exercise 4.1's checkpoints (given, not an exercise).

Exercise 4.1 decides *when* a checkpoint is trustworthy (atomic writes, a manifest checked before
use, the newest valid one wins, every rank's RNG under its own keys). What it stands on is here,
complete:

* :func:`sha256_file`, :func:`fsync_directory`: a file's digest; a rename made durable;
* :func:`read_manifest`: ``manifest.json`` parsed *defensively*. A manifest is input like any
  other: a flipped byte can turn a key name, a number or a file name into anything. Whatever it
  holds, :func:`read_manifest` returns a well-formed :class:`Manifest` or raises
  :class:`ManifestError` with a reason in a few words, never ``KeyError``/``TypeError``. A
  manifest that lists no file, names a file outside its folder (``../x``, ``a/b``) or disagrees
  with its folder's step is malformed too;
* the folders: ``step_XXXXXXXX`` (:func:`step_of`, :func:`is_step_folder`), and the *switch* that
  lets a step be saved again without ever removing its last valid state first
  (:func:`staging_folder`, :func:`switch_in`, :func:`recover_switches`: the new files and their
  manifest are written in a hidden folder beside the old one, and only a complete new folder
  takes the old one's name);
* the settings that shaped a checkpoint (:class:`SettingsMismatch`, :func:`check_settings`): a
  run with another ``--train-samples`` is refused by name before any tensor is loaded, instead of
  failing later with "The size of tensor a (480) must match ... (512)";
* :func:`folder_problem`: a checkpoint directory that cannot exist (below a file) or cannot be
  written, said before any process group starts.

**A checkpoint folder is code-trusted input.** ``torch.load(..., weights_only=True)`` (what
4.1's manager uses) unpickles only tensors, numbers, strings and containers. But
``torch.distributed.checkpoint.load`` unpickles the folder's ``.metadata`` with the full pickle
module (torch/distributed/checkpoint/filesystem.py, ``read_metadata``): a crafted folder runs
code when it is loaded. The manifest check (every listed file present with its size and sha256,
and nothing unlisted) refuses a damaged folder and one changed by someone who did not also
rewrite the manifest; against someone who can rewrite the folder, pin the manifest's own digest
(:func:`manifest_digest`, printed when the checkpoint is written) or load only folders you wrote.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
STEP_PREFIX = "step_"
_STEP_NAME = re.compile(r"step_(\d{8,})")
_HEX64 = re.compile(r"[0-9a-f]{64}")
Setting = str | int | float | bool | None


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


# ----------------------------------------------------------------------------- the manifest


class ManifestError(ValueError):
    """``manifest.json`` cannot be trusted to describe its folder; the message says why."""


@dataclass(frozen=True)
class FileEntry:
    """What the manifest says one file of the checkpoint is."""

    bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """A parsed, well-formed ``manifest.json``."""

    step: int
    files: dict[str, FileEntry]
    settings: dict[str, Setting] = field(default_factory=dict)


def manifest_json(
    step: int, files: Mapping[str, FileEntry], settings: Mapping[str, Setting]
) -> bytes:
    """The bytes :func:`read_manifest` reads back (sorted keys, one entry per line)."""
    data: dict[str, Any] = {
        "step": step,
        "files": {
            name: {"bytes": e.bytes, "sha256": e.sha256} for name, e in sorted(files.items())
        },
    }
    if settings:
        data["settings"] = dict(settings)
    return json.dumps(data, indent=1, sort_keys=True).encode()


def _plain_name(name: object) -> bool:
    """A file directly inside the folder: no separator, not ``.``/``..``, not the manifest."""
    return (
        isinstance(name, str)
        and bool(name)
        and name not in (".", "..", MANIFEST)
        and "/" not in name
        and "\\" not in name
        and "\x00" not in name
    )


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_manifest(directory: Path) -> Manifest:
    """``directory``'s manifest, or :class:`ManifestError` saying why it is not one.

    Refused: a file that is not UTF-8 JSON, a top level that is not an object, a ``step`` that is
    not the folder's (``step_00000040`` holds step 40), ``files`` that is not a non-empty object
    of plain file names each with an integer ``bytes`` >= 0 and a lower-case hex ``sha256`` of 64
    digits, ``settings`` that is not an object of numbers, strings, booleans and nulls. A missing
    manifest is :class:`ManifestError` too (check for it first when that means something else:
    in 4.1, a save that did not finish).
    """
    directory = Path(directory)
    path = directory / MANIFEST
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise ManifestError(f"no {MANIFEST}") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        raise ManifestError(f"{MANIFEST} is unreadable ({type(err).__name__})") from None
    if not isinstance(data, dict):
        raise ManifestError(f"{MANIFEST} is malformed: not a JSON object")
    unknown = sorted(set(data) - {"step", "files", "settings"})
    if unknown:
        raise ManifestError(f"{MANIFEST} is malformed: unknown key {unknown[0]!r}")
    step = data.get("step")
    if not isinstance(step, int) or not _count(step):
        raise ManifestError(f"{MANIFEST} is malformed: 'step' is {step!r}, not a step number")
    if is_step_folder(directory) and step != step_of(directory):
        raise ManifestError(
            f"{MANIFEST} is malformed: it says step {step}, the folder is {directory.name}"
        )
    files = data.get("files")
    if not isinstance(files, dict) or not files:
        raise ManifestError(f"{MANIFEST} is malformed: it lists no files")
    entries: dict[str, FileEntry] = {}
    for name, entry in files.items():
        if not _plain_name(name):
            raise ManifestError(f"{MANIFEST} is malformed: {name!r} is not a file of this folder")
        if not isinstance(entry, dict) or set(entry) != {"bytes", "sha256"}:
            raise ManifestError(f"{MANIFEST} is malformed: the entry of {name!r}")
        size, digest = entry["bytes"], entry["sha256"]
        if not _count(size) or not isinstance(digest, str) or not _HEX64.fullmatch(digest):
            raise ManifestError(f"{MANIFEST} is malformed: the size or sha256 of {name!r}")
        entries[name] = FileEntry(size, digest)
    settings = data.get("settings", {})
    if not isinstance(settings, dict) or not all(
        isinstance(k, str) and _setting(v) for k, v in settings.items()
    ):
        raise ManifestError(f"{MANIFEST} is malformed: 'settings'")
    return Manifest(step, entries, settings)


def _setting(value: object) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    return value is None or isinstance(value, (str, int, bool))


def manifest_digest(directory: Path) -> str:
    """The sha256 of ``directory``'s manifest itself: pin it to trust the whole folder."""
    return sha256_file(Path(directory) / MANIFEST)


def unlisted_files(directory: Path, manifest: Manifest) -> list[str]:
    """Files in ``directory`` (recursively) that the manifest does not list, besides itself.

    ``torch.distributed.checkpoint`` reads whatever ``.metadata`` points at: in a folder checked
    before ``dcp.load``, an unlisted file is as suspect as a changed one.
    """
    found = sorted(
        str(p.relative_to(directory)) for p in Path(directory).rglob("*") if not p.is_dir()
    )
    return [name for name in found if name != MANIFEST and name not in manifest.files]


# ----------------------------------------------------------------------------- the step folders


def is_step_folder(path: Path) -> bool:
    """``step_00000030`` (8 or more digits)."""
    return _STEP_NAME.fullmatch(Path(path).name) is not None


def step_of(directory: Path) -> int:
    """``step_00000030`` -> 30."""
    match = _STEP_NAME.fullmatch(Path(directory).name)
    if match is None:
        raise ValueError(f"{directory} is not a checkpoint folder (step_XXXXXXXX)")
    return int(match[1])


def staging_folder(target: Path) -> Path:
    """A hidden folder beside ``target`` for a new save of the same step."""
    return target.parent / f".{target.name}.new-{secrets.token_hex(4)}"


def _parked_folder(target: Path) -> Path:
    return target.parent / f".{target.name}.old-{secrets.token_hex(4)}"


def switch_in(staged: Path, target: Path) -> None:
    """Put the complete folder ``staged`` in ``target``'s place; the old ``target`` is removed
    only once the new one holds the name.

    Two renames: the old folder is parked under a hidden name, the new one takes the name. A crash
    between them leaves a parked folder and a complete staged one and no ``target``: the next
    :func:`recover_switches` (every listing of checkpoints runs it) puts the staged one in place.
    """
    parked = _parked_folder(target)
    os.replace(target, parked)
    try:
        os.replace(staged, target)
    except FileNotFoundError:
        if not target.exists():  # nobody finished the switch for us: put the old one back
            os.replace(parked, target)
            raise
    fsync_directory(target.parent)
    shutil.rmtree(parked, ignore_errors=True)


def recover_switches(root: Path) -> None:
    """Finish the switches a crash interrupted (see :func:`switch_in`); idempotent.

    A parked folder whose step folder is missing: the complete staged folder of that step takes
    the name (it has its manifest: the save finished), else the parked one goes back. A parked
    folder whose step folder exists is the debris of a finished switch and is removed.
    """
    root = Path(root)
    if not root.is_dir():
        return
    for parked in sorted(root.glob(f".{STEP_PREFIX}*.old-*")):
        target = root / parked.name[1:].split(".old-")[0]
        try:
            if not target.exists():
                staged = [s for s in root.glob(f".{target.name}.new-*") if (s / MANIFEST).exists()]
                os.replace(staged[0] if staged else parked, target)
            shutil.rmtree(parked, ignore_errors=True)
        except OSError:
            continue  # another process is recovering the same folder


def stale_folders(root: Path) -> list[Path]:
    """Hidden staging and parked folders left by interrupted saves (the writer removes them)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob(f".{STEP_PREFIX}*") if p.is_dir())


# ----------------------------------------------------------------------------- settings


class SettingsMismatch(ValueError):
    """A checkpoint made with other settings than this run's; the message names each one."""


def _shown(key: str, value: Setting) -> str:
    """``--train-samples 512``, ``world size 2``, ``model.name=resnet50``."""
    return f"{key} {value}" if key.startswith("-") or " " in key else f"{key}={value}"


def settings_differences(saved: Mapping[str, Setting], now: Mapping[str, Setting]) -> list[str]:
    """``"--train-samples 512, this run has 480"`` for each setting ``now`` names that differs
    (a setting the checkpoint does not record is not compared)."""
    return [
        f"{_shown(key, saved[key])}, this run has {now[key]}"
        for key in now
        if key in saved and saved[key] != now[key]
    ]


def check_settings(directory: Path, settings: Mapping[str, Setting]) -> None:
    """Raise :class:`SettingsMismatch` when ``directory``'s manifest records other ``settings``.

    Reads only the manifest: nothing of the checkpoint is unpickled before the settings agree.
    """
    if not settings:
        return
    manifest = read_manifest(directory)
    differences = settings_differences(manifest.settings, settings)
    if differences:
        raise SettingsMismatch(
            f"checkpoint {Path(directory).name} was made with "
            + "; with ".join(differences)
            + ": run with the checkpoint's settings, or point the run at another checkpoint folder"
        )


def newest_settings_problem(root: Path, settings: Mapping[str, Setting]) -> str | None:
    """Before a run starts: the settings mismatch of the newest checkpoint whose manifest reads,
    in one line, or None (no checkpoint, or the same settings)."""
    root = Path(root)
    if not root.is_dir():
        return None
    folders = sorted((p for p in root.iterdir() if is_step_folder(p) and p.is_dir()), key=step_of)
    for folder in reversed(folders):
        try:
            check_settings(folder, settings)
        except SettingsMismatch as err:
            return str(err)
        except ManifestError:
            continue
        return None
    return None


def folder_problem(path: str | Path, what: str) -> str | None:
    """Why checkpoints cannot be written under ``path`` (one line naming ``what``, the flag or
    key, and the fix), or None. Checked before any process group starts."""
    p = Path(path)
    for ancestor in (p, *p.parents):
        if not ancestor.exists():
            continue
        if not ancestor.is_dir():
            return (
                f"{what} {path}: {ancestor} is a file, not a folder "
                "(fix: choose a folder path, e.g. checkpoints/run1)"
            )
        if not os.access(ancestor, os.W_OK | os.X_OK):
            return f"{what} {path}: {ancestor} is not writable (fix: a folder you can write)"
        return None
    return None
