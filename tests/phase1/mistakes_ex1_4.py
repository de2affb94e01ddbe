"""1.4's namer and what it knows (issue 49): the bytes sent per step the trainer reports, and
its realistic mistakes, each off by what it counts.

The grader trains on 4 ranks with each hand-written all-reduce (at 4 ranks 2(n-1)/n·S, (n-1)·S
and the payload S all differ; at 2 ranks the first equals S) and reads rank 0's report. The
mistakes are planted by the byte counts of the two strategies, computed here from the ranks'
sends (the root is rank 0), one switch per thing counted.

``reduce_totals``' values name a cause (the float32 wire, dicts paired by position, a mean, no
sum at all) only when every value on the rank is what that way gives. Its table plants the
reduction with a tensor all-reduce of our own over the two ranks' dicts, one switch per factor
(the dtype on the wire, the key order, the reduce op). Its collective count describes, names no
cause (it counts the collectives and says one tensor can carry every value).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if str(Path(__file__).parent) not in sys.path:  # loaded by path: the grader's folder
    sys.path.insert(0, str(Path(__file__).parent))
import torch
from grade_1_4_trainer import TOTALS_WORLD, bytes_sent_verdict, totals_input, totals_problems
from mistake_tables import KnownMistake, NamerTable, one_factor_away

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


# ----------------------------------------------------------------------------- reduce_totals

TOTALS_FACTORS: dict[str, tuple[str, ...]] = {
    "dtype": ("float64", "float32", "bfloat16", "float16"),
    "keys": ("sorted", "each rank's own order"),
    "op": ("sum", "avg", "max", "none"),
}
TOTALS_RIGHT = {factor: values[0] for factor, values in TOTALS_FACTORS.items()}
TOTALS_KNOWN = {
    "float32": {"dtype": "float32"},
    "by position": {"keys": "each rank's own order"},
    "mean": {"op": "avg"},
    "own": {"op": "none"},
}
TOTALS_CASE = "2 ranks, 'samples' 2^24 + 1 on each, the dicts in opposite orders"


def totals_measure(changes: dict[str, str]) -> list[dict[str, torch.Tensor]]:
    """Every rank's returned dict, reduced ``changes``' way by a tensor all-reduce of our own
    (each value a 0-d float64 tensor: same_measurement tells inf from a number only there)."""
    way = TOTALS_RIGHT | changes
    dtype = getattr(torch, way["dtype"])
    inputs = [totals_input(r) for r in range(TOTALS_WORLD)]
    orders = [sorted(d) if way["keys"] == "sorted" else list(d) for d in inputs]
    wire = torch.stack(
        [torch.tensor([d[k] for k in o], dtype=dtype) for d, o in zip(inputs, orders, strict=True)]
    )
    reduced = {
        "sum": wire.sum(0),
        "avg": wire.sum(0) / TOTALS_WORLD,
        "max": wire.max(0).values,
        "none": None,
    }[way["op"]]
    out = []
    for r, order in enumerate(orders):
        values = wire[r] if reduced is None else reduced
        out.append({k: v.double() for k, v in zip(order, values, strict=True)})
    return out


def totals_name(measured: list[dict[str, torch.Tensor]]) -> str | None:
    said = totals_problems([{k: float(v) for k, v in got.items()} for got in measured])
    return "\n".join(said) or None


def totals_neighbours(key: str) -> Sequence[tuple[str, Any]]:
    return one_factor_away(
        TOTALS_KNOWN[key], TOTALS_KNOWN.values(), TOTALS_RIGHT, TOTALS_FACTORS, totals_measure
    )


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
    NamerTable(
        exercise="1.4",
        function="DataParallelLoop.reduce_totals",
        factors=tuple(f"{f} ({' / '.join(v)})" for f, v in TOTALS_FACTORS.items()),
        cases=(TOTALS_CASE,),
        mistakes=(
            KnownMistake("float32", "the dtype on the wire", TOTALS_CASE, "travelled in float32"),
            KnownMistake(
                "by position",
                "the key order (each rank's own)",
                TOTALS_CASE,
                "values paired by position add unrelated numbers",
            ),
            KnownMistake("mean", "a factor: the world size", TOTALS_CASE, "not summed"),
            KnownMistake("own", "no reduction", TOTALS_CASE, "returned its own totals"),
        ),
        right=lambda: totals_measure({}),
        plant=lambda key: totals_measure(TOTALS_KNOWN[key]),
        name=totals_name,
        neighbours=totals_neighbours,
    ),
)
