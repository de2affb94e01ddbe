"""Run one function on a world of N processes joined in a process group, and report like a grader.

Tests, benchmarks and notebooks use :func:`run_world` instead of torchrun when they need a small
world inside one Python program. These properties matter more than anything else:

* **Fast start.** Processes come from a ``forkserver`` that imported torch once, so a world costs
  a fork, not a fresh interpreter (``spawn`` re-imports torch: about 2.5 s per world on a small
  machine). The store that ranks meet at is hosted by the calling process on a port the OS picks,
  so worlds never race for a port.
* **Failures name their rank.** A rank that raises fails the whole world with that rank's exception
  type, message and the project frames it came from; the other ranks are stopped.
* **Hangs end, fast; slow is not hung.** One deadline for every world, :func:`world_timeout`
  (20 s, or ``DTFS_WORLD_TIMEOUT``). At the deadline a world whose unfinished ranks have all stood
  still for :data:`STALL_WINDOW` seconds (no thread gained CPU time, no ledger event: see
  :mod:`course.rank_activity`) is hung: each rank is asked for its Python stack (``faulthandler``
  on SIGUSR1), and the error names the hung ranks, the line each was stuck on, and the
  point-to-point messages that were posted and never matched (see :mod:`course.p2p_ledger`). A
  world whose ranks are still computing (tracing a compiled model on a busy machine, say) keeps
  running until they stand still that long, or until the ceiling (``ceiling``, 10x the deadline),
  where it is reported as :class:`WorldStillComputing` with each rank's CPU seconds and stack,
  never as a deadlock. The process group's own timeout is a little longer than the ceiling, so
  the harness, not gloo, reports a hang. A deadlock does not wait for the
  deadline: when every unfinished rank has waited ``DEADLOCK_SETTLE`` seconds for a message that
  no rank posted, or in a collective that a member of its group never entered (the ranks'
  ledgers, read every ``_POLL`` seconds while nothing happens), none of them can ever move, and
  the same report comes at once; a hang in computation, or in communication the ledgers do not
  see (DDP's reducer, functional collectives), still waits for the deadline. No process outlives
  :func:`run_world`: every rank is killed on the way out, and each rank also dies with the fork
  server (``PR_SET_PDEATHSIG``).
* **Simulated nodes.** ``nodes=2`` lays the ranks out as two nodes and exports to each rank what
  torchrun's agent on that node would (:func:`torchrun_env`), so topology code sees two nodes.
  Under NCCL the GPU is then chosen by the global rank, not LOCAL_RANK: the "nodes" share one
  host's GPUs, and two ranks on one GPU is what NCCL refuses.

A finished rank does not leave the process group until every rank has finished: leaving early
would close sockets under peers still inside a collective, and turn a hang ("rank 0 waits for a
message rank 1 never sent") into a confusing connection error.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import linecache
import math
import multiprocessing
import os
import pickle
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from course import p2p_ledger, rank_activity
from course.distributed import DEVICE_INDEX_ENV, choose_backend, device_for

DEFAULT_WORLD_TIMEOUT = 20.0
WORLD_TIMEOUT_ENV = "DTFS_WORLD_TIMEOUT"
# When set, every world that runs under NCCL appends one line to this file (the pytest test that
# started it, the world size): the GPU batch of .ci/gpu-batch lists the tests that took a CUDA path.
NCCL_LOG_ENV = "DTFS_NCCL_WORLD_LOG"
PRELOAD_ENV = "DTFS_WORLD_PRELOAD"  # modules the fork server imports (preload_in_worlds)
PG_TIMEOUT_MARGIN = 10.0  # the process group outlives the world's ceiling by this much
CEILING_FACTOR = 10.0  # a world still computing is stopped at this many times its deadline
# At or past the deadline, a world is hung when none of its unfinished ranks moved (CPU, ledger,
# a message) for this long. Long enough for a few CPU samples on a machine with other work.
STALL_WINDOW = 5.0
_SAMPLE_EVERY = 1.0  # seconds between CPU samples of the ranks (a clock tick is 10 ms)
# A deadlock the ledgers show (every unfinished rank waits for a message no rank posted) is
# reported once it has held this long, without waiting for the deadline.
DEADLOCK_SETTLE = 2.0
_POLL = 0.5  # how often a world with no news looks at its ranks' ledgers
PROJECT_ROOT = Path(__file__).resolve().parents[1]
_HARNESS_FILE = str(Path(__file__).resolve())
_EXIT = b"exit"


MAX_UNMATCHED_SHOWN = 12  # a hang report lists at most this many unmatched messages


def world_timeout() -> float:
    """Seconds a world may run before it is reported as hung: ``DTFS_WORLD_TIMEOUT`` or 20.

    Every world test uses this one deadline (a hung exercise then costs 20 s, not minutes);
    raise it on a slow machine with ``DTFS_WORLD_TIMEOUT=60 uv run pytest ...``.
    """
    raw = os.environ.get(WORLD_TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_WORLD_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(
            f"{WORLD_TIMEOUT_ENV}={raw!r} is not a positive number of seconds; "
            f"set it like {WORLD_TIMEOUT_ENV}=60 or unset it for the default "
            f"{DEFAULT_WORLD_TIMEOUT:g}"
        )
    return value


# ----------------------------------------------------------------------------- errors


@dataclass(frozen=True)
class Frame:
    """One Python frame: where a rank raised or where it was stuck."""

    filename: str
    lineno: int
    function: str
    line: str = ""

    @property
    def location(self) -> str:
        return f"{_relative(self.filename)}:{self.lineno} in {self.function}"

    def __str__(self) -> str:
        return f"{self.location}: {self.line}" if self.line else self.location


class WorldError(RuntimeError):
    """Base class of everything :func:`run_world` raises about its ranks."""


class RankFailed(WorldError):
    """A rank raised an exception; carries its type, message and the project frames it came from."""

    def __init__(self, rank: int, exc_type: str, message: str, frames: Sequence[Frame]) -> None:
        self.rank = rank
        self.exc_type = exc_type
        self.message = message
        self.frames = list(frames)
        lines = [f"rank {rank} raised {exc_type}: {message}"]
        lines += [f"  at {frame}" for frame in self.frames[-3:]]
        super().__init__("\n".join(lines))


class WorldHung(WorldError):
    """Some ranks were still running at the deadline; carries where each one was stuck."""

    def __init__(
        self,
        timeout: float,
        hung: dict[int, list[Frame]],
        finished: Sequence[int],
        pending: Mapping[int, Sequence[p2p_ledger.PendingP2P]] | None = None,
        posted: Mapping[int, p2p_ledger.Posted] | None = None,
        deadlocked_after: float | None = None,
        unjoined: Sequence[tuple[p2p_ledger.PendingCollective, list[int]]] = (),
        elapsed: float | None = None,
        stalled_for: float | None = None,
    ) -> None:
        self.timeout = timeout
        self.elapsed = timeout if elapsed is None else elapsed  # seconds into the world
        self.stalled_for = stalled_for  # how long no rank moved (None: not measured)
        self.deadlocked_after = deadlocked_after  # seconds into the world; None: the deadline
        self.unjoined = list(unjoined)  # collectives waited in that a member never entered
        self.hung = hung
        self.finished = list(finished)
        self.pending = {rank: list(ops) for rank, ops in (pending or {}).items()}
        self.unmatched = p2p_ledger.unmatched(self.pending, posted)
        self.blocked_in_send = p2p_ledger.all_blocked_in_send(self.pending, sorted(hung))
        self.crossed = p2p_ledger.crossed_tags(self.unmatched)
        ranks = ", ".join(str(rank) for rank in sorted(hung))
        done = ", ".join(str(rank) for rank in self.finished) or "none"
        if self.crossed:
            send, recv = self.crossed[0]
            why = (
                f"The same message under two tags: rank {send.rank} sends it to rank "
                f"{send.peer} under tag {send.tag} ({_relative(send.filename)}:{send.lineno}) "
                f"and rank {recv.rank} receives it under tag {recv.tag} "
                f"({_relative(recv.filename)}:{recv.lineno}); a message is matched by its tag."
            )
        elif self.blocked_in_send:
            why = "Deadlock: " + p2p_ledger.BLOCKING_SEND_ADVICE + "."
        elif self.unmatched:
            why = (
                "A rank waiting forever usually means another rank skipped or reordered a "
                "collective, or a message was sent to or expected from the wrong rank or tag."
            )
        else:
            why = (
                "A rank waiting forever usually means another rank skipped or reordered a "
                "collective."
            )
        if deadlocked_after is None:
            first = f"rank(s) {ranks} still running after {self.elapsed:.0f} s (finished: {done})"
            first += (
                "." if stalled_for is None
                else f", none of them using the CPU or communicating for {stalled_for:.0f} s."
            )
        else:
            first = (
                f"rank(s) {ranks} deadlocked (finished: {done}): each waits for a message or "
                "a collective that no other rank will post or join, as none of them can move "
                f"(seen {deadlocked_after:.1f} s into the world, before its {timeout:g} s "
                "deadline)."
            )
        lines = [f"{first} {why}"]
        for rank in sorted(hung):
            frames = hung[rank]
            if frames:
                lines.append(f"  rank {rank} stuck at {frames[-1]}")
                lines += [f"      called from {frame}" for frame in reversed(frames[-3:-1])]
            else:
                lines.append(f"  rank {rank}: no Python stack could be read")
            current = p2p_ledger.waiting_on(self.pending.get(rank, ()))
            if current is not None and not (
                frames
                and Path(frames[-1].filename).resolve() == Path(current.filename).resolve()
                and frames[-1].lineno == current.lineno
            ):
                site = f"{_relative(current.filename)}:{current.lineno} in {current.function}"
                lines.append(f"      waiting for its {current.message} posted at {site}")
        for op, missing in self.unjoined:
            others = ", ".join(str(m) for m in missing)
            lines.append(
                f"  rank {op.rank} waits in its collective number {op.seq + 1} on ranks "
                f"{op.members} ({op.op} at {_relative(op.filename)}:{op.lineno}), which rank(s) "
                f"{others} never entered"
            )
        if self.unmatched:
            lines.append("  point-to-point messages never matched:")
            described = [f"    {op.describe(_relative)} — {what}" for op, what in self.unmatched]
            shown = list(dict.fromkeys(described))  # a loop posts the same message many times
            lines += shown[:MAX_UNMATCHED_SHOWN]
            if len(described) > MAX_UNMATCHED_SHOWN:
                lines.append(
                    f"    ... {len(described)} in all ({len(shown)} different); the first "
                    f"{min(len(shown), MAX_UNMATCHED_SHOWN)} different ones are listed"
                )
        super().__init__("\n".join(lines))


class WorldStillComputing(WorldError):
    """Ranks were still computing at the world's ceiling: slow or looping, not deadlocked.

    Carries each unfinished rank's CPU seconds, the busiest thread's share of a core when last
    sampled, and its stack, so that a loop that never ends is found at its line.
    """

    def __init__(
        self,
        elapsed: float,
        timeout: float,
        stacks: Mapping[int, list[Frame]],
        cpu: Mapping[int, float],
        share: Mapping[int, float],
        moving: Sequence[int],
        finished: Sequence[int],
    ) -> None:
        self.elapsed, self.timeout = elapsed, timeout
        self.hung = dict(stacks)
        self.cpu, self.share = dict(cpu), dict(share)
        self.moving, self.finished = list(moving), list(finished)
        ranks = ", ".join(str(rank) for rank in sorted(stacks))
        done = ", ".join(str(rank) for rank in self.finished) or "none"
        busy = ", ".join(str(rank) for rank in self.moving) or "none"
        lines = [
            f"rank(s) {ranks} still running after {elapsed:.0f} s, this world's ceiling "
            f"({elapsed / timeout:.0f}x its {timeout:g} s deadline; finished: {done}), rank(s) "
            f"{busy} still computing: not a deadlock, a rank kept using the CPU all along. "
            "Either a loop that never ends (look at the lines below), or work far too large "
            f"for this machine (smaller sizes, or a longer deadline: {WORLD_TIMEOUT_ENV}=60)."
        ]
        for rank in sorted(stacks):
            frames = stacks[rank]
            used = f"{self.cpu.get(rank, 0.0):.1f} CPU s, {self.share.get(rank, 0.0):.0%} of a core"
            if frames:
                lines.append(f"  rank {rank} ({used}) at {frames[-1]}")
                lines += [f"      called from {frame}" for frame in reversed(frames[-3:-1])]
            else:
                lines.append(f"  rank {rank} ({used}): no Python stack could be read")
        super().__init__("\n".join(lines))


class RankDied(WorldError):
    """A rank's process ended without reporting (a crash, os._exit, or killed by a signal)."""

    def __init__(self, rank: int, exitcode: int | None) -> None:
        self.rank = rank
        self.exitcode = exitcode
        how = (
            f"killed by signal {-exitcode}"
            if exitcode is not None and exitcode < 0
            else f"exit code {exitcode}"
        )
        super().__init__(f"rank {rank} died without reporting a result ({how})")


