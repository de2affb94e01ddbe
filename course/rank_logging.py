"""Printing from many processes: one voice (rank 0), or every rank with its name in front."""

from __future__ import annotations

import sys

import torch.distributed as dist


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def log0(*parts: object) -> None:
    """Print on rank 0 only (or when there is no process group), flushed at once."""
    if _rank() == 0:
        print(*parts, flush=True)


def log_all(*parts: object) -> None:
    """Print on every rank, prefixed with ``[rank r]`` so interleaved lines stay readable."""
    print(f"[rank {_rank()}]", *parts, flush=True, file=sys.stdout)
