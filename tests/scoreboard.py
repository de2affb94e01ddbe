"""The scoreboard: per phase, which exercises pass, and the next TODO to open.

It counts what pytest reports, where the reports arrive: in the one pytest process, or in the
controller when pytest-xdist runs the tests in workers (so it is a plugin the root conftest.py
loads, not part of tests/conftest.py, which the controller never reads). What it needs to know
beyond pass, fail and skip comes in the report: the unwritten TODO a test stopped at is a user
property (``TODO_PROPERTY``) set by tests/conftest.py where the test ran.

"Next" points at what to do first: a written function that fails (its test, file and line),
since code built on it would fail too; else the TODO a failure actually stopped at, even when
a test of 2.5 reached an unwritten 2.3 through a helper.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from exercises import BY_ID, EXERCISES, PHASE_TITLES, Exercise

ROOT = Path(__file__).resolve().parents[1]
TODO_PROPERTY = "unwritten_todo"  # report.user_properties key: the TODO message a test stopped at


@dataclass
class Tally:
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    todo: str | None = None  # the first unwritten-TODO message seen for this exercise
    blocked_by: str | None = None  # the exercise whose TODO that message names, when another
    nodes: list[str] = field(default_factory=list)
    # the first test that failed for a written function (no unwritten TODO), and the learner's
    # file:line its failure names ("" when none): fixed before the next TODO is written
    failure: tuple[str, str] | None = None
    # tests marked ``reference`` check the reference or the library way beside the exercise:
    # they grade no learner code, so they do not decide the status, but they are counted and
    # shown, so the scoreboard's numbers add up to pytest's
    reference: dict[str, int] = field(default_factory=dict)


TALLY: dict[str, Tally] = {}

_TODO_ID = re.compile(r"TODO (\d+\.\d+):")


def _todo_exercise(todo: str) -> str | None:
    """The exercise a TODO message names (``"TODO 2.3: ..."`` -> ``"2.3"``), if it is known."""
    match = _TODO_ID.match(todo)
    return match[1] if match and match[1] in BY_ID else None


def _outcome(report: pytest.TestReport) -> str:
    return "passed" if report.passed else "failed" if report.failed else "skipped"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    ids = [ex.id for ex in EXERCISES if ex.marker in report.keywords]
    if not ids:
        return
    # a test counts once, as pytest does: by its call, or by a setup that failed or skipped
    counted = report.when == "call" or (report.when == "setup" and not report.passed)
    if not counted:
        return
    tally = TALLY.setdefault(ids[0], Tally())
    tally.nodes.append(report.nodeid.split("@")[0])  # xdist's loadgroup appends "@group"
    for name, todo in report.user_properties:
        if name != TODO_PROPERTY or not isinstance(todo, str):
            continue
        tally.todo = tally.todo or todo
        other = _todo_exercise(todo)
        if other is not None and other != ids[0] and tally.blocked_by is None:
            tally.blocked_by = other
    if "reference" in report.keywords:
        outcome = _outcome(report)
        tally.reference[outcome] = tally.reference.get(outcome, 0) + 1
        return
    if report.passed:
        tally.passed += 1
    elif report.failed:
        tally.failed += 1
        stopped_at_todo = any(name == TODO_PROPERTY for name, _ in report.user_properties)
        if tally.failure is None and not stopped_at_todo:
            tally.failure = (report.nodeid.split("::")[-1], learner_site(report.longreprtext))
    else:
        tally.skipped += 1


# the learner's code, with its line: a template, or the reference under --impl solutions (not
# the given modules beside them, such as phase3_multi_node/ddp_support.py)
_SITE = r"(?:solutions/phase\d_\w+/[\w/]+|phase\d_\w+/template_\w+)\.py:\d+"
# a grader's pointer ("at phase2_advanced/template_x.py:60 in f", or in parentheses); not a
# traceback's frame, whose line number a colon follows
_POINTER = re.compile(rf"(?P<site>{_SITE})(?![\d:])(?: in (?P<fn>[\w.<>]+))?")
_FRAME = re.compile(rf"^(?P<site>{_SITE}): in (?P<fn>[\w<>]+)", re.MULTILINE)


def learner_site(text: str) -> str:
    """``phase2_advanced/template_x.py:60 in forward``: where a failure's text points in the
    learner's code: the grader's own pointer when it has one, else the deepest frame of the
    traceback in the learner's code; "" when the text names no line of it."""
    pointer = _POINTER.search(text)
    if pointer is not None:
        function = (pointer["fn"] or "").rstrip(".")
        return pointer["site"] + (f" in {function}" if function else "")
    frames = list(_FRAME.finditer(text))
    return f"{frames[-1]['site']} in {frames[-1]['fn']}" if frames else ""


# ----------------------------------------------------------------------------- the scoreboard


def _status(tally: Tally) -> str:
    """TODO or FAIL when a test (or a reference check) failed, pass when something passed and
    nothing failed, skipped when nothing ran."""
    if tally.failed or (tally.skipped and tally.todo):
        return "TODO" if tally.todo else "FAIL"
    if tally.reference.get("failed"):
        return "FAIL"
    if tally.passed or tally.reference.get("passed"):
        return "pass"
    return "skipped"


