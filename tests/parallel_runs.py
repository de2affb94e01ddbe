"""Running the tests in parallel worker processes (pytest-xdist) without breaking the grader's rules.

``uv run pytest`` starts ``-n auto`` workers (pyproject.toml): as many as the CPUs this process
may use, at most ``MAX_WORKERS``, since one test may itself start a world of 4 ranks or a
torchrun scenario; none when the run selects one exercise (``-m ex3_1``, or its grader files),
whose tests would all go to one worker anyway: they run in the pytest process, a few seconds
sooner (no worker imports torch and collects the tests again). ``PYTEST_XDIST_AUTO_NUM_WORKERS=N``
or ``-n N`` choose another number; ``-n 0`` runs every test in the pytest process, as ``print``
debugging needs (``--pdb`` does it by itself).

Two rules of tests/conftest.py live in the process that runs the tests: an exercise reports its
first unwritten TODO once and its later tests as "blocked", and after one of its worlds hangs its
other worlds are skipped. Both hold only if every test of an exercise runs in the same worker, in
file order. So the unit of work a worker receives is :func:`work_unit`: the exercise, read from
the grader file's name (``tests/phase2/grade_2_5_pipeline.py`` and ``grade_2_5_zero_bubble.py``
are both exercise 2.5), or else the test file (so a module fixture runs once).
:func:`check_work_units` refuses a test suite where one exercise's tests would be split.

Each worker computes on one thread (:func:`pytest_configure`): the workers already fill the CPUs.

The scheduler is xdist's ``LoadScopeScheduling`` with this scope (xdist's own ``loadgroup`` reads
``xdist_group`` markers by rewriting node ids, which pytest 9 no longer allows). Units holding a
long scenario (a notebook, a real-torchrun run) go first: started last, one would run on alone
while the other workers sit idle.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from typing import Any

import pytest

MAX_WORKERS = 4
_GRADER = re.compile(r"(?:^|/)grade_(?P<major>\d+)_(?P<minor>\d+)_\w+\.py$")


def work_unit(nodeid: str) -> str:
    """What one worker runs whole: ``"exercise 2.5"`` for a grader's test, else its file."""
    path = nodeid.split("::", 1)[0]
    match = _GRADER.search(path)
    return f"exercise {match['major']}.{match['minor']}" if match else path


_ONE_EXERCISE_MARK = re.compile(r"^\s*ex(?P<major>\d+)_(?P<minor>\d+)\s*$")


def one_exercise(markexpr: str, args: list[str]) -> str | None:
    """The exercise a run selects alone (``-m ex3_1``, or only grader files of 3.1), else None."""
    if match := _ONE_EXERCISE_MARK.match(markexpr or ""):
        return f"{match['major']}.{match['minor']}"
    units = {work_unit(arg) for arg in args}
    if args and len(units) == 1 and (unit := units.pop()).startswith("exercise "):
        return unit.removeprefix("exercise ")
    return None


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    chosen = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS", "")
    if chosen.isdigit():
        return int(chosen)
    # One exercise runs in one worker anyway: starting workers would only delay its first message
    if one_exercise(config.getoption("markexpr", ""), list(config.args)):
        return 0
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(MAX_WORKERS, usable or 1))


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadscope":
        return None  # another --dist was asked for: xdist's own scheduler
    from xdist.scheduler import LoadScopeScheduling

    class ExerciseScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ExerciseScheduling(config, log)


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):
        # N workers share N CPUs: one compute thread each (torch's default is one per CPU, and
        # idle OpenMP threads spin), and so do the programs a test starts
        import torch

        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"


def _long_running(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(name) for name in ("long_running", "torchrun"))


def check_work_units(items: list[pytest.Item], exercise_of: Any) -> None:
    """Raise when the tests of one exercise would fall into more than one work unit."""
    units: dict[str, set[str]] = defaultdict(set)
    for item in items:
        ex = exercise_of(item)
        if ex is not None:
            units[ex.id].add(work_unit(item.nodeid))
    split = {ex: sorted(found) for ex, found in units.items() if len(found) > 1}
    if split:
        raise pytest.UsageError(
            f"tests of one exercise would run in different workers: {split}; keep an exercise's "
            "tests in graders named tests/phaseN/grade_<id>_<name>.py (see tests/parallel_runs.py)"
        )


def order_for_workers(items: list[pytest.Item]) -> None:
    """Units holding a long scenario first; the file order within a unit and among the rest."""
    long_units = {work_unit(item.nodeid) for item in items if _long_running(item)}
    items.sort(key=lambda item: work_unit(item.nodeid) not in long_units)
