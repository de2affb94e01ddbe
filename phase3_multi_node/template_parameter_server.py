# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase3.py
"""Exercise 3.7: a parameter server (Li et al., "Scaling Distributed Machine Learning with the
Parameter Server", OSDI 2014) with synchronous, asynchronous and bounded-staleness training.

Servers hold the parameters, each a shard of them (ps_sharding.py); workers hold data. One
*clock* of a worker is: pull every parameter from every server, compute a gradient on its own
batch, push the gradient back, then tell each server "clock c done". What a server does with the
pushes, and when it lets a worker pull, is the consistency model:

* ``sync``: the server buffers the W gradients of clock c and applies their average once, in
  worker order, as one optimizer step; nobody pulls clock c+1 before that. This is data-parallel
  SGD (exercise 1.2) with a server in the middle, so it equals it to rounding (float64: 1e-12).
* ``async``: every push is applied at once (scaled by 1/W, so a round of W pushes moves the
  parameters as far as one sync step); pulls are never held. Hogwild-style (Recht et al., 2011):
  no waiting, but gradients are computed on parameters other workers have since moved.
* ``ssp`` with staleness s (Ho et al., "More Effective Distributed ML via a Stale Synchronous
  Parallel Parameter Server", NIPS 2013): clocks are applied as in sync, one averaged step per
  clock in clock order, but a worker may start clock c as soon as clock c - s - 1 was applied,
  so the fastest never runs more than s clocks ahead of the slowest. s = 0 is sync, exactly.
  Ho et al.'s server may also show a reader updates newer than the bound (its own, say); this
  one shows exactly the applied clocks, so runs are reproducible and s = 0 equals sync.

A parameter server must outlive its workers (unlike a c10d group, where one dead rank fails every
collective): a worker whose connection drops leaves the live set at once, so async and ssp go
on without it; a sync clock waits ``sync_timeout`` seconds for missing pushes, then re-forms with
the workers that pushed, and says so in the log. A restarted worker says HELLO again, is told
the clock to join at, pulls the current parameters and goes on.

What is given here: sockets, threads, authentication, the framing (ps_protocol.py), the checks
every frame goes through before it reaches the exercise code, and the bookkeeping of worker
clocks. What you write: when a pull may be served (``ready_to_serve``), what a push does
(``apply_push``), applying a clock (``finish_clock``, ``close_clock``), and the worker's
``pull`` and ``push``. Every method of ParameterServer named below runs with ``self.lock`` held.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import socket
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from phase3_multi_node.template_ps_protocol import (
    DIGEST_SIZE,
    NONCE_SIZE,
    Header,
    MsgType,
    PeerClosed,
    ProtocolError,
    auth_digest,
    encode_control,
    encode_tensor,
    expect,
    is_loopback,
    payload_tensor,
    read_frame,
    read_header,
    read_payload,
)
from phase3_multi_node.template_ps_sharding import keys_of

MODES = ("sync", "async", "ssp")
LOG = logging.getLogger("dtfs.parameter_server")


@dataclass(frozen=True)
class ServerConfig:
    """How a server trains and whom it talks to. Checked by :func:`check_server_config`."""

    mode: str = "sync"
    staleness: int = 0  # ssp only: how many clocks the fastest may run ahead of the slowest
    num_workers: int = 1
    lr: float = 0.05
    momentum: float = 0.0
    host: str = "127.0.0.1"
    port: int = 0  # 0: the OS picks a free port (read it from ParameterServer.address)
    secret: bytes | None = None  # required for a non-loopback host
    sync_timeout: float = 5.0  # sync: seconds a clock waits for missing pushes, then re-forms
    read_timeout: float = 30.0  # seconds of silence from a client before its connection closes
    pull_timeout: float = 60.0  # seconds a held pull may wait before it is refused
    start_timeout: float = 30.0  # seconds to wait for all workers' first HELLO before serving
    max_connections: int = 64


def check_server_config(config: ServerConfig) -> None:
    """Refuse bad settings before a socket exists, naming the value and the fix."""
    if config.mode not in MODES:
        raise ValueError(f"mode={config.mode!r}: choose one of {', '.join(MODES)}")
    if config.staleness < 0:
        raise ValueError(f"staleness={config.staleness}: must be >= 0 (0 is sync)")
    if config.num_workers < 1:
        raise ValueError(f"num_workers={config.num_workers}: need at least one worker")
    if not is_loopback(config.host) and not config.secret:
        raise ValueError(
            f"host={config.host!r} is reachable from other machines: a non-loopback bind needs "
            "a shared secret (ServerConfig(secret=...); the launcher reads DTFS_PS_SECRET), so "
            "that every connection authenticates before a tensor is read"
        )
    for name in ("sync_timeout", "read_timeout", "pull_timeout", "start_timeout"):
        if getattr(config, name) <= 0:
            raise ValueError(f"{name}={getattr(config, name)}: must be a positive number of s")


@dataclass(frozen=True)
class Grant:
    """A pull the server served: when, to whom, for which clock, and the live workers' clocks."""

    time: float
    worker: int
    clock: int
    slowest: int  # fewest clocks completed by a live worker at that moment
    fastest: int


