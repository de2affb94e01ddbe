# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase3.py
"""Exercise 3.5, FSDP-style part 1: one unit of ZeRO-3 in mixed precision, gathered ahead of use.

The FSDP2 way (``fully_shard``, torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py and
_fsdp_collectives.py) differs from stage 3 of ``zero_units.py`` in three ways, each a saving:

* **Master shard and compute buffer.** The optimizer steps this rank's shard in the master dtype
  (fp32: K = 12 bytes per parameter with Adam); the layer computes with a separate full buffer in
  the policy's ``param_dtype`` (bf16 or fp16), which exists only while the unit is gathered.
* **Gather in the compute dtype.** The all-gather moves compute-dtype elements: 2 bytes per
  element instead of 4, half the traffic.
* **Reduce in the reduce dtype.** Gradients come out of backward in the compute dtype; they are
  reduce-scattered in the policy's ``reduce_dtype`` (fp32 keeps the sum exact; bf16 halves the
  bytes again) and the slice this rank receives is cast back to the master dtype before the
  optimizer sees it.
* **Asynchronous gathers.** ``start_gather`` issues the all-gather and returns at once
  (``async_op=True``); ``wait_gather`` waits for it just before the parameters are read. Between
  the two, the previous unit computes: that is the prefetch of ``zero_fsdp.py``.

The layout is 3.5's: one flat buffer per unit, padded to a multiple of N (``make_layout``), each
rank owning its slice. The model's parameters are views of the compute buffer, whose storage is
0 bytes while the unit is free (``free``), as in stage 3.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phase3_multi_node.zero_fsdp_support import MixedPrecision, divide_factors
from phase3_multi_node.template_zero_partition import make_layout


class FsdpUnit:
    """One unit: this rank's master shard, and the compute buffer the parameters view.

    ``shard`` is an ``nn.Parameter`` in the master dtype (the parameters' dtype at wrap time),
    this rank's slice of the padded flat buffer; the optimizer steps it. ``flat_param`` is the
    whole padded buffer in ``param_dtype``, 0 bytes while free; the model's parameters are views
    of it. ``work`` is the all-gather in flight (None when none is), ``gather_input`` the cast
    shard it sends (kept alive until the work is done).
    """

    def __init__(
        self, params: list[nn.Parameter], policy: MixedPrecision, group: dist.ProcessGroup | None
    ) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.layout = make_layout(params, self.world_size, dist.get_rank(group))
        master = self.layout.flatten([p.detach() for p in params])
        src = dist.get_process_group_ranks(group or dist.group.WORLD)[0]
        dist.broadcast(master, src=src, group=group)  # every rank starts from the same values
        self.shard = nn.Parameter(master[self.layout.shard_start : self.layout.shard_stop].clone())
        self.param_dtype = policy.compute_dtype(master.dtype)
        self.reduce_dtype = policy.reduction_dtype(master.dtype)
        self.flat_param = torch.empty(
            self.layout.padded_numel, dtype=self.param_dtype, device=master.device
        )
        for p, view in zip(params, self.layout.views(self.flat_param), strict=True):
            p.data = view  # parameters now live in the compute dtype, inside flat_param
        self.work: Any = None
        self.gather_input: torch.Tensor | None = None
        self.free()

    @property
    def is_gathered(self) -> bool:
        """Whether the compute buffer holds memory (gathered, or its all-gather in flight)."""
        return self.flat_param.untyped_storage().nbytes() > 0

    @property
    def padded_bytes(self) -> int:
        """Bytes of the whole compute buffer: what one all-gather delivers."""
        return self.layout.padded_numel * self.flat_param.element_size()

    def start_gather(self) -> None:
        """Issue the all-gather of the whole unit in the compute dtype; return without waiting."""
        # TODO 3.5: the unit's all-gather under way, in the compute dtype, without waiting for it.
        # Invariant: afterwards flat_param's storage holds padded_bytes and self.work is the
        #   all-gather into flat_param, still in flight, carrying param_dtype elements (their size,
        #   not the master's: half the bytes with bf16); a unit gathered or gathering issues
        #   nothing.
        # Hint 1: a collective issued with async_op set returns a Work at once; the tensor it sends
        #   must stay alive until that work is done.
        # More hints: uv run python -m tests.hint 3.5
        # See guidelines.md#zero-3-the-fsdp-way
        raise NotImplementedError(
            "TODO 3.5: the unit's all-gather under way, in the compute dtype, without waiting for "
            "it "
            "(see phase3_multi_node/guidelines.md#zero-3-the-fsdp-way)"
        )

    def wait_gather(self) -> None:
        """Make the parameters hold the whole unit, gathering it now if nobody started it."""
        # TODO 3.5: the parameters must hold every rank's values before the layer reads them.
        # Invariant: on return flat_param holds every rank's shard in param_dtype, no work is
        #   pending (self.work is None) and the sent tensor is released; a unit nobody prefetched is
        #   gathered here.
        # Hint 1: a Work's result is there once its wait() has returned, not before.
        # More hints: uv run python -m tests.hint 3.5
        # See guidelines.md#zero-3-the-fsdp-way
        raise NotImplementedError(
            "TODO 3.5: the parameters must hold every rank's values before the layer reads them "
            "(see phase3_multi_node/guidelines.md#zero-3-the-fsdp-way)"
        )

    def free(self) -> None:
        """Release the compute buffer (the parameters stay views of its 0-byte storage)."""
        if self.work is not None:
            raise RuntimeError(
                "free() while this unit's all-gather is in flight: wait_gather first"
            )
        self.flat_param.untyped_storage().resize_(0)

    def reduced_gradient(self, flat_grad: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the mean over the group of every rank's ``flat_grad`` (the
        padded gradient in the compute dtype), reduced in ``reduce_dtype``, in the master dtype."""
        # TODO 3.5: this rank's slice of the mean gradient, its sum formed in the reduce dtype.
        # Invariant: shard_numel elements in the master dtype (the shard's): rank r's slice of the
        #   sum over the group divided by the group's size; the reduce-scatter's input and output
        #   carry reduce_dtype elements; the division is split as divide_factors says.
        # Hint 1: divide_factors gives (before, after): the part of the division by the group's size
        #   to do ahead of the sum, and the part after it.
        # More hints: uv run python -m tests.hint 3.5
        # See guidelines.md#zero-3-the-fsdp-way
        raise NotImplementedError(
            "TODO 3.5: this rank's slice of the mean gradient, its sum formed in the reduce dtype "
            "(see phase3_multi_node/guidelines.md#zero-3-the-fsdp-way)"
        )

    def reduce_gradients(self) -> None:
        """When the unit's last gradient of this backward is in: reduce it into the shard's
        ``.grad`` (accumulating over backwards, in the master dtype) and drop the full ones."""
        params = self.layout.params
        mine = self.reduced_gradient(self.layout.flatten([p.grad for p in params]))  # type: ignore[misc]
        for p in params:
            p.grad = None
        if mine.dtype != self.shard.dtype or mine.shape != self.shard.shape:
            raise TypeError(
                f"reduced_gradient returned {mine.dtype} of shape {tuple(mine.shape)}; the "
                f"master shard is {self.shard.dtype} of shape {tuple(self.shard.shape)}: return "
                "this rank's slice cast back to the master dtype"
            )
        if self.shard.grad is None:
            self.shard.grad = mine
        else:
            self.shard.grad += mine
