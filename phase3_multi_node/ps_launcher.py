"""Run S parameter servers and W workers as processes on one machine (exercise 3.7's launcher).

    uv run python -m solutions.phase3_multi_node.parameter_server \\
        --servers 2 --workers 3 --mode ssp --staleness 2 --slow-worker 1

(the same as ``-m phase3_multi_node.ps_launcher``) trains on the built-in dataset
(course/datasets.py) and prints the address each server listens on, the clocks each
worker ran, the staleness histogram (how far ahead of the slowest live worker each pull was
served), throughput and test accuracy. ``--impl templates`` runs your own code.

Processes come from a ``forkserver`` that imported torch once (fork of a process that already
runs torch threads is unsafe; spawn re-imports torch per process). Servers and workers talk only
over TCP with the framed protocol of ps_wire.py; the launcher talks to its own children over
``multiprocessing`` pipes, which pickle: fine between a parent and the children it forked, never
for a socket a stranger can reach. Every child is killed and reaped on the way out, and each dies
with the fork server (PR_SET_PDEATHSIG).

A run's results are read only after every server has handled what the departed workers sent last
(:meth:`Cluster.drain`): a worker process reports as soon as its last frames are in the kernel's
buffer, and a report taken before the server read them would miss the last clock. When a server
closed a worker's connection, the failure leads with the server's reason, not the worker's
``PeerClosed``. Every flag is checked before a process starts (:func:`validate`).

Fault knobs: ``--kill-worker 1 --kill-at 5`` makes worker 1 SIGKILL itself in clock 5, after
computing and before pushing; ``--restart-killed`` starts it again (after a sync clock re-formed
without it), and it rejoins at the current clock. ``--slow-worker 1 --slow-factor 3`` makes
worker 1 take 3x as long per clock; ``--step-delay`` adds compute time to every worker.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import random
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn

from course.cli import parse_config, run_main
from course.datasets import PatternSpec, make_pattern_dataset
from course.impl import IMPLS, load_impl
from course.models import MLP, BabyCNN
from phase3_multi_node.ps_server_base import (
    ServerConfig,
    ServerReport,
    check_server_config,
    default_secret,
    shard_of,
    staleness_histogram,
)
from phase3_multi_node.ps_wire import is_loopback

PHASE = "phase3_multi_node"
MODES = ("sync", "async", "ssp")
PROJECT_ROOT = Path(__file__).resolve().parents[1]
DRAIN_TIMEOUT = 10.0  # seconds a server may take to handle what departed workers sent last
CONNECTION_ERRORS = ("PeerClosed", "ProtocolError", "ConnectionResetError", "BrokenPipeError")

BatchFn = Callable[[int, int, int], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class PSConfig:
    """The command line (see the module docstring). Every number is checked before any process
    starts: bounds here (``ge``/``gt``/``lt``, see course/cli.py), the rest in :func:`validate`."""

    servers: int = field(
        default=2, metadata={"help": "parameter servers (processes)", "ge": 1, "fix": "1 or more"}
    )
    workers: int = field(
        default=3, metadata={"help": "workers (processes)", "ge": 1, "fix": "1 or more"}
    )
    mode: str = field(default="sync", metadata={"choices": MODES, "help": "consistency model"})
    staleness: int = field(
        default=2,
        metadata={"help": "ssp: clocks the fastest may lead", "ge": 0, "fix": "0 (sync) or more"},
    )
    steps: int = field(
        default=150, metadata={"help": "clocks each worker runs", "ge": 1, "fix": "1 or more"}
    )
    batch_size: int = field(
        default=32,
        metadata={"help": "samples per worker per clock", "ge": 1, "fix": "e.g. --batch-size 32"},
    )
    lr: float = field(
        default=0.05, metadata={"gt": 0, "fix": "a positive learning rate, e.g. --lr 0.05"}
    )
    momentum: float = field(
        default=0.0, metadata={"ge": 0, "lt": 1, "fix": "a momentum in [0, 1), e.g. 0.9"}
    )
    model: str = field(default="mlp", metadata={"choices": ("mlp", "cnn")})
    train_samples: int = field(default=4096, metadata={"ge": 1, "fix": "e.g. --train-samples 4096"})
    test_samples: int = field(default=1024, metadata={"ge": 1, "fix": "e.g. --test-samples 1024"})
    slow_worker: int = field(
        default=-1,
        metadata={
            "help": "this worker runs slow_factor x slower",
            "ge": -1,
            "fix": "a worker id, or -1 for none",
        },
    )
    slow_factor: float = field(
        default=3.0, metadata={"ge": 1, "fix": "1 (not slow) or more, e.g. 3"}
    )
    random_straggler: bool = field(
        default=False, metadata={"help": "each clock, a random 1/W of the workers is slow"}
    )
    time_budget: float = field(
        default=0.0,
        metadata={
            "help": ">0: workers stop starting clocks after this many s",
            "ge": 0,
            "fix": "0 (no budget) or a number of seconds",
        },
    )
    step_delay: float = field(
        default=0.0,
        metadata={
            "help": "extra seconds of 'compute' per clock",
            "ge": 0,
            "fix": "0 or a number of seconds, e.g. 0.02",
        },
    )
    kill_worker: int = field(
        default=-1,
        metadata={
            "help": "this worker SIGKILLs itself",
            "ge": -1,
            "fix": "a worker id, or -1 for none",
        },
    )
    kill_at: int = field(
        default=-1,
        metadata={"help": "...in this clock, before pushing", "ge": -1, "fix": "a clock number"},
    )
    restart_killed: bool = False
    sync_timeout: float = field(
        default=2.0, metadata={"gt": 0, "fix": "a positive number of seconds, e.g. 2"}
    )
    host: str = field(
        default="127.0.0.1", metadata={"help": "bind address (non-loopback needs DTFS_PS_SECRET)"}
    )
    time_limit: float = field(
        default=300.0, metadata={"gt": 0, "fix": "a positive number of seconds, e.g. 300"}
    )
    impl: str = field(default="solutions", metadata={"choices": IMPLS})


@dataclass(frozen=True)
class Job:
    """Everything a child process needs, picklable: factories are module-level functions."""

    model_fn: Callable[[], nn.Module]
    batch_fn: BatchFn
    server_config: ServerConfig
    num_servers: int
    steps: int
    impl: str = "solutions"
    secret: bytes | None = None
    slow_worker: int = -1
    slow_factor: float = 3.0
    step_delay: float = 0.0
    kill_worker: int = -1
    kill_at: int = -1
    worker_timeout: float = 60.0
    time_budget: float = 0.0  # >0: each worker stops starting clocks this long after its first
    random_straggler: bool = False  # each clock, each worker is slow with probability 1/W

    @property
    def num_workers(self) -> int:
        return int(self.server_config.num_workers)


@dataclass
class WorkerReport:
    """One worker process's run: the clocks it computed, with times (time.monotonic)."""

    worker: int
    join_clock: int
    clocks: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    started: list[float] = field(default_factory=list)  # before the pull
    pulled: list[float] = field(default_factory=list)  # the pull returned
    finished: list[float] = field(default_factory=list)  # the push was sent (plus delays)
    first_params: list[torch.Tensor] = field(default_factory=list)  # after the first pull