# ----------------------------------------------------------------------------- frames


def _relative(filename: str) -> str:
    try:
        return str(Path(filename).resolve().relative_to(PROJECT_ROOT))
    except ValueError:
        return filename


_LIBRARY_PREFIXES = tuple(
    {str(Path(prefix).resolve() / "lib") for prefix in (sys.base_prefix, sys.prefix)}
)


def _is_project_frame(filename: str) -> bool:
    """Frames worth showing a learner: their code, not torch, the stdlib or this harness."""
    if filename in (_HARNESS_FILE, p2p_ledger.LEDGER_FILE) or filename.startswith("<"):
        return False
    resolved = Path(filename).resolve()
    if "site-packages" in resolved.parts:
        return False
    return not str(resolved).startswith(_LIBRARY_PREFIXES)


def _project_frames(frames: Sequence[Frame]) -> list[Frame]:
    """Project frames, outermost first; all frames when none belongs to the project."""
    mine = [frame for frame in frames if _is_project_frame(frame.filename)]
    return mine or list(frames)


_FAULTHANDLER_LINE = re.compile(r'File "(?P<file>.+)", line (?P<line>\d+) in (?P<func>.+)')


def parse_faulthandler_dump(text: str) -> list[Frame]:
    """Frames of the first thread in a ``faulthandler`` dump, outermost first."""
    frames: list[Frame] = []
    for raw in text.splitlines():
        if frames and not raw.startswith("  "):
            break  # the next thread's block
        match = _FAULTHANDLER_LINE.search(raw)
        if match:
            filename, lineno = match["file"], int(match["line"])
            code = linecache.getline(filename, lineno).strip()
            frames.append(Frame(filename, lineno, match["func"].strip(), code))
    frames.reverse()  # faulthandler prints the most recent call first
    return frames


