"""2.4's namers and the mistakes they know (tests/mistake_tables.py, issue 49).

``split_sizes`` is judged by :func:`grade_2_4_model_parallel.split_verdict` on every (layers,
ranks) with 1 <= ranks <= layers <= 12. A realistic mistake is off in where the extra layers go
(the first ranks, the last ranks, all to one rank) and in the base count (the floor, or the
ceiling with the last rank taking what is left). Named: the extras on the last ranks (the right
counts in the wrong places), only when every wrong case holds the right counts in some order.

Messages that describe and name no cause, so need no table:

* the p2p gradient hint (``describe``: "all zeros ... was the gradient sent back and received
  into the right buffer?", and "Is the gradient sent back to the previous rank, and received in
  order?") describes, names no cause: it says what differs and asks about the places that fit.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:  # loaded by path (tests/mistake_tables.py)
    sys.path.insert(0, str(Path(__file__).parent))

from grade_2_4_model_parallel import SPLIT_CASES, split_verdict
from mistake_tables import KnownMistake, NamerTable

Split = dict[tuple[int, int], list[int]]


def _extras_first(n: int, w: int) -> list[int]:
    base, extra = divmod(n, w)
    return [base + (r < extra) for r in range(w)]


def _extras_last(n: int, w: int) -> list[int]:
    return _extras_first(n, w)[::-1]


def _extras_to_last_rank(n: int, w: int) -> list[int]:
    base = n // w
    return [base] * (w - 1) + [n - base * (w - 1)]


def _extras_to_first_rank(n: int, w: int) -> list[int]:
    base = n // w
    return [n - base * (w - 1)] + [base] * (w - 1)


def _ceil_then_rest(n: int, w: int) -> list[int]:
    size = math.ceil(n / w)
    return [size] * (w - 1) + [n - size * (w - 1)]


def _extras_dropped(n: int, w: int) -> list[int]:
    return [n // w] * w


WAYS: dict[str, Callable[[int, int], list[int]]] = {
    "extras on the first ranks": _extras_first,
    "extras on the last ranks": _extras_last,
    "every extra on the last rank": _extras_to_last_rank,
    "every extra on the first rank": _extras_to_first_rank,
    "ceil, the last takes the rest": _ceil_then_rest,
    "extras dropped": _extras_dropped,
}


def split(way: str) -> Split:
    return {case: WAYS[way](*case) for case in SPLIT_CASES}


TABLES = (
    NamerTable(
        exercise="2.4",
        function="split_sizes",
        factors=("where the extra layers go", "the base count (floor or ceil)"),
        cases=tuple(f"{n} layers over {w} ranks" for n, w in SPLIT_CASES),
        mistakes=(
            KnownMistake("extras_last", "which ranks take the extras", "3 layers over 2 ranks",
                         "the counts are right but in the wrong places"),
        ),
        right=lambda: split("extras on the first ranks"),
        plant=lambda key: split("extras on the last ranks"),
        name=split_verdict,
        neighbours=lambda key: [(way, split(way)) for way in WAYS],
    ),
)  # fmt: skip
