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

from solutions.phase3_multi_node.zero_partition import FlatLayout


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
        # Hint 2: How many elements does this rank receive, in which dtype and on which device? The
        #   collective sums: what turns the sum into the mean that each rank's loss (a mean over its
        #   own samples) calls for? On which group: the world's, or this unit's?
        # Hint 3: A new output of one slice (layout.shard_numel elements, flat_grad's dtype and
        #   device), the reduce-scatter into it on this unit's group, then the division by the group
        #   size; return it.
        # See guidelines.md#35-zero-stages-1-3
        # >>> solution
        out = torch.empty(self.layout.shard_numel, dtype=flat_grad.dtype, device=flat_grad.device)
        dist.reduce_scatter_tensor(out, flat_grad, group=self.group)
        return out.div_(self.world_size)
        # <<< solution

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
        # Hint 2: What goes in and what comes out of the gather? In stages 1-2, whose memory is the
        #   shard (a view of what?), and what happens when a collective's input and output overlap?
        #   Does autograd need to see this copy?
        # Hint 3: The input is this rank's shard, detached (and copied in stages 1-2: input and
        #   output must not overlap), the output the whole flat_param, on this unit's group.
        # See guidelines.md#35-zero-stages-1-3
        # >>> solution
        mine = self.shard.detach()
        if self.stage < 3:
            mine = mine.clone()  # a view of flat_param: input and output must not overlap
        dist.all_gather_into_tensor(self.flat_param, mine, group=self.group)
        # <<< solution

    def gather(self) -> None:
        """Stage 3: regrow the freed buffer and all-gather the layer into it."""
        # TODO 3.5: give flat_param its memory back, then fill it with the whole layer.
        # Invariant: after gather() the layer's parameters hold the full, current values;
        #   calling it on a gathered unit costs nothing (no second all-gather).
        # Hint 1: the memory behind a tensor is its storage (Tensor.untyped_storage()); a freed
        #   one holds 0 bytes and can be grown back in place, so every view of it sees the memory.
        # Hint 2: How do you tell a gathered unit from a freed one without a flag (how many bytes
        #   does its storage hold in each case)? How many bytes does the whole padded buffer take?
        #   Once the memory is back, what fills it?
        # Hint 3: If the storage already holds the whole padded buffer's bytes (padded_numel times
        #   the element size), return; otherwise grow the storage to that many bytes and fill it
        #   with all_gather_params().
        # See guidelines.md#35-zero-stages-1-3
        # >>> solution
        storage = self.flat_param.untyped_storage()
        full = self.layout.padded_numel * self.flat_param.element_size()
        if storage.nbytes() == full:
            return
        storage.resize_(full)
        self.all_gather_params()
        # <<< solution

    def free(self) -> None:
        """Stage 3: release the gathered layer; only ``shard`` (1/N of it) stays."""
        # TODO 3.5: release the memory of the gathered layer, keeping the parameter objects.
        # Invariant: afterwards flat_param's storage holds 0 bytes and the model's parameters
        #   are still views of it (autograd saved them for backward: gather() refills them).
        # Hint 1: free the memory, not the tensor: the storage can be resized in place, and the
        #   parameters (views of flat_param) must stay the same objects.
        # Hint 2: What must stay the same object (the parameters autograd saved, flat_param that
        #   they view), and what may go? Which call on a tensor's storage changes how many bytes it
        #   holds without replacing the tensor?
        # Hint 3: Resize flat_param's untyped storage to zero bytes, and nothing else: the
        #   parameters stay views of flat_param, and gather() grows the storage back.
        # See guidelines.md#35-zero-stages-1-3
        # >>> solution
        self.flat_param.untyped_storage().resize_(0)
        # <<< solution

    @property
    def is_gathered(self) -> bool:
        return self.flat_param.untyped_storage().nbytes() > 0
