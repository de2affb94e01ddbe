"""4.4's namers and what they know (issue 49): the 16-bit hooks' and the top-k hook's realistic
mistakes, each off by one factor (the order of cast, divide and sum; how many divisions; which
entries are chosen and what is sent; the error feedback), and the graded case that tells it
from the others.

The ranks are simulated in one process: every rank's gradients are drawn as the grader's worker
draws them (the same generators, seeds and sizes), and the hooks are hooks of our own with one
switch per factor, written apart from the grader's variants. The sums run in rank order, as the
right answer here does too: what the grader compares with torch's hook on gloo, this compares
with the right order emulated the same way.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import torch

if str(Path(__file__).parent) not in sys.path:  # loaded by path: the grader's folder
    sys.path.insert(0, str(Path(__file__).parent))
from compression_helpers import (
    TOPK_BUCKETS,
    cast_problems,
    fitting_everywhere,
    mixed_gradients,
    sparse_top,
    topk_value_problems,
)
from mistake_tables import KnownMistake, NamerTable, settings_one_away

Setting = dict[str, str]


def one_away(
    factors: dict[str, tuple[str, ...]], known: dict[str, Setting], key: str
) -> list[Setting]:
    """The settings one factor away from ``known[key]``, other than right and the known ones."""
    right = {f: v[0] for f, v in factors.items()}
    return settings_one_away(known[key], known.values(), right, factors)


def label_of(setting: Setting, factors: dict[str, tuple[str, ...]]) -> str:
    return ", ".join(f"{f}: {v}" for f, v in setting.items() if v != factors[f][0])


# ----------------------------------------------------------------------------- fp16 / bf16

CAST_WORLD = 3
CAST_FACTORS: dict[str, tuple[str, ...]] = {
    "order": ("cast, divide, sum", "divide, cast, sum", "cast, sum, divide"),
    "divisions": ("one", "none", "two"),
    "returned": ("the bucket's dtype", "the 16-bit dtype"),
    "buffer": ("written back", "left as it was"),
}
CAST_KNOWN: dict[str, Setting] = {
    "divide before the cast": {"order": "divide, cast, sum"},
    "sum before the division": {"order": "cast, sum, divide"},
    "no division": {"divisions": "none"},
    "divided twice": {"divisions": "two"},
    "16-bit returned": {"returned": "the 16-bit dtype"},
    "buffer not written": {"buffer": "left as it was"},
}
CAST_HOOKS = (("fp16_hook", torch.float16), ("bf16_hook", torch.bfloat16))
BUCKET_DTYPES = (torch.float32, torch.float64)


@cache
def cast_data() -> dict[str, list[torch.Tensor]]:
    """Each graded label's buckets, one per rank, drawn as cast_worker draws them."""
    per_rank = []
    for rank in range(CAST_WORLD):
        g = torch.Generator().manual_seed(40 + rank)
        mine = {}
        for name, _ in CAST_HOOKS:
            for bucket_dtype in BUCKET_DTYPES:
                data = mixed_gradients(g, 1000, bucket_dtype)
                data[:8] = 40000.0
                mine[f"{name} on a {str(bucket_dtype).removeprefix('torch.')} bucket"] = data
        per_rank.append(mine)
    return {label: [r[label] for r in per_rank] for label in per_rank[0]}


def cast_hook(parts: list[torch.Tensor], dtype: torch.dtype, setting: Setting) -> Any:
    """(future's value, rank 0's buffer) of a 16-bit hook with ``setting``'s choices."""
    divisor = {"one": CAST_WORLD, "none": 1, "two": CAST_WORLD * CAST_WORLD}[setting["divisions"]]
    order = setting["order"]
    if order == "divide, cast, sum":
        sent = [(x / divisor).to(dtype) for x in parts]
    else:
        sent = [x.to(dtype) for x in parts]
        if order == "cast, divide, sum":
            sent = [s / divisor for s in sent]
    total = sent[0].clone()
    for s in sent[1:]:
        total += s
    if order == "cast, sum, divide":
        total = total / divisor
    result = total if setting["returned"] == "the 16-bit dtype" else total.to(parts[0].dtype)
    buffer = parts[0].clone()
    if setting["buffer"] == "written back":
        buffer.copy_(total)
    return result, buffer


def cast_measure(setting: Setting) -> dict[str, Any]:
    right = {f: v[0] for f, v in CAST_FACTORS.items()}
    out = {}
    for label, parts in cast_data().items():
        dtype = torch.float16 if label.startswith("fp16") else torch.bfloat16
        out[label] = cast_hook(parts, dtype, right | setting)
    return out


