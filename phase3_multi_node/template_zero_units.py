# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase3.py
"""Exercise 3.5, part 2: one ZeRO unit, the parameters of one layer and one dtype, sharded.

A unit owns one flat, padded buffer (see zero_partition.py) and this rank's slice of it, and it
moves data with the two halves of a ring all-reduce (phase 3.1):

* ``reduce_scatter``: every rank hands in the whole flat gradient, each gets back the sum of its
  own slice over all ranks (then divided by N: data parallelism averages). Stage 1 does it in
  ``step()``; stages 2 and 3 as soon as the layer's gradients are ready in backward, and drop the
  full gradient (the stage 2 saving: 4Ψ -> 4Ψ/N bytes of fp32 gradients).
* ``all_gather_params``: every rank hands in its updated slice; everyone gets the whole buffer.
  Stages 1 and 2 do it after the local optimizer step; stage 3 before the layer's forward and
  again before its backward (``gather``), and frees the buffer right after (``free``).

Stage 3 frees by shrinking the buffer's *storage* to 0 bytes and regrows it before the next use,
as PyTorch FSDP does (``_free_storage``/``_alloc_storage`` in torch/distributed/utils.py): the
model's parameters stay views of the same storage, so the tensors autograd saved for backward are
still valid once the storage holds the gathered values again.

gloo in torch 2.15 implements both ``dist.reduce_scatter_tensor`` and
``dist.all_gather_into_tensor`` (checked on this machine), so no fallback is needed. Neither has
an AVG reduction on gloo: the sum is divided by the group size here.
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
        # TODO 3.5: reduce-scatter the full flat gradient: this rank gets the mean of its slice.
        # Invariant: the result has shard_numel elements: rank r's slice of sum_ranks(flat_grad)
        #   divided by the group size; flat_grad is the padded buffer (every rank the same size).
        # Hint 1: torch's reduce-scatter collective (dist.reduce_scatter_tensor) hands rank r the
        #   SUM of slice r (gloo has no AVG); each rank's loss is the mean over its own samples.
        # More hints: uv run python -m tests.hint 3.5
        # See guidelines.md#35-zero-stages-1-3
        raise NotImplementedError(
            "TODO 3.5: reduce-scatter the full flat gradient: this rank gets the mean of its slice "
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
        # TODO 3.5: all-gather every rank's slice into the full flat parameter buffer.
        # Invariant: afterwards flat_param[r·S:(r+1)·S] holds rank r's shard (S = shard_numel)
        #   on every rank, so every model parameter (a view of flat_param) is up to date.
        # Hint 1: torch's all-gather into one tensor (dist.all_gather_into_tensor) lays the pieces
        #   out in group-rank order; in stages 1-2 the shard is a view of flat_param itself.
        # More hints: uv run python -m tests.hint 3.5
        # See guidelines.md#35-zero-stages-1-3
        raise NotImplementedError(
            "TODO 3.5: all-gather every rank's slice into the full flat parameter buffer "
            "(see phase3_multi_node/guidelines.md#35-zero-stages-1-3)"
        )

    def gather(self) -> None:
        """Stage 3: regrow the freed buffer and all-gather the layer into it."""
        # TODO 3.5: give flat_param its memory back, then fill it with the whole layer.
        # Invariant: after gather() the layer's parameters hold the full, current values;
        #   calling it on a gathered unit costs nothing (no second all-gather).
        # Hint 1: the memory behind a tensor is its storage (Tensor.untyped_storage()); a freed
        #   one holds 0 bytes and can be grown back in place, so every view of it sees the memory.
        # More hints: uv run python -m tests.hint 3.5
        # See guidelines.md#35-zero-stages-1-3
        raise NotImplementedError(
            "TODO 3.5: give flat_param its memory back, then fill it with the whole layer "
            "(see phase3_multi_node/guidelines.md#35-zero-stages-1-3)"
        )

    def free(self) -> None:
        """Stage 3: release the gathered layer; only ``shard`` (1/N of it) stays."""
        # TODO 3.5: release the memory of the gathered layer, keeping the parameter objects.
        # Invariant: afterwards flat_param's storage holds 0 bytes and the model's parameters
        #   are still views of it (autograd saved them for backward: gather() refills them).
        # Hint 1: free the memory, not the tensor: the storage can be resized in place, and the
        #   parameters (views of flat_param) must stay the same objects.
        # More hints: uv run python -m tests.hint 3.5
        # See guidelines.md#35-zero-stages-1-3
        raise NotImplementedError(
            "TODO 3.5: release the memory of the gathered layer, keeping the parameter objects "
            "(see phase3_multi_node/guidelines.md#35-zero-stages-1-3)"
        )

    @property
    def is_gathered(self) -> bool:
        return self.flat_param.untyped_storage().nbytes() > 0
