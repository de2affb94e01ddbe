"""Run one function on a world of N processes joined in a process group, and report like a grader.

Tests, benchmarks and notebooks use :func:`run_world` instead of torchrun when they need a small
world inside one Python program. Three properties matter more than anything else:

* **Fast start.** Processes come from a ``forkserver`` that imported torch once, so a world costs
  a fork, not a fresh interpreter (``spawn`` re-imports torch: about 2.5 s per world on a small
  machine). The store that ranks meet at is hosted by the calling process on a port the OS picks,
  so worlds never race for a port.
* **Failures name their rank.** A rank that raises fails the whole world with that rank's exception
  type, message and the project frames it came from; the other ranks are stopped.
* **Hangs end.** When ranks are still running at the deadline (say one rank skipped a collective),
  each is asked for its Python stack (``faulthandler`` on SIGUSR1), and the error names the hung
  ranks and the line each was stuck on. No process outlives :func:`run_world`: every rank is killed
  on the way out, and each rank also dies with the fork server (``PR_SET_PDEATHSIG``).

A finished rank does not leave the process group until every rank has finished: leaving early
would close sockets under peers still inside a collective, and turn a hang ("rank 0 waits for a
message rank 1 never sent") into a confusing connection error.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import linecache
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
from typing import Any

import torch
import torch.distributed as dist

from solutions.common.distributed import choose_backend, device_for

DEFAULT_WORLD_TIMEOUT = float(os.environ.get("DTFS_WORLD_TIMEOUT", "90"))
PROJECT_ROOT = Path(__file__).resolve().parents[2]
_HARNESS_FILE = str(Path(__file__).resolve())
_EXIT = b"exit"


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
        self, timeout: float, hung: dict[int, list[Frame]], finished: Sequence[int]
    ) -> None:
        self.timeout = timeout
        self.hung = hung
        self.finished = list(finished)
        ranks = ", ".join(str(rank) for rank in sorted(hung))
        done = ", ".join(str(rank) for rank in self.finished) or "none"
        lines = [
            f"rank(s) {ranks} still running after {timeout:g} s (finished: {done}). "
            "A rank waiting forever usually means another rank skipped or reordered a collective."
        ]
        for rank in sorted(hung):
            frames = hung[rank]
            if frames:
                lines.append(f"  rank {rank} stuck at {frames[-1]}")
                lines += [f"      called from {frame}" for frame in reversed(frames[-3:-1])]
            else:
                lines.append(f"  rank {rank}: no Python stack could be read")
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
    if filename == _HARNESS_FILE or filename.startswith("<"):
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
    return type(exc).__name__, message, _project_frames(frames)


def _rank_main(
    rank: int,
    world_size: int,
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
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store_port),
    )
    os.environ.update(env)
    if backend == "gloo":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dump = open(stack_file, "w")  # noqa: SIM115 - must stay open for the signal handler
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=False)
    torch.set_num_threads(1)
    try:
        device = device_for(backend, int(os.environ["LOCAL_RANK"]))
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


def _forkserver() -> Any:
    """The multiprocessing context all worlds fork from; torch is imported there once."""
    global _context
    if _context is None:
        ctx = multiprocessing.get_context("forkserver")
        # torch._dynamo is what DistributedDataParallel's constructor imports (about 2 s);
        # paying for it once here keeps every world that builds a DDP model fast.
        ctx.set_forkserver_preload(
            ["torch", "torch.distributed", "torch._dynamo", "solutions.common.world"]
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
    timeout: float = DEFAULT_WORLD_TIMEOUT,
    backend: str | None = None,
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` processes in one process group.

    ``fn`` must be importable (defined at module level), since each rank unpickles it. Inside it,
    ``dist.get_rank()`` and ``dist.get_world_size()`` say who it is; RANK, WORLD_SIZE, LOCAL_RANK
    and LOCAL_WORLD_SIZE are set as torchrun would set them (``env`` may override or add to them).

    Returns the ranks' return values in rank order. Raises :class:`RankFailed` when a rank raises,
    :class:`WorldHung` when ranks are still running after ``timeout`` seconds, and
    :class:`RankDied` when a rank's process ends without reporting.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: a world needs at least one process")
    backend = backend or choose_backend(world_size)
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
                    store.port,
                    backend,
                    timeout + 60.0,
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
        _collect(members, timeout)
        graceful = True
        return [member.result for member in members]
    finally:
        _stop(members, graceful)
        del store
        shutil.rmtree(tmpdir, ignore_errors=True)


def _collect(members: list[_Rank], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    by_conn = {id(member.conn): member for member in members}
    by_sentinel = {member.process.sentinel: member for member in members}
    while True:
        pending = [member for member in members if not member.done]
        if not pending:
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            finished = [member.rank for member in members if member.done]
            raise WorldHung(timeout, _read_stacks(pending), finished)
        waitables: list[Any] = [member.conn for member in pending]
        waitables += [member.process.sentinel for member in pending]
        for ready in wait(waitables, timeout=remaining):
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
            if status == "error":
                exc_type, message, frames = payload
                raise RankFailed(member.rank, exc_type, message, frames)
            member.result, member.done = payload, True
