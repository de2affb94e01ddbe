"""Grader of exercise 4.1, atomic and complete checkpoints: ``uv run pytest tests/test_phase4.py -m ex4_1``.

The checks break things on purpose: a write that dies half-way must leave the old file whole; a
newest checkpoint that is truncated, corrupted or unfinished must be skipped with a log line that
names it and why; the RNG states of two ranks must come back each to its own rank, through a
``torch.load(..., weights_only=True)``. The library way is checked beside it: FSDP2 state saved
with ``torch.distributed.checkpoint`` (also ``async_save``) by 2 ranks, loaded by 1 and by 4.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from grading import exercise, learner_line
from phase4_helpers import fail, module, world

ROOT = Path(__file__).resolve().parents[2]


def ckpt() -> Any:
    return module("checkpoint")


# ----------------------------------------------------------------------------- atomic files


class Boom(Exception):
    pass


def contents(path: Path) -> bytes | str:
    return path.read_bytes() if path.exists() else "no file at all"


@exercise("4.1")
def test_a_write_that_dies_half_way_leaves_the_old_file_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = ckpt()
    target = tmp_path / "state.pt"
    fsyncs: list[int] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        if not os.path.isdir(f"/proc/self/fd/{fd}"):  # the file's, not its directory's
            fsyncs.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    c.atomic_write(target, lambda f: f.write(b"old contents"))
    if contents(target) != b"old contents":
        fail(
            "4.1 atomic_write: after a successful write the file holds "
            f"{contents(target)!r}, not what was written (b'old contents')"
        )
    if not fsyncs:
        fail(
            "4.1 atomic_write: os.fsync was never called; flush and fsync the temporary file "
            "before the rename, or a power loss can leave the renamed file empty"
        )

    def dies_half_way(f: Any) -> None:
        f.write(b"new con")
        raise Boom("the process died while writing")

    try:
        c.atomic_write(target, dies_half_way)
    except Boom:
        pass
    else:
        fail(
            "4.1 atomic_write: write(f) raised half-way and atomic_write returned normally; the "
            "caller must learn that nothing was written: let the error go on once the "
            "temporary file is gone"
        )
    if contents(target) != b"old contents":
        fail(
            "4.1 atomic_write: a write that failed half-way left "
            f"{contents(target)!r} where b'old contents' was; write a temporary file next to "
            "it and os.replace it onto the path only when complete"
        )
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name != "state.pt")
    if leftovers:
        fail(f"4.1 atomic_write: a failed write left {leftovers} behind; remove the temporary file")


@exercise("4.1")
def test_the_temporary_file_is_renamed_in_the_same_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = ckpt()
    target = tmp_path / "sub" / "state.pt"
    target.parent.mkdir()
    renames: list[tuple[str, str]] = []
    real_replace = os.replace

    def recording_replace(a: str, b: str) -> None:
        renames.append((str(a), str(b)))
        real_replace(a, b)

    monkeypatch.setattr(os, "replace", recording_replace)
    c.atomic_save({"w": torch.arange(3)}, target)
    if not renames or Path(renames[-1][1]) != target:
        fail("4.1 atomic_save: the file was not put in place with os.replace(tmp, path)")
    if Path(renames[-1][0]).parent != target.parent:
        fail(
            f"4.1 atomic_write: the temporary file {renames[-1][0]} is not in {target.parent}; a "
            "rename is atomic only within one filesystem, so keep it in the same directory"
        )
    if not torch.equal(torch.load(target, weights_only=True)["w"], torch.arange(3)):
        fail("4.1 atomic_save: the saved file does not load back to what was saved")


@exercise("4.1")
def test_the_bytes_are_on_the_disk_before_the_rename_and_the_rename_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a power loss would see: the grader records, in order, every os.fsync (of a file: how
    many bytes the file held then; of a folder) and every os.replace of one atomic_write."""
    c = ckpt()
    target = tmp_path / "state.pt"
    data = b"x" * 1000  # less than Python's buffer: unflushed, it is still inside the process
    events: list[tuple[str, str, int]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def recording_fsync(fd: int) -> None:
        where = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.isdir(where):
            events.append(("fsync folder", where, 0))
        else:
            events.append(("fsync file", where, os.fstat(fd).st_size))
        real_fsync(fd)

    def recording_replace(a: str, b: str) -> None:
        events.append(("replace", str(a), 0))
        events.append(("replaced onto", str(b), 0))
        real_replace(a, b)

    def writing(f: Any) -> None:
        f.write(data)
        events.append(("wrote", "", 0))  # write(f) has returned: the bytes are in Python's hands

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    c.atomic_write(target, writing)
    problem = durability_problem(events, target, len(data))
    if problem:
        fail(problem)


Event = tuple[str, str, int]  # ("fsync file" / "fsync folder" / "replace" / ..., path, size)


def durability_problem(events: list[Event], target: Path, nbytes: int) -> str | None:
    """What a power loss would find wrong in one atomic_write's recorded fsyncs and renames,
    ``nbytes`` written to ``target``. The one cause named, why a file fsync saw too few bytes
    (an fsync before write(f) wrote them, or the bytes unflushed in Python's buffer), is named
    only when it is the only problem; with others, each is described."""
    seen = "; ".join(f"{what} {Path(where).name}".strip() for what, where, _ in events) or "none"
    onto = [i for i, (what, where, _) in enumerate(events) if what == "replaced onto"]
    if not onto or Path(events[onto[-1]][1]) != target:
        return (
            f"4.1 atomic_write: the file never reached {target.name} through os.replace (the "
            f"grader saw: {seen})"
        )
    rename = onto[-1] - 1
    temporary = events[rename][1]
    wrote = next((i for i, (what, _, _) in enumerate(events) if what == "wrote"), len(events))
    before = [
        (i, size) for i, (what, _, size) in enumerate(events[:rename]) if what == "fsync file"
    ]
    after = [what for what, _, _ in events[rename:] if what == "fsync file"]
    problems: list[tuple[str, str]] = []  # (described, named): named is said when alone
    if not before:
        when = (
            "made durable (os.fsync) only after the rename"
            if after
            else "never made durable (os.fsync)"
        )
        said = (
            f"the temporary file {Path(temporary).name} was {when}. Until then its bytes may sit "
            f"in the page cache only: a power loss after the rename leaves {target.name} "
            "pointing at an empty or partial file"
        )
        problems.append((said, said))
    elif max(size for _, size in before) != nbytes:
        held = max(size for _, size in before)
        described = (
            f"os.fsync ran when the temporary file held {held} of the {nbytes} bytes written"
        )
        if all(i < wrote for i, _ in before):
            named = (
                f"{described}: every fsync of it came before write(f) wrote them; fsync after "
                "the write"
            )
        else:
            named = (
                f"{described}; the others were still in Python's own buffer, which os.fsync "
                "does not see (it makes durable what the operating system holds): flush first"
            )
        problems.append((described, named))
    folder = [
        i
        for i, (what, where, _) in enumerate(events)
        if what == "fsync folder" and Path(where) == target.parent
    ]
    if not any(i > rename for i in folder):
        ahead = " (its fsync came before the rename, which changes it)" if folder else ""
        said = (
            f"after the rename nothing made it durable: a rename changes the folder "
            f"{target.parent.name}{ahead}, and until that folder is fsynced after it a power "
            "loss can bring back the old name"
        )
        problems.append((said, said))
    if not problems:
        return None
    if len(problems) == 1:
        return f"4.1 atomic_write: {problems[0][1]} (the grader saw: {seen})"
    listed = "; ".join(f"({n}) {d}" for n, (d, _) in enumerate(problems, 1))
    return f"4.1 atomic_write: {len(problems)} problems: {listed} (the grader saw: {seen})"


# ----------------------------------------------------------------------------- manifest, fallback


def save_three(c: Any, root: Path, logs: list[str]) -> Any:
    manager = c.CheckpointManager(root, keep=3, log=logs.append)
    for step in (10, 20, 30, 40):
        manager.save(step, {"state.pt": {"step": step, "w": torch.full((256,), float(step))}})
    return manager


@exercise("4.1")
def test_the_manifest_is_written_last_and_only_the_newest_k_are_kept(tmp_path: Path) -> None:
    c = ckpt()
    manager = save_three(c, tmp_path, [])
    names = [p.name for p in manager.checkpoints()]
    if names != ["step_00000020", "step_00000030", "step_00000040"]:
        fail(
            f"4.1 CheckpointManager(keep=3) after saving steps 10..40 left {names}; expected 20, 30, 40"
        )
    newest = tmp_path / "step_00000040"
    manifest = json.loads((newest / "manifest.json").read_text())
    entry = manifest["files"]["state.pt"]
    if entry["sha256"] != c.sha256_file(newest / "state.pt"):
        fail("4.1: the manifest's sha256 of state.pt is not the file's")
    if c.verify_checkpoint(newest) is not None:
        fail(
            f"4.1 verify_checkpoint: an intact checkpoint was refused: {c.verify_checkpoint(newest)!r}"
        )


DAMAGES = {  # what the grader did to step_00000040, in the words of the file system
    "truncate": "state.pt holds 100 bytes fewer than its manifest lists",
    "corrupt": "state.pt has the listed size, one byte in its middle changed",
    "no-manifest": "the folder has no manifest.json",
    "missing": "the manifest lists state.pt, the folder has no such file",
}


@exercise("4.1")
@pytest.mark.parametrize(
    "damage, reason",
    [
        ("truncate", "truncated"),
        ("corrupt", "corrupted"),
        ("no-manifest", "did not finish"),
        ("missing", "missing"),
    ],
)
def test_a_damaged_newest_checkpoint_is_skipped_with_a_reason(
    tmp_path: Path, damage: str, reason: str
) -> None:
    c = ckpt()
    logs: list[str] = []
    manager = save_three(c, tmp_path, logs)
    newest = tmp_path / "step_00000040"
    state = newest / "state.pt"
    if damage == "truncate":
        state.write_bytes(state.read_bytes()[:-100])
    elif damage == "corrupt":
        data = bytearray(state.read_bytes())
        data[len(data) // 2] ^= 0xFF
        state.write_bytes(bytes(data))
    elif damage == "no-manifest":
        (newest / "manifest.json").unlink()
    else:
        state.unlink()
    logs.clear()
    chosen = manager.latest_valid()
    if chosen is None or chosen.name != "step_00000030":
        got = None if chosen is None else chosen.name
        fail(
            f"4.1 latest_valid with a {damage} newest checkpoint returned {got}; expected "
            "step_00000030, the newest one that verifies"
        )
    named = [line for line in logs if "step_00000040" in line]
    if not named or reason not in named[0]:
        fail(
            f"4.1 latest_valid: skipping the {damage} step_00000040 should log one line naming "
            f"it and the reason (containing {reason!r}: {DAMAGES[damage]}); the log was {logs}"
        )
    for path in manager.checkpoints():
        (path / "manifest.json").unlink(missing_ok=True)
    try:
        left = manager.latest_valid()
    except Exception as err:  # the finding
        fail(
            f"4.1 latest_valid raised {type(err).__name__}: {err}{learner_line(err)} with no "
            "complete checkpoint left; it must return None (a fresh start, not a crash)"
        )
    if left is not None:
        fail(
            f"4.1 latest_valid: with no complete checkpoint left it returned {left.name}; it "
            "must return None"
        )


# ----------------------------------------------------------------------------- per-rank RNG


def draws() -> list[float]:
    return [
        *torch.rand(3).tolist(),
        *np.random.rand(3).tolist(),
        *[random.random() for _ in range(3)],
        random.gauss(0, 1),
    ]


def plain(value: object) -> bool:
    """What ``torch.load(weights_only=True)`` reads back: tensors, numbers, strings, None, and
    lists of tensors."""
    if isinstance(value, list):
        return all(isinstance(v, torch.Tensor) for v in value)
    return value is None or isinstance(value, torch.Tensor | bool | int | float | str)


def rng_worker(path: str) -> dict[str, Any]:
    c = ckpt()
    rank = dist.get_rank()
    torch.manual_seed(100 + rank)
    np.random.seed(200 + rank)
    random.seed(300 + rank)
    random.gauss(0, 1)  # leaves a cached Gaussian in Python's state
    mine = c.capture_rng(rank)
    expected = draws()
    missing = [
        k for k in ("torch_cpu", "numpy_keys", "python_internal") if f"rank{rank}/{k}" not in mine
    ]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    merged = {k: v for states in gathered for k, v in states.items()}
    if rank == 0:
        torch.save(merged, path)
    dist.barrier()
    try:
        loaded = torch.load(path, weights_only=True)  # refuses anything but tensors and numbers
    except pickle.UnpicklingError:
        foreign = sorted(f"{k} ({type(v).__name__})" for k, v in mine.items() if not plain(v))
        return {"keys": sorted(mine), "missing": missing, "error": None, "refused": foreign}
    draws()  # move every generator on
    try:
        c.restore_rng(loaded, rank)
    except KeyError as err:
        return {"keys": sorted(mine), "missing": missing, "error": f"KeyError {err}"}
    again = draws()
    try:
        c.restore_rng({k: v for k, v in loaded.items() if k.startswith("rank0/")}, 1)
        other = "no error"
    except KeyError as err:
        other = f"KeyError {err}"
    return {
        "keys": sorted(mine),
        "missing": missing,
        "error": None,
        "expected": expected,
        "again": again,
        "other": other,
    }


@exercise("4.1")
def test_each_ranks_rng_comes_back_from_its_own_keys_through_weights_only(tmp_path: Path) -> None:
    results = world(rng_worker, 2, str(tmp_path / "rng.pt"))
    for rank, result in enumerate(results):  # every rank's keys first: a capture under another
        wrong = [k for k in result["keys"] if not k.startswith(f"rank{rank}/")]  # rank's keys
        if wrong or not result["keys"]:  # makes the restore of the rank it collides with fail
            fail(
                f"4.1 capture_rng({rank}) returned keys {result['keys']}; every key must start "
                f"with 'rank{rank}/' so two ranks' states can share one file"
            )
    for rank, result in enumerate(results):
        if "refused" in result:
            fail(
                f"4.1 capture_rng({rank}): torch.load(weights_only=True) refused the file of "
                "both ranks' states. It reads back tensors, numbers, strings, None and lists of "
                f"tensors; capture_rng returned {', '.join(result['refused']) or 'other objects'}"
            )
    for rank, result in enumerate(results):
        if result["missing"] or result["error"]:
            fail(
                f"4.1 capture_rng({rank}) lacks {result['missing']} (restore_rng raised "
                f"{result['error']}); capture every generator: torch CPU and CUDA, NumPy "
                "(rng_state.numpy_state) and Python (rng_state.python_state)"
            )
        if result["again"] != result["expected"]:
            got = ", ".join(f"{v:.4f}" for v in result["again"][:4])
            want = ", ".join(f"{v:.4f}" for v in result["expected"][:4])
            fail(
                f"4.1 restore_rng on rank {rank}: after the restore the generators drew "
                f"{got}, ...; the saved state draws {want}, ...; restore this rank's own keys "
                "(rank<r>/...) into every generator: torch CPU and CUDA, NumPy, Python"
            )
    if not results[1]["other"].startswith("KeyError"):
        fail(
            "4.1 restore_rng(states holding only rank 0's keys, rank=1) did not raise KeyError; a "
            "rank must never take another rank's generator states"
        )


RNG_RANKS = 12  # rank 1's prefix 'rank1' also selects rank10's and rank11's keys
RNG_ORDERS = {  # how the merged file lists the ranks' keys
    "rank 0 first": tuple(range(RNG_RANKS)),
    "rank 11 first": tuple(range(RNG_RANKS - 1, -1, -1)),
}


def rng_restore_verdict(order: str, rank: int, took: list[int]) -> str:
    """The failure for restore_rng(the states of 12 ranks, ``order``, rank) that restored the
    states of the ranks ``took`` (whose saved draws it drew). The prefix without its slash is
    named only when the rank restored is one that prefix also matches, the first or the last
    of them in the file as the order says."""
    told = f"rank {took[0]}'s states" if took else "states of no single rank"
    head = (
        f"4.1 restore_rng(the states of 12 ranks, {order} in the file, rank={rank}) restored {told}"
    )
    matching = [r for r in RNG_ORDERS[order] if f"rank{r}".startswith(f"rank{rank}")]
    if len(took) == 1 and took[0] != rank and took[0] in matching:
        which = "last" if took[0] == matching[-1] else "first" if took[0] == matching[0] else "a"
        others = ", ".join(f"rank{r}/" for r in matching if r != rank)
        return (
            f"{head}: its prefix 'rank{rank}' without the slash also matches {others}, and the "
            f"{which} of them in the file won. Select exactly this rank's keys: the prefix "
            f"'rank{rank}/' with its slash"
        )
    return (
        f"{head}. Select exactly this rank's keys, the prefix 'rank{rank}/', and restore every "
        "generator from them: torch CPU and CUDA, NumPy, Python"
    )


def seeded_capture(c: Any, rank: int) -> tuple[dict[str, Any], list[float]]:
    """Rank ``rank``'s generators seeded apart from every other rank's: its capture and the
    draws that state gives."""
    torch.manual_seed(1000 + rank)
    np.random.seed(2000 + rank)
    random.seed(3000 + rank)
    return c.capture_rng(rank), draws()


@exercise("4.1")
def test_rng_keys_of_12_ranks_never_mix_ranks() -> None:
    """Rank 1's prefix must not also select rank 10's and rank 11's keys: seen only at 11+ ranks."""
    c = ckpt()
    saved = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    try:
        states: dict[str, Any] = {}
        expected: dict[int, list[float]] = {}
        for rank in range(RNG_RANKS):
            mine, expected[rank] = seeded_capture(c, rank)
            wrong = sorted(k for k in mine if not k.startswith(f"rank{rank}/"))
            if wrong or not mine:
                fail(
                    f"4.1 capture_rng({rank}) returned keys {wrong[:3] or sorted(mine)}; every "
                    f"key must start with 'rank{rank}/' (its rank, then a slash) so that 12 "
                    "ranks' states can share one file"
                )
            states.update(mine)
        for order, ranks in RNG_ORDERS.items():
            merged = {k: v for r in ranks for k, v in states.items() if k.startswith(f"rank{r}/")}
            for rank in range(RNG_RANKS):
                draws()  # move every generator on
                c.restore_rng(merged, rank)
                got = draws()
                if got == expected[rank]:
                    continue
                took = [r for r, want in expected.items() if want == got]
                fail(rng_restore_verdict(order, rank, took))
    finally:
        torch.set_rng_state(saved[0])
        np.random.set_state(saved[1])
        random.setstate(saved[2])


# ----------------------------------------------------------------------------- no pickles


@exercise("4.1")
@pytest.mark.reference
def test_no_file_of_the_project_loads_with_weights_only_false() -> None:
    pattern = re.compile(r"weights_only\s*=\s*False")
    found = []
    for folder in ("solutions", "tests", "notebooks", *[p.name for p in ROOT.glob("phase*_*")]):
        for path in (ROOT / folder).rglob("*.py"):
            if pattern.search(path.read_text(errors="replace")):
                found.append(str(path.relative_to(ROOT)))
    found = [f for f in found if f != "tests/phase4/grade_4_1_checkpoint.py"]
    if found:
        fail(f"weights_only=False appears in {found}: store tensors and numbers instead")


# ----------------------------------------------------------------------------- the library way


def dcp_save_worker(path: str) -> dict[str, dict[str, torch.Tensor]]:
    import solutions.phase4_production.library.sharded_checkpoint as sharded

    model, optimizer = sharded.build_sharded(seed=0)
    sharded.train_steps(model, optimizer, steps=2)
    sharded.save(model, optimizer, path + "/sync")
    sharded.save(model, optimizer, path + "/async", use_async=True)
    saved = sharded.full_model_state(model)
    sharded.train_steps(model, optimizer, steps=1)  # what the loaded worlds' next step must give
    return {"saved": saved, "after": sharded.full_model_state(model)}


def dcp_load_worker(path: str) -> dict[str, Any]:
    import solutions.phase4_production.library.sharded_checkpoint as sharded

    model, optimizer = sharded.build_sharded(seed=1)  # different weights before the load
    sharded.load(model, optimizer, path)
    full = sharded.full_model_state(model)
    local = sum(p.to_local().numel() for p in model.parameters())  # type: ignore[attr-defined]
    total = sum(p.numel() for p in model.parameters())
    # the optimizer state came back too: one more step matches the saving world's next step
    sharded.train_steps(model, optimizer, steps=1)
    return {"full": full, "local": local, "total": total, "after": sharded.full_model_state(model)}


@exercise("4.1")
@pytest.mark.reference
def test_dcp_state_saved_by_2_ranks_loads_resharded_at_1_and_4(tmp_path: Path) -> None:
    """The library way: FSDP2 shards saved with dcp.save and dcp.async_save by a world of 2;
    the first loaded by a world of 1, the second by a world of 4."""
    path = str(tmp_path / "dcp")
    reference = world(dcp_save_worker, 2, path)[0]
    for world_size, kind in ((1, "sync"), (4, "async")):
        results = world(dcp_load_worker, world_size, f"{path}/{kind}")
        label = f"DCP ({kind} save at world 2, loaded at world {world_size})"
        for rank, result in enumerate(results):
            for name, tensor in reference["saved"].items():
                if not torch.equal(result["full"][name], tensor):
                    fail(f"{label}: {name} differs from what was saved")
            if world_size > 1 and result["local"] >= result["total"]:
                fail(f"{label}: rank {rank} holds every parameter, not a shard")
            for name, tensor in reference["after"].items():
                if not torch.allclose(result["after"][name], tensor, rtol=1e-5, atol=1e-6):
                    fail(
                        f"{label}: one step after the load, {name} differs from world 2's next "
                        "step: the optimizer state was not resharded with the model"
                    )


def benchmark_worker(impl_args: list[str]) -> int:
    import solutions.phase4_production.benchmarks.checkpoint as bench

    args = ["--width", "64", "--layers", "2", "--saves", "2", "--steps", "1"]
    return int(bench.main([*args, *impl_args]))


@exercise("4.1")
def test_the_checkpoint_benchmark_runs_on_two_ranks(tmp_path: Path) -> None:
    """The benchmark times your CheckpointManager too (--impl templates)."""
    from grading import impl

    # only rank 0 writes: an unwritten TODO there would surface as rank 1's broken barrier
    ckpt().CheckpointManager(tmp_path).save(1, {"probe.pt": torch.zeros(1)})
    codes = world(benchmark_worker, 2, ["--impl", impl()])
    if codes != [0, 0]:
        fail(f"4.1: benchmark_checkpoint exited with {codes} on 2 ranks; expected [0, 0]")
