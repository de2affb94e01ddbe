"""Grader of exercise 4.1, damage beyond the files: ``uv run pytest tests/test_phase4.py -m ex4_1``.

The manifest is input too. Every byte of a manifest is flipped (each of its 8 bits, one at a
time) and the manifest is cut at every length: whatever the damage, ``latest_valid`` must return
the older intact checkpoint (or the damaged one only when the damage changed nothing it
describes, such as whitespace), log the one it passed over, and never raise. Hand-made bad
manifests (no files, a file outside the folder, a size that is not a number) are invalid.

Then a step saved again (a run that resumed at its last step saves it once more) with ``keep=1``:
the process is killed with SIGKILL in the middle of that save, at two points, and the folder must
still hold a complete checkpoint equal to one of the two saves. Beside it, the given parts:
settings recorded in a checkpoint are compared before anything is unpickled, and a DCP folder
that does not match its manifest is refused before ``dcp.load`` unpickles its ``.metadata``.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from grading import exercise, learner_line
from phase4_helpers import fail, module, world

STATE = "state.pt"


def ckpt() -> Any:
    return module("checkpoint")


def saved_state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64,), float(step)), "step": torch.tensor(step)}


def two_checkpoints(root: Path, logs: list[str]) -> Any:
    manager = ckpt().CheckpointManager(root, keep=2, log=logs.append)
    for step in (10, 20):
        manager.save(step, {STATE: saved_state(step)})
    return manager


def describe_change(original: bytes, damaged: bytes, position: int | None) -> str:
    if position is None:
        return f"the manifest cut to its first {len(damaged)} of {len(original)} bytes"
    return (
        f"byte {position} of the manifest changed from {original[position : position + 1]!r} "
        f"to {damaged[position : position + 1]!r}"
    )


def still_describes_the_files(original: bytes, damaged: bytes) -> bool:
    """Whether the damaged manifest still says exactly what the original says about the files
    (whitespace, say): only then may the damaged checkpoint be returned."""
    try:
        before, after = json.loads(original), json.loads(damaged.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(after, dict) and after.get("files") == before["files"]


def check_damage(
    manager: Any,
    logs: list[str],
    manifest: Path,
    original: bytes,
    damaged: bytes,
    position: int | None,
) -> None:
    manifest.write_bytes(damaged)
    logs.clear()
    change = describe_change(original, damaged, position)
    try:
        chosen = manager.latest_valid()
    except Exception as err:  # the grader's point: anything raised here is the finding
        fail(
            f"4.1 latest_valid raised {type(err).__name__}: {err}{learner_line(err)} after {change} "
            f"(step_00000020/manifest.json now reads {damaged[:120]!r}). A damaged manifest "
            "makes its checkpoint invalid, nothing more: verify_checkpoint must return a "
            "reason for it (read_manifest raises ManifestError for any manifest it cannot "
            "trust), so that the older checkpoint step_00000010 is used"
        )
    name = None if chosen is None else chosen.name
    if name == "step_00000020" and still_describes_the_files(original, damaged):
        return
    if name != "step_00000010":
        why = (
            "it no longer describes its files: it must be skipped"
            if name == "step_00000020"
            else "step_00000010 is intact and must be used"
        )
        fail(
            f"4.1 latest_valid returned {name} after {change} (step_00000020/manifest.json now "
            f"reads {damaged[:120]!r}); {why}"
        )
    if not any("step_00000020" in line for line in logs):
        fail(
            f"4.1 latest_valid passed over step_00000020 after {change} without a log line "
            f"naming it and the reason; the log was {logs}"
        )


@exercise("4.1")
def test_every_byte_flip_and_cut_of_a_manifest_falls_back_to_the_older_checkpoint(
    tmp_path: Path,
) -> None:
    logs: list[str] = []
    manager = two_checkpoints(tmp_path, logs)
    manifest = tmp_path / "step_00000020" / "manifest.json"
    original = manifest.read_bytes()
    for position in range(len(original)):
        for bit in range(8):
            damaged = bytearray(original)
            damaged[position] ^= 1 << bit
            check_damage(manager, logs, manifest, original, bytes(damaged), position)
    for length in range(len(original)):
        check_damage(manager, logs, manifest, original, original[:length], None)
    manifest.write_bytes(original)
    chosen = manager.latest_valid()
    if chosen is None or chosen.name != "step_00000020":
        fail("4.1 latest_valid: with its manifest restored, step_00000020 must be valid again")


def forged(root: Path) -> dict[str, Any]:
    """Hand-made manifests for step_00000020 (its state file is intact)."""
    c = ckpt()
    state = root / "step_00000020" / STATE
    entry = {"bytes": state.stat().st_size, "sha256": c.sha256_file(state)}
    older = root / "step_00000010" / STATE
    outside = {"bytes": older.stat().st_size, "sha256": c.sha256_file(older)}
    return {
        "no files listed": {"step": 20, "files": {}},
        "a file outside the folder": {"step": 20, "files": {"../step_00000010/state.pt": outside}},
        "a size that is a string": {"step": 20, "files": {STATE: {**entry, "bytes": "1234"}}},
        "an entry that is a list": {"step": 20, "files": {STATE: [entry["bytes"]]}},
        "files that is a list": {"step": 20, "files": [STATE]},
        "a top level that is a list": [{"step": 20, "files": {STATE: entry}}],
        "another step's manifest": {"step": 10, "files": {STATE: entry}},
    }


@exercise("4.1")
def test_hand_made_bad_manifests_are_invalid(tmp_path: Path) -> None:
    logs: list[str] = []
    manager = two_checkpoints(tmp_path, logs)
    manifest = tmp_path / "step_00000020" / "manifest.json"
    for what, content in forged(tmp_path).items():
        manifest.write_text(json.dumps(content))
        logs.clear()
        try:
            reason = ckpt().verify_checkpoint(tmp_path / "step_00000020")
            chosen = manager.latest_valid()
        except Exception as err:  # the finding
            fail(
                f"4.1 a manifest with {what} ({json.dumps(content)[:100]}) made "
                f"verify_checkpoint or latest_valid raise {type(err).__name__}: {err}"
                f"{learner_line(err)}; it must "
                "make that checkpoint invalid, with a reason"
            )
        if reason is None or chosen is None or chosen.name != "step_00000010":
            got = None if chosen is None else chosen.name
            fail(
                f"4.1 a manifest with {what} ({json.dumps(content)[:100]}): verify_checkpoint "
                f"said {reason!r} and latest_valid returned {got}; that checkpoint is invalid "
                "(read_manifest refuses it: use it), step_00000010 must be returned"
            )


# ----------------------------------------------------------------------------- a killed re-save


def killed_child(action: Callable[[], object]) -> None:
    """Run ``action`` in a forked child and make sure it died of SIGKILL (a real crash)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            action()
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
        fail(f"4.1 grader: the saving process was meant to be killed, it exited with {status}")


