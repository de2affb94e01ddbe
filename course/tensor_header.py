"""The one wire header that announces a tensor: dtype and shape, in a fixed-size int64 message.

``dist.recv`` fills a buffer the receiver allocated, so before a tensor whose shape depends on
the batch (an activation, say) the receiver must learn its dtype and shape. Naive model
parallelism (exercise 2.4) sends this header before every activation; the pipeline executor
(exercise 2.5) sends it once per stage boundary and step, before any data. Its length is fixed,
so a receiver can always post the receive for it before knowing anything::

    [dtype code, ndim, size_0, ..., size_{ndim-1}, -1, ..., -1]     HEADER_SLOTS int64 values

The dtype code is the position in :data:`WIRE_DTYPES`. A header travels on the device of the
tensor it describes (NCCL sends only CUDA tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HEADER_SLOTS = 10
MAX_DIMS = HEADER_SLOTS - 2
WIRE_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
)


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver must know to allocate a buffer: shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @staticmethod
    def of(tensor: torch.Tensor) -> TensorMeta:
        return TensorMeta(tuple(tensor.shape), tensor.dtype)

    def empty(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """An uninitialised buffer this meta describes: where a receive lands."""
        return torch.empty(self.shape, dtype=self.dtype, device=device)


def encode_header(
    meta: TensorMeta | torch.Tensor, device: torch.device | str | None = None
) -> torch.Tensor:
    """The header describing ``meta`` (or a tensor), on ``device`` (the tensor's by default)."""
    if isinstance(meta, torch.Tensor):
        device = meta.device if device is None else device
        meta = TensorMeta.of(meta)
    if meta.dtype not in WIRE_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in WIRE_DTYPES)
        raise ValueError(f"cannot send {meta.dtype}: the header knows {names}")
    if len(meta.shape) > MAX_DIMS:
        raise ValueError(
            f"cannot send a {len(meta.shape)}-d tensor: the header holds at most {MAX_DIMS} sizes"
        )
    values = [WIRE_DTYPES.index(meta.dtype), len(meta.shape), *meta.shape]
    values += [-1] * (HEADER_SLOTS - len(values))
    return torch.tensor(values, dtype=torch.int64, device=device or "cpu")


def empty_header(device: torch.device | str = "cpu") -> torch.Tensor:
    """A buffer to receive a header into."""
    return torch.empty(HEADER_SLOTS, dtype=torch.int64, device=device)


def decode_header(header: torch.Tensor) -> TensorMeta:
    """The :class:`TensorMeta` a header made by :func:`encode_header` describes."""
    values = header.tolist()
    code, ndim = values[0], values[1]
    if not (0 <= code < len(WIRE_DTYPES) and 0 <= ndim <= MAX_DIMS):
        raise ValueError(
            f"not a tensor header: {values} (was a data message received in its place? "
            "the header always comes first)"
        )
    return TensorMeta(tuple(values[2 : 2 + ndim]), WIRE_DTYPES[code])
