# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase3.py
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
    # More hints: uv run python -m tests.hint 3.7
    # See guidelines.md#37-parameter-server
    raise NotImplementedError(
        "TODO 3.7: refuse a frame from its header alone, before a byte of payload is read "
        "(see phase3_multi_node/guidelines.md#37-parameter-server)"
    )
