# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase3.py
"""Exercise 3.5, part 2: one ZeRO unit, the parameters of one layer and one dtype, sharded.

A unit owns one flat, padded buffer (see zero_partition.py) and this rank's slice of it, and it
moves data with the two halves of a ring all-reduce (phase 3.1):

* ``reduce_scatter``: from every rank's whole flat gradient, this rank's slice of the whole
  batch's gradient (the stage 2 saving: 4Ψ -> 4Ψ/N bytes of fp32 gradients kept);
* ``all_gather_params``: from every rank's slice, the whole buffer on every rank;
* stage 3 only: ``gather`` (the whole layer, current) and ``free`` (its memory released, every
  tensor object kept: the optimizer, the hooks and autograd hold them), as PyTorch FSDP frees
  and regrows its flat parameter.

gloo in torch 2.15 implements both ``dist.reduce_scatter_tensor`` and
``dist.all_gather_into_tensor`` (checked on this machine), so no fallback is needed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from phase3_multi_node.template_zero_partition import FlatLayout


class ZeroUnit:
    """The flat buffer of one layer's parameters of one dtype, and this rank's slice of it.

    Stages 1-2: ``flat_param`` stays allocated; the model's parameters are views of it and
    ``shard`` (what the optimizer steps) is a view of this rank's slice: no extra copy.
    Stage 3: ``shard`` is this rank's own copy of its slice; ``flat_param`` holds the whole layer
    only between ``gather()`` and ``free()``.
    Stage 1 also keeps ``flat_grad``, the full padded gradient, which the parameters' ``.grad``
    are views of (autograd accumulates into them in place).
    """

    def __init__(self, layout: FlatLayout, stage: int, group: dist.ProcessGroup | None) -> None:
        self.layout, self.stage, self.group = layout, stage, group
        self.world_size = dist.get_world_size(group)
        self.flat_param = layout.flatten([p.detach() for p in layout.params])
        src = dist.get_process_group_ranks(group or dist.group.WORLD)[0]
        dist.broadcast(self.flat_param, src=src, group=group)  # all ranks start equal, as DDP
        for p, view in zip(layout.params, layout.views(self.flat_param), strict=True):
            p.data = view
        own = self.flat_param[layout.shard_start : layout.shard_stop]
        self.shard = nn.Parameter(own.clone() if stage == 3 else own)
        self.flat_grad: torch.Tensor | None = None
        if stage == 1:
            self.flat_grad = torch.zeros_like(self.flat_param)
            for p, view in zip(layout.params, layout.views(self.flat_grad), strict=True):
                p.grad = view
            self.shard.grad = self.flat_grad[layout.shard_start : layout.shard_stop]
        if stage == 3:
            self.free()

    def reduce_scatter(self, flat_grad: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the MEAN over the group of every rank's ``flat_grad``."""
        # TODO 3.5: this rank's slice of the whole batch's gradient, from every rank's flat one.
        # Invariant: a new tensor of shard_numel elements (flat_grad's dtype and device): this
        #   rank's slice of the gradient of the whole global batch's loss, every rank's flat_grad
        #   being the gradient of the mean over its own, equal share of that batch; only the unit's
        #   group takes part.
        # Hint 1: dist.reduce_scatter_tensor hands rank r slice r of the SUM over the group of every
        #   rank's input (gloo has no AVG).
        # More hints: uv run python -m tests.hint 3.5
        # See guidelines.md#35-zero-stages-1-3
        raise NotImplementedError(
            "TODO 3.5: this rank's slice of the whole batch's gradient, from every rank's flat one "
            "(see phase3_multi_node/guidelines.md#35-zero-stages-1-3)"
        )

    def adopt_gradients(self) -> None:
        """Stage 1: re-attach ``.grad`` as views of ``flat_grad`` if something replaced them
        (``model.zero_grad()`` sets them to None; autograd then allocates new ones)."""
        assert self.flat_grad is not None
        views = self.layout.views(self.flat_grad)
        for p, view in zip(self.layout.params, views, strict=True):
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad)
                p.grad = view

    def reduce_gradients(self) -> None:
        """Stages 2-3: reduce-scatter the layer's fresh gradients into ``shard.grad``, drop them."""
        params = self.layout.params
        mine = self.reduce_scatter(self.layout.flatten([p.grad for p in params]))  # type: ignore[misc]
        for p in params:
            p.grad = None  # the full gradient is gone: only this rank's slice stays
        if self.shard.grad is None:
            self.shard.grad = mine
        else:
            self.shard.grad += mine  # gradient accumulation over several backwards

    def all_gather_params(self) -> None:
        """Fill ``flat_param`` with every rank's ``shard``: the whole layer, on every rank."""
        # TODO 3.5: every rank's current shard in its place in the whole buffer, on every rank.
        # Invariant: afterwards flat_param holds each rank's shard in that rank's slice, so every
        #   model parameter (a view of flat_param) is current on every rank.
        # Hint 1: dist.all_gather_into_tensor lays every rank's input end to end, in group-rank
        #   order, in one output tensor.
        # More hints: uv run python -m tests.hint 3.5
        # See guidelines.md#35-zero-stages-1-3
        raise NotImplementedError(
            "TODO 3.5: every rank's current shard in its place in the whole buffer, on every rank "
            "(see phase3_multi_node/guidelines.md#35-zero-stages-1-3)"
        )

    def gather(self) -> None:
        """Stage 3: the whole, current layer in ``flat_param``."""
        # TODO 3.5: the whole layer in flat_param again, current on every rank.
        # Invariant: afterwards flat_param's storage holds the whole padded buffer and every
        #   parameter (a view of it) its current values; on a unit that is gathered already, nothing
        #   is communicated.
        # Hint 1: a freed unit's flat_param still exists: its storage (Tensor.untyped_storage) holds
        #   0 bytes.
        # More hints: uv run python -m tests.hint 3.5
        # See guidelines.md#35-zero-stages-1-3
        raise NotImplementedError(
            "TODO 3.5: the whole layer in flat_param again, current on every rank "
            "(see phase3_multi_node/guidelines.md#35-zero-stages-1-3)"
        )

    def free(self) -> None:
        """Stage 3: release the gathered layer; only ``shard`` (1/N of it) stays."""
        # TODO 3.5: release the gathered layer's memory, keeping every tensor object.
        # Invariant: afterwards flat_param's storage holds 0 bytes, and flat_param and the model's
        #   parameters are the very same tensor objects as before (the optimizer, the hooks and
        #   autograd's saved tensors hold them); the next gather() refills them in place.
        # Hint 1: autograd saved the layer's parameters during forward; the backward that reads them
        #   runs after free() and the next gather().
        # More hints: uv run python -m tests.hint 3.5
        # See guidelines.md#35-zero-stages-1-3
        raise NotImplementedError(
            "TODO 3.5: release the gathered layer's memory, keeping every tensor object "
            "(see phase3_multi_node/guidelines.md#35-zero-stages-1-3)"
        )

    @property
    def is_gathered(self) -> bool:
        return self.flat_param.untyped_storage().nbytes() > 0
