"""Exercise 3.5, part 1: flat, evenly padded partitions, the layout every ZeRO stage shares.

ZeRO (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
SC 2020) gives each of the N data-parallel ranks 1/N of the model states. The layout used by
DeepSpeed (``stage_1_and_2.py``: one flat buffer per dtype, padded so it divides by N) and by
PyTorch FSDP (``FlatParameter``, ``torch/distributed/fsdp/_flat_param.py``) is the one built here:

* the parameters of one unit (a layer) and one dtype are laid end to end in one flat buffer;
* the buffer is padded with zeros to a multiple of N, so every rank owns one contiguous slice,
  all of the same length, in the order ``all_gather_into_tensor`` lays its pieces out;
* because every slice has the same length, ``dist.reduce_scatter_tensor`` and
  ``dist.all_gather_into_tensor`` (which require equal pieces) move them with no special case.

The padding stays zero for ever: its gradient is zero, so AdamW's update of it is zero too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn


def padded_size(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``world_size`` (0 stays 0)."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: a group has at least one rank")
    # TODO 3.5: the length of the flat buffer once padded for the group.
    # Invariant: the shortest length at least `numel` that `world_size` divides (0 stays 0), so
    #   that every rank can own a slice of the same length.
    # Hint 1: 107 elements over 4 ranks: how many must each rank own at least, and how long does
    #   that make the whole buffer?
    # Hint 2: How many elements per rank are enough to hold numel of them, when no rank can own a
    #   fraction of an element? Does a length that world_size divides already need any padding?
    # Hint 3: Per rank, numel divided by world_size rounded up: 107 over 4 is 26.75, so 27 each and
    #   108 in all; 108 over 4 is exactly 27 each, no padding.
    # Hint 4: The ceiling of numel over world_size (in integers: the floor division of minus numel
    #   by world_size, negated back), times world_size.
    # See guidelines.md#35-zero-stages-1-3
    # >>> solution
    return -(-numel // world_size) * world_size
    # <<< solution


def shard_bounds(padded_numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(start, stop)`` of the slice of a padded flat buffer that ``rank`` owns."""
    if padded_numel % world_size:
        raise ValueError(
            f"a flat buffer of {padded_numel} elements is not padded for {world_size} ranks: "
            "pad it with padded_size() first"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside the group's ranks 0..{world_size - 1}")
    # TODO 3.5: the slice of the padded buffer that `rank` owns.
    # Invariant: the N slices have equal lengths and do not overlap, and laid end to end in the
    #   order all_gather_into_tensor puts its pieces they are the whole buffer.
    # Hint 1: all_gather_into_tensor lays every rank's piece end to end in group-rank order.
    # Hint 2: How long is every slice, and does world_size always divide padded_numel here (what
    #   was the padding for)? How many slices come before rank r's? Is the stop included in the
    #   pair you return, or excluded?
    # Hint 3: A buffer of 12 over 4 ranks: slices of 3 elements; rank 2's holds elements 6, 7 and
    #   8, so its pair is 6 and 9: the stop excluded, as in a Python slice.
    # Hint 4: The slice length is padded_numel divided by world_size; rank r starts r slice lengths
    #   in and stops one slice length later.
    # See guidelines.md#35-zero-stages-1-3
    # >>> solution
    shard = padded_numel // world_size
    return rank * shard, (rank + 1) * shard
    # <<< solution


@dataclass
class FlatLayout:
    """Where each parameter of one unit and one dtype sits in its flat, padded buffer.

    ``offsets[i]`` is where ``params[i]`` starts; ``numel`` the elements of all of them;
    ``padded_numel`` that rounded up to ``world_size``; this rank owns
    ``[shard_start, shard_stop)``.
    """

    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    padded_numel: int
    world_size: int
    rank: int

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    @property
    def shard_start(self) -> int:
        return shard_bounds(self.padded_numel, self.world_size, self.rank)[0]

    @property
    def shard_stop(self) -> int:
        return shard_bounds(self.padded_numel, self.world_size, self.rank)[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def flatten(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """A new padded flat buffer holding ``tensors`` (shaped like ``params``) end to end."""
        flat = torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
        for tensor, offset in zip(tensors, self.offsets, strict=True):
            flat[offset : offset + tensor.numel()].copy_(tensor.reshape(-1))
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` shaped like each parameter (they share ``flat``'s storage)."""
        return [
            flat[offset : offset + p.numel()].view(p.shape)
            for p, offset in zip(self.params, self.offsets, strict=True)
        ]


def make_layout(params: Sequence[nn.Parameter], world_size: int, rank: int) -> FlatLayout:
    """Lay ``params`` (one dtype, one device) end to end, padded for ``world_size`` ranks."""
    if not params:
        raise ValueError("a flat layout needs at least one parameter")
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1:
        raise ValueError(f"one flat buffer holds one dtype; got {sorted(map(str, dtypes))}")
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += p.numel()
    return FlatLayout(
        list(params), offsets, total, padded_size(total, world_size), world_size, rank
    )


def group_by_dtype(params: Iterable[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Parameters split by dtype, in the order each dtype first appears (same on every rank)."""
    groups: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(p.dtype, []).append(p)
    return list(groups.values())