# ----------------------------------------------------------------------------- the rank side


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (the fork server) exits."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _describe(exc: BaseException) -> tuple[str, str, list[Frame]]:
    frames = [
        Frame(f.filename, f.lineno or 0, f.name, (f.line or "").strip())
        for f in traceback.extract_tb(exc.__traceback__)
    ]
    message = str(exc)
    if isinstance(exc, AssertionError) and not message:
        message = "assertion failed"
    notes = [str(note) for note in getattr(exc, "__notes__", ())]  # exc.add_note(): the context
    message = "\n".join([message, *notes]) if notes else message
    return type(exc).__name__, message, _project_frames(frames)


def torchrun_env(rank: int, world_size: int, nodes: int, store_port: int) -> dict[str, str]:
    """The variables torchrun's agent exports to ``rank`` when ranks fill ``nodes`` nodes in order.

    As torch/distributed/elastic/agent/server/api.py (``_assign_worker_ranks``) and
    local_elastic_agent.py (``_start_workers``) set them: GROUP_RANK is the node's index in the
    rendezvous, LOCAL_RANK the rank's index on its node, ROLE_* the same as the global ones
    since every worker has the default role.
    """
    per_node = world_size // nodes
    return dict(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % per_node),
        LOCAL_WORLD_SIZE=str(per_node),
        GROUP_RANK=str(rank // per_node),
        GROUP_WORLD_SIZE=str(nodes),
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=str(world_size),
        ROLE_NAME="default",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store_port),
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
    )


