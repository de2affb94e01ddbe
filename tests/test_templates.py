"""Templates and solutions stay in step: same public API, TODOs that teach, no stubs shipped.

Templates are generated from the solutions' marked TODO regions by
``course.template_maker``; these checks run under both ``--impl`` values, except the
byte-for-byte comparison with the generator, which only makes sense on an untouched checkout
(learners edit their templates, and may commit their work) and so runs only where
``DTFS_CHECK_TEMPLATES=1`` says the templates are the maintainers' (``.ci/run`` sets it).
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from exercises import BY_ID

from course import template_maker

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = template_maker.solution_files()
IDS = [str(path.relative_to(ROOT)) for path in SOLUTIONS]
TODO_MESSAGE = re.compile(
    r"^TODO (?P<id>\d+\.\d+): (?P<goal>.+) "
    r"\(see (?P<phase>phase\d+_\w+)/guidelines\.md#(?P<anchor>[a-z0-9-]+)\)$"
)

pytestmark = pytest.mark.harness


def test_there_are_templates_to_check() -> None:
    assert SOLUTIONS, "no solution module has TODO regions: nothing would be graded"


def public_api(tree: ast.Module) -> dict[str, tuple[str, str | None]]:
    """Public functions, classes and methods -> (parameters with defaults, docstring)."""
    api: dict[str, tuple[str, str | None]] = {}

    def describe(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, str | None]:
        return ast.unparse(fn.args), ast.get_docstring(fn)

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith(
            "_"
        ):
            api[node.name] = describe(node)
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            api[node.name] = ("class", ast.get_docstring(node))
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                    not item.name.startswith("_") or item.name in ("__init__", "__call__")
                ):
                    api[f"{node.name}.{item.name}"] = describe(item)
    return api


@pytest.mark.parametrize("solution", SOLUTIONS, ids=IDS)
def test_template_has_the_solutions_public_api(solution: Path) -> None:
    template = template_maker.template_path(solution)
    assert template.exists(), f"{template.relative_to(ROOT)} is missing; regenerate with --write"
    ours = public_api(ast.parse(template.read_text()))
    theirs = public_api(ast.parse(solution.read_text()))
    missing = sorted(set(theirs) - set(ours))
    extra = sorted(set(ours) - set(theirs))
    assert not missing, f"{template.name} lacks {missing}, which the tests call"
    assert not extra, (
        f"{template.name} has public names the solution lacks: {extra} (prefix helpers with _)"
    )
    for name, (params, doc) in theirs.items():
        assert ours[name][0] == params, (
            f"{template.name}: {name}({ours[name][0]}) should have the parameters ({params})"
        )
        assert ours[name][1] == doc, (
            f"{template.name}: {name}'s docstring differs from the solution's"
        )


@pytest.mark.parametrize("solution", SOLUTIONS, ids=IDS)
def test_template_imports(solution: Path) -> None:
    template = template_maker.template_path(solution)
    name = f"{template.parent.name}.{template.stem}"
    importlib.import_module(name)


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub makes for a page's headings."""
    anchors = set()
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif line.startswith("#") and not in_code:
            title = line.lstrip("#").strip().lower()
            title = re.sub(r"[^\w\- ]", "", title)
            anchors.add(title.replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("solution", SOLUTIONS, ids=IDS)
def test_every_todo_raises_naming_its_exercise_and_guidelines_section(solution: Path) -> None:
    generated = ast.parse(template_maker.make_template(solution))
    messages = []
    for node in ast.walk(generated):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            func = node.exc.func
            if isinstance(func, ast.Name) and func.id == "NotImplementedError":
                arg = node.exc.args[0] if node.exc.args else None
                assert isinstance(arg, ast.Constant), (
                    f"line {node.lineno}: the TODO message must be a string"
                )
                messages.append((node.lineno, str(arg.value)))
    regions = template_maker.todos(solution)
    assert len(messages) == len(regions) > 0, (
        f"{solution.name}: {len(regions)} TODO regions but {len(messages)} raises in the template"
    )
    for lineno, message in messages:
        match = TODO_MESSAGE.match(message)
        assert match, (
            f"template line {lineno}: {message!r} should read "
            "'TODO x.y: goal (see phase/guidelines.md#anchor)'"
        )
        assert match["id"] in BY_ID, (
            f"template line {lineno}: exercise {match['id']} is not in tests/exercises.py"
        )
        guidelines = ROOT / match["phase"] / "guidelines.md"
        assert guidelines.exists(), f"{guidelines.relative_to(ROOT)} is missing"
        assert match["anchor"] in github_anchors(guidelines.read_text()), (
            f"template line {lineno}: {guidelines.relative_to(ROOT)} has no heading "
            f"for #{match['anchor']}"
        )


def test_no_solution_raises_not_implemented() -> None:
    stubs = []
    for path in sorted((ROOT / "solutions").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(exc, ast.Name) and exc.id == "NotImplementedError":
                    stubs.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not stubs, f"a solution must be complete, but these raise NotImplementedError: {stubs}"


@pytest.mark.parametrize("solution", SOLUTIONS, ids=IDS)
def test_committed_template_is_what_the_generator_makes(solution: Path) -> None:
    if os.environ.get("DTFS_CHECK_TEMPLATES") != "1":
        pytest.skip(
            "maintainers' check, run by CI (DTFS_CHECK_TEMPLATES=1): in a learner's checkout "
            "the templates hold the learner's work"
        )
    template = template_maker.template_path(solution)
    if template.read_text() != template_maker.make_template(solution):
        pytest.fail(
            f"{template.relative_to(ROOT)} drifted from {solution.relative_to(ROOT)}. "
            "Maintainers: `uv run python -m course.template_maker --write` regenerates "
            "every phase*/template_*.py from the solutions, overwriting whatever is in them "
            "(never run it in a checkout where someone is doing the exercises); then commit.",
            pytrace=False,
        )


@pytest.mark.parametrize("solution", SOLUTIONS, ids=IDS)
def test_templates_show_hint_1_only(solution: Path) -> None:
    generated = template_maker.make_template(solution)
    later = [line.strip() for line in generated.splitlines() if template_maker.LATER_HINT.match(line.strip())]
    assert not later, f"{solution.name}: the template shows later hints {later}"
    for todo, hints in template_maker.later_hints(solution):
        if hints:
            pointer = f"# More hints: uv run python -m tests.hint {todo.exercise}"
            assert pointer in generated, f"{solution.name}: TODO {todo.exercise} lacks {pointer!r}"


def test_hint_command_prints_the_later_hints() -> None:
    with_hints = [
        (todo, hints)
        for solution in SOLUTIONS
        for todo, hints in template_maker.later_hints(solution)
        if hints
    ]
    assert with_hints, "no TODO has a Hint 2: the hint command would have nothing to show"
    todo, hints = with_hints[0]
    result = subprocess.run(
        [sys.executable, "-m", "tests.hint", todo.exercise, "--all"],  # --all keeps no state
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert hints[0] in result.stdout, f"`python -m tests.hint {todo.exercise}` did not print {hints[0]!r}"
    unknown = subprocess.run(
        [sys.executable, "-m", "tests.hint", "9.9"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )
    assert unknown.returncode == 2 and "9.9" in unknown.stderr
