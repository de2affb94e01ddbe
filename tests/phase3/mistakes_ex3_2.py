"""What 3.2's namers know (issue 49; tests/mistake_tables.py runs these tables).

``ring_cost`` and ``halving_doubling_cost``: tests/phase3/grade_3_2_model_alpha_beta.py measures
(messages, bytes sent, bytes reduced) on every n of 1..8 and hands them to ``cost_verdict``,
which names a mistake only when exactly one it knows gives those counts on every n. Each
mistake is planted here from a model of the function with the factors a learner can get wrong
(written apart from the grader's own formulas), and every mistake one factor away from a named
one is planted as its neighbour.

* SIGABRT_NOTE (a rank of halving_doubling_all_reduce aborted by gloo) lists the causes that
  fit, names none: the signal says a receive got a message of another size, not which exchange
  sent it (partners splitting their ranges differently, or a fold-in message that is not the
  whole tensor). The hang notes (fold_hang_note) have unit tests in
  tests/test_hang_notes_phase3.py.
* phase3_helpers' chunk_hint (the wrong chunks of a ring's result) and random_float_problems
  (bits that differ between ranks; an element beyond the reordering bound) describe and list the
  causes that fit, name none (3.1 and 3.2 both use them).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path[:0] = [p for p in (str(Path(__file__).parent),) if p not in sys.path]

from grade_3_2_halving_doubling import (  # noqa: E402
    BLOCKS_SAY,
    HD_NUMEL,
    HD_TRAFFIC_MISTAKES,
    HD_WORLDS,
    blocks_verdict,
    hd_traffic_verdict,
)
from grade_3_2_model_alpha_beta import (  # noqa: E402
    COST_MISTAKES,
    COST_WORLDS,
    FIT_MISTAKES,
    FIT_WORLDS,
    S,
    cost_counts,
    cost_verdict,
    fit_data,
    fit_verdict,
)
from mistake_tables import KnownMistake, NamerTable  # noqa: E402

from solutions.phase3_multi_node import alpha_beta  # noqa: E402

Params = dict[str, Any]
Counts = tuple[float, float, float]


def ring_model(n: int, steps: str, halves: int, per_step: str, reduced: str) -> Counts:
    """A ring's counts as a learner may write them: ``steps`` per half ("n-1", "n", "n-2"),
    ``halves`` counted (2 or 1), each step moving a ``per_step`` ("chunk" of S/n or the
    "tensor"), bytes reduced by the reduce-scatter only ("rs only") or counted "as sent"."""
    k = {"n-1": n - 1, "n": n, "n-2": n - 2}[steps]
    unit = S / n if per_step == "chunk" else S
    sent = halves * k * unit
    return halves * k, sent, k * unit if reduced == "rs only" else sent


def halving_doubling_model(n: int, p_rule: str, fold: str, halves: int) -> Counts:
    """Halving-doubling's counts: the core on p ranks (``p_rule``: "floor" 2^floor(log2 n),
    "ceil" the next power of two, or "n"), ``halves`` of the core counted (2 or 1), and, when
    n is not a power of two, the fold-in counted "both ways", "one way" or "none"."""
    floor_p = 1 << (n.bit_length() - 1)
    p = {"floor": floor_p, "ceil": 1 << (n - 1).bit_length(), "n": n}[p_rule]
    core = (halves * math.log2(p), halves * (p - 1) / p * S, (p - 1) / p * S)
    extra = {"both ways": (2, 2 * S, S), "one way": (1, S, S), "none": (0, 0.0, 0.0)}[fold]
    if n == floor_p:
        extra = (0, 0.0, 0.0)
    return core[0] + extra[0], core[1] + extra[1], core[2] + extra[2]


FACTORS: dict[str, dict[str, Sequence[Any]]] = {
    "ring": {
        "steps": ("n-1", "n", "n-2"),
        "halves": (2, 1),
        "per_step": ("chunk", "tensor"),
        "reduced": ("rs only", "as sent"),
    },
    "halving_doubling": {
        "p_rule": ("floor", "ceil", "n"),
        "fold": ("both ways", "one way", "none"),
        "halves": (2, 1),
    },
}
MODELS: dict[str, Callable[..., Counts]] = {
    "ring": ring_model,
    "halving_doubling": halving_doubling_model,
}
RIGHT: dict[str, Params] = {
    "ring": {"steps": "n-1", "halves": 2, "per_step": "chunk", "reduced": "rs only"},
    "halving_doubling": {"p_rule": "floor", "fold": "both ways", "halves": 2},
}
# each named mistake as one change of the model's factors
PLANTED: dict[str, dict[str, Params]] = {
    "ring": {
        "n steps": {"steps": "n"},
        "one half": {"halves": 1},
        "whole tensor per step": {"per_step": "tensor"},
        "reduced as sent": {"reduced": "as sent"},
    },
    "halving_doubling": {
        "no fold-in": {"fold": "none"},
        "log2 of n": {"p_rule": "n"},
        "fold-in one way": {"fold": "one way"},
        "p rounded up": {"p_rule": "ceil"},
    },
}
SEPARATED_BY = {  # the first graded n where each differs from every other named mistake
    "n steps": "n = 1",
    "one half": "n = 2",
    "whole tensor per step": "n = 2",
    "reduced as sent": "n = 2",
    "no fold-in": "n = 3",
    "log2 of n": "n = 3",
    "fold-in one way": "n = 3",
    "p rounded up": "n = 3",
}


def measured(algorithm: str, params: Params) -> dict[int, Counts]:
    """What the grader measures from the model with ``params`` (every graded n)."""
    model = MODELS[algorithm]
    return cost_counts(lambda nbytes, n: _Cost(*model(n, **params)))


class _Cost:
    def __init__(self, rounds: float, bytes_sent: float, bytes_reduced: float) -> None:
        self.rounds, self.bytes_sent, self.bytes_reduced = rounds, bytes_sent, bytes_reduced


def _params(algorithm: str, key: str) -> Params:
    return {**RIGHT[algorithm], **PLANTED[algorithm][key]}


def _neighbours(algorithm: str, key: str) -> list[tuple[str, Any]]:
    """Every mistake one factor away from ``key``'s (the right value of a factor included)."""
    base = _params(algorithm, key)
    out = []
    for factor, values in FACTORS[algorithm].items():
        for value in values:
            if value != base[factor]:
                params = {**base, factor: value}
                label = ", ".join(f"{f}={v}" for f, v in params.items())
                out.append((label, measured(algorithm, params)))
    return out


