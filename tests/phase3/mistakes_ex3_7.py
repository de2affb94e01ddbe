"""What 3.7's namers know (issue 49, tests/mistake_tables.py): the gate ``ready_to_serve``.

When a run serves a pull early or late, the grader asks ``ready_to_serve`` directly (no socket:
a server whose 2 clocks every worker completed) for clocks 0, 1, 2, ... and reads the lead it
allows (``gate_lead``); ``gate_words`` words it. A mistaken gate is one value per factor: which
staleness it uses in each mode, and its comparison. The runs set a staleness of 2 in sync (as the
launcher does), so honouring it there (a lead of 2) differs from an off-by-one (a lead of 1).

The other 3.7 failures (parameters against data-parallel SGD, the server's logged reasons for a
closed connection, the sharding's bound) say what was seen against what was expected and name
no cause beyond what the server's own log says.

* params_words (sync and ssp s=0 against data-parallel SGD) describes, names no cause: which keys
  and how many elements differ, the largest difference and where, and the change from the initial
  parameters as a ratio of the expected change; it names neither apply_push nor close_clock,
  since these numbers alone do not tell which of them moved the parameters.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))

import grade_3_7_parameter_server as grader
from mistake_tables import KnownMistake, NamerTable
from phase3_helpers import factor_neighbours

Settings = dict[str, Any]
CASES = tuple(f"{mode}, staleness {s}" for mode, s in grader.GATE_CASES)
APPLIED = 2  # gate_lead's server: 2 clocks applied by every worker
FACTORS = {
    "staleness": ("ssp's, 0 in sync", "the setting in every mode", "0 in every mode"),
    "comparison": ("clock >= c - s", "clock > c - s", "clock >= c - s - 1", "clock <= c - s"),
}
RIGHT = {f: vs[0] for f, vs in FACTORS.items()}


def mistaken_gate(mode: str, staleness: int, clock: int, c: int, s: Settings) -> bool:
    """ready_to_serve as a learner might write it (sync and ssp only: async serves all)."""
    used = {
        "ssp's, 0 in sync": staleness if mode == "ssp" else 0,
        "the setting in every mode": staleness,
        "0 in every mode": 0,
    }[s["staleness"]]
    return {
        "clock >= c - s": clock >= c - used,
        "clock > c - s": clock > c - used,
        "clock >= c - s - 1": clock >= c - used - 1,
        "clock <= c - s": clock <= c - used,
    }[s["comparison"]]


def measure(s: Settings) -> dict[str, int | None]:
    """The lead gate_lead reads, per case: clocks served past the applied ones, None when the
    answers are not one threshold (as gate_lead computes it)."""
    out: dict[str, int | None] = {}
    for (mode, staleness), label in zip(grader.GATE_CASES, CASES, strict=True):
        served = [mistaken_gate(mode, staleness, APPLIED, c, s) for c in range(APPLIED + 6)]
        ok = served[0] and served == sorted(served, reverse=True)
        out[label] = sum(served) - APPLIED - 1 if ok else None
    return out


def name(measured: dict[str, int | None]) -> str | None:
    for (mode, staleness), label in zip(grader.GATE_CASES, CASES, strict=True):
        said = grader.gate_words(mode, staleness, measured[label])
        if said:
            return said
    return None


MISTAKES = (
    (KnownMistake("sync_uses_staleness", "the staleness: ssp's used in sync", CASES[0],
                  "sync honoured the staleness setting"),
     {"staleness": "the setting in every mode"}),
    (KnownMistake("ssp_ignores_staleness", "the staleness: 0 in ssp too", CASES[2],
                  "ssp ignored its staleness setting"), {"staleness": "0 in every mode"}),
    (KnownMistake("one_clock_early", "the comparison: off by one, lenient", CASES[0],
                  "the comparison is off by one"), {"comparison": "clock >= c - s - 1"}),
    (KnownMistake("one_clock_late", "the comparison: off by one, strict", CASES[0],
                  "one clock too strict"), {"comparison": "clock > c - s"}),
    (KnownMistake("reversed", "the comparison reversed", CASES[0], "are not one threshold"),
     {"comparison": "clock <= c - s"}),
)  # fmt: skip
SETTINGS = {m.key: {**RIGHT, **changed} for m, changed in MISTAKES}

TABLES = (
    NamerTable(
        exercise="3.7",
        function="ready_to_serve",
        factors=tuple(f"{f}: {', '.join(vs)}" for f, vs in FACTORS.items()),
        cases=CASES,
        mistakes=tuple(m for m, _ in MISTAKES),
        right=lambda: measure(RIGHT),
        plant=lambda key: measure(SETTINGS[key]),
        name=name,
        neighbours=lambda key: factor_neighbours(SETTINGS[key], RIGHT, FACTORS, measure),
    ),
)
