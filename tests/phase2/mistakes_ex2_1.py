"""2.1's namers and the mistakes they know (tests/mistake_tables.py, issue 49).

* ``accumulate_gradients``' returned loss, judged by :func:`grade_2_1_accumulation.loss_verdict`
  per micro-batch size (micro-batches of 4 first: 4 + 4 + 2 of 10 samples, where every
  weighting of the micro-batches' means gives another number). A realistic mistake weighs each
  micro-batch's mean by something other than its samples / 10: equally (1 / the micro-batch
  count), not at all (a sum), by its samples / the micro-batch size, or by 1 / the sample count.
* ``accumulation_step(data_parallel=True)``'s all-reduces, judged by ``all_reduce_advice`` on 3
  steps of 2 micro-batches of a model of 4 parameter tensors. A realistic mistake all-reduces per
  micro-batch instead of per step, per parameter instead of one flat buffer, both, or never; the
  counts (3, 6, 12, 24, 0) differ, since the steps, micro-batches and tensors are 3, 2 and 4.

Also below: ``ddp_accumulation_step``'s bucket all-reduces under no_sync, judged by
:func:`grade_2_1_accumulation.no_sync_verdict` (its own comment block).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:  # loaded by path (tests/mistake_tables.py)
    sys.path.insert(0, str(Path(__file__).parent))

from grade_2_1_accumulation import (
    MICRO_BATCH_SIZES,
    NO_SYNC_MICRO_BATCHES,
    PARAMETER_TENSORS,
    SAMPLES,
    all_reduce_advice,
    loss_verdict,
    micro_batch_means,
    no_sync_verdict,
    small_mlp,
)
from mistake_tables import KnownMistake, NamerTable, one_factor_away

LOSS_CASES = tuple(f"micro-batches of {m}" for m in MICRO_BATCH_SIZES)
# a micro-batch's weight, from its samples s, the micro-batch size m and their count c
WEIGHTS: dict[str, Callable[[int, int, int], float]] = {
    "s / N": lambda s, m, c: s / SAMPLES,
    "1 / count": lambda s, m, c: 1 / c,
    "1": lambda s, m, c: 1.0,
    "s / m": lambda s, m, c: s / m,
    "1 / N": lambda s, m, c: 1 / SAMPLES,
}


def loss_with(weight: str) -> dict[str, float]:
    """The returned loss per graded micro-batch size, each micro-batch's mean weighted so."""
    found = {}
    for m, label in zip(MICRO_BATCH_SIZES, LOSS_CASES, strict=True):
        _, means = micro_batch_means(m)
        sizes = [min(m, SAMPLES - start) for start in range(0, SAMPLES, m)]
        found[label] = sum(
            WEIGHTS[weight](s, m, len(sizes)) * mean for s, mean in zip(sizes, means, strict=True)
        )
    return found


def loss_name(measured: dict[str, float]) -> str | None:
    """The first verdict, in the grader's order of micro-batch sizes."""
    for m, label in zip(MICRO_BATCH_SIZES, LOSS_CASES, strict=True):
        said = loss_verdict(m, measured[label])
        if said:
            return said
    return None


STEPS, MICRO_BATCHES = 3, 2  # test_data_parallel_accumulation_all_reduces_once_per_step
TENSORS = len(list(small_mlp().parameters()))
assert TENSORS == PARAMETER_TENSORS, "the grader's count of parameter tensors is stale"
COUNT_CASE = f"{STEPS} steps of {MICRO_BATCHES} micro-batches, {TENSORS} parameter tensors"
PER = {
    "step, one flat buffer": STEPS,
    "micro-batch, one flat buffer": STEPS * MICRO_BATCHES,
    "step, per tensor": STEPS * TENSORS,
    "micro-batch, per tensor": STEPS * MICRO_BATCHES * TENSORS,
    "never": 0,
}


def count_name(measured: dict[str, int]) -> str | None:
    made = measured[COUNT_CASE]
    return None if made == STEPS else all_reduce_advice(made, STEPS, MICRO_BATCHES, tensors=TENSORS)


