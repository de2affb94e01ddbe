"""The ZeRO paper's memory and communication formulas, and the same quantities measured.

Memory (Rajbhandari et al., SC 2020, section 5 and Figure 1): Ψ parameters, N data-parallel
ranks, p bytes per parameter, g per gradient, K bytes of optimizer state per parameter.

=======  =========  =========  ==========
stage    params     grads      optimizer
=======  =========  =========  ==========
0 (DP)   pΨ         gΨ         KΨ
1        pΨ         gΨ         KΨ/N
2        pΨ         gΨ/N       KΨ/N
3        pΨ/N       gΨ/N       KΨ/N
=======  =========  =========  ==========

fp32 training with Adam: p = g = 4, K = 8 (exp_avg, exp_avg_sq), so 16Ψ, 8Ψ + 8Ψ/N,
4Ψ + 12Ψ/N, 16Ψ/N. Mixed precision (the paper's case): p = g = 2 (fp16) and K = 12 (fp32 master
weights, exp_avg, exp_avg_sq): 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N.

Ψ counts trainable parameters, a tied one once. Φ frozen parameters add pΦ to every stage's
parameters (zero_wrap leaves them whole on every rank) and nothing else: no gradient, no state.

Measured: the bytes of the distinct tensor *storages* a rank holds (``untyped_storage().nbytes()``,
each storage counted once, in the first category that reaches it): parameters (the model's and
the optimizer's), their ``.grad``, and the tensors in ``optimizer.state``. Adam's ``step``
counter (a 0-dim tensor per parameter, 4 or 8 bytes) is not counted: the paper does not count it.

Communication (section 7): volume in bytes handed to collectives, each collective counted by the
size of its *full* buffer (the all-gather's output, the reduce-scatter's input; an all-reduce
counts twice, as a reduce-scatter plus an all-gather): 2·4Ψ bytes for DP and stages 1-2, 3·4Ψ for
stage 3. What a rank actually sends on a ring is (N-1)/N of that: nccl-tests' "bus bytes".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from course.comm_counter import CommRecord


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of model states on one rank."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def formula_bytes(
    stage: int, psi: int, world: int, p: int = 4, g: int = 4, k: int = 8, frozen: int = 0
) -> ModelStateBytes:
    """The paper's bytes per rank; ``psi`` (trainable) must divide by ``world`` for stages 1-3
    (pad it); ``frozen`` parameters are held whole by every rank (p bytes each, nothing else)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage}: ZeRO stages are 0 (plain data parallel) to 3")
    if stage and psi % world:
        raise ValueError(f"psi={psi} is not a multiple of {world}: use the padded count")
    per = psi // world if stage else psi
    return ModelStateBytes(
        params=p * (per if stage >= 3 else psi) + p * frozen,
        grads=g * (per if stage >= 2 else psi),
        optimizer=k * (per if stage >= 1 else psi),
    )


def formula_volume(stage: int, psi: int, bytes_per_element: int = 4) -> int:
    """Bytes handed to collectives per step by the standard accounting: 2Ψ, or 3Ψ in stage 3."""
    return (3 if stage == 3 else 2) * psi * bytes_per_element


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2 parameters and their state), else the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _storage_bytes(tensors: Iterable[Any], seen: set[int]) -> int:
    total = 0
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
            continue
        storage = _local(tensor).untyped_storage()
        key = storage.data_ptr() if storage.nbytes() else id(storage)
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def optimizer_params(optimizer: Any) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def optimizer_state_tensors(optimizer: Any) -> list[torch.Tensor]:
    """Every tensor in ``optimizer.state`` (ZeroRedundancyOptimizer: its local ``optim``'s)."""
    inner = getattr(optimizer, "optim", optimizer)
    return [t for state in inner.state.values() for t in state.values()]


def held_bytes(model: nn.Module, optimizer: Any) -> ModelStateBytes:
    """Measured bytes of parameters, gradients and optimizer state this rank holds now."""
    seen: set[int] = set()
    params = [*model.parameters(), *optimizer_params(getattr(optimizer, "optim", optimizer))]
    param_bytes = _storage_bytes(params, seen)
    grad_bytes = _storage_bytes((p.grad for p in params), seen)
    state_bytes = _storage_bytes(optimizer_state_tensors(optimizer), seen)
    return ModelStateBytes(param_bytes, grad_bytes, state_bytes)


def parameter_bytes(model: nn.Module, optimizer: Any) -> int:
    """Measured bytes of parameter storage held now (stage 3: shards + gathered layers)."""
    params = [*model.parameters(), *optimizer_params(optimizer)]
    return _storage_bytes(params, set())


