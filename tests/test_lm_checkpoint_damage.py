"""The language-model framework never resumes from a damaged checkpoint (issue 38).

Two real checkpoints (a dp2 run of 2 x 2 steps in float64, saving every 2 steps: ``step_00000002``
and ``step_00000004``) are copied, the newest is damaged one way per test, and the framework's
choice is checked: it falls back to ``step_00000002`` and says in one line which folder it
skipped and why, or, for a checkpoint of another model, refuses by name. With every folder
damaged it refuses in one line naming the folder. Not an exercise: it runs the reference
framework (``lm/checkpoint.py``, 4.1's manifest code underneath).
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_lm_framework import CKPT_MODEL, checkpointed_run
from torch.distributed.checkpoint import FileSystemReader

from course.topology import Topology
from course.world import run_world
from phase4_production.checkpoint_files import manifest_json, read_manifest
from phase4_production.lm_layout import ParallelSettings
from solutions.phase4_production.checkpoint import write_manifest
from solutions.phase4_production.lm import checkpoint as lm_checkpoint

pytestmark = pytest.mark.harness

LAYOUT = {"dp": 2}
NEWEST, OLDER = "step_00000004", "step_00000002"
WIDER = dataclasses.replace(CKPT_MODEL, width=32)  # another model, same names, other shapes
WEIGHT, MOMENT = "model.blocks.1.mlp.down.weight", "exp_avg_sq.blocks.0.attention.qkv.weight"


@dataclasses.dataclass(frozen=True)
class Saved:
    """A folder of two intact checkpoints and the losses of the 4 steps that made them."""

    directory: Path
    losses: list[float]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    directory = tmp_path_factory.mktemp("saved") / "ckpt"
    losses = run_world(checkpointed_run, 2, (LAYOUT, 2, str(directory)))[0]
    names = sorted(p.name for p in directory.iterdir())
    assert names == [OLDER, NEWEST], (
        f"the dp2 run of 4 steps saved {names}, not [{OLDER}, {NEWEST}]"
    )
    return Saved(directory, losses)


def wider_run(directory: str) -> None:
    """One rank trains WIDER for 4 steps and saves once, at the end (step_00000004)."""
    from solutions.phase4_production.lm.trainer import RunOptions, run

    settings = ParallelSettings(lr=1e-2, max_norm=1.0)
    options = RunOptions(batch=4, epochs=2, steps_per_epoch=2, eval_batches=1,
                         dtype="float64", seed=3, sample_bytes=0)  # fmt: skip
    plan = lm_checkpoint.CheckpointPlan(directory, every=4)
    run(WIDER, settings, options, Topology.build(1, 1, 1), plan)


@pytest.fixture(scope="module")
def wider(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of another model (width 32, not 16) at step 4."""
    directory = tmp_path_factory.mktemp("wider")
    run_world(wider_run, 1, (str(directory),))
    return directory / NEWEST


def copy_of(saved: Saved, tmp_path: Path) -> Path:
    directory = tmp_path / "ckpt"
    shutil.copytree(saved.directory, directory)
    return directory


# ----------------------------------------------------------------------------- damage


def tensor_bytes(folder: Path, fqn: str) -> tuple[Path, int, int]:
    """Where the values of the tensor ``fqn`` lie: its file, their offset in it, their length.

    ``.metadata`` maps each tensor to a ``torch.save`` blob in a shard file (offset, length);
    the values are the blob's bytes equal to the tensor's raw bytes.
    """
    metadata = FileSystemReader(folder).read_metadata()  # read before the damage
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == fqn)
    path = folder / info.relative_path
    blob = path.read_bytes()[info.offset : info.offset + info.length]
    raw = torch.load(io.BytesIO(blob), weights_only=True).numpy().tobytes()
    start = blob.find(raw)
    assert start >= 0, f"{fqn}'s values are not in its blob in {path.name}"
    return path, info.offset + start, len(raw)


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def flip_inside(fqn: str) -> Callable[[Path], None]:
    """Flip one byte in the middle of the tensor ``fqn``'s values (DCP alone reads it silently:
    the blob is stored, not compressed, and nothing in it is checked)."""

    def damage(folder: Path) -> None:
        path, offset, length = tensor_bytes(folder, fqn)
        flip_byte(path, offset + length // 2)

    return damage


def flip_metadata(folder: Path) -> None:
    path = folder / ".metadata"
    flip_byte(path, path.stat().st_size // 2)


def truncate(*names: str, keep: float) -> Callable[[Path], None]:
    def damage(folder: Path) -> None:
        for name in names:
            path = folder / name
            path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])

    return damage


def delete(name: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).unlink()


def add_unlisted(folder: Path) -> None:
    shutil.copy(folder / "__0_0.distcp", folder / "__2_0.distcp")


def garble_manifest(folder: Path) -> None:
    path = folder / "manifest.json"
    path.write_bytes(path.read_bytes()[:40])