def cast_neighbours(key: str) -> list[tuple[str, Any]]:
    """The settings one factor away from ``key``'s that measure unlike every known mistake.

    Two kinds are left out: a setting whose buckets equal a known mistake's bit for bit
    (same_measurement reads equal infinities as different: inf - inf is nan), and the order
    changed together with the number of divisions: with no division or two, the order of cast
    and division changes only the last bits of values a factor of 3 off, finer than the ratio
    the grader measures, so such a setting is the division mistake at the grader's resolution."""
    known = [cast_measure(s) for s in CAST_KNOWN.values()] + [cast_measure({})]
    out = []
    for setting in one_away(CAST_FACTORS, CAST_KNOWN, key):
        if setting.get("divisions", "one") != "one" and setting.get(
            "order", "cast, divide, sum"
        ) != ("cast, divide, sum"):
            continue
        measured = cast_measure(setting)
        if any(bitwise_equal(measured, k) for k in known):
            continue
        out.append((label_of(setting, CAST_FACTORS), measured))
    return out


def bitwise_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(
        x.dtype == y.dtype and torch.equal(x, y)
        for label in a
        for x, y in zip(a[label], b[label], strict=True)
    )


def cast_name(measured: dict[str, Any]) -> str | None:
    right = cast_measure({})
    problems = []
    for label, (result, buffer) in measured.items():
        parts = cast_data()[label]
        dtype = torch.float16 if label.startswith("fp16") else torch.bfloat16
        magnitude = torch.stack(parts).double().abs().sum(0) / CAST_WORLD
        want = right[label][0]
        problems += cast_problems(label, buffer, result, want, dtype, CAST_WORLD, magnitude)
    return "\n".join(problems) or None


# ----------------------------------------------------------------------------- top-k

TOPK_WORLD, TOPK_RATIO, TOPK_STEPS = 2, 0.05, 3
TOPK_FACTORS: dict[str, tuple[str, ...]] = {
    "chosen by": ("|gradient + error|", "gradient + error (signed)", "|gradient|"),
    "values sent": ("gradient + error", "their magnitudes", "gradient alone"),
    "error feedback": ("kept", "none"),
    "divisions": ("one", "none", "two"),
}
TOPK_KNOWN: dict[str, Setting] = {
    "by value": {"chosen by": "gradient + error (signed)"},
    "magnitudes sent": {"values sent": "their magnitudes"},
    "no error feedback": {"error feedback": "none"},
    "chosen by the gradient": {"chosen by": "|gradient|"},
    "the sum": {"divisions": "none"},
    "divided twice": {"divisions": "two"},
}


