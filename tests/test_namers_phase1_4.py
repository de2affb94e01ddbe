"""What the namers of 1.1-1.4 and 4.1-4.5 say where the mistake tables do not look (issue 49):
evidence that fits two mistakes gets both listed, a value of the wrong shape is described, not
run into a tensor error inside the grader. The tables themselves run in test_mistake_tables.py.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

TESTS = Path(__file__).resolve().parent
for folder in ("phase1", "phase4"):
    if str(TESTS / folder) not in sys.path:
        sys.path.insert(0, str(TESTS / folder))

from compression_helpers import cast_problems, topk_value_problems  # noqa: E402
from grade_1_2_averaging import averaging_remark  # noqa: E402
from grade_1_3_all_reduce import census_remark  # noqa: E402
from grade_1_4_trainer import totals_input, totals_problems  # noqa: E402
from grade_4_1_checkpoint import durability_problem, rng_restore_verdict  # noqa: E402


def test_half_the_mean_in_a_group_of_2_of_4_lists_both_causes_without_the_whole_world() -> None:
    said = averaging_remark([(0.5, 2, 4)])
    assert "each of these" in said and "world's size" in said and "two divisions" in said
    assert "instead of the group's" not in said  # no name: two mistakes fit
    said = averaging_remark([(0.5, 2, 4), (1.0, 4, 4)])
    assert "divided by the world's size instead of the group's" in said
    said = averaging_remark([(0.5, 2, 4), (0.25, 4, 4)])
    assert "divided by the number of ranks twice" in said


def test_a_ratio_no_mistake_gives_is_said_as_a_ratio() -> None:
    assert averaging_remark([(0.75, 2, 2)]) == " (0.75 times the mean)"


def test_two_contributions_missing_is_counted_not_named_as_one() -> None:
    said = census_remark([1, 0, 0, 1])
    assert "contributions were never received" in said
    assert "a contribution was never" not in said
    assert "overwritten" not in census_remark([0, 0, 3, 1])


def test_a_restore_of_an_unrelated_rank_names_no_slash() -> None:
    said = rng_restore_verdict("rank 0 first", 2, [5])
    assert "restored rank 5's states" in said and "without the slash" not in said
    said = rng_restore_verdict("rank 0 first", 1, [11])
    assert "without the slash" in said and "the last of them" in said


def test_a_top_k_value_of_the_wrong_shape_is_described() -> None:
    want = torch.zeros(10)
    said = topk_value_problems("step 1", torch.zeros(3), want, {}, True, [])
    assert said and "(3,)" in said[0] and "(10,)" in said[0]


def test_a_16_bit_future_of_the_wrong_shape_is_described() -> None:
    want = torch.zeros(10)
    said = cast_problems(
        "fp16_hook", want, torch.zeros(5, dtype=torch.float16), want, torch.float16, 3, want
    )
    assert said and "(5,)" in said[0] and "(10,)" in said[0]


def test_a_max_over_the_ranks_is_described_though_one_rank_holds_its_own_totals() -> None:
    inputs = [totals_input(rank) for rank in (0, 1)]
    largest = {k: max(d[k] for d in inputs) for k in inputs[0]}  # rank 1's: its own
    said = " ".join(totals_problems([largest, dict(largest)]))
    assert "'loss' is 3.0, expected 4.5" in said
    assert "own totals" not in said and "not summed" not in said and "float32" not in said


def test_a_float32_sum_shows_the_difference_not_a_ratio_of_1() -> None:
    rounded = {"samples": float(2**25), "loss": 4.5, "steps": 7.0}
    said = " ".join(totals_problems([rounded, dict(rounded)]))
    assert "off by -2" in said and "1 times" not in said and "float32" in said


def test_an_unflushed_write_is_named_only_when_it_is_the_only_problem() -> None:
    target = Path("/ckpt/state.pt")
    tmp = "/ckpt/.state.pt.tmp"
    events: list[Any] = [("wrote", "", 0), ("fsync file", tmp, 0), ("replace", tmp, 0),
                         ("replaced onto", str(target), 0)]  # fmt: skip
    alone = durability_problem([*events, ("fsync folder", "/ckpt", 0)], target, 1000)
    assert alone and "Python's own buffer" in alone
    both = durability_problem(events, target, 1000)
    assert both and "2 problems" in both and "Python's own buffer" not in both
