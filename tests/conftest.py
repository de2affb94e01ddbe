"""The grading harness: ``--impl``, short teacher-like failures, and the scoreboard.

* ``--impl templates`` (default) grades the learner's templates, ``--impl solutions`` the reference.
* A failure caused by an unwritten TODO reads as one line naming the TODO and its guidelines
  section; later tests of the same exercise that stop at the same wall are reported as skipped
  ("blocked by TODO 1.1"), so each open exercise shows up once. Rank failures and hangs from
  :func:`course.world.run_world` are shown as their own short message, not as harness
  tracebacks.
* After a world of an exercise hangs, the exercise's later worlds are skipped before they start
  ("blocked by the hang above (test_x)"): a hung exercise costs one timeout, not one per test.
* A later test of an exercise that fails with the very error an earlier one reported (a shared
  world re-raised in each test that reads it, the same raise reached again) is reported as
  skipped ("blocked by the failure above (test_x)"): one cause, one message.
* Tests run in parallel worker processes (tests/parallel_runs.py; ``-n 0`` runs them in this
  one). Every test of one exercise runs in the same worker, in file order, so the two rules above
  hold there; the scoreboard (tests/scoreboard.py) counts where the reports arrive.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from exercises import BY_ID, EXERCISES, Exercise
from grading import IMPL_ENV, LoadError, block_worlds
from learner_sites import todo_site
from parallel_runs import check_work_units, order_for_workers
from scoreboard import TODO_PROPERTY

# course.world (and so torch) is imported by the hooks that use it, not here: tests/preflight.py
# prints the first TODO of a selected exercise before torch loads (issue 29, part 1)

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Walls:
    """What the tests of one exercise ran into so far, in this process (one xdist worker runs
    every test of an exercise: see tests/parallel_runs.py)."""

    todo: str | None = None  # the first unwritten-TODO message seen for this exercise
    hang: str | None = None  # the first test of this exercise whose world hung
    learner_failed: str | None = None  # the first test of the learner's code that failed
    failures: dict[tuple[str, ...], str] = field(default_factory=dict)  # error -> first test


WALLS: dict[str, Walls] = {}


def pytest_configure(config: pytest.Config) -> None:
    # Set before any world starts: ranks inherit it and load the same implementation.
    os.environ[IMPL_ENV] = config.getoption("--impl")
    config.addinivalue_line("markers", "exercise(id): the exercise a test grades")
    config.addinivalue_line("markers", "harness: tests of the grading harness itself")
    config.addinivalue_line(
        "markers",
        "torchrun: starts real torchrun agents in subprocesses (slow; deselect with "
        "-m 'not torchrun')",
    )
    config.addinivalue_line(
        "markers",
        "long_running: runs for 10 s or more (a notebook, a deadline, a real-torchrun scenario; "
        "torchrun implies it): its work unit starts first when tests run in parallel and "
        "tests/work_unit_seconds.json has no time for it",
    )
    config.addinivalue_line(
        "markers",
        "first_failure: plants a raise in every exercise and re-grades it (CI runs these apart: "
        "uv run pytest tests/test_first_failure.py -m first_failure)",
    )
    config.addinivalue_line(
        "markers",
        "reference: checks the reference or library way beside an exercise (runs with the "
        "exercise's marker, not counted on the scoreboard: it grades no learner code)",
    )
    for ex in EXERCISES:
        config.addinivalue_line("markers", f"{ex.marker}: exercise {ex.id}, {ex.title}")


def pytest_report_header(config: pytest.Config) -> str:
    return f"grading: --impl {config.getoption('--impl')}"


# ----------------------------------------------------------------------------- parallel runs


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    check_work_units(items, _exercise_of)
    references_last(items)
    if hasattr(config, "workerinput"):  # an xdist worker; otherwise tests run in file order
        order_for_workers(items)


def pytest_collection_finish(session: pytest.Session) -> None:
    # Every rank unpickles its function from a test module, which imports pytest and the graders'
    # helpers: imported once in the fork server instead (course/world_preload.py). Only the
    # selected tests' modules, so that one exercise's run pays for nothing else.
    if "torch" not in sys.modules:
        # no selected test imported torch (course.world would import it): a world, if one
        # starts, preloads the defaults, not the list of a pytest that started this one
        os.environ.pop("DTFS_WORLD_PRELOAD", None)  # course.world.PRELOAD_ENV
        return
    from course.world import preload_in_worlds

    # A test module may name more in WORLD_PRELOAD: what its ranks import but it does not
    # (2.5's ranks run torch's pipelining, which its grader imports only where it is used).
    found = {m for item in session.items if (m := getattr(item, "module", None))}
    extra = [name for module in found for name in getattr(module, "WORLD_PRELOAD", ())]
    modules = sorted(module.__name__ for module in found)
    preload_in_worlds(["pytest", "numpy", *sorted(set(extra)), *modules])


def _is_reference(item: pytest.Item) -> bool:
    return item.get_closest_marker("reference") is not None


def references_last(items: list[pytest.Item]) -> None:
    """Within each exercise, its reference checks after the tests of the learner's code.

    They grade no learner code (the library way beside the exercise, the instructor's programs),
    so they must not stand between a learner and their first failure; see also
    :func:`pytest_runtest_setup`, which skips them while the learner's tests fail.
    """
    position = {id(item): index for index, item in enumerate(items)}
    first_seen: dict[str, int] = {}
    for item in items:
        if (ex := _exercise_of(item)) is not None:
            first_seen.setdefault(ex.id, position[id(item)])

    def key(item: pytest.Item) -> tuple[int, bool, int]:
        ex = _exercise_of(item)
        unit = first_seen[ex.id] if ex is not None else position[id(item)]
        return (unit, _is_reference(item), position[id(item)])

    items.sort(key=key)


# ----------------------------------------------------------------------------- short failures


def _exercise_of(item: pytest.Item) -> Exercise | None:
    marker = item.get_closest_marker("exercise")
    return BY_ID.get(marker.args[0]) if marker else None


class _NoWorldYet(Exception):
    """Stands for course.world's errors while nothing has imported it: none can have occurred."""


def _world_errors() -> tuple[Any, Any, Any]:
    """course.world's (RankFailed, WorldError, WorldHung), without importing it (and torch) for a
    run whose tests never started a world: the report hooks run for every test."""
    world = sys.modules.get("course.world")
    if world is None:
        return _NoWorldYet, _NoWorldYet, _NoWorldYet
    return world.RankFailed, world.WorldError, world.WorldHung


def _todo_text(exc: BaseException) -> str | None:
    """The TODO message when ``exc`` is an unwritten TODO, here or on a rank."""
    RankFailed, _, _ = _world_errors()
    if isinstance(exc, NotImplementedError):
        return str(exc) or "a function still raises NotImplementedError"
    if isinstance(exc, RankFailed) and exc.exc_type == "NotImplementedError":
        return exc.message or "a function still raises NotImplementedError"
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    ex = _exercise_of(item)
    walls = WALLS.get(ex.id) if ex else None
    hang = walls.hang if walls else None
    if ex is not None and walls is not None and _is_reference(item) and walls.learner_failed:
        # a reference check proves the library way or the instructor's programs, not the
        # learner's code: while the learner's tests fail it would only delay the run
        pytest.skip(
            f"reference check of {ex.id}: runs once the exercise's own tests pass (the first "
            f"failure: {walls.learner_failed})"
        )
    block_worlds(f"blocked by the hang above ({hang})" if hang else None)


def pytest_runtest_teardown(item: pytest.Item) -> None:
    block_worlds(None)


def _where(excinfo: pytest.ExceptionInfo[BaseException]) -> str:
    """``file:line in Class.method`` of the innermost frame in the project."""
    for entry in reversed(excinfo.traceback):
        path = Path(str(entry.path))
        if ROOT in path.parents and ".venv" not in path.parts:
            qualname = getattr(entry.frame.code.raw, "co_qualname", entry.name)
            return f"{path.relative_to(ROOT)}:{entry.lineno + 1} in {qualname}"
    return ""


def _signature(excinfo: pytest.ExceptionInfo[BaseException]) -> tuple[str, ...]:
    """What makes two failures the same error: type, message and the line that raised it."""
    RankFailed, _, _ = _world_errors()
    exc = excinfo.value
    if isinstance(exc, RankFailed):  # the error's own line; notes below it name the case
        where = exc.frames[-1].location if exc.frames else ""
        return (exc.exc_type, exc.message.split("\n", 1)[0], where)
    return (type(exc).__name__, str(exc), _where(excinfo))


def _blocked(item: pytest.Item, report: pytest.TestReport, reason: str) -> None:
    report.outcome = "skipped"
    report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {reason}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """A judged failure of an exercise (values, counts, order: ``pytest.fail``) without a line of
    the learner's gets one: the function its first lines name (tests/learner_sites.py); a rank's
    error raised in given code or a test helper is put at the learner's call that caused it
    (tests/learner_calls.py, issue 49)."""
    try:
        return (yield)
    except Exception as exc:  # a rank's error raised in given code: at the learner's call
        RankFailed, _, _ = _world_errors()
        ex = _exercise_of(item)
        if isinstance(exc, RankFailed) and ex is not None and not _is_reference(item):
            from learner_calls import at_learner_call

            at_learner_call(exc, ex.id)
        raise
    except pytest.fail.Exception as exc:
        ex = _exercise_of(item)
        if ex is not None and not _is_reference(item):
            from learner_sites import judged_site

            site = judged_site(exc.msg or "", ex, item.config.getoption("--impl"))
            if site:
                exc.msg = f"{exc.msg}\n  at {site}"
        raise


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    outcome = yield
    RankFailed, WorldError, WorldHung = _world_errors()
    report = outcome.get_result()
    ex = _exercise_of(item)
    if ex is not None and report.failed and not _is_reference(item):
        walls = WALLS.setdefault(ex.id, Walls())
        walls.learner_failed = walls.learner_failed or item.name
    if call.excinfo is None or report.when != "call":
        return
    exc = call.excinfo.value
    label = f"{ex.id} {ex.title}" if ex else item.name
    todo = _todo_text(exc)
    if isinstance(exc, WorldHung) and ex is not None:
        walls = WALLS.setdefault(ex.id, Walls())
        walls.hang = walls.hang or item.name
    if todo is not None and ex is not None:
        walls = WALLS.setdefault(ex.id, Walls())
        # the scoreboard (tests/scoreboard.py) may run in another process: tell it in the report
        report.user_properties.append((TODO_PROPERTY, todo))
        if walls.todo is not None:
            _blocked(item, report, f"blocked by {todo}")
            return
        walls.todo = todo
        where = _where(call.excinfo) if isinstance(exc, NotImplementedError) else ""
        if isinstance(exc, RankFailed) and exc.frames:
            where = f"rank {exc.rank}, {exc.frames[-1].location}"
        if not where.removeprefix(f"rank {getattr(exc, 'rank', '')}, ").startswith("phase"):
            where = todo_site(todo) or where  # re-raised by harness code: the raise itself
        report.longrepr = f"[{label}] not written yet: {todo}" + (
            f"\n  at {where}" if where else ""
        )
        return
    if ex is not None and report.failed and not isinstance(exc, WorldHung):
        walls = WALLS.setdefault(ex.id, Walls())
        signature = _signature(call.excinfo)
        first = walls.failures.get(signature)
        if first is not None:
            _blocked(item, report, f"blocked by the failure above ({first}): the same error")
            return
        walls.failures[signature] = item.name
    if isinstance(exc, (WorldError, LoadError)):
        report.longrepr = f"[{label}] {exc}"
