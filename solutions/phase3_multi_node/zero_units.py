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
        # TODO 3.5: this rank's slice of the whole batch's gradient, from every rank's flat one.
        # Invariant: a new tensor of shard_numel elements (flat_grad's dtype and device): this
        #   rank's slice of the gradient of the whole global batch's loss, every rank's flat_grad
        #   being the gradient of the mean over its own, equal share of that batch; only the unit's
        #   group takes part.
        # Hint 1: dist.reduce_scatter_tensor hands rank r slice r of the SUM over the group of every
        #   rank's input (gloo has no AVG).
        # Hint 2: When every rank holds the same number of samples, what is the whole batch's mean
        #   loss in terms of the ranks' mean losses? What then turns the collective's sum into the
        #   gradient you want? Which ranks take part, and what does the output look like?
        # Hint 3: The group is the unit's, self.group, never the world: inside a subgroup of 2 ranks
        #   of a world of 4, a reduce-scatter on the world expects an input of 4 slices, and the
        #   others' samples are not this model's.
        # Hint 4: The divisor is the number of ranks in that group, self.world_size: with 2 ranks
        #   whose gradients of one element are 1.0 and 3.0, the whole batch's is 2.0, not their sum
        #   4.0.
        # Hint 5: An empty output of shard_numel elements shaped like a slice of flat_grad; the
        #   reduce-scatter of flat_grad into it on the unit's group; the output divided in place by
        #   the group's size, and returned.
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
        # TODO 3.5: every rank's current shard in its place in the whole buffer, on every rank.
        # Invariant: afterwards flat_param holds each rank's shard in that rank's slice, so every
        #   model parameter (a view of flat_param) is current on every rank.
        # Hint 1: dist.all_gather_into_tensor lays every rank's input end to end, in group-rank
        #   order, in one output tensor.
        # Hint 2: What is the input, what is the output, and on which group? In stages 1-2 the shard
        #   is a view of a slice of flat_param itself: is it wise to hand a collective an input that
        #   lies inside its own output? Does autograd need to record this copy?
        # Hint 3: The output is flat_param itself (the parameters are views of it); the input is
        #   this rank's shard, detached: nothing here is for autograd.
        # Hint 4: In stages 1-2 input and output overlap: hand the collective a copy of the shard
        #   there, so that what it reads cannot change while it writes (stage 3's shard is a tensor
        #   of its own already).
        # Hint 5: The shard detached (and cloned in stages 1 and 2), all-gathered into flat_param on
        #   the unit's group.
        # See guidelines.md#35-zero-stages-1-3
        # >>> solution
        mine = self.shard.detach()
        if self.stage < 3:
            mine = mine.clone()  # a view of flat_param: input and output must not overlap
        dist.all_gather_into_tensor(self.flat_param, mine, group=self.group)
        # <<< solution

    def gather(self) -> None:
        """Stage 3: the whole, current layer in ``flat_param``."""
        # TODO 3.5: the whole layer in flat_param again, current on every rank.
        # Invariant: afterwards flat_param's storage holds the whole padded buffer and every
        #   parameter (a view of it) its current values; on a unit that is gathered already, nothing
        #   is communicated.
        # Hint 1: a freed unit's flat_param still exists: its storage (Tensor.untyped_storage) holds
        #   0 bytes.
        # Hint 2: How do you tell a gathered unit from a freed one? How many bytes does the whole
        #   padded buffer take? Once the memory is back, what fills it, and which of your methods
        #   does that already?
        # Hint 3: Gathered or not: compare the storage's nbytes with padded_numel times the element
        #   size; equal means gathered, and then return at once (a tied weight's unit is asked for
        #   by a second layer while it is still whole).
        # Hint 4: The memory: resize the storage in place (resize_) to that many bytes; every view
        #   of it, the parameters included, sees memory again, uninitialised.
        # Hint 5: If the storage already holds the padded buffer's bytes, return; otherwise resize
        #   it to them and call all_gather_params.
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
        # TODO 3.5: release the gathered layer's memory, keeping every tensor object.
        # Invariant: afterwards flat_param's storage holds 0 bytes, and flat_param and the model's
        #   parameters are the very same tensor objects as before (the optimizer, the hooks and
        #   autograd's saved tensors hold them); the next gather() refills them in place.
        # Hint 1: autograd saved the layer's parameters during forward; the backward that reads them
        #   runs after free() and the next gather().
        # Hint 2: If free gave the parameters new data, which memory would autograd's saved tensors
        #   still point at? Underneath a tensor and its views, what holds the bytes, and can it
        #   shrink without the tensor being replaced?
        # Hint 3: The bytes are in the storage that flat_param and its views share
        #   (untyped_storage); a storage can be resized in place, and every view of it sees the new
        #   size.
        # Hint 4: Resize flat_param's untyped storage to 0 bytes, and nothing else.
        # See guidelines.md#35-zero-stages-1-3
        # >>> solution
        self.flat_param.untyped_storage().resize_(0)
        # <<< solution

    @property
    def is_gathered(self) -> bool:
        return self.flat_param.untyped_storage().nbytes() > 0
