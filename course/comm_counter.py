"""Count the messages and bytes a rank hands to ``torch.distributed``, and the groups they used.

Tests use it to check the *shape* of communication, not only its result: how many collectives a
step issues, and how many bytes each rank sends (a reduce-to-root sends (n-1)·S from the root, a
ring 2(n-1)/n·S from every rank). It wraps the Python entry points of ``torch.distributed`` (the
package attributes and the ``distributed_c10d`` globals, so ``dist.P2POp(dist.isend, ...)`` and
``batch_isend_irecv`` keep working) for the duration of a ``with`` block.

Each record also says *where* the message went, in global ranks: the process group's members
(``group_ranks``, None for the default world group) and, for point-to-point, the peer. Parallel
code that runs on subgroups (3D parallelism, hierarchical all-reduce) must never talk outside its
group; :meth:`CommCounter.crossing` lists the calls that did. torch's own convention is followed:
``dst``/``src`` are global ranks, ``group_dst``/``group_src`` are ranks *within* ``group`` and are
mapped back with ``dist.get_global_rank(group, r)``.

Only calls made through Python are seen: the C++ reducer inside ``DistributedDataParallel`` is
invisible here (count those with a DDP communication hook instead).
"""

from __future__ import annotations

import functools
import inspect
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# Hang reports (course/p2p_ledger.py) name the line that called a counted send or collective,
# not this module's wrapper around it.
__p2p_ledger_transparent__ = True
SENDING_OPS = ("send", "isend")
RECEIVING_OPS = ("recv", "irecv")
POINT_TO_POINT_OPS = SENDING_OPS + RECEIVING_OPS
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
# The argument naming a peer (point-to-point) or a root (broadcast, reduce): (global, group-local).
_PEER_ARGS = {
    "send": ("dst", "group_dst"),
    "isend": ("dst", "group_dst"),
    "recv": ("src", "group_src"),
    "irecv": ("src", "group_src"),
    "broadcast": ("src", "group_src"),
    "reduce": ("dst", "group_dst"),
}


# All-to-alls take (output, input): their bytes are the input's, this rank's own piece included
# (the piece it keeps never leaves the process, but it is handed to the collective).
_INPUT_ARGS = {"all_to_all_single": "input", "all_to_all": "input_tensor_list"}


@dataclass(frozen=True)
class CommRecord:
    """One call: which op, how many bytes of tensor it carried, and where it went.

    ``peer`` is the GLOBAL rank of the other side of a send/recv (or the root of a broadcast or
    reduce); None when not known (a ``recv`` from any source, a collective without a root).
    ``group_ranks`` are the GLOBAL ranks of the process group the call used, None for the default
    (world) group.
    """

    op: str
    nbytes: int
    peer: int | None = None
    group_ranks: tuple[int, ...] | None = None
    # the tensor's dtype on the wire ("int64", "float32"; None when not a tensor): a contract
    # that travels (a count carried as float32 is exact only below 2**24)
    dtype: str | None = field(default=None, compare=False)

    @property
    def is_point_to_point(self) -> bool:
        return self.op in POINT_TO_POINT_OPS

    def describe(self, rank: int | None = None) -> str:
        """A phrase for failure messages: "rank 2 sent 64 bytes to rank 1 with isend"."""
        who = "this rank" if rank is None else f"rank {rank}"
        if self.op in SENDING_OPS:
            return f"{who} sent {self.nbytes} bytes to rank {self.peer} with {self.op}"
        if self.op in RECEIVING_OPS:
            source = "any rank" if self.peer is None else f"rank {self.peer}"
            return f"{who} received {self.nbytes} bytes from {source} with {self.op}"
        where = "the world group" if self.group_ranks is None else f"group {self.group_ranks}"
        return f"{who} called {self.op} ({self.nbytes} bytes) on {where}"


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(item) for item in value)
    return 0


def _is_world(group: Any) -> bool:
    if group is None:
        return True
    return bool(dist.is_initialized() and group is dist.group.WORLD)


def _group_ranks(group: Any) -> tuple[int, ...] | None:
    """Global ranks of ``group``; None for the default group (or anything that is not a group)."""
    if _is_world(group) or not isinstance(group, dist.ProcessGroup):
        return None
    return tuple(dist.get_process_group_ranks(group))


def _global_peer(group: Any, global_rank: Any, group_rank: Any) -> int | None:
    if global_rank is not None:
        return int(global_rank)
    if group_rank is None:
        return None
    if _is_world(group):
        return int(group_rank)
    return dist.get_global_rank(group, int(group_rank))