def raise_sites(path: Path, exercise_id: str) -> list[tuple[int, str, str, str]]:
    """(line, Class.function, guide section, message) of each ``raise NotImplementedError("TODO
    <id>: ...")`` in a file, read as text (no import, no torch); the section is the one the
    message names (a TODO may point below the exercise's own heading, e.g. 2.5's zero-bubble
    part)."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return []
    sites: list[tuple[int, str, str, str]] = []

    def visit(node: ast.AST, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, [*scope, child.name])
                continue
            if isinstance(child, ast.Raise) and isinstance(child.exc, ast.Call):
                func, args = child.exc.func, child.exc.args
                if (
                    isinstance(func, ast.Name)
                    and func.id == "NotImplementedError"
                    and args
                    and isinstance(args[0], ast.Constant)
                    and str(args[0].value).startswith(f"TODO {exercise_id}:")
                ):
                    message = str(args[0].value)
                    see = re.search(r"\(see (\S+?guidelines\.md#[\w-]+)\)", message)
                    guide = see[1] if see else ""
                    sites.append((child.lineno, ".".join(scope) or "<module>", guide, message))
            visit(child, scope)

    visit(tree, [])
    return sorted(sites)


def open_todos(ex: Exercise, root: Path = ROOT) -> list[tuple[Path, int, str, str, str]]:
    """(template, line, Class.function, guide section, message) of every unwritten TODO of
    ``ex``, in the order of its modules and then of the file: the first is where a learner
    starts (the scoreboard's "Next" and tests/preflight.py's first message both name it)."""
    found = []
    for module in ex.modules:
        path = root / ex.phase / f"template_{module}.py"
        found += [(path, *site) for site in raise_sites(path, ex.id)]
    return found


def _next_step(ex: Exercise, tally: Tally, impl: str) -> str:
    """Where to go next: a written function that fails (fix it before writing more: the next
    TODO may build on it, and its tests would fail for this one's mistake); else the TODO the
    failures stopped at, which may belong to another exercise (a 2.5 test that runs 2.3's
    checkpointing stops at TODO 2.3)."""
    test_file = tally.nodes[0].split("::")[0] if tally.nodes else "tests/"
    rerun = f"uv run pytest {test_file} -m {ex.marker}"
    if tally.failure is not None:
        test, site = tally.failure
        at = f" at {site}" if site else ""
        more = " before writing the next TODO" if tally.todo else ""
        return f"fix {ex.id}'s failure in {test}{at} (in full above){more}; rerun with `{rerun}`"
    target = BY_ID.get(tally.blocked_by or "", ex)
    needed = f", which {ex.id}'s tests need" if target is not ex else ""
    guide = f"{target.phase}/guidelines.md#{target.anchor}"
    sites = open_todos(target) if impl == "templates" else []
    if sites:
        path, line, where, section, _ = sites[0]
        rel = path.relative_to(ROOT)
        read = section or guide
        return f"open {rel}:{line}, {where} (TODO {target.id}{needed}; read {read})"
    return f"fix {target.id}{needed}: see its first failure above; rerun with `{rerun}`"


def _reference_note(tally: Tally) -> str:
    """``, + 2/2 reference checks`` when the exercise has tests of the reference beside it."""
    total = sum(tally.reference.values())
    if not total:
        return ""
    return f", + {tally.reference.get('passed', 0)}/{total} reference checks"


def _count_line(terminalreporter: pytest.TerminalReporter) -> str:
    """How the scoreboard's counts relate to pytest's summary line."""
    listed = sum(
        t.passed + t.failed + t.skipped + sum(t.reference.values()) for t in TALLY.values()
    )
    counted = sum(
        len([r for r in terminalreporter.stats.get(key, []) if getattr(r, "when", "") != ""])
        for key in ("passed", "failed", "skipped", "error")
    )
    others = counted - listed
    if others <= 0:
        return f"({listed} tests of exercises above, as pytest counts them.)"
    return (
        f"({listed} tests of exercises above; pytest's other {others} check the harness, the "
        "templates, notebooks and programs.)"
    )


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config
) -> None:
    if not TALLY:
        return
    impl = config.getoption("--impl")
    write = terminalreporter.write_line
    terminalreporter.section(f"scoreboard (--impl {impl})", sep="=")
    next_step = None
    skipped: list[str] = []
    for phase, title in PHASE_TITLES.items():
        rows = [ex for ex in EXERCISES if ex.phase == phase and ex.id in TALLY]
        if not rows:
            continue
        write(title)
        for ex in rows:
            tally = TALLY[ex.id]
            total = tally.passed + tally.failed + tally.skipped
            status = _status(tally)
            needs = f" (needs TODO {tally.blocked_by})" if tally.blocked_by else ""
            write(
                f"  [{status:^7}] {ex.id:<5} {ex.title:<42} "
                f"{tally.passed}/{total} tests pass{_reference_note(tally)}{needs}"
            )
            if status in ("TODO", "FAIL") and next_step is None:
                next_step = _next_step(ex, tally, impl)
            if status == "skipped":
                skipped.append(ex.id)
    write(_count_line(terminalreporter))
    write("")
    if next_step:
        write(f"Next: {next_step}")
    elif skipped:
        write(
            f"Nothing failed; every test of {', '.join(skipped)} was skipped (pytest -rs says why)."
        )
    elif all(ex.id in TALLY for ex in EXERCISES):
        write("Every graded exercise passes.")
    else:
        write("Every selected exercise passes.")
