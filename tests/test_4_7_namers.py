"""The mistake-namers of exercise 4.7 (tests/phase4/lm_namers.py), tried without a world.

Every named branch gets a mistake that must get its name and its nearest neighbours, which must
not; where a measurement cannot tell two mistakes apart, both must be listed (and only then).
The measurements are made here the way the graders make them: the shares a mistaken
``balance_loss_share`` would return, the gradient a mistaken ``finish_gradients`` would leave,
the calls CommCounter would record.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

if str(Path(__file__).resolve().parent / "phase4") not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent / "phase4"))

from lm_namers import (
    BALANCE_MISTAKES,
    BALANCE_RIGHT,
    PLACEMENT_WAYS,
    BalanceLayout,
    BalanceMeasured,
    HeldKind,
    LayoutFacts,
    LossCase,
    RegionCase,
    all_gather_problem,
    balance_problem,
    balance_way,
    communication_problem,
    count_problem,
    finish_mistakes,
    finish_problem,
    hand_made_problem,
    loss_problem,
    parameter_causes,
    placements_problem,
    placements_verdict,
    positions_problem,
    recipe_coefficients,
    reduce_scatter_problem,
    region_problem,
    right_axes,
    right_recipe,
    zigzag_positions,
)

from course.comm_counter import CommRecord
from course.topology import RankGrid

pytestmark = pytest.mark.harness


def ints(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-9, 10, shape, generator=g).double()


# ----------------------------------------------------------------------------- token_positions


def _positions(fn: object, seq: int, cp: int) -> list[torch.Tensor]:
    return [torch.tensor(fn(seq, r, cp)) for r in range(cp)]  # type: ignore[operator]


def test_right_positions_say_nothing() -> None:
    for seq, cp in ((16, 1), (16, 2), (16, 4)):
        assert positions_problem(seq, cp, _positions(zigzag_positions, seq, cp)) is None


def test_contiguous_positions_are_named_contiguous_not_local_indices() -> None:
    # rank 0's contiguous positions ARE its local indices: the other ranks tell them apart
    got = _positions(lambda s, r, c: list(range(r * s // c, (r + 1) * s // c)), 16, 2)
    message = positions_problem(16, 2, got)
    assert message and "contiguous layout" in message and "local indices" not in message


def test_local_indices_are_named_local_indices_not_contiguous() -> None:
    message = positions_problem(16, 2, _positions(lambda s, r, c: list(range(s // c)), 16, 2))
    assert message and "local indices" in message and "contiguous" not in message


def test_swapped_chunks_and_the_whole_sequence_get_their_own_names() -> None:
    def swapped(s: int, r: int, c: int) -> list[int]:
        half = s // (2 * c)
        p = zigzag_positions(s, r, c)
        return p[half:] + p[:half]

    message = positions_problem(16, 4, _positions(swapped, 16, 4))
    assert message and "wrong order" in message and "contiguous" not in message
    message = positions_problem(16, 2, _positions(lambda s, r, c: list(range(s)), 16, 2))
    assert message and "whole sequence" in message and "local indices" not in message


def test_positions_of_the_wrong_dtype_are_named_by_their_dtype_only() -> None:
    got = [t.float() for t in _positions(zigzag_positions, 16, 2)]
    message = positions_problem(16, 2, got)
    assert message and "int64" in message and "float32" in message
    assert "contiguous" not in message and "local" not in message


def test_positions_no_mistake_explains_are_described_not_named() -> None:
    got = _positions(zigzag_positions, 16, 2)
    got[1] = torch.tensor([4, 5, 6, 7, 8, 9, 10, 99])
    message = positions_problem(16, 2, got)
    assert message and "does not hold (99)" in message
    assert "contiguous" not in message and "local indices" not in message


def test_positions_in_another_order_or_of_another_length_are_described_as_such() -> None:
    got = _positions(zigzag_positions, 16, 2)
    got[1] = torch.tensor([5, 4, 6, 7, 8, 9, 10, 11])  # two swapped: no whole-rank pattern
    message = positions_problem(16, 2, got)
    assert message and "right ones in another order" in message and "chunks in the" not in message
    got[1] = torch.tensor([4, 5, 6, 7])
    message = positions_problem(16, 2, got)
    assert message and "4 positions; a rank holds seq_len/cp = 8 tokens" in message


# ----------------------------------------------------------------------------- collectives

SHARES = [ints(4, 3, 5, seed=r) for r in range(4)]  # one per rank of a world of 4
WHOLES = [ints(4, 6, 5, seed=10 + r) for r in range(4)]
GROUP = (0, 1)  # tp2 x dp2: rank 1's group


def test_all_gather_mistakes_get_their_names() -> None:
    shares = [SHARES[q] for q in GROUP]
    assert all_gather_problem(torch.cat(shares, 1), shares, SHARES) is None
    batch = all_gather_problem(torch.cat(shares, 0), shares, SHARES)
    assert batch and "dimension 0 (the batch)" in batch and "world" not in batch
    world = all_gather_problem(torch.cat(SHARES, 1), shares, SHARES)
    assert world and "all 4 ranks of the world" in world and "batch" not in world
    flipped = all_gather_problem(torch.cat(shares[::-1], 1), shares, SHARES)
    assert flipped and "reverse group-rank order" in flipped


def test_reduce_scatter_mistakes_get_their_names_and_not_their_neighbours() -> None:
    wholes = [WHOLES[q] for q in GROUP]
    total = wholes[0] + wholes[1]
    want = total.chunk(2, dim=1)[1]
    assert reduce_scatter_problem(want, wholes, WHOLES, 1, 1) is None
    cases = {
        "sequence left in dimension 0": want.transpose(0, 1),  # not transposed back
        "cut along dimension 0 (the batch)": total.chunk(2, dim=0)[1],
        "the whole sum over the group": total,
        "its own input": wholes[1].chunk(2, dim=1)[1],
        "the mean over the group": want / 2,
        "sum over all 4 ranks of the world": sum(WHOLES, torch.zeros(4, 6, 5)).chunk(2, 1)[1],
        "the share of group rank 0": total.chunk(2, dim=1)[0],
    }
    for name, got in cases.items():
        message = reduce_scatter_problem(got, wholes, WHOLES, 1, 1)
        assert message and name in message, (name, message)
        others = [other for other in cases if other != name and other in message]
        assert not others, (name, message)


def test_a_reduce_scatter_done_as_an_all_reduce_is_named_by_its_bytes() -> None:
    whole_bytes = 4 * 6 * 5 * 8
    budget = whole_bytes / 2  # (n-1)/n of the tensor, n = 2
    right = [CommRecord("reduce_scatter_tensor", whole_bytes // 2, None, GROUP)]
    assert communication_problem(right, GROUP, 4, budget, "a reduce-scatter") is None
    as_all_reduce = [CommRecord("all_reduce", whole_bytes, None, GROUP)]
    message = communication_problem(as_all_reduce, GROUP, 4, budget, "a reduce-scatter")
    assert message and "done as an all-reduce" in message and "twice the bytes" in message
    gather = communication_problem(as_all_reduce, GROUP, 4, budget, "an all-gather")
    assert gather and "all-gather done as an all-reduce" in gather
    on_world = [CommRecord("reduce_scatter_tensor", whole_bytes // 4, None, None)]
    world = communication_problem(on_world, GROUP, 4, budget, "a reduce-scatter")
    assert world and "the world group" in world and "all-reduce" not in world


def test_collectives_no_mistake_explains_are_described_by_shape_and_values() -> None:
    shares = [SHARES[q] for q in GROUP]
    other = all_gather_problem(torch.cat(shares, 1) + 1, shares, SHARES)
    assert other and "120 of 120 elements differ, by up to 1" in other  # what differs, not
    assert "no known mistake gives this" in other  # what should have been computed
    shape = all_gather_problem(torch.zeros(1, 2, 3), shares, SHARES)
    assert shape and "shape (1, 2, 3), expected (4, 6, 5)" in shape
    wholes = [WHOLES[q] for q in GROUP]
    odd = reduce_scatter_problem(torch.zeros(4, 3, 5), wholes, WHOLES, 1, 1)
    assert odd and "contiguous share of the sequence" in odd
    assert "0 times the expected values" in odd and "expected (4, 3, 5)" not in odd  # same shape
    partly = (wholes[0] + wholes[1]).chunk(2, dim=1)[1].clone()
    partly[:, 2] += 1  # the last token of the share only
    told = reduce_scatter_problem(partly, wholes, WHOLES, 1, 1)
    assert told and "20 of 60 elements differ" in told and "sequence positions 2 of 0-2" in told
    extra = [CommRecord("all_gather", 960, None, GROUP), CommRecord("all_gather", 960, None, GROUP)]
    bytes_ = communication_problem(extra, GROUP, 4, 480, "an all-gather")
    assert bytes_ and "2 x all_gather of 1920 bytes" in bytes_ and "all-reduce" not in bytes_


def _region(which: str, sp: bool, rank_in_group: int = 1) -> RegionCase:
    tokens_in, tokens_out = {("enter", True): (3, 6), ("enter", False): (6, 6),
                             ("leave", True): (6, 3), ("leave", False): (6, 6)}[(which, sp)]  # fmt: skip
    xs = [ints(4, tokens_in, 5, seed=20 + r) for r in range(4)]
    ws = [ints(4, tokens_out, 5, seed=30 + r) for r in range(4)]
    return RegionCase(which, sp, rank_in_group, [xs[q] for q in GROUP], [ws[q] for q in GROUP],
                      xs, ws)  # fmt: skip


def test_regions_right_say_nothing_and_each_mistake_gets_its_name() -> None:
    for which in ("enter", "leave"):
        for sp in (True, False):
            case = _region(which, sp)
            out, grad = case.want()
            assert region_problem(case, out, grad) is None
    enter_sp = _region("enter", True)
    out, grad = enter_sp.want()
    assert "2.6's f is the identity" in str(region_problem(enter_sp, enter_sp.inputs[1], None))
    assert "no gradient reached" in str(region_problem(enter_sp, out, None))
    own = enter_sp.weights[1].chunk(2, 1)[1]
    assert "only this rank's own part" in str(region_problem(enter_sp, out, own))
    leave_sp = _region("leave", True)
    out, _ = leave_sp.want()
    whole = leave_sp.inputs[0] + leave_sp.inputs[1]
    message = str(region_problem(leave_sp, whole, None))
    assert "2.6's g" in message and "reduce-scatter" in message
    only_own = torch.zeros(4, 6, 5, dtype=torch.float64)
    only_own[:, 3:] = leave_sp.weights[1]
    assert "own share of the tokens only" in str(region_problem(leave_sp, out, only_own))
    leave = _region("leave", False)
    out, _ = leave.want()
    summed = leave.weights[0] + leave.weights[1]
    assert "backward too" in str(region_problem(leave, out, summed))
    assert "came back as it was" in str(region_problem(leave, leave.inputs[1], None))
    enter = _region("enter", False)
    out, _ = enter.want()
    assert "own part" in str(region_problem(enter, out, enter.weights[1]))


# ----------------------------------------------------------------------------- count


COUNT_GRIDS = {"dp2 x cp2": RankGrid(2, cp=2), "cp2 x tp2": RankGrid(1, 2, cp=2)}
OWN = {"dp2 x cp2": [10, 5, 9, 13], "cp2 x tp2": [15, 15, 18, 18]}


def _counts(rule: str) -> dict[str, list[tuple[object, int]]]:
    out = {}
    for label, grid in COUNT_GRIDS.items():
        own = OWN[label]
        per_rank: list[tuple[object, int]] = []
        for r in range(4):
            if rule == "own":
                ranks: tuple[int, ...] = (r,)
            elif rule == "world":
                ranks = (0, 1, 2, 3)
            else:
                ranks = grid.group_of(rule, r)
            per_rank.append((sum(own[q] for q in ranks), own[r]))
        out[label] = per_rank
    return out


def test_count_mistakes_are_named_only_when_every_layout_agrees() -> None:
    assert count_problem(_counts("dp_cp"), COUNT_GRIDS) is None
    words = {"own": "its own count", "dp": "over dp only", "cp": "over cp only",
             "tp": "the sum over tp", "world": "every rank of the world"}  # fmt: skip
    for rule, phrase in words.items():
        problem = count_problem(_counts(rule), COUNT_GRIDS)
        assert problem is not None, rule
        assert phrase in problem[3], (rule, problem)
        assert not [p for r, p in words.items() if r != rule and p in problem[3]], (rule, problem)
    typed = _counts("dp_cp")
    typed["dp2 x cp2"][0] = (torch.tensor(37), 10)
    problem = count_problem(typed, COUNT_GRIDS)
    assert problem and "expected an int" in problem[3]


# ----------------------------------------------------------------------------- loss


SIZES = {"dp": 2, "cp": 3, "tp": 4, "dp_cp": 6, "world": 24}
ONE = {"dp": 1, "cp": 1, "tp": 1, "dp_cp": 1, "world": 1}
LOSS_CASES = [LossCase("1 rank", 30.0, 11, 16, 11, ONE),
              LossCase("dp2 x cp3 x tp4", 30.0, 11, 16, 53, SIZES)]  # fmt: skip


def test_loss_share_mistakes_are_named_only_when_every_case_agrees() -> None:
    right = [c.want for c in LOSS_CASES]
    assert loss_problem(right, LOSS_CASES) is None
    # on one rank, masked targets counted with or without the dp x cp scale are the same
    # number: only the second case tells them apart
    plain = loss_problem([30 / 16, 30 / 16], LOSS_CASES)
    scaled = loss_problem([30 / 16, 30 / 16 * 6], LOSS_CASES)
    assert plain and plain[0] == 0 and "masked ones counted: divide" in plain[1]
    assert "and scaled by dp x cp" not in plain[1]
    assert scaled and "(masked ones counted) and scaled by dp x cp" in scaled[1]
    assert "masked ones counted: divide" not in scaled[1]
    # the world size on one case and the dp size on the other fit no single mistake
    mixed = loss_problem([right[0], 30 * 24 / 53], LOSS_CASES)
    assert mixed and "scaled by the world size" in mixed[1]
    both = loss_problem([right[0] * 2, 30 * 24 / 53], LOSS_CASES)
    assert both and "scaled by" not in both[1] and "2 times the expected value" in both[1]


def test_loss_share_values_no_mistake_gives_are_described_by_their_ratio() -> None:
    right = [c.want for c in LOSS_CASES]
    odd = loss_problem([right[0], right[1] * 1.37], LOSS_CASES)
    assert odd and odd[0] == 1 and "1.37 times the expected value" in odd[1]
    assert (
        "nor does one size of the layout (dp 2, cp 3, tp 4" in odd[1]
        and "right on 1 rank" in odd[1]
    )
    by_tp = loss_problem([right[0], right[1] / 4], LOSS_CASES)
    assert (
        by_tp and "0.25 times" in by_tp[1] and "divided by the tp size (1, 4 in these" in by_tp[1]
    )
    near = loss_problem([right[0], right[1] * (1 + 1e-6)], LOSS_CASES)
    assert near and "off by" in near[1] and "times the expected" not in near[1]


# ----------------------------------------------------------------------------- balance

BALANCE_LAYOUTS = (
    BalanceLayout("dp2 x cp2", 2, 2, 1, False),
    BalanceLayout("cp2 x tp2 with sequence parallelism", 1, 2, 2, True),
    BalanceLayout("cp2 x tp2 without sequence parallelism", 1, 2, 2, False),
)
GROUPS_OF = {"holders": ("cp",), "own": (), "cp": ("cp",), "cp_tp": ("cp", "tp"),
             "dp_cp": ("dp_cp",), "world": ("world",)}  # fmt: skip


def _routing() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    probs = torch.softmax(torch.randn(4, 16, 4, generator=g, dtype=torch.float64) * 2, dim=-1)
    return probs, probs.topk(2, dim=-1).indices


def _measure(way: object, with_groups: bool = True) -> dict[str, BalanceMeasured]:
    probs, experts = _routing()
    out = {}
    for layout in BALANCE_LAYOUTS:
        values, grads = balance_way(way, layout, probs, experts, 4, 4)  # type: ignore[arg-type]
        names = set(GROUPS_OF[way.counts_over])  # type: ignore[attr-defined]
        if way.counts_over == "holders" and layout.sp:  # type: ignore[attr-defined]
            names.add("tp")
        groups = [frozenset(names)] * 4 if with_groups else None
        out[layout.label] = BalanceMeasured(values, grads, groups)
    return out


def _balance(measured: dict[str, BalanceMeasured]) -> tuple[str, str] | None:
    probs, experts = _routing()
    right, _ = balance_way(BALANCE_RIGHT, BALANCE_LAYOUTS[0], probs, experts, 4, 4)
    want = sum(right) / 4
    return balance_problem(BALANCE_LAYOUTS, measured, probs, experts, 4, 4, want)


def test_the_right_balance_loss_says_nothing() -> None:
    assert _balance(_measure(BALANCE_RIGHT)) is None


@pytest.mark.parametrize("way", BALANCE_MISTAKES, ids=[w.key for w in BALANCE_MISTAKES])
def test_each_balance_mistake_gets_its_own_name(way: object) -> None:
    problem = _balance(_measure(way))
    assert problem is not None
    _, message = problem
    assert way.says in message, message  # type: ignore[attr-defined]
    others = [w.key for w in BALANCE_MISTAKES if w is not way and w.says in message]
    assert not others, (way.key, others, message)  # type: ignore[attr-defined]


def test_a_2x_balance_loss_is_not_blamed_on_whole_sequences_by_its_ratio_alone() -> None:
    # the counts summed over tp without sequence parallelism give 2x on cp2 x tp2 too
    way = next(w for w in BALANCE_MISTAKES if w.key == "counts over tp too")
    problem = _balance(_measure(way))
    assert problem and "(2x)" in problem[1] and "counted tp times" in problem[1]
    assert "whole sequence's loss" not in problem[1]


def test_balance_gradients_alone_wrong_or_two_mistakes_at_once_are_said_so() -> None:
    measured = _measure(BALANCE_RIGHT)
    label = BALANCE_LAYOUTS[0].label
    right = measured[label]
    measured[label] = BalanceMeasured(right.shares, [g * 2 for g in right.grads], right.groups)
    problem = _balance(measured)
    assert problem and "the shares are right" in problem[1] and "counts f carry none" in problem[1]
    both = _measure(next(w for w in BALANCE_MISTAKES if w.key == "unscaled"))
    p_local = _measure(next(w for w in BALANCE_MISTAKES if w.key == "P over local tokens"))
    both[BALANCE_LAYOUTS[1].label] = p_local[BALANCE_LAYOUTS[1].label]
    problem = _balance(both)
    assert problem and "in this layout alone it fits" in problem[1]


def test_without_the_collectives_recorded_the_ambiguous_balance_mistakes_are_listed() -> None:
    way = next(w for w in BALANCE_MISTAKES if w.key == "counts over cp only")
    problem = _balance(_measure(way, with_groups=False))
    assert problem and way.says in problem[1]


# ----------------------------------------------------------------------------- finish_gradients

FINISH_GRIDS = {
    "dp2 x cp2 ep2": (RankGrid(2, cp=2, ep=2), False),
    "dp2 x tp2 sp": (RankGrid(2, 2), True),
    "dp2 x tp2": (RankGrid(2, 2), False),
    "pp2 x dp2": (RankGrid(2, 1, 2), False),
}
KINDS = [
    HeldKind("blocks.0.attention.qkv.weight"),
    HeldKind("blocks.0.mlp_norm.weight", tp_replicated=True),
    HeldKind("blocks.1.mlp.experts.0.fc1.weight", tp_replicated=True, expert=True),
    HeldKind("final_norm.weight", tp_replicated=True, reduced=True),
    HeldKind("embedding.weight", tp_replicated=True, tied=True),
    HeldKind("embedding.weight", tp_replicated=True),
]
INPUTS = [ints(2, 4, seed=40 + r) for r in range(4)]


def _after(coefficients: list[float]) -> torch.Tensor:
    return sum((c * x for c, x in zip(coefficients, INPUTS, strict=True)), torch.zeros(2, 4))


@pytest.mark.parametrize("layout", list(FINISH_GRIDS))
def test_each_finish_mistake_is_named_and_only_indistinguishable_ones_beside_it(
    layout: str,
) -> None:
    grid, sp = FINISH_GRIDS[layout]
    for kind in KINDS:
        if kind.tied and grid.pp == 1:
            continue
        want = _after(recipe_coefficients(right_recipe(kind, sp), grid, 1))
        assert finish_problem(kind, sp, grid, 1, want, INPUTS) is None
        mistakes = finish_mistakes(kind, sp, grid)
        for mistake, recipe in mistakes:
            world = "world" in recipe.sums
            c = ([1.0 if q == 1 else 0.0 for q in range(4)] if recipe.unchanged
                 else recipe_coefficients(recipe, grid, 1))  # fmt: skip
            got = _after(c)
            message = finish_problem(kind, sp, grid, 1, got, INPUTS, on_world=world)
            if torch.equal(got, want):
                assert message is None
                continue
            assert message and mistake.says in message, (layout, kind, mistake.key, message)
            for other, other_recipe in mistakes:  # listed beside it: the same measurement
                if other is not mistake and other.says in message:
                    oc = ([1.0 if q == 1 else 0.0 for q in range(4)] if other_recipe.unchanged
                          else recipe_coefficients(other_recipe, grid, 1))  # fmt: skip
                    assert oc == c, (layout, kind.name, mistake.key, other.key)


def test_the_expert_summed_over_dp_x_cp_gets_expert_advice_not_the_dense_weights() -> None:
    grid, kind = RankGrid(2, cp=2, ep=2), KINDS[2]
    got = _after([0.25] * 4)  # summed over dp x cp (= the world here), divided by 4
    message = finish_problem(kind, False, grid, 1, got, INPUTS)
    assert message and "OTHER experts" in message
    assert "whole world" not in message.split(";", 1)[1]  # no group= call was seen


def test_a_division_by_the_world_size_is_named_as_such_not_a_tp_sum() -> None:
    grid, kind = RankGrid(2, 2), KINDS[1]
    c = recipe_coefficients(right_recipe(kind, True), grid, 1)
    got = _after([x * 2 / 4 for x in c])  # right ranks, divided by 4 instead of 2
    message = finish_problem(kind, True, grid, 1, got, INPUTS)
    assert (
        message and "divided by the world size" in message and "sum it over the tp" not in message
    )


def test_the_untied_embedding_summed_with_the_head_is_named() -> None:
    grid, kind = RankGrid(2, 1, 2), KINDS[5]
    got = _after([0.5] * 4)  # rank 1's dp x cp (1, 0) and the embedding group (1, 3)
    message = finish_problem(kind, False, grid, 1, got, INPUTS)
    assert message and "untied" in message and "embedding group" in message


def test_a_value_no_sum_gives_is_said_so() -> None:
    got = torch.maximum(INPUTS[0], INPUTS[1])
    message = finish_problem(KINDS[0], False, RankGrid(2, 2), 1, got, INPUTS)
    assert message and "not a sum of the ranks' gradients" in message


def test_the_hand_made_run_never_pushes_tp_or_tie_sums_through_the_data_parallel_hook() -> None:
    message = hand_made_problem(RankGrid(2, 2), 1, INPUTS[1], INPUTS)
    assert "this rank's own gradient" in message and "in place" in message
    assert "tp" not in message.replace("this rank", "") and "embedding" not in message


# ----------------------------------------------------------------------------- placements


def test_placements_accept_equivalent_groups_and_name_missing_and_extra_ones() -> None:
    norm = HeldKind("blocks.0.mlp_norm.weight", tp_replicated=True)
    assert placements_problem(norm, {"dp_cp", "tp"}) is None
    assert placements_problem(norm, {"dp", "cp", "tp"}) is None  # the same copies
    missing = placements_problem(norm, {"dp_cp"})
    assert missing and "missing ['tp']" in missing and "extra" not in missing
    untied = HeldKind("head.weight", tp_replicated=True)
    extra = placements_problem(untied, {"dp_cp", "tp", "embedding"})
    assert extra and "extra ['embedding']" in extra and "missing" not in extra


# ----------------------------------------------------------------------------- training layouts


def test_training_advice_lists_only_what_the_layout_can_have() -> None:
    one_stage = LayoutFacts(dp=2, tied=True)
    causes = " ".join(parameter_causes("embedding/head", one_stage))
    assert "tie" not in causes and "tp" not in causes and "dp x cp" in causes
    no_tp = " ".join(parameter_causes("norm", LayoutFacts(cp=2)))
    assert "tp" not in no_tp and "cp" in no_tp
    pipeline = " ".join(
        parameter_causes("embedding/head", LayoutFacts(pp=2, tied=True, tie_across_ranks=True))
    )
    assert "tied embedding" in pipeline and "dp x cp" not in pipeline
    sp = " ".join(parameter_causes("norm", LayoutFacts(tp=2, sp=True)))
    assert "summed over tp" in sp and "not summed over tp" not in sp


def test_placements_name_a_way_only_when_every_gradient_fits_it_alone() -> None:
    cases = [
        (HeldKind("blocks.0.mlp_norm.weight", tp_replicated=True), "a norm"),
        (HeldKind("embedding.weight", tp_replicated=True, tied=True), "the tied embedding"),
        (HeldKind("blocks.0.mlp.down.weight"), "a tp shard"),
    ]
    no_tp, words = PLACEMENT_WAYS["no tp"]
    said = placements_verdict(cases, [no_tp(kind) for kind, _ in cases])
    assert said and words in said and "2 of 3 gradients" in said
    # tp and embedding both left out: two ways at once, described gradient by gradient
    said = placements_verdict(cases, [right_axes(kind) - {"tp", "embedding"} for kind, _ in cases])
    assert said and "missing ['embedding', 'tp']" in said
    assert not any(words in said for _, words in PLACEMENT_WAYS.values())