def _table(algorithm: str) -> NamerTable:
    return NamerTable(
        exercise="3.2",
        function=f"{algorithm}_cost",
        factors=tuple(FACTORS[algorithm]),
        cases=tuple(f"n = {n}" for n in COST_WORLDS),
        mistakes=tuple(
            KnownMistake(
                key,
                ", ".join(f"{f}: {v}" for f, v in change.items()),
                SEPARATED_BY[key],
                COST_MISTAKES[algorithm][key][0],
            )
            for key, change in PLANTED[algorithm].items()
        ),
        right=lambda: cost_counts(getattr(alpha_beta, f"{algorithm}_cost")),
        plant=lambda key: measured(algorithm, _params(algorithm, key)),
        name=lambda got: cost_verdict(algorithm, got),
        neighbours=lambda key: _neighbours(algorithm, key),
    )


# ----------------------------------------------------------------------------- the traffic


def hd_messages(n: int, numel: int, params: Params) -> list[tuple[int, int, int]]:
    """Every message (from, to, bytes) of an all-reduce of ``numel`` float32 on ``n`` ranks,
    written with ``params``: halving-doubling with the fold-in (each halving step sends "half of
    the range" or the "whole tensor"; the doubling runs or not), or a ring."""
    out: list[tuple[int, int, int]] = []
    if params["algorithm"] == "ring":
        cut = [len(c) for c in torch.arange(numel).tensor_split(n)]
        for r in range(n):
            for s in range(n - 1):
                out.append((r, (r + 1) % n, 4 * cut[(r - 1 - s) % n]))
                out.append((r, (r + 1) % n, 4 * cut[(r - s) % n]))
        return out
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    core = [2 * i + 1 for i in range(extra)] + list(range(2 * extra, n))  # core index -> rank
    for i in range(extra):
        out.append((2 * i, 2 * i + 1, 4 * numel))  # fold in
    ranges = {c: (0, numel) for c in range(p)}
    kept: list[tuple[int, dict[int, tuple[int, int]]]] = []  # (d, ranges before step d)
    d = p // 2
    while d >= 1:
        kept.append((d, dict(ranges)))
        for c in range(p):
            lo, hi = ranges[c]
            mid = (lo + hi) // 2
            keep, give = ((lo, mid), (mid, hi)) if c & d == 0 else ((mid, hi), (lo, mid))
            nbytes = 4 * numel if params["per step"] == "whole tensor" else 4 * (give[1] - give[0])
            out.append((core[c], core[c ^ d], nbytes))
            ranges[c] = keep
        d //= 2
    if params["doubling"] == "yes":
        for d, before in reversed(kept):
            for c in range(p):
                lo, hi = ranges[c]
                nbytes = 4 * numel if params["per step"] == "whole tensor" else 4 * (hi - lo)
                out.append((core[c], core[c ^ d], nbytes))  # what it kept, to its partner
            ranges = before
    for i in range(extra):
        out.append((2 * i + 1, 2 * i, 4 * numel))  # the result back
    return out


