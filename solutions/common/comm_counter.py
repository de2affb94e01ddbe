"""Count the messages and bytes a rank hands to ``torch.distributed``.

Tests use it to check the *shape* of communication, not only its result: how many collectives a
step issues, and how many bytes each rank sends (a reduce-to-root sends (n-1)·S from the root, a
ring 2(n-1)/n·S from every rank). It wraps the Python entry points of ``torch.distributed`` (the
package attributes and the ``distributed_c10d`` globals, so ``dist.P2POp(dist.isend, ...)`` and
``batch_isend_irecv`` keep working) for the duration of a ``with`` block.

Only calls made through Python are seen: the C++ reducer inside ``DistributedDataParallel`` is
invisible here (count those with a DDP communication hook instead).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

SENDING_OPS = ("send", "isend")
RECEIVING_OPS = ("recv", "irecv")
COLLECTIVE_OPS = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "barrier",
)


@dataclass(frozen=True)
class CommRecord:
    """One call: which op, how many bytes of tensor it carried, and the peer for point-to-point."""

    op: str
    nbytes: int
    peer: int | None = None


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(item) for item in value)
    return 0


def _peer(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    for key in ("dst", "src", "group_dst", "group_src"):
        if kwargs.get(key) is not None:
            return int(kwargs[key])
    if name in SENDING_OPS + RECEIVING_OPS and len(args) > 1 and args[1] is not None:
        return int(args[1])
    return None


@dataclass
class CommCounter:
    """``with CommCounter() as comm: ...`` then read ``comm.bytes_sent``, ``comm.calls``, ...."""

    records: list[CommRecord] = field(default_factory=list)
    _saved: list[tuple[Any, str, Any]] = field(default_factory=list, repr=False)
    _depth: int = field(default=0, repr=False)

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:  # dist.send calls isend inside: count the outer call only
                tensor = args[0] if args else kwargs.get("tensor", kwargs.get("tensor_list"))
                peer = _peer(name, args, kwargs)
                self.records.append(CommRecord(name, _tensor_bytes(tensor), peer))
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def __enter__(self) -> CommCounter:
        for name in SENDING_OPS + RECEIVING_OPS + COLLECTIVE_OPS:
            original = getattr(c10d, name)
            wrapper = self._wrap(name, original)
            for module in (dist, c10d):
                self._saved.append((module, name, getattr(module, name)))
                setattr(module, name, wrapper)
        return self

    def __exit__(self, *exc: object) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()

    def reset(self) -> None:
        self.records.clear()

    def _select(self, ops: tuple[str, ...]) -> Iterator[CommRecord]:
        return (record for record in self.records if record.op in ops)

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank passed to send/isend."""
        return sum(record.nbytes for record in self._select(SENDING_OPS))

    @property
    def bytes_received(self) -> int:
        """Bytes of the buffers this rank passed to recv/irecv."""
        return sum(record.nbytes for record in self._select(RECEIVING_OPS))

    @property
    def calls(self) -> Counter[str]:
        """Number of calls per op name."""
        return Counter(record.op for record in self.records)

    def count(self, op: str) -> int:
        return self.calls[op]
