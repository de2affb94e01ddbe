"""Given helpers of exercise 2.6: the tensor-parallel group, equal slices, and their checks.

Not an exercise. The operators (``template_tensor_parallel_ops.py``), the layers
(``template_tensor_parallel_layers.py``) and the blocks (``template_tensor_parallel.py``) use:

* :func:`tp_rank_and_size`: this rank's index in a group and the group's size;
* :func:`last_dim_slice`: this rank's equal slice of a tensor's last dimension;
* :func:`check_divisible`: refuse unequal slices before any communication, saying the fix;
* :func:`uniform_like_linear`: ``nn.Linear``'s default initialisation, from the dense layer's
  fan-in, for a layer built without a dense one.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

Group = dist.ProcessGroup | None


def tp_rank_and_size(group: Group = None) -> tuple[int, int]:
    """This rank's index in the tensor-parallel group, and the group's size (no communication)."""
    return dist.get_rank(group), dist.get_world_size(group)


def last_dim_slice(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's equal slice of ``tensor``'s last dimension (a view)."""
    size = tensor.shape[-1]
    if size % world_size:
        raise ValueError(
            f"last dimension {size} is not divisible by the tensor-parallel size {world_size}: "
            "every rank must hold an equal slice"
        )
    width = size // world_size
    return tensor[..., rank * width : (rank + 1) * width]


def check_divisible(size: int, what: str, tp_size: int) -> None:
    """Refuse a split into unequal slices, before any communication, saying how to fix it."""
    if tp_size < 1:
        raise ValueError(f"tensor-parallel size {tp_size}: need at least one rank")
    if size % tp_size:
        nearest = max(tp_size, round(size / tp_size) * tp_size)
        divisors = [str(d) for d in range(2, min(size, 16) + 1) if size % d == 0]
        sizes = f" (e.g. {', '.join(divisors)})" if divisors else ""
        raise ValueError(
            f"{what} {size} is not divisible by the tensor-parallel size {tp_size}: every rank "
            f"must hold an equal slice; make the {what} a multiple of {tp_size} "
            f"(e.g. {nearest}) or a tensor-parallel size that divides {size}{sizes}"
        )


def uniform_like_linear(tensor: torch.Tensor, fan_in: int) -> None:
    """nn.Linear's default initialisation bound, from the *dense* layer's fan-in."""
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    nn.init.uniform_(tensor, -bound, bound)
