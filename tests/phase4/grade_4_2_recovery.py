"""Grader of exercise 4.2, automatic recovery: ``uv run pytest tests/test_phase4.py -m ex4_2``.

The reference is the trainer (solutions/phase4_production/resilience/trainer.py) run once without
failures in a forked world of 2. Every recovered run must end with the same weights, bit for bit
(``torch.equal`` on CPU): resumed in a fresh world from a mid-epoch checkpoint; under real
``torchrun --max-restarts`` after a SIGKILL, an exception and a hang (one after the other, the
i-th failure on attempt i); after a rank is killed while a checkpoint is being written (that
checkpoint must be skipped, the previous one used). With ``--max-restarts=0`` a failure must end
the run with a non-zero status and a clear message. No process may outlive a scenario.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from grading import exercise, learner_line
from phase4_helpers import (
    compare_weights,
    config,
    fail,
    final_weights,
    lines_with,
    module,
    no_survivors,
    rank_text,
    tail,
    torchrun_trainer,
    train_in_world,
    world,
)

from course.training import StepEvent, StepOutput

_REFERENCE: dict[str, Any] = {}


def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The uninterrupted run's final weights (computed once per session)."""
    if "weights" not in _REFERENCE:
        directory = tmp_path_factory.mktemp("uninterrupted")
        _REFERENCE["weights"] = train_in_world(config(directory), 2)
        _REFERENCE["final"] = torch.load(
            sorted(directory.glob("step_*"))[-1] / "train_state.pt", weights_only=True
        )
    return _REFERENCE["weights"]


def event(epoch: int, step: int) -> StepEvent:
    return StepEvent(epoch, 0, step, StepOutput(0.0, 8))


def _resume_probe(directory: str) -> None:
    fault, ckpt = module("fault_tolerance"), module("checkpoint")
    model = torch.nn.Linear(2, 2)
    state = fault.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    fault.resume(ckpt.CheckpointManager(directory), state)


def probe_recovery(tmp_path: Path) -> None:
    """The exercise's functions, quickly: an unwritten TODO stops the test here, not in torchrun."""
    fault = module("fault_tolerance")
    fault.advance(fault.Progress(), event(0, 1), 32, 512)
    world(_resume_probe, 1, str(tmp_path / "probe"))


# ----------------------------------------------------------------------------- progress


@exercise("4.2")
def test_advance_counts_samples_and_rolls_over_at_the_end_of_an_epoch() -> None:
    fault = module("fault_tolerance")
    p = fault.Progress()
    seen = []
    for step in range(1, 5):  # 4 steps of 32 samples make an epoch of 128
        p = fault.advance(p, event(0, step), 32, 128)
        seen.append((p.epoch, p.position, p.global_step))
    want = [(0, 32, 1), (0, 64, 2), (0, 96, 3), (1, 0, 4)]
    if seen != want:
        fail(
            f"4.2 advance over one epoch of 4 steps x 32 samples gave (epoch, position, step) "
            f"{seen}; expected {want}: a finished epoch resumes at the next one, position 0"
        )
    p = fault.advance(fault.Progress(1, 0, 4), event(1, 5), 32, 128)
    if (p.epoch, p.position, p.global_step) != (1, 32, 5):
        fail(
            f"4.2 advance into epoch 1: got {p}, expected Progress(epoch=1, position=32, global_step=5)"
        )
    p = fault.advance(fault.Progress(0, 96, 3), event(1, 4), 32, 128)
    if (p.epoch, p.position, p.global_step) != (1, 32, 4):
        fail(
            f"4.2 advance(Progress(epoch=0, position=96, ...), a step of epoch 1) gave {p}; "
            "expected Progress(epoch=1, position=32, global_step=4): epoch 0 ended before its "
            "count reached epoch_samples (a loader that drops its last partial batch), and a "
            "step of a new epoch starts a new count"
        )


# ----------------------------------------------------------------------------- in a forked world