DAMAGES: dict[str, tuple[Callable[[Path], None], str]] = {
    # name: (the damage done to the newest folder, what the skip line must say)
    "half-truncated shards": (
        truncate("__0_0.distcp", "__1_0.distcp", keep=0.5),
        "__0_0.distcp has",
    ),
    "one empty shard": (truncate("__1_0.distcp", keep=0), "__1_0.distcp has 0 bytes"),
    "a flipped byte in a weight": (flip_inside(WEIGHT), "sha256 differs"),
    "a flipped byte in a moment": (flip_inside(MOMENT), "sha256 differs"),
    "a flipped byte in .metadata": (flip_metadata, ".metadata sha256 differs"),
    "a deleted shard": (delete("__0_0.distcp"), "__0_0.distcp is missing"),
    "a deleted .metadata": (delete(".metadata"), ".metadata is missing"),
    "a deleted manifest": (delete("manifest.json"), "no manifest.json"),
    "a garbled manifest": (garble_manifest, "manifest.json is unreadable"),
    "an unlisted file": (add_unlisted, "__2_0.distcp is not in the manifest"),
}


def assert_falls_back(directory: Path, damage: str, reason: str) -> None:
    """The framework's choice is the older intact checkpoint, with one line about the newest."""
    lines: list[str] = []
    chosen = lm_checkpoint.newest_valid(directory, CKPT_MODEL, lines.append)
    assert chosen == directory / OLDER, (
        f"{damage} in {NEWEST}: the framework chose {chosen}, not the intact {OLDER}"
    )
    assert len(lines) == 1 and NEWEST in lines[0] and reason in lines[0], (
        f"{damage} in {NEWEST}: expected one line naming {NEWEST} and saying {reason!r}; "
        f"got {lines}"
    )


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_newest_checkpoint_is_skipped_with_its_reason(
    saved: Saved, tmp_path: Path, damage: str
) -> None:
    directory = copy_of(saved, tmp_path)
    apply, reason = DAMAGES[damage]
    apply(directory / NEWEST)
    assert_falls_back(directory, damage, reason)


class Tripwire:
    """Unpickled, it creates its file: the trace of a ``.metadata`` that was unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[Path]]:
        return (Path.touch, (self.path,))


def test_a_replaced_metadata_is_refused_before_it_is_unpickled(
    saved: Saved, tmp_path: Path
) -> None:
    """DCP unpickles ``.metadata`` with the full pickle module: a folder whose ``.metadata`` is
    not the one its manifest lists is skipped without unpickling it."""
    directory = copy_of(saved, tmp_path)
    tripped = tmp_path / "unpickled"
    (directory / NEWEST / ".metadata").write_bytes(pickle.dumps(Tripwire(tripped)))
    try:
        assert_falls_back(directory, "a replaced .metadata", ".metadata has")
    finally:  # the root cause, when it is one, over what followed from it
        assert not tripped.exists(), "a replaced .metadata was unpickled before its check"


def test_a_manifest_that_lies_about_the_model_is_damage(
    saved: Saved, wider: Path, tmp_path: Path
) -> None:
    """Another model's tensors under a manifest that names this run's model, every hash right:
    skipped, naming the first tensor whose shape is not this model's."""
    directory = copy_of(saved, tmp_path)
    newest = directory / NEWEST
    shutil.rmtree(newest)
    shutil.copytree(wider, newest)
    manifest = read_manifest(newest)
    settings = {**manifest.settings, **lm_checkpoint.model_settings(CKPT_MODEL)}
    (newest / "manifest.json").write_bytes(manifest_json(manifest.step, manifest.files, settings))
    assert_falls_back(directory, "a lying manifest", "in its tensors, [256, 16] in this run's")


def test_a_manifest_that_hides_extra_tensors_is_damage(saved: Saved, tmp_path: Path) -> None:
    """This model's tensors and one more under the manifest (DCP would load the rest and say
    nothing): skipped, naming the tensor this run's model does not have."""
    directory = copy_of(saved, tmp_path)
    newest = directory / NEWEST
    metadata = FileSystemReader(newest).read_metadata()
    key = next(k for k in metadata.state_dict_metadata if k.startswith("exp_avg."))
    metadata.state_dict_metadata["exp_avg.blocks.2.extra"] = metadata.state_dict_metadata[key]
    (newest / ".metadata").write_bytes(pickle.dumps(metadata))
    manifest = read_manifest(newest)
    write_manifest(newest, manifest.step, list(manifest.files), manifest.settings)
    assert_falls_back(directory, "a manifest over extra tensors", "exp_avg.blocks.2.extra")


def test_a_checkpoint_of_another_model_is_refused_by_name_not_skipped(
    saved: Saved, wider: Path, tmp_path: Path
) -> None:
    directory = copy_of(saved, tmp_path)
    shutil.rmtree(directory / NEWEST)
    shutil.copytree(wider, directory / NEWEST)
    with pytest.raises(lm_checkpoint.CheckpointMismatch) as refused:
        lm_checkpoint.newest_valid(directory, CKPT_MODEL, print)
    message = str(refused.value)
    assert not isinstance(refused.value, lm_checkpoint.CheckpointDamaged), (
        f"a checkpoint of another model was taken for damage: {message}"
    )
    assert NEWEST in message and "model.width=32 in the checkpoint, 16 in this run" in message, (
        f"another model in {NEWEST}: expected a refusal naming the folder and model.width; "
        f"got {message!r}"
    )