def hd_measured(params: Params) -> dict[int, list[dict[str, int]]]:
    """What the grader's bytes_worker reports per rank, on every graded world."""
    seen = {}
    for n in HD_WORLDS:
        messages = hd_messages(n, HD_NUMEL, params)
        seen[n] = [
            {
                "sent": sum(b for src, _, b in messages if src == r),
                "received": sum(b for _, dst, b in messages if dst == r),
                "messages": sum(1 for src, _, _ in messages if src == r),
            }
            for r in range(n)
        ]
    return seen


HD_FACTORS: dict[str, Sequence[Any]] = {
    "algorithm": ("halving-doubling", "ring"),
    "per step": ("half of the range", "whole tensor"),
    "doubling": ("yes", "no"),
}
HD_RIGHT: Params = {factor: values[0] for factor, values in HD_FACTORS.items()}
HD_PLANTED: dict[str, Params] = {
    "ring": {"algorithm": "ring"},
    "whole tensor per step": {"per step": "whole tensor", "doubling": "no"},
    "halving only": {"doubling": "no"},
}


def _hd_neighbours(key: str) -> list[tuple[str, Any]]:
    base = {**HD_RIGHT, **HD_PLANTED[key]}
    out = []
    for factor, values in HD_FACTORS.items():
        for value in values:
            if value != base[factor]:
                params = {**base, factor: value}
                label = ", ".join(f"{f}={v}" for f, v in params.items())
                out.append((label, hd_measured(params)))
    return out


HD_TRAFFIC = NamerTable(
    exercise="3.2",
    function="halving_doubling_all_reduce (bytes and messages)",
    factors=tuple(HD_FACTORS),
    cases=tuple(f"{n} ranks" for n in HD_WORLDS),
    mistakes=tuple(
        KnownMistake(
            key,
            ", ".join(f"{f}: {v}" for f, v in change.items()),
            "3 ranks",
            HD_TRAFFIC_MISTAKES[key],
        )
        for key, change in HD_PLANTED.items()
    ),
    right=lambda: hd_measured(HD_RIGHT),
    plant=lambda key: hd_measured({**HD_RIGHT, **HD_PLANTED[key]}),
    name=hd_traffic_verdict,
    neighbours=_hd_neighbours,
)

# ----------------------------------------------------------------------------- the fit

DATA = fit_data(alpha_beta.ring_cost)