@exercise("4.2")
def test_a_fresh_world_resumed_mid_epoch_ends_bitwise_equal(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    want = reference(tmp_path_factory)
    directory = tmp_path / "ckpt"
    train_in_world(config(directory), 2)
    for path in sorted(directory.glob("step_*")):
        if int(path.name[5:]) > 15:  # step 15 is mid-epoch 0 (16 steps per epoch)
            shutil.rmtree(path)
    got = train_in_world(config(directory), 2)
    what = "4.2 resumed from step 15 (mid-epoch 0) in a fresh world"
    final = torch.load(sorted(directory.glob("step_*"))[-1] / "train_state.pt", weights_only=True)
    for key in ("scheduler", "scaler", "progress"):
        if final[key] != _REFERENCE["final"][key]:
            fail(
                f"{what}: the final {key} state is {final[key]}, the uninterrupted run's is "
                f"{_REFERENCE['final'][key]}; resume must restore it too (TrainState.load_state_dicts)"
            )
    compare_weights(got, want, what)
    model, progress = final_weights(directory)
    compare_weights(model, want, "4.2 the final checkpoint")
    if progress["global_step"] != 32:
        fail(f"4.2: the final checkpoint says global step {progress['global_step']}, expected 32")


def _saved_linear(step: int) -> dict[str, Any]:
    """What the trainer would save at ``step`` for a Linear(2, 2): weights equal to ``step``."""
    ckpt = module("checkpoint")
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": None,
        "scaler": None,
        "progress": {"epoch": 0, "position": 8 * step, "global_step": step},
        "world_size": 2,
        "rng": {**ckpt.capture_rng(0), **ckpt.capture_rng(1)},
    }


def _stale_view_worker(directory: str) -> dict[str, Any]:
    """Rank 1 looked at the folder before step 10 was complete: its own latest_valid is older."""
    import torch.distributed as dist

    fault, ckpt = module("fault_tolerance"), module("checkpoint")

    class StaleView(ckpt.CheckpointManager):  # type: ignore[name-defined]
        def latest_valid(self) -> Path | None:
            return self.path_for(5)

    rank = dist.get_rank()
    manager = ckpt.CheckpointManager(directory) if rank == 0 else StaleView(directory)
    model = torch.nn.Linear(2, 2)
    state = fault.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    resumed = fault.resume(manager, state)
    return {"step": resumed.progress.global_step, "weight": float(model.weight[0, 0])}


@exercise("4.2")
def test_every_rank_resumes_from_the_checkpoint_rank_0_chose(tmp_path: Path) -> None:
    ckpt = module("checkpoint")
    manager = ckpt.CheckpointManager(tmp_path, keep=5)
    for step in (5, 10):
        manager.save(step, {"train_state.pt": _saved_linear(step)})
    got = world(_stale_view_worker, 2, str(tmp_path))
    steps = [r["step"] for r in got]
    if steps != [10, 10] or [r["weight"] for r in got] != [10.0, 10.0]:
        fail(
            f"4.2 resume: the ranks resumed from steps {steps} (weights "
            f"{[r['weight'] for r in got]}); rank 0's latest_valid() is step 10, rank 1's own "
            "look at the folder says step 5 (a checkpoint completed between two looks). Every "
            "rank must load the checkpoint rank 0 chose: rank 0 asks latest_valid() and "
            "broadcasts its step, the others take that step, not their own look"
        )


SUBGROUP_STEPS = {0: (5, 10), 1: (7, 12)}  # each group's checkpoints, in a folder of its own


def _seeded_states(rank: int) -> tuple[dict[str, Any], list[float]]:
    """Rank ``rank``'s generators seeded apart from the others': their capture and what torch
    draws next from that state."""
    ckpt = module("checkpoint")
    torch.manual_seed(500 + rank)
    np.random.seed(600 + rank)
    random.seed(700 + rank)
    return ckpt.capture_rng(rank), torch.rand(3).tolist()


def _subgroup_worker(root: str, draws: dict[int, list[float]]) -> dict[str, Any]:
    """Groups (0, 1) and (2, 3), each with its own checkpoints; each group's rank 1 looked at
    the folder before the newest was complete."""
    from subgroups import split_into_groups

    fault, ckpt = module("fault_tolerance"), module("checkpoint")
    info = split_into_groups(2)
    older = SUBGROUP_STEPS[info.index][0]

    class StaleView(ckpt.CheckpointManager):  # type: ignore[name-defined]
        def latest_valid(self) -> Path | None:
            return self.path_for(older)

    directory = Path(root) / f"group{info.index}"
    manager = ckpt.CheckpointManager(directory) if info.group_rank == 0 else StaleView(directory)
    model = torch.nn.Linear(2, 2)
    state = fault.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        resumed = fault.resume(manager, state, group=info.group)
    except Exception as err:  # the finding: reported by the test, with the group
        return {"ranks": info.ranks, "error": f"{type(err).__name__}: {err}{learner_line(err)}"}
    drawn = torch.rand(3).tolist()
    took = [r for r, want in draws.items() if want == drawn]
    return {
        "ranks": info.ranks,
        "error": None,
        "step": resumed.progress.global_step,
        "took": took,
    }


