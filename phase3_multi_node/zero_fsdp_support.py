"""The given part of exercise 3.5's FSDP-style ZeRO-3: the policy, the units' parameters, wiring.

PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``, torch/distributed/fsdp/_fully_shard/) is
ZeRO stage 3 as large models train today: one call per block makes one *unit*; each unit keeps
this rank's shard of its parameters in fp32 (the master weights the optimizer steps) and, with a
``MixedPrecisionPolicy``, computes in a lower precision. The exercise (``zero_fsdp_units.py``,
``zero_fsdp.py``) writes the unit's collectives and the prefetch; this module holds the rest:

* :class:`MixedPrecision`, FSDP2's policy: ``param_dtype`` is the dtype parameters are
  all-gathered and computed in; ``reduce_dtype`` the dtype gradients are
  reduce-scattered in (None: the master dtype, as FSDP2 does since torch 2.15; it reduced in
  ``param_dtype`` before). Both None: no mixed precision. :meth:`MixedPrecision.torch_policy`
  is the same policy for ``fully_shard``.
* :func:`divide_factors`: how FSDP2 divides the summed gradient by the group size N: all of it
  after the sum for fp32/bf16 (their range cannot overflow), part before and part after for
  fp16 (about sqrt(N) each side: N fp16 gradients summed could overflow 65504).
* :func:`in_backward`: whether a hook runs inside a backward pass. Activation checkpointing
  (2.3) runs a block's forward a second time inside backward, and its forward hooks fire again:
  the wiring tells such a *recompute* apart, as FSDP2 does with its ``TrainingState``
  (``_fsdp_state.py``, ``_pre_forward``: "composing with activation checkpointing").
* :func:`cast_floating`: FSDP2's ``cast_forward_inputs``: floating tensors reaching a unit's
  forward are cast to the compute dtype (a bf16 weight cannot multiply an fp32 input).
* :func:`assign_unit_parameters`: which parameters each unit holds, like ``fully_shard``: a unit
  takes every parameter under its module that no unit nested inside it took, and the root takes
  the rest (or, given explicit groups, :func:`group_unit_parameters`: ``wrap_policy.py``).
  :func:`check_fsdp_arguments` refuses, before any communication, what this course's
  FSDP-style wrapper does not do (frozen parameters, a weight tied across two units: FSDP2's
  rule is that shared parameters belong to one unit enclosing every module that uses them).
* :class:`FsdpOptimizer`: the optimizer the wrapper returns (it steps the fp32 shards), and
  :func:`full_master_state`: every parameter in full, in the master dtype, on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phase3_multi_node.sharded_optimizer import ShardedOptimizer
from phase3_multi_node.wrap_policy import UnitGroup, are_groups, check_groups

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class MixedPrecision:
    """FSDP2's ``MixedPrecisionPolicy`` (the fields this course uses)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    def compute_dtype(self, master: torch.dtype) -> torch.dtype:
        """The dtype parameters are all-gathered and computed in."""
        return self.param_dtype or master

    def reduction_dtype(self, master: torch.dtype) -> torch.dtype:
        """The dtype gradients are reduce-scattered in (FSDP2 in torch 2.15: the master dtype
        unless ``reduce_dtype`` says otherwise)."""
        return self.reduce_dtype or master

    def torch_policy(self) -> Any:
        """The same policy for ``fully_shard(..., mp_policy=...)``."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)

    def describe(self) -> str:
        if self.param_dtype is None and self.reduce_dtype is None:
            return "no mixed precision"
        def name(dtype: torch.dtype | None) -> str:
            return "master" if dtype is None else str(dtype).removeprefix("torch.")

        return f"compute {name(self.param_dtype)}, reduce {name(self.reduce_dtype)}"


DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
POLICIES = {
    "off": MixedPrecision(),
    "bf16-fp32": MixedPrecision(torch.bfloat16, torch.float32),
    "bf16": MixedPrecision(torch.bfloat16, torch.bfloat16),
    "fp16": MixedPrecision(torch.float16, torch.float16),
}


def divide_factors(world: int, reduce_dtype: torch.dtype) -> tuple[float, float]:
    """``(before, after)``: divide the gradient by ``before`` before the reduce-scatter and the
    sum by ``after`` after it; ``before * after == world``.

    FSDP2's rule (``_get_gradient_divide_factors`` in torch/distributed/fsdp/_fully_shard/
    _fsdp_collectives.py): fp32, bf16 and fp64 sum first and divide by N after (NCCL's AVG);
    fp16 divides by the smallest power of two ``before`` with ``before**2 >= N`` first and by
    ``N / before`` after, so neither the sum nor the small gradients leave fp16's range.
    """
    if world < 1:
        raise ValueError(f"world={world}: a group has at least one rank")
    if reduce_dtype != torch.float16:
        return 1.0, float(world)
    before = 1
    while world % before == 0 and world / before > before:
        before *= 2
    return float(before), world / before


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread right now.

    A forward hook that fires inside backward belongs to a recompute (2.3's checkpoint re-runs
    the forward of what it kept only the input of). torch's own checkpoint asks the engine the
    same question (torch/utils/checkpoint.py, ``torch._C._current_graph_task_id() != -1``);
    there is no public spelling of it yet.
    """
    return bool(torch._C._current_graph_task_id() != -1)


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating-point tensor in it (tuples, lists, dicts) cast to ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(cast_floating(item, dtype) for item in value)
    if isinstance(value, dict):
        return {key: cast_floating(item, dtype) for key, item in value.items()}
    return value


def check_fsdp_arguments(
    model: nn.Module, modules: Sequence[nn.Module | UnitGroup], prefetch: int
) -> None:
    """Refuse, before any communication, what the FSDP-style wrapper cannot shard. ``modules``
    are FSDP2's (a unit per module) or, all of them, explicit groups (``wrap_policy.py``)."""
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(
            f"prefetch={prefetch!r}: the number of units gathered ahead, 0 (none) or more"
        )
    if are_groups(modules):
        check_groups(model, modules)  # type: ignore[arg-type]
    elif any(isinstance(m, tuple) for m in modules):
        raise ValueError("modules mixes modules and (module, layers) groups: list one kind")
    inside = {id(m) for m in model.modules()}
    for i, module in enumerate(modules):
        if not isinstance(module, tuple) and id(module) not in inside:
            raise ValueError(f"modules[{i}] ({type(module).__name__}) is not part of the model")
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError("a module is listed twice in modules: one unit per module")
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    if frozen:
        raise ValueError(
            f"parameter {frozen[0]} is frozen: this FSDP-style wrapper casts and gathers "
            "trainable parameters only (zero_wrap leaves frozen ones whole on every rank; FSDP2 "
            "shards them with the rest)"
        )
    if not any(True for _ in model.parameters()):
        raise ValueError("the model has no parameters to shard")


def group_unit_parameters(
    model: nn.Module, groups: Sequence[UnitGroup]
) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """``(module, parameters)`` of every unit of explicit groups (``wrap_policy.py``), in the
    order given: a unit holds its layers' own parameters. ValueError for a parameter registered
    by layers of two groups (tied across units: FSDP2 wants one unit enclosing every user)."""
    names = {id(p): n for n, p in model.named_parameters()}
    owner: dict[int, int] = {}
    out = []
    for index, (module, layers) in enumerate(groups):
        params: list[nn.Parameter] = []
        for layer in layers:
            for p in layer.parameters(recurse=False):
                if owner.setdefault(id(p), index) != index:
                    raise ValueError(
                        f"parameter {names[id(p)]} is used by groups {owner[id(p)]} and {index} "
                        "(tied across units): put both users in one group"
                    )
                if all(q is not p for q in params):
                    params.append(p)
        if params:
            out.append((module, params))
    return out


def assign_unit_parameters(
    model: nn.Module, modules: Sequence[nn.Module]
) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """``(module, parameters)`` of every unit, in forward order (the order of
    ``model.modules()``: the root first, then the blocks as registered, the order a plain stack
    runs them). A unit holds every parameter under its module that no unit nested inside it
    holds; the root's unit holds what is left (only when something is).

    ValueError for a parameter tied across two units that do not nest (FSDP2's rule: a shared
    parameter belongs to one unit that encloses every module using it).
    """
    order = {id(m): i for i, m in enumerate(model.modules())}
    chosen = sorted({id(m): m for m in [model, *modules]}.values(), key=lambda m: order[id(m)])
    owner: dict[int, nn.Module] = {}
    held: dict[int, list[nn.Parameter]] = {}
    for module in reversed(chosen):  # the deepest first: a nested unit keeps its own
        held[id(module)] = [p for p in module.parameters() if id(p) not in owner]
        owner.update((id(p), module) for p in held[id(module)])
    names = {id(p): n for n, p in model.named_parameters()}
    for module in chosen:
        below = {id(m) for m in module.modules()}
        for p in module.parameters():
            if id(owner[id(p)]) not in below:
                raise ValueError(
                    f"parameter {names[id(p)]} is used by two units that do not nest (tied "
                    "across units): list a module that encloses both users instead"
                )
    return [(m, held[id(m)]) for m in chosen if held[id(m)]]


class FsdpOptimizer(ShardedOptimizer):
    """The optimizer the wrapper returns: ``inner`` steps this rank's fp32 shards only.

    ``units`` are the wrapper's units in forward order; ``state`` and ``param_groups`` are the
    inner optimizer's (its state covers 1/N of the padded elements, in the master dtype).
    """

    def step(self) -> None:
        """Step the shards (the next forward gathers the updated values)."""
        self.refuse_partial_backward("every parameter needs a gradient in every backward")
        self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for unit in self.units:
            if set_to_none:
                unit.shard.grad = None
            elif unit.shard.grad is not None:
                unit.shard.grad.zero_()


def full_master_state(
    model: nn.Module, units: Sequence[Any], shards: Sequence[torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Every parameter in full, in the master dtype, on every rank (a collective: all-gathers
    each unit's fp32 shard), named as ``model.named_parameters()``.

    ``shards``, one per unit, are gathered in place of the units' shards: any tensor laid out
    like a shard (an optimizer moment of it, for a checkpoint) comes back as whole parameters."""
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    pieces = [unit.shard for unit in units] if shards is None else list(shards)
    for unit, shard in zip(units, pieces, strict=True):
        layout = unit.layout
        full = torch.empty(layout.padded_numel, dtype=shard.dtype, device=shard.device)
        dist.all_gather_into_tensor(full, shard.detach(), group=unit.group)
        for p, offset in zip(layout.params, layout.offsets, strict=True):
            out[names[id(p)]] = full[offset : offset + p.numel()].view(p.shape).clone()
    return {name: out[name] for name in names.values()}
