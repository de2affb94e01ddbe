"""What every hand-made collective of phase 3 needs and none of them teaches.

The ring (3.1), halving-doubling (3.2) and hierarchical (3.3) all-reduces share these pieces:

* :func:`combine_`: ``acc = acc (op) incoming`` in place, for SUM, PRODUCT, MIN and MAX (what
  gloo's and NCCL's reduction kernels do element-wise, in the tensor's own dtype: a bfloat16 sum
  is rounded to bfloat16 after every addition there too).
* :func:`check_reduce_args` and :func:`group_and_size`: bad input is refused with a message that
  names the value and the fix, *before* any message is sent (a rank that raises after its peers
  started sending leaves them waiting).
* :func:`peer`: torch's ``dst=``/``src=`` are GLOBAL ranks even with ``group=`` given
  (torch/distributed/distributed_c10d.py, ``isend``/``irecv``); rings and trees are written in
  group ranks and mapped here with ``dist.get_global_rank``.
* :class:`BufferPool`: receive buffers kept between calls. Allocating (and the kernel zeroing the
  fresh pages of) a 32 MiB buffer on every call costs a few milliseconds, a tenth of a 64 MiB
  all-reduce on a laptop; gloo and NCCL keep theirs too.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp
SUPPORTED_OPS = {
    ReduceOp.SUM: "SUM",
    ReduceOp.PRODUCT: "PRODUCT",
    ReduceOp.MIN: "MIN",
    ReduceOp.MAX: "MAX",
}


def op_name(op: object) -> str:
    return SUPPORTED_OPS.get(op, str(op))  # type: ignore[call-overload]


def combine_(acc: torch.Tensor, incoming: torch.Tensor, op: object) -> torch.Tensor:
    """``acc = acc (op) incoming`` in place, returns ``acc``; no temporary is allocated."""
    if op == ReduceOp.SUM:
        return acc.add_(incoming)
    if op == ReduceOp.PRODUCT:
        return acc.mul_(incoming)
    if op == ReduceOp.MIN:
        return torch.minimum(acc, incoming, out=acc)
    if op == ReduceOp.MAX:
        return torch.maximum(acc, incoming, out=acc)
    raise ValueError(f"op={op} is not supported: use one of SUM, PRODUCT, MIN, MAX")


def check_reduce_args(tensor: torch.Tensor, op: object, name: str = "tensor") -> None:
    """Refuse a non-tensor, a non-contiguous tensor and an unsupported op, saying how to fix it."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(
            f"{name} of shape {tuple(tensor.shape)} with strides {tensor.stride()} is not "
            "contiguous: call .contiguous() first (chunks are sent from the tensor's memory as "
            "flat blocks, so the result would land in the wrong elements)"
        )
    if op not in SUPPORTED_OPS:
        raise ValueError(
            f"op={op} is not supported here: use one of SUM, PRODUCT, MIN, MAX "
            "(AVG: all-reduce with SUM, then divide by the group size)"
        )


def group_and_size(group: dist.ProcessGroup | None) -> tuple[dist.ProcessGroup, int, int]:
    """``(group, rank in group, group size)``, with ``None`` meaning the default (world) group."""
    if not dist.is_initialized():
        raise RuntimeError(
            "no process group: call dist.init_process_group first (or run under torchrun)"
        )
    group = group or dist.group.WORLD
    assert group is not None
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            f"global rank {dist.get_rank()} is not a member of the group "
            f"{dist.get_process_group_ranks(group)}: only its members may call this"
        )
    return group, rank, dist.get_world_size(group)


def peer(group: dist.ProcessGroup, group_rank: int) -> int:
    """The GLOBAL rank of member ``group_rank`` of ``group``: what ``dst=``/``src=`` want."""
    return dist.get_global_rank(group, group_rank)


def wait_all(works: Iterable[dist.Work | None]) -> None:
    """Wait for every pending isend/irecv (``None`` stands for an op that completed at once)."""
    for work in works:
        if work is not None:
            work.wait()


class BufferPool:
    """Receive buffers reused across calls: one per (slot, dtype, device), grown when too small.

    Not re-entrant: two collectives running at once (from two threads) must not share a pool.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, numel: int, like: torch.Tensor, slot: int = 0) -> torch.Tensor:
        """A flat buffer of ``numel`` elements of ``like``'s dtype and device (contents stale)."""
        key = (slot, like.dtype, like.device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._buffers[key] = buffer
        return buffer[:numel]

    def clear(self) -> None:
        """Free every buffer (the next call allocates again)."""
        self._buffers.clear()

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


def segments(start: int, stop: int, per_segment: int) -> list[tuple[int, int]]:
    """``[start, stop)`` cut into pieces of at most ``per_segment`` elements; none when empty.

    Sender and receiver compute the same pieces from the same bounds, so an empty chunk (a tensor
    smaller than the group) is skipped by both sides and no zero-byte message is ever posted.
    """
    per_segment = max(1, per_segment)
    return [(lo, min(lo + per_segment, stop)) for lo in range(start, stop, per_segment)]
