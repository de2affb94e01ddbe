"""What each axis of exercise 4.7's composition sends in a step: formulas, and CommCounter's count.

Every collective and message of a training step is counted by ``CommCounter`` (course/
comm_counter.py: the bytes of the tensor handed to torch, the output for ``all_gather`` and
``reduce_scatter_tensor``, the input for all-to-alls) and put under the group it used, named by
the topology (``tp``, ``cp``, ``pp``, ``dp``, ``dp_cp``, ``ep``, ``edp``, ``embedding``; groups
whose ranks coincide share one label such as ``cp+ep``; point-to-point messages go under ``pp``
or ``cp`` by their peer). Groups of one rank move nothing and are left out.

:func:`expected_step` predicts the same table from the model's sizes and the layout alone, for a
micro-batch of ``b`` sequences, ``s = seq_len / cp`` tokens, width ``h``, ``e`` bytes per element:

* tp, per layer and micro-batch, one region per attention and per SwiGLU: without sequence
  parallelism an all-reduce of ``b·s·h·e`` each way (g forward, f backward); with it an all-gather
  (``b·s·h·e``) and a reduce-scatter (``b·s·h·e/tp``) each way. Under sequence parallelism also
  the weights' gradient sum after backward, the MoE counts and the loss report;
* cp, per attention layer and micro-batch: 2(cp-1) sends (K and V, ``b·s·h·e/tp`` each) forward,
  4(cp-1) backward (K and V again, then their dK and dV sums);
* pp: per micro-batch the activation to the next stage and its gradient back
  (``b·s_sp·h·e``), and one header per boundary;
* dp x cp: the valid-target count, the loss report (cross-entropy, balance and, per MoE layer,
  each expert's token choices: an expert nobody chose keeps no gradient, as in one process), and
  the gradients: plain data parallelism one
  flat all-reduce of the non-expert gradients; ZeRO-1 a reduce-scatter of each unit after
  backward and an all-gather of each unit after the step; ZeRO-2 a reduce-scatter of each unit
  per micro-batch and an all-gather of each unit after the step; ZeRO-3 and FSDP-style a
  reduce-scatter and two all-gathers (one for forward, one for backward) of each unit per
  micro-batch (3.5's units; a tied weight read by two layers is gathered once more, not counted
  here);
* ep (MoE), per layer and micro-batch: the census all-gather, the counts' all-to-all, and the
  rows: dispatch (``k·T`` rows out), combine (the rows the experts got), and both again
  backward: ``4·k·T·h·e`` summed over the ep group for its ``T`` tokens (each rank's share
  depends on the routing);
* edp: the experts' gradient sum; embedding: a tied embedding's; clipping adds 8 bytes on the
  group of every axis.

A zero-bubble schedule's W walks each chunk's graph a second time to reach the weights: every
backward collective of a chunk (f's all-reduces, the ring's passes, the all-to-alls) runs again,
except on stage 0, whose B computes nothing (its input needs no gradient).
:func:`backward_passes` says so; 2.5's executor cannot stop autograd at the weights (torch's
``stage_backward_weight`` reuses the gradients B saved at each layer's inputs instead).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from course.comm_counter import POINT_TO_POINT_OPS, CommCounter, CommRecord
from course.tensor_header import HEADER_SLOTS
from phase4_production.lm_blocks import ParallelMoE
from phase4_production.lm_layout import ZERO_BUBBLE

NAMES = ("tp", "cp", "pp", "dp", "dp_cp", "ep", "edp", "embedding")
ROWS = "all_to_all_single rows"  # the MoE rows: checked per ep group, not per rank
Key = tuple[str, str]


@dataclass
class Traffic:
    calls: int = 0
    nbytes: int = 0

    def add(self, calls: int, nbytes: int) -> None:
        self.calls += calls
        self.nbytes += calls * nbytes


def labels(topology: Any) -> dict[str, str]:
    """Each group name -> its label: the names of the groups with the same ranks, joined
    (``""`` for a group of one rank)."""
    by_ranks: dict[tuple[int, ...], list[str]] = defaultdict(list)
    for name in NAMES:
        by_ranks[topology.group_ranks(name)].append(name)
    return {
        name: ("" if len(ranks) == 1 else "+".join(by_ranks[ranks]))
        for ranks in by_ranks
        for name in by_ranks[ranks]
    }


def classify(record: CommRecord, topology: Any) -> str:
    """The label of the group ``record`` used ("" for one rank, "world" for the world)."""
    names = labels(topology)
    if record.op in POINT_TO_POINT_OPS:
        for name in ("pp", "cp", "dp_cp"):  # dp_cp: a hand-made all-reduce's sends
            if record.peer in topology.group_ranks(name) and record.peer != topology.rank:
                return names[name]
        return "outside"
    if record.group_ranks is None:
        return "world"
    for name in NAMES:
        if topology.group_ranks(name) == record.group_ranks:
            return names[name]
    return "outside"


def measure_step(model: Any, tokens: torch.Tensor, targets: torch.Tensor) -> dict[Key, Traffic]:
    """One training step of ``model`` (a ParallelLanguageModel) under CommCounter, by label and
    op; the MoE layers' row all-to-alls under ``ROWS``."""
    with CommCounter() as counter:
        model.train_step(tokens, targets)
    out: dict[Key, Traffic] = defaultdict(Traffic)
    experts = model.config.num_experts
    for record in counter.records:
        label = classify(record, model.topology)
        if not label:
            continue
        op = record.op
        if op == "all_to_all_single" and record.nbytes != experts * 8:
            op = ROWS
        out[(label, op)].add(1, record.nbytes)
    return dict(out)


