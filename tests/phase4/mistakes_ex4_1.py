"""4.1's namer and what it knows (issue 49): ``restore_rng`` picking one rank's generator states
out of a file that holds 12 ranks' (keys ``rank<r>/...``), listed rank 0 first and rank 11
first; the realistic mistakes, each off by the prefix, by which duplicate wins, or by a rank.

The grader measures whose saved draws each rank drew after the restore; that is planted here
by a selection of our own with one switch per factor. The rest of 4.1's failures state the
property a check measured (the old file whole after a crash, the fsync before the rename, a
skipped checkpoint logged with its reason) and name no cause beyond it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if str(Path(__file__).parent) not in sys.path:  # loaded by path: the grader's folder
    sys.path.insert(0, str(Path(__file__).parent))
from grade_4_1_checkpoint import RNG_ORDERS, RNG_RANKS, rng_restore_verdict
from mistake_tables import KnownMistake, NamerTable, one_factor_away

FACTORS: dict[str, tuple[str, ...]] = {
    "prefix": ("rank<r>/", "rank<r> (no slash)"),
    "duplicates": ("the last key wins", "the first key wins"),
    "rank": ("its own", "0", "the next"),
}
RIGHT = {factor: values[0] for factor, values in FACTORS.items()}
KNOWN = {
    "no slash, last wins": {"prefix": "rank<r> (no slash)"},
    "no slash, first wins": {"prefix": "rank<r> (no slash)", "duplicates": "the first key wins"},
    "rank 0's": {"rank": "0"},
}
Measured = dict[tuple[str, int], list[int]]


def restored(order: str, rank: int, s: dict[str, str]) -> list[int]:
    """Whose states a restore with ``s``'s switches leaves in the generators."""
    wanted = {"its own": rank, "0": 0, "the next": (rank + 1) % RNG_RANKS}[s["rank"]]
    prefix = f"rank{wanted}/" if s["prefix"] == "rank<r>/" else f"rank{wanted}"
    keys = [r for r in RNG_ORDERS[order] if f"rank{r}/".startswith(prefix)]
    if not keys:
        return []
    return [keys[-1] if s["duplicates"] == "the last key wins" else keys[0]]


def measure(changes: dict[str, str]) -> Measured:
    s = RIGHT | changes
    return {(o, r): restored(o, r, s) for o in RNG_ORDERS for r in range(RNG_RANKS)}


def name(measured: Measured) -> str | None:
    """The grader fails at the first rank, in its order, that drew another rank's states."""
    for (order, rank), took in measured.items():
        if took != [rank]:
            return rng_restore_verdict(order, rank, took)
    return None


def neighbours(key: str) -> Sequence[tuple[str, Any]]:
    return one_factor_away(KNOWN[key], KNOWN.values(), RIGHT, FACTORS, measure)


CASES = tuple(f"12 ranks, {order} in the file" for order in RNG_ORDERS)
TABLES = (
    NamerTable(
        exercise="4.1",
        function="restore_rng",
        factors=tuple(f"{f} ({' / '.join(v)})" for f, v in FACTORS.items()),
        cases=CASES,
        mistakes=(
            KnownMistake(
                "no slash, last wins",
                "the prefix's slash",
                CASES[0],
                "the last of them in the file won",
            ),
            KnownMistake(
                "no slash, first wins",
                "the prefix's slash",
                CASES[1],
                "the first of them in the file won",
            ),
            KnownMistake(
                "rank 0's", "a rank: 0 for its own", CASES[0], "restored rank 0's states."
            ),
        ),
        right=lambda: measure({}),
        plant=lambda key: measure(KNOWN[key]),
        name=name,
        neighbours=neighbours,
    ),
)
