"""A ledger of the point-to-point messages a rank posted and that have not completed yet.

When ranks of :func:`course.world.run_world` hang, their Python stacks say *where* each
one waits, not *for what*: "stuck at ``work.wait()``" does not say which message never arrived.
Inside each rank this module wraps ``send``/``recv``/``isend``/``irecv`` (the package attributes
and the ``distributed_c10d`` globals, as :mod:`course.comm_counter` does, so
``dist.P2POp(dist.isend, ...)`` and ``batch_isend_irecv`` keep working: ``batch_isend_irecv``
tests ``op.op is isend`` against the module's own global, see torch/distributed/
distributed_c10d.py), and ``Work.wait`` (to know which message a rank is blocked on). It keeps,
for each message still in flight: op, peer, tag, dtype, shape and the innermost project line that
posted it. It also wraps the collectives of ``torch.distributed``'s Python API (``COLLECTIVES``)
and keeps, per group, how many this rank entered and the ones not finished: the i-th collective
on a group completes only once every member entered its i-th, so a rank waiting in one that a
member never entered is stuck (:func:`unjoined`). With both, the parent can tell a deadlock from
a slow world before the deadline (:func:`deadlocked_waits`).

A rank blocked in a C++ wait cannot run a Python signal handler, so the ledger cannot be asked
for at the deadline: it is kept in memory and a small thread of the rank rewrites a JSON file
whenever it changed, every 0.1 s (``Work.wait`` releases the GIL, so the thread runs while the
rank is blocked; it also forgets async messages that completed without anyone waiting on them).
The parent reads the files of the hung ranks and matches sends with receives. A message can stay
listed after its peer has it (gloo marks a send complete only when its sender waits on it), so
the ledger also counts, per peer and tag, every send and receive the rank ever posted: gloo and
NCCL match one peer's messages of one tag in posting order, so the i-th send from A to B with
tag t meets B's i-th receive from A with tag t, and a message is reported as unmatched only when
its peer never posted its counterpart (:func:`unmatched`). Writing the file on
every message instead cost 0.75 ms a write on a disk-backed /tmp (6 ms per send/recv pair);
recording in memory costs about 10 us a message (tests/test_harness.py keeps it under 100 us),
lost in gloo's 2-4 ms per send/recv pair on a busy 2-core machine (``DTFS_P2P_LEDGER=0`` turns
the ledger off to compare).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

SENDS = ("send", "isend")
RECEIVES = ("recv", "irecv")
LEDGER_FILE = str(Path(__file__).resolve())
# A module that only wraps isend/irecv (ring_links.RingLinks) sets this global to True, so that
# a message is reported at the line that called the wrapper, which is the line a learner wrote.
TRANSPARENT_FLAG = "__p2p_ledger_transparent__"
DISABLE_ENV = "DTFS_P2P_LEDGER"  # "0" turns the ledger off (to measure what it costs)
BLOCKING_SEND_ADVICE = (
    "every hung rank is blocked in a send. Either every rank sends before it receives, and with "
    "messages larger than the transport buffers each send waits for a matching recv: post the "
    "irecv first, or alternate by rank parity (even ranks send first, odd ranks receive first); "
    "see phase1_data_parallel/guidelines.md#13-all-reduce-from-send-and-recv. Or a rank sends "
    "one message more than its peer receives (a step too many): compare the sends listed below "
    "with the receives your code posts"
)


@dataclass(frozen=True)
class PendingP2P:
    """One message a rank posted that had not completed when the ledger was last written."""

    rank: int
    op: str  # send, isend, recv, irecv
    peer: int | None  # global rank; None for a receive from any source
    tag: int
    dtype: str
    shape: tuple[int, ...]
    filename: str  # the innermost project frame that posted it
    lineno: int
    function: str
    waiting: bool  # the rank is blocked waiting for this very message
    seq: int = -1  # how many messages of the same kind, peer and tag this rank posted before it

    @property
    def is_send(self) -> bool:
        return self.op in SENDS

    @property
    def message(self) -> str:
        """``send to 1 tag 3 float32[4, 8]``."""
        kind = "send to" if self.is_send else "recv from"
        peer = "any rank" if self.peer is None else str(self.peer)
        dims = ", ".join(str(d) for d in self.shape)
        return f"{kind} {peer} tag {self.tag} {self.dtype}[{dims}]"

    def describe(self, relative: Callable[[str], str]) -> str:
        """``rank 0 posted send to 1 tag 3 float32[4, 8] at file.py:88``."""
        return f"rank {self.rank} posted {self.message} at {relative(self.filename)}:{self.lineno}"


@dataclass(frozen=True)
class PendingCollective:
    """A collective a rank entered through ``torch.distributed``'s Python API and that had not
    completed when the ledger was last written (collectives issued from C++, as DDP's reducer
    does, or through functional collectives, as DTensor and FSDP2 do, are not seen)."""

    rank: int
    op: str  # all_reduce, broadcast, ...
    group: str  # the process group's name (the same on every member: groups are made in order)
    members: tuple[int, ...]  # its global ranks
    seq: int  # how many collectives this rank entered on that group before this one
    filename: str
    lineno: int
    function: str
    waiting: bool

    @property
    def message(self) -> str:
        """``all_reduce on ranks (0, 1)``."""
        return f"{self.op} on ranks {self.members}"


# ----------------------------------------------------------------------------- the rank side


class _Ledger:
    def __init__(self, path: str, rank: int, is_project_frame: Callable[[str], bool]) -> None:
        self.path = path
        self.rank = rank
        self.is_project_frame = functools.lru_cache(maxsize=None)(is_project_frame)
        self.dirty = True
        self.lock = threading.RLock()
        self.entries: dict[int, dict[str, Any]] = {}  # id -> entry
        self.works: dict[int, tuple[Any, int]] = {}  # id(work) -> (work, entry id)
        self.next_id = 0
        self.posted: dict[tuple[str, int | None, int], int] = {}  # (send|recv, peer, tag) -> count
        self.collectives: dict[int, dict[str, Any]] = {}  # id -> a PendingCollective's fields
        self.entered: dict[str, int] = {}  # group name -> collectives entered on it
        self.local = threading.local()
        self.write()

    # ---- recording

    def _site(self) -> tuple[str, int, str]:
        frame = sys._getframe(2)
        while frame is not None:
            filename = frame.f_code.co_filename
            if (
                filename != LEDGER_FILE
                and not frame.f_globals.get(TRANSPARENT_FLAG)
                and self.is_project_frame(filename)
            ):
                return filename, frame.f_lineno, frame.f_code.co_name
            frame = frame.f_back  # type: ignore[assignment]
        return "<unknown>", 0, "?"

    def post(self, op: str, tensor: Any, peer: int | None, tag: int, waiting: bool) -> int:
        filename, lineno, function = self._site()
        shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else ()
        dtype = str(tensor.dtype).removeprefix("torch.") if isinstance(tensor, torch.Tensor) else ""
        key = ("send" if op in SENDS else "recv", peer, tag)
        with self.lock:
            entry_id = self.next_id
            self.next_id += 1
            seq = self.posted.get(key, 0)
            self.posted[key] = seq + 1
            self.entries[entry_id] = dict(
                rank=self.rank,
                op=op,
                peer=peer,
                tag=tag,
                dtype=dtype,
                shape=list(shape),
                filename=filename,
                lineno=lineno,
                function=function,
                waiting=waiting,
                seq=seq,
            )
            self.dirty = True
        return entry_id

    def enter(self, op: str, group: str, members: tuple[int, ...], waiting: bool) -> int:
        """Record a collective this rank enters; its id shares the message ids' counter."""
        filename, lineno, function = self._site()
        with self.lock:
            entry_id = self.next_id
            self.next_id += 1
            seq = self.entered.get(group, 0)
            self.entered[group] = seq + 1
            self.collectives[entry_id] = dict(
                rank=self.rank, op=op, group=group, members=list(members), seq=seq,
                filename=filename, lineno=lineno, function=function, waiting=waiting,
            )  # fmt: skip
            self.dirty = True
        return entry_id

    def complete(self, entry_id: int) -> None:
        with self.lock:
            self.entries.pop(entry_id, None)
            self.collectives.pop(entry_id, None)
            self.dirty = True

    def track(self, work: Any, entry_id: int) -> None:
        with self.lock:
            self.works[id(work)] = (work, entry_id)

    def set_waiting(self, work: Any, waiting: bool) -> int | None:
        with self.lock:
            held = self.works.get(id(work))
            if held is None or held[0] is not work:
                return None
            entry = self.entries.get(held[1], self.collectives.get(held[1]))
            if entry is not None:
                entry["waiting"] = waiting
                self.dirty = True
            return held[1]

    def finish_work(self, work: Any) -> None:
        with self.lock:
            held = self.works.pop(id(work), None)
            if held is not None:
                self.entries.pop(held[1], None)
                self.collectives.pop(held[1], None)
                self.dirty = True

    def _sweep(self) -> None:
        """Forget async messages that completed without anyone waiting on them."""
        done = []
        for key, (work, entry_id) in self.works.items():
            with contextlib.suppress(Exception):
                if work.is_completed():
                    done.append((key, entry_id))
        for key, entry_id in done:
            self.works.pop(key, None)
            self.entries.pop(entry_id, None)
            self.collectives.pop(entry_id, None)
            self.dirty = True

    def flush_forever(self, period: float = 0.1) -> None:
        """The rank's ledger thread: keep the file as fresh as ``period`` allows."""
        pause = threading.Event()
        while not pause.wait(period):
            with self.lock:
                self._sweep()
                dirty = self.dirty
            if dirty:
                self.write()

    def write(self) -> None:
        with self.lock:
            snapshot = json.dumps(
                {
                    "pending": list(self.entries.values()),
                    "posted": [[*key, count] for key, count in self.posted.items()],
                    "collectives": list(self.collectives.values()),
                    "entered": self.entered,
                }
            )
            self.dirty = False
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as out:
            out.write(snapshot)
        os.replace(tmp, self.path)  # the parent never reads half a file


