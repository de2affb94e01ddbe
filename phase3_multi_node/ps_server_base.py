"""The machinery of a parameter server (exercise 3.7), given: connections, deadlines, checks,
bookkeeping. Exercise 3.7's ``ParameterServer`` subclasses :class:`ServerBase` and writes only
the consistency model: when a pull is served, what a push does, when a clock is applied.

One thread accepts connections; each connection gets a thread that runs :meth:`ServerBase._serve`:

1. **Handshake**, within ``handshake_timeout`` of the accept, for the whole of it: with a shared
   secret, CHALLENGE and the client's AUTH (HMAC-SHA256 of the nonce); then HELLO (worker id),
   answered with WELCOME (the clock to start at).
2. **Frames**, one at a time: a worker may be silent up to ``read_timeout`` between frames (it
   is computing), but once a frame's first byte arrived the whole frame must arrive within
   ``frame_timeout``. Every header is checked by the exercise's ``check_header`` before its
   payload is read; a PUSH's key, dtype and shape are checked against the parameter, its values
   must be finite, and every frame's clock must be the one the worker is at. Only then are the
   exercise methods called, with ``self.lock`` held.

Slow and idle clients cannot lock workers out. The deadlines are for whole frames and for the
whole handshake, not per ``recv`` (a timeout per ``recv`` is reset by every byte, so a client
sending one byte every half second would hold its thread forever). Connections still in their
handshake are counted apart from the workers' (at most ``max_unauthenticated``); when a new one
arrives over the limit, the *oldest* is closed to make room, so a flood of idle sockets delays
a worker's connect by one handshake at most, instead of refusing it. A worker id is connected
at most once, so the established connections are at most ``num_workers``. What happens to such
clients is counted in :attr:`ServerReport.counts` and logged (the first few of each kind).

A parameter server must outlive its workers: a worker whose connection drops leaves
``self.live`` at once (and, in ssp, ``self.members``, so the others go on); a sync clock waits
``sync_timeout`` seconds after it began waiting, then re-forms with the workers that pushed and
says so in the log (the watchdog thread). A restarted worker says HELLO again and is told the
clock to join at (:meth:`ServerBase.join_clock`).
"""

from __future__ import annotations

import abc
import contextlib
import logging
import math
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

from phase3_multi_node.ps_wire import (
    DIGEST_SIZE,
    NONCE_SIZE,
    Header,
    HeaderCheck,
    MsgType,
    PeerClosed,
    ProtocolError,
    deadline_in,
    digest_ok,
    encode_control,
    encode_tensor,
    is_loopback,
    payload_tensor,
    read_frame,
    read_header,
    read_payload,
    send_frames,
    wait_for_data,
)

MODES = ("sync", "async", "ssp")
LOG = logging.getLogger("dtfs.parameter_server")
LOGGED_PER_KIND = 10  # log lines per kind of dropped unauthenticated client; all are counted


@dataclass(frozen=True)
class ServerConfig:
    """How a server trains and whom it talks to. Checked by :func:`check_server_config`."""

    mode: str = "sync"
    staleness: int = 0  # ssp only: how many clocks the fastest may run ahead of the slowest
    num_workers: int = 1
    lr: float = 0.05
    momentum: float = 0.0
    host: str = "127.0.0.1"
    port: int = 0  # 0: the OS picks a free port (read it from ServerBase.address)
    secret: bytes | None = None  # required for a non-loopback host
    sync_timeout: float = 5.0  # sync: seconds a clock waits for missing pushes, then re-forms
    read_timeout: float = 30.0  # seconds a worker may stay silent between two frames
    frame_timeout: float = 10.0  # seconds for a whole frame once it began (and for a reply)
    handshake_timeout: float = 5.0  # seconds from accept to WELCOME (AUTH and HELLO included)
    max_unauthenticated: int = 16  # connections in their handshake; one more closes the oldest
    pull_timeout: float = 60.0  # seconds a held pull may wait before it is refused
    start_timeout: float = 30.0  # seconds to wait for all workers' first HELLO before serving