@exercise("4.2")
def test_resume_on_a_subgroup_takes_its_rank_0s_choice_and_each_ranks_own_generators(
    tmp_path: Path,
) -> None:
    ckpt = module("checkpoint")
    saved_rng = (torch.get_rng_state(), np.random.get_state(), random.getstate())
    try:
        states, draws = {}, {}
        for rank in range(4):
            mine, draws[rank] = _seeded_states(rank)
            states.update(mine)
    finally:
        torch.set_rng_state(saved_rng[0])
        np.random.set_state(saved_rng[1])
        random.setstate(saved_rng[2])
    for index, steps in SUBGROUP_STEPS.items():
        manager = ckpt.CheckpointManager(tmp_path / f"group{index}", keep=5)
        ranks = (2 * index, 2 * index + 1)
        for step in steps:
            saved = _saved_linear(step)
            saved["rng"] = {
                k: v for k, v in states.items() if k.split("/")[0] in {f"rank{r}" for r in ranks}
            }
            manager.save(step, {"train_state.pt": saved})
    got = world(_subgroup_worker, 4, str(tmp_path), draws)
    what = (
        "4.2 resume(manager, state, group=) in a world of 4 split into the groups (0, 1) and (2, 3)"
    )
    verdict = subgroup_resume_verdict(got, what)
    if verdict:
        fail(verdict)


