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
    # TODO 3.7: refuse a frame from its header alone: dtype, shape and length all bounded.
    # Invariant: when this returns, `header.length` bytes are safe to read: a tensor frame has
    #   a known dtype, at most MAX_DIMS dimensions, none negative and the unused ones 0, and a
    #   length equal to the bytes its dtype and shape imply, never more than `max_payload`; a
    #   CHALLENGE or AUTH frame has its fixed size (BYTES_TYPES); every other frame has none.
    # Hint 1: every field is a number a stranger chose: the dtype code must index WIRE_DTYPES
    #   before `header.dtype` may be read, and a length of 2**62 must be refused here, not
    #   allocated.
    # Hint 2: first the fields every frame shares: the dtype code, then ndim, then the shape
    #   (used sizes not negative, unused ones zero). Then by message type: a tensor frame's
    #   length must equal the element count times the element size, and stay within
    #   max_payload; a fixed-size frame's length must equal its size; any other frame's must
    #   be zero. Each refusal raises ProtocolError naming the field, its value and what was
    #   allowed.
    # Hint 3: an element's size is element_size() of an empty 0-d tensor of header.dtype;
    #   the expected length is math.prod of header.shape times it; the unused sizes are the
    #   entries of header.dims from position ndim on.
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
