"""Cases the scoreboard tests in tests/test_harness.py run in a pytest of their own.

Not collected by ``uv run pytest`` (the name does not start with ``test_``): they fail on purpose.
"""

from __future__ import annotations

import pytest
from grading import exercise, world

# torch is imported by the functions that run on ranks, not here: the cases that start no world
# then run without it, as a learner's first message does (tests/preflight.py)


def rank_one_skips_the_barrier() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.barrier()


def all_reduce_one() -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


@exercise("1.3")
def test_hangs_first() -> None:
    world(rank_one_skips_the_barrier, 2)


@exercise("1.3")
def test_would_hang_again() -> None:
    world(rank_one_skips_the_barrier, 2)


@exercise("1.3")
def test_would_hang_a_third_time() -> None:
    world(all_reduce_one, 2)


@exercise("1.2")
def test_a_pure_test_still_runs() -> None:
    assert 1 + 1 == 2


@exercise("1.4")
def test_reaches_an_unwritten_all_reduce_through_a_helper() -> None:
    raise NotImplementedError("TODO 1.3: write all_reduce; see guidelines.md#13")


@exercise("1.4")
def test_reaches_it_again() -> None:
    raise NotImplementedError("TODO 1.3: write all_reduce; see guidelines.md#13")


@exercise("1.1")
def test_passes() -> None:
    assert True


@exercise("1.1")
@pytest.mark.reference
def test_a_reference_check_beside_the_exercise() -> None:
    assert True


@exercise("2.1")
@pytest.mark.reference
def test_a_failing_reference_check_alone() -> None:
    raise AssertionError("the reference broke")


@exercise("2.2")
@pytest.mark.reference
def test_a_passing_reference_check_alone() -> None:
    assert True


_SHARED: dict[str, BaseException] = {}


def shared_result() -> None:
    """Stands for a world that several tests read (run once, its error re-raised in each)."""
    if "error" not in _SHARED:
        _SHARED["error"] = ValueError("the learner's combine put rows in the wrong place")
    raise _SHARED["error"]


@exercise("3.4")
@pytest.mark.reference
def test_a_reference_check_listed_before_the_learners_tests() -> None:
    """Runs after the learner's tests of 3.4, and only when they pass (here they fail)."""
    raise AssertionError("a reference check ran before the learner's tests, or while they fail")


@exercise("3.4")
def test_the_shared_cause_fails_first() -> None:
    shared_result()


@exercise("3.4")
def test_reads_the_same_failed_world() -> None:
    shared_result()


@exercise("3.4")
def test_fails_for_a_cause_of_its_own() -> None:
    raise ValueError("another mistake")