def collective_volume(records: Iterable[CommRecord], group_size: int) -> int:
    """Bytes of the full buffers of the collectives in ``records`` (the paper's accounting).

    :class:`CommCounter` records a collective's first tensor argument: the OUTPUT of
    ``reduce_scatter_tensor`` (1/N of the buffer), so it is multiplied by the group size here;
    ``all_gather_into_tensor``'s output is the full buffer; an ``all_reduce`` counts twice.
    Broadcasts (done once, at wrap time) are not part of a step and are not counted.
    """
    total = 0
    for record in records:
        if record.op == "reduce_scatter_tensor":
            total += record.nbytes * group_size
        elif record.op == "all_gather_into_tensor":
            total += record.nbytes
        elif record.op == "all_reduce":
            total += 2 * record.nbytes
    return total


def bus_bytes(volume: int, group_size: int) -> float:
    """What one rank sends on a ring for ``volume`` bytes of full buffers: (N-1)/N of it."""
    return volume * (group_size - 1) / group_size


def layer_sizes(model: nn.Module, world: int) -> list[int]:
    """Padded elements of each layer as zero_wrap lays them out: per module and dtype, the
    module's own trainable parameters (a tied one in the first module that registers it)
    rounded up to a multiple of N."""
    sizes = []
    seen: set[int] = set()
    for module in model.modules():
        per_dtype: dict[torch.dtype, int] = {}
        for p in module.parameters(recurse=False):
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                per_dtype[p.dtype] = per_dtype.get(p.dtype, 0) + p.numel()
        if per_dtype:
            sizes.append(sum(-(-n // world) * world for n in per_dtype.values()))
    return sizes


def padded_psi(model: nn.Module, world: int) -> int:
    """Ψ with padding: the elements of every flat buffer zero_wrap makes on ``world`` ranks."""
    return sum(layer_sizes(model, world))


def frozen_numel(model: nn.Module) -> int:
    """Φ: the elements of the frozen parameters (each counted once)."""
    return sum(p.numel() for p in model.parameters() if not p.requires_grad)


# ----------------------------------------------------------------------------- FSDP-style ZeRO-3


def fsdp_formula_volume(
    psi: int, param_dtype: torch.dtype, reduce_dtype: torch.dtype
) -> dict[str, dict[str, int]]:
    """Bytes handed to collectives per step by FSDP-style ZeRO-3 (full buffers, padded Ψ), per
    op and dtype: two all-gathers of every unit in the compute dtype (forward and backward),
    one reduce-scatter in the reduce dtype."""
    return {
        "all_gather": {_name(param_dtype): 2 * psi * param_dtype.itemsize},
        "reduce_scatter": {_name(reduce_dtype): psi * reduce_dtype.itemsize},
    }


def window_peak(unit_bytes: list[int], window: int) -> int:
    """Largest bytes of gathered parameters alive with a prefetch window: while unit i computes,
    units i..i+window hold their compute buffers (forward; backward is the same in reverse)."""
    return max(sum(unit_bytes[i : i + window + 1]) for i in range(len(unit_bytes)))


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class DtypeCounter:
    """``with DtypeCounter() as c:`` counts the bytes of the full buffers of
    ``all_gather_into_tensor`` (its output) and ``reduce_scatter_tensor`` (its input), per op
    and dtype (``CommCounter`` records bytes but not dtypes)."""

    by_op: dict[str, dict[str, int]] | None = None
    _saved: tuple[Any, Any] | None = None

    def __enter__(self) -> DtypeCounter:
        import torch.distributed as dist

        self.by_op = {"all_gather": {}, "reduce_scatter": {}}
        gather, scatter = dist.all_gather_into_tensor, dist.reduce_scatter_tensor
        self._saved = (gather, scatter)
        counts = self.by_op

        def add(op: str, tensor: torch.Tensor) -> None:
            key = _name(tensor.dtype)
            counts[op][key] = counts[op].get(key, 0) + tensor.numel() * tensor.element_size()

        def counted_gather(output: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            add("all_gather", output)
            return gather(output, *args, **kwargs)

        def counted_scatter(output: torch.Tensor, input: torch.Tensor, *args: Any,
                            **kwargs: Any) -> Any:  # fmt: skip
            add("reduce_scatter", input)
            return scatter(output, input, *args, **kwargs)

        dist.all_gather_into_tensor = counted_gather  # type: ignore[assignment]
        dist.reduce_scatter_tensor = counted_scatter
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        assert self._saved is not None
        dist.all_gather_into_tensor, dist.reduce_scatter_tensor = self._saved
