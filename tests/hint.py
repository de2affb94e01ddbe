"""Climb the hints of an exercise one rung at a time: ``uv run python -m tests.hint 3.1``.

A template shows each TODO's goal, its invariant and Hint 1. When you want more, this prints the
next rung for the TODO you are on (the first one of the exercise whose ``raise
NotImplementedError`` is still in your template), and only that: Hint 2 (what to consider: the
questions and facts that lead to the design) the first time, then rungs that settle one decision
each, and last the answer in words (never a line to paste).

    uv run python -m tests.hint 3.1            # the next rung of the TODO you are on
    uv run python -m tests.hint 3.1 --todo 2   # the next rung of the exercise's second TODO
    uv run python -m tests.hint 3.1 --level 3  # a given rung (2, 3, ...), whatever came before
    uv run python -m tests.hint 3.1 --reset    # start the exercise's ladders again at Hint 2
    uv run python -m tests.hint 3.1 --all      # every later hint of every TODO (instructors)

The rungs you have seen are remembered in .hints/ladder.json (see tests/hint_ladder.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "tests"):  # the project, and tests/ as pytest's pythonpath has it
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from exercises import BY_ID, EXERCISES  # noqa: E402
from hint_ladder import STATE_FILE, LadderState, TodoHints, exercise_todos, unwritten_line  # noqa: E402

COMMAND = "uv run python -m tests.hint"


class UsageError(ValueError):
    """A bad exercise id, --todo or --level; the message names the value and the fix."""


def dump(todos: list[TodoHints]) -> str:
    """Every later hint of every TODO, as instructors read them (``--all``)."""
    paragraphs = []
    for todo in todos:
        lines = [line for level in sorted(todo.rungs) for line in todo.rungs[level]]
        body = "\n".join(f"  {line}" for line in lines) or "  (no further hints: see the guide)"
        heading = f"TODO {todo.exercise} #{todo.number}: {todo.goal}"
        paragraphs.append(f"{heading}\n  in {todo.template}\n{body}")
    return "\n\n".join(paragraphs)


def rung_text(todo: TodoHints, level: int, total: int, root: Path) -> str:
    """One rung, with the TODO and the template it belongs to, and how to go on."""
    line = unwritten_line(todo, root)
    where = f"{todo.template}:{line}" if line else f"{todo.template} (written already)"
    guide = f"{todo.template.parent}/{todo.ref}"
    head = [f"TODO {todo.exercise} #{todo.number} of {total}: {todo.goal}", f"  in {where}"]
    if not todo.rungs:
        return "\n".join([*head, f"  no hints beyond Hint 1 (in your template): read {guide}"])
    body = [f"  {text}" for text in todo.rungs[level]]
    higher = [rung for rung in sorted(todo.rungs) if rung > level]
    if higher:
        after = [
            f"Next rung: ask again (without --level) for Hint {higher[0]} of this TODO, or",
            f"  {COMMAND} {todo.exercise} --todo {todo.number} --level {higher[0]}",
        ]
    else:
        after = [
            f"That was the last rung of this TODO: read {guide} again,",
            f"and let the tests' messages guide you. To climb {todo.exercise}'s ladders again "
            "from Hint 2, run",
            f"  {COMMAND} {todo.exercise} --reset",
        ]
    return "\n".join([*head, *body, "", *after])


def pick_todo(todos: list[TodoHints], number: int | None, root: Path) -> TodoHints | str:
    """The TODO asked for, or the first one not written yet; a message when all are written."""
    if number is not None:
        if not 1 <= number <= len(todos):
            listed = "".join(f"\n  {todo.number}: {todo.goal}" for todo in todos)
            raise UsageError(
                f"--todo {number}: exercise {todos[0].exercise} has TODOs 1 to {len(todos)}; "
                f"pick one of them:{listed}"
            )
        return todos[number - 1]
    for todo in todos:
        if unwritten_line(todo, root) is not None:
            return todo
    files = ", ".join(sorted({str(todo.template) for todo in todos}))
    ex = BY_ID[todos[0].exercise]
    return (
        f"Every TODO of {ex.id} is written in {files} (no `raise NotImplementedError` left).\n"
        f"Grade it: uv run pytest tests/test_{ex.phase.split('_')[0]}.py -m {ex.marker}\n"
        f"A hint on one of them: {COMMAND} {ex.id} --todo K (K = 1 to {len(todos)})."
    )


def check_level(todo: TodoHints, level: int) -> None:
    """Refuse a rung the TODO does not have, saying which it has."""
    if level in todo.rungs:
        return
    if level == 1:
        raise UsageError(
            f"--level 1: Hint 1 of TODO {todo.exercise} #{todo.number} is in your template, "
            f"above its raise ({todo.template}); ask for --level 2 or higher"
        )
    levels = sorted(todo.rungs)
    have = f"Hint {levels[0]} only" if len(levels) == 1 else "Hints " + ", ".join(map(str, levels))
    raise UsageError(
        f"--level {level}: TODO {todo.exercise} #{todo.number} has {have} beyond the Hint 1 of "
        f"your template; ask for --level {levels[-1]} or leave --level out"
    )


def run(args: argparse.Namespace, root: Path, state_file: Path) -> str:
    """What the command prints; raises UsageError for a bad argument."""
    todos = exercise_todos(args.exercise)
    if not todos:
        known = ", ".join(ex.id for ex in EXERCISES if exercise_todos(ex.id))
        raise UsageError(
            f"exercise {args.exercise!r} has no TODOs with hints: exercises are numbered like "
            f"2.5 (one of {known})"
        )
    if args.all:
        return dump(todos)
    state = LadderState(state_file)
    if args.reset:
        count = state.reset(args.exercise)
        return (
            f"Forgot the rungs shown for {count} TODO(s) of {args.exercise}: the next "
            f"{COMMAND} {args.exercise} starts again at Hint 2."
        )
    todo = pick_todo(todos, args.todo, root)
    if isinstance(todo, str):
        return todo
    if not todo.rungs:
        return rung_text(todo, 0, len(todos), root)
    level = args.level if args.level is not None else state.next_rung(todo)
    check_level(todo, level)
    state.record(todo, level)
    return rung_text(todo, level, len(todos), root)


def main(argv: list[str] | None = None, *, root: Path = ROOT, state_file: Path = STATE_FILE) -> int:
    parser = argparse.ArgumentParser(
        prog=COMMAND,
        description="Show the next hint of the TODO you are on, one rung at a time.",
    )
    parser.add_argument("exercise", help="exercise id, e.g. 3.1")
    parser.add_argument("--todo", type=int, help="the K-th TODO of the exercise (1-based)")
    parser.add_argument(
        "--level", type=int, help="a given rung: 2 (what to consider), 3, ... (the last: the answer)"
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--reset", action="store_true", help="start the exercise's ladders again")
    mode.add_argument("--all", action="store_true", help="every later hint at once (instructors)")
    args = parser.parse_args(argv)
    if (args.reset or args.all) and (args.todo is not None or args.level is not None):
        parser.error("--reset and --all take no --todo or --level")
    try:
        print(run(args, root, state_file))
    except UsageError as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
