"""Read the later hints of an exercise, when you choose to: ``uv run python -m tests.hint 2.5``.

A template shows each TODO's goal, its invariant and Hint 1 only, so that Hint 1 can be read
alone. The later hints (the shape of the solution, never its code) live with the reference and
are printed here, one TODO at a time, with the place in your template they belong to:

    uv run python -m tests.hint 2.5          # every TODO of exercise 2.5
    uv run python -m tests.hint 2.5 --todo 2 # only the second TODO of 2.5
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "tests"):  # the project, and tests/ as pytest's pythonpath has it
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from exercises import BY_ID  # noqa: E402

from course.template_maker import (  # noqa: E402
    later_hints,
    solution_files,
    template_path,
)


def hints_for(exercise_id: str) -> list[str]:
    """Paragraphs, one per TODO of the exercise, in course order."""
    paragraphs = []
    modules = BY_ID[exercise_id].modules if exercise_id in BY_ID else ()

    def course_order(solution: Path) -> int:  # the exercise's modules in the order it lists them
        return modules.index(solution.stem) if solution.stem in modules else len(modules)

    for solution in sorted(solution_files(), key=course_order):
        for todo, hints in later_hints(solution):
            if todo.exercise != exercise_id:
                continue
            where = template_path(solution).relative_to(ROOT)
            body = "\n".join(f"  {line}" for line in hints) or "  (no further hints: see the guide)"
            paragraphs.append(f"TODO {todo.exercise}: {todo.goal}\n  in {where}\n{body}")
    return paragraphs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Show the later hints of one exercise.")
    parser.add_argument("exercise", help="exercise id, e.g. 2.5")
    parser.add_argument("--todo", type=int, default=None, help="only the N-th TODO (1-based)")
    args = parser.parse_args(argv)
    paragraphs = hints_for(args.exercise)
    if not paragraphs:
        print(f"no TODO of exercise {args.exercise!r}: exercises are numbered like 1.1 or 2.5")
        return 2
    if args.todo is not None:
        if not 1 <= args.todo <= len(paragraphs):
            print(f"--todo {args.todo}: exercise {args.exercise} has {len(paragraphs)} TODOs")
            return 2
        paragraphs = [paragraphs[args.todo - 1]]
    print("\n\n".join(paragraphs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
