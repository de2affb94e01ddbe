"""The hint ladder: which TODO a learner is on, which rung of its hints comes next.

A TODO's hints are rungs: Hint 1 in the template, Hint 2 (what to consider) and Hint 3 (the
answer in words, never pasteable code) with the reference, printed by ``tests.hint``
one at a time so that a learner who wants a nudge on one TODO does not read every answer of the
exercise. Which TODO is "next" is read from the learner's own template: the first whose
``raise NotImplementedError("TODO x.y: <goal> ...")`` is still there. Which rung comes next is
remembered in a small state file (``.hints/ladder.json`` at the project root, ignored by git, so
a fresh clone starts at Hint 2 everywhere); ``tests.hint --reset`` forgets it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from exercises import BY_ID

from course import template_maker

ROOT = Path(__file__).resolve().parents[1]
STATE_FILE = ROOT / ".hints" / "ladder.json"
_HINT = re.compile(r"Hint (?P<level>\d+)\s*:")
# a raise the template maker wrote, its message split over adjacent string literals
_RAISE = re.compile(r'raise\s+NotImplementedError\(\s*(?P<pieces>(?:"(?:[^"\\]|\\.)*"\s*)+)\)')


@dataclass(frozen=True)
class TodoHints:
    """One TODO of an exercise with its later hints, and where the learner writes it."""

    exercise: str
    number: int  # 1-based within the exercise, in course order
    goal: str
    ref: str  # guidelines.md#anchor
    template: Path  # relative to the project root
    rungs: dict[int, list[str]]  # hint level (2, 3, ...) -> its lines

    @property
    def key(self) -> str:
        """The state file's name for this TODO: its goal, which survives renumbering."""
        return f"{self.exercise} {self.goal}"


def exercise_todos(exercise_id: str) -> list[TodoHints]:
    """Every TODO of an exercise in course order (its modules in the order the exercise lists
    them, file order within a module), with its later hints; empty for an unknown id."""
    ex = BY_ID.get(exercise_id)
    if ex is None:
        return []

    def course_order(solution: Path) -> int:
        stem = solution.stem
        return ex.modules.index(stem) if stem in ex.modules else len(ex.modules)

    found: list[TodoHints] = []
    for solution in sorted(template_maker.solution_files(), key=course_order):
        template = template_maker.template_path(solution).relative_to(template_maker.ROOT)
        for todo, hints in template_maker.later_hints(solution):
            if todo.exercise == exercise_id:
                rungs = split_rungs(hints)
                found.append(
                    TodoHints(exercise_id, len(found) + 1, todo.goal, todo.ref, template, rungs)
                )
    return found


def split_rungs(hints: list[str]) -> dict[int, list[str]]:
    """``["Hint 2: a", "b", "Hint 3: c"]`` -> ``{2: ["Hint 2: a", "b"], 3: ["Hint 3: c"]}``."""
    rungs: dict[int, list[str]] = {}
    level = None
    for line in hints:
        match = _HINT.match(line)
        if match:
            level = int(match["level"])
            rungs[level] = []
        if level is not None:
            rungs[level].append(line)
    return rungs


def open_raises(template: Path) -> list[tuple[int, str]]:
    """(line, message) of every ``raise NotImplementedError("...")`` left in a template.

    Read as text, not parsed, so that a template in the middle of being written (a syntax error
    elsewhere) still answers; commented-out lines do not count.
    """
    if not template.exists():
        return []
    lines = template.read_text().splitlines()
    code = "\n".join("" if line.lstrip().startswith("#") else line for line in lines)
    return [
        (
            code[: match.start()].count("\n") + 1,
            "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', match["pieces"])),
        )
        for match in _RAISE.finditer(code)
    ]


def unwritten_line(todo: TodoHints, root: Path = ROOT) -> int | None:
    """The line of the TODO's raise in the learner's template, or None once it is written."""
    wanted = " ".join(f"TODO {todo.exercise}: {todo.goal}".split())
    for line, message in open_raises(root / todo.template):
        if " ".join(message.split()).startswith(wanted):
            return line
    return None


class LadderState:
    """The highest rung shown per TODO, kept in a JSON file; a missing or unreadable file is an
    empty ladder (a learner may delete it, and a broken one must not block a hint)."""

    def __init__(self, path: Path = STATE_FILE) -> None:
        self.path = path
        try:
            loaded = json.loads(path.read_text())
        except (OSError, ValueError):
            loaded = {}
        self.shown: dict[str, int] = {
            key: value
            for key, value in (loaded.items() if isinstance(loaded, dict) else [])
            if isinstance(key, str) and isinstance(value, int)
        }

    def next_rung(self, todo: TodoHints) -> int:
        """The lowest rung above the highest one shown; the last rung again at the top."""
        levels = sorted(todo.rungs)
        above = [level for level in levels if level > self.shown.get(todo.key, 1)]
        return above[0] if above else levels[-1]

    def record(self, todo: TodoHints, level: int) -> None:
        self.shown[todo.key] = max(level, self.shown.get(todo.key, 1))
        self._save()

    def reset(self, exercise_id: str) -> int:
        """Forget every rung shown for an exercise; returns how many TODOs were remembered."""
        forgotten = [key for key in self.shown if key.split(" ", 1)[0] == exercise_id]
        for key in forgotten:
            del self.shown[key]
        if forgotten:
            self._save()
        return len(forgotten)

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.shown, indent=1, sort_keys=True) + "\n")
