"""4.1's namer and what it knows (issue 49): ``restore_rng`` picking one rank's generator states
out of a file that holds 12 ranks' (keys ``rank<r>/...``), listed rank 0 first and rank 11
first; the realistic mistakes, each off by the prefix, by which duplicate wins, or by a rank.

The grader measures whose saved draws each rank drew after the restore; that is planted here
by a selection of our own with one switch per factor.

``atomic_write``'s durability check names one cause: why an fsync before the rename saw fewer
bytes than were written (it came before write(f) wrote them, or they sat unflushed in Python's
buffer); the grader records when write(f) returned, which tells the two apart, and names either
only when it is the only problem. Its table plants the recorded fsyncs and renames of a write of
our own, one switch per step. The rest of 4.1's failures state the property a check measured:

- atomic_write's successful write holding other bytes describes, names no cause;
- "os.fsync was never called" describes, names no cause (what was counted, and the fix);
- a failed write returning normally, leaving other bytes in place of the old file, or leaving
  files behind describes, names no cause (what the folder holds against the old file);
- the temporary file outside the target's folder, or no os.replace onto the path, describes,
  names no cause (the paths the grader saw renamed);
- the durability check's other lines (no fsync of the file before the rename; no fsync of the
  folder after it) describe, name no cause (the order of the fsyncs and renames seen);
- the manifest, keep-k and skipped-checkpoint checks describe, name no cause (files and log lines
  found against those expected).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if str(Path(__file__).parent) not in sys.path:  # loaded by path: the grader's folder
    sys.path.insert(0, str(Path(__file__).parent))
from grade_4_1_checkpoint import RNG_ORDERS, RNG_RANKS, durability_problem, rng_restore_verdict
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


# ----------------------------------------------------------------------------- atomic_write

WRITE_FACTORS: dict[str, tuple[str, ...]] = {
    "flush": ("before the fsync", "none"),
    "file fsync": ("after the write", "before the write", "after the rename", "none"),
    "move": ("os.replace", "os.rename"),
    "folder fsync": ("after the rename", "before the rename", "none"),
}
WRITE_RIGHT = {factor: values[0] for factor, values in WRITE_FACTORS.items()}
WRITE_KNOWN = {
    "no flush": {"flush": "none"},
    "fsync before write": {"file fsync": "before the write"},
}
TARGET, TEMPORARY, NBYTES = Path("/ckpt/state.pt"), "/ckpt/.state.pt.tmp", 1000
WRITE_CASE = "one atomic_write of 1000 bytes (less than Python's buffer)"


def write_measure(changes: dict[str, str]) -> list[tuple[str, str, int]]:
    """The fsyncs and renames the grader records from an atomic_write done ``changes``' way:
    a file's fsync sees only the bytes that left Python's buffer (flushed, or at close)."""
    way = WRITE_RIGHT | changes
    events: list[tuple[str, str, int]] = []
    visible = 0  # bytes the operating system holds
    if way["file fsync"] == "before the write":
        events.append(("fsync file", TEMPORARY, visible))
    events.append(("wrote", "", 0))
    if way["flush"] == "before the fsync":
        visible = NBYTES
    if way["file fsync"] == "after the write":
        events.append(("fsync file", TEMPORARY, visible))
    if way["folder fsync"] == "before the rename":
        events.append(("fsync folder", str(TARGET.parent), 0))
    visible = NBYTES  # closed
    if way["move"] == "os.replace":
        events += [("replace", TEMPORARY, 0), ("replaced onto", str(TARGET), 0)]
    if way["file fsync"] == "after the rename":
        events.append(("fsync file", str(TARGET), visible))
    if way["folder fsync"] == "after the rename":
        events.append(("fsync folder", str(TARGET.parent), 0))
    return events


def write_neighbours(key: str) -> Sequence[tuple[str, Any]]:
    return one_factor_away(
        WRITE_KNOWN[key], WRITE_KNOWN.values(), WRITE_RIGHT, WRITE_FACTORS, write_measure
    )


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
    NamerTable(
        exercise="4.1",
        function="atomic_write (the fsyncs and the rename)",
        factors=tuple(f"{f} ({' / '.join(v)})" for f, v in WRITE_FACTORS.items()),
        cases=(WRITE_CASE,),
        mistakes=(
            KnownMistake(
                "no flush", "the flush before the fsync", WRITE_CASE, "still in Python's own buffer"
            ),
            KnownMistake(
                "fsync before write",
                "the fsync's place: before write(f)",
                WRITE_CASE,
                "came before write(f) wrote them",
            ),
        ),
        right=lambda: write_measure({}),
        plant=lambda key: write_measure(WRITE_KNOWN[key]),
        name=lambda events: durability_problem(events, TARGET, NBYTES),
        neighbours=write_neighbours,
    ),
)
