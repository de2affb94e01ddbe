"""RNG states as tensors and ints, so that ``torch.load(weights_only=True)`` reads them.

A resumed run is bitwise equal to an uninterrupted one only if every random draw after the resume
is the one the uninterrupted run would have made: dropout masks (torch's CPU and CUDA generators),
augmentations (NumPy's and Python's ``random``). Each rank draws from its own streams, so each
rank's states are saved under its own keys (``rank1/numpy_keys``...).

``torch.load(..., weights_only=True)`` (the default since torch 2.6) unpickles only tensors,
numbers, strings and containers of them (torch/_weights_only_unpickler.py): NumPy's state tuple
holds an ndarray and Python's a 625-tuple, so both are converted here, and back. Not an
exercise: the exercise (checkpoint.py) decides *what* to capture and *where* it goes.
"""

from __future__ import annotations

import random

import numpy as np
import torch

RngState = dict[str, torch.Tensor | int | float | str | None]


def numpy_state() -> RngState:
    """``np.random.get_state()`` (legacy MT19937) as a tensor of its 624 keys and plain numbers."""
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {
        "numpy_name": str(name),
        "numpy_keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "numpy_pos": int(pos),
        "numpy_has_gauss": int(has_gauss),
        "numpy_cached_gaussian": float(cached),
    }


def set_numpy_state(state: RngState) -> None:
    """The inverse of :func:`numpy_state`."""
    keys = state["numpy_keys"]
    assert isinstance(keys, torch.Tensor)
    np.random.set_state(
        (
            str(state["numpy_name"]),
            keys.numpy().astype(np.uint32),
            int(state["numpy_pos"]),  # type: ignore[arg-type]
            int(state["numpy_has_gauss"]),  # type: ignore[arg-type]
            float(state["numpy_cached_gaussian"]),  # type: ignore[arg-type]
        )
    )


def python_state() -> RngState:
    """``random.getstate()`` = (version, 625 ints, gauss_next) as a tensor and plain numbers."""
    version, internal, gauss_next = random.getstate()
    return {
        "python_version": int(version),
        "python_internal": torch.tensor(internal, dtype=torch.int64),
        "python_gauss_next": gauss_next,
    }


def set_python_state(state: RngState) -> None:
    """The inverse of :func:`python_state`."""
    internal = state["python_internal"]
    assert isinstance(internal, torch.Tensor)
    gauss = state["python_gauss_next"]
    random.setstate(
        (
            int(state["python_version"]),  # type: ignore[arg-type]
            tuple(int(v) for v in internal.tolist()),
            None if gauss is None else float(gauss),
        )
    )


def cuda_states() -> list[torch.Tensor]:
    """One byte tensor per visible GPU; empty where this process has not used CUDA (a CPU rank on
    a GPU machine has no CUDA random state worth keeping, and asking for one would initialise
    CUDA, which a worker forked from a parent that used CUDA cannot do)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return []
    return list(torch.cuda.get_rng_state_all())


def set_cuda_states(states: list[torch.Tensor]) -> None:
    """The inverse of :func:`cuda_states`; ignored on a machine without CUDA."""
    if states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states)