@dataclass
class ChildFailure:
    """A child raised: which, the exception, and the innermost project frame."""

    role: str  # "server" or "worker"
    index: int
    exc_type: str
    message: str
    where: str

    def __str__(self) -> str:
        at = f" (at {self.where})" if self.where else ""
        return f"{self.role} {self.index}: {self.exc_type}: {self.message}{at}"


class ClusterError(RuntimeError):
    """A server or worker failed, or the run passed its time limit."""

    def __init__(self, message: str, failure: ChildFailure | None = None) -> None:
        super().__init__(message)
        self.failure = failure


@dataclass
class RunResult:
    workers: dict[int, list[WorkerReport]]  # every incarnation that finished, in start order
    killed: list[int]  # workers that died by SIGKILL
    servers: list[ServerReport]  # one per server
    params: list[torch.Tensor]  # the final parameters, by key, from the servers
    addresses: list[tuple[str, int]]
    wall: float  # seconds from the first clock's start (any worker) to the last clock's end
    pids: list[int]  # every process the run started (all gone when train() returns)


# ----------------------------------------------------------------------------- built-in job


@functools.lru_cache(maxsize=4)
def _dataset(samples: int, split_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = make_pattern_dataset(samples, PatternSpec(), split_seed=split_seed)
    return data.tensors[0], data.tensors[1]


def pattern_batch(
    worker: int, num_workers: int, clock: int, *, batch_size: int, samples: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``worker``'s batch for ``clock``: its shard is every W-th sample, walked in order."""
    images, labels = _dataset(samples, 0)
    shard = torch.arange(worker, samples, num_workers)
    start = (clock * batch_size) % len(shard)
    index = shard[(torch.arange(batch_size) + start) % len(shard)]
    return images[index], labels[index]


def make_model(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if name == "cnn":
        return BabyCNN()
    return MLP(PatternSpec().image_size ** 2, hidden=64)


def test_accuracy(model: nn.Module, samples: int) -> float:
    images, labels = _dataset(samples, 1)
    with torch.no_grad():
        return float((model(images).argmax(dim=1) == labels).float().mean())


# ----------------------------------------------------------------------------- children

_context: Any = None


def _forkserver() -> Any:
    """The forkserver context; its server imports once what every child would import again.

    ``torch._dynamo`` is there because the first ``torch.optim`` optimizer a process creates
    imports it (about 900 modules, 2-3 s on an idle laptop core, several times that on a busy
    one): every server would pay it at start, before it can accept a worker.
    """
    global _context
    if _context is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch._dynamo", "phase3_multi_node.ps_launcher"])
        multiprocessing.forkserver.ensure_running()  # now, not inside a run's time limit
        _context = ctx
    return _context


def _send(conn: Connection, message: Any) -> None:
    """Plain pickle (tensors inline), not torch's fd-sharing reducers: the sender may exit
    before the receiver reads, and a shared fd then dangles."""
    conn.send_bytes(pickle.dumps(message))


def _receive(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _where(exc: BaseException) -> str:
    """``file:line in function`` of the innermost project frame (the learner's code, usually)."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = Path(frame.filename).resolve()
        if PROJECT_ROOT in path.parents and ".venv" not in path.parts:
            return f"{path.relative_to(PROJECT_ROOT)}:{frame.lineno} in {frame.name}"
    return ""


def _modules(impl: str) -> tuple[Any, Any]:
    return load_impl(PHASE, "parameter_server", impl), load_impl(PHASE, "ps_sharding", impl)


def _assignment(job: Job, model: nn.Module) -> list[int]:
    _, sharding = _modules(job.impl)
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    return list(sharding.balanced_assignment(sizes, job.num_servers))


def _server_main(server_id: int, job: Job, conn: Connection) -> None:
    _die_with_parent()
    torch.set_num_threads(1)
    server = None
    try:
        ps, _ = _modules(job.impl)
        model = job.model_fn()
        shard = shard_of(model, _assignment(job, model), server_id)
        server = ps.ParameterServer(server_id, shard, job.server_config)
        _send(conn, ("ready", server.start()))
    except BaseException as exc:
        _send(
            conn,
            ("error", ChildFailure("server", server_id, type(exc).__name__, str(exc), _where(exc))),
        )
        return
    while True:
        try:
            command = _receive(conn)
        except (EOFError, OSError):
            command = "stop"
        if command == "snapshot":
            _send(conn, ("snapshot", server.snapshot()))
        elif command == "drain":  # every worker gone: each frame it sent has been handled
            _send(conn, ("drained", server.wait_until_idle(DRAIN_TIMEOUT)))
        elif command == "report":
            _send(conn, ("report", server.get_report()))
        else:
            server.stop()
            with contextlib.suppress(OSError):
                _send(conn, ("stopped", None))
            return


def _worker_main(
    worker_id: int, job: Job, addresses: list[tuple[str, int]], may_kill: bool, conn: Connection
) -> None:
    _die_with_parent()
    torch.set_num_threads(1)
    try:
        ps, _ = _modules(job.impl)
        model = job.model_fn()
        worker = ps.Worker(
            worker_id,
            model,
            addresses,
            _assignment(job, model),
            secret=job.secret,
            timeout=job.worker_timeout,
        )
        # one untimed forward/backward first: the first call builds the dataset and warms
        # autograd, which a slow worker's delay (a multiple of its clock's time) would inflate
        worker.compute(*job.batch_fn(worker_id, job.num_workers, 0))
        start = worker.connect()
        report = WorkerReport(worker_id, start)
        straggle = random.Random(1000 + worker_id)
        for clock in range(start, job.steps):
            began = time.monotonic()
            if job.time_budget > 0 and report.pulled and began - report.pulled[0] > job.time_budget:
                break
            worker.pull(clock)
            pulled = time.monotonic()
            if clock == start:
                report.first_params = [p.detach().clone() for p in model.parameters()]
            inputs, targets = job.batch_fn(worker_id, job.num_workers, clock)
            loss = worker.compute(inputs, targets)
            if may_kill and worker_id == job.kill_worker and clock == job.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # mid-clock: computed, never pushed
            worker.push(clock)
            delay = job.step_delay
            slow = worker_id == job.slow_worker
            if job.random_straggler:
                slow = straggle.random() < 1 / job.num_workers
            if slow:
                delay += (job.slow_factor - 1) * (time.monotonic() - pulled + job.step_delay)
            if delay > 0:
                time.sleep(delay)
            report.clocks.append(clock)
            report.losses.append(loss)
            report.started.append(began)
            report.pulled.append(pulled)
            report.finished.append(time.monotonic())
        worker.close()
        _send(conn, ("ok", report))
    except BaseException as exc:
        _send(
            conn,
            ("error", ChildFailure("worker", worker_id, type(exc).__name__, str(exc), _where(exc))),
        )


# ----------------------------------------------------------------------------- the cluster


@dataclass
class _Child:
    role: str
    index: int
    process: Any
    conn: Connection
    result: Any = None
    done: bool = False


class Cluster:
    """S server processes and W worker processes; ``with Cluster(job) as c:`` kills all at exit."""

    def __init__(self, job: Job, time_limit: float = 60.0) -> None:
        self.job = job
        _forkserver()  # started (once per process) before the time limit runs
        self.deadline = time.monotonic() + time_limit
        self.time_limit = time_limit
        self.servers: list[_Child] = []
        self.workers: list[_Child] = []
        self.addresses: list[tuple[str, int]] = []
        self.pids: list[int] = []

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise ClusterError(f"the run passed its time limit of {self.time_limit:g} s")
        return left

    def _start(self, role: str, index: int, target: Callable[..., None], *args: Any) -> _Child:
        ctx = _forkserver()
        parent, child = ctx.Pipe()
        process = ctx.Process(target=target, args=(index, self.job, *args, child), daemon=True)
        process.start()
        child.close()
        self.pids.append(process.pid)
        return _Child(role, index, process, parent)

    def start_servers(self) -> list[tuple[str, int]]:
        self.servers = [self._start("server", s, _server_main) for s in range(self.job.num_servers)]
        for server in self.servers:
            kind, value = self._recv(server)
            if kind == "error":
                raise ClusterError(f"{value}", value)
            self.addresses.append(tuple(value))
        return self.addresses

    def start_worker(self, worker: int, may_kill: bool = True) -> None:
        self.workers.append(
            self._start("worker", worker, _worker_main, list(self.addresses), may_kill)
        )

    def _recv(self, child: _Child) -> Any:
        if not child.conn.poll(self._left()):
            raise ClusterError(f"{child.role} {child.index} did not answer within the time limit")
        try:
            return _receive(child.conn)
        except EOFError as exc:
            raise ClusterError(
                f"{child.role} {child.index} died (exit code {child.process.exitcode})"
            ) from exc

    def _raise_worker_failures(self) -> None:
        """A worker that reported an error ends the run now, not at the time limit."""
        for child in self.workers:
            if not child.done and child.conn.poll():
                with contextlib.suppress(EOFError):
                    child.result = _receive(child.conn)
                child.done = True
            if child.result is not None and child.result[0] == "error":
                self._raise_worker_failure(child.result[1])

    def _raise_worker_failure(self, failure: ChildFailure) -> NoReturn:
        """End the run on a worker's failure, leading with the servers' side when they have one.

        A worker whose connection a server closed only sees ``PeerClosed``; the reason (an
        exception in the server's exercise code, or the frame the server refused) is in the
        server's report, so it comes first.
        """
        self._raise_server_errors()
        if failure.exc_type in CONNECTION_ERRORS:
            said = self._server_side(failure.index)
            if said is not None:
                server, reason = said
                raise ClusterError(
                    f"server {server} closed worker {failure.index}'s connection: {reason} "
                    f"(the worker then saw {failure.exc_type}: {failure.message})",
                    ChildFailure("server", server, "ProtocolError", reason, ""),
                )
        raise ClusterError(str(failure), failure)

    def _server_side(self, worker: int) -> tuple[int, str] | None:
        """The first reason a server logged for closing ``worker``'s connection, if any; else
        the first handshake it refused (before HELLO names the worker, a client is only an
        address, and the launcher's workers are the only clients)."""
        marks = (f"closing the connection of worker {worker}: ", f"serving worker {worker}: ")
        refused = None
        for report in self.server_reports():
            for line in report.events:
                for mark in marks:
                    if mark in line:
                        return report.server_id, line.split(mark, 1)[1]
                if refused is None and "closing the connection of client" in line:
                    reason = line.split("): ", 1)[-1]
                    if "to make room" not in reason and "handshake within" not in reason:
                        refused = (report.server_id, f"refused its handshake: {reason}")
        return refused

    def wait_for_death(self, worker: int) -> None:
        child = next(c for c in self.workers if c.index == worker)
        while child.process.exitcode is None:
            self._raise_worker_failures()
            child.process.join(min(0.1, self._left()))
        self._raise_worker_failures()
        if child.process.exitcode != -signal.SIGKILL:
            raise ClusterError(
                f"worker {worker} was meant to kill itself in clock {self.job.kill_at} but "
                f"exited with code {child.process.exitcode}"
            )

    def wait_for_event(self, text: str) -> list[str]:
        """Poll the servers' logs until a line contains ``text``; returns the lines."""
        while True:
            lines = [line for report in self.server_reports() for line in report.events]
            if any(text in line for line in lines):
                return lines
            self._raise_worker_failures()
            self._left()
            time.sleep(0.05)

    def wait_for_clock(self, clock: int, timeout: float) -> None:
        """Poll the servers until some worker completed ``clock`` clocks on every server."""
        deadline = time.monotonic() + timeout
        while True:
            done = [
                max((c + 1 for _, _, c in report.clocks_done), default=0)
                for report in self.server_reports()
            ]
            if min(done) >= clock:
                return
            self._raise_worker_failures()
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"the workers did not go on without worker {self.job.kill_worker}: after "
                    f"{timeout:g} s no worker had completed {clock} clocks (reached {done}); "
                    "a dead worker must stop counting: ssp waits only for the members still "
                    "connected"
                )
            time.sleep(0.05)

    def wait_workers(self) -> tuple[dict[int, list[WorkerReport]], list[int]]:
        """Wait for every worker process; reports by worker id, and the ids killed by SIGKILL."""
        pending = [c for c in self.workers if not c.done]
        while pending:
            ready = wait(
                [c.conn for c in pending] + [c.process.sentinel for c in pending],
                timeout=self._left(),
            )
            for child in pending:
                if child.conn in ready or child.process.sentinel in ready:
                    try:
                        child.result = _receive(child.conn) if child.conn.poll() else None
                    except EOFError:
                        child.result = None
                    if child.result is None:
                        child.process.join(1.0)
                    child.done = True
            self._raise_worker_failures()  # one failed worker: stop, don't wait for the rest
            pending = [c for c in pending if not c.done]
        reports: dict[int, list[WorkerReport]] = {}
        killed = []
        for child in self.workers:
            if child.result is None:
                if child.process.exitcode == -signal.SIGKILL:
                    killed.append(child.index)
                    continue
                raise ClusterError(
                    f"worker {child.index} died without a report "
                    f"(exit code {child.process.exitcode})"
                )
            kind, value = child.result
            if kind == "error":
                self._raise_worker_failure(value)
            reports.setdefault(child.index, []).append(value)
        return reports, killed

    def _raise_server_errors(self) -> None:
        for report in self.server_reports():
            for exc_type, message, where in report.errors:
                failure = ChildFailure("server", report.server_id, exc_type, message, where)
                raise ClusterError(str(failure), failure)

    def _ask(self, command: str) -> list[Any]:
        answers = []
        for server in self.servers:
            _send(server.conn, command)
            _, value = self._recv(server)
            answers.append(value)
        return answers

    def server_reports(self) -> list[ServerReport]:
        return self._ask("report")

    def drain(self) -> None:
        """Wait until every server has handled what the departed workers sent last.

        A worker's last frames (its final CLOCK, then BYE) may still sit in a server's socket
        when the worker's process has already reported; a report taken then would miss the
        last clock. A server is drained when no worker is connected to it any more.
        """
        for server, drained in zip(self.servers, self._ask("drain"), strict=True):
            if not drained:
                raise ClusterError(
                    f"server {server.index} still had a worker connected {DRAIN_TIMEOUT:g} s "
                    "after every worker process ended"
                )

    def parameters(self) -> list[torch.Tensor]:
        merged: dict[int, torch.Tensor] = {}
        for shard in self._ask("snapshot"):
            merged.update(shard)
        return [merged[key] for key in sorted(merged)]

    def close(self) -> None:
        """Stop the servers, kill every child still running, reap them all."""
        for server in self.servers:
            with contextlib.suppress(OSError, ValueError):
                _send(server.conn, "stop")
        for child in self.servers + self.workers:
            child.process.join(timeout=2.0 if child.role == "server" else 0.0)
            if child.process.exitcode is None:
                child.process.kill()
                child.process.join(timeout=5.0)
            child.conn.close()


def train(
    job: Job,
    *,
    time_limit: float = 60.0,
    restart_killed: bool = False,
    on_servers: Callable[[list[tuple[str, int]]], None] | None = None,
) -> RunResult:
    """Run a whole job: servers, workers (a killed one restarted if asked), then collect."""
    with Cluster(job, time_limit) as cluster:
        addresses = cluster.start_servers()
        if on_servers is not None:
            on_servers(addresses)
        began = time.monotonic()
        for worker in range(job.num_workers):
            cluster.start_worker(worker)
        if restart_killed and job.kill_worker >= 0:
            cluster.wait_for_death(job.kill_worker)
            if job.server_config.mode == "sync":
                cluster.wait_for_event("re-formed")
            else:  # the others go on without it, past where ssp would hold them for it
                lead = job.server_config.staleness if job.server_config.mode == "ssp" else 0
                cluster.wait_for_clock(job.kill_at + lead + 2, timeout=10.0)
            cluster.start_worker(job.kill_worker, may_kill=False)
        reports, killed = cluster.wait_workers()
        ends = [r.finished[-1] for runs in reports.values() for r in runs if r.finished]
        firsts = [r.started[0] for runs in reports.values() for r in runs if r.started]
        wall = (max(ends) if ends else time.monotonic()) - (min(firsts) if firsts else began)
        cluster.drain()
        cluster._raise_server_errors()
        servers = cluster.server_reports()
        params = cluster.parameters()
    return RunResult(reports, killed, servers, params, cluster.addresses, wall, cluster.pids)


# ----------------------------------------------------------------------------- the command


def job_from_config(config: PSConfig) -> Job:
    """The job a command line describes (call :func:`validate` first)."""
    secret = default_secret()
    server_config = ServerConfig(
        mode=config.mode,
        staleness=config.staleness,
        num_workers=config.workers,
        lr=config.lr,
        momentum=config.momentum,
        host=config.host,
        secret=secret,
        sync_timeout=config.sync_timeout,
    )
    check_server_config(server_config)
    return Job(
        model_fn=functools.partial(make_model, config.model),
        batch_fn=functools.partial(
            pattern_batch, batch_size=config.batch_size, samples=config.train_samples
        ),
        server_config=server_config,
        num_servers=config.servers,
        steps=config.steps,
        impl=config.impl,
        secret=secret,
        slow_worker=config.slow_worker,
        slow_factor=config.slow_factor,
        step_delay=config.step_delay,
        kill_worker=config.kill_worker,
        kill_at=config.kill_at,
        random_straggler=config.random_straggler,
        time_budget=config.time_budget,
    )


def validate(config: PSConfig) -> None:
    """Refuse settings that do not fit together, before any process starts (ValueError, one
    line naming the flags, the values and the fix). Single values were bounded by parse_config."""
    workers = f"0..{config.workers - 1}"
    for flag, value in (
        ("--slow-worker", config.slow_worker),
        ("--kill-worker", config.kill_worker),
    ):
        if value >= config.workers:
            raise ValueError(
                f"{flag} {value}: with --workers {config.workers} choose a worker in {workers}, "
                "or -1 for none"
            )
    if config.kill_worker >= 0 and not 0 <= config.kill_at < config.steps:
        raise ValueError(
            f"--kill-at {config.kill_at}: worker {config.kill_worker} can only be killed in a "
            f"clock it runs: choose one in 0..{config.steps - 1} (--steps {config.steps})"
        )
    if config.restart_killed and config.kill_worker < 0:
        raise ValueError(
            "--restart-killed: no worker is killed; add --kill-worker ID --kill-at CLOCK"
        )
    shard = config.train_samples // config.workers
    if config.batch_size > shard:
        raise ValueError(
            f"--batch-size {config.batch_size}: each of the {config.workers} workers holds "
            f"{shard} of the {config.train_samples} training samples; choose a batch of at "
            f"most {max(shard, 1)} or raise --train-samples"
            if shard
            else f"--train-samples {config.train_samples}: fewer samples than the "
            f"{config.workers} workers; give each worker at least one (--train-samples "
            f"{config.workers * config.batch_size} or more)"
        )
    if not is_loopback(config.host) and not default_secret():
        raise ValueError(
            f"--host {config.host}: reachable from other machines, so every connection must "
            "authenticate: set DTFS_PS_SECRET in the environment (never a flag: ps(1) shows "
            "those), or bind 127.0.0.1"
        )


def summarize(config: PSConfig, result: RunResult, accuracy: float) -> list[str]:
    lines = []
    for worker in sorted(result.workers):
        for run in result.workers[worker]:
            slow = " (slow)" if worker == config.slow_worker else ""
            last = run.clocks[-1] if run.clocks else "-"
            loss = run.losses[-1] if run.losses else float("nan")
            lines.append(
                f"worker {worker}{slow}: clocks {run.join_clock}..{last} "
                f"({len(run.clocks)} clocks), last loss {loss:.3f}"
            )
    for worker in result.killed:
        lines.append(f"worker {worker}: killed (SIGKILL)")
    for report in result.servers:
        hist = staleness_histogram(report.grants)
        shown = ", ".join(f"{gap}: {count}" for gap, count in hist.items())
        lines.append(
            f"server {report.server_id}: {report.optimizer_steps} optimizer steps; staleness "
            f"(pull clock - slowest live worker's clock) histogram {{{shown}}}"
        )
        lines += [
            f"  log: {event}" for event in report.events if "closed: peer closed" not in event
        ]
    samples = (
        sum(len(r.clocks) for runs in result.workers.values() for r in runs) * config.batch_size
    )
    lines.append(
        f"throughput: {samples / result.wall:.0f} samples/s "
        f"({samples} samples in {result.wall:.2f} s)"
    )
    lines.append(f"test accuracy: {accuracy:.3f} (chance {1 / PatternSpec().num_classes:.2f})")
    return lines


def run(config: PSConfig, *, verbose: bool = True) -> tuple[RunResult, float]:
    job = job_from_config(config)

    def announce(addresses: list[tuple[str, int]]) -> None:
        if not verbose:
            return
        for server, (host, port) in enumerate(addresses):
            print(f"server {server} listening on {host}:{port}", flush=True)

    result = train(
        job, time_limit=config.time_limit, restart_killed=config.restart_killed, on_servers=announce
    )
    model = job.model_fn()
    with torch.no_grad():
        for param, value in zip(model.parameters(), result.params, strict=True):
            param.copy_(value)
    return result, test_accuracy(model, config.test_samples)


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(PSConfig, argv, __doc__)
    try:
        validate(config)  # before any process starts
        job_from_config(config)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        result, accuracy = run(config)
    except ClusterError as err:
        failure = err.failure
        if failure is not None and failure.exc_type == "NotImplementedError":  # a learner's TODO
            todo, _, rest = failure.message.partition(":")
            print(f"{todo} not written:{rest}\n  at {failure.where}", file=sys.stderr)
            return 1
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(
        f"mode {config.mode}" + (f", staleness {config.staleness}" if config.mode == "ssp" else "")
    )
    for line in summarize(config, result, accuracy):
        print(line)
    return 0


if __name__ == "__main__":
    run_main(main)
