"""The client side of the parameter server (exercise 3.7), given: connecting, framing, computing.

Exercise 3.7's ``Worker`` subclasses :class:`WorkerBase` and writes one clock's traffic, ``pull``
and ``push``, with what this class gives it:

* ``self.worker_id``; ``self.params``: the model's parameters, indexed by key (the position in
  ``model.parameters()``); ``self.keys[s]``: the keys server ``s`` holds, in key order;
* :meth:`WorkerBase.send` (bytes to server ``s``) and :meth:`WorkerBase.receive` (one whole frame
  from server ``s``, its header checked by the exercise's ``check_header`` like any peer's);
* :meth:`WorkerBase.gradient`: a parameter's gradient after :meth:`WorkerBase.compute`, or a clear
  error when backward did not reach it.

``connect()`` says HELLO to every server (answering the HMAC challenge when a shared secret is
set) and returns the clock to start at; ``close()`` says BYE, so a sync clock does not wait for
this worker. Every read has a deadline of ``timeout`` seconds for the whole frame: a held pull
(sync, ssp) counts against it, so it must exceed the servers' ``pull_timeout`` in practice.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Sequence

import torch
from torch import nn

from phase3_multi_node.ps_wire import (
    Header,
    HeaderCheck,
    MsgType,
    PeerClosed,
    ProtocolError,
    auth_digest,
    deadline_in,
    encode_control,
    expect,
    read_frame,
    send_frames,
)

HANDSHAKE_RETRIES = 5  # a server under a flood of idle connections may close ours to make room


class WorkerBase:
    """Pulls the parameters, computes a gradient on its own data, pushes it: once per clock.

    ``addresses[s]`` is server s's (host, port); ``assignment[key]`` the server holding each
    parameter (ps_sharding.py); ``check_header`` judges every frame a server sends.
    """

    def __init__(
        self,
        worker_id: int,
        model: nn.Module,
        addresses: Sequence[tuple[str, int]],
        assignment: Sequence[int],
        *,
        check_header: HeaderCheck,
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
        self.keys = [
            [key for key, owner in enumerate(self.assignment) if owner == server]
            for server in range(len(self.addresses))
        ]
        self.check_header = check_header
        self.secret = secret
        self.timeout = timeout
        self.max_payload = max(p.numel() * p.element_size() for p in self.params)
        self.sockets: list[socket.socket] = []

    def connect(self, attempts: int = 200) -> int:
        """Connect to every server (authenticating when a secret is set); the clock to start.

        The servers must agree on the clock to join at; they can differ for a moment (one has
        closed a clock the other has not yet), so on disagreement leave cleanly and retry.
        """
        starts: list[int] = []
        for _ in range(attempts):
            starts = [self._connect_one(host, port) for host, port in self.addresses]
            if len(set(starts)) == 1:
                return starts[0]
            self.close()
            time.sleep(0.02)
        raise ProtocolError(f"the servers never agreed on a clock to join at (last: {starts})")

    def _connect_one(self, host: str, port: int) -> int:
        """Handshake with one server; retried when the server closes it before WELCOME."""
        for attempt in range(HANDSHAKE_RETRIES):
            sock = socket.create_connection((host, port), timeout=self.timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                header = self._handshake(sock, host, port)
            except PeerClosed:
                sock.close()
                if attempt == HANDSHAKE_RETRIES - 1:
                    raise
                time.sleep(0.05 * (attempt + 1))
                continue
            self.sockets.append(sock)
            return header.clock
        raise AssertionError("unreachable")

    def _handshake(self, sock: socket.socket, host: str, port: int) -> Header:
        deadline = deadline_in(self.timeout)
        if self.secret:
            _, nonce = expect(sock, MsgType.CHALLENGE, 0, self.check_header, deadline)
            answer = encode_control(MsgType.AUTH, payload=auth_digest(self.secret, nonce))
            send_frames(sock, answer, deadline)
        send_frames(sock, encode_control(MsgType.HELLO, worker=self.worker_id), deadline)
        header, _ = read_frame(sock, 0, self.check_header, deadline)
        if header.type == MsgType.CHALLENGE:
            raise ProtocolError(f"server {host}:{port} requires a shared secret")
        if header.type != MsgType.WELCOME:
            raise ProtocolError(f"expected WELCOME from {host}:{port}, got {header.type}")
        return header

    def send(self, server: int, frame: bytes) -> None:
        """Send ``frame`` (one or more whole frames, joined) to server ``server``."""
        send_frames(self.sockets[server], frame, deadline_in(self.timeout))

    def receive(self, server: int) -> tuple[Header, bytes]:
        """One whole checked frame from server ``server``: (header, payload bytes)."""
        return read_frame(
            self.sockets[server], self.max_payload, self.check_header, deadline_in(self.timeout)
        )

    def compute(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Gradients of the mean cross-entropy on this worker's batch; returns the loss."""
        for param in self.params:
            param.grad = None
        loss = nn.functional.cross_entropy(self.model(inputs), targets)
        loss.backward()
        return float(loss.detach())

    def gradient(self, key: int) -> torch.Tensor:
        """The gradient of parameter ``key`` after :meth:`compute`, or a clear error."""
        grad = self.params[key].grad
        if grad is None:
            raise RuntimeError(f"parameter {key} has no gradient: the loss does not depend on it")
        return grad

    def close(self) -> None:
        """Leave cleanly (BYE), so a sync clock does not wait for this worker."""
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.sendall(encode_control(MsgType.BYE, worker=self.worker_id))
            sock.close()
        self.sockets = []