def subgroup_resume_verdict(got: list[dict[str, Any]], what: str) -> str | None:
    """The failure for what each rank of the groups (0, 1) and (2, 3) reported after resume: an
    error, the step it resumed from, whose generators it drew from. A cause is named only when
    every finding points at it (the group's rank in a missing key or a drawn state, a source
    outside the group, the step of its own stale look); else the findings are listed."""
    findings: list[tuple[str | None, str, str]] = []  # (cause, the words naming it, the fact)
    for rank, result in enumerate(got):
        group_rank, error = rank % 2, result["error"]
        me = f"rank {rank} (rank {group_rank} of group {result['ranks']})"
        if error:
            fact = f"{me} raised {error}"
            said = error.split(" (at ")[0]  # the error's words, without the learner's line
            looked_for = re.search(rf"rank ?{group_rank}(?!\d)", said)
            if said.startswith("KeyError") and rank != group_rank and looked_for:
                findings.append(
                    (
                        "rng by group rank",
                        f"{fact}. It looked for rank {group_rank}'s states, its rank in the group: "
                        "the checkpoint keeps every rank's generator states under its global rank "
                        f"(the trainer's gather_rng), and the file of this group holds ranks "
                        f"{result['ranks']}: restore this process's own",
                        fact,
                    )
                )
            elif "is not part of group" in error:
                findings.append(
                    (
                        "src as group rank",
                        f"{fact}. On a subgroup, a collective's src names a global rank: the group's "
                        f"rank 0 is global rank {result['ranks'][0]} there",
                        fact,
                    )
                )
            else:
                findings.append(
                    (
                        None,
                        f"{fact}. resume(..., group=) must work on a subgroup as on the whole world: "
                        "group= to every collective, global ranks where torch asks for a rank",
                        fact,
                    )
                )
            continue
        older, newest = SUBGROUP_STEPS[rank // 2]
        if result["step"] != newest:
            fact = (
                f"{me} resumed from step {result['step']}; its group's rank 0 chose step {newest}"
            )
            if result["step"] == older:
                findings.append(
                    (
                        "own look",
                        f"{fact}: that is its own look at the folder (an older one, in this test): "
                        "every rank of a group must take the choice of the group's rank 0",
                        fact,
                    )
                )
            else:
                findings.append((None, f"{fact}, a step no rank of its group chose", fact))
        if result["took"] != [rank]:
            told = f"rank {result['took'][0]}'s" if result["took"] else "no saved rank's"
            fact = f"{me} drew after resume what {told} saved generators draw"
            rule = (
                ". The checkpoint keeps every rank's states under its global rank (the "
                "trainer's gather_rng): restore this process's own"
            )
            if result["took"] == [group_rank] and rank != group_rank:
                findings.append(
                    (
                        "rng by group rank",
                        f"{fact} (its rank in the group, not its global rank {rank}){rule}",
                        fact,
                    )
                )
            else:
                findings.append((None, fact + rule, fact))
    if not findings:
        return None
    causes = {cause for cause, _, _ in findings}
    if len(findings) == 1 or (len(causes) == 1 and None not in causes):
        return f"{what}: {findings[0][1]}"
    return (
        f"{what}: more than one thing differs from a resume that takes the group's rank 0's "
        "choice and this process's own generators: " + "; ".join(f for _, _, f in findings[:5])
    )


# ----------------------------------------------------------------------------- under torchrun


@exercise("4.2")
@pytest.mark.torchrun
def test_kill_then_exception_then_hang_each_recovered_bitwise(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    probe_recovery(tmp_path)
    want = reference(tmp_path_factory)
    chain = "kill:rank=1:step=6,raise:rank=0:step=13,hang:rank=1:step=17"
    cfg = config(tmp_path / "ckpt", fail=chain, collective_timeout=4.0)
    run = torchrun_trainer(cfg, max_restarts=3, time_limit=75)
    what = f"4.2 torchrun --max-restarts=3 with --fail {chain}"
    if not run.ok or run.attempts() != [0, 1, 2, 3]:
        fail(f"{what}: expected 4 attempts and exit 0, got attempts {run.attempts()}{tail(run)}")
    for attempt, step in ((1, 5), (2, 10), (3, 15)):
        text = rank_text(run, attempt=attempt)
        if f"resumed from step_{step:08d}" not in text:
            fail(
                f"{what}: attempt {attempt} should resume from step_{step:08d}, the newest "
                f"checkpoint before the failure (every 5 steps){tail(run)}"
            )
    if not lines_with(run, "Timed out") and not lines_with(run, "timed out"):
        fail(f"{what}: the hang was not ended by the collective timeout{tail(run)}")
    model, _ = final_weights(tmp_path / "ckpt")
    compare_weights(model, want, f"{what}: final weights")
    no_survivors(run, what)


@exercise("4.2")
@pytest.mark.torchrun
def test_a_kill_during_a_checkpoint_write_falls_back_to_the_previous_one(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    probe_recovery(tmp_path)
    want = reference(tmp_path_factory)
    cfg = config(tmp_path / "ckpt", fail="kill:rank=0:step=10", fail_during_save=True)
    run = torchrun_trainer(cfg, max_restarts=1, time_limit=60)
    what = "4.2 rank 0 killed while writing checkpoint step 10"
    if not run.ok:
        fail(f"{what}: the run did not recover{tail(run)}")
    text = rank_text(run, attempt=1)
    if "step_00000010 skipped" not in text or "resumed from step_00000005" not in text:
        fail(
            f"{what}: the restart should log that step_00000010 was skipped (no manifest) and "
            f"resume from step_00000005{tail(run)}"
        )
    model, _ = final_weights(tmp_path / "ckpt")
    compare_weights(model, want, f"{what}: final weights")
    no_survivors(run, what)


@exercise("4.2")
@pytest.mark.torchrun
def test_without_restarts_a_failure_ends_the_run_non_zero_with_a_clear_message(
    tmp_path: Path,
) -> None:
    probe_recovery(tmp_path)
    cfg = config(tmp_path / "ckpt", fail="raise:rank=0:step=3")
    run = torchrun_trainer(cfg, nproc_per_node=1, max_restarts=0, time_limit=45)
    what = "4.2 torchrun --max-restarts=0 with an exception at step 3"
    if run.timed_out or run.agents[0].returncode in (0, None):
        fail(f"{what}: expected a non-zero exit, got {run.agents[0].returncode}{tail(run)}")
    if not lines_with(run, "no restarts left (--max-restarts=0"):
        fail(f"{what}: the failing rank should say there are no restarts left{tail(run)}")
    no_survivors(run, what)
