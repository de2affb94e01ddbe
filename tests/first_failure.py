"""Every first failure at the learner's line: plant a raise in a template, grade, read the first failure.

A learner who breaks one function must see, in the first failure the grader prints, the template
file and line they broke, under a test whose name fits the function (issue 29, part 3). A helper
that runs cases and turns every exception into its own message, or a rank's error reported
without its frames, breaks that promise silently; this module checks it the way a learner
meets it:

1. copy the working tree into a scratch folder (``.venv`` linked), complete every template with
   the solution's code (``course.template_maker --complete``), so every exercise passes;
2. plant ``raise RuntimeError("planted ...")`` as the first statement of one template function that
   holds a TODO, in one exercise, or in several exercises of a phase at once when none of them
   uses another's modules (:func:`rounds`);
3. grade those exercises with ``--impl templates -n 0`` (the real-torchrun scenarios left out, as
   CI's learner step does), each exercise stopping at its first failure (this module is also the
   pytest plugin that does it, ``-p first_failure``), and read each first failure.

tests/test_first_failure.py plants one function per exercise (CI);
``uv run python -m tests.first_failure`` plants every TODO function and prints a table
(``--exercise 3.8`` for one exercise's functions): what maintainers run after changing a grader
or a helper.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as ``python -m tests.first_failure`` or imported by a test
    sys.path.insert(0, str(ROOT))
if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))

from exercises import BY_ID, EXERCISES  # noqa: E402

from course.template_maker import SIBLING_IMPORT, solution_files, template_path, todos  # noqa: E402

PLANTED = "planted by tests/first_failure.py"
GRADE_TIMEOUT = 480.0  # seconds for one round of exercises, each up to its first failure
REPORT_ENV = "DTFS_FIRST_FAILURES"  # where the plugin writes each exercise's first failure


@dataclass(frozen=True)
class Plant:
    """One template function that holds a TODO: where a learner writes code."""

    exercise: str
    template: str  # e.g. "phase3_multi_node/template_ring_allreduce.py"
    qualname: str  # e.g. "chunk_bounds" or "FsdpUnit.start_gather"

    @property
    def function(self) -> str:
        return self.qualname.rsplit(".", 1)[-1]

    def __str__(self) -> str:
        return f"{self.exercise} {self.template}::{self.qualname}"


@dataclass(frozen=True)
class FirstFailure:
    """The first test of a graded exercise that failed, and what it printed."""

    test: str  # the test's name, with parameters: "test_chunk_bounds[7-3]"
    text: str  # the failure as the learner reads it (message and short traceback)


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function of a module with its qualified name (methods as ``Class.method``)."""

    def walk(
        node: ast.AST, prefix: str
    ) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                yield prefix + child.name, child
                yield from walk(child, f"{prefix}{child.name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def plants() -> list[Plant]:
    """Every template function that holds a TODO, in exercise and file order."""
    found: list[Plant] = []
    for solution in solution_files():
        functions = list(_functions(ast.parse(solution.read_text())))
        template = str(template_path(solution).relative_to(ROOT))
        for todo in todos(solution):
            around = [
                (name, fn)
                for name, fn in functions
                if fn.lineno <= todo.line <= (fn.end_lineno or fn.lineno)
            ]
            if not around:
                continue  # a TODO at module level: no function to plant in
            name = max(around, key=lambda pair: pair[1].lineno)[0]
            plant = Plant(todo.exercise, template, name)
            if plant not in found:
                found.append(plant)
    return sorted(found, key=lambda p: tuple(int(x) for x in p.exercise.split(".")))


def plant_line(source: str, qualname: str) -> tuple[str, int]:
    """``source`` with a raise as the first statement of ``qualname`` (after its docstring), and
    the raise's line number."""
    tree = ast.parse(source)
    fn = dict(_functions(tree)).get(qualname)
    if fn is None:
        raise LookupError(f"no function {qualname} in the template")
    body = fn.body
    first = body[0]
    if (
        len(body) > 1
        and isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        first = body[1]
    lines = source.splitlines(keepends=True)
    indent = " " * first.col_offset
    at = first.lineno - 1
    lines.insert(at, f'{indent}raise RuntimeError("{PLANTED}")\n')
    return "".join(lines), at + 1


def make_scratch(dest: Path, *, complete: bool = True) -> Path:
    """A copy of the working tree in ``dest`` with every template completed (``complete``) or
    fresh from the solutions, as a new learner finds it; returns ``dest``."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    dest.mkdir(parents=True, exist_ok=True)
    for raw in files:
        if not raw:
            continue
        rel = raw.decode()
        src = ROOT / rel
        if not src.is_file():
            continue  # deleted in the working tree, or a submodule
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(src.read_bytes())
    (dest / ".venv").symlink_to(ROOT / ".venv")
    subprocess.run(
        [sys.executable, "-m", "course.template_maker", "--complete" if complete else "--write"],
        cwd=dest,
        check=True,
        capture_output=True,
    )
    return dest


@contextmanager
def planted(scratch: Path, plant: Plant) -> Iterator[int]:
    """The raise planted in ``scratch``'s template for the block; yields the raise's line."""
    path = scratch / plant.template
    original = path.read_text()
    text, line = plant_line(original, plant.qualname)
    path.write_text(text)
    try:
        yield line
    finally:
        path.write_text(original)


def _imports() -> dict[str, set[str]]:
    """module -> the solution modules with TODOs it imports (which the templates import)."""
    found: dict[str, set[str]] = {}
    for solution in solution_files():
        found[solution.stem] = {
            match["mod"]
            for line in solution.read_text().splitlines()
            if (match := SIBLING_IMPORT.match(line))
        }
    return found


def depends_on(exercise: str, other: str) -> bool:
    """Whether ``exercise``'s code or graders reach a module of ``other`` (or share one), so
    that a raise planted in ``other`` could be the first failure of ``exercise``."""
    imports = _imports()
    reach: set[str] = set()
    todo = list(BY_ID[exercise].modules)
    while todo:
        module = todo.pop()
        if module not in reach:
            reach.add(module)
            todo += imports.get(module, ())
    ex = BY_ID[exercise]
    phase_tests = ROOT / "tests" / f"phase{ex.id.split('.')[0]}"
    graders = phase_tests.glob(f"grade_{ex.id.replace('.', '_')}_*.py")
    text = "".join(path.read_text() for path in graders)
    theirs = set(BY_ID[other].modules)
    return bool(theirs & reach) or any(f'"{module}"' in text for module in theirs)


def rounds(chosen: Sequence[Plant]) -> list[list[Plant]]:
    """``chosen`` (at most one plant per exercise) in rounds that can be graded together: one
    phase per round, and no exercise of a round depends on another's (:func:`depends_on`)."""
    found: list[list[Plant]] = []
    for plant in chosen:
        phase = plant.exercise.split(".")[0]
        for group in found:
            if group[0].exercise.split(".")[0] == phase and not any(
                depends_on(plant.exercise, other.exercise)
                or depends_on(other.exercise, plant.exercise)
                for other in group
            ):
                group.append(plant)
                break
        else:
            found.append([plant])
    return found


def grade(
    scratch: Path, exercises: Sequence[str], timeout: float = GRADE_TIMEOUT
) -> dict[str, FirstFailure | None]:
    """Grade ``exercises`` (of one phase) in ``scratch``, each up to its first failure."""
    report = scratch / "first-failures.json"
    report.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "DTFS_IMPL"))}
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # the scratch copy leaves no .pyc behind
    env["PYTHONPATH"] = os.pathsep.join([str(scratch / "tests"), str(scratch)])
    env[REPORT_ENV] = str(report)
    markers = " or ".join(BY_ID[ex].marker for ex in exercises)
    phase = exercises[0].split(".")[0]
    done = subprocess.run(
        [
            str(scratch / ".venv" / "bin" / "python"),
            "-m",
            "pytest",
            f"tests/test_phase{phase}.py",
            "-m",
            f"({markers}) and not torchrun",
            "--impl",
            "templates",
            "-n",
            "0",
            "-q",
            "-p",
            "first_failure",
        ],
        cwd=scratch,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if not report.exists():
        raise RuntimeError(
            f"grading {', '.join(exercises)} in {scratch} wrote no report:\n{done.stdout[-3000:]}"
            f"\n{done.stderr[-3000:]}"
        )
    found = json.loads(report.read_text())
    return {ex: FirstFailure(*found[ex]) if ex in found else None for ex in exercises}


# ----------------------------------------------------------------------------- the plugin
# ``-p first_failure`` in the pytest run that grades planted templates: once a test of an
# exercise failed, the exercise's later tests are skipped; each exercise's first failure is
# written to the JSON file named by DTFS_FIRST_FAILURES.

_FIRST: dict[str, tuple[str, str]] = {}


def _exercise_of(keywords: Any) -> str | None:
    return next((ex.id for ex in EXERCISES if ex.marker in keywords), None)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if os.environ.get(REPORT_ENV) and _exercise_of(item.keywords) in _FIRST:
        pytest.skip("this exercise already failed once (tests/first_failure.py)")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get(REPORT_ENV)
    ex = _exercise_of(report.keywords)
    if not path or ex is None or not report.failed or ex in _FIRST:
        return
    name = report.nodeid.split("::")[-1]
    _FIRST[ex] = (name, report.longreprtext)
    Path(path).write_text(json.dumps(_FIRST))


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get(REPORT_ENV)
    if path:
        Path(path).write_text(json.dumps(_FIRST))


_WORD = re.compile(r"[a-z0-9]+")
# words too common in names to say which function a test is about
_COMMON = {
    "test", "the", "a", "an", "of", "and", "or", "to", "in", "on", "with", "is", "are", "its",
    "it", "for", "by", "as", "at", "from", "init", "iter", "one", "two", "all", "every", "each",
    "equal", "equals", "same", "like", "match", "matches", "gives", "runs", "run",
}  # fmt: skip
# a test's abbreviation -> the words it stands for
_ALIASES = {"dp": {"data", "parallel"}, "zb": {"zero", "bubble"}, "ddp": {"data", "parallel"}}


def names_line(failure: FirstFailure, plant: Plant, line: int) -> bool:
    """The failure's text names the planted template file and line."""
    name = re.escape(Path(plant.template).name)
    return re.search(rf"{name}:{line}\b", failure.text) is not None


def _words(text: str) -> set[str]:
    words = set(_WORD.findall(re.sub(r"(?<=[a-z])(?=[A-Z])", "_", text).lower()))
    for word in list(words):
        words |= _ALIASES.get(word, set())
    return {w for w in words if len(w) > 2 and w not in _COMMON} | (words & {"dp", "zb"})


def _related(a: str, b: str) -> bool:
    """The same word, or forms of one (checkpoint, checkpointed; reduced, reduction)."""
    shortest = min(len(a), len(b))
    shared = next((i for i in range(shortest) if a[i] != b[i]), shortest)
    return a == b or shared >= 5 or (shared >= 4 and shared == shortest)


def name_fits(test: str, plant: Plant, also: Sequence[str] = ()) -> bool:
    """The test's name (with its parameters) shares a telling word with the function, its class
    or its module (``template_ring_allreduce.py``: ring, allreduce), or with ``also``."""
    module = Path(plant.template).stem.removeprefix("template_")
    theirs = _words(plant.qualname) | _words(module) | set(also)
    return any(_related(a, b) for a in _words(test) for b in theirs)


@dataclass(frozen=True)
class Outcome:
    plant: Plant
    line: int
    failure: FirstFailure | None
    seconds: float

    @property
    def at_line(self) -> bool:
        return self.failure is not None and names_line(self.failure, self.plant, self.line)

    @property
    def first_line(self) -> str:
        if self.failure is None:
            return "(no failure: every test passed)"
        return self.failure.text.strip().splitlines()[0][:160]


def check(scratch: Path, chosen: Sequence[Plant]) -> list[Outcome]:
    """Plant every one of ``chosen`` (a round: see :func:`rounds`), grade, read each first
    failure; the templates are restored afterwards."""
    start = time.monotonic()
    with ExitStack() as stack:
        lines = [stack.enter_context(planted(scratch, plant)) for plant in chosen]
        failures = grade(scratch, [plant.exercise for plant in chosen])
    seconds = time.monotonic() - start
    return [
        Outcome(plant, line, failures[plant.exercise], seconds)
        for plant, line in zip(chosen, lines, strict=True)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--exercise", action="append", help="only this exercise (repeatable)")
    parser.add_argument("--scratch", type=Path, help="reuse (or make) this scratch copy")
    parser.add_argument("--verbose", action="store_true", help="print each first failure whole")
    args = parser.parse_args(argv)
    import tempfile

    chosen = [p for p in plants() if not args.exercise or p.exercise in args.exercise]
    by_exercise: dict[str, list[Plant]] = {}
    for plant in chosen:
        by_exercise.setdefault(plant.exercise, []).append(plant)
    # round k plants the k-th function of every exercise (split where exercises depend)
    waves = [
        [found[k] for found in by_exercise.values() if k < len(found)]
        for k in range(max((len(found) for found in by_exercise.values()), default=0))
    ]
    with tempfile.TemporaryDirectory(prefix="dtfs-first-failure-") as tmp:
        scratch = args.scratch or Path(tmp) / "repo"
        if not (scratch / ".venv").exists():
            make_scratch(scratch)
        bad = 0
        for wave in waves:
            for group in rounds(wave):
                for outcome in check(scratch, group):
                    plant = outcome.plant
                    fits = outcome.failure is not None and name_fits(outcome.failure.test, plant)
                    ok = outcome.at_line
                    bad += not ok
                    test = outcome.failure.test if outcome.failure else "-"
                    print(
                        f"{'ok ' if ok else 'BAD'} {'fits' if fits else 'name?'} "
                        f"{outcome.seconds:5.1f}s {plant}  ->  {test}: {outcome.first_line}",
                        flush=True,
                    )
                    if args.verbose and outcome.failure is not None:
                        text = outcome.failure.text
                        print("    " + text.replace("\n", "\n    "), flush=True)
    print(f"{len(chosen) - bad} of {len(chosen)} first failures name the planted line")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
