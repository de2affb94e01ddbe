"""The parameter server under slow and idle clients (issue 19): a legitimate worker is served
throughout, and the unwelcome clients are closed within the server's deadlines.

These test the given machinery (phase3_multi_node/ps_server_base.py, ps_wire.py), so they run the
reference exercise code whatever ``--impl`` says; the server runs in this process (threads) with
short deadlines, the unwelcome clients come from phase3_multi_node/ps_probes.py. Every check is
on values and counts; the only times are generous deadlines (the server's own deadline plus
several seconds for a loaded machine).

* A client that trickles one byte every 0.2 s, before or after HELLO, is closed by the
  handshake deadline or the whole-frame deadline (a timeout per ``recv`` would never fire).
* 64 sockets that never send a byte do not lock a worker out: the server keeps at most
  ``max_unauthenticated`` of them, closes the oldest to make room and the rest at the
  handshake deadline, and the worker connects and trains meanwhile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from course.impl import load_impl
from phase3_multi_node import ps_wire
from phase3_multi_node.ps_probes import Flood
from phase3_multi_node.ps_server_base import ServerConfig

pytestmark = pytest.mark.harness

PS = load_impl("phase3_multi_node", "parameter_server", "solutions")
PROTOCOL = load_impl("phase3_multi_node", "ps_protocol", "solutions")
DEADLINE = 1.0  # the server's handshake and frame deadlines in these tests
SLACK = 4.0  # what a loaded 2-core machine may add to a deadline
LR = 0.1


def double_mlp() -> nn.Module:
    """A small float64 MLP with 4 parameters (keys 0-3), the same at every call."""
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(10, 24), nn.Tanh(), nn.Linear(24, 5)).double()


def shard_params() -> dict[int, torch.Tensor]:
    return {key: p.detach().clone() for key, p in enumerate(double_mlp().parameters())}


def double_batch(worker: int, num_workers: int, clock: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * clock + worker)
    return torch.randn(8, 10, generator=g, dtype=torch.float64), torch.randint(5, (8,), generator=g)


def plain_sgd(clocks: int) -> dict[int, torch.Tensor]:
    """What one worker's ``clocks`` sync clocks must produce: SGD on its batches, in one process."""
    model = double_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for clock in range(clocks):
        optimizer.zero_grad()
        inputs, targets = double_batch(0, 1, clock)
        nn.functional.cross_entropy(model(inputs), targets).backward()
        optimizer.step()
    return {key: p.detach().clone() for key, p in enumerate(model.parameters())}


@contextlib.contextmanager
def live_server(**options: Any) -> Iterator[Any]:
    settings: dict[str, Any] = {
        "mode": "sync",
        "num_workers": 1,
        "lr": LR,
        "read_timeout": 5.0,
        "frame_timeout": DEADLINE,
        "handshake_timeout": DEADLINE,
        "max_unauthenticated": 8,
        "pull_timeout": 10.0,
        "start_timeout": 10.0,
        **options,
    }
    server = PS.ParameterServer(0, shard_params(), ServerConfig(**settings))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def train_worker(server: Any, clocks: int, worker_id: int = 0) -> None:
    """A legitimate worker: connect, then ``clocks`` clocks of pull, compute, push."""
    model = double_mlp()
    worker = PS.Worker(worker_id, model, [server.address], [0] * 4, timeout=20.0)
    try:
        start = worker.connect()
    except ps_wire.ProtocolError as exc:
        pytest.fail(
            f"a legitimate worker could not connect: {type(exc).__name__}: {exc}; the "
            f"server's log: {server.get_report().events[-3:]}",
            pytrace=False,
        )
    assert start == 0
    for clock in range(clocks):
        worker.pull(clock)
        worker.compute(*double_batch(worker_id, server.config.num_workers, clock))
        worker.push(clock)
    worker.close()
    assert server.wait_until_idle(10.0), "the server still counts the worker as connected"


def assert_trained_like_sgd(server: Any, clocks: int) -> None:
    expected = plain_sgd(clocks)
    got = server.snapshot()
    diff = max(float((got[k] - expected[k]).abs().max()) for k in got)
    assert server.get_report().clock == clocks and diff <= 1e-12, (
        f"the worker's {clocks} clocks were not all applied as plain SGD: server clock "
        f"{server.get_report().clock}, largest difference {diff:.3g}"
    )


def wait_closed(flood: Flood, count: int, within: float) -> None:
    end = time.monotonic() + within
    while flood.report().closed_by_server < count and time.monotonic() < end:
        time.sleep(0.05)


def test_a_slow_drip_before_hello_is_closed_by_the_handshake_deadline() -> None:
    with live_server() as server:
        with Flood(server.address, drips=4, interval=0.2) as flood:
            train_worker(server, clocks=20)
            wait_closed(flood, 4, DEADLINE + SLACK)
            report = flood.report()
        assert_trained_like_sgd(server, 20)
        counts = server.get_report().counts
    assert report.closed_by_server == 4, (
        f"of 4 clients sending one byte every 0.2 s and never finishing a header, the server "
        f"closed {report.closed_by_server} within {DEADLINE + SLACK:g} s (handshake deadline "
        f"{DEADLINE:g} s); longest held {report.longest_held:.1f} s"
    )
    assert report.drip_bytes >= 4, "the slow clients never got a byte through: nothing tested"
    assert max(report.lifetimes) <= DEADLINE + SLACK
    assert counts.get("handshake timed out") == 4, counts


