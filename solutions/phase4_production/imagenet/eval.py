"""Top-1 / top-5 accuracy over the whole validation set, computed by every rank together.

Each rank scores a disjoint slice of the validation set (``ShardSampler``: no padding, so no
image is counted twice, unlike torchvision's reference, which evaluates with a padded
DistributedSampler and warns that its numbers may be slightly off), and the *counts* (correct at
1, correct at 5, summed loss, images) are summed over the ranks with one all-reduce in float64.
The result equals one process scoring every image with the same weights.

Two traps are avoided here:

* **BatchNorm buffers differ between ranks.** DDP broadcasts rank 0's running statistics at the
  start of each forward, then every rank updates its own copy with its own batch; after the last
  step the ranks' buffers differ. :func:`sync_buffers` copies rank 0's (the ones the checkpoint
  holds) to every rank first.
* **Evaluate the plain module, not the DDP wrapper.** DDP's forward broadcasts buffers, a
  collective; with unequal slices (50,000 images over 16 ranks) one rank runs one batch more
  than another and waits for ever in that broadcast.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class EvalResult:
    top1: float  # percent
    top5: float  # percent (top-k with k = min(5, classes))
    loss: float  # mean cross-entropy (no label smoothing)
    samples: int


def sync_buffers(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Broadcast group rank 0's buffers (BatchNorm running statistics) to every rank."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for buffer in model.buffers():
        dist.broadcast(buffer, src=src, group=group)


def correct_at_k(logits: torch.Tensor, targets: torch.Tensor, ks: Iterable[int]) -> torch.Tensor:
    """How many targets are among the top-k logits, for each k (k capped at the class count);
    a tensor on the logits' device (no host sync per batch)."""
    ks = list(ks)
    classes = logits.shape[1]
    top = logits.topk(min(max(ks), classes), dim=1).indices
    hits = top == targets[:, None]
    return torch.stack([hits[:, : min(k, classes)].any(dim=1).sum() for k in ks])


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: Iterable[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    *,
    group: dist.ProcessGroup | None = None,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
) -> EvalResult:
    """Score this rank's slice, sum the counts over ``group``; the same result on every rank.

    ``model`` is the plain module (not DDP); call :func:`sync_buffers` first when ranks' buffers
    may differ.
    """
    was_training = model.training
    model.eval()
    counts = torch.zeros(4, dtype=torch.float64, device=device)  # top1, top5, loss sum, n
    for images, targets in loader:
        with autocast():
            logits = model(images)
        logits = logits.float()
        counts[:2] += correct_at_k(logits, targets, (1, 5)).to(torch.float64)
        counts[2] += nn.functional.cross_entropy(logits, targets, reduction="sum").double()
        counts[3] += targets.numel()
    model.train(was_training)
    if dist.is_initialized():
        dist.all_reduce(counts, group=group)
    n = max(float(counts[3]), 1.0)
    return EvalResult(
        100.0 * float(counts[0]) / n,
        100.0 * float(counts[1]) / n,
        float(counts[2]) / n,
        int(counts[3]),
    )
