"""Given code refuses what it cannot honour (issue 49 item 4), before anything is sent.

A given helper that silently does something else than it was asked (a hand-made all-reduce
quietly replaced by torch's for an op it cannot do) turns the learner's mistake into a passing
run, or a grader's advice into nonsense ("pass the function you did pass").
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from phase4_production.lm_support import all_reduce_flat

pytestmark = pytest.mark.harness


@pytest.mark.parametrize("op", [dist.ReduceOp.AVG, dist.ReduceOp.MAX])
def test_all_reduce_flat_refuses_another_op_than_sum_with_a_hand_made_all_reduce(
    op: dist.ReduceOp.RedOpType,
) -> None:
    handed: list[torch.Tensor] = []

    def hand_made(tensor: torch.Tensor, group: object = None) -> torch.Tensor:
        handed.append(tensor)
        return tensor

    with pytest.raises(ValueError, match=r"only sums.*sum with it .* and divide afterwards"):
        all_reduce_flat([torch.ones(3)], None, op, all_reduce_fn=hand_made)
    assert not handed, "refused after calling the hand-made all-reduce"