def damage_both(directory: Path) -> None:
    flip_inside(WEIGHT)(directory / NEWEST)
    truncate("__1_0.distcp", keep=0.5)(directory / OLDER)


def test_with_every_checkpoint_damaged_the_run_refuses_in_one_line(
    saved: Saved, tmp_path: Path
) -> None:
    directory = copy_of(saved, tmp_path)
    damage_both(directory)
    lines: list[str] = []
    with pytest.raises(lm_checkpoint.CheckpointDamaged) as refused:
        lm_checkpoint.newest_valid(directory, CKPT_MODEL, lines.append)
    message = str(refused.value)
    expected = [str(directory), f"{NEWEST}: __0_0.distcp sha256 differs",
                f"{OLDER}: __1_0.distcp has"]  # fmt: skip
    assert "\n" not in message and all(part in message for part in expected), (
        f"every checkpoint damaged: expected one line naming {expected}; got {message!r}"
    )
    assert not lines, f"a refusal says it all in its one line; it also logged {lines}"


# ----------------------------------------------------------------------------- resuming


def resume_refusal(directory: str) -> str:
    """This rank's refusal when the run resumes from ``directory`` (or that it did not refuse)."""
    try:
        checkpointed_run(LAYOUT, 2, directory)
    except lm_checkpoint.CheckpointMismatch as err:
        return str(err)
    return "(no refusal: the run went on)"


def test_the_run_resumes_from_the_older_checkpoint_and_refuses_on_every_rank(
    saved: Saved, tmp_path: Path
) -> None:
    """The trainer itself, at dp2: a flipped weight in the newest checkpoint -> it resumes from
    step 2 and its steps 3-4 are the intact run's (resuming the damaged step 4 would run none);
    every checkpoint damaged -> every rank raises the same one-line refusal."""
    directory = copy_of(saved, tmp_path)
    flip_inside(WEIGHT)(directory / NEWEST)
    losses = run_world(checkpointed_run, 2, (LAYOUT, 2, str(directory)))[0]
    assert losses == pytest.approx(saved.losses[2:], rel=1e-10), (
        f"resumed past a flipped weight in {NEWEST}: steps {losses}, want the intact run's "
        f"steps 3-4 {saved.losses[2:]} (from {OLDER})"
    )
    assert lm_checkpoint.newest_valid(directory, CKPT_MODEL) == directory / NEWEST, (
        f"the resumed run's save of step 4 did not replace the damaged {NEWEST}"
    )
    damage_both(directory)
    refusals = run_world(resume_refusal, 2, (str(directory),))
    assert refusals[0] == refusals[1] and "no checkpoint verifies" in refusals[0], (
        f"every checkpoint damaged: expected the same refusal on both ranks; got {refusals}"
    )


@pytest.mark.torchrun
def test_under_torchrun_a_folder_of_damaged_checkpoints_is_refused_in_one_line(
    saved: Saved, tmp_path: Path
) -> None:
    """The framework's command line at dp2: exit 2, the refusal in one ``error:`` line naming
    the folder (said by rank 0, the other ranks as a backstop: course/cli.py, say_refusal), no
    traceback from any rank."""
    from course.torchrun_runner import run_torchrun

    directory = copy_of(saved, tmp_path)
    damage_both(directory)
    overrides = [
        "model.width=16", "model.heads=2", "model.layers=2", "model.ffn=32", "model.seq_len=8",
        "model.tied=true", "parallel.dp=2", "parallel.tp=1", "parallel.sequence_parallel=false",
        "train.batch=4", "train.epochs=2", "train.steps_per_epoch=2", "train.eval_batches=1",
        "train.sample_bytes=0", "precision=fp64", f"checkpoint.dir={directory}",
        "checkpoint.every=2",
    ]  # fmt: skip
    run = run_torchrun("solutions.phase4_production.lm.framework", ["--set", *overrides],
                       nproc_per_node=2, time_limit=60, fork_workers=True)  # fmt: skip
    what = f"lm_framework at dp2 over {directory} with every checkpoint damaged"
    assert not run.ok and not run.timed_out, f"{what}: expected a refusal; {run.describe(800)}"
    said = [line for log in run.ranks for line in log.stderr.splitlines()
            if "no checkpoint verifies" in line]  # fmt: skip
    assert said and all(
        line.startswith("error: checkpoint.dir") and str(directory) in line for line in said
    ), f"{what}: expected one 'error: checkpoint.dir {directory}: ...' line; {run.describe(800)}"
    for log in run.ranks:
        assert "Traceback" not in log.stderr, (
            f"{what}: rank {log.local_rank} printed a traceback, not one line: {log.stderr}"
        )
