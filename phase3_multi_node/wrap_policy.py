"""Which layers share a unit, and whose hooks gather it: the wrap policy of 3.5's wrappers (given).

ZeRO's and FSDP's units are what their collectives move: one reduce-scatter and one or two
all-gathers per unit. One unit per layer (the exercise's layout: every module with parameters of
its own) is simplest to reason about, but a transformer block holds a dozen small layers, and a
dozen collectives of a few KiB each cost their latency a dozen times. Frameworks group them:
FSDP2 users call ``fully_shard`` on every block (``transformer_auto_wrap_policy`` in FSDP1), DDP
fills buckets up to ``bucket_cap_mb``. A :data:`UnitGroup` says it explicitly:

    (module, layers): one unit (per dtype) holds the own parameters of ``layers``; stage 3 and
    the FSDP-style units gather it around ``module``'s forward and backward, which must run every
    one of those layers.

Both wrappers take a list of groups (``zero_wrap(..., wrap=)``, ``fsdp_wrap(model, groups, ...)``);
:func:`one_per_layer` is the exercise's layout. A caller that reduces gradients by kind (4.7's
composition sums a tensor-parallel-replicated norm over tp, a tied embedding over its stages)
keeps each group to one kind, since a unit is reduced as one buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

UnitGroup = tuple[nn.Module, Sequence[nn.Module]]


def are_groups(items: Sequence[object]) -> bool:
    """Whether a wrapper's ``modules`` are explicit :data:`UnitGroup` s (all of them), rather
    than FSDP2-style modules."""
    return bool(items) and all(isinstance(item, tuple) for item in items)


def layers_of(model: nn.Module) -> list[nn.Module]:
    """Modules that own parameters directly, in registration order (the ZeRO units)."""
    return [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]


def one_per_layer(model: nn.Module) -> list[UnitGroup]:
    """Every layer its own group, gathered around itself: the exercise's layout."""
    return [(layer, [layer]) for layer in layers_of(model)]


def check_groups(model: nn.Module, groups: Sequence[UnitGroup]) -> None:
    """Refuse, before any communication, groups that are not a wrap policy of ``model``: a layer
    in no group or in two, a module outside the model, a layer outside its group's module."""
    inside = {id(m) for m in model.modules()}
    names = {id(m): name or "(the root)" for name, m in model.named_modules()}
    seen: dict[int, int] = {}
    for index, (module, layers) in enumerate(groups):
        if id(module) not in inside:
            raise ValueError(f"group {index}: its module is not part of the model")
        under = {id(m) for m in module.modules()}
        for layer in layers:
            if id(layer) not in under:
                raise ValueError(
                    f"group {index}: layer {names.get(id(layer), '?')} is not inside "
                    f"{names[id(module)]}, whose hooks would gather it"
                )
            if id(layer) in seen:
                raise ValueError(
                    f"layer {names[id(layer)]} is in groups {seen[id(layer)]} and {index}: "
                    "each layer's parameters belong to one unit"
                )
            seen[id(layer)] = index
    missing = [layer for layer in layers_of(model) if id(layer) not in seen]
    if missing:
        raise ValueError(
            f"layer {names[id(missing[0])]} is in no group: its parameters would be neither "
            "sharded nor trained; list every layer with parameters of its own"
        )
