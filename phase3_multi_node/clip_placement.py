"""Where each gradient of a sharded model lives: the metadata exercise 3.6's clipping reads.

``torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)`` on one process computes the
norm of every gradient of the model, then scales them all by ``max_norm / (norm + 1e-6)`` when
that is below 1. On a sharded model no rank holds every gradient, and some ranks hold the *same*
gradient as others. Per tensor a rank holds, two facts decide how it enters the global norm:

* along which axes of the ``Topology`` identical copies of it live (``replicated_on``): with
  plain data parallelism every gradient is the same on every dp rank (after the average); in
  Megatron's tensor parallelism the row-parallel layer's bias (``fc2.bias`` of a ``ParallelMLP``)
  and layer norms are whole on every tp rank, while fc1's rows and fc2's columns are pieces;
* the other axes hold other pieces: tp ranks other rows/columns, pipeline stages other blocks,
  and under ZeRO/FSDP the dp ranks other slices of each unit's flat gradient (padding zero).

:class:`GradShard` carries one tensor with that fact. Two builders make them for the course's
sharded models: :func:`shards_of_stage` for a 3D-parallel stage (``Parallel3D.stage``: blocks of
``ParallelMLP``, gradients averaged over dp) and :func:`shards_of_flat_slices` for ZeRO/FSDP
(each rank's slice of a flat gradient: nothing replicated on dp).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

# the groups of a Topology along which identical copies of a gradient can live
COPY_GROUPS = ("dp", "cp", "tp", "dp_cp", "edp", "embedding")
# parameters whole on every tp rank of a Megatron block: the row-parallel layer's bias (added
# once, after the all-reduce) and, in transformer blocks, the layer norms
TP_REPLICATED_SUFFIXES = ("fc2.bias", "norm.weight", "norm.bias")


@dataclass(frozen=True)
class GradShard:
    """One gradient this rank holds (``grad``, clipped in place) and where its copies live.

    ``replicated_on`` names groups of the topology (:data:`COPY_GROUPS`) along which every rank
    holds an identical copy of this tensor: ``"dp"`` and ``"tp"`` in a 3D-parallel stack; in
    exercise 4.7 also ``"cp"`` or ``"dp_cp"`` (data x context ranks hold the same weights),
    ``"edp"`` (the copies of an expert) and ``"embedding"`` (the first and last stage's copies
    of a tied embedding). Along the other axes the ranks hold different pieces of the model.
    ``name`` is for messages.
    """

    name: str
    grad: torch.Tensor
    replicated_on: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        unknown = set(self.replicated_on) - set(COPY_GROUPS)
        if unknown:
            raise ValueError(
                f"{self.name}: replicated_on={sorted(self.replicated_on)}; copies live on the "
                f"groups {', '.join(COPY_GROUPS)} (a pipeline stage holds its own blocks)"
            )


def tp_replicated(name: str) -> bool:
    """Whether a parameter of a Megatron block is whole on every tp rank (by its name)."""
    return name.endswith(TP_REPLICATED_SUFFIXES)


def shards_of_stage(stage: nn.Module, dp_replicated: bool = True) -> list[GradShard]:
    """The gradients of a 3D-parallel stage (``Parallel3D.stage``), after ``average_gradients``
    made them equal on every dp rank (``dp_replicated``): fc1's rows and fc2's columns are this
    tp rank's pieces, fc2's bias is whole on every tp rank. Parameters without a gradient are
    skipped, as ``clip_grad_norm_`` does."""
    out = []
    for name, p in stage.named_parameters():
        if p.grad is None:
            continue
        axes = {"dp"} if dp_replicated else set()
        if tp_replicated(name):
            axes.add("tp")
        out.append(GradShard(name, p.grad, frozenset(axes)))
    return out


def shards_of_flat_slices(
    named: Iterable[tuple[str, torch.Tensor]], tp_replicated_slices: Sequence[str] = ()
) -> list[GradShard]:
    """ZeRO-2/3 and FSDP gradients: each rank's slice of each unit's flat, padded gradient
    (``unit.shard.grad``), a different piece on every dp rank. ``tp_replicated_slices`` names
    the slices whose whole unit is replicated on tp (none in the course's models)."""
    return [
        GradShard(name, grad, frozenset({"tp"} if name in tp_replicated_slices else ()))
        for name, grad in named
    ]
