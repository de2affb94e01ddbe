"""The last line of every ``tests.bench`` run: the goal, what was measured, and the verdict.

Every bench with a *speed* goal (2.5's bubble, 2.7's balance, 3.1's ring, 3.4's DDP) measures
the same way, with the API below (the rule itself lives in ``course/verdicts.py``, so that the
benchmarks in ``solutions/`` whose results the guides quote judge their cells by it too):

* :func:`interleave`: repeats of your code and the baseline alternate, A, B, A, B, ..., in the
  same processes (or world), so that load which comes and goes hits both alike;
* :func:`pair_ratios`: one ratio per repeat pair (a goal without a baseline, such as a bubble
  against its formula, has one value per repeat instead);
* :class:`Spread`: the median of those values and their interquartile range (the middle half);
* :class:`LoadMeter` / :class:`Load`: the machine's 1-minute load (``os.getloadavg()``) before
  and after, less what the run's own ranks added, against the cores it may use
  (``os.sched_getaffinity(0)``); *busy* is other work above the spare cores + 0.5;
* :meth:`Goal.judge` / :meth:`Goal.judge_cells`: the three outcomes, and :func:`finish` prints
  the line and returns the exit code:

  ====================  ==========================================================  ====
  ``goal met``          the whole middle half on the goal's side                     0
  ``goal not met``      the whole middle half on the wrong side, machine not busy    1
  ``inconclusive: ...`` ``the machine is busy (load X on N cores), re-run``, or      3
                        ``the spread (a-b) straddles the goal, re-run with more
                        repeats``
  ====================  ==========================================================  ====

  (2: the measurement could not run.) The exact definitions are in ``course/verdicts.py``.

Goals that are exact (bytes equal to a formula: 3.5, 3.8, 4.4, 4.7) cannot be flipped by load
and keep one number: :meth:`Goal.verdict`.
"""

from __future__ import annotations

import argparse

from course.impl import IMPLS
from course.verdicts import (
    BUSY_MARGIN,
    EXIT_COULD_NOT_RUN,
    EXIT_INCONCLUSIVE,
    EXIT_MET,
    EXIT_NOT_MET,
    INCONCLUSIVE,
    MET,
    NOT_MET,
    Goal,
    Load,
    LoadMeter,
    Spread,
    Verdict,
    interleave,
    pair_ratios,
    tally,
)

__all__ = [
    "BUSY_MARGIN", "EXIT_COULD_NOT_RUN", "EXIT_INCONCLUSIVE", "EXIT_MET", "EXIT_NOT_MET",
    "INCONCLUSIVE", "MET", "NOT_MET", "Goal", "Load", "LoadMeter", "Spread", "Verdict",
    "finish", "interleave", "more_repeats", "pair_ratios", "parser", "tally",
]  # fmt: skip


def parser(description: str, *, repeats: int | None = None) -> argparse.ArgumentParser:
    """The flags every bench takes: whose code (default: yours) and a quicker, noisier run; a
    timed bench (``repeats``: its default count) also takes ``--repeats``."""
    p = argparse.ArgumentParser(prog="python -m tests.bench", description=description)
    p.add_argument("--impl", choices=IMPLS, default="templates", help="whose code (default: yours)")
    p.add_argument("--quick", action="store_true", help="fewer repeats: faster, noisier")
    if repeats is not None:
        p.add_argument(
            "--repeats", type=int, default=None, metavar="N",
            help=f"interleaved repeats per cell (default {repeats}; more: a narrower spread)",
        )  # fmt: skip
    return p


def more_repeats(current: int, flag: str = "--repeats") -> str:
    """What an inconclusive verdict suggests: ``more repeats (--repeats 24)``."""
    return f"more repeats ({flag} {2 * current})"


def finish(verdict: Verdict) -> int:
    """Print the verdict's line (the last line of the run) and return its exit code."""
    print(verdict.line)
    return verdict.code