def kill_now() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def resave_killed_before_manifest(root: Path) -> None:
    manager = ckpt().CheckpointManager(root, keep=1, log=lambda _m: None)
    manager.save(5, {STATE: saved_state(500)}, before_manifest=kill_now)


def resave_killed_between_the_renames(root: Path) -> None:
    """Kill the process just after the old folder was moved aside, before the new one is in."""
    real = os.replace

    def replace_then_die(src: Any, dst: Any) -> None:
        real(src, dst)
        if Path(src).name == "step_00000005":
            kill_now()

    os.replace = replace_then_die  # type: ignore[assignment]
    manager = ckpt().CheckpointManager(root, keep=1, log=lambda _m: None)
    manager.save(5, {STATE: saved_state(500)})


@exercise("4.1")
@pytest.mark.parametrize(
    "point, kill",
    [
        ("after the new files, before their manifest", resave_killed_before_manifest),
        (
            "between moving the old folder aside and the new one in",
            resave_killed_between_the_renames,
        ),
    ],
)
def test_a_step_saved_again_and_killed_midway_with_keep_1_leaves_a_complete_checkpoint(
    tmp_path: Path, point: str, kill: Callable[[Path], None]
) -> None:
    logs: list[str] = []
    manager = ckpt().CheckpointManager(tmp_path, keep=1, log=logs.append)
    manager.save(5, {STATE: saved_state(5)})
    killed_child(lambda: kill(tmp_path))
    what = f"4.1 keep=1, step 5 saved again and the process SIGKILLed {point}"
    chosen = manager.latest_valid()
    if chosen is None:
        fail(
            f"{what}: latest_valid found nothing valid (the folder holds "
            f"{sorted(p.name for p in tmp_path.iterdir())}; log {logs}). Saving a step again "
            "must never remove its last valid state before the new one is complete"
        )
    got = manager.load(chosen, STATE)
    if not any(torch.equal(got["w"], saved_state(s)["w"]) for s in (5, 500)):
        fail(f"{what}: the checkpoint found holds neither save's values")
    manager.save(5, {STATE: saved_state(7)})  # the next run saves it once more, and cleans up
    if sorted(p.name for p in tmp_path.iterdir()) != ["step_00000005"]:
        fail(f"{what}: after one more save the folder holds {sorted(os.listdir(tmp_path))}")
    if not torch.equal(manager.load(manager.latest_valid(), STATE)["w"], saved_state(7)["w"]):
        fail(f"{what}: the save after the crash did not replace the step's state")


