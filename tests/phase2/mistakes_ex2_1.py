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
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

if str(Path(__file__).parent) not in sys.path:  # loaded by path (tests/mistake_tables.py)
    sys.path.insert(0, str(Path(__file__).parent))

from grade_2_1_accumulation import (
    MICRO_BATCH_SIZES,
    PARAMETER_TENSORS,
    SAMPLES,
    all_reduce_advice,
    loss_verdict,
    micro_batch_means,
    small_mlp,
)
from mistake_tables import KnownMistake, NamerTable

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


TABLES = (
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
