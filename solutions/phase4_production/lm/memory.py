"""The bytes one rank holds under a layout of the language model, from the model's shapes alone.

What the memory model prices is the layout's description (``lm.layout_work``): what each rank
holds, written down once for the planner's memory and time models alike.

The planner (``lm/planner.py``) needs, for a layout it has not run, the bytes every rank would
hold: the model states, exactly (the same shapes the composition builds, the same ZeRO units and
padding as 3.5), and the activations, from a measured cost per token. The description says what
each pipeline rank holds (its units: a norm, a projection, the embedding, the head; tp shards and
E/ep experts) and what the schedule keeps in flight; this module only prices it. Per parameter
of a rank's units, with ``e`` bytes per element and AdamW's two moments in the parameters' dtype:

* plain data parallelism: parameters ``e``, gradients ``e``, optimizer ``2e``;
* ZeRO-1: the optimizer's ``2e`` on this rank's slice only (1/N of each unit, N = dp x cp);
* ZeRO-2: the gradients too (the full ones are dropped after their reduce-scatter);
* ZeRO-3 and FSDP-style: the parameters too (a unit is gathered only while it computes).

Those are the course's runs (every state in one dtype). For a plan of a GPU cluster the bytes per
element of each state are given apart (:class:`StateBytes`): mixed-precision AdamW as the ZeRO
paper counts it holds 16-bit parameters and gradients (2 + 2 bytes) and, for the optimizer, fp32
master weights and two fp32 moments (K = 12; Rajbhandari et al., 2020, section 3), sharded by
the same stages: :data:`MIXED_ADAMW`. Each unit is padded to a multiple of N, as 3.5's flat
buffers are.

Activations (an estimate, stated as such): the bytes autograd saves per token and layer (measured
on one dense layer by ``lm.rates``): the norms' part whole on every tp rank without sequence
parallelism, a tp share with it; the rest (inside the tensor-parallel regions) a tp share, times
the tokens of a micro-batch on a rank, times the layers of a chunk,
times the (micro-batch, chunk) pairs the schedule holds at once on the busiest rank (2.5's
``peak_in_flight`` of its actions). With activation checkpointing a layer keeps only its input
(for every layer of a chunk and micro-batch in flight), plus one layer's activations while it is
recomputed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from solutions.phase4_production.lm.layout_work import LayoutWork


@dataclass(frozen=True)
class StateBytes:
    """Bytes per element of each model state: the parameters a rank computes with, their
    gradients, and what the optimizer keeps per parameter (AdamW's two moments, and the fp32
    master weights under mixed precision)."""

    param: int
    grad: int
    optimizer: int

    @classmethod
    def adamw(cls, element: int) -> StateBytes:
        """AdamW with every state in one dtype of ``element`` bytes (the course's runs)."""
        return cls(element, element, 2 * element)


MIXED_ADAMW = StateBytes(2, 2, 12)  # bf16 weights and grads; fp32 master + moments (ZeRO's K)


@dataclass(frozen=True)
class HeldBytes:
    """What one rank holds: model states (exact) and activations (from a measured rate)."""

    params: int
    grads: int
    optimizer: int
    activations: int

    @property
    def states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.states + self.activations


def state_bytes(
    units: Sequence[int], zero: int | str, shards: int, element: int | StateBytes
) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes of a rank's units under ``zero`` over ``shards`` ranks;
    ``element``: bytes per element of every state (AdamW in one dtype), or each state's."""
    b = StateBytes.adamw(element) if isinstance(element, int) else element
    full = sum(units)
    padded = sum(math.ceil(n / shards) * shards for n in units)
    mine = padded // shards
    if zero == 0:
        return full * b.param, full * b.grad, full * b.optimizer
    if zero == 1:
        return padded * b.param, padded * b.grad, mine * b.optimizer
    if zero == 2:
        return padded * b.param, mine * b.grad, mine * b.optimizer
    return mine * b.param, mine * b.grad, mine * b.optimizer  # 3 and fsdp


def held_bytes(
    work: LayoutWork,
    activation_bytes_per_token_layer: float,
    norm_bytes_per_token_layer: float = 0.0,
    states: StateBytes | None = None,
) -> HeldBytes:
    """The busiest rank's bytes under the layout ``work`` describes: the pipeline rank with the
    most states (every dp, cp, tp rank of it holds the same), and the activations of the
    schedule's peak in flight. The activations take ``work.element`` bytes per element, the
    states too unless ``states`` says."""
    s, micro = work.settings, work.micro
    per_element = states or StateBytes.adamw(work.element)
    per_rank = [state_bytes(rank.units, s.zero, work.shards, per_element) for rank in work.ranks]
    params, grads, optimizer = max(per_rank, key=sum)
    inside = activation_bytes_per_token_layer - norm_bytes_per_token_layer
    whole = norm_bytes_per_token_layer / (s.tp if s.sequence_parallel else 1)
    per_layer = (inside / s.tp + whole) * micro.tokens
    if s.activation_checkpointing:  # layer inputs in flight, one layer recomputed
        kept = micro.between * work.config.width * work.element * work.layers_per_chunk
        activations = int(kept * work.in_flight + per_layer)
    else:
        activations = int(per_layer * work.layers_per_chunk * work.in_flight)
    return HeldBytes(params, grads, optimizer, activations)