def _record(
    name: str, signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> CommRecord:
    try:
        bound = signature.bind(*args, **kwargs).arguments
    except TypeError:  # a wrong call: let torch raise its own error, count what can be read
        bound = dict(kwargs)
    if name in _INPUT_ARGS:  # the first argument is the output: count what this rank hands over
        tensor = bound.get(_INPUT_ARGS[name])
    else:
        tensor = args[0] if args else kwargs.get("tensor", kwargs.get("tensor_list"))
    group = bound.get("group")
    peer = None
    if name in _PEER_ARGS:
        global_key, group_key = _PEER_ARGS[name]
        peer = _global_peer(group, bound.get(global_key), bound.get(group_key))
    return CommRecord(name, _tensor_bytes(tensor), peer, _group_ranks(group), _dtype(tensor))


def _dtype(value: Any) -> str | None:
    """``"float32"`` for a tensor, or the first tensor of a list; None otherwise."""
    if isinstance(value, (list, tuple)) and value:
        value = value[0]
    return str(value.dtype).removeprefix("torch.") if isinstance(value, torch.Tensor) else None


@dataclass
class CommCounter:
    """``with CommCounter() as comm: ...`` then read ``comm.bytes_sent``, ``comm.calls``, ....

    ``batch_isend_irecv`` is recorded as one ``isend``/``irecv`` record per ``P2POp`` (the call
    itself adds no record), so byte and call counts are the same as with separate isend/irecv.
    """

    records: list[CommRecord] = field(default_factory=list)
    _saved: list[tuple[Any, str, Any]] = field(default_factory=list, repr=False)
    _depth: int = field(default=0, repr=False)

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:  # dist.send calls isend inside: count the outer call only
                self.records.append(_record(name, signature, args, kwargs))
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def _wrap_batch(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def counted(p2p_op_list: list[Any]) -> Any:
            ops = list(p2p_op_list) if isinstance(p2p_op_list, list) else p2p_op_list
            if self._depth == 0 and isinstance(ops, list):
                ops = [self._count_p2p_op(op) for op in ops]
            self._depth += 1
            try:
                return original(ops)
            finally:
                self._depth -= 1

        return counted

    def _count_p2p_op(self, op: Any) -> Any:
        """Record one ``P2POp`` (its ``peer`` is global already) and point it at our wrapper.

        ``batch_isend_irecv`` tells sends from receives with ``op.op is isend``; an op built with
        the unwrapped ``isend`` (before the ``with`` block) would fail that test while we are
        installed, so a copy pointing at the installed function is passed on instead.
        """
        if not isinstance(op, dist.P2POp):
            return op
        name = getattr(op.op, "__name__", "")
        if name not in ("isend", "irecv"):
            return op
        self.records.append(
            CommRecord(name, _tensor_bytes(op.tensor), int(op.peer), _group_ranks(op.group))
        )
        installed = getattr(c10d, name)
        if op.op is installed:
            return op
        patched = object.__new__(type(op))  # P2POp.__new__ checks its op: copy around it
        patched.__dict__.update(vars(op), op=installed)
        return patched

    def __enter__(self) -> CommCounter:
        for name in SENDING_OPS + RECEIVING_OPS + COLLECTIVE_OPS + ("batch_isend_irecv",):
            original = getattr(c10d, name)
            if name == "batch_isend_irecv":
                wrapper = self._wrap_batch(original)
            else:
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

    def crossing(self, allowed: Collection[int]) -> list[CommRecord]:
        """The records that touch a rank outside ``allowed`` (global ranks).

        A point-to-point call crosses when its peer is outside ``allowed`` (or, peer unknown, when
        its group reaches outside); a collective crosses when its group has a member outside
        ``allowed``. The default group counts as every rank of the world: when ``allowed`` is
        not the whole world, a collective with no ``group=`` crosses.
        """
        inside = set(allowed)
        world = tuple(range(dist.get_world_size())) if dist.is_initialized() else None

        def reaches_out(ranks: tuple[int, ...] | None) -> bool:
            members = world if ranks is None else ranks
            return members is None or not inside.issuperset(members)

        crossing = []
        for record in self.records:
            if record.is_point_to_point and record.peer is not None:
                out = record.peer not in inside
            else:
                out = reaches_out(record.group_ranks)
            if out:
                crossing.append(record)
        return crossing
