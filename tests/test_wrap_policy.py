"""3.5's wrappers with a wrap policy (phase3_multi_node/wrap_policy.py): refusals before any
communication. The groups themselves are trained by every ZeRO and FSDP-style layout of 4.7
(the runtime groups each block's layers by kind) against one process."""

from __future__ import annotations

import pytest
from torch import nn

from phase3_multi_node.wrap_policy import check_groups, layers_of, one_per_layer
from phase3_multi_node.zero_fsdp_support import group_unit_parameters

pytestmark = pytest.mark.harness


def model() -> nn.Sequential:  # Linear, then a block of (LayerNorm, Linear)
    return nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4)))


def test_one_unit_per_layer_is_the_exercises_layout() -> None:
    m = model()
    assert [layers for _, layers in one_per_layer(m)] == [[layer] for layer in layers_of(m)]
    check_groups(m, one_per_layer(m))


def test_groups_that_miss_or_repeat_a_layer_or_leave_their_module_are_refused() -> None:
    m = model()
    block, first = m[1], m[0]
    assert isinstance(block, nn.Sequential)
    with pytest.raises(ValueError, match=r"layer 0 is in no group"):
        check_groups(m, [(block, list(block))])
    with pytest.raises(ValueError, match=r"layer 1.0 is in groups 1 and 2"):
        check_groups(m, [(first, [first]), (block, [block[0]]), (block, list(block))])
    with pytest.raises(ValueError, match=r"group 0: layer 0 is not inside 1"):
        check_groups(m, [(block, [first, *block])])
    with pytest.raises(ValueError, match=r"its module is not part of the model"):
        check_groups(m, [(nn.Linear(1, 1), [first]), (block, list(block))])


def test_a_weight_tied_across_two_groups_is_refused_and_one_group_holds_each_once() -> None:
    m = model()
    first, block = m[0], m[1]
    assert isinstance(block, nn.Sequential)
    block[1].weight = first.weight  # the block's Linear reuses the first Linear's weight
    with pytest.raises(ValueError, match=r"0.weight is used by groups 0 and 1"):
        group_unit_parameters(m, [(first, [first]), (block, list(block))])
    ((module, params),) = group_unit_parameters(m, [(m, [first, *block])])
    assert module is m and len(params) == len({id(p) for p in m.parameters()}) == 5
