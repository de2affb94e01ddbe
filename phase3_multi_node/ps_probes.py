"""Unwelcome clients for probing a parameter server (exercise 3.7): idle sockets and slow drips.

A server that reads with a timeout per ``recv`` can be held by a client that sends one byte
every half second ("slowloris"), and a server that counts every accepted socket against one limit
can be filled with sockets that never send a byte. :class:`Flood` opens such clients against an
address from one background thread and records, for every socket, when it was opened and when
the server closed it, so a test or a measurement can check that the server sheds them within its
deadlines while a real worker goes on::

    with Flood(address, idle=64, drips=4) as flood:
        ...                      # run a worker against the same server
    flood.report()               # opened, closed by the server, longest held, still open

``reopen=True`` keeps the numbers up: a socket the server closed is replaced at once (a sustained
flood). Loopback only by intent: point it at your own server. As a program (no torch imported,
so it starts in a blink and takes no CPU from what it measures), it floods for a while and prints
its report as one JSON line::

    uv run python -m phase3_multi_node.ps_probes 127.0.0.1 PORT --idle 64 --drips 16 \
        --seconds 8 --reopen
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

POLL = 0.02  # seconds between checks of the sockets


@dataclass
class _Probe:
    sock: socket.socket
    drip: bool
    opened: float
    next_byte: float
    closed: float | None = None


@dataclass
class FloodReport:
    """What happened to a flood's sockets (times in seconds)."""

    opened: int  # sockets opened in all
    closed_by_server: int  # sockets the server closed (EOF or reset seen)
    still_open: int  # sockets open when the flood stopped
    longest_held: float  # the longest any socket stayed open (closed ones, and open ones so far)
    drip_bytes: int  # bytes the slow clients got to send
    refused_connects: int  # connects that failed outright
    lifetimes: list[float] = field(default_factory=list)  # of the sockets the server closed


class Flood:
    """``idle`` sockets that never send, ``drips`` that send one byte every ``interval`` s."""

    def __init__(
        self,
        address: tuple[str, int],
        *,
        idle: int = 0,
        drips: int = 0,
        interval: float = 0.5,
        reopen: bool = False,
    ) -> None:
        self.address = address
        self.idle = idle
        self.drips = drips
        self.interval = interval
        self.reopen = reopen
        self._probes: list[_Probe] = []
        self._closed: list[_Probe] = []
        self._refused = 0
        self._drip_bytes = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True, name="flood")

    def __enter__(self) -> Flood:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Open every socket now (before returning), then tend them in the background."""
        for _ in range(self.idle):
            self._open(drip=False)
        for _ in range(self.drips):
            self._open(drip=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop tending and close every socket still open."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        with self._lock:
            for probe in self._probes:
                probe.sock.close()

    def open_count(self) -> int:
        with self._lock:
            return len(self._probes)

    def report(self) -> FloodReport:
        now = time.monotonic()
        with self._lock:
            lifetimes = [p.closed - p.opened for p in self._closed if p.closed is not None]
            ages = [now - p.opened for p in self._probes]
            return FloodReport(
                opened=len(self._closed) + len(self._probes),
                closed_by_server=len(self._closed),
                still_open=len(self._probes),
                longest_held=max(lifetimes + ages, default=0.0),
                drip_bytes=self._drip_bytes,
                refused_connects=self._refused,
                lifetimes=lifetimes,
            )

    def _open(self, drip: bool) -> None:
        try:
            sock = socket.create_connection(self.address, timeout=2.0)
        except OSError:
            with self._lock:
                self._refused += 1
            return
        sock.setblocking(False)
        now = time.monotonic()
        with self._lock:
            self._probes.append(_Probe(sock, drip, now, now + self.interval))

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        while not self._stop.is_set():
            with self._lock:
                probes = list(self._probes)
            for probe in probes:
                selector.register(probe.sock, selectors.EVENT_READ, probe)
            ready = selector.select(timeout=POLL)
            for probe in probes:
                selector.unregister(probe.sock)
            now = time.monotonic()
            gone = [key.data for key, _ in ready if self._server_closed(key.data.sock)]
            for probe in probes:
                if probe.drip and probe not in gone and now >= probe.next_byte:
                    try:
                        probe.sock.send(b"P")  # the first byte of a header, forever unfinished
                        with self._lock:
                            self._drip_bytes += 1
                    except OSError:
                        gone.append(probe)
                    probe.next_byte = now + self.interval
            for probe in gone:
                probe.closed = now
                probe.sock.close()
                with self._lock:
                    self._probes.remove(probe)
                    self._closed.append(probe)
                if self.reopen and not self._stop.is_set():
                    self._open(drip=probe.drip)
        selector.close()

    @staticmethod
    def _server_closed(sock: socket.socket) -> bool:
        """A readable probe: the server closed it (EOF or reset), or sent something (ignored)."""
        try:
            return sock.recv(4096) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True


def _number(kind: type, minimum: float, fix: str) -> Callable[[str], Any]:
    """An argparse type: a finite number of ``kind`` of at least ``minimum``, else one line."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number ({fix})") from None
        if not math.isfinite(value) or value < minimum:
            raise argparse.ArgumentTypeError(
                f"{text}: must be a finite number >= {minimum:g} ({fix})"
            )
        return value

    return parse


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Flood a parameter server with idle or slow "
        "clients; print what happened to them as one JSON line."
    )
    parser.add_argument("host")
    parser.add_argument("port", type=_number(int, 1, "the server's port"))
    parser.add_argument("--idle", type=_number(int, 0, "a count, e.g. 64"), default=0)
    parser.add_argument("--drips", type=_number(int, 0, "a count, e.g. 16"), default=0)
    parser.add_argument(
        "--interval", type=_number(float, 0.001, "seconds between a drip's bytes"), default=0.5
    )
    parser.add_argument("--seconds", type=_number(float, 0, "how long to flood"), default=8.0)
    parser.add_argument("--reopen", action="store_true", help="replace every closed socket")
    args = parser.parse_args(argv)
    flood = Flood(
        (args.host, args.port),
        idle=args.idle,
        drips=args.drips,
        interval=args.interval,
        reopen=args.reopen,
    )
    with flood:
        print(json.dumps({"ready": flood.open_count()}), flush=True)
        time.sleep(args.seconds)
        report = flood.report()
    print(json.dumps(dataclasses.asdict(report)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