_RANK_CONN: Connection | None = None  # inside a rank of run_world: its pipe to the caller


def report_progress(done: int, total: int, what: str) -> None:
    """Inside a world: tell the caller how far this rank got (``3/8 layouts``), so that a long
    world shows it is moving. Only rank 0's reports are shown; outside a world, nothing."""
    if _RANK_CONN is None or not dist.is_initialized() or dist.get_rank() != 0:
        return
    _RANK_CONN.send_bytes(pickle.dumps(("progress", (done, total, what))))


def _rank_main(
    rank: int,
    world_size: int,
    nodes: int,
    store_port: int,
    backend: str,
    pg_timeout: float,
    conn: Connection,
    stack_file: str,
    env: Mapping[str, str],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> None:
    _die_with_parent()
    os.environ.update(torchrun_env(rank, world_size, nodes, store_port))
    # Simulated nodes share one host: under NCCL each rank needs its own GPU, so the GPU is
    # chosen by the global rank, not LOCAL_RANK (two "nodes" would both pick cuda:0 otherwise).
    # setup_distributed() and current_info() read this too.
    os.environ[DEVICE_INDEX_ENV] = str(rank)  # equal to LOCAL_RANK when nodes == 1
    os.environ.update(env)
    if backend == "gloo":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    global _RANK_CONN
    _RANK_CONN = conn
    dump = open(stack_file, "w")  # noqa: SIM115 - must stay open for the signal handler
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=False)
    torch.set_num_threads(1)
    try:
        p2p_ledger.install(f"{stack_file}.p2p.json", rank, _is_project_frame)
        device = device_for(backend, int(os.environ[DEVICE_INDEX_ENV]))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = dist.TCPStore(
            "127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=pg_timeout)
        )
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
        )
        result = fn(*args, **kwargs)
        report = pickle.dumps(("ok", result))
    except BaseException as exc:  # report everything, KeyboardInterrupt included
        report = pickle.dumps(("error", _describe(exc)))
    conn.send_bytes(report)
    with contextlib.suppress(EOFError, OSError):
        conn.recv_bytes()  # wait until every rank is done (see the module docstring)
    if dist.is_initialized():
        dist.destroy_process_group()
    dump.close()
    os._exit(0)


