"""Measure your own code against the goal its guide sets: ``uv run python -m tests.bench 3.1``.

Some exercises have a goal beyond right values: a speed (the ring as fast as ``dist.all_reduce``),
a shape of the work (a pipeline's bubble as small as the formula says) or a size (ZeRO's bytes
equal to the paper's). For each, one command measures *your* implementation (``--impl
templates``, the default) in the same run as PyTorch's baseline, prints the table, and ends with
one verdict line. It only needs the TODOs of its own exercise: a later exercise left unwritten
never costs you the table.

A timed goal is measured in interleaved repeats (yours, the baseline's, yours, ...), one ratio
per pair, and judged on their median and middle half (interquartile range) and on the machine's
load (tests/benches/verdict.py, course/verdicts.py):

* ``goal met``: the whole middle half on the goal's side;
* ``goal not met``: the whole middle half on the wrong side, and the machine not busy;
* ``inconclusive: the machine is busy (load X on N cores), re-run``, or ``inconclusive: the
  spread (a-b) straddles the goal, re-run with more repeats`` (``--repeats N``).

Busy: other work's 1-minute load (the load less what this run's own ranks added) above the
cores the run leaves free plus half a core. A count of bytes is exact and is met or not met.

    uv run python -m tests.bench --list            # the exercises that have a goal to measure
    uv run python -m tests.bench 3.1               # your ring against dist.all_reduce
    uv run python -m tests.bench 3.1 --impl solutions --quick

Exit status: 0 goal met, 1 goal not met, 2 the measurement could not run (an unwritten TODO,
a bad flag), 3 inconclusive (a busy machine, or a spread across the goal: re-run); the last
line says which.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "tests"):  # the project, and tests/ as pytest's pythonpath has it
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

# exercise id -> module under tests/benches/ with ``GOAL`` (one line) and ``main(argv) -> int``
BENCHES: dict[str, str] = {
    "2.5": "bench_2_5_bubble",
    "2.7": "bench_2_7_zigzag",
    "3.1": "bench_3_1_ring",
    "3.4": "bench_3_4_ddp",
    "3.5": "bench_3_5_zero",
    "3.8": "bench_3_8_moe",
    "4.4": "bench_4_4_compression",
    "4.7": "bench_4_7_traffic",
}


def _load(exercise: str) -> ModuleType:
    return importlib.import_module(f"benches.{BENCHES[exercise]}")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if args else 2
    if args[0] == "--list":
        for exercise in BENCHES:
            print(f"{exercise}  {_load(exercise).GOAL}")
        return 0
    exercise, rest = args[0], args[1:]
    if exercise not in BENCHES:
        known = ", ".join(BENCHES) or "none yet"
        print(f"exercise {exercise!r} has no goal to measure (exercises with one: {known})")
        return 2
    return int(_load(exercise).main(rest))


if __name__ == "__main__":
    sys.exit(main())
