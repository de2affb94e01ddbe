"""Make each exercise template from its solution, so the two can never drift apart.

A solution marks every piece a learner writes with a comment block and a fenced region::

    # TODO 1.2: average the gradients across ranks, in place.
    # Invariant: ...
    # Hint 1: ...      (a nudge)
    # Hint 2: ...      (the shape of the solution, never its code)
    # See guidelines.md#12-broadcast-and-gradient-averaging
    # >>> solution
    ...the reference code...
    # <<< solution

The template keeps the goal, the invariant and Hint 1, replaces the later hints with one line
saying how to read them when the learner chooses to (``uv run python -m tests.hint 1.2``, see
tests/hint.py), and replaces the fenced region with
``raise NotImplementedError("TODO 1.2: <goal> (see <phase>/guidelines.md#<anchor>)")``.
Imports of sibling solution modules that have templates are pointed at those templates, so a
learner's trainer runs on the learner's own sampler and all-reduce.

    uv run python -m course.template_maker --check   # exit 1 if a template drifted
    uv run python -m course.template_maker --write   # regenerate (maintainers only:
                                                               # it overwrites learners' work)
    uv run python -m course.template_maker --complete  # CI, in a throwaway copy
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINE = 100  # ruff's line length (pyproject.toml)
SOLUTION_START = "# >>> solution"
SOLUTION_END = "# <<< solution"
TODO_LINE = re.compile(r"#\s*TODO (?P<id>\d+\.\d+)\s*:\s*(?P<goal>.+?)\s*$")
SEE_LINE = re.compile(r"#\s*See (?P<ref>guidelines\.md#[a-z0-9-]+)")
LATER_HINT = re.compile(r"#\s*Hint (?:[2-9]|\d\d+)\s*:")
SIBLING_IMPORT = re.compile(
    r"^(?P<indent>\s*)from solutions\.(?P<phase>phase\d+_\w+)\.(?P<mod>\w+) import"
)


class TemplateError(ValueError):
    """A solution's TODO markers are malformed; the message names the file and line."""


@dataclass(frozen=True)
class Todo:
    """One TODO region: its exercise id, goal and guidelines reference."""

    exercise: str
    goal: str
    ref: str
    line: int


def has_todos(solution: Path) -> bool:
    return SOLUTION_START in solution.read_text()


def template_path(solution: Path) -> Path:
    """solutions/phaseN_x/mod.py -> phaseN_x/template_mod.py"""
    return ROOT / solution.parent.name / f"template_{solution.name}"


def solution_files() -> list[Path]:
    """Every solution module that has at least one TODO region."""
    return sorted(path for path in (ROOT / "solutions").glob("phase*/*.py") if has_todos(path))


def _comment_block(lines: list[str], end: int) -> list[str]:
    """The contiguous comment lines just above index ``end``."""
    block: list[str] = []
    i = end - 1
    while i >= 0 and lines[i].lstrip().startswith("#"):
        block.insert(0, lines[i].strip())
        i -= 1
    return block


def _parse_todo(block: list[str], where: str) -> Todo:
    todo = next((m for m in map(TODO_LINE.match, block) if m), None)
    see = next((m for m in map(SEE_LINE.match, block) if m), None)
    if todo is None or see is None:
        raise TemplateError(
            f"{where}: the comment block above '{SOLUTION_START}' needs a "
            "'# TODO <id>: <goal>' line and a '# See guidelines.md#<anchor>' line"
        )
    return Todo(todo["id"], todo["goal"].rstrip("."), see["ref"], 0)


def _raise_lines(indent: str, todo: Todo, phase: str) -> list[str]:
    """``raise NotImplementedError("TODO x.y: goal (see ...)")`` wrapped to the line length."""
    width = MAX_LINE - len(indent) - 7  # four spaces, two quotes, one trailing space
    goal = textwrap.wrap(f"TODO {todo.exercise}: {todo.goal}", width, break_long_words=False)
    pieces = [*goal, f"(see {phase}/{todo.ref})"]
    body = [f'{indent}    "{piece} "' for piece in pieces[:-1]] + [f'{indent}    "{pieces[-1]}"']
    return [f"{indent}raise NotImplementedError(", *body, f"{indent})"]


def make_template(solution: Path) -> str:
    """The template text for one solution module."""
    phase = solution.parent.name
    rel = solution.relative_to(ROOT)
    lines = solution.read_text().splitlines()
    out = [
        "# Exercise template (made by course/template_maker.py; this copy is yours to edit).",
        "# Replace every `raise NotImplementedError(...)` with your code; the comments above each",
        "# one say what to build. Grade yourself: "
        f"uv run pytest tests/test_{phase.split('_')[0]}.py",
    ]
    lines = _hide_later_hints(lines, rel)
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if stripped == SOLUTION_START:
            where = f"{rel}:{i + 1}"
            todo = _parse_todo(_comment_block(lines, i), where)
            indent = line[: len(line) - len(line.lstrip())]
            end = next(
                (j for j in range(i + 1, len(lines)) if lines[j].strip() == SOLUTION_END), None
            )
            nested = next(
                (j for j in range(i + 1, end or len(lines)) if lines[j].strip() == SOLUTION_START),
                None,
            )
            if end is None or nested is not None:
                raise TemplateError(f"{where}: '{SOLUTION_START}' has no matching '{SOLUTION_END}'")
            out += _raise_lines(indent, todo, phase)
            i = end + 1
            continue
        if stripped == SOLUTION_END:
            raise TemplateError(f"{rel}:{i + 1}: '{SOLUTION_END}' without '{SOLUTION_START}'")
        out.append(_point_at_templates(line))
        i += 1
    return "\n".join(out) + "\n"