def check_server_config(config: ServerConfig) -> None:
    """Refuse bad settings before a socket exists, naming the value and the fix."""
    if config.mode not in MODES:
        raise ValueError(f"mode={config.mode!r}: choose one of {', '.join(MODES)}")
    if config.staleness < 0:
        raise ValueError(f"staleness={config.staleness}: must be >= 0 (0 is sync)")
    if config.num_workers < 1:
        raise ValueError(f"num_workers={config.num_workers}: need at least one worker")
    if not (math.isfinite(config.lr) and config.lr > 0):
        raise ValueError(f"lr={config.lr}: must be a positive finite learning rate, e.g. 0.05")
    if not (math.isfinite(config.momentum) and 0 <= config.momentum < 1):
        raise ValueError(f"momentum={config.momentum}: must be in [0, 1), e.g. 0.9")
    if not 0 <= config.port <= 65535:
        raise ValueError(f"port={config.port}: must be in 0..65535 (0: any free port)")
    if not is_loopback(config.host) and not config.secret:
        raise ValueError(
            f"host={config.host!r} is reachable from other machines: a non-loopback bind needs "
            "a shared secret (ServerConfig(secret=...); the launcher reads DTFS_PS_SECRET), so "
            "that every connection authenticates before a tensor is read"
        )
    for name in (
        "sync_timeout",
        "read_timeout",
        "frame_timeout",
        "handshake_timeout",
        "pull_timeout",
        "start_timeout",
    ):
        value = getattr(config, name)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name}={value}: must be a positive, finite number of seconds")
    if config.max_unauthenticated < 1:
        raise ValueError(
            f"max_unauthenticated={config.max_unauthenticated}: must be >= 1 (workers "
            "authenticate through these slots)"
        )


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
    # connections by outcome: "accepted", "welcomed", and for clients that never said HELLO:
    # "evicted" (closed to make room), "handshake timed out", "refused" (a bad frame or a wrong
    # HMAC), "left" (closed by the client)
    counts: dict[str, int] = field(default_factory=dict)