_ledger: _Ledger | None = None


def _global_peer(group: Any, peer: int | None, group_peer: int | None) -> int | None:
    if peer is not None:
        return int(peer)
    if group_peer is None:
        return None
    if group is None or group is dist.GroupMember.WORLD:
        return int(group_peer)
    with contextlib.suppress(Exception):
        return int(dist.get_global_rank(group, group_peer))
    return int(group_peer)


def _arguments(name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
    """(tensor, global peer, tag) of a send/recv/isend/irecv call, whatever way it was written."""
    peer_key, group_key = ("dst", "group_dst") if name in SENDS else ("src", "group_src")
    tensor = args[0] if args else kwargs.get("tensor")
    peer = args[1] if len(args) > 1 else kwargs.get(peer_key)
    group = args[2] if len(args) > 2 else kwargs.get("group")
    tag = args[3] if len(args) > 3 else kwargs.get("tag", 0)
    group_peer = args[4] if len(args) > 4 else kwargs.get(group_key)
    return tensor, _global_peer(group, peer, group_peer), int(tag or 0)


def _wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    blocking = name in ("send", "recv")

    @functools.wraps(original)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        ledger = _ledger
        if ledger is None or getattr(ledger.local, "inside", False):
            return original(*args, **kwargs)  # dist.send calls isend inside: record it once
        tensor, peer, tag = _arguments(name, args, kwargs)
        entry_id = ledger.post(name, tensor, peer, tag, waiting=blocking)
        return _call_recorded(ledger, entry_id, blocking, original, args, kwargs)

    return _never_traced(recorded)


def _never_traced(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` runs as plain Python even when a compiled model calls it.

    Without this, TorchDynamo traces into the ledger's bookkeeping when a compiled chunk calls a
    collective (seen in the randomized layouts: frames of ``_call_recorded`` recompiled until
    ``recompile_limit``), replaying its dict and counter updates as the side effects of a graph;
    the ledger must count what the rank did, exactly, so the call breaks the graph instead."""
    return torch.compiler.disable(fn, recursive=True)


def _call_recorded(
    ledger: _Ledger,
    entry_id: int,
    blocking: bool,
    original: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> Any:
    """Run a recorded call: what it calls inside is not recorded again (``dist.send`` calls
    ``isend``; an object collective its tensor ones); a blocking call is complete when it
    returns, an async one when its work is waited on or found completed."""
    ledger.local.inside = True
    try:
        result = original(*args, **kwargs)
    except BaseException:
        ledger.complete(entry_id)
        raise
    finally:
        ledger.local.inside = False
    if blocking or result is None:  # None: inside a coalescing manager (NCCL batches)
        ledger.complete(entry_id)
    else:
        ledger.track(result, entry_id)
    return result


COLLECTIVES = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "barrier",
)  # fmt: skip


def _group_identity(group: Any) -> tuple[str, tuple[int, ...]] | None:
    """(name, global ranks) of a collective's group; None when it cannot be told."""
    with contextlib.suppress(Exception):
        group = group if group is not None else dist.GroupMember.WORLD
        members = tuple(int(r) for r in dist.get_process_group_ranks(group))
        return str(group.group_name), members
    return None


# what a recorded collective enters: (group key, its global ranks, blocking), or None to pass
Identify = Callable[[Mapping[str, Any]], "tuple[str, tuple[int, ...], bool] | None"]


def _collective_identity(given: Mapping[str, Any]) -> tuple[str, tuple[int, ...], bool] | None:
    identity = _group_identity(given.get("group"))
    return None if identity is None else (*identity, not given.get("async_op", False))


def _new_group_identity(given: Mapping[str, Any]) -> tuple[str, tuple[int, ...], bool] | None:
    """``dist.new_group`` waits on the store until every rank of the world (or, with
    ``use_local_synchronization``, of the new group) has called it: a collective of its own,
    counted apart from the world's collectives under the name ``new_group``."""
    world = tuple(range(dist.get_world_size()))
    members = world
    if given.get("use_local_synchronization") and given.get("ranks") is not None:
        members = tuple(sorted(int(r) for r in given["ranks"]))
    return ("new_group" if members == world else f"new_group{members}"), members, True


def _wrap_collective(
    name: str, original: Callable[..., Any], identify: Identify = _collective_identity
) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        ledger = _ledger
        if ledger is None or getattr(ledger.local, "inside", False):
            return original(*args, **kwargs)
        try:
            identity = identify(signature.bind(*args, **kwargs).arguments)
        except (TypeError, RuntimeError, ValueError):
            identity = None  # a bad call: torch will say what is wrong with it
        if identity is None:
            return original(*args, **kwargs)
        key, members, blocking = identity
        entry_id = ledger.enter(name, key, members, waiting=blocking)
        return _call_recorded(ledger, entry_id, blocking, original, args, kwargs)

    return _never_traced(recorded)


def _wrap_work_wait(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        ledger = _ledger
        if ledger is None or ledger.set_waiting(self, True) is None:
            return original(self, *args, **kwargs)
        try:
            result = original(self, *args, **kwargs)
        except BaseException:
            ledger.set_waiting(self, False)
            raise
        ledger.finish_work(self)
        return result

    return _never_traced(wait)


def install(path: str, rank: int, is_project_frame: Callable[[str], bool]) -> None:
    """Record this process's point-to-point messages into ``path`` from now on (ranks only)."""
    global _ledger
    if _ledger is not None or os.environ.get(DISABLE_ENV) == "0":
        return
    _ledger = _Ledger(path, rank, is_project_frame)
    for name in SENDS + RECEIVES:
        wrapper = _wrap(name, getattr(c10d, name))
        for module in (dist, c10d):
            setattr(module, name, wrapper)
    for name in COLLECTIVES:
        wrapper = _wrap_collective(name, getattr(c10d, name))
        for module in (dist, c10d):
            setattr(module, name, wrapper)
    wrapper = _wrap_collective("new_group", c10d.new_group, _new_group_identity)
    for module in (dist, c10d):
        setattr(module, "new_group", wrapper)  # noqa: B010 - mypy: dist has no new_group stub
    work_type = torch._C._distributed_c10d.Work
    work_type.wait = _wrap_work_wait(work_type.wait)  # type: ignore[method-assign]
    threading.Thread(target=_ledger.flush_forever, name="p2p-ledger", daemon=True).start()


# ----------------------------------------------------------------------------- the parent side


Posted = dict[tuple[str, int | None, int], int]  # ("send"|"recv", peer, tag) -> messages posted


def _read(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {"pending": raw}


def read_pending(path: Path) -> list[PendingP2P]:
    """The messages a rank's ledger file lists as not completed (empty when unreadable)."""
    pending = []
    for item in _read(path).get("pending", []):
        with contextlib.suppress(KeyError, TypeError):
            item["shape"] = tuple(item["shape"])
            pending.append(PendingP2P(**item))
    return pending


def read_collectives(path: Path) -> tuple[list[PendingCollective], dict[str, int]]:
    """The collectives a rank's ledger lists as not completed, and how many it entered per
    group (empty when unreadable)."""
    raw = _read(path)
    pending = []
    for item in raw.get("collectives", []):
        with contextlib.suppress(KeyError, TypeError):
            item["members"] = tuple(item["members"])
            pending.append(PendingCollective(**item))
    entered = raw.get("entered", {})
    counts = {str(k): int(v) for k, v in entered.items()} if isinstance(entered, dict) else {}
    return pending, counts


def read_posted(path: Path) -> Posted:
    """How many sends and receives a rank ever posted, by (kind, peer, tag) (empty when
    unreadable)."""
    posted: Posted = {}
    for item in _read(path).get("posted", []):
        with contextlib.suppress(TypeError, ValueError):
            kind, peer, tag, count = item
            posted[(str(kind), None if peer is None else int(peer), int(tag))] = int(count)
    return posted


def unmatched(
    pending: Mapping[int, Sequence[PendingP2P]], posted: Mapping[int, Posted] | None = None
) -> list[tuple[PendingP2P, str]]:
    """Pending messages whose peer never posted their counterpart, and what went wrong with each.

    A send matches a receive on its peer posted from this rank (or from any rank) with the same
    tag, in the order they were posted, as gloo and NCCL match them. With ``posted`` (every
    rank's counts, :func:`read_posted`) the i-th send from A to B with tag t is matched when B
    ever posted an i-th receive from A with tag t, finished or not (a send whose receive already
    completed is not "never received"); without it, only by the receives still pending.
    """
    if posted is not None:
        return _unmatched_by_count(pending, posted)
    receives = {
        rank: [p for p in ops if not p.is_send] for rank, ops in pending.items()
    }
    sends = {rank: [p for p in ops if p.is_send] for rank, ops in pending.items()}
    lonely: list[tuple[PendingP2P, str]] = []
    for rank in sorted(sends):
        for send in sends[rank]:
            candidates = receives.get(send.peer, []) if send.peer is not None else []
            match = next(
                (r for r in candidates if r.peer in (rank, None) and r.tag == send.tag), None
            )
            if match is not None:
                candidates.remove(match)
            else:
                lonely.append((send, "never received"))
    for _rank, left in sorted(receives.items()):
        lonely += [(recv, "never sent") for recv in left]
    lonely.sort(key=lambda item: item[0].rank)
    return lonely


def crossed_tags(
    lonely: Sequence[tuple[PendingP2P, str]],
) -> list[tuple[PendingP2P, PendingP2P]]:
    """Pairs of unmatched messages that are one message under two tags: a send from A to B
    under tag t that B never received, and B's receive from A of the same dtype and shape under
    another tag that A never sent (gloo and NCCL match a message by its tag). Receives that
    their rank is blocked on come first: an early-posted receive may still be met later."""
    sends = [op for op, _ in lonely if op.is_send]
    receives = sorted((op for op, _ in lonely if not op.is_send), key=lambda op: not op.waiting)
    return [
        (send, recv)
        for recv in receives
        for send in sends
        if recv.rank == send.peer
        and recv.peer in (send.rank, None)
        and recv.tag != send.tag
        and (recv.dtype, recv.shape) == (send.dtype, send.shape)
    ]


def unjoined(
    collectives: Mapping[int, Sequence[PendingCollective]], entered: Mapping[int, Mapping[str, int]]
) -> list[tuple[PendingCollective, list[int]]]:
    """Collectives a rank waits in that some member of the group never entered: the i-th
    collective on a group needs every member's i-th (``entered`` counts them per rank)."""
    out = []
    for rank in sorted(collectives):
        for op in collectives[rank]:
            if not op.waiting:
                continue
            missing = [m for m in op.members
                       if m != rank and entered.get(m, {}).get(op.group, 0) <= op.seq]  # fmt: skip
            if missing:
                out.append((op, missing))
    return out


def deadlocked_waits(
    pending: Mapping[int, Sequence[PendingP2P]],
    posted: Mapping[int, Posted],
    unfinished: Sequence[int],
    collectives: Mapping[int, Sequence[PendingCollective]] | None = None,
    entered: Mapping[int, Mapping[str, int]] | None = None,
) -> tuple[PendingP2P | PendingCollective, ...] | None:
    """What the unfinished ranks wait for, when none of it can ever come (else None).

    Every unfinished rank is blocked in a point-to-point wait for a message whose peer never
    posted its counterpart (:func:`unmatched`, by counts), or in a collective that a member of
    its group never entered (:func:`unjoined`): a finished rank posts and enters nothing more,
    and a blocked one nothing until its own wait ends, so no wait can end. Ranks computing, or
    blocked in communication the ledger does not see (DDP's reducer, functional collectives),
    are not counted as blocked: such worlds still run to their deadline. A ledger is rewritten
    every 0.1 s, so something posted a moment ago may not be listed yet: the caller believes the
    same answer only when it holds for a while.
    """
    if not unfinished:
        return None
    never = {op for op, _ in unmatched(pending, posted)}
    stuck = {op for op, _ in unjoined(collectives or {}, entered or {})}
    waits: list[PendingP2P | PendingCollective] = []
    for rank in unfinished:
        message = waiting_on(pending.get(rank, ()))
        if message is not None:
            if message not in never:
                return None
            waits.append(message)
            continue
        joined = next((op for op in (collectives or {}).get(rank, ()) if op.waiting), None)
        if joined is None or joined not in stuck:
            return None
        waits.append(joined)
    return tuple(waits)


def waiting_on(ops: Sequence[PendingP2P]) -> PendingP2P | None:
    """The message a rank is blocked on, if it is blocked in a point-to-point wait."""
    return next((p for p in ops if p.waiting), None)


def all_blocked_in_send(
    pending: Mapping[int, Sequence[PendingP2P]], hung: Sequence[int]
) -> bool:
    """True when every hung rank waits on one of its own sends (the blocking-send pitfall)."""
    if not hung:
        return False
    for rank in hung:
        current = waiting_on(pending.get(rank, ()))
        if current is None or not current.is_send:
            return False
    return True


def _unmatched_by_count(
    pending: Mapping[int, Sequence[PendingP2P]], posted: Mapping[int, Posted]
) -> list[tuple[PendingP2P, str]]:
    lonely: list[tuple[PendingP2P, str]] = []
    for rank in sorted(pending):
        for op in pending[rank]:
            if op.peer is None:  # a receive from any source: any send to this rank and tag
                sent = sum(
                    counts.get(("send", rank, op.tag), 0) for counts in posted.values()
                )
                if sent <= op.seq:
                    lonely.append((op, "never sent"))
                continue
            peer = posted.get(op.peer, {})
            if op.is_send:
                answered = peer.get(("recv", rank, op.tag), 0) > op.seq
                answered = answered or peer.get(("recv", None, op.tag), 0) > 0
                if not answered:
                    lonely.append((op, "never received"))
            elif peer.get(("send", rank, op.tag), 0) <= op.seq:
                lonely.append((op, "never sent"))
    return lonely
