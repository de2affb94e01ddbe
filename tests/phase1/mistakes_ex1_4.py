"""1.4's namer and what it knows (issue 49): the bytes sent per step the trainer reports, and
its realistic mistakes, each off by what it counts.

The grader trains on 4 ranks with each hand-written all-reduce (at 4 ranks 2(n-1)/n·S, (n-1)·S
and the payload S all differ; at 2 ranks the first equals S) and reads rank 0's report. The
mistakes are planted by the byte counts of the two strategies, computed here from the ranks'
sends (the root is rank 0), one switch per thing counted.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if str(Path(__file__).parent) not in sys.path:  # loaded by path: the grader's folder
    sys.path.insert(0, str(Path(__file__).parent))
from grade_1_4_trainer import bytes_sent_verdict
from mistake_tables import KnownMistake, NamerTable

N, SIZE = 4, 4 * 1000  # the graded world; S (the grader's comes from the model: any S will do)
STRATEGIES = ("reduce_broadcast", "direct_exchange")
CASES = tuple(f"--all-reduce {s} on {N} ranks" for s in STRATEGIES)
FACTORS: dict[str, tuple[str, ...]] = {
    "counted": (
        "bytes through send/isend, averaged over ranks",
        "the payload S",
        "nothing (torch's all-reduce ran)",
        "bytes sent and received",
        "rank 0's own, not averaged",
    ),
}
RIGHT = {factor: values[0] for factor, values in FACTORS.items()}
KNOWN = {"payload": {"counted": "the payload S"}, "none": {"counted": FACTORS["counted"][2]}}


def sent_by(strategy: str, rank: int) -> int:
    """Bytes rank ``rank`` sends in one all-reduce of S bytes (received: the same)."""
    if strategy == "reduce_broadcast":
        return (N - 1) * SIZE if rank == 0 else SIZE
    return (N - 1) * SIZE


def reported(strategy: str, counted: str) -> float:
    per_rank = [sent_by(strategy, r) for r in range(N)]
    return {
        FACTORS["counted"][0]: sum(per_rank) / N,
        "the payload S": float(SIZE),
        "nothing (torch's all-reduce ran)": 0.0,
        "bytes sent and received": 2 * sum(per_rank) / N,
        "rank 0's own, not averaged": float(per_rank[0]),
    }[counted]


def measure(changes: dict[str, str]) -> dict[str, float]:
    setting = RIGHT | changes
    return {
        case: reported(s, setting["counted"]) for case, s in zip(CASES, STRATEGIES, strict=True)
    }


def name(measured: dict[str, float]) -> str | None:
    verdicts = [
        bytes_sent_verdict(s, N, SIZE, measured[case])
        for case, s in zip(CASES, STRATEGIES, strict=True)
    ]
    return "\n".join(v for v in verdicts if v) or None


def neighbours(key: str) -> Sequence[tuple[str, Any]]:
    known = [RIGHT | k for k in KNOWN.values()]
    return [
        (f"counted: {value}", measure({"counted": value}))
        for value in FACTORS["counted"]
        if RIGHT | {"counted": value} not in [RIGHT, *known]
    ]


TABLES = (
    NamerTable(
        exercise="1.4",
        function="the step's bytes_sent (DataParallelLoop)",
        factors=tuple(f"{f} ({' / '.join(v)})" for f, v in FACTORS.items()),
        cases=CASES,
        mistakes=(
            KnownMistake("payload", "reports S", CASES[0], "That is the payload S"),
            KnownMistake("none", "reports 0", CASES[0], "No byte went through send/isend"),
        ),
        right=lambda: measure({}),
        plant=lambda key: measure(KNOWN[key]),
        name=name,
        neighbours=neighbours,
    ),
)
