"""Shared pieces of the phase 4 graders (tests/phase4/grade_4_*.py): the code under test, short
failures, the trainer run in a forked world (the uninterrupted reference) and under real
torchrun agents (restarts, elastic membership), and the checks on what they leave behind.

A torchrun scenario takes 10-40 s, so before one starts, :func:`probe` calls the exercise's
functions in-process: an unwritten TODO is then reported at once, as the TODO, instead of after a
scenario in which every worker printed "TODO 4.x not written".
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

import pytest
import torch
import torch.distributed as dist
from grading import assert_bitwise_equal, impl, load, world

from course.torchrun_runner import TorchrunRun, alive, run_torchrun
from course.world import DEFAULT_WORLD_TIMEOUT, world_timeout

PHASE = "phase4_production"
TRAINER = "solutions.phase4_production.resilience.trainer"
STATE_FILE = "train_state.pt"
# elastic: settle a join in ~2 s, notice a lost agent after 3 missed 1 s heartbeats
ELASTIC_RDZV = (
    "--rdzv-conf=last_call_timeout=2,join_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=3"
)
# torch 2.15's c10d rendezvous does not republish the workers' store address to an agent that
# joins a later round while the store is shared (guidelines.md, 4.3): elastic runs opt out
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
_TODO = re.compile(r"TODO (\d+\.\d+) not written:(.*)")


def fail(message: str) -> NoReturn:
    """A teacher's remark, without the grader's traceback."""
    pytest.fail(message, pytrace=False)


def module(name: str) -> ModuleType:
    """``phase4_production/<name>`` as ``--impl`` chose it (template or solution)."""
    return load(PHASE, name)


def trainer_module() -> ModuleType:
    import solutions.phase4_production.resilience.trainer as trainer

    return trainer


def config(checkpoint_dir: Path, **overrides: Any) -> Any:
    """The trainer's config for tests: 2 epochs of 16 steps of 32 samples, a checkpoint every 5."""
    trainer = trainer_module()
    base = {"checkpoint_dir": str(checkpoint_dir), "keep": 10, "impl": impl()}
    return trainer.ResilientConfig(**{**base, **overrides})


def config_args(cfg: Any) -> list[str]:
    """The same config as command-line flags (for torchrun)."""
    args: list[str] = []
    defaults = trainer_module().ResilientConfig()
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if value == getattr(defaults, f.name) and f.name != "checkpoint_dir":
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        else:
            args += [flag, str(value)]
    return args


def _train_worker(cfg: Any) -> dict[str, torch.Tensor]:
    trainer = trainer_module()
    result: dict[str, torch.Tensor] = trainer.Trainer(cfg).run()
    dist.barrier()
    return result


def train_in_world(cfg: Any, world_size: int = 2) -> dict[str, torch.Tensor]:
    """Run the trainer in a forked world (no torchrun); rank 0's final weights."""
    return world(_train_worker, world_size, cfg)[0]


def final_weights(checkpoint_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The newest checkpoint's model weights and progress, read with ``weights_only=True``."""
    newest = sorted(Path(checkpoint_dir).glob("step_*"))[-1]
    saved = torch.load(newest / STATE_FILE, weights_only=True)
    return saved["model"], saved["progress"]


def compare_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    """Fail unless every tensor is ``torch.equal`` (bitwise) to the reference."""
    assert_bitwise_equal(
        got, want, what,
        "a resume must be bitwise: restore model, optimizer, scheduler, scaler, the sample "
        "position and this rank's RNG states (dropout draws from them)",
    )  # fmt: skip


def raise_if_todo(run: TorchrunRun) -> None:
    """A worker stopped at an unwritten TODO: raise it here, so it is graded as that TODO."""
    for log in run.ranks:
        match = _TODO.search(log.stderr)
        if match:
            raise NotImplementedError(f"TODO {match[1]}:{match[2]}")


def no_survivors(run: TorchrunRun, what: str) -> None:
    survivors = sorted(pid for pid in run.pids if alive(pid))
    if survivors:
        fail(f"{what}: processes outlived the scenario: {survivors}")


def slow_machine_limit(seconds: float) -> float:
    """A scenario's time bound, stretched as ``DTFS_WORLD_TIMEOUT`` stretches the worlds' (a
    loaded machine is slower, not hung): x1 at the default 20 s, x3 at 60 s."""
    return seconds * max(1.0, world_timeout() / DEFAULT_WORLD_TIMEOUT)


def torchrun_trainer(
    cfg: Any,
    *,
    nproc_per_node: int = 2,
    max_restarts: int = 2,
    time_limit: float = 60,
    **kwargs: Any,
) -> TorchrunRun:
    """The trainer under real torchrun agents; an unwritten TODO in a worker is re-raised.

    Workers are forked from their agent (``fork_workers``): these scenarios restart workers
    several times, and a fresh interpreter per worker per restart would import torch each time.
    """
    run = run_torchrun(
        TRAINER,
        config_args(cfg),
        nproc_per_node=nproc_per_node,
        max_restarts=max_restarts,
        time_limit=slow_machine_limit(time_limit),
        fork_workers=True,
        **kwargs,
    )
    raise_if_todo(run)
    return run


def rank_text(run: TorchrunRun, agent: int | None = None, attempt: int | None = None) -> str:
    """Everything the selected workers wrote, stdout and stderr."""
    return "\n".join(
        log.stdout + log.stderr
        for log in run.ranks
        if (agent is None or log.agent == agent) and (attempt is None or log.attempt == attempt)
    )


def lines_with(run: TorchrunRun, text: str) -> list[str]:
    return [line for line in rank_text(run).splitlines() if text in line]


def tail(run: TorchrunRun, limit: int = 1500) -> str:
    return "\n  what the run printed (tail):\n" + run.describe(400)[-limit:]


def journal_lines(checkpoint_dir: Path, text: str) -> list[str]:
    """Lines of the trainer's journal (every attempt's, unlike torchrun's logs) holding ``text``."""
    path = Path(checkpoint_dir) / "journal.txt"
    lines = path.read_text().splitlines() if path.exists() else []
    return [line for line in lines if text in line]


def probe(*calls: Sequence[Any]) -> None:
    """Call ``(fn, *args)`` in-process before a slow scenario: an unwritten TODO raises here."""
    for fn, *args in calls:
        fn(*args)