@dataclass
class ServerReport:
    """What a server did: the tests and the launcher read it (never sent over the network)."""

    server_id: int
    clock: int
    optimizer_steps: int
    grants: list[Grant] = field(default_factory=list)
    clocks_done: list[tuple[float, int, int]] = field(default_factory=list)  # (t, worker, clock)
    events: list[str] = field(default_factory=list)
    errors: list[tuple[str, str, str]] = field(default_factory=list)  # (type, message, where)


class ParameterServer:
    """Serves one shard of the parameters to workers over TCP; applies their gradients.

    ``params`` maps each key this server holds to its initial value. ``start()`` binds and
    serves on background threads; ``address`` is then ``(host, port)``; ``stop()`` ends it.
    """

    def __init__(
        self, server_id: int, params: dict[int, torch.Tensor], config: ServerConfig
    ) -> None:
        check_server_config(config)
        self.server_id = server_id
        self.config = config
        self.params = {
            key: nn.Parameter(value.detach().clone(), requires_grad=False)
            for key, value in sorted(params.items())
        }
        self.optimizer = torch.optim.SGD(
            list(self.params.values()), lr=config.lr, momentum=config.momentum
        )
        self.optimizer_steps = 0
        self.optimizer.register_step_post_hook(self._count_step)
        self.max_payload = max(
            (p.numel() * p.element_size() for p in self.params.values()), default=0
        )
        self.lock = threading.Condition()
        # --- the state the exercise methods read and write (under self.lock) ---
        self.clock = 0  # sync: how many clocks were closed (averaged steps applied)
        self.completed: dict[int, int] = {}  # worker -> clocks it completed on this server
        self.live: set[int] = set()  # workers connected now
        self.members: set[int] = set()  # sync/ssp: the workers an open clock waits for
        # sync/ssp: clock -> worker -> key -> gradient, for every clock not yet applied
        self.pending: dict[int, dict[int, dict[int, torch.Tensor]]] = {}
        self.pending_since: float | None = None  # when the oldest open clock got its first push
        # --- bookkeeping of the given code ---
        self.pushed_keys: dict[int, set[int]] = {}  # worker -> keys pushed in its open clock
        self.joined_once: set[int] = set()
        self.report = ServerReport(server_id, 0, 0)
        self._stopping = threading.Event()
        self._started_at = time.monotonic()
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._connections: set[socket.socket] = set()

    # ------------------------------------------------------------------ the exercise

    def clock_pushers(self) -> list[int]:
        """Sync/ssp: the workers that pushed every key of the oldest open clock (self.clock) and
        closed it, in worker order."""
        pushed = self.pending.get(self.clock, {})
        return sorted(w for w in pushed if self.completed.get(w, 0) > self.clock)

    def ready_to_serve(self, worker: int, clock: int) -> bool:
        """May ``worker``, about to compute ``clock``, pull the parameters now?"""
        # TODO 3.7: decide when a pull for `clock` may be served, per mode.
        # Invariant: self.clock counts the clocks applied so far. sync serves clock c only
        #   after clock c-1 was applied; ssp with staleness s once clock c-s-1 was applied
        #   (s = 0 is sync); async always.
        # Hint 1: a worker about to compute clock c needs the updates of every clock before
        #   c - s; clocks are applied in order, so one comparison with self.clock decides.
        # More hints: uv run python -m tests.hint 3.7
        # See guidelines.md#37-parameter-server
        raise NotImplementedError(
            "TODO 3.7: decide when a pull for `clock` may be served, per mode "
            "(see phase3_multi_node/guidelines.md#37-parameter-server)"
        )

    def apply_push(self, worker: int, key: int, grad: torch.Tensor, clock: int) -> None:
        """A gradient of ``key`` from ``worker``'s ``clock`` arrived whole and checked."""
        # TODO 3.7: apply a push now (async) or keep it for its clock (sync, ssp).
        # Invariant: async takes one optimizer step on this key with grad / num_workers. sync
        #   and ssp change no parameter here: they store the gradient under
        #   self.pending[clock][worker][key], and refuse (ProtocolError) a push for a clock
        #   that was already applied (clock < self.clock).
        # Hint 1: self.step_with({key: tensor}) runs the optimizer on just those keys.
        # More hints: uv run python -m tests.hint 3.7
        # See guidelines.md#37-parameter-server
        raise NotImplementedError(
            "TODO 3.7: apply a push now (async) or keep it for its clock (sync, ssp) "
            "(see phase3_multi_node/guidelines.md#37-parameter-server)"
        )

    def finish_clock(self, worker: int, clock: int) -> None:
        """``worker`` completed ``clock`` (self.completed is already updated), or a member left
        (BYE, or died in ssp) while clock ``clock`` was open."""
        # TODO 3.7: apply every open clock that every member has completed, oldest first.
        # Invariant: clocks are applied in order, each exactly once, as soon as every worker
        #   in self.members completed it (self.completed[m] > that clock), with the gradients
        #   of every worker that completed it (self.clock_pushers(): a member that said BYE
        #   after pushing counts). async does nothing here.
        # Hint 1: the oldest open clock is self.clock; in ssp a later clock may already be
        #   complete when an older one closes, so keep going.
        # More hints: uv run python -m tests.hint 3.7
        # See guidelines.md#37-parameter-server
        raise NotImplementedError(
            "TODO 3.7: apply every open clock that every member has completed, oldest first "
            "(see phase3_multi_node/guidelines.md#37-parameter-server)"
        )

    def close_clock(self, pushers: Sequence[int]) -> None:
        """Apply the average of ``pushers``' gradients for the oldest open clock as one step."""
        # TODO 3.7: average the gradients of `pushers` for self.clock, step once, advance.
        # Invariant: one optimizer step per clock; the average is summed in worker order (the
        #   same bits every run) over `pushers` only; afterwards self.clock is one more, the
        #   clock's entry is gone from self.pending, and self.pending_since is None when no
        #   later clock has pushes (else the time its wait starts: now).
        # Hint 1: data-parallel SGD averages gradients; here the server does it.
        # More hints: uv run python -m tests.hint 3.7
        # See guidelines.md#37-parameter-server
        raise NotImplementedError(
            "TODO 3.7: average the gradients of `pushers` for self.clock, step once, advance "
            "(see phase3_multi_node/guidelines.md#37-parameter-server)"
        )

    # ------------------------------------------------------------------ given helpers

    def step_with(self, grads: dict[int, torch.Tensor]) -> None:
        """One optimizer step that moves only the keys in ``grads``."""
        for key, param in self.params.items():
            param.grad = grads[key].to(param.dtype) if key in grads else None
        self.optimizer.step()
        for param in self.params.values():
            param.grad = None

    def _count_step(self, *_: object) -> None:
        self.optimizer_steps += 1

    def join_clock(self, worker: int) -> int:
        """The clock a (re)joining worker starts at: the current parameters' clock."""
        if self.config.mode != "async":
            return self.clock  # the oldest clock not yet applied
        others = [self.completed[w] for w in self.live if w != worker]
        if others:
            return min(others)
        return self.completed.get(worker, 0)

    def snapshot(self) -> dict[int, torch.Tensor]:
        with self.lock:
            return {key: p.detach().clone() for key, p in self.params.items()}

    def get_report(self) -> ServerReport:
        with self.lock:
            self.report.clock = self.clock
            self.report.optimizer_steps = self.optimizer_steps
            return ServerReport(
                **{
                    **self.report.__dict__,
                    "grants": list(self.report.grants),
                    "clocks_done": list(self.report.clocks_done),
                    "events": list(self.report.events),
                    "errors": list(self.report.errors),
                }
            )

    def log(self, message: str) -> None:
        line = f"[server {self.server_id}] {message}"
        LOG.warning(line)
        with self.lock:
            self.report.events.append(line)

    # ------------------------------------------------------------------ lifecycle

    @property
    def address(self) -> tuple[str, int]:
        if self._listener is None:
            raise RuntimeError("the server is not started: call start() first")
        host, port = self._listener.getsockname()[:2]
        return host, port

    def start(self) -> tuple[str, int]:
        """Bind, listen, and serve on background threads; returns (host, port)."""
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.config.host, self.config.port))
        listener.listen(self.config.max_connections)
        listener.settimeout(0.1)
        self._listener = listener
        self._started_at = time.monotonic()
        for target in (self._accept_loop, self._watchdog):
            thread = threading.Thread(target=target, daemon=True, name=f"ps{self.server_id}")
            thread.start()
            self._threads.append(thread)
        return self.address

    def stop(self) -> None:
        self._stopping.set()
        with self.lock:
            self.lock.notify_all()
            for conn in list(self._connections):
                with _quiet():
                    conn.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(timeout=2.0)
        if self._listener is not None:
            self._listener.close()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                conn, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self.lock:
                crowded = len(self._connections) >= self.config.max_connections
                if not crowded:
                    self._connections.add(conn)
            if crowded:
                self.log(f"refused {peer}: {self.config.max_connections} connections already open")
                conn.close()
                continue
            thread = threading.Thread(target=self._serve, args=(conn, peer), daemon=True)
            thread.start()

    def _watchdog(self) -> None:
        """Sync: re-form a clock that waited longer than sync_timeout for missing pushes."""
        while not self._stopping.wait(0.05):
            if self.config.mode != "sync":
                continue
            with self.lock:
                since = self.pending_since
                if since is None or time.monotonic() - since < self.config.sync_timeout:
                    continue
                pushed = self.clock_pushers()
                missing = sorted(self.members - set(pushed))
                if not pushed:
                    continue
                self.members -= set(missing)
                if missing:
                    self.log(
                        f"clock {self.clock} re-formed with the survivors {pushed} after "
                        f"{self.config.sync_timeout:g} s: workers {missing} did not push"
                    )
                try:
                    self.close_clock(pushed)
                except Exception as exc:  # the exercise code: report, keep the thread alive
                    self._record_error(exc)
                self.lock.notify_all()

    # ------------------------------------------------------------------ one connection

    def _serve(self, conn: socket.socket, peer: object) -> None:
        conn.settimeout(self.config.read_timeout)
        worker: int | None = None
        try:
            if self.config.secret:
                self._authenticate(conn)
            worker = self._hello(conn)
            while not self._stopping.is_set():
                header = read_header(conn, self.max_payload)
                if header.worker != worker:
                    raise ProtocolError(
                        f"frame says worker {header.worker} on worker {worker}'s connection"
                    )
                if header.type == MsgType.PULL:
                    self._serve_pull(conn, worker, header.clock)
                elif header.type == MsgType.PUSH:
                    self._receive_push(conn, worker, header)
                elif header.type == MsgType.CLOCK:
                    self._receive_clock(worker, header.clock)
                elif header.type == MsgType.BYE:
                    with self.lock:
                        self.members.discard(worker)
                        self.finish_clock(worker, self.clock)  # it may have been the last
                        self.lock.notify_all()
                    return
                else:
                    raise ProtocolError(f"unexpected {MsgType(header.type).name} from a worker")
        except PeerClosed as exc:
            who = f"worker {worker}" if worker is not None else f"client {peer}"
            self.log(f"connection of {who} closed: {exc}")
        except ProtocolError as exc:
            who = f"worker {worker}" if worker is not None else f"client {peer}"
            self.log(f"closing the connection of {who}: {exc}")
        except Exception as exc:  # an error in the exercise code: keep serving the others
            self.log(f"internal error serving worker {worker}: {type(exc).__name__}: {exc}")
            self._record_error(exc)
        finally:
            with self.lock:
                if worker is not None:
                    self.live.discard(worker)
                    self.pushed_keys.pop(worker, None)
                    if self.config.mode == "ssp" and worker in self.members:
                        # ssp goes on without a dead worker; sync waits sync_timeout for it
                        self.members.discard(worker)
                        try:
                            self.finish_clock(worker, self.clock)
                        except Exception as exc:
                            self._record_error(exc)
                self._connections.discard(conn)
                self.lock.notify_all()
            with _quiet():
                conn.close()

    def _record_error(self, exc: BaseException) -> None:
        last = traceback.extract_tb(exc.__traceback__)[-1]
        where = f"{last.filename}:{last.lineno} in {last.name}"
        with self.lock:
            self.report.errors.append((type(exc).__name__, str(exc), where))

    def _authenticate(self, conn: socket.socket) -> None:
        """HMAC challenge: nothing but one AUTH frame of DIGEST_SIZE bytes is read before it."""
        assert self.config.secret
        nonce = secrets.token_bytes(NONCE_SIZE)
        conn.sendall(encode_control(MsgType.CHALLENGE, payload=nonce))
        header = read_header(conn, 0)
        if header.type != MsgType.AUTH:
            raise ProtocolError(f"expected AUTH first, got message type {header.type}")
        answer = read_payload(conn, header)
        if len(answer) != DIGEST_SIZE or not _digest_ok(self.config.secret, nonce, answer):
            raise ProtocolError("authentication failed: wrong HMAC of the challenge")

    def _hello(self, conn: socket.socket) -> int:
        header, _ = read_frame(conn, 0)
        if header.type != MsgType.HELLO:
            raise ProtocolError(f"expected HELLO, got message type {header.type}")
        worker = header.worker
        if not 0 <= worker < self.config.num_workers:
            raise ProtocolError(f"worker id {worker} outside 0..{self.config.num_workers - 1}")
        with self.lock:
            deadline = time.monotonic() + 1.0  # its old connection may still be closing
            while worker in self.live and time.monotonic() < deadline:
                self.lock.wait(0.05)
            if worker in self.live:
                raise ProtocolError(f"worker {worker} is already connected")
            start = self.join_clock(worker)
            rejoin = worker in self.joined_once
            self.completed[worker] = start
            self.live.add(worker)
            self.joined_once.add(worker)
            self.pushed_keys[worker] = set()
            if self.config.mode != "async":
                self.members.add(worker)
            self.lock.notify_all()
        if rejoin:
            self.log(f"worker {worker} rejoined at clock {start}")
        conn.sendall(encode_control(MsgType.WELCOME, worker=worker, clock=start))
        return worker

    def _check_clock(self, worker: int, clock: int, what: str) -> None:
        expected = self.completed[worker]
        if clock != expected:
            raise ProtocolError(
                f"worker {worker} sent {what} for clock {clock}, but it is at clock {expected} "
                "(clocks go 0, 1, 2, ...: one PULL, the PUSHes and one CLOCK per clock)"
            )

    def _serve_pull(self, conn: socket.socket, worker: int, clock: int) -> None:
        deadline = time.monotonic() + self.config.pull_timeout
        with self.lock:
            self._check_clock(worker, clock, "PULL")
            while not (self._everyone_arrived() and self.ready_to_serve(worker, clock)):
                if self._stopping.is_set():
                    raise PeerClosed("server stopping")
                if time.monotonic() > deadline:
                    raise ProtocolError(
                        f"pull of worker {worker} for clock {clock} held longer than "
                        f"{self.config.pull_timeout:g} s"
                    )
                self.lock.wait(0.1)
            clocks = [self.completed[w] for w in self.live]
            self.report.grants.append(
                Grant(time.monotonic(), worker, clock, min(clocks), max(clocks))
            )
            frames = [
                encode_tensor(MsgType.PARAM, p, key=key, worker=worker, clock=clock)
                for key, p in self.params.items()
            ]
        frames.append(encode_control(MsgType.END, worker=worker, clock=clock))
        conn.sendall(b"".join(frames))

    def _everyone_arrived(self) -> bool:
        """Serve no pull before every worker said HELLO once (or start_timeout passed)."""
        waited = time.monotonic() - self._started_at
        return (
            len(self.joined_once) >= self.config.num_workers or waited > self.config.start_timeout
        )

    def _receive_push(self, conn: socket.socket, worker: int, header: Header) -> None:
        """Check key, dtype and shape from the header, then read the whole payload, then apply."""
        param = self.params.get(header.key)
        if param is None:
            raise ProtocolError(f"unknown key {header.key}: this server holds {list(self.params)}")
        if header.dtype != param.dtype or header.shape != tuple(param.shape):
            raise ProtocolError(
                f"key {header.key} is {param.dtype} {list(param.shape)}, the frame says "
                f"{header.dtype} {list(header.shape)}"
            )
        grad = payload_tensor(header, read_payload(conn, header))
        if not bool(torch.isfinite(grad).all()):
            raise ProtocolError(f"gradient of key {header.key} has non-finite values")
        with self.lock:
            self._check_clock(worker, header.clock, "PUSH")
            if header.key in self.pushed_keys[worker]:
                raise ProtocolError(f"key {header.key} pushed twice in clock {header.clock}")
            self.apply_push(worker, header.key, grad, header.clock)
            self.pushed_keys[worker].add(header.key)
            self.lock.notify_all()

    def _receive_clock(self, worker: int, clock: int) -> None:
        with self.lock:
            self._check_clock(worker, clock, "CLOCK")
            missing = sorted(set(self.params) - self.pushed_keys[worker])
            if missing:
                raise ProtocolError(
                    f"worker {worker} closed clock {clock} without pushing {missing}"
                )
            self.pushed_keys[worker] = set()
            self.completed[worker] = clock + 1
            self.report.clocks_done.append((time.monotonic(), worker, clock))
            self.finish_clock(worker, clock)
            self.lock.notify_all()


