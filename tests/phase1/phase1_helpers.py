"""Shared pieces of the phase 1 graders (tests/phase1/grade_1_*.py): loading the code under test,
short failures, and running an exercise inside two subgroups of a world of 4.

Every phase-1 function takes ``group=``. The subgroup checks split a world of 4 into the groups
(0, 1) and (2, 3) (tests/subgroups.py), run the same exercise in both at the same time on
different data, and compare each group with what a world of 2 gives. While the exercise runs,
:func:`only_inside` stops a rank at the first message that leaves its group, naming the call, so
"used the default group" or "passed a group rank where torch wants a global one" is reported as
such instead of as a hang or a wrong number.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

import pytest
import torch.distributed as dist
from grading import load, world
from subgroups import SubgroupInfo, split_into_groups

from course.comm_counter import CommCounter, CommRecord
from course.world import WorldHung

PHASE = "phase1_data_parallel"
ROOT = Path(__file__).resolve().parents[2]
SUBGROUP_WORLD, SUBGROUP_SIZE = 4, 2


def sampler_module() -> ModuleType:
    return load(PHASE, "data_loader")


def trainer_module() -> ModuleType:
    return load(PHASE, "trainer")


def all_reduce_module() -> ModuleType:
    return load(PHASE, "all_reduce")


def fail(message: str) -> NoReturn:
    """A teacher's remark, without the grader's traceback."""
    pytest.fail(message, pytrace=False)


def small_world(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """A world of the implementation under test; a hang is reported after the world timeout
    (DTFS_WORLD_TIMEOUT, 20 s by default), a deadlock 2-4 s after it sets in."""
    return world(fn, world_size, *args, **kwargs)


def first_problems(problems: list[str], header: str, limit: int = 6) -> None:
    """Fail with the first few problems the ranks reported, if any."""
    if problems:
        more = f"\n  ... and {len(problems) - limit} more" if len(problems) > limit else ""
        fail(header + "\n  " + "\n  ".join(problems[:limit]) + more)


# ----------------------------------------------------------------------------- subgroups


class _GuardedRecords(list[CommRecord]):
    """The records of a CommCounter that raises at the first call leaving the group."""

    def __init__(self, info: SubgroupInfo, what: str) -> None:
        super().__init__()
        self.info, self.what = info, what

    def append(self, record: CommRecord) -> None:
        super().append(record)
        probe = CommCounter(records=[record])
        root_outside = record.peer is not None and record.peer not in self.info.ranks
        if probe.crossing(self.info.ranks) or root_outside:
            raise AssertionError(leaving_message(record, self.info, self.what) + _call_site())


def _call_site() -> str:
    """`` (at file:line in function: code, ...)``: the last calls made in the code under test."""
    sites = []
    for frame in traceback.extract_stack():
        path = Path(frame.filename).resolve()
        if ROOT not in path.parents or ".venv" in path.parts:
            continue
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "tests" or path.name == "comm_counter.py":
            continue
        sites.append(f"{rel}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}")
    return f" (called from {'; then '.join(sites[-3:])})" if sites else ""


def leaving_message(record: CommRecord, info: SubgroupInfo, what: str) -> str:
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    in_group = record.group_ranks is not None and set(record.group_ranks) <= set(info.ranks)
    if in_group and not record.is_point_to_point:
        why = (
            f"its root is global rank {record.peer}, outside the group: torch's src=/dst= are "
            f"GLOBAL ranks even with group= given; pass a rank of the group as group_src=/"
            f"group_dst=, or map it with dist.get_global_rank(group, r)"
        )
        return (
            f"{what} inside the group {info.ranks} of a world of {world_size}: rank {rank} "
            f"called {record.op} ({record.nbytes} bytes) on group {record.group_ranks}, but {why}"
        )
    if record.is_point_to_point:
        why = (
            f"rank {record.peer} is not in the group. dst=/src= of send/recv are GLOBAL ranks "
            f"even with group= given: map a rank r of the group with "
            f"dist.get_global_rank(group, r) (or pass group_dst=/group_src=)"
        )
    elif record.group_ranks is None:
        why = (
            f"that call used the default group, all {world_size} ranks of the world: pass "
            f"group=group to every collective (and ask the group, dist.get_rank(group) and "
            f"dist.get_world_size(group), for ranks and sizes)"
        )
    else:
        why = f"that group {record.group_ranks} reaches outside {info.ranks}"
    return (
        f"{what} inside the group {info.ranks} of a world of {world_size}: "
        f"{record.describe(rank)}, outside the group; {why}"
    )


@contextmanager
def only_inside(info: SubgroupInfo, what: str) -> Iterator[CommCounter]:
    """Count this rank's calls; raise AssertionError at the first one that leaves ``info``'s
    group (before it is sent, so the world fails with a message instead of hanging)."""
    counter = CommCounter(records=_GuardedRecords(info, what))
    with counter:
        yield counter


def in_subgroups(worker: Callable[..., Any], *args: Any) -> list[Any]:
    """Run ``worker(info, *args)`` on a world of 4 split into the groups (0, 1) and (2, 3)."""
    return small_world(_subgroup_main, SUBGROUP_WORLD, worker, args)


def _subgroup_main(worker: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    info = split_into_groups(SUBGROUP_SIZE)
    return worker(info, *args)


def run_in_subgroups(label: str, worker: Callable[..., Any], *args: Any) -> list[Any]:
    """:func:`in_subgroups`, turning a hang into a remark about groups."""
    try:
        return in_subgroups(worker, *args)
    except WorldHung as exc:
        fail(
            f"{label}: run in two groups of 2 at once (ranks 0-1 and 2-3 of a world of 4), the "
            "ranks hung. Inside a subgroup, every collective needs group=group, sizes and ranks "
            "come from dist.get_world_size(group) / dist.get_rank(group), and a peer given to "
            "send/recv/broadcast as dst=/src= must be a GLOBAL rank.\n" + str(exc)
        )