TABLES: tuple[NamerTable, ...] = (
    NamerTable(
        exercise="2.1",
        function="accumulate_gradients (the returned loss)",
        factors=tuple(f"a micro-batch's weight {w}" for w in WEIGHTS),
        cases=LOSS_CASES,
        mistakes=(
            KnownMistake("plain_mean", "the micro-batch count for the sample share", LOSS_CASES[0],
                         "the plain mean of the micro-batches' means"),
            KnownMistake("sum_of_means", "no weight at all", LOSS_CASES[0],
                         "the sum of the micro-batches' means"),
        ),
        right=lambda: loss_with("s / N"),
        plant=lambda key: loss_with({"plain_mean": "1 / count", "sum_of_means": "1"}[key]),
        name=loss_name,
        neighbours=lambda key: [(f"weighted {w}", loss_with(w)) for w in WEIGHTS],
    ),
    NamerTable(
        exercise="2.1",
        function="accumulation_step(data_parallel=True) (its all-reduces)",
        factors=("per step or per micro-batch", "one flat buffer or one per tensor"),
        cases=(COUNT_CASE,),
        mistakes=(
            KnownMistake("per_micro_batch", "the micro-batch count", COUNT_CASE,
                         "that is one per micro-batch"),
            KnownMistake("never", "all of them", COUNT_CASE, "none at all"),
            KnownMistake("per_tensor", "the parameter tensors", COUNT_CASE,
                         "one per parameter tensor (4) each step"),
        ),
        right=lambda: {COUNT_CASE: STEPS},
        plant=lambda key: {COUNT_CASE: {"per_micro_batch": PER["micro-batch, one flat buffer"],
                                        "never": 0, "per_tensor": PER["step, per tensor"]}[key]},
        name=count_name,
        neighbours=lambda key: [(f"per {how}", {COUNT_CASE: n}) for how, n in PER.items()],
    ),
)  # fmt: skip


# ---------------------------------------------------------------------------- DDP and no_sync
# ddp_accumulation_step's bucket all-reduces per optimizer step, judged by no_sync_verdict on 3
# steps of 3 micro-batches (2 + 2 + 1 samples per rank). DDP's bucket count is known only inside
# the world; the verdict reads the calls in units of it, so the table takes B = 4 (any B > 1
# measures alike). DDP decides at a micro-batch's forward whether its backward all-reduces, so a
# step launches B per micro-batch whose forward ran outside no_sync(). Factors: which
# micro-batches run inside no_sync() (all but the last, all, none, all but the last two) and what
# it wraps (forward and backward, the forward only, the backward only). Nothing wrapped and only
# the backwards wrapped measure alike (every forward outside): one row, its message lists both.

NO_SYNC_CASES = ("ddp_accumulation_step, 2 ranks x 5 samples in micro-batches of 2 + 2 + 1",)
ASSUMED_BUCKETS = 4
INSIDE = {"all but the last": 2, "all": 3, "none": 0, "all but the last two": 1}
NO_SYNC_RIGHT = {"inside": "all but the last", "wraps": "forward and backward"}
NO_SYNC_FACTORS = {
    "inside": tuple(INSIDE),
    "wraps": ("forward and backward", "the forward only", "the backward only"),
}
NO_SYNC_PLANTED = {
    "all_inside": {"inside": "all"},
    "no_forward_inside": {"inside": "none"},
}


def bucket_calls(setting: dict[str, str]) -> tuple[list[int], int]:
    """(calls per step over 3 steps, buckets) of a step with these factors."""
    inside = INSIDE[setting["inside"]] if setting["wraps"] != "the backward only" else 0
    return [ASSUMED_BUCKETS * (NO_SYNC_MICRO_BATCHES - inside)] * 3, ASSUMED_BUCKETS


TABLES = (
    *TABLES,
    NamerTable(
        exercise="2.1",
        function="ddp_accumulation_step (DDP's all-reduces under no_sync)",
        factors=tuple(NO_SYNC_FACTORS),
        cases=NO_SYNC_CASES,
        mistakes=(
            KnownMistake("all_inside", "the last micro-batch inside", NO_SYNC_CASES[0],
                         "none at all: the last micro-batch"),
            KnownMistake("no_forward_inside", "a factor of the micro-batch count",
                         NO_SYNC_CASES[0], "no micro-batch's forward ran inside no_sync()"),
        ),
        right=lambda: bucket_calls(NO_SYNC_RIGHT),
        plant=lambda key: bucket_calls({**NO_SYNC_RIGHT, **NO_SYNC_PLANTED[key]}),
        name=lambda measured: no_sync_verdict(measured[0], measured[1], NO_SYNC_MICRO_BATCHES),
        neighbours=lambda key: one_factor_away(
            NO_SYNC_PLANTED[key], NO_SYNC_PLANTED.values(), NO_SYNC_RIGHT, NO_SYNC_FACTORS,
            lambda changed: bucket_calls({**NO_SYNC_RIGHT, **changed}),
        ),
    ),
)  # fmt: skip