def planted_fit(
    costs: Sequence[Any], seconds: Sequence[float], params: Params
) -> tuple[float, float]:
    """fit_alpha_beta as a learner may write it, solved with torch.linalg.lstsq: each equation
    divided by t**power (1: relative to each time, 0: not at all), the bytes taken from
    ``volume``, the result returned in ``order``; alpha, then beta, clamped at 0."""
    t = torch.tensor(list(seconds), dtype=torch.float64)
    m = torch.tensor([c.rounds for c in costs], dtype=torch.float64)
    v = torch.tensor([getattr(c, params["volume"]) for c in costs], dtype=torch.float64)
    w = t ** params["power"]
    a = torch.stack([m / w, v / w], dim=1)
    solution = torch.linalg.lstsq(a, (t / w).unsqueeze(1)).solution.flatten()
    alpha, beta = float(solution[0]), float(solution[1])
    if alpha < 0:
        col = v / w
        alpha, beta = 0.0, float((col * (t / w)).sum() / (col * col).sum())
    return (alpha, beta) if params["order"] == "alpha first" else (beta, alpha)


def fit_measured(params: Params) -> dict[int, tuple[tuple[float, float], tuple[float, float]]]:
    return {n: (planted_fit(*DATA[n][0], params), planted_fit(*DATA[n][1], params))
            for n in FIT_WORLDS}  # fmt: skip


FIT_FACTORS: dict[str, Sequence[Any]] = {
    "power": (1, 0),
    "volume": ("bytes_sent", "bytes_reduced"),
    "order": ("alpha first", "beta first"),
}
FIT_RIGHT: Params = {factor: values[0] for factor, values in FIT_FACTORS.items()}
FIT_PLANTED: dict[str, Params] = {
    "bytes reduced fitted": {"volume": "bytes_reduced"},
    "alpha and beta swapped": {"order": "beta first"},
    "unweighted": {"power": 0},
}


def _fit_neighbours(key: str) -> list[tuple[str, Any]]:
    base = {**FIT_RIGHT, **FIT_PLANTED[key]}
    out = []
    for factor, values in FIT_FACTORS.items():
        for value in values:
            if value != base[factor]:
                params = {**base, factor: value}
                label = ", ".join(f"{f}={v}" for f, v in params.items())
                out.append((label, fit_measured(params)))
    return out


FIT = NamerTable(
    exercise="3.2",
    function="fit_alpha_beta",
    factors=tuple(FIT_FACTORS),
    cases=tuple(f"n = {n}, {kind} times" for n in FIT_WORLDS for kind in ("exact", "noisy")),
    mistakes=tuple(
        KnownMistake(
            key,
            ", ".join(f"{f}: {v}" for f, v in change.items()),
            "n = 2, noisy times" if key == "unweighted" else "n = 2, exact times",
            FIT_MISTAKES[key][0],
        )
        for key, change in FIT_PLANTED.items()
    ),
    right=lambda: {
        n: tuple(
            (f.alpha, f.beta)
            for f in (alpha_beta.fit_alpha_beta(*exact), alpha_beta.fit_alpha_beta(*noisy))
        )
        for n, (exact, noisy) in DATA.items()
    },
    plant=lambda key: fit_measured({**FIT_RIGHT, **FIT_PLANTED[key]}),
    name=lambda fits: fit_verdict(fits, DATA),
    neighbours=_fit_neighbours,
)

# ----------------------------------------------------------------------------- which half

BLOCKS_P = 4  # the values test on 4 ranks, first size 4·4 = 16 (a power of two: the diagnosis)
BLOCKS_NUMEL = 16


