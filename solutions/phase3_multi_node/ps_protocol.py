"""Exercise 3.7, the parameter server's wire protocol: judge a frame from its header alone.

A frame is a fixed 64-byte header, then ``length`` raw bytes (the layout, the message types and
the reading functions are given in phase3_multi_node/ps_wire.py). A server is network-facing,
so it must assume any byte it reads was written by an attacker or a bug. The rule that makes
reading safe is yours to write: **decide from the header alone whether the frame is acceptable,
before reading or allocating its payload**. A length field is a number someone else wrote:
allocating ``length`` bytes because a header said so lets one 64-byte frame ask for 2^62 bytes.

Every reader of the course's parameter server (the server's connection threads, the workers,
the tests) passes :func:`check_header` to ``ps_wire.read_frame``, which calls it on each header
before it reads a byte of payload.
"""

from __future__ import annotations

import math

import torch

from phase3_multi_node.ps_wire import (
    BYTES_TYPES,
    MAGIC,
    MAX_DIMS,
    TENSOR_TYPES,
    WIRE_DTYPES,
    Header,
    MsgType,
    ProtocolError,
)


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
    # TODO 3.7: refuse a frame from its header alone, before a byte of payload is read.
    # Invariant: when this returns, `header.length` bytes are safe to read: a tensor frame has a
    #   known dtype, at most MAX_DIMS dimensions, none negative and the unused ones 0, and a length
    #   equal to the bytes its dtype and shape imply, never more than `max_payload`; a CHALLENGE or
    #   AUTH frame has its fixed size (BYTES_TYPES); every other frame has none; every refusal is a
    #   ProtocolError naming the field.
    # Hint 1: every field is a number a stranger chose, and header.dtype looks one of them up in
    #   WIRE_DTYPES.
    # Hint 2: Which field must be checked before another may be read? In what order do the dtype
    #   code, ndim and the sizes go? How many bytes do a dtype and a shape imply? Which frames carry
    #   a tensor, which a fixed number of bytes, and which nothing at all?
    # Hint 3: First the dtype code: below the length of WIRE_DTYPES, or header.dtype raises
    #   IndexError instead of a refusal; then ndim between 0 and MAX_DIMS; then no used size
    #   negative and every unused one (the dims from position ndim on) zero.
    # Hint 4: A tensor frame (TENSOR_TYPES): its length must equal the product of its shape times
    #   the element size of its dtype (that of an empty 0-d tensor of header.dtype), and stay within
    #   max_payload. A [4] float64 tensor is 32 bytes: 31 or 2^62 is refused.
    # Hint 5: The others: a CHALLENGE or AUTH frame's length must equal its entry of BYTES_TYPES;
    #   any other frame's must be 0. Each refusal raises ProtocolError with the field, its value and
    #   what was allowed.
    # See guidelines.md#37-parameter-server
    # >>> solution
    if header.dtype_code >= len(WIRE_DTYPES):
        raise ProtocolError(
            f"unknown dtype code {header.dtype_code} (know 0..{len(WIRE_DTYPES) - 1})"
        )
    if not 0 <= header.ndim <= MAX_DIMS:
        raise ProtocolError(f"ndim {header.ndim} outside 0..{MAX_DIMS}")
    if any(d < 0 for d in header.shape) or any(d != 0 for d in header.dims[header.ndim :]):
        raise ProtocolError(f"bad shape fields {header.dims} for ndim {header.ndim}")
    if msg in TENSOR_TYPES:
        itemsize = torch.empty((), dtype=header.dtype).element_size()
        expected = math.prod(header.shape) * itemsize
        if header.length != expected:
            raise ProtocolError(
                f"payload length {header.length} does not match shape {list(header.shape)} of "
                f"{header.dtype} ({expected} bytes)"
            )
        if header.length > max_payload:
            raise ProtocolError(f"payload length {header.length} exceeds the limit {max_payload}")
    elif msg in BYTES_TYPES:
        if header.length != BYTES_TYPES[msg]:
            raise ProtocolError(
                f"{msg.name} payload length {header.length}, expected {BYTES_TYPES[msg]}"
            )
    elif header.length != 0:
        raise ProtocolError(f"{msg.name} carries no payload, but the length says {header.length}")
    # <<< solution