class ServerBase(abc.ABC):
    """Serves one shard of the parameters to workers over TCP; the consistency model is abstract.

    ``params`` maps each key this server holds to its initial value; ``check_header`` is the
    function that judges every header (exercise 3.7's ``ps_protocol.check_header``). ``start()``
    binds and serves on background threads and returns ``(host, port)``; ``stop()`` ends it.

    The state the subclass reads and writes, always with ``self.lock`` held: ``config``,
    ``params`` (key -> parameter), ``clock`` (clocks applied so far), ``completed`` (worker ->
    clocks it completed here), ``live`` (workers connected now), ``members`` (sync/ssp: the
    workers an open clock waits for), ``pending`` (sync/ssp: clock -> worker -> key ->
    gradient, for every clock not yet applied).
    """

    def __init__(
        self,
        server_id: int,
        params: dict[int, torch.Tensor],
        config: ServerConfig,
        check_header: HeaderCheck,
    ) -> None:
        check_server_config(config)
        self.server_id = server_id
        self.config = config
        self.check_header = check_header
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
        # --- the state the consistency model reads and writes (under self.lock) ---
        self.clock = 0  # sync/ssp: how many clocks were applied (averaged steps taken)
        self.completed: dict[int, int] = {}  # worker -> clocks it completed on this server
        self.live: set[int] = set()  # workers connected now
        self.members: set[int] = set()  # sync/ssp: the workers an open clock waits for
        self.pending: dict[int, dict[int, dict[int, torch.Tensor]]] = {}
        # --- bookkeeping of the given code ---
        self.pushed_keys: dict[int, set[int]] = {}  # worker -> keys pushed in its open clock
        self.joined_once: set[int] = set()
        self.report = ServerReport(server_id, 0, 0)
        self._waiting: tuple[int, float] | None = None  # (oldest open clock, since when)
        self._stopping = threading.Event()
        self._started_at = time.monotonic()
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._connections: set[socket.socket] = set()  # every open connection
        self._handshaking: dict[socket.socket, float] = {}  # not yet welcomed, oldest first
        self._evicted: set[socket.socket] = set()

    # ------------------------------------------------------------------ the consistency model

    @abc.abstractmethod
    def ready_to_serve(self, worker: int, clock: int) -> bool:
        """May ``worker``, about to compute ``clock``, pull the parameters now?"""

    @abc.abstractmethod
    def apply_push(self, worker: int, key: int, grad: torch.Tensor, clock: int) -> None:
        """A gradient of ``key`` from ``worker``'s ``clock`` arrived whole and checked."""

    @abc.abstractmethod
    def finish_clock(self, worker: int, clock: int) -> None:
        """``worker`` completed ``clock``, or a member left while ``clock`` was open."""

    @abc.abstractmethod
    def close_clock(self, pushers: Sequence[int]) -> None:
        """Apply the average of ``pushers``' gradients for the oldest open clock as one step."""

    # ------------------------------------------------------------------ helpers for it

    def clock_pushers(self) -> list[int]:
        """Sync/ssp: the workers that pushed every key of the oldest open clock (self.clock) and
        completed it, in worker order."""
        pushed = self.pending.get(self.clock, {})
        return sorted(w for w in pushed if self.completed.get(w, 0) > self.clock)

    def step_with(self, grads: dict[int, torch.Tensor]) -> None:
        """One optimizer step that moves only the keys in ``grads`` (key -> gradient)."""
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

    # ------------------------------------------------------------------ what it did

    def snapshot(self) -> dict[int, torch.Tensor]:
        """A copy of every parameter of this shard, by key."""
        with self.lock:
            return {key: p.detach().clone() for key, p in self.params.items()}

    def get_report(self) -> ServerReport:
        """A copy of the report (the lists keep growing while the server runs)."""
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
                    "counts": dict(self.report.counts),
                }
            )

    def log(self, message: str) -> None:
        """One line in the server's log (stderr) and in its report's events."""
        line = f"[server {self.server_id}] {message}"
        LOG.warning(line)
        with self.lock:
            self.report.events.append(line)

    def wait_until_idle(self, timeout: float) -> bool:
        """Wait until no worker is connected (every frame sent before a BYE or a close was
        handled); False if some worker is still connected after ``timeout`` seconds."""
        end = time.monotonic() + timeout
        with self.lock:
            while self.live and time.monotonic() < end:
                self.lock.wait(0.05)
            return not self.live

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
        listener.listen(128)
        listener.settimeout(0.1)
        self._listener = listener
        self._started_at = time.monotonic()
        for target in (self._accept_loop, self._watchdog):
            thread = threading.Thread(target=target, daemon=True, name=f"ps{self.server_id}")
            thread.start()
            self._threads.append(thread)
        return self.address

    def stop(self) -> None:
        """Stop accepting, close every connection, end the threads."""
        self._stopping.set()
        with self.lock:
            self.lock.notify_all()
            for conn in list(self._connections):
                _shut(conn)
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
            accepted = time.monotonic()
            with self.lock:
                self._count("accepted")
                self._connections.add(conn)
                self._handshaking[conn] = accepted
                if len(self._handshaking) > self.config.max_unauthenticated:
                    oldest = next(iter(self._handshaking))  # dicts keep insertion order
                    del self._handshaking[oldest]
                    self._evicted.add(oldest)
                    _shut(oldest)  # its thread reads EOF and ends
            thread = threading.Thread(target=self._serve, args=(conn, peer, accepted), daemon=True)
            thread.start()

    def _watchdog(self) -> None:
        """Sync: re-form a clock that waited longer than sync_timeout for missing pushes.

        A clock begins waiting when it is the oldest open clock and has a push (noticed here
        within 50 ms); the wait restarts whenever an older clock is applied.
        """
        while not self._stopping.wait(0.05):
            if self.config.mode != "sync":
                continue
            with self.lock:
                if not self.pending:
                    self._waiting = None
                    continue
                if self._waiting is None or self._waiting[0] != self.clock:
                    self._waiting = (self.clock, time.monotonic())
                    continue
                if time.monotonic() - self._waiting[1] < self.config.sync_timeout:
                    continue
                pushed = self.clock_pushers()
                if not pushed:
                    continue
                missing = sorted(self.members - set(pushed))
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

    def _serve(self, conn: socket.socket, peer: object, accepted: float) -> None:
        worker: int | None = None
        try:
            handshake_deadline = accepted + self.config.handshake_timeout
            if self.config.secret:
                self._authenticate(conn, handshake_deadline)
            worker = self._hello(conn, handshake_deadline)
            while not self._stopping.is_set():
                wait_for_data(conn, self.config.read_timeout)
                deadline = deadline_in(self.config.frame_timeout)
                header = read_header(conn, self.max_payload, self.check_header, deadline)
                if header.worker != worker:
                    raise ProtocolError(
                        f"frame says worker {header.worker} on worker {worker}'s connection"
                    )
                if header.type == MsgType.PULL:
                    self._serve_pull(conn, worker, header.clock)
                elif header.type == MsgType.PUSH:
                    self._receive_push(conn, worker, header, deadline)
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
        except ProtocolError as exc:  # PeerClosed included
            if worker is None:
                self._drop_unauthenticated(conn, peer, exc)
            elif isinstance(exc, PeerClosed):
                self.log(f"connection of worker {worker} closed: {exc}")
            else:
                self.log(f"closing the connection of worker {worker}: {exc}")
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
                self._handshaking.pop(conn, None)
                self._evicted.discard(conn)
                self.lock.notify_all()
            _shut(conn)
            conn.close()

    def _drop_unauthenticated(self, conn: socket.socket, peer: object, exc: Exception) -> None:
        """Count (and log the first few of each kind) a client that never said HELLO."""
        with self.lock:
            evicted = conn in self._evicted
        if evicted:
            kind = "evicted"
            reason = (
                f"{self.config.max_unauthenticated} newer connections were still in their "
                "handshake; closed the oldest to make room"
            )
        elif "timed out" in str(exc):
            kind = "handshake timed out"
            reason = f"no complete handshake within {self.config.handshake_timeout:g} s ({exc})"
        elif isinstance(exc, PeerClosed):
            kind, reason = "left", str(exc)
        else:
            kind, reason = "refused", str(exc)
        seen = self._count(kind)
        if seen <= LOGGED_PER_KIND:
            more = " (further ones are only counted)" if seen == LOGGED_PER_KIND else ""
            self.log(f"closing the connection of client {peer}: {reason}{more}")

    def _count(self, kind: str) -> int:
        with self.lock:
            self.report.counts[kind] = self.report.counts.get(kind, 0) + 1
            return self.report.counts[kind]

    def _record_error(self, exc: BaseException) -> None:
        last = traceback.extract_tb(exc.__traceback__)[-1]
        where = f"{last.filename}:{last.lineno} in {last.name}"
        with self.lock:
            self.report.errors.append((type(exc).__name__, str(exc), where))

    def _authenticate(self, conn: socket.socket, deadline: float) -> None:
        """HMAC challenge: nothing but one AUTH frame of DIGEST_SIZE bytes is read before it."""
        assert self.config.secret
        nonce = secrets.token_bytes(NONCE_SIZE)
        send_frames(conn, encode_control(MsgType.CHALLENGE, payload=nonce), deadline)
        header = read_header(conn, 0, self.check_header, deadline)
        if header.type != MsgType.AUTH:
            raise ProtocolError(f"expected AUTH first, got message type {header.type}")
        answer = read_payload(conn, header, deadline)
        if len(answer) != DIGEST_SIZE or not digest_ok(self.config.secret, nonce, answer):
            raise ProtocolError("authentication failed: wrong HMAC of the challenge")

    def _hello(self, conn: socket.socket, deadline: float) -> int:
        header, _ = read_frame(conn, 0, self.check_header, deadline)
        if header.type != MsgType.HELLO:
            raise ProtocolError(f"expected HELLO, got message type {header.type}")
        worker = header.worker
        if not 0 <= worker < self.config.num_workers:
            raise ProtocolError(f"worker id {worker} outside 0..{self.config.num_workers - 1}")
        with self.lock:
            if conn in self._evicted:
                raise PeerClosed("closed to make room for newer connections")
            # its old connection may still be closing
            wait_until = min(deadline, time.monotonic() + 1.0)
            while worker in self.live and time.monotonic() < wait_until:
                self.lock.wait(0.05)
            if worker in self.live:
                raise ProtocolError(f"worker {worker} is already connected")
            self._handshaking.pop(conn, None)
            start = self.join_clock(worker)
            rejoin = worker in self.joined_once
            self.completed[worker] = start
            self.live.add(worker)
            self.joined_once.add(worker)
            self.pushed_keys[worker] = set()
            if self.config.mode != "async":
                self.members.add(worker)
            self.report.counts["welcomed"] = self.report.counts.get("welcomed", 0) + 1
            self.lock.notify_all()
        if rejoin:
            self.log(f"worker {worker} rejoined at clock {start}")
        send_frames(conn, encode_control(MsgType.WELCOME, worker=worker, clock=start), deadline)
        return worker

    def _check_clock(self, worker: int, clock: int, what: str) -> None:
        expected = self.completed[worker]
        if clock != expected:
            hint = ""
            pushed = self.pushed_keys.get(worker, set())
            if what == "PULL" and clock == expected + 1 and pushed == set(self.params):
                hint = f"; it pushed every key of clock {expected} but sent no CLOCK frame for it"
            raise ProtocolError(
                f"worker {worker} sent {what} for clock {clock}, but it is at clock {expected} "
                f"(clocks go 0, 1, 2, ...: one PULL, the PUSHes and one CLOCK per clock){hint}"
            )

    def _serve_pull(self, conn: socket.socket, worker: int, clock: int) -> None:
        deadline = time.monotonic() + self.config.pull_timeout
        with self.lock:
            self._check_clock(worker, clock, "PULL")
            while not (self._everyone_arrived() and self.ready_to_serve(worker, clock)):
                if self._stopping.is_set():
                    raise PeerClosed("server stopping")
                if time.monotonic() > deadline:
                    raise ProtocolError(self._held_too_long(worker, clock))
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
        send_frames(conn, b"".join(frames), deadline_in(self.config.frame_timeout))

    def _held_too_long(self, worker: int, clock: int) -> str:
        """Why a pull was refused after pull_timeout: what the server saw, and what it means."""
        members = sorted(self.members)
        done = {m: self.completed.get(m, 0) for m in members}
        said = (
            f"pull of worker {worker} for clock {clock} held longer than "
            f"{self.config.pull_timeout:g} s: ready_to_serve stayed False with {self.clock} "
            f"clocks applied, clocks completed {done}, pending clocks {sorted(self.pending)}"
        )
        if not self._everyone_arrived():
            return said + f" (workers {sorted(self.joined_once)} of {self.config.num_workers} came)"
        if self.config.mode != "async" and clock <= self.clock:
            return said + (
                f"; every clock before {clock} was applied, so this pull must be served: look at "
                "ready_to_serve's comparison"
            )
        complete = all(done[m] > self.clock for m in members)
        if self.config.mode != "async" and complete and not self.pending:
            return said + (
                f"; every member completed clock {self.clock} but nothing is pending: sync and "
                "ssp keep each push in self.pending until finish_clock applies its clock"
            )
        if self.config.mode != "async" and complete:
            return said + (
                f"; every member completed clock {self.clock} but it was not applied: "
                "finish_clock applies it (close_clock moves self.clock on)"
            )
        return said

    def _everyone_arrived(self) -> bool:
        """Serve no pull before every worker said HELLO once (or start_timeout passed)."""
        waited = time.monotonic() - self._started_at
        return (
            len(self.joined_once) >= self.config.num_workers or waited > self.config.start_timeout
        )

    def _receive_push(
        self, conn: socket.socket, worker: int, header: Header, deadline: float
    ) -> None:
        """Check key, dtype and shape from the header, then read the whole payload, then apply."""
        param = self.params.get(header.key)
        if param is None:
            raise ProtocolError(f"unknown key {header.key}: this server holds {list(self.params)}")
        if header.dtype != param.dtype or header.shape != tuple(param.shape):
            raise ProtocolError(
                f"key {header.key} is {param.dtype} {list(param.shape)}, the frame says "
                f"{header.dtype} {list(header.shape)}"
            )
        grad = payload_tensor(header, read_payload(conn, header, deadline))
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


def _shut(conn: socket.socket) -> None:
    """Shut a socket down both ways (wakes a thread blocked on it); never raises."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)


def shard_of(model: nn.Module, assignment: Sequence[int], server: int) -> dict[int, torch.Tensor]:
    """The initial values of the keys ``server`` holds (``assignment[key]`` is its server)."""
    params = list(model.parameters())
    return {
        key: params[key].detach().clone() for key, owner in enumerate(assignment) if owner == server
    }


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