def _params(model: Any, keep: Any) -> int:
    """Elements of the parameters (or, under ZeRO-2/3 and FSDP, of the units' slices) whose
    piece satisfies ``keep``."""
    if model.settings.zero in (2, 3, "fsdp"):
        return sum(
            unit.layout.shard_numel for unit in model.units
            if keep(model.pieces[id(unit.layout.params[0])])
        )  # fmt: skip
    seen: dict[int, Any] = {}
    for p in model.model.parameters():
        seen.setdefault(id(p), p)
    return sum(p.numel() for p in seen.values() if keep(model.pieces[id(p)]))


def expected_step(model: Any, batch_size: int) -> dict[Key, Traffic]:
    """The table :func:`measure_step` must give, from the formulas of the module docstring."""
    s, c, t = model.settings, model.config, model.topology
    e = model.chunks[0].dtype.itemsize
    m, tp, cp = s.microbatches, t.tp_size, t.cp_size
    b = batch_size // (s.dp * m)
    tokens = c.seq_len // cp
    between = tokens // tp if s.sequence_parallel else tokens  # tokens held between regions
    h, experts = c.width, c.num_experts
    moe = [layer for chunk in model.chunks for layer in chunk.layers if c.is_moe(layer)]
    by_name: dict[str, dict[str, Traffic]] = {name: defaultdict(Traffic) for name in NAMES}
    tp_, cp_ = by_name["tp"], by_name["cp"]
    block = b * tokens * (h // tp) * e
    for chunk, passes in zip(model.chunks, backward_passes(model), strict=True):
        regions = sum(1 if c.is_moe(layer) else 2 for layer in chunk.layers)
        if s.sequence_parallel:
            for runs in (1, passes):  # forward, then backward
                tp_["all_gather"].add(regions * m * runs, b * tokens * h * e)
                tp_["reduce_scatter_tensor"].add(regions * m * runs, b * tokens * h * e // tp)
        else:
            tp_["all_reduce"].add(regions * m * (1 + passes), b * tokens * h * e)
        for op in ("isend", "irecv"):
            cp_[op].add(len(chunk.layers) * m * (2 + 4 * passes) * (cp - 1), block)
    # the report: cross-entropy, balance, and every MoE layer's choices per expert (float64)
    report = 8 * (2 + len(c.moe_layers) * experts)
    if s.sequence_parallel:
        tp_["all_reduce"].add(1, report)
        tp_["all_reduce"].add(1, _params(model, lambda p: p.tp_replicated) * e)
        tp_["all_reduce"].add(len(moe) * m, b * experts * 8)  # balance counts
    cp_["all_reduce"].add(len(moe) * m, b * experts * 8)
    _pipeline(model, by_name["pp"], b, between, e)
    dp_cp = by_name["dp_cp"]
    dp_cp["all_reduce"].add(1, 8)  # count_valid_tokens
    dp_cp["all_reduce"].add(1, report)
    if s.zero == 0:
        dp_cp["all_reduce"].add(1, _params(model, lambda p: not p.expert) * e)
    if s.zero in (1, 2):
        times = 1 if s.zero == 1 else m
        for unit in model.units:
            dp_cp["reduce_scatter_tensor"].add(times, unit.layout.shard_numel * e)
            dp_cp["all_gather_into_tensor"].add(1, unit.layout.padded_numel * e)
    if s.zero in (3, "fsdp"):  # per micro-batch: gathered for forward and for backward
        for unit in model.units:
            dp_cp["reduce_scatter_tensor"].add(m, unit.layout.shard_numel * e)
            dp_cp["all_gather_into_tensor"].add(2 * m, unit.layout.padded_numel * e)
    by_name["pp"]["all_reduce"].add(1, report)  # summed over the stages
    ep_ = by_name["ep"]
    ep_["all_gather_into_tensor"].add(len(moe) * m, t.ep_size * experts * 8)
    ep_["all_to_all_single"].add(len(moe) * m, experts * 8)
    if moe:
        by_name["edp"]["all_reduce"].add(1, _params(model, lambda p: p.expert) * e)
    if any(p.tied for p in model.pieces.values()):
        by_name["embedding"]["all_reduce"].add(1, c.vocab * h * e)
    if s.max_norm is not None:
        for name in ("tp", "cp", "dp", "pp"):
            by_name[name]["all_reduce"].add(1, 8)
    names = labels(t)
    out: dict[Key, Traffic] = defaultdict(Traffic)
    for name, ops in by_name.items():
        if not names[name]:
            continue
        for op, traffic in ops.items():
            if traffic.calls:
                out[(names[name], op)].add(traffic.calls, 0)
                out[(names[name], op)].nbytes += traffic.nbytes
    return dict(out)


def backward_passes(model: Any) -> list[int]:
    """How many times each chunk's backward collectives run per micro-batch: once, or twice
    under a zero-bubble schedule (B for the input, W again for the weights), except on stage 0
    whose B has no input gradient to compute."""
    zero_bubble = model.settings.schedule in ZERO_BUBBLE
    return [
        2 if zero_bubble and model.executor.stage_of(chunk) > 0 else 1
        for chunk in range(len(model.chunks))
    ]


def _pipeline(model: Any, pp: dict[str, Traffic], b: int, between: int, e: int) -> None:
    """Activations forward and gradients back across stage boundaries between two ranks, one
    header per boundary (none where a V turns on one rank)."""
    links, m, h = model.executor.links, model.settings.microbatches, model.config.width
    last = links.last_stage
    message = b * between * h * e
    for chunk in range(len(model.chunks)):
        stage = model.executor.stage_of(chunk)
        if stage < last and not links.holds(stage + 1):
            pp["isend"].add(m, message)  # activations
            pp["irecv"].add(m, message)  # their gradients
            pp["isend"].add(1, HEADER_SLOTS * 8)
        if stage > 0 and not links.holds(stage - 1):
            pp["irecv"].add(m, message)
            pp["isend"].add(m, message)
            pp["irecv"].add(1, HEADER_SLOTS * 8)


def moe_rows_expected(model: Any, batch_size: int) -> int:
    """The MoE rows' bytes summed over one ep group: 4·k·T·h·e per layer and micro-batch for
    the group's T tokens (dispatch and combine, forward and backward; twice backward under a
    zero-bubble schedule)."""
    s, c, t = model.settings, model.config, model.topology
    e = model.chunks[0].dtype.itemsize
    m = s.microbatches
    b = batch_size // (s.dp * m)
    tokens = c.seq_len // t.cp_size
    if s.sequence_parallel:
        tokens //= t.tp_size
    group_tokens = b * tokens * t.ep_size
    passes = backward_passes(model)
    directions = sum(
        2 + 2 * passes[i]
        for i, chunk in enumerate(model.chunks)
        for block in chunk.blocks.values()
        if isinstance(block.mlp, ParallelMoE)
    )
    return m * directions * c.top_k * group_tokens * c.width * e


def differences(
    measured: dict[Key, Traffic], expected: dict[Key, Traffic]
) -> Iterable[tuple[Key, Traffic, Traffic]]:
    """Every (label, op) whose calls or bytes differ (the MoE rows excluded: per group)."""
    for key in sorted(set(measured) | set(expected)):
        if key[1] == ROWS:
            continue
        got, want = measured.get(key, Traffic()), expected.get(key, Traffic())
        if (got.calls, got.nbytes) != (want.calls, want.nbytes):
            yield key, got, want
