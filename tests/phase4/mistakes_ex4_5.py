"""4.5's namers and what they know (issue 49): MFU, the FLOP count of a training step and the
straggler rule, each mistake off by one factor (a unit, a multiplier, a statistic, a rank's
name), and the graded case that tells it from the others.

All three are graded on numbers the test chooses, so the mistakes are planted here as
arithmetic of our own (the straggler rule with statistics.median_low and friends, written apart
from the grader's rule_answer), on the grader's own cases.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if str(Path(__file__).parent) not in sys.path:  # loaded by path: the grader's folder
    sys.path.insert(0, str(Path(__file__).parent))
from grade_4_5_monitoring import (
    FOUR,
    MFU_CASES,
    TWO,
    chain_flops,
    flops_verdict,
    mfu_verdict,
    straggler_verdict,
)
from mistake_tables import KnownMistake, NamerTable, settings_one_away

Setting = dict[str, str]


def one_away(
    factors: dict[str, tuple[str, ...]], known: dict[str, Setting], key: str
) -> list[Setting]:
    """The settings one factor away from ``known[key]``, other than right and the known ones."""
    right = {f: v[0] for f, v in factors.items()}
    return settings_one_away(known[key], known.values(), right, factors)


def neighbours_of(
    factors: dict[str, tuple[str, ...]],
    known: dict[str, Setting],
    measure: Callable[[Setting], Any],
) -> Callable[[str], Sequence[tuple[str, Any]]]:
    def neighbours(key: str) -> Sequence[tuple[str, Any]]:
        out = []
        for setting in one_away(factors, known, key):
            label = ", ".join(f"{f}: {v}" for f, v in setting.items() if v != factors[f][0])
            out.append((label, measure(setting)))
        return out

    return neighbours


def factor_list(factors: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    return tuple(f"{f} ({' / '.join(v)})" for f, v in factors.items())


# ----------------------------------------------------------------------------- MFU

MFU_FACTORS: dict[str, tuple[str, ...]] = {
    "seconds": ("seconds", "x 1000 (milliseconds)", "/ 1000"),
    "flops": ("as given", "x 3 (forward + backward again)", "/ 3"),
    "peak": ("FLOP/s", "x 1e12 (taken as TFLOP/s)", "/ 1e12"),
    "result": ("a fraction", "a percentage"),
}
MFU_KNOWN: dict[str, Setting] = {
    "milliseconds": {"seconds": "x 1000 (milliseconds)"},
    "seconds / 1000": {"seconds": "/ 1000"},
    "x 3": {"flops": "x 3 (forward + backward again)"},
    "/ 3": {"flops": "/ 3"},
    "TFLOP/s": {"peak": "x 1e12 (taken as TFLOP/s)"},
    "peak / 1e12": {"peak": "/ 1e12"},
}


def mfu_measure(setting: Setting) -> list[str]:
    """Each case's MFU as repr(float): exact (same_measurement compares floats with an absolute
    floor of 1e-9, which reads 5e-16 and 5e-13 as the same number)."""
    return [repr(v) for v in _mfu_values(setting)]


def _mfu_values(setting: Setting) -> list[float]:
    s = {f: v[0] for f, v in MFU_FACTORS.items()} | setting
    out = []
    for flops, seconds, peak, _ in MFU_CASES:
        seconds = {
            "seconds": seconds,
            "x 1000 (milliseconds)": seconds * 1e3,
            "/ 1000": seconds / 1e3,
        }[s["seconds"]]
        flops = {"as given": flops, "x 3 (forward + backward again)": 3 * flops, "/ 3": flops / 3}[
            s["flops"]
        ]
        peak = {"FLOP/s": peak, "x 1e12 (taken as TFLOP/s)": peak * 1e12, "/ 1e12": peak / 1e12}[
            s["peak"]
        ]
        value = flops / seconds / peak
        out.append(value * 100 if s["result"] == "a percentage" else value)
    return out


def mfu_name(measured: list[str]) -> str | None:
    """The grader stops at the first wrong case."""
    for (flops, seconds, peak, want), got in zip(MFU_CASES, measured, strict=True):
        verdict = mfu_verdict(flops, seconds, peak, want, float(got))
        if verdict:
            return verdict
    return None


# ----------------------------------------------------------------------------- FLOPs

FLOPS_BATCH = 4
FLOPS_FACTORS: dict[str, tuple[str, ...]] = {
    "counted": ("forward and backward", "forward alone"),
    "then": ("nothing", "x 3 (rule of thumb)", "x 2", "x 3"),
}
FLOPS_KNOWN: dict[str, Setting] = {
    "forward alone": {"counted": "forward alone"},
    "3 x forward": {"counted": "forward alone", "then": "x 3 (rule of thumb)"},
    "2 x the step": {"then": "x 2"},
    "3 x the step": {"then": "x 3"},
}


def flops_measure(setting: Setting) -> int:
    s = {f: v[0] for f, v in FLOPS_FACTORS.items()} | setting
    forward, step = chain_flops(FLOPS_BATCH)
    counted = forward if s["counted"] == "forward alone" else step
    return counted * {"nothing": 1, "x 3 (rule of thumb)": 3, "x 2": 2, "x 3": 3}[s["then"]]


def flops_name(measured: int) -> str | None:
    forward, step = chain_flops(FLOPS_BATCH)
    return flops_verdict(measured, forward, step, FLOPS_BATCH)


# ----------------------------------------------------------------------------- stragglers

RULE_FACTORS: dict[str, tuple[str, ...]] = {
    "window": ("lower median", "mean"),
    "across": ("lower median", "mean", "middle average"),
    "threshold": ("given", "1.5 always"),
    "comparison": (">", ">="),
    "names": ("global rank", "group rank"),
    "direction": ("slower", "both ways"),
}
RULE_KNOWN: dict[str, Setting] = {
    "mean in the window": {"window": "mean"},
    "mean across ranks": {"across": "mean"},
    "middle average across ranks": {"across": "middle average"},
    "threshold ignored": {"threshold": "1.5 always"},
    "at the threshold": {"comparison": ">="},
    "group rank": {"names": "group rank"},
    "faster too": {"direction": "both ways"},
}


def told(scenario: Any, rank: int, s: Setting) -> list[int]:
    groups = scenario.groups or (tuple(sorted(scenario.windows_ms)),)
    members = next(g for g in groups if rank in g)
    of_window = statistics.mean if s["window"] == "mean" else statistics.median_low
    medians = [of_window(scenario.windows_ms[r]) for r in members]
    across = {
        "lower median": statistics.median_low,
        "mean": statistics.mean,
        "middle average": statistics.median,
    }[s["across"]](medians)
    limit = (1.5 if s["threshold"] == "1.5 always" else scenario.threshold) * across
    out = []
    for position, (r, m) in enumerate(zip(members, medians, strict=True)):
        slow = m >= limit if s["comparison"] == ">=" else m > limit
        fast = s["direction"] == "both ways" and m < across / (limit / across)
        if slow or fast:
            out.append(position if s["names"] == "group rank" else r)
    return sorted(out)


def rule_measure(setting: Setting) -> dict[str, list[dict[int, list[int]]]]:
    s = {f: v[0] for f, v in RULE_FACTORS.items()} | setting
    return {
        label: [
            {rank: told(scenario, rank, s) for rank in range(world)} for _, scenario, _ in cases
        ]
        for label, cases, world in (("world of 2", TWO, 2), ("world of 4", FOUR, 4))
    }


def rule_name(measured: dict[str, list[dict[int, list[int]]]]) -> str | None:
    verdicts = [
        straggler_verdict(measured["world of 2"], TWO, 2, name_causes=False),
        straggler_verdict(measured["world of 4"], FOUR, 4),
    ]
    return "\n".join(v for v in verdicts if v) or None


TABLES = (
    NamerTable(
        exercise="4.5",
        function="model_flops_utilization",
        factors=factor_list(MFU_FACTORS),
        cases=tuple(f"{f:g} FLOPs, {s:g} s, peak {p:g}" for f, s, p, _ in MFU_CASES),
        mistakes=tuple(
            KnownMistake(
                key, ", ".join(change.values()), f"{3e12:g} FLOPs, 0.5 s, peak {12e12:g}", says
            )
            for (key, change), says in zip(
                MFU_KNOWN.items(),
                (
                    "the seconds were turned into milliseconds",
                    "the seconds were divided by 1000",
                    "3 times too large: flops_per_step",
                    "3 times too small: flops_per_step",
                    "it was multiplied by 1e12",
                    "it was divided by 1e12",
                ),
                strict=True,
            )
        ),
        right=lambda: mfu_measure({}),
        plant=lambda key: mfu_measure(MFU_KNOWN[key]),
        name=mfu_name,
        neighbours=neighbours_of(MFU_FACTORS, MFU_KNOWN, mfu_measure),
    ),
    NamerTable(
        exercise="4.5",
        function="count_training_flops",
        factors=factor_list(FLOPS_FACTORS),
        cases=("Linear 6-7-5-3, batch 4",),
        mistakes=(
            KnownMistake(
                "forward alone", "the backward", "Linear 6-7-5-3, batch 4", "the forward pass alone"
            ),
            KnownMistake(
                "3 x forward",
                "x 3 of the forward",
                "Linear 6-7-5-3, batch 4",
                "3 x the forward count",
            ),
            KnownMistake(
                "2 x the step",
                "a factor 2",
                "Linear 6-7-5-3, batch 4",
                "2 x the forward + backward",
            ),
            KnownMistake(
                "3 x the step",
                "a factor 3",
                "Linear 6-7-5-3, batch 4",
                "3 x the forward + backward",
            ),
        ),
        right=lambda: flops_measure({}),
        plant=lambda key: flops_measure(FLOPS_KNOWN[key]),
        name=flops_name,
        neighbours=neighbours_of(FLOPS_FACTORS, FLOPS_KNOWN, flops_measure),
    ),
    NamerTable(
        exercise="4.5",
        function="find_stragglers",
        factors=factor_list(RULE_FACTORS),
        cases=("world of 2", "world of 4"),
        mistakes=(
            KnownMistake(
                "mean in the window",
                "the window's statistic",
                "world of 2",
                "a rank's window was averaged",
            ),
            KnownMistake(
                "mean across ranks",
                "the statistic across ranks: the mean",
                "world of 4",
                "the ranks were compared with their mean",
            ),
            KnownMistake(
                "middle average across ranks",
                "the statistic across ranks: the middle average",
                "world of 4",
                "compared with the average of the two middle medians",
            ),
            KnownMistake(
                "threshold ignored", "the threshold", "world of 4", "where another was given"
            ),
            KnownMistake(
                "at the threshold",
                "> for >=",
                "world of 2",
                "exactly at threshold x the median was named",
            ),
            KnownMistake(
                "group rank",
                "the group's rank for the global",
                "world of 4",
                "named by their rank in the group",
            ),
            KnownMistake(
                "faster too",
                "the direction",
                "world of 4",
                "a rank faster than the median was named",
            ),
        ),
        right=lambda: rule_measure({}),
        plant=lambda key: rule_measure(RULE_KNOWN[key]),
        name=rule_name,
        neighbours=neighbours_of(RULE_FACTORS, RULE_KNOWN, rule_measure),
    ),
)