# ----------------------------------------------------------------------------- the given parts


@exercise("4.1")
@pytest.mark.reference
def test_a_checkpoint_of_other_settings_is_refused_by_name_before_anything_is_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from phase4_production.checkpoint_files import SettingsMismatch

    c = ckpt()
    made = c.CheckpointManager(tmp_path, settings={"--train-samples": 512, "--seed": 0})
    path = made.save(3, {STATE: saved_state(3)})
    loads: list[Any] = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a))
    other = c.CheckpointManager(tmp_path, settings={"--train-samples": 480, "--seed": 0})
    with pytest.raises(SettingsMismatch) as refused:
        other.load(path, STATE)
    message = str(refused.value)
    what = "4.1 a checkpoint saved with --train-samples 512, loaded by a run with 480"
    if "--train-samples 512, this run has 480" not in message or "--seed" in message:
        fail(
            f"{what}: the refusal should name the one setting that differs, with both values "
            f"('--train-samples 512, this run has 480') and no other; it says: {message!r}"
        )
    if loads:
        fail(
            f"{what}: refused, but only after torch.load read {len(loads)} file(s): compare "
            "the settings from the manifest first, before loading anything"
        )


class Payload:
    """Unpickling this creates ``marker``: what a crafted .metadata could do instead."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (Path(self.marker),))


def tampered_dcp_worker(root: str) -> dict[str, str]:
    import solutions.phase4_production.library.sharded_checkpoint as sharded

    model, optimizer = sharded.build_sharded(seed=0)
    outcomes: dict[str, str] = {}
    cases: dict[str, Callable[[Path], object]] = {
        "intact": lambda folder: None,
        "a crafted .metadata": lambda folder: (folder / ".metadata").write_bytes(
            pickle.dumps(Payload(str(folder.parent / "ran")))
        ),
        "a shard changed": lambda folder: next(folder.glob("*.distcp")).write_bytes(b"x"),
        "an unlisted file": lambda folder: (folder / "extra.distcp").write_bytes(b"x"),
    }
    for name, damage in cases.items():
        folder = Path(root) / name.replace(" ", "_")
        digest = sharded.save(model, optimizer, str(folder))
        damage(folder)
        try:
            sharded.load(model, optimizer, str(folder), manifest_sha256=digest)
            outcomes[name] = "loaded"
        except sharded.CheckpointRejected as err:
            outcomes[name] = f"refused: {err}"
    folder = Path(root) / "pinned"
    sharded.save(model, optimizer, str(folder))
    try:
        sharded.load(model, optimizer, str(folder), manifest_sha256="0" * 64)
        outcomes["another manifest pinned"] = "loaded"
    except sharded.CheckpointRejected as err:
        outcomes["another manifest pinned"] = f"refused: {err}"
    outcomes["code ran"] = str((Path(root) / "ran").exists())
    return outcomes


@exercise("4.1")
@pytest.mark.reference
def test_a_dcp_folder_that_does_not_match_its_manifest_is_refused_before_dcp_load(
    tmp_path: Path,
) -> None:
    outcomes = world(tampered_dcp_worker, 1, str(tmp_path))[0]
    what = "4.1 the sharded (DCP) checkpoint against its manifest"
    if outcomes.pop("intact") != "loaded":
        fail(f"{what}: an intact folder should load; the outcomes were {outcomes}")
    if outcomes.pop("code ran") != "False":
        fail(
            f"{what}: loading a crafted .metadata ran the code pickled in it: check the "
            "manifest's digests before dcp.load unpickles anything"
        )
    for name, outcome in outcomes.items():
        if not outcome.startswith("refused: refusing to dcp.load"):
            fail(f"{what}: a folder with {name} should be refused before dcp.load; {outcome}")
    if "metadata: .metadata " not in outcomes["a crafted .metadata"]:
        fail(
            f"{what}: the refusal of a crafted .metadata should name the file '.metadata'; it "
            f"says: {outcomes['a crafted .metadata']!r}"
        )
