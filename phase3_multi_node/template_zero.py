# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase3.py
"""Exercise 3.5: ZeRO stages 1-3, one entry point, ``zero_wrap(model, optimizer_factory, stage)``.

ZeRO (Rajbhandari, Rasley, Ruwase & He, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", SC 2020) removes the redundancy of data parallelism, where each of N ranks
holds all the model states. With Adam in fp32, per parameter: 4 bytes of weights, 4 of gradient
and 8 of optimizer state (``exp_avg``, ``exp_avg_sq``): 16Ψ bytes per rank for Ψ parameters.

* Stage 1 (P_os) shards the optimizer state: 8Ψ + 8Ψ/N. Each rank runs the optimizer on its
  slice only, then the updated slices are all-gathered.
* Stage 2 (P_os+g) also shards the gradients: 4Ψ + 12Ψ/N. Gradients are reduce-scattered (each
  rank receives the mean of its slice only) as soon as a layer's backward is done; the full
  gradient is dropped.
* Stage 3 (P_os+g+p) also shards the parameters: 16Ψ/N. A layer is whole only while it
  computes.

Communication per step, in elements handed to collectives (the paper's accounting, section 7):
stages 1-2 move 2Ψ (reduce-scatter + all-gather, exactly what data parallelism's all-reduce
moves); stage 3 moves 3Ψ (two all-gathers and a reduce-scatter).

Layout: every module with parameters of its own (a "layer") is a unit with one flat buffer per
dtype, padded to a multiple of N (zero_partition.py), as FSDP's FlatParameter. Ψ in the formulas
is then the padded count: the sum over units of N·ceil(numel/N).

Frozen parameters (``requires_grad=False``) are left as they are: whole on every rank, in no
unit and no optimizer, never updated (p bytes each on every rank, no gradient, no state), as
``torch.optim`` and ``ZeroRedundancyOptimizer`` leave a parameter without a gradient. A tied
parameter (one ``nn.Parameter`` registered by two modules) is sharded once, in the unit of the
first layer that registers it; autograd sums both uses into its one gradient.

Use like any model and optimizer (every trainable parameter must get a gradient in every
backward)::

    model, optimizer = zero_wrap(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), stage=2)
    loss_fn(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phase3_multi_node.sharded_optimizer import ShardedOptimizer
from phase3_multi_node.wrap_policy import UnitGroup, check_groups, one_per_layer
from phase3_multi_node.template_zero_partition import group_by_dtype, make_layout
from phase3_multi_node.template_zero_units import ZeroUnit

STAGES = (1, 2, 3)
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class ZeroOptimizer(ShardedOptimizer):
    """The optimizer ``zero_wrap`` returns: it steps this rank's shards only.

    ``inner`` is the optimizer built by the factory on the shards; ``state`` and
    ``param_groups`` are its own (so its state holds 1/N of the model's elements).
    """

    def __init__(self, inner: torch.optim.Optimizer, units: list[ZeroUnit], stage: int) -> None:
        super().__init__(inner, units)
        self.stage = stage

    def step(self) -> None:
        """One optimizer step on this rank's shards; afterwards every rank's model is where one
        process's would be."""
        self.refuse_partial_backward(
            "ZeRO here needs a gradient for every parameter in every backward"
        )
        if self.stage == 1:
            for unit in self.units:
                unit.adopt_gradients()
        # TODO 3.5: one step that leaves every rank's model where one process's would be.
        # Invariant: afterwards every rank's model holds the parameters one process would have after
        #   AdamW on the whole global batch (in stage 3 its shards do); the inner optimizer only
        #   ever sees this rank's shards; the bytes held and the collectives of a step are the
        #   contract's.
        # Hint 1: in stage 1 unit.flat_grad holds the full local gradient and shard.grad is a view
        #   of this rank's slice of it; in stages 2-3 the given gradient hooks have put this rank's
        #   reduced slice in shard.grad already.
        # More hints: uv run python -m tests.hint 3.5
        # See guidelines.md#35-zero-stages-1-3
        raise NotImplementedError(
            "TODO 3.5: one step that leaves every rank's model where one process's would be "
            "(see phase3_multi_node/guidelines.md#35-zero-stages-1-3)"
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Stage 1 zeroes its flat gradient in place (the parameters' .grad are views of it);
        stages 2-3 drop the shards' gradients."""
        for unit in self.units:
            if unit.flat_grad is not None:
                unit.flat_grad.zero_()
            elif set_to_none:
                unit.shard.grad = None
            elif unit.shard.grad is not None:
                unit.shard.grad.zero_()


def unit_parameters(layer: nn.Module, owned: set[int]) -> list[nn.Parameter]:
    """The parameters ``layer`` registers itself that its ZeRO units shard, in registration
    order; ``owned`` holds the ``id`` of every parameter some unit holds already, and grows by
    the ones returned.

    A frozen parameter (``requires_grad=False``) gets no gradient and is never updated: no unit
    holds it (it stays whole on every rank, outside the optimizer). A tied parameter, one
    ``nn.Parameter`` object registered by two modules (an embedding and the output layer that
    reuses its weight), belongs to the first layer that registers it, and to no other.
    """
    # TODO 3.5: the parameters this layer's units shard, each trainable parameter in one unit.
    # Invariant: called on every layer in registration order with one `owned`, it returns every
    #   trainable parameter of the model exactly once (from the first layer that registers it
    #   itself), no frozen one ever, in registration order; `owned` grows by what it returns.
    # Hint 1: a tied weight is the very same nn.Parameter object in both modules.
    # More hints: uv run python -m tests.hint 3.5
    # See guidelines.md#35-zero-stages-1-3
    raise NotImplementedError(
        "TODO 3.5: the parameters this layer's units shard, each trainable parameter in one unit "
        "(see phase3_multi_node/guidelines.md#35-zero-stages-1-3)"
    )


def install_gradient_hooks(optimizer: ZeroOptimizer) -> None:
    """Stages 2-3: when a unit's last gradient arrives, reduce-scatter them (and, stage 3, free)."""
    for index, unit in enumerate(optimizer.units):
        params = unit.layout.params

        def ready(_param: torch.Tensor, index: int = index, unit: ZeroUnit = unit) -> None:
            optimizer.pending[index] = optimizer.pending.get(index, 0) + 1
            if optimizer.pending[index] < len(unit.layout.params):
                return
            optimizer.pending[index] = 0
            unit.reduce_gradients()
            if unit.stage == 3:
                unit.free()

        for p in params:
            p.register_post_accumulate_grad_hook(ready)


def install_stage3_hooks(layer: nn.Module, units: list[ZeroUnit]) -> None:
    """Stage 3: hooks on ``layer`` that keep its parameters whole whenever it computes, and
    only shards otherwise.

    ``units`` are the units whose parameters the layer reads: its own, and the unit of a tied
    parameter another layer owns. (The given gradient hooks free them once their gradients are
    reduce-scattered.)
    """

    # TODO 3.5: the layer's parameters whole whenever it computes, and only shards otherwise.
    # Invariant: whenever the layer's forward or backward reads its parameters they are whole;
    #   between forward and backward, and after the step, only shards are held; at most one layer is
    #   gathered at a time (peak parameter memory = the shards + the largest layer).
    # Hint 1: nn.Module can run a function of yours just before its forward, just after it, and just
    #   before its backward.
    # More hints: uv run python -m tests.hint 3.5
    # See guidelines.md#35-zero-stages-1-3
    raise NotImplementedError(
        "TODO 3.5: the layer's parameters whole whenever it computes, and only shards otherwise "
        "(see phase3_multi_node/guidelines.md#35-zero-stages-1-3)"
    )


def check_arguments(model: nn.Module, stage: int) -> None:
    """Refuse what zero_wrap cannot shard, before any communication."""
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r} is not a ZeRO stage: choose 1, 2 or 3")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("the model has no trainable parameters to shard")


def broadcast_frozen(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Make every frozen parameter equal to group rank 0's, as the units do with theirs (and
    DDP with every parameter): a collective, once, at wrap time."""
    src = dist.get_process_group_ranks(group or dist.group.WORLD)[0]
    for p in model.parameters():
        if not p.requires_grad:
            dist.broadcast(p.data, src=src, group=group)


def zero_wrap(
    model: nn.Module,
    optimizer_factory: OptimizerFactory,
    stage: int,
    group: dist.ProcessGroup | None = None,
    wrap: Sequence[UnitGroup] | None = None,
) -> tuple[nn.Module, ZeroOptimizer]:
    """Shard ``model``'s states over ``group`` as ZeRO stage ``stage`` (1, 2 or 3).

    ``optimizer_factory(params)`` builds the per-rank optimizer (e.g. AdamW) on this rank's
    shards. Returns the same ``model`` (parameters now views of flat buffers; hooks installed)
    and a :class:`ZeroOptimizer`. Parameters start equal to group rank 0's (broadcast).
    ``wrap``: which layers share a unit and around which module stage 3 gathers it
    (``phase3_multi_node/wrap_policy.py``); None: one unit per layer.
    """
    check_arguments(model, stage)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    broadcast_frozen(model, group)
    units: list[ZeroUnit] = []
    owned: set[int] = set()
    owner: dict[int, ZeroUnit] = {}  # id(parameter) -> the unit that shards it
    groups = one_per_layer(model) if wrap is None else list(wrap)
    check_groups(model, groups)
    for _, layers in groups:
        mine = [p for layer in layers for p in unit_parameters(layer, owned)]
        for params in group_by_dtype(mine):
            unit = ZeroUnit(make_layout(params, world, rank), stage, group)
            units.append(unit)
            owner.update((id(p), unit) for p in params)
    inner = optimizer_factory([unit.shard for unit in units])
    optimizer = ZeroOptimizer(inner, units, stage)
    if stage >= 2:
        install_gradient_hooks(optimizer)
    if stage == 3:
        for module, layers in groups:
            # every unit whose parameters the layers read: their own, and a tied one's owner
            used = {id(owner[id(p)]): owner[id(p)] for layer in layers
                    for p in layer.parameters(recurse=False) if id(p) in owner}  # fmt: skip
            if used:
                install_stage3_hooks(module, list(used.values()))
    return model, optimizer


def full_state_dict(model: nn.Module, optimizer: ZeroOptimizer) -> dict[str, torch.Tensor]:
    """Every parameter in full, on every rank (stage 3 gathers each layer, copies, frees it).

    A collective: call it on every rank of the group. This is the "state_dict gathering" every
    sharded trainer needs before saving a single-file checkpoint.
    """
    names = {id(p): name for name, p in model.named_parameters()}  # a tied one: first name
    out: dict[str, torch.Tensor] = {}
    for unit in optimizer.units:
        was_gathered = unit.is_gathered
        if unit.stage == 3:
            unit.gather()
        for p in unit.layout.params:
            out[names[id(p)]] = p.detach().clone()
        if unit.stage == 3 and not was_gathered:
            unit.free()
    for name, p in model.named_parameters():  # frozen ones: whole on every rank already
        if name not in out:
            out[name] = p.detach().clone()
    return {name: out[name] for name in names.values()}


def shard_parameters(optimizer: ZeroOptimizer) -> Iterable[nn.Parameter]:
    """The parameters this rank's optimizer steps: one slice per unit."""
    return (unit.shard for unit in optimizer.units)
