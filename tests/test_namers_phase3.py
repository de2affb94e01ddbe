"""Phase 3's mistake-namers (3.5-3.8), tried without a world, at simulated layouts the graded
worlds cannot hold (issue 49: ep != dp, groups inside larger worlds, a class method pointed at
by its own line). The graded cases themselves are checked by tests/test_mistake_tables.py."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent / "phase3") not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent / "phase3"))

from clip_helpers import LAYOUTS, Rules, _held, dense_grads, named_mistakes, simulate
from grade_3_7_parameter_server import gate_words
from grade_3_8_expert_parallel import ratio_words
from phase3_helpers import factor_neighbours, with_sites
from zero_helpers import reduce_scatter_problem


def test_factor_neighbours_change_one_wrong_factor_to_each_other_wrong_value() -> None:
    factors = {"a": ("right", "x", "y"), "b": ("right", "z")}
    right = {"a": "right", "b": "right"}
    got = factor_neighbours({"a": "x", "b": "right"}, right, factors, lambda s: dict(s))
    assert got == [("a=y", {"a": "y", "b": "right"})]


def test_ratio_words_name_the_divisor_when_ep_and_dp_differ_and_list_both_when_equal() -> None:
    # ep4 x dp2 (simulated): dividing by dp leaves 4x, by ep 2x: each has its own words
    by_dp = ratio_words("the expert's gradient", 4.0, ep=4, dp=2, summed_on="dp group")
    by_ep = ratio_words("the expert's gradient", 2.0, ep=4, dp=2, summed_on="dp group")
    assert "divided by the dp group's size (2)" in by_dp and "ep group" not in by_dp
    assert "divided by the ep group's size (4)" in by_ep and "dp group's size" not in by_ep
    summed = ratio_words("the router's gradient", 8.0, ep=4, dp=2, summed_on="world")
    assert "no division at all" in summed
    both = ratio_words("the router's gradient", 2.0, ep=2, dp=2, summed_on="world")
    assert "the dp group's size (2) or by the ep group's size (2)" in both
    assert "cannot tell which" in both
    odd = ratio_words("the router's gradient", 3.0, ep=2, dp=2, summed_on="world")
    assert "3 times the right one" in odd and "divided by" not in odd


def test_reduce_scatter_namer_at_a_group_of_2_in_a_world_of_8() -> None:
    total = torch.arange(10, dtype=torch.float64) * 3
    size = 5
    right = total[5:] / 2
    assert reduce_scatter_problem(right, total, 1, 7, 2, 8) is None
    world_mean = reduce_scatter_problem(total[5:] / 8, total, 1, 7, 2, 8)
    assert world_mean is not None and "WORLD's size (8)" in world_mean
    summed = reduce_scatter_problem(total[5:].clone(), total, 1, 7, 2, 8)
    assert summed is not None and "it is the sum" in summed
    other = reduce_scatter_problem(total[:size] / 3, total, 1, 7, 2, 8)
    assert other is not None and "GLOBAL" not in other and "elements differ" in other


def test_a_norm_that_fits_one_mistake_on_every_layout_is_named_alone() -> None:
    """tp not reduced on tp2 x dp2 also fits "local norm only, every rank its own copy"; the
    other layouts' values single out the first."""
    grads = dense_grads()
    rules = Rules(frozenset({"tp", "dp", "cp"}), frozenset({"pp", "dp", "cp"}))
    measured = {
        layout: simulate(layout, 2.0, rules, _held(layout, 2.0, grads)) for layout in LAYOUTS
    }
    first = LAYOUTS[0]
    alone = named_mistakes(first, 2.0, measured[first], grads)
    assert alone is not None and len(alone.causes) == 2
    elsewhere = [(layout, measured[layout]) for layout in LAYOUTS[1:]]
    everywhere = named_mistakes(first, 2.0, measured[first], grads, elsewhere)
    assert everywhere is not None and len(everywhere.causes) == 1
    assert "tp pieces were not reduced" in everywhere.text()


def test_gate_words_tell_a_staleness_honoured_in_sync_from_an_off_by_one() -> None:
    assert gate_words("sync", 2, 0) == ""
    assert "sync honoured the staleness" in gate_words("sync", 2, 2)
    assert "off by one" in gate_words("sync", 2, 1)
    assert "ssp ignored its staleness" in gate_words("ssp", 2, 0)
    assert "not one threshold" in gate_words("ssp", 2, None)


class _Unit:
    def gather(self) -> None:
        """A method of the learner's unit."""


def test_a_unit_remark_points_at_its_own_class_method() -> None:
    got = with_sites({"gather": "it left the storage at 0 bytes"}, _Unit)
    assert got["gather"].startswith("it left the storage at 0 bytes (tests/test_namers_phase3.py:")
    assert got["gather"].endswith("in _Unit.gather)")
