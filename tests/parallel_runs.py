"""Running the tests in parallel worker processes (pytest-xdist) without breaking the grader's rules.

``uv run pytest`` starts ``-n auto`` workers (pyproject.toml): as many as the CPUs this process
may use, at most ``MAX_WORKERS``, since one test may itself start a world of 4 ranks or a
torchrun scenario. Not one more: on 2 cores a third worker filled the CPUs while tests waited
(91% -> 99% busy, 396 -> 373 s, before the waits were cut), but once the worlds' costs fell it
measured the same as two (343 s against 340 s, back to back), and it stretched every scenario
that runs against a clock (the nested pytest of the hang harness test: 17 s -> 39 s of a 40 s
bound; 2 cores, the notes on issue 26, 2026-11-28). None when the run selects one exercise
(``-m ex3_1``, or its grader files), whose tests would all go to one worker anyway: they run in
the pytest process, a few seconds sooner (no worker imports torch and collects the tests
again). ``PYTEST_XDIST_AUTO_NUM_WORKERS=N`` or ``-n N`` choose another number; ``-n 0`` runs
every test in the pytest process, as ``print`` debugging needs (``--pdb`` does it by itself).

Two rules of tests/conftest.py live in the process that runs the tests: an exercise reports its
first unwritten TODO once and its later tests as "blocked", and after one of its worlds hangs its
other worlds are skipped. Both hold only if every test of an exercise runs in the same worker, in
file order. So the unit of work a worker receives is :func:`work_unit`: the exercise, read from
the grader file's name (``tests/phase2/grade_2_5_pipeline.py`` and ``grade_2_5_zero_bubble.py``
are both exercise 2.5), or else the test file (so a module fixture runs once).
:func:`check_work_units` refuses a test suite where one exercise's tests would be split.

Each worker computes on one thread (:func:`pytest_configure`): the workers already fill the CPUs.

The scheduler is xdist's ``LoadScopeScheduling`` with this scope (xdist's own ``loadgroup`` reads
``xdist_group`` markers by rewriting node ids, which pytest 9 no longer allows). It hands a
worker the next unit in order when the worker is nearly done, so the order is longest unit first
(the LPT rule of list scheduling): a long unit started last would run on alone while the other
workers sit idle (exercise 4.7, 54 s, came last in file order and, in a run of 3 workers, ended
24 s after the others). How long a unit takes is read from ``work_unit_seconds.json``,
recorded by a run with ``--record-unit-seconds`` (it rewrites the units that run selected); a
unit not recorded there goes first if it holds a long scenario (a notebook, a real-torchrun run),
else last. The recorded seconds decide the order only: a stale table costs time, never a result.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

MAX_WORKERS = 4
UNIT_SECONDS = Path(__file__).with_name("work_unit_seconds.json")
RECORD_OPTION = "--record-unit-seconds"
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


def recorded_unit_seconds(path: Path = UNIT_SECONDS) -> dict[str, float]:
    """Seconds per work unit as the last ``--record-unit-seconds`` run measured them ({} if
    none)."""
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(table, dict):
        return {}
    return {str(unit): float(s) for unit, s in table.items() if isinstance(s, (int, float))}


def order_for_workers(items: list[pytest.Item], seconds: dict[str, float] | None = None) -> None:
    """Longest unit first, by recorded ``seconds``; units not recorded: those holding a long
    scenario before every recorded one, the rest after them. The file order within a unit, and
    among units that tie."""
    seconds = recorded_unit_seconds() if seconds is None else seconds
    long_units = {work_unit(item.nodeid) for item in items if _long_running(item)}
    top = max(seconds.values(), default=0.0) + 1.0

    def cost(item: pytest.Item) -> float:
        unit = work_unit(item.nodeid)
        if unit in seconds:
            return seconds[unit]
        return top if unit in long_units else -1.0

    items.sort(key=cost, reverse=True)  # stable: equal costs keep the file order


# ----------------------------------------------------------------------------- recording


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        RECORD_OPTION,
        action="store_true",
        help="write how long each work unit took to tests/work_unit_seconds.json (the order "
        "parallel workers take units in, longest first); units not run keep their time",
    )


class UnitClock:
    """Sums the durations of the reports of each work unit (setup, call, teardown), where the
    reports arrive (the controller under xdist)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[work_unit(report.nodeid)] += report.duration

    def write(self, path: Path = UNIT_SECONDS) -> None:
        table = {**recorded_unit_seconds(path), **{u: round(s, 1) for u, s in self.seconds.items()}}
        ordered = dict(sorted(table.items(), key=lambda kv: (-kv[1], kv[0])))
        path.write_text(json.dumps(ordered, indent=1) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption(RECORD_OPTION, False) and not hasattr(config, "workerinput"):
        config.pluginmanager.register(UnitClock(), "unit_clock")
    if hasattr(config, "workerinput"):
        # N workers share the CPUs: one compute thread each (torch's default is one per CPU,
        # and idle OpenMP threads spin), and so do the programs a test starts
        import torch

        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"


def pytest_sessionfinish(session: pytest.Session) -> None:
    clock = session.config.pluginmanager.get_plugin("unit_clock")
    if isinstance(clock, UnitClock):
        clock.write()