def _digest_ok(secret: bytes, nonce: bytes, answer: bytes) -> bool:
    return hmac.compare_digest(auth_digest(secret, nonce), answer)


class _quiet:
    """``with _quiet():`` ignores OSError (closing a socket the peer already closed)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: object, tb: object) -> bool:
        return isinstance(exc, OSError)


class Worker:
    """Pulls the parameters, computes a gradient on its own data, pushes it: once per clock.

    ``addresses[s]`` is server s's (host, port); ``assignment[key]`` the server holding each
    parameter (ps_sharding.py). ``connect()`` returns the clock to start at (0, or the current
    clock for a restarted worker); then for each clock: ``pull``, ``compute``, ``push``.
    """

    def __init__(
        self,
        worker_id: int,
        model: nn.Module,
        addresses: Sequence[tuple[str, int]],
        assignment: Sequence[int],
        *,
        secret: bytes | None = None,
        timeout: float = 60.0,
    ) -> None:
        self.worker_id = worker_id
        self.model = model
        self.params = list(model.parameters())
        if len(assignment) != len(self.params):
            raise ValueError(
                f"the assignment covers {len(assignment)} keys, the model has "
                f"{len(self.params)} parameters"
            )
        self.addresses = list(addresses)
        self.assignment = list(assignment)
        self.keys = [keys_of(self.assignment, s) for s in range(len(self.addresses))]
        self.secret = secret
        self.timeout = timeout
        self.max_payload = max(p.numel() * p.element_size() for p in self.params)
        self.sockets: list[socket.socket] = []

    def connect(self, attempts: int = 200) -> int:
        """Connect to every server (authenticating when a secret is set); the clock to start.

        The servers must agree on the clock to join at; they can differ for a moment (one has
        closed a clock the other has not yet), so on disagreement leave cleanly and retry.
        """
        for _ in range(attempts):
            starts = [self._connect_one(host, port) for host, port in self.addresses]
            if len(set(starts)) == 1:
                return starts[0]
            self.close()
            time.sleep(0.02)
        raise ProtocolError(f"the servers never agreed on a clock to join at (last: {starts})")

    def _connect_one(self, host: str, port: int) -> int:
        sock = socket.create_connection((host, port), timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sockets.append(sock)
        if self.secret:
            _, nonce = expect(sock, MsgType.CHALLENGE, 0)
            sock.sendall(encode_control(MsgType.AUTH, payload=auth_digest(self.secret, nonce)))
        sock.sendall(encode_control(MsgType.HELLO, worker=self.worker_id))
        header, _ = read_frame(sock, 0)
        if header.type == MsgType.CHALLENGE:
            raise ProtocolError(f"server {host}:{port} requires a shared secret")
        if header.type != MsgType.WELCOME:
            raise ProtocolError(f"expected WELCOME from {host}:{port}, got {header.type}")
        return header.clock

    def send(self, server: int, frame: bytes) -> None:
        self.sockets[server].sendall(frame)

    def receive(self, server: int) -> tuple[Header, bytes]:
        """One checked frame from ``server`` (a server is checked like any peer)."""
        return read_frame(self.sockets[server], self.max_payload)

    def pull(self, clock: int) -> None:
        """Ask every server for its parameters for ``clock``; copy them into the model."""
        # TODO 3.7: pull the current parameters from every server into the model.
        # Invariant: afterwards every model parameter holds the bits its server sent for this
        #   clock; a server may hold the answer back (sync, ssp), so wait for it.
        # Hint 1: send a PULL frame (encode_control) to each server, then read its PARAM frames
        #   until END; the key of a frame says which parameter (self.params[key]).
        # More hints: uv run python -m tests.hint 3.7
        # See guidelines.md#37-parameter-server
        raise NotImplementedError(
            "TODO 3.7: pull the current parameters from every server into the model "
            "(see phase3_multi_node/guidelines.md#37-parameter-server)"
        )

    def compute(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Gradients of the mean cross-entropy on this worker's batch; returns the loss."""
        for param in self.params:
            param.grad = None
        loss = nn.functional.cross_entropy(self.model(inputs), targets)
        loss.backward()
        return float(loss.detach())

    def push(self, clock: int) -> None:
        """Send every gradient to the server holding it, then close the clock there."""
        # TODO 3.7: push this clock's gradients to their servers and close the clock.
        # Invariant: each server gets exactly one PUSH per key it holds, stamped with this
        #   clock and this worker, then one CLOCK frame for the same clock.
        # Hint 1: encode_tensor(MsgType.PUSH, grad, key=..., worker=..., clock=...) builds a
        #   frame; the server refuses a clock it does not expect.
        # More hints: uv run python -m tests.hint 3.7
        # See guidelines.md#37-parameter-server
        raise NotImplementedError(
            "TODO 3.7: push this clock's gradients to their servers and close the clock "
            "(see phase3_multi_node/guidelines.md#37-parameter-server)"
        )

    def close(self) -> None:
        """Leave cleanly (BYE), so a sync clock does not wait for this worker."""
        for sock in self.sockets:
            with _quiet():
                sock.sendall(encode_control(MsgType.BYE, worker=self.worker_id))
                sock.close()
        self.sockets = []


def _grad_of(param: torch.Tensor, key: int) -> torch.Tensor:
    """``param.grad``, or a clear error when backward did not reach it."""
    if param.grad is None:
        raise RuntimeError(f"parameter {key} has no gradient: the loss does not depend on it")
    return param.grad


def shard_of(model: nn.Module, assignment: Sequence[int], server: int) -> dict[int, torch.Tensor]:
    """The initial values of the keys ``server`` holds."""
    params = list(model.parameters())
    return {key: params[key].detach().clone() for key in keys_of(assignment, server)}


def staleness_histogram(grants: Sequence[Grant]) -> dict[int, int]:
    """How many pulls were served at each gap (clock - slowest live worker's clock)."""
    counts: dict[int, int] = {}
    for grant in grants:
        gap = grant.clock - grant.slowest
        counts[gap] = counts.get(gap, 0) + 1
    return dict(sorted(counts.items()))


def default_secret() -> bytes | None:
    """The shared secret from DTFS_PS_SECRET (never a command-line flag: ps(1) shows those)."""
    value = os.environ.get("DTFS_PS_SECRET")
    return value.encode() if value else None


if __name__ == "__main__":
    from course.cli import run_main
    from phase3_multi_node.ps_launcher import main

    run_main(main)
