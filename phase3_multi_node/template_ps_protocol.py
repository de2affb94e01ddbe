# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase3.py
"""Exercise 3.7, the parameter server's wire protocol: fixed-size frames over plain TCP.

Every message is one frame: a fixed 64-byte header, then ``length`` raw bytes::

    offset  size  field
    0       4     magic b"PSv1"
    4       1     message type (MsgType)
    5       1     dtype code (position in WIRE_DTYPES; 0 when there is no tensor)
    6       1     ndim (0..MAX_DIMS)
    7       1     reserved, 0
    8       4     key (uint32: the parameter's index in ``model.parameters()``)
    12      4     worker id (int32)
    16      8     clock (int64: the worker's clock the message belongs to)
    24      32    shape: MAX_DIMS int64 sizes, unused ones 0
    56      8     payload length in bytes (uint64)

all big-endian (``struct`` format ``!``). A tensor travels as its raw bytes, C order, so a
receiver rebuilds it with ``torch.frombuffer`` and never runs code from the network: no pickle
(``multiprocessing.connection`` unpickles what it receives, which is arbitrary code execution
for anyone who can connect), no ``torch.load`` of received bytes.

A server is network-facing, so it must assume any byte it reads was written by an attacker or a
bug. The rule that makes reading safe (exercise 3.7's protocol TODO, :func:`check_header`):
**decide from the header alone whether the frame is acceptable, before reading or allocating
its payload**. A length field is a number someone else wrote: allocating ``length`` bytes
because a header said so lets one 64-byte frame ask for 2^62 bytes. The payload is then read
in bounded chunks (:func:`recv_exact`) under a per-connection timeout, so a client that stops
sending mid-frame cannot hold a server thread forever.

Connecting with a shared secret: the server sends CHALLENGE with 32 random bytes, the client
answers AUTH with ``HMAC-SHA256(secret, nonce)``, compared with :func:`hmac.compare_digest`
(constant time, so the comparison's duration leaks nothing). Only then is any tensor read.
This is the scheme of ``multiprocessing.connection``'s ``authkey``, without its pickle.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import math
import socket
import struct
from dataclasses import dataclass

import torch

MAGIC = b"PSv1"
MAX_DIMS = 4
HEADER = struct.Struct("!4sBBBBIiq" + "q" * MAX_DIMS + "Q")
HEADER_SIZE = HEADER.size  # 64
NONCE_SIZE = 32
DIGEST_SIZE = 32  # sha256
WIRE_DTYPES: tuple[torch.dtype, ...] = (
    torch.uint8,  # code 0: raw bytes (nonces, digests) and "no tensor"
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
)
CHUNK = 1 << 20  # bytes read per recv: memory grows with what arrived, not with what was promised


class MsgType(enum.IntEnum):
    """What a frame means. Worker -> server unless marked."""

    HELLO = 1  # worker id; server answers WELCOME
    WELCOME = 2  # server -> worker: clock = the clock the worker (re)joins at
    PULL = 3  # clock = the clock the worker is about to compute; server answers PARAM... END
    PARAM = 4  # server -> worker: one parameter (key, dtype, shape, payload)
    END = 5  # server -> worker: the last PARAM of a pull was sent
    PUSH = 6  # one gradient for `key`, computed at `clock`
    CLOCK = 7  # the worker finished `clock`: every key of this server was pushed
    CHALLENGE = 8  # server -> client: NONCE_SIZE random bytes
    AUTH = 9  # client -> server: HMAC-SHA256(secret, nonce)
    BYE = 10  # worker leaves cleanly


TENSOR_TYPES = frozenset({MsgType.PARAM, MsgType.PUSH})
BYTES_TYPES = {MsgType.CHALLENGE: NONCE_SIZE, MsgType.AUTH: DIGEST_SIZE}


class ProtocolError(Exception):
    """The peer sent something this protocol does not allow; the message says what.

    A server answers it by closing the connection and logging the message, nothing else: no
    parameter is touched by a frame that was not accepted whole.
    """


class PeerClosed(ProtocolError):
    """The peer closed the connection (between frames: a clean end; inside one: truncated)."""


@dataclass(frozen=True)
class Header:
    """One decoded frame header; nothing in it is trusted until :func:`check_header` says so."""

    magic: bytes
    type: int
    dtype_code: int
    ndim: int
    reserved: int
    key: int
    worker: int
    clock: int
    dims: tuple[int, ...]  # always MAX_DIMS values
    length: int

    @property
    def shape(self) -> tuple[int, ...]:
        return self.dims[: self.ndim]

    @property
    def dtype(self) -> torch.dtype:
        return WIRE_DTYPES[self.dtype_code]


def dtype_code(dtype: torch.dtype) -> int:
    if dtype not in WIRE_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in WIRE_DTYPES)
        raise ValueError(f"cannot send {dtype}: the protocol knows {names}")
    return WIRE_DTYPES.index(dtype)


def pack_header(
    msg_type: MsgType,
    *,
    key: int = 0,
    worker: int = 0,
    clock: int = 0,
    dtype: torch.dtype = torch.uint8,
    shape: tuple[int, ...] = (),
    length: int = 0,
) -> bytes:
    """The 64 header bytes (no checks: tests use it to forge bad frames on purpose)."""
    dims = tuple(shape) + (0,) * (MAX_DIMS - len(shape))
    return HEADER.pack(
        MAGIC, int(msg_type), dtype_code(dtype), len(shape), 0, key, worker, clock, *dims, length
    )


def unpack_header(raw: bytes) -> Header:
    magic, kind, code, ndim, reserved, key, worker, clock, *rest = HEADER.unpack(raw)
    dims, length = tuple(rest[:MAX_DIMS]), rest[MAX_DIMS]
    return Header(magic, kind, code, ndim, reserved, key, worker, clock, dims, length)


def encode_tensor(
    msg_type: MsgType, tensor: torch.Tensor, *, key: int, worker: int = 0, clock: int = 0
) -> bytes:
    """A whole frame carrying ``tensor``: header + its bytes (C order, native little-endian)."""
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"tensor of shape {tuple(tensor.shape)}: at most {MAX_DIMS} dims")
    data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    head = pack_header(
        msg_type,
        key=key,
        worker=worker,
        clock=clock,
        dtype=tensor.dtype,
        shape=tuple(tensor.shape),
        length=len(data),
    )
    return head + data


def encode_control(
    msg_type: MsgType, *, key: int = 0, worker: int = 0, clock: int = 0, payload: bytes = b""
) -> bytes:
    """A frame without a tensor (HELLO, PULL, CLOCK, ...), or with raw bytes (CHALLENGE, AUTH)."""
    shape = (len(payload),) if payload else ()
    head = pack_header(
        msg_type, key=key, worker=worker, clock=clock, shape=shape, length=len(payload)
    )
    return head + payload


def check_header(header: Header, max_payload: int) -> None:
    """Raise ProtocolError unless ``header`` describes a frame this protocol allows.

    Decided from the 64 header bytes alone, before any payload byte is read or allocated. A
    tensor frame's length must be exactly what its dtype and shape imply, and at most
    ``max_payload`` (the largest tensor the reader expects); a CHALLENGE/AUTH carries exactly
    its fixed number of bytes; every other frame carries none.
    """
    if header.magic != MAGIC:
        raise ProtocolError(f"bad magic {header.magic!r} (expected {MAGIC!r}): not this protocol")
    if header.type not in MsgType._value2member_map_:
        raise ProtocolError(f"unknown message type {header.type}")
    msg = MsgType(header.type)
    # TODO 3.7: refuse a frame from its header alone: dtype, shape and length all bounded.
    # Invariant: when this returns, `header.length` bytes are safe to read: the length is
    #   exactly numel * itemsize of a valid dtype and shape for tensor frames, the fixed size
    #   for CHALLENGE/AUTH, 0 for the rest, and never more than `max_payload`.
    # Hint 1: every field is a number a stranger chose: the dtype code indexes WIRE_DTYPES,
    #   ndim must fit MAX_DIMS, and a length of 2**62 must be refused here, not allocated.
    # More hints: uv run python -m tests.hint 3.7
    # See guidelines.md#37-parameter-server
    raise NotImplementedError(
        "TODO 3.7: refuse a frame from its header alone: dtype, shape and length all bounded "
        "(see phase3_multi_node/guidelines.md#37-parameter-server)"
    )


def recv_exact(sock: socket.socket, size: int, what: str) -> bytes:
    """Exactly ``size`` bytes, read in chunks of at most CHUNK (memory grows with arrivals).

    Raises PeerClosed when the peer closes first, ProtocolError on the socket's timeout.
    """
    parts: list[bytes] = []
    got = 0
    while got < size:
        try:
            part = sock.recv(min(CHUNK, size - got))
        except TimeoutError as exc:
            raise ProtocolError(
                f"read timed out after {sock.gettimeout()} s with {got} of {size} bytes of {what}"
            ) from exc
        except OSError as exc:
            raise PeerClosed(f"connection lost in {what}: {exc}") from exc
        if not part:
            if got == 0 and what == "header":
                raise PeerClosed("peer closed the connection")
            raise PeerClosed(f"peer closed mid-frame: got {got} of {size} bytes of {what}")
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def read_header(sock: socket.socket, max_payload: int) -> Header:
    """Read and check one header (:func:`check_header`); the payload is still on the socket."""
    header = unpack_header(recv_exact(sock, HEADER_SIZE, "header"))
    check_header(header, max_payload)
    return header


def read_payload(sock: socket.socket, header: Header) -> bytes:
    return recv_exact(sock, header.length, f"the payload of a {MsgType(header.type).name} frame")


def payload_tensor(header: Header, payload: bytes) -> torch.Tensor:
    """The tensor a checked header and its payload describe (a copy: owns its memory)."""
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return flat.view(header.dtype).reshape(header.shape).clone()


def read_frame(sock: socket.socket, max_payload: int) -> tuple[Header, bytes]:
    """One whole checked frame: (header, payload bytes)."""
    header = read_header(sock, max_payload)
    return header, read_payload(sock, header)


def expect(sock: socket.socket, msg_type: MsgType, max_payload: int) -> tuple[Header, bytes]:
    """Read one frame and insist on its type (a client's view of a server's answer)."""
    header, payload = read_frame(sock, max_payload)
    if header.type != msg_type:
        raise ProtocolError(f"expected a {msg_type.name} frame, got type {header.type}")
    return header, payload


def auth_digest(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, nonce, hashlib.sha256).digest()


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and "localhost": addresses no other machine can reach."""
    if host == "localhost":
        return True
    try:
        packed = socket.inet_pton(socket.AF_INET, host)
        return packed[0] == 127
    except OSError:
        pass
    try:
        return socket.inet_pton(socket.AF_INET6, host) == socket.inet_pton(socket.AF_INET6, "::1")
    except OSError:
        return False
