"""The bytes one rank holds under a layout of the language model, from the model's shapes alone.

The planner (``lm/planner.py``) needs, for a layout it has not run, the bytes every rank would
hold: the model states, exactly (the same shapes the composition builds, the same ZeRO units and
padding as 3.5), and the activations, from a measured cost per token. Per parameter of a rank's
pieces, with ``e`` bytes per element and AdamW's two moments in the parameters' dtype:

* plain data parallelism: parameters ``e``, gradients ``e``, optimizer ``2e``;
* ZeRO-1: the optimizer's ``2e`` on this rank's slice only (1/N of each unit, N = dp x cp);
* ZeRO-2: the gradients too (the full ones are dropped after their reduce-scatter);
* ZeRO-3 and FSDP-style: the parameters too (a unit is gathered only while it computes).

Those are the course's runs (every state in one dtype). For a plan of a GPU cluster the bytes per
element of each state are given apart (:class:`StateBytes`): mixed-precision AdamW as the ZeRO
paper counts it holds 16-bit parameters and gradients (2 + 2 bytes) and, for the optimizer, fp32
master weights and two fp32 moments (K = 12; Rajbhandari et al., 2020, section 3), sharded by
the same stages: :data:`MIXED_ADAMW`.

Each unit (a module owning parameters: a norm, a projection, the embedding, the head) is padded to
a multiple of N, as 3.5's flat buffers are. The pieces: the embedding on the first virtual stage,
the final norm and head on the last (one weight when tied on the same rank), and per layer two
norms (whole on every tp rank), q/k/v and gate/up (rows / tp), the output and down projections
(columns / tp), or for an MoE layer the router and E/ep experts.

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
from dataclasses import dataclass

from course.language_model import LMConfig
from phase2_advanced.pipeline_layout import virtual_stage
from phase4_production.lm_blocks import split_layers
from phase4_production.lm_layout import ParallelSettings
from solutions.phase2_advanced.pipeline_schedules import (
    make_schedule,
    peak_in_flight,
    placement_of,
)


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


def layer_units(config: LMConfig, layer: int, tp: int, ep: int) -> list[int]:
    """Elements of each unit one layer holds on a rank (tp shards, E/ep experts), as the
    runtime's wrap policy groups them: one unit per block (an MoE block, which ZeRO refuses,
    listed by kind: the norms and the router, the attention, the experts)."""
    h = config.width
    attention = 3 * h * h // tp + h * h // tp  # qkv, out
    if config.is_moe(layer):
        per_expert = 2 * h * config.expert_ffn + config.expert_ffn + h  # two Linears, biased
        whole = 2 * h + config.num_experts * h  # the norms and the router
        return [whole, attention, per_expert * (config.num_experts // ep)]
    return [2 * h + attention + 2 * config.ffn * h // tp + h * config.ffn // tp]  # + SwiGLU


def rank_stages(settings: ParallelSettings, pp_rank: int) -> list[int]:
    """The virtual stages pipeline rank ``pp_rank`` holds, one per chunk, under the schedule's
    placement (the loop, or zb-v's V)."""
    placement = placement_of(settings.schedule)
    return [
        virtual_stage(pp_rank, chunk, settings.pp, placement)
        for chunk in range(settings.chunks_per_rank)
    ]


def rank_units(config: LMConfig, settings: ParallelSettings, pp_rank: int) -> list[int]:
    """Elements of every unit pipeline rank ``pp_rank`` holds (its chunks' layers, the embedding
    and the head where its chunks are the first and the last virtual stage)."""
    runs = split_layers(config.layers, settings.virtual_stages)
    last = settings.virtual_stages - 1
    units: list[int] = []
    stages = rank_stages(settings, pp_rank)
    for stage in stages:
        for layer in runs[stage]:
            units += layer_units(config, layer, settings.tp, settings.ep)
    if 0 in stages:
        units.append(config.vocab * config.width)
    if last in stages:
        units.append(config.width)  # the final norm
        if not (config.tied and 0 in stages):
            units.append(config.vocab * config.width)
    return units


def state_bytes(
    units: list[int], zero: int | str, shards: int, element: int | StateBytes
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


def in_flight(settings: ParallelSettings) -> int:
    """The most micro-batch activations any pipeline rank holds at once."""
    schedule = make_schedule(settings.schedule, settings.pp, settings.microbatches, settings.chunks)
    return max(peak_in_flight(actions) for actions in schedule)


def held_bytes(
    config: LMConfig,
    settings: ParallelSettings,
    batch: int,
    element: int,
    activation_bytes_per_token_layer: float,
    norm_bytes_per_token_layer: float = 0.0,
    states: StateBytes | None = None,
) -> HeldBytes:
    """The busiest rank's bytes: the pipeline rank with the most states (every dp, cp, tp rank
    of it holds the same), and the activations of the schedule's peak in flight. ``element``
    is the activations' bytes per element, and the states' too unless ``states`` says."""
    shards = settings.dp * settings.cp
    per_element = states or StateBytes.adamw(element)
    per_rank = [
        state_bytes(rank_units(config, settings, r), settings.zero, shards, per_element)
        for r in range(settings.pp)
    ]
    params, grads, optimizer = max(per_rank, key=sum)
    tokens = batch // (settings.dp * settings.microbatches) * config.seq_len // settings.cp
    inside = activation_bytes_per_token_layer - norm_bytes_per_token_layer
    whole = norm_bytes_per_token_layer / (settings.tp if settings.sequence_parallel else 1)
    per_layer = (inside / settings.tp + whole) * tokens
    layers_per_chunk = math.ceil(config.layers / settings.virtual_stages)
    if settings.activation_checkpointing:  # layer inputs in flight, one layer recomputed
        between = tokens // settings.tp if settings.sequence_parallel else tokens
        kept = between * config.width * element * layers_per_chunk * in_flight(settings)
        activations = int(kept + per_layer)
    else:
        activations = int(per_layer * layers_per_chunk * in_flight(settings))
    return HeldBytes(params, grads, optimizer, activations)