# ----------------------------------------------------------------------------- the caller side

_context: Any = None


def preload_in_worlds(modules: Sequence[str]) -> None:
    """Have the fork server import ``modules`` once, before it forks the first rank.

    Replaces the list an earlier call (or the parent process) set. Takes effect for a fork server
    not yet started: the first :func:`run_world` of this process starts it. See
    :mod:`course.world_preload`.
    """
    if any("," in name or not name for name in modules):
        raise ValueError(f"module names must be non-empty and hold no comma: {list(modules)}")
    os.environ[PRELOAD_ENV] = ",".join(dict.fromkeys(modules))


def preload_names() -> list[str]:
    """The modules :func:`preload_in_worlds` named, in order."""
    return [name for name in os.environ.get(PRELOAD_ENV, "").split(",") if name]


def warm_context() -> Any:
    """The multiprocessing context worlds fork their ranks from (a fork server that imported
    torch and torch._dynamo once): :mod:`course.torchrun_runner` forks torchrun agents from it."""
    return _forkserver()


def _forkserver() -> Any:
    """The multiprocessing context all worlds fork from; torch is imported there once."""
    global _context
    if _context is None:
        ctx = multiprocessing.get_context("forkserver")
        # torch._dynamo is what DistributedDataParallel's constructor imports (about 2 s);
        # paying for it once here keeps every world that builds a DDP model fast. Then what the
        # caller named with preload_in_worlds (course/world_preload.py imports it).
        ctx.set_forkserver_preload(
            ["torch", "torch.distributed", "torch._dynamo", "course.world", "course.world_preload"]
        )
        _context = ctx
    return _context


@dataclass
class _Rank:
    rank: int
    process: Any
    conn: Connection
    stack_file: Path
    result: Any = None
    done: bool = False


def _read_ledgers(members: list[_Rank]) -> dict[int, list[p2p_ledger.PendingP2P]]:
    """Every rank's unfinished point-to-point messages, as its ledger file last listed them."""
    return {
        member.rank: p2p_ledger.read_pending(Path(f"{member.stack_file}.p2p.json"))
        for member in members
    }


def _read_collectives(
    members: list[_Rank],
) -> tuple[dict[int, list[p2p_ledger.PendingCollective]], dict[int, dict[str, int]]]:
    """Every rank's unfinished collectives, and how many it entered per group."""
    read = {m.rank: p2p_ledger.read_collectives(Path(f"{m.stack_file}.p2p.json")) for m in members}
    return {r: pending for r, (pending, _) in read.items()}, {r: n for r, (_, n) in read.items()}


