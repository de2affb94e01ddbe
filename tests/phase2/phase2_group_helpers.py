"""Shared pieces of the graders of 2.1, 2.2, 2.3 and 2.6 (tests/phase2/grade_2_{1,2,3,6}_*.py).

Loading the code under test, short failures, and running an exercise inside two subgroups of a
world of 4: the groups (0, 1) and (2, 3) (tests/subgroups.py) run the same exercise at the same
time on different data, each is compared with what a world of 2 (or one process) gives, and no
message may leave its group (``assert_no_crossing``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, NoReturn

import pytest
import torch
import torch.distributed as dist
from grading import impl, load, world
from subgroups import SubgroupInfo

from course.comm_counter import CommCounter

PHASE = "phase2_advanced"
SUBGROUP_WORLD, SUBGROUP_SIZE = 4, 2


def fail(message: str) -> NoReturn:
    """A teacher's remark, without the grader's traceback."""
    pytest.fail(message, pytrace=False)


def module(name: str) -> ModuleType:
    """The implementation of ``phase2_advanced/<name>`` chosen by ``--impl``."""
    return load(PHASE, name)


def demo_module(name: str) -> ModuleType:
    """A demo module (no template: always from solutions/, running ``--impl``'s exercise)."""
    import importlib

    return importlib.import_module(f"solutions.{PHASE}.{name}")


def impl_flag() -> list[str]:
    """``["--impl", <the implementation under test>]`` for a demo's command line."""
    return ["--impl", impl()]


def small_world(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """A world of 2-4 ranks; a hang is reported after the world timeout."""
    return world(fn, world_size, *args)


def crossing_message(counter: CommCounter, info: SubgroupInfo) -> str | None:
    """None when this rank talked only inside its group, else each call that left it, once."""
    crossing = counter.crossing(info.ranks)
    if not crossing:
        return None
    rank = dist.get_rank()
    calls = Counter(record.describe(rank) for record in crossing)
    lines = [text + (f" ({count} times)" if count > 1 else "") for text, count in calls.items()]
    more = f"; and {len(lines) - 4} more" if len(lines) > 4 else ""
    return (
        "; ".join(lines[:4]) + more + f". This rank's group is {info.ranks}: give every "
        "collective group=, and map a peer's rank in the group to a global one with "
        "dist.get_global_rank(group, r)"
    )


def fail_on_crossing(label: str, results: Sequence[dict[str, Any]]) -> None:
    """Fail naming the first rank whose messages left its group (results carry "crossing")."""
    for rank, result in enumerate(results):
        if result.get("crossing"):
            fail(
                f"{label}: rank {rank} communicated outside its group of 2 in a world of 4: "
                f"{result['crossing']}"
            )


def max_diff(got: torch.Tensor | None, want: torch.Tensor) -> float:
    if got is None or got.shape != want.shape:
        return float("inf")
    return float((got - want).abs().max()) if want.numel() else 0.0


def describe(got: torch.Tensor | None, want: torch.Tensor) -> str:
    """What differs, in a few words: missing, wrong shape, or how far off."""
    if got is None:
        return "got None (no value / no gradient)"
    if got.shape != want.shape:
        return f"got shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    return f"max difference {max_diff(got, want):.2e}"