def test_a_slow_drip_after_hello_is_closed_by_the_frame_deadline() -> None:
    """A client that says HELLO (as worker 1) and then trickles a frame: the whole-frame
    deadline closes it; worker 0 trains meanwhile (async: it does not wait for worker 1)."""
    with live_server(mode="async", num_workers=2, read_timeout=30.0) as server:
        with socket.create_connection(server.address, timeout=5.0) as sock:
            sock.sendall(ps_wire.encode_control(ps_wire.MsgType.HELLO, worker=1))
            welcome, _ = ps_wire.read_frame(
                sock, 0, PROTOCOL.check_header, ps_wire.deadline_in(5.0)
            )
            assert welcome.type == ps_wire.MsgType.WELCOME
            frame = ps_wire.encode_control(ps_wire.MsgType.PULL, worker=1, clock=0)
            opened = time.monotonic()
            closed_after = None
            for byte in frame:
                try:
                    sock.sendall(bytes([byte]))
                    time.sleep(0.2)
                    sock.settimeout(0.001)
                    if sock.recv(1) == b"":
                        closed_after = time.monotonic() - opened
                        break
                except TimeoutError:
                    continue
                except OSError:
                    closed_after = time.monotonic() - opened
                    break
            train_worker(server, clocks=10, worker_id=0)
        events = server.get_report().events
    assert closed_after is not None and closed_after <= DEADLINE + SLACK, (
        f"a worker connection trickling one byte every 0.2 s was still open after "
        f"{time.monotonic() - opened:.1f} s (frame deadline {DEADLINE:g} s, read timeout 30 s): "
        "the deadline must cover the whole frame, not each recv"
    )
    assert any("worker 1" in e and "timed out" in e for e in events), events


def test_idle_sockets_do_not_lock_a_worker_out() -> None:
    with live_server(max_unauthenticated=8) as server:
        with Flood(server.address, idle=64) as flood:
            train_worker(server, clocks=20)
            wait_closed(flood, 64, DEADLINE + SLACK)
            report = flood.report()
        assert_trained_like_sgd(server, 20)
        counts = server.get_report().counts
    assert report.refused_connects == 0
    assert report.closed_by_server == 64, (
        f"of 64 sockets that never sent a byte, the server closed {report.closed_by_server} "
        f"within {DEADLINE + SLACK:g} s (handshake deadline {DEADLINE:g} s)"
    )
    assert max(report.lifetimes) <= DEADLINE + SLACK
    shed = counts.get("evicted", 0) + counts.get("handshake timed out", 0)
    assert shed == 64 and counts.get("welcomed") == 1, counts
    assert counts.get("evicted", 0) >= 64 - 8 - 1, (
        f"with at most 8 connections in their handshake, at least 55 of 64 idle sockets "
        f"should have been closed at once to make room: {counts}"
    )


def test_a_worker_connects_through_a_sustained_flood() -> None:
    """The idle sockets are replaced as soon as the server closes them: the worker still gets a
    handshake through (the newest connection is the last one closed to make room)."""
    with live_server(max_unauthenticated=8) as server:
        with Flood(server.address, idle=32, reopen=True) as flood:
            train_worker(server, clocks=10)
            report = flood.report()
        assert_trained_like_sgd(server, 10)
    assert report.opened > 32, "the flood never replaced a socket: nothing tested"
    assert report.longest_held <= DEADLINE + SLACK


def test_the_deadlines_are_checked() -> None:
    for name in ("handshake_timeout", "frame_timeout", "read_timeout"):
        for value in (0.0, -1.0, float("inf"), float("nan")):
            with pytest.raises(ValueError, match=name):
                settings: dict[str, Any] = {name: value}
                config = dataclasses.replace(ServerConfig(), **settings)
                PS.ParameterServer(0, shard_params(), config)
    with pytest.raises(ValueError, match="max_unauthenticated"):
        PS.ParameterServer(0, shard_params(), ServerConfig(max_unauthenticated=0))


def test_frames_are_read_within_one_deadline() -> None:
    """ps_wire.read_frame: bytes arriving one at a time inside the deadline are read; the same
    bytes past the deadline are refused, however often each single byte arrives."""
    left, right = socket.socketpair()
    with left, right:
        frame = ps_wire.encode_control(ps_wire.MsgType.CLOCK, worker=2, clock=7)
        left.sendall(frame)
        header, _ = ps_wire.read_frame(right, 0, PROTOCOL.check_header, ps_wire.deadline_in(1.0))
        assert (header.type, header.worker, header.clock) == (ps_wire.MsgType.CLOCK, 2, 7)
        left.sendall(frame[:10])
        with pytest.raises(ps_wire.ProtocolError, match="timed out"):
            ps_wire.read_frame(right, 0, PROTOCOL.check_header, ps_wire.deadline_in(0.2))
