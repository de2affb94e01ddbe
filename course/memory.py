"""Measure the bytes autograd keeps for backward, with ``saved_tensors_hooks``.

Every tensor autograd saves for the backward pass (a Linear's input, a ReLU's output, what a
custom Function passes to ``ctx.save_for_backward``) goes through the pack hook of
``torch.autograd.graph.saved_tensors_hooks`` (see the PyTorch "Hooks for saved tensors" notes).
The meter counts each underlying storage once, even when several graph nodes save it, follows it
until autograd drops it (after the node's backward, or when the graph is freed), and records the
peak, so recomputation during a checkpointed backward is counted too. Parameters can be excluded:
they are model state, not activations.

This works the same on CPU and GPU, which is why the course uses it: ``torch.cuda``'s memory
statistics exist only on GPUs.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    return (str(tensor.device), tensor.untyped_storage().data_ptr())


class _Saved:
    """What autograd stores instead of the tensor; its death tells the meter the bytes are gone."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, meter: SavedTensorMeter, key: tuple[str, int], tensor: torch.Tensor) -> None:
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self) -> None:
        self.meter._release(self.key)


class SavedTensorMeter:
    """``with SavedTensorMeter(exclude=model.parameters()) as meter: ...forward...backward...``

    Attributes after (or during) the block:
        live_bytes: bytes saved for backward and not yet released.
        peak_bytes: the largest ``live_bytes`` seen.
        packed_bytes: bytes of every distinct storage saved, in total.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {_storage_key(t) for t in exclude}
        self._refs: dict[tuple[str, int], int] = {}
        self._sizes: dict[tuple[str, int], int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.packed_bytes = 0
        self._hooks = saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        key = _storage_key(tensor)
        if key in self._excluded or tensor.device.type == "meta":
            return tensor
        if key not in self._refs:
            nbytes = tensor.untyped_storage().nbytes()
            self._refs[key], self._sizes[key] = 0, nbytes
            self.live_bytes += nbytes
            self.packed_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._refs[key] += 1
        return _Saved(self, key, tensor)

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _release(self, key: tuple[str, int]) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live_bytes -= self._sizes.pop(key)

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._hooks.__exit__(exc_type, exc, traceback)
