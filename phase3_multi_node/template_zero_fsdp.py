# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase3.py
"""Exercise 3.5, FSDP-style part 2: ``fsdp_wrap``, one unit per block, gathers issued ahead.

``fsdp_wrap(model, modules, optimizer_factory, policy, prefetch)`` is ZeRO-3 the way FSDP2's
``fully_shard`` does it (torch/distributed/fsdp/_fully_shard/): each listed module (a block) is
one unit (``zero_fsdp_units.FsdpUnit``), the root takes the parameters no block holds, and

* before a unit's forward, and before its backward, the unit must be gathered; after its forward
  it is freed, after its backward (its gradients reduce-scattered) too;
* a bounded **prefetch window**: when a unit is about to compute, the all-gathers of the next
  ``prefetch`` units (in forward order going forward, in backward order going backward) are
  issued without waiting, so they travel while this unit computes. FSDP2 prefetches one unit in
  backward by default and lets you set more, in both directions
  (``set_modules_to_forward_prefetch``/``set_modules_to_backward_prefetch``).

The window bounds memory: while unit i computes, unit i and at most ``prefetch`` units after it
hold their compute buffers, so the gathered parameters alive never exceed the largest sum of
``prefetch + 1`` consecutive units (in the compute dtype). A window of 0 is stage 3 of
``zero.py`` (gather, compute, free); an unbounded one gathers the whole model at once.

Per step, in bytes handed to collectives (each counted by its full buffer, as 3.5 counts): two
all-gathers per unit in the compute dtype, one reduce-scatter in the reduce dtype:
``2·Ψ·b_param + Ψ·b_reduce`` (Ψ padded); with bf16 parameters and an fp32 reduction that is
``8Ψ`` bytes where fp32 ZeRO-3 moves ``12Ψ``.

Use::

    model, optimizer = fsdp_wrap(model, list(model), lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                 MixedPrecision(torch.bfloat16, torch.float32), prefetch=1)
    loss_fn(model(x).float(), y).backward()
    optimizer.step()
    optimizer.zero_grad()
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phase3_multi_node.wrap_policy import UnitGroup, are_groups
from phase3_multi_node.zero_fsdp_support import (
    FsdpOptimizer,
    MixedPrecision,
    OptimizerFactory,
    assign_unit_parameters,
    cast_floating,
    check_fsdp_arguments,
    group_unit_parameters,
    in_backward,
)
from phase3_multi_node.template_zero_fsdp_units import FsdpUnit


class Prefetcher:
    """Decides, each time a unit is about to compute, what to wait for and what to start.

    ``window`` is the number of units whose all-gathers may be issued ahead of the one
    computing. ``forward`` lists the units in forward order, ``backward`` in backward order.
    """

    def __init__(self, units: list[FsdpUnit], window: int) -> None:
        self.window = window
        self.forward = list(units)
        self.backward = list(reversed(units))

    def before(self, order: list[FsdpUnit], position: int, recompute: bool = False) -> None:
        """Unit ``order[position]`` is about to compute (forward or backward, as ``order`` is).

        ``recompute`` is True when the forward runs a second time inside backward (activation
        checkpointing, 2.3); ``order`` is then the forward order.
        """
        # TODO 3.5: the unit about to compute is gathered, and the window's next gathers travel.
        # Invariant: when this returns, order[position] holds its whole parameters; the gathers the
        #   window allows are issued and not waited for, so they run while this unit computes; every
        #   gather issued is waited for later in this same pass, by the unit it belongs to; at every
        #   unit's compute start the units holding memory are exactly that unit and the next
        #   `window` ones of `order` (fewer at the end).
        # Hint 1: FsdpUnit.start_gather issues without waiting (and does nothing twice);
        #   FsdpUnit.wait_gather waits, and gathers first when nothing was issued.
        # More hints: uv run python -m tests.hint 3.5
        # See guidelines.md#zero-3-the-fsdp-way
        raise NotImplementedError(
            "TODO 3.5: the unit about to compute is gathered, and the window's next gathers travel "
            "(see phase3_multi_node/guidelines.md#zero-3-the-fsdp-way)"
        )


def install_hooks(
    model: nn.Module,
    placed: list[tuple[nn.Module, FsdpUnit]],
    prefetcher: Prefetcher,
    optimizer: FsdpOptimizer,
) -> None:
    """Forward pre-hook: wait/prefetch, cast the inputs; forward hook: free; backward pre-hook:
    wait/prefetch; post-accumulate-grad hooks: when a unit's last gradient is in, reduce it and
    free the unit (the root's unit also frees at the end of forward and regathers first thing in
    backward, where FSDP2 keeps the root gathered).

    A forward inside backward is a recompute (activation checkpointing): the prefetcher is told
    so, and the unit stays gathered after it, since its own backward comes next (FSDP2's
    ``_post_forward`` does not reshard during backward either); it frees once its gradients are
    reduced. Each unit is still gathered twice per step.
    """
    for index, (module, unit) in enumerate(placed):

        def before_forward(_m: nn.Module, args: Any, kwargs: Any, unit: FsdpUnit = unit) -> Any:
            position = prefetcher.forward.index(unit)
            prefetcher.before(prefetcher.forward, position, recompute=in_backward())
            return cast_floating(args, unit.param_dtype), cast_floating(kwargs, unit.param_dtype)

        def after_forward(*_: Any, unit: FsdpUnit = unit) -> None:
            if not in_backward():  # a recomputed unit's backward comes next: keep it
                unit.free()

        def before_backward(*_: Any, unit: FsdpUnit = unit) -> None:
            prefetcher.before(prefetcher.backward, prefetcher.backward.index(unit))

        def ready(_p: torch.Tensor, index: int = index, unit: FsdpUnit = unit) -> None:
            optimizer.pending[index] = optimizer.pending.get(index, 0) + 1
            if optimizer.pending[index] < len(unit.layout.params):
                return
            optimizer.pending[index] = 0
            unit.reduce_gradients()
            unit.free()

        module.register_forward_pre_hook(before_forward, with_kwargs=True)
        module.register_forward_hook(after_forward)
        module.register_full_backward_pre_hook(before_backward)
        for p in unit.layout.params:
            p.register_post_accumulate_grad_hook(ready)


def fsdp_wrap(
    model: nn.Module,
    modules: Sequence[nn.Module | UnitGroup],
    optimizer_factory: OptimizerFactory,
    policy: MixedPrecision | None = None,
    prefetch: int = 1,
    group: dist.ProcessGroup | None = None,
) -> tuple[nn.Module, FsdpOptimizer]:
    """Shard ``model`` over ``group`` as FSDP2 does: one unit per module of ``modules`` (and the
    root for the rest), master shards in the parameters' dtype, compute and reduction in
    ``policy``'s dtypes, the all-gathers of the next ``prefetch`` units issued ahead.

    ``modules`` may instead be explicit ``(module, layers)`` groups (``wrap_policy.py``): a unit
    of those layers' own parameters, gathered around ``module``.
    Returns the same ``model`` (its parameters now views of the units' compute buffers, in the
    compute dtype) and an :class:`FsdpOptimizer` built by ``optimizer_factory`` on the shards.
    Frozen parameters, and parameters tied across units, are refused before any communication.
    """
    check_fsdp_arguments(model, modules, prefetch)
    policy = policy or MixedPrecision()
    assigned = (
        group_unit_parameters(model, modules)  # type: ignore[arg-type]
        if are_groups(modules)
        else assign_unit_parameters(model, modules)  # type: ignore[arg-type]
    )
    placed = [(module, FsdpUnit(params, policy, group)) for module, params in assigned]
    units = [unit for _, unit in placed]
    optimizer = FsdpOptimizer(optimizer_factory([unit.shard for unit in units]), units)
    install_hooks(model, placed, Prefetcher(units, prefetch), optimizer)
    return model, optimizer
