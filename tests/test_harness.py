"""The grading harness itself: worlds start, failures name their rank, hangs end, nothing leaks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from solutions.common.world import RankDied, RankFailed, WorldHung, run_world

pytestmark = pytest.mark.harness


def rank_and_sum() -> tuple[int, int, float]:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def rank_one_raises(pid_dir: str) -> None:
    Path(pid_dir, f"{dist.get_rank()}.pid").write_text(str(os.getpid()))
    dist.barrier()  # both pids are on disk before anything fails
    if dist.get_rank() == 1:
        raise ValueError("rank 1 saw a bad value: 42")
    dist.barrier()  # rank 0 waits here for a rank that is gone


def rank_one_skips_the_all_reduce(pid_dir: str) -> None:
    Path(pid_dir, f"{dist.get_rank()}.pid").write_text(str(os.getpid()))
    dist.barrier()
    t = torch.ones(4)
    if dist.get_rank() != 1:
        dist.all_reduce(t)  # the collective rank 1 never joins


def rank_one_exits_abruptly() -> None:
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def _pids(pid_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(pid_dir.glob("*.pid"))]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_come_back_in_rank_order(world_size: int) -> None:
    results = run_world(rank_and_sum, world_size)
    expected_sum = world_size * (world_size + 1) / 2
    assert results == [(r, world_size, expected_sum) for r in range(world_size)]


def test_a_raising_rank_fails_the_world_with_its_message(tmp_path: Path) -> None:
    with pytest.raises(RankFailed) as info:
        run_world(rank_one_raises, 2, (str(tmp_path),), timeout=30)
    err = info.value
    assert err.rank == 1 and err.exc_type == "ValueError"
    assert "bad value: 42" in err.message
    assert err.frames and err.frames[-1].function == "rank_one_raises", err.frames
    assert "rank 1 raised ValueError" in str(err)
    pids = _pids(tmp_path)
    assert len(pids) == 2 and not any(map(_alive, pids)), "ranks outlived run_world"


def test_a_skipped_collective_is_reported_as_a_hang_with_the_stuck_line(tmp_path: Path) -> None:
    with pytest.raises(WorldHung) as info:
        run_world(rank_one_skips_the_all_reduce, 2, (str(tmp_path),), timeout=6)
    err = info.value
    assert sorted(err.hung) == [0], f"expected only rank 0 to hang, got {sorted(err.hung)}"
    assert err.finished == [1]
    stuck = err.hung[0][-1]
    assert stuck.function == "rank_one_skips_the_all_reduce", str(err)
    assert "dist.all_reduce(t)" in stuck.line, str(err)
    assert "rank 0 stuck at tests/test_harness.py" in str(err)
    pids = _pids(tmp_path)
    assert len(pids) == 2 and not any(map(_alive, pids)), "ranks outlived run_world"


def test_a_rank_that_dies_without_reporting_is_named() -> None:
    with pytest.raises(RankDied) as info:
        run_world(rank_one_exits_abruptly, 2, timeout=30)
    assert info.value.rank == 1 and info.value.exitcode == 3


def test_world_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="world_size=0"):
        run_world(rank_and_sum, 0)