def hd_values(params: Params) -> list[list[int]]:
    """Each rank's wrong blocks (of p) after halving-doubling written with ``params``, all ranks
    stepping at once: which half the lower rank keeps at a halving step ("lower" right,
    "upper" for both partners consistently, "both lower": the partners disagree), and the
    doubling's steps replayed in "reverse" order, the "same" order, or "none"."""
    g = torch.Generator().manual_seed(32)
    flat = [torch.randint(-8, 9, (BLOCKS_NUMEL,), generator=g).double() for _ in range(BLOCKS_P)]
    total = torch.stack(flat).sum(0)
    ranges = [(0, BLOCKS_NUMEL)] * BLOCKS_P
    history: list[list[tuple[int, tuple[int, int], tuple[int, int]]]] = []
    d = BLOCKS_P // 2
    while d >= 1:
        step = []
        for r in range(BLOCKS_P):
            lo, hi = ranges[r]
            mid = (lo + hi) // 2
            lower_keeps_lower = {"lower": True, "upper": False, "both lower": True}[params["keep"]]
            keeps_lower = (r & d == 0) == lower_keeps_lower or params["keep"] == "both lower"
            keep, give = ((lo, mid), (mid, hi)) if keeps_lower else ((mid, hi), (lo, mid))
            step.append((r ^ d, keep, give))
        sent = [flat[r][give[0] : give[1]].clone() for r, (_, _, give) in enumerate(step)]
        for r, (partner, keep, _) in enumerate(step):
            flat[r][keep[0] : keep[1]] += sent[partner]
            ranges[r] = keep
        history.append(step)
        d //= 2
    replay = {"reverse": history[::-1], "same": history, "none": []}[params["doubling"]]
    for step in replay:
        sent = [flat[r][keep[0] : keep[1]].clone() for r, (_, keep, _) in enumerate(step)]
        for r, (partner, _, give) in enumerate(step):
            if flat[r][give[0] : give[1]].shape == sent[partner].shape:
                flat[r][give[0] : give[1]] = sent[partner]
    blocks = list(zip(total.tensor_split(BLOCKS_P), strict=True))
    return [
        [i for i, (b,) in enumerate(blocks) if not torch.equal(f.tensor_split(BLOCKS_P)[i], b)]
        for f in flat
    ]


def blocks_name(everyone: list[list[int]]) -> str | None:
    return "\n".join(blocks_verdict(everyone)) or None


BLOCKS_FACTORS: dict[str, Sequence[Any]] = {
    "keep": ("lower", "upper", "both lower"),
    "doubling": ("reverse", "same", "none"),
}
BLOCKS_RIGHT: Params = {"keep": "lower", "doubling": "reverse"}
BLOCKS_PLANTED: dict[str, Params] = {
    "nothing came back": {"doubling": "none"},
    "some came back wrong": {"doubling": "same"},
}  # a wrong own block ("keep": "both lower", ...) is described, its conditions listed


def _blocks_neighbours(key: str) -> list[tuple[str, Any]]:
    base = {**BLOCKS_RIGHT, **BLOCKS_PLANTED[key]}
    out = []
    for factor, values in BLOCKS_FACTORS.items():
        for value in values:
            if value != base[factor]:
                params = {**base, factor: value}
                label = ", ".join(f"{f}={v}" for f, v in params.items())
                out.append((label, hd_values(params)))
    return out


BLOCKS = NamerTable(
    exercise="3.2",
    function="halving_doubling_all_reduce (which phase: blocks_diagnosis)",
    factors=tuple(BLOCKS_FACTORS),
    cases=(f"{BLOCKS_P} ranks, {BLOCKS_NUMEL} elements",),
    mistakes=tuple(
        KnownMistake(
            key,
            ", ".join(f"{f}: {v}" for f, v in change.items()),
            f"{BLOCKS_P} ranks, {BLOCKS_NUMEL} elements",
            BLOCKS_SAY[key],
        )
        for key, change in BLOCKS_PLANTED.items()
    ),
    right=lambda: hd_values(BLOCKS_RIGHT),
    plant=lambda key: hd_values({**BLOCKS_RIGHT, **BLOCKS_PLANTED[key]}),
    name=blocks_name,
    neighbours=_blocks_neighbours,
)

TABLES = (_table("ring"), _table("halving_doubling"), HD_TRAFFIC, FIT, BLOCKS)