def _read_posted(members: list[_Rank]) -> dict[int, p2p_ledger.Posted]:
    """How many sends and receives each rank ever posted, by peer and tag (its ledger file)."""
    return {
        member.rank: p2p_ledger.read_posted(Path(f"{member.stack_file}.p2p.json"))
        for member in members
    }


def _read_stacks(pending: list[_Rank]) -> dict[int, list[Frame]]:
    """Ask each hung rank for its stack (SIGUSR1 -> faulthandler) and parse what it writes."""
    for member in pending:
        if member.process.is_alive():
            os.kill(member.process.pid, signal.SIGUSR1)
    texts = {member.rank: "" for member in pending}
    complete: set[int] = set()
    deadline = time.monotonic() + 2.0
    while len(complete) < len(pending) and time.monotonic() < deadline:
        time.sleep(0.1)
        for member in pending:
            text = member.stack_file.read_text() if member.stack_file.exists() else ""
            if "File " in text and text == texts[member.rank]:
                complete.add(member.rank)  # unchanged for 0.1 s: the dump is finished
            texts[member.rank] = text
    return {
        rank: _project_frames(parse_faulthandler_dump(text)) for rank, text in texts.items()
    }


def _stop(members: list[_Rank], graceful: bool) -> None:
    for member in members:
        with contextlib.suppress(BrokenPipeError, OSError):
            member.conn.send_bytes(_EXIT)
    if graceful:
        deadline = time.monotonic() + 10.0
        for member in members:
            member.process.join(max(0.0, deadline - time.monotonic()))
    for member in members:
        if member.process.is_alive():
            member.process.kill()
        member.process.join(5.0)
        member.conn.close()


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    timeout: float | None = None,
    backend: str | None = None,
    env: Mapping[str, str] | None = None,
    nodes: int = 1,
    ceiling: float | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` processes in one process group.

    ``fn`` must be importable (defined at module level), since each rank unpickles it. Inside it,
    ``dist.get_rank()`` and ``dist.get_world_size()`` say who it is; the environment is what
    torchrun would export (:func:`torchrun_env`; ``env`` may override or add to it). With
    ``nodes=N`` the ranks are laid out as N simulated nodes of ``world_size // N`` ranks each, in
    rank order: rank r has LOCAL_RANK ``r % per_node`` and GROUP_RANK ``r // per_node``.

    ``timeout`` defaults to :func:`world_timeout`. Returns the ranks' return values in rank order.
    Raises :class:`RankFailed` when a rank raises, :class:`WorldHung` when ranks are still running
    after ``timeout`` seconds and none of them moved for :data:`STALL_WINDOW` seconds (or at once,
    when their ledgers prove a deadlock), :class:`WorldStillComputing` when ranks still compute at
    ``ceiling`` seconds (default ``CEILING_FACTOR`` x ``timeout``; pass ``ceiling=timeout`` for a
    hard deadline), and :class:`RankDied` when a rank's process ends without reporting.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: a world needs at least one process")
    if nodes < 1 or world_size % nodes:
        raise ValueError(
            f"world_size={world_size} cannot be laid out as nodes={nodes} nodes of equal size: "
            "choose a world size that is a multiple of the node count (torchrun starts the same "
            "--nproc_per_node on every node)"
        )
    timeout = world_timeout() if timeout is None else timeout
    ceiling = CEILING_FACTOR * timeout if ceiling is None else max(ceiling, timeout)
    backend = backend or choose_backend(world_size)
    if backend == "nccl" and (log := os.environ.get(NCCL_LOG_ENV)):
        test = os.environ.get("PYTEST_CURRENT_TEST", "(no test)").split(" ")[0]
        with open(log, "a") as file:
            file.write(f"{test}\tworld {world_size}\t{getattr(fn, '__qualname__', fn)}\n")
    ctx = _forkserver()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    tmpdir = Path(tempfile.mkdtemp(prefix="dtfs-world-"))
    members: list[_Rank] = []
    graceful = False
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            stack_file = tmpdir / f"rank{rank}.stack"
            process = ctx.Process(
                target=_rank_main,
                name=f"rank{rank}",
                args=(
                    rank,
                    world_size,
                    nodes,
                    store.port,
                    backend,
                    ceiling + PG_TIMEOUT_MARGIN,
                    child_end,
                    str(stack_file),
                    dict(env or {}),
                    fn,
                    tuple(args),
                    dict(kwargs or {}),
                ),
                daemon=True,
            )
            process.start()
            child_end.close()
            members.append(_Rank(rank, process, parent_end, stack_file))
        _collect(members, timeout, ceiling)
        graceful = True
        return [member.result for member in members]
    finally:
        _stop(members, graceful)
        del store
        shutil.rmtree(tmpdir, ignore_errors=True)


ProgressSink = Callable[[int, int, int, str], None]
_progress_sink: ProgressSink | None = None


def set_progress_sink(sink: ProgressSink | None) -> None:
    """Where the caller shows a world's progress: ``sink(world_size, done, total, what)`` for
    each :func:`report_progress` of its rank 0 (tests/conftest.py prints a line per report in
    a one-exercise run: ``world of 4: 3/8 layouts``); None: nowhere."""
    global _progress_sink
    _progress_sink = sink


def _collect(members: list[_Rank], timeout: float, ceiling: float) -> None:
    started = time.monotonic()
    deadline, stop_at = started + timeout, started + ceiling
    by_conn = {id(member.conn): member for member in members}
    by_sentinel = {member.process.sentinel: member for member in members}
    suspected: Any = None  # the deadlock the ledgers last showed, and since when
    suspected_since = started
    activity = rank_activity.RankActivity({m.rank: m.process.pid for m in members})
    ledger_stamps: dict[int, int] = {}
    sampled = -_SAMPLE_EVERY
    watched_since: float | None = None  # the first CPU sample: what moved before it is unknown
    while True:
        pending = [member for member in members if not member.done]
        if not pending:
            return
        now = time.monotonic()
        if now >= deadline - STALL_WINDOW - _SAMPLE_EVERY and now - sampled >= _SAMPLE_EVERY:
            sampled = now  # CPU samples start shortly before the deadline: until then, free
            watched_since = now if watched_since is None else watched_since
            activity.sample([m.rank for m in pending], now)
            _note_ledger_news(pending, ledger_stamps, activity, now)
        if now >= deadline:
            # a rank that finished or reported is news too: its peers may be about to finish
            last = max((activity.last_moved(m.rank) or -math.inf) for m in members)
            if last <= now - STALL_WINDOW:
                before = _ledger_stamps(members)
                stacks = _read_stacks(pending)
                if _ledger_stamps(members) != before:  # it moved while its stacks were read:
                    activity.moved(pending[0].rank, time.monotonic())  # not stuck after all
                    continue
                seen_from = max(last, watched_since if watched_since is not None else now)
                stalled = now - seen_from if rank_activity.available() else None
                _raise_hung(members, pending, timeout, elapsed=now - started,
                            stalled_for=stalled, stacks=stacks)  # fmt: skip
            if now >= stop_at:
                _raise_still_computing(members, pending, timeout, activity, now - started)
        next_event = deadline if now < deadline else stop_at
        waitables: list[Any] = [member.conn for member in pending]
        waitables += [member.process.sentinel for member in pending]
        ready_now = wait(waitables, timeout=max(0.0, min(next_event - now, _POLL)))
        if not ready_now:
            state = _deadlock_seen(members, pending)
            if state is None or state != suspected:
                suspected, suspected_since = state, time.monotonic()
            elif time.monotonic() - suspected_since >= DEADLOCK_SETTLE:
                _raise_hung(members, pending, timeout, time.monotonic() - started)
            continue
        for ready in ready_now:
            member = by_sentinel.get(ready) if isinstance(ready, int) else by_conn[id(ready)]
            if member is None or member.done:
                continue
            if isinstance(ready, int) and not member.conn.poll():
                member.process.join(1.0)
                raise RankDied(member.rank, member.process.exitcode)
            try:
                status, payload = pickle.loads(member.conn.recv_bytes())
            except EOFError:
                member.process.join(1.0)
                raise RankDied(member.rank, member.process.exitcode) from None
            if status == "progress":
                activity.moved(member.rank, time.monotonic())
                if _progress_sink is not None:
                    _progress_sink(len(members), *payload)
                continue
            if status == "error":
                exc_type, message, frames = payload
                if _PEER_GONE.search(message):
                    _raise_if_a_peer_died(members, member)
                raise RankFailed(member.rank, exc_type, message, frames)
            member.result, member.done = payload, True
            activity.moved(member.rank, time.monotonic())


def _ledger_stamps(members: list[_Rank]) -> dict[int, int]:
    """When each rank's ledger file was last rewritten (ns): the ledger thread rewrites it only
    when its rank posted, entered or finished a message or collective."""
    stamps = {}
    for member in members:
        with contextlib.suppress(OSError):
            stamps[member.rank] = os.stat(f"{member.stack_file}.p2p.json").st_mtime_ns
    return stamps


def _note_ledger_news(
    pending: list[_Rank], stamps: dict[int, int], activity: rank_activity.RankActivity, now: float
) -> None:
    """A ledger file rewritten since the last look: its rank communicated, so it moved."""
    for rank, stamp in _ledger_stamps(pending).items():
        if rank in stamps and stamps[rank] != stamp:
            activity.moved(rank, now)
        stamps[rank] = stamp


def _deadlock_seen(members: list[_Rank], pending: list[_Rank]) -> Any:
    """What the ledgers say every unfinished rank waits for, when no wait can end (else None):
    with every rank's counts of posted messages, so that any new message changes it."""
    if not all(member.process.is_alive() for member in pending):
        return None  # a dead rank is reported as such, by its sentinel
    ledgers, posted = _read_ledgers(members), _read_posted(members)
    collectives, entered = _read_collectives(members)
    unfinished = [m.rank for m in pending]
    waits = p2p_ledger.deadlocked_waits(ledgers, posted, unfinished, collectives, entered)
    if waits is None:
        return None
    counts = [(rank, sorted(posted[rank].items(), key=str), sorted(entered[rank].items()))
              for rank in sorted(posted)]  # fmt: skip
    return waits, repr(counts)


def _raise_hung(
    members: list[_Rank],
    pending: list[_Rank],
    timeout: float,
    deadlocked_after: float | None = None,
    elapsed: float | None = None,
    stalled_for: float | None = None,
    stacks: dict[int, list[Frame]] | None = None,
) -> NoReturn:
    """Raise :class:`WorldHung` with the ranks' stacks (read now unless given) and their ledgers,
    read after the stacks: a world that stands still shows the same messages in both."""
    finished = [member.rank for member in members if member.done]
    stacks = _read_stacks(pending) if stacks is None else stacks
    ledgers, posted = _read_ledgers(members), _read_posted(members)
    collectives, entered = _read_collectives(members)
    stuck = p2p_ledger.unjoined(collectives, entered)
    raise WorldHung(
        timeout, stacks, finished, ledgers, posted, deadlocked_after, stuck,
        elapsed=elapsed, stalled_for=stalled_for,
    )  # fmt: skip


def _raise_still_computing(
    members: list[_Rank],
    pending: list[_Rank],
    timeout: float,
    activity: rank_activity.RankActivity,
    elapsed: float,
) -> NoReturn:
    ranks = [member.rank for member in pending]
    cpu = {rank: activity.cpu_seconds(rank) for rank in ranks}
    share = {rank: activity.share(rank) for rank in ranks}
    moving = [rank for rank in ranks if share[rank] >= rank_activity.MOVING_SHARE]
    finished = [member.rank for member in members if member.done]
    stacks = _read_stacks(pending)
    raise WorldStillComputing(elapsed, timeout, stacks, cpu, share, moving, finished)


_PEER_GONE = re.compile(r"Connection closed by peer|Connection reset|Broken pipe")


def _raise_if_a_peer_died(members: list[_Rank], reporter: _Rank, grace: float = 1.0) -> None:
    """When a rank fails because a peer's connection dropped, name the peer that died instead.

    The peer's death is the cause and the connection error its echo; which of the two the parent
    notices first is a race, so wait up to ``grace`` seconds for a dead, silent peer.
    """
    deadline = time.monotonic() + grace
    while True:
        for other in members:
            if other is reporter or other.done or other.process.is_alive():
                continue
            try:  # a dead rank's pipe polls as readable: at EOF, or holding its last report
                reported = other.conn.poll() and bool(other.conn.recv_bytes())
            except (EOFError, OSError):
                reported = False
            if not reported:
                other.process.join(1.0)
                raise RankDied(other.rank, other.process.exitcode)
        if time.monotonic() >= deadline:
            return
        time.sleep(0.05)
