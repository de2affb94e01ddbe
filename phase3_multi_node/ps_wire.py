"""The parameter server's wire format (exercise 3.7): fixed-size frames over plain TCP, each read
whole within a deadline. Given code: the servers, the workers and the tests all use it.

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

Reading is safe because of three rules, all applied here:

* **The header is judged alone.** :func:`read_frame` calls a ``check(header, max_payload)``
  function (exercise 3.7's ``check_header``, passed in by whoever reads) on the 64 header bytes
  before a byte of payload is read or allocated: a length field is a number a stranger wrote.
* **Memory grows with what arrived**, not with what was promised: payloads are read in chunks
  of at most CHUNK bytes.
* **A whole frame has a deadline**, not each ``recv``. A timeout per ``recv`` is reset by every
  byte, so a client sending one byte every half second keeps a server thread forever (a
  "slowloris" client). Every read here takes an absolute ``deadline`` (``time.monotonic()``
  seconds) for the whole frame, and :func:`wait_for_data` bounds the silence before one.

Connecting with a shared secret: the server sends CHALLENGE with NONCE_SIZE random bytes, the
client answers AUTH with ``HMAC-SHA256(secret, nonce)`` (:func:`auth_digest`), compared with
:func:`hmac.compare_digest` (constant time, so the comparison's duration leaks nothing). This is
the scheme of ``multiprocessing.connection``'s ``authkey``, without its pickle.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import socket
import struct
import time
from collections.abc import Callable
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


TENSOR_TYPES = frozenset({MsgType.PARAM, MsgType.PUSH})  # frames that carry one tensor
BYTES_TYPES = {MsgType.CHALLENGE: NONCE_SIZE, MsgType.AUTH: DIGEST_SIZE}  # fixed raw payloads


class ProtocolError(Exception):
    """The peer sent something this protocol does not allow; the message says what.

    A server answers it by closing the connection and logging the message, nothing else: no
    parameter is touched by a frame that was not accepted whole.
    """


class PeerClosed(ProtocolError):
    """The peer closed the connection (between frames: a clean end; inside one: truncated)."""


@dataclass(frozen=True)
class Header:
    """One decoded frame header; nothing in it is trusted until a check says so."""

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


HeaderCheck = Callable[[Header, int], None]  # check(header, max_payload): raise ProtocolError


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
    """The fields of 64 header bytes, unchecked."""
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


def payload_tensor(header: Header, payload: bytes) -> torch.Tensor:
    """The tensor a checked header and its payload describe (a copy: owns its memory)."""
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return flat.view(header.dtype).reshape(header.shape).clone()


# ----------------------------------------------------------------------------- reading


def deadline_in(seconds: float) -> float:
    """The ``time.monotonic()`` value ``seconds`` from now: a deadline for :func:`read_frame`."""
    return time.monotonic() + seconds


def _time_left(sock: socket.socket, deadline: float, what: str, got: int, size: int) -> None:
    """Set the socket's timeout to what is left before ``deadline``, or refuse: time is up."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise ProtocolError(
            f"read timed out: {got} of {size} bytes of {what} arrived before the deadline"
        )
    sock.settimeout(left)


def recv_exact(sock: socket.socket, size: int, what: str, deadline: float) -> bytes:
    """Exactly ``size`` bytes by ``deadline``, read in chunks of at most CHUNK.

    Raises PeerClosed when the peer closes first, ProtocolError when the deadline passes (however
    the bytes trickle in: the deadline is for all of them, not for each ``recv``).
    """
    parts: list[bytes] = []
    got = 0
    while got < size:
        _time_left(sock, deadline, what, got, size)
        try:
            part = sock.recv(min(CHUNK, size - got))
        except TimeoutError:
            _time_left(sock, deadline, what, got, size)  # raises: the deadline has passed
            continue
        except OSError as exc:
            raise PeerClosed(f"connection lost in {what}: {exc}") from exc
        if not part:
            if got == 0 and what == "header":
                raise PeerClosed("peer closed the connection")
            raise PeerClosed(f"peer closed mid-frame: got {got} of {size} bytes of {what}")
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def wait_for_data(sock: socket.socket, timeout: float) -> None:
    """Return once the peer has sent a byte (left on the socket); the silence is bounded.

    Raises PeerClosed when the peer closes, ProtocolError after ``timeout`` seconds of silence.
    """
    sock.settimeout(timeout)
    try:
        first = sock.recv(1, socket.MSG_PEEK)
    except TimeoutError as exc:
        raise ProtocolError(f"read timed out: the peer was silent for {timeout:g} s") from exc
    except OSError as exc:
        raise PeerClosed(f"connection lost: {exc}") from exc
    if not first:
        raise PeerClosed("peer closed the connection")


def read_header(
    sock: socket.socket, max_payload: int, check: HeaderCheck, deadline: float
) -> Header:
    """Read one header by ``deadline`` and ``check`` it; the payload is still on the socket."""
    header = unpack_header(recv_exact(sock, HEADER_SIZE, "header", deadline))
    check(header, max_payload)
    return header


def read_payload(sock: socket.socket, header: Header, deadline: float) -> bytes:
    """The payload of a checked header, by ``deadline``."""
    what = f"the payload of a {MsgType(header.type).name} frame"
    return recv_exact(sock, header.length, what, deadline)


def read_frame(
    sock: socket.socket, max_payload: int, check: HeaderCheck, deadline: float
) -> tuple[Header, bytes]:
    """One whole checked frame, header and payload both by ``deadline``: (header, payload)."""
    header = read_header(sock, max_payload, check, deadline)
    return header, read_payload(sock, header, deadline)


def expect(
    sock: socket.socket, msg_type: MsgType, max_payload: int, check: HeaderCheck, deadline: float
) -> tuple[Header, bytes]:
    """Read one frame and insist on its type (a client's view of a server's answer)."""
    header, payload = read_frame(sock, max_payload, check, deadline)
    if header.type != msg_type:
        raise ProtocolError(f"expected a {msg_type.name} frame, got type {header.type}")
    return header, payload


def send_frames(sock: socket.socket, data: bytes, deadline: float) -> None:
    """Send ``data`` whole by ``deadline`` (a peer that does not read cannot hold the sender)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise ProtocolError("send timed out: the deadline passed before sending")
    sock.settimeout(left)  # sendall's timeout bounds the whole call (Python >= 3.5)
    try:
        sock.sendall(data)
    except TimeoutError as exc:
        raise ProtocolError(f"send timed out: the peer did not read {len(data)} bytes") from exc
    except OSError as exc:
        raise PeerClosed(f"connection lost while sending: {exc}") from exc


# ----------------------------------------------------------------------------- trust


def auth_digest(secret: bytes, nonce: bytes) -> bytes:
    """HMAC-SHA256 of the server's challenge under the shared secret: the client's answer."""
    return hmac.new(secret, nonce, hashlib.sha256).digest()


def digest_ok(secret: bytes, nonce: bytes, answer: bytes) -> bool:
    """Whether ``answer`` is the right HMAC, compared in constant time."""
    return hmac.compare_digest(auth_digest(secret, nonce), answer)


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