def _hide_later_hints(lines: list[str], rel: Path) -> list[str]:
    """Replace ``# Hint 2:`` and later hints (up to the ``# See`` line) of every TODO block with
    one line that says how to read them, so a learner reads Hint 1 alone first."""
    hidden: set[int] = set()
    pointer: dict[int, str] = {}
    for start, line in enumerate(lines):
        if line.strip() != SOLUTION_START:
            continue
        first = start
        while first > 0 and lines[first - 1].lstrip().startswith("#"):
            first -= 1
        block = range(first, start)
        later = next((j for j in block if LATER_HINT.match(lines[j].strip())), None)
        if later is None:
            continue
        todo = _parse_todo([lines[j].strip() for j in block], f"{rel}:{start + 1}")
        end = next(j for j in block if SEE_LINE.match(lines[j].strip()))
        if end < later:
            raise TemplateError(f"{rel}:{later + 1}: hints must come before the '# See' line")
        indent = lines[later][: len(lines[later]) - len(lines[later].lstrip())]
        hidden.update(range(later, end))
        pointer[later] = f"{indent}# More hints: uv run python -m tests.hint {todo.exercise}"
    out: list[str] = []
    for j, line in enumerate(lines):
        if j in pointer:
            out.append(pointer[j])
        elif j not in hidden:
            out.append(line)
    return out


def later_hints(solution: Path) -> list[tuple[Todo, list[str]]]:
    """Each TODO of a solution with its hints after Hint 1 (comment markers stripped)."""
    lines = solution.read_text().splitlines()
    found = []
    for todo in todos(solution):
        start = todo.line - 1
        first = start
        while first > 0 and lines[first - 1].lstrip().startswith("#"):
            first -= 1
        hints: list[str] = []
        inside = False
        for j in range(first, start):
            text = lines[j].strip()
            if LATER_HINT.match(text):
                inside = True
            elif SEE_LINE.match(text):
                inside = False
            if inside:
                hints.append(text.removeprefix("#").strip())
        found.append((todo, hints))
    return found


def _point_at_templates(line: str) -> str:
    """``from solutions.phaseN_x.mod import ...`` -> ``from phaseN_x.template_mod import ...``
    when ``mod`` has a template, so a learner's module uses the learner's other modules."""
    match = SIBLING_IMPORT.match(line)
    if match:
        sibling = ROOT / "solutions" / match["phase"] / f"{match['mod']}.py"
        if sibling.exists() and has_todos(sibling):
            line = line.replace(
                f"from solutions.{match['phase']}.{match['mod']} import",
                f"from {match['phase']}.template_{match['mod']} import",
            )
    return line


def make_completed_template(solution: Path) -> str:
    """The template as a learner who got every TODO right would leave it: the solution's code
    in place of each raise, imports still pointing at the other templates. CI grades these with
    ``--impl templates`` to prove the learner's path (graders, cross-template imports) works."""
    lines = solution.read_text().splitlines()
    kept = [line for line in lines if line.strip() not in (SOLUTION_START, SOLUTION_END)]
    return "\n".join(_point_at_templates(line) for line in kept) + "\n"


def todos(solution: Path) -> list[Todo]:
    """Every TODO region of a solution, in file order."""
    lines = solution.read_text().splitlines()
    found = []
    for i, line in enumerate(lines):
        if line.strip() == SOLUTION_START:
            todo = _parse_todo(_comment_block(lines, i), f"{solution}:{i + 1}")
            found.append(Todo(todo.exercise, todo.goal, todo.ref, i + 1))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate or check the exercise templates.")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 if a template differs")
    mode.add_argument(
        "--write",
        action="store_true",
        help="maintainers only: overwrite every phase*/template_*.py with what the solutions "
        "make (a learner's work in them is lost)",
    )
    mode.add_argument(
        "--complete",
        action="store_true",
        help="overwrite the templates with completed ones (CI, in a throwaway copy only)",
    )
    parser.add_argument(
        "--phase",
        metavar="FOLDER",
        help="only the templates of this phase folder (e.g. phase2_advanced); default: all",
    )
    args = parser.parse_args(argv)
    solutions = [s for s in solution_files() if args.phase in (None, s.parent.name)]
    if args.phase is not None and not solutions:
        parser.error(f"--phase {args.phase}: no solution with TODOs in solutions/{args.phase}/")
    if args.complete:
        for solution in solutions:
            template_path(solution).write_text(make_completed_template(solution))
        print(f"completed {len(solutions)} templates")
        return 0
    drifted = 0
    for solution in solutions:
        target = template_path(solution)
        text = make_template(solution)
        current = target.read_text() if target.exists() else None
        if current == text:
            continue
        if args.write:
            target.write_text(text)
            print(f"wrote {target.relative_to(ROOT)}")
        else:
            drifted += 1
            print(
                f"{target.relative_to(ROOT)} differs from what {solution.relative_to(ROOT)} makes"
            )
    return 1 if drifted else 0


if __name__ == "__main__":
    sys.exit(main())