def topk_count(numel: int) -> int:
    return max(1, -(-int(numel * TOPK_RATIO * 1000) // 1000))  # ceil(numel x ratio), at least 1


@cache
def topk_grads() -> list[list[list[torch.Tensor]]]:
    """[rank][step][bucket] gradients, drawn as topk_worker draws them."""
    out = []
    for rank in range(TOPK_WORLD):
        g = torch.Generator().manual_seed(70 + rank)
        out.append([[torch.randn(n, generator=g) for n in TOPK_BUCKETS] for _ in range(TOPK_STEPS)])
    return out


def topk_run(setting: Setting) -> list[list[torch.Tensor]]:
    """[step][bucket]: the averaged bucket every rank gets from a top-k hook with ``setting``."""
    errors = [[torch.zeros(n) for n in TOPK_BUCKETS] for _ in range(TOPK_WORLD)]
    steps = []
    for step in range(TOPK_STEPS):
        outs = []
        for index, numel in enumerate(TOPK_BUCKETS):
            k = topk_count(numel)
            dense = []
            for rank in range(TOPK_WORLD):
                grad = topk_grads()[rank][step][index]
                total = grad + errors[rank][index] if setting["error feedback"] == "kept" else grad
                key = {
                    "|gradient + error|": total.abs(),
                    "gradient + error (signed)": total,
                    "|gradient|": grad.abs(),
                }[setting["chosen by"]]
                chosen = torch.topk(key, k).indices
                values = {
                    "gradient + error": total[chosen],
                    "their magnitudes": total[chosen].abs(),
                    "gradient alone": grad[chosen],
                }[setting["values sent"]]
                sent = torch.zeros(numel)
                sent[chosen] = values
                dense.append(sent)
                # the usual code keeps the error by zeroing the chosen entries of the total,
                # whatever it sent: error = total with zeros at the chosen indices
                kept = total.clone()
                kept[chosen] = 0
                errors[rank][index] = (
                    kept if setting["values sent"] != "gradient alone" else (total - sent)
                )
            summed = dense[0].clone()
            for part in dense[1:]:
                summed += part
            divisor = {"one": TOPK_WORLD, "none": 1, "two": TOPK_WORLD**2}[setting["divisions"]]
            outs.append(summed / divisor)
        steps.append(outs)
    return steps


def topk_measure(setting: Setting) -> list[list[torch.Tensor]]:
    return topk_run({f: v[0] for f, v in TOPK_FACTORS.items()} | setting)


def topk_name(measured: list[list[torch.Tensor]]) -> str | None:
    """The grader's remarks: each place's want and variants as topk_worker computes them (the
    right error trajectory, and the trajectories of the mistakes that remember their own
    errors), against the measured averaged bucket."""
    zeros = [[torch.zeros(n) for n in TOPK_BUCKETS] for _ in range(TOPK_WORLD)]
    errors = [list(e) for e in zeros]
    signed_errors = [list(e) for e in zeros]
    by_grad_errors = [list(e) for e in zeros]
    places = []
    for step in range(TOPK_STEPS):
        for index, numel in enumerate(TOPK_BUCKETS):
            k = topk_count(numel)
            grads = [topk_grads()[r][step][index] for r in range(TOPK_WORLD)]
            sents, signed, by_grad = [], [], []
            for r in range(TOPK_WORLD):
                total = grads[r] + errors[r][index]
                sents.append(sparse_top(total, k))
                errors[r][index] = total - sents[-1]
                total = grads[r] + signed_errors[r][index]
                signed.append(sparse_top(total, k, signed=True))
                signed_errors[r][index] = total - signed[-1]
                total = grads[r] + by_grad_errors[r][index]
                by_grad.append(sparse_top(total, k, chosen_by=grads[r]))
                by_grad_errors[r][index] = total - by_grad[-1]
            want = mean(sents)
            variants = {
                "sum": want * TOPK_WORLD,
                "twice": want / TOPK_WORLD,
                "grad": mean([sparse_top(g, k) for g in grads]),
                "grad indices": mean(by_grad),
                "signed": mean(signed),
                "magnitudes": mean([s.abs() for s in sents]),
            }
            where = f"step {step + 1}, bucket {index} ({numel} elements)"
            places.append((where, measured[step][index], want, variants))
    everywhere = fitting_everywhere([(out, variants) for _, out, _, variants in places])
    problems = []
    for where, out, want, variants in places:
        problems += topk_value_problems(where, out, want, variants, True, everywhere)
    return "\n".join(problems) or None


def mean(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    out = torch.zeros_like(parts[0])
    for part in parts:
        out += part
    return out / len(parts)


TABLES = (
    NamerTable(
        exercise="4.4",
        function="fp16_hook / bf16_hook",
        factors=tuple(f"{f} ({' / '.join(v)})" for f, v in CAST_FACTORS.items()),
        cases=tuple(cast_data()),
        mistakes=(
            KnownMistake(
                "divide before the cast",
                "the order of cast and divide",
                "fp16_hook on a float32 bucket",
                "the division came before the sum: it came before the cast",
            ),
            KnownMistake(
                "sum before the division",
                "the order of sum and divide",
                "fp16_hook on a float32 bucket",
                "divide by the world size before the all-reduce",
            ),
            KnownMistake(
                "no division",
                "a factor: the world (3)",
                "bf16_hook on a float32 bucket",
                "a division by the world is missing",
            ),
            KnownMistake(
                "divided twice",
                "a factor: the world (3), the other way",
                "fp16_hook on a float32 bucket",
                "divided by the world once too often",
            ),
            KnownMistake(
                "16-bit returned",
                "the dtype handed back",
                "fp16_hook on a float32 bucket",
                "with torch's values; expected the bucket's own",
            ),
            KnownMistake(
                "buffer not written",
                "where the average goes",
                "fp16_hook on a float32 bucket",
                "bucket.buffer() does not hold it",
            ),
        ),
        right=lambda: cast_measure({}),
        plant=lambda key: cast_measure(CAST_KNOWN[key]),
        name=cast_name,
        neighbours=cast_neighbours,
    ),
    NamerTable(
        exercise="4.4",
        function="topk_hook",
        factors=tuple(f"{f} ({' / '.join(v)})" for f, v in TOPK_FACTORS.items()),
        cases=tuple(f"step {s + 1}" for s in range(TOPK_STEPS)),
        mistakes=(
            KnownMistake(
                "by value",
                "the key of the choice: signed, not magnitude",
                "step 1",
                "the k largest values were sent",
            ),
            KnownMistake(
                "magnitudes sent",
                "the values sent: magnitudes",
                "step 1",
                "their magnitudes were sent",
            ),
            KnownMistake(
                "no error feedback",
                "the error: dropped",
                "step 2",
                "the remembered error never added",
            ),
            KnownMistake(
                "chosen by the gradient",
                "the key of the choice: the gradient without the error",
                "step 2",
                "chosen by the gradient's magnitudes alone",
            ),
            KnownMistake("the sum", "a factor: the world (2)", "step 1", "not their average"),
            KnownMistake(
                "divided twice",
                "a factor: the world (2), the other way",
                "step 1",
                "divided by the world once more",
            ),
        ),
        right=lambda: topk_measure({}),
        plant=lambda key: topk_measure(TOPK_KNOWN[key]),
        name=topk_name,
        neighbours=lambda key: [
            (label_of(s, TOPK_FACTORS), topk_measure(s))
            for s in one_away(TOPK_FACTORS, TOPK_KNOWN, key)
        ],
    ),
)
