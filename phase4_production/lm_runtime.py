"""Given for exercise 4.7: the language model's training step on every axis, minus the thinking.

Not an exercise. ``template_lm_parallel.py``'s ``ParallelLanguageModel`` is a
:class:`LanguageModelRuntime` whose :attr:`~LanguageModelRuntime.functions` are yours. One step,
on every rank, from the GLOBAL batch (the same ``tokens`` and ``targets`` everywhere, as 3.6):

1. **This rank's tokens.** Its data-parallel replica's rows (contiguous, equal), then its
   context-parallel shard of every sequence (2.7's zig-zag ``shard_sequence``). The count of
   valid targets of the whole batch comes from yours (``count_valid_tokens``).
2. **The pipeline** (2.5's executor on the pp group, the schedule of the settings) runs the
   micro-batches through this rank's chunks (``lm_blocks.py``; with ``activation_checkpointing``
   each layer keeps only its input and is recomputed in backward by your 2.3 ``checkpoint``);
   the last stage turns its logits into your ``loss_share``, the executor divides every
   micro-batch's loss by m, so the runtime hands it ``m x`` the share. MoE layers attach their
   balance-loss shares to the backward.
3. **The gradients** this rank holds (:class:`~phase4_production.lm_support.HeldGradient`,
   whole or ZeRO slices) go through your ``finish_gradients`` (its data-parallel all-reduces with
   the settings' ``communication``: torch's, your 3.1 ring or 3.2 halving-doubling), then, with
   ``max_norm``, through
   3.6's ``clip_grad_norm_`` with your ``gradient_placements``.
4. **The optimizer** steps (AdamW, or the ZeRO/FSDP-style optimizer of 3.5 over the dp x cp
   group), and the step's losses are reported on every rank (:class:`StepReport`).

ZeRO-1 keeps whole gradients through backward; the runtime reduce-scatters each unit's over dp x
cp before step 3 (3.5's ``reduce_scatter``), so what your ``finish_gradients`` and the clipping see
are already-averaged slices, as under ZeRO-2, and then steps the slices and all-gathers the
parameters itself (3.5's step without its reduce-scatter): the gradients cross the data-parallel
ranks once, a reduce-scatter and an all-gather, as the ZeRO paper's stage 1 sends them, rather
than an all-reduce and then a reduce-scatter of what is already averaged.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from course.distributed import current_info
from course.language_model import LanguageModel
from course.topology import Topology
from phase3_multi_node.wrap_policy import UnitGroup, layers_of
from phase3_multi_node.zero_fsdp_support import MixedPrecision, full_master_state
from phase4_production.lm_blocks import Piece, StepContext, build_chunks, pieces_of
from phase4_production.lm_functions import CompositionFunctions
from phase4_production.lm_layout import ParallelSettings
from phase4_production.lm_support import HeldGradient, sequence_share

NORM_TYPE = 2.0
COMPILE_BACKEND_ENV = "DTFS_COMPILE_BACKEND"  # tests trace with "eager": Inductor's C++ is slow


@dataclass(frozen=True)
class StepTotals:
    """What every rank knows after a step's sums: the cross-entropy and balance loss, and per
    MoE layer (rows, in ``moe_layers`` order) how many token choices of the global batch went
    to each expert."""

    cross_entropy: float
    balance: float
    expert_choices: torch.Tensor

    def idle_experts(self, moe_layers: tuple[int, ...]) -> set[tuple[int, int]]:
        """(layer, expert) pairs that no token chose."""
        rows, experts = torch.nonzero(self.expert_choices == 0, as_tuple=True)
        return {(moe_layers[r], e) for r, e in zip(rows.tolist(), experts.tolist(), strict=True)}

    def report(self, config: Any, grad_norm: float | None, valid: int) -> StepReport:
        loss = self.cross_entropy + config.aux_coefficient * self.balance
        return StepReport(loss, self.cross_entropy, self.balance, grad_norm, valid)


@dataclass(frozen=True)
class StepReport:
    """One step's result, the same on every rank: the loss the step minimized
    (``cross_entropy + aux_coefficient * balance``), its two parts, the global gradient norm
    before clipping (None without clipping) and the valid targets of the global batch."""

    loss: float
    cross_entropy: float
    balance: float
    grad_norm: float | None
    valid_tokens: int


class LanguageModelRuntime:
    """This rank's part of the language model, its pipeline and its optimizer.

    ``LanguageModelRuntime(dense, topology, settings)``: ``dense`` is the one-process model (the
    same on every rank, e.g. ``build_language_model(config, seed)``), ``topology`` this rank's
    :class:`~course.topology.Topology` with the settings' degrees. Then
    :meth:`train_step` per global batch.
    """

    functions: ClassVar[CompositionFunctions]

    def __init__(
        self,
        dense: LanguageModel,
        topology: Topology,
        settings: ParallelSettings,
        device: torch.device | None = None,
    ) -> None:
        config = dense.config
        # where this rank computes: its GPU under NCCL, the CPU under gloo (course/distributed.py)
        self.device = device if device is not None else current_info().device
        dense = dense.to(self.device)
        settings.check(topology.world_size, config)
        degrees = (topology.dp_size, topology.cp_size, topology.tp_size, topology.pp_size)
        wanted = (settings.dp, settings.cp, settings.tp, settings.pp)
        if degrees != wanted or topology.ep_size != settings.ep:
            raise ValueError(
                f"the topology is {topology.grid.degrees()} but the settings say "
                f"{settings.label()}: build the Topology from the same degrees"
            )
        if settings.bf16_autocast and dense.head.weight.dtype != torch.float32:
            raise ValueError(
                f"bf16_autocast with a {dense.head.weight.dtype} model: autocast computes in "
                "bf16 from float32 parameters; build the model in float32"
            )
        fns = self.functions
        self.config, self.topology, self.settings = config, topology, settings
        self.placement = fns.placement_of(settings.schedule)
        self.context = StepContext()
        self.chunks = build_chunks(dense, fns, topology, settings, self.context, self.placement)
        if settings.compile:  # in place: the executor, the hooks and the pieces keep the chunks
            for chunk in self.chunks:
                chunk.compile(backend=os.environ.get(COMPILE_BACKEND_ENV, "inductor"))
        self.model = nn.ModuleList(self.chunks)
        holds_both = any(c.embedding is not None for c in self.chunks) and any(
            c.head is not None for c in self.chunks
        )
        self.pieces: dict[int, Piece] = pieces_of(self.chunks, config.tied and not holds_both)
        self.optimizer, self.units = self._optimizer()
        m = settings.microbatches
        actions = fns.make_schedule(settings.schedule, settings.pp, m, settings.chunks)
        self.executor = fns.executor(
            self.chunks,
            actions[topology.pp_rank],
            m,
            self._loss_fn,
            group=topology.pp_group,
            placement=self.placement,
        )
        self.global_valid = 0
        # settings.communication: the data-parallel reductions' all-reduce (None: torch's)
        self.all_reduce_fn: Callable[..., Any] | None = {
            "library": None,
            "ring": fns.ring_all_reduce,
            "tree": fns.halving_doubling_all_reduce,
        }[settings.communication]

    # ------------------------------------------------------------------ building

    def _optimizer(self) -> tuple[Any, list[Any]]:
        s, fns = self.settings, self.functions

        def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
            return torch.optim.AdamW(
                params, lr=s.lr, betas=s.betas, weight_decay=s.weight_decay, eps=1e-8,
                fused=s.fused_adamw or None,
            )  # fmt: skip

        group = self.topology.group("dp_cp")
        if s.zero == 0:
            return adamw(list(self.model.parameters())), []
        wrap = self.wrap_policy()
        if s.zero == "fsdp":
            _, optimizer = fns.fsdp_wrap(self.model, wrap, adamw, MixedPrecision(), 1, group)
        else:
            _, optimizer = fns.zero_wrap(self.model, adamw, int(s.zero), group, wrap)
        return optimizer, list(optimizer.units)

    def wrap_policy(self) -> list[UnitGroup]:
        """Which layers share a ZeRO or FSDP-style unit: each transformer block's layers, in
        one unit gathered around the block, as FSDP2 users call ``fully_shard`` on every block
        (its layers ordered by kind of gradient reduction, so that each kind is one run of the
        unit's flat buffer: :meth:`held_gradients` hands each run of this rank's slice to
        ``finish_gradients`` as its own gradient); the embedding, the final norm and the head
        each their own unit, gathered around themselves, so that every unit comes in the
        order it computes (a unit around the whole chunk would be first in forward order while
        its head computes last, and the backward prefetch would start its gather again after
        its gradients were reduced). One unit per layer would hand the collectives a dozen
        small buffers per block: at dp4 FSDP-style on 2 cores (width 64, 4 layers) 27 units
        took 361-459 ms a step, 5 units per block 149-170 ms, with the same losses."""
        groups: list[UnitGroup] = []
        for chunk in self.chunks:
            blocks = {id(m): block for block in chunk.blocks.values() for m in block.modules()}
            grouped: set[int] = set()
            for layer in layers_of(chunk):
                block = blocks.get(id(layer))
                if block is None:
                    groups.append((layer, [layer]))  # the embedding, final norm, head
                elif id(block) not in grouped:
                    grouped.add(id(block))
                    groups.append((block, sorted(layers_of(block), key=self._kind_of)))
        return groups

    def _kind_of(self, layer: nn.Module) -> tuple[bool, bool, bool]:
        """How a layer's gradient is reduced (``Piece``): tp-replicated first, then the shards."""
        piece = self.pieces[id(next(layer.parameters(recurse=False)))]
        return (not piece.tp_replicated, piece.tied, piece.expert)

    # ------------------------------------------------------------------ one step

    def _loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        topology = self.topology
        if self.settings.sequence_parallel:
            targets = sequence_share(targets, topology.tp_rank, topology.tp_size)
        share = self.functions.loss_share(logits, targets, self.global_valid, topology)
        return share * self.settings.microbatches  # the executor divides by m

    def local_batch(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's rows (its dp replica's) and positions (its cp shard) of a global batch."""
        topology = self.topology
        if batch.dim() != 2 or batch.shape[1] != self.config.seq_len:
            raise ValueError(
                f"a batch of shape {tuple(batch.shape)}: expected [sequences, "
                f"{self.config.seq_len}] (the model's seq_len)"
            )
        rows = batch.shape[0] // topology.dp_size
        mine = batch[topology.dp_rank * rows : (topology.dp_rank + 1) * rows].to(self.device)
        return self.functions.shard_sequence(
            mine, topology.cp_rank, topology.cp_size, zigzag=True, dim=1
        )

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor) -> StepReport:
        """One AdamW step on the GLOBAL batch (``tokens`` and ``targets`` [sequences, seq_len],
        the same on every rank; targets equal to IGNORE_INDEX do not count)."""
        settings, topology, fns = self.settings, self.topology, self.functions
        settings.check(topology.world_size, self.config, tokens.shape[0])
        if targets.shape != tokens.shape:
            raise ValueError(f"targets {tuple(targets.shape)} for tokens {tuple(tokens.shape)}")
        x, y = self.local_batch(tokens), self.local_batch(targets)
        self.global_valid = fns.count_valid_tokens(y, topology)
        self.context.clear(tokens.shape[0])
        self.optimizer.zero_grad(set_to_none=True)
        executor = self.executor
        result = executor.step(
            x if executor.links.holds(0) else None,
            y if executor.links.holds(executor.last_stage) else None,
        )
        totals = self._totals(result.loss)
        held = self.held_gradients()
        fns.finish_gradients(held, topology, settings.sequence_parallel, self.all_reduce_fn)
        grad_norm = None
        if settings.max_norm is not None:
            shards = fns.gradient_placements(held, topology)
            grad_norm = float(fns.clip_grad_norm(shards, settings.max_norm, NORM_TYPE, topology))
        self._leave_idle_experts(totals.idle_experts(self.config.moe_layers))
        if settings.zero == 1:  # the slices were reduced in held_gradients: step, gather
            self.optimizer.inner.step()
            for unit in self.units:
                unit.all_gather_params()
        else:
            self.optimizer.step()
        return totals.report(self.config, grad_norm, self.global_valid)

    def evaluate(self, tokens: torch.Tensor, targets: torch.Tensor) -> StepReport:
        """The losses of a global batch without updating anything. 2.5's executor has no
        forward-only mode, so this runs its step and drops the gradients (twice the work of a
        forward; the course's models are small)."""
        settings, topology, fns = self.settings, self.topology, self.functions
        settings.check(topology.world_size, self.config, tokens.shape[0])
        x, y = self.local_batch(tokens), self.local_batch(targets)
        self.global_valid = fns.count_valid_tokens(y, topology)
        self.context.clear(tokens.shape[0])
        executor = self.executor
        result = executor.step(
            x if executor.links.holds(0) else None,
            y if executor.links.holds(executor.last_stage) else None,
        )
        self.optimizer.zero_grad(set_to_none=True)
        return self._totals(result.loss).report(self.config, None, self.global_valid)

    def _totals(self, loss: float | None) -> StepTotals:
        """Sum the ranks' shares of the step's losses onto every rank (the loss shares, scaled
        by dp x cp for the gradient average, over the ranks holding other tokens; the MoE
        layers' over the pipeline stages too), and with them every MoE layer's token choices per
        expert (this rank's layers fill their rows, the stages' sums fill the rest): one
        all-reduce per group."""
        topology, config = self.topology, self.config
        choices = torch.zeros(len(config.moe_layers), config.num_experts, dtype=torch.float64)
        for row, layer in enumerate(config.moe_layers):
            if layer in self.context.expert_choices:
                choices[row] = self.context.expert_choices[layer].double()
        losses = torch.tensor([loss or 0.0, float(sum(float(b) for b in self.context.balance))],
                              dtype=torch.float64) / topology.size_of("dp_cp")  # fmt: skip
        parts = torch.cat([losses, choices.flatten()]).to(self.device)
        for name in ("dp_cp", "tp" if self.settings.sequence_parallel else None, "pp"):
            if name is not None and topology.size_of(name) > 1:  # a group of one adds nothing
                dist.all_reduce(parts, group=topology.group(name))
        parts = parts.cpu()
        return StepTotals(float(parts[0]), float(parts[1]), parts[2:].view_as(choices))

    def _leave_idle_experts(self, idle: set[tuple[int, int]]) -> None:
        """Drop the gradients of the experts that no token of the global batch chose.

        One process runs an expert only on the tokens that chose it (``dropless_moe``), so an
        expert nobody chose gets no gradient, and AdamW leaves a parameter without a gradient
        alone: no weight decay, no step count, moments unchanged. Here every expert runs, on
        zero rows when none arrive, and its reduced gradient is zero, which AdamW would step
        (its moments decay and move the weight). Whether a zero gradient means "not chosen" only
        the routing says (a sequence without valid targets gives zero gradients too), so the
        choices are counted and summed with the loss report."""
        if not idle:
            return
        for param in self.model.parameters():
            piece = self.pieces[id(param)]
            if piece.expert and (piece.layer, piece.expert_id) in idle:
                param.grad = None

    # ------------------------------------------------------------------ what a rank holds

    def held_gradients(self) -> list[HeldGradient]:
        """Every gradient this rank holds, in the same order on every rank of each group: whole
        (plain data parallel: averaged by you) or this rank's slices of ZeRO and FSDP-style
        units, averaged over dp x cp (during backward, or under ZeRO-1 here: a collective)."""
        out = []
        if self.settings.zero == 1:
            for unit in self.units:  # 3.5's step reduce-scatters these; the runtime does it first
                unit.adopt_gradients()
                assert unit.flat_grad is not None and unit.shard.grad is not None
                unit.shard.grad.copy_(unit.reduce_scatter(unit.flat_grad))
        if self.settings.zero in (1, 2, 3, "fsdp"):
            for unit in self.units:
                out += self._slice_runs(unit)
            return out
        seen: set[int] = set()
        for param in self.model.parameters():
            if id(param) in seen:
                continue
            seen.add(id(param))
            piece = self.pieces[id(param)]
            if param.grad is None:
                raise RuntimeError(
                    f"{piece.dense_name} has no gradient after the pipeline's step: every "
                    "weight of a chunk is used by every micro-batch"
                )
            out.append(
                HeldGradient(piece.dense_name, param.grad, piece.tp_replicated, piece.tied,
                             piece.expert)
            )  # fmt: skip
        return out

    def _slice_runs(self, unit: Any) -> list[HeldGradient]:
        """This rank's slice of a ZeRO or FSDP-style unit's gradient, cut into runs of one kind
        of reduction each (the wrap policy orders a block's layers by kind): views of the
        shard's gradient, so that reducing and clipping them acts on the shard. Every rank of a
        tp or embedding group holds the same layout and slice, so the same runs."""
        layout, grad = unit.layout, unit.shard.grad
        pieces = [self.pieces[id(p)] for p in layout.params]
        if grad is None:
            raise RuntimeError(f"{pieces[0].dense_name}: ZeRO left no gradient in its shard")
        runs: list[tuple[tuple[bool, bool, bool], int, int, list[str]]] = []
        for piece, offset, param in zip(pieces, layout.offsets, layout.params, strict=True):
            start = max(offset, layout.shard_start) - layout.shard_start
            stop = min(offset + param.numel(), layout.shard_stop) - layout.shard_start
            if start >= stop:
                continue  # this parameter lies outside this rank's slice
            kind = (piece.tp_replicated, piece.tied, piece.expert)
            if runs and runs[-1][0] == kind:
                runs[-1] = (kind, runs[-1][1], stop, [*runs[-1][3], piece.dense_name])
            else:
                runs.append((kind, start, stop, [piece.dense_name]))
        return [HeldGradient(",".join(names), grad[start:stop], *kind, reduced=True)
                for kind, start, stop, names in runs]  # fmt: skip

    def local_state(self) -> dict[str, torch.Tensor]:
        """This rank's piece of every parameter, named as in the one-process model (ZeRO and
        FSDP-style shards gathered: a collective over dp x cp, call it on every rank)."""
        zero = self.settings.zero
        if zero in (1, 2, 3):
            full = self.functions.full_state_dict(self.model, self.optimizer)
        elif zero == "fsdp":
            full = full_master_state(self.model, self.units)
        else:
            full = {name: p.detach().clone() for name, p in self.model.named_parameters()}
        params = dict(self.model.named_parameters())
        return {self.pieces[id(params[name])].dense_name: value for name, value in full.items()}

    def local_optimizer_state(self, key: str) -> dict[str, torch.Tensor]:
        """This rank's piece of one optimizer state tensor per parameter (AdamW's ``exp_avg``
        or ``exp_avg_sq``; zeros before the first step), named and shaped as :meth:`local_state`:
        under ZeRO and FSDP-style sharding each unit's slices are all-gathered over dp x cp (a
        collective) and cut back into the unit's parameters."""
        state = self.optimizer.state

        def of(stepped: torch.Tensor) -> torch.Tensor:
            held = state[stepped].get(key) if stepped in state else None
            return torch.zeros_like(stepped) if held is None else held

        if self.settings.zero == 0:
            full = {name: of(p).detach().clone() for name, p in self.model.named_parameters()}
        else:
            full = full_master_state(self.model, self.units, [of(u.shard) for u in self.units])
        params = dict(self.model.named_parameters())
        return {self.pieces[id(params[name])].dense_name: value for name, value in full.items()}

    def full_state(self, local: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The one-process model's whole state dict, on every rank, assembled from every rank's
        pieces (a collective over the world): tp shards concatenated, experts from their
        holders. For sampling text, or loading into another layout. ``local`` assembles other
        per-piece values instead of the weights (e.g. :meth:`local_optimizer_state`'s)."""
        local = self.local_state() if local is None else local
        state = {name: value.cpu() for name, value in local.items()}
        mine = (self.topology.tp_rank, state, {
            name: (p.how, p.fused_parts) for name, p in self.piece_of().items()
        })  # fmt: skip
        everyone: list[Any] = [None] * self.topology.world_size
        dist.all_gather_object(everyone, mine)
        return assemble_state(everyone, self.topology.tp_size, self.config.tied)

    def piece_of(self) -> dict[str, Piece]:
        """Which piece of each one-process parameter this rank holds, by dense name."""
        return {piece.dense_name: piece for piece in self.pieces.values()}

    def chunk_layers(self) -> list[range]:
        return [chunk.layers for chunk in self.chunks]


def assemble_state(everyone: list[Any], tp: int, tied: bool) -> dict[str, torch.Tensor]:
    """The whole state from ``(tp_rank, local_state, {name: (how, fused_parts)})`` of every rank
    (in rank order): a column piece is each fused block's rows of one tp rank, a row piece its
    columns.

    Pieces that several ranks hold (data- and context-parallel replicas, a tp-replicated norm,
    the two copies of a tied embedding) must be equal, bitwise: every copy receives the same
    reduced gradient and steps alike. Copies that differ mean a reduction missed a group, and
    a checkpoint of one of them would resume a model no rank trained: refused, naming the
    parameter and the ranks (:class:`ReplicasDiffer`).
    """
    by_name: dict[str, dict[int, torch.Tensor]] = {}
    holder: dict[tuple[str, int], int] = {}
    how_of: dict[str, tuple[str, int]] = {}
    for rank, (tp_rank, state, pieces) in enumerate(everyone):
        for name, value in state.items():
            first = by_name.setdefault(name, {}).setdefault(tp_rank, value)
            if first is not value:
                _same_replica(name, first, value, holder[(name, tp_rank)], rank)
            holder.setdefault((name, tp_rank), rank)
            how_of[name] = pieces[name]
    out = {}
    for name, per_tp in by_name.items():
        how, parts = how_of[name]
        if how == "column":
            blocks = [per_tp[t].chunk(parts, dim=0) for t in range(tp)]
            out[name] = torch.cat([torch.cat([b[i] for b in blocks]) for i in range(parts)])
        elif how == "row":
            out[name] = torch.cat([per_tp[t] for t in range(tp)], dim=1)
        else:
            out[name] = next(iter(per_tp.values()))
    if tied:
        if "head.weight" in out and "embedding.weight" in out:
            _same_replica("the tied embedding/head weight", out["embedding.weight"],
                          out["head.weight"], holder[("embedding.weight", 0)],
                          holder[("head.weight", 0)])  # fmt: skip
        out["head.weight"] = out.get("head.weight", out.get("embedding.weight"))  # type: ignore[assignment]
        out["embedding.weight"] = out["head.weight"]
    return out


class ReplicasDiffer(ValueError):
    """Two ranks hold different values for one piece that every copy should share."""


def _same_replica(name: str, a: torch.Tensor, b: torch.Tensor, rank_a: int, rank_b: int) -> None:
    if a.shape == b.shape and torch.equal(a, b):
        return
    gap = float((a.double() - b.double()).abs().max()) if a.shape == b.shape else math.inf
    scale = max(float(a.double().abs().max()), 1e-300) if a.numel() else 1.0
    if gap <= 1e3 * torch.finfo(a.dtype).eps * scale:
        why = (
            "they differ in their last bits only: the copies' gradients were rounded "
            "differently (for a tied weight, a hand-made all-reduce rounds each element by "
            "where it falls in the buffer, which differs between the stages), so the copies "
            "drift apart as training goes on"
        )
    else:
        why = (
            "every copy of a weight must receive the same reduced gradient: a reduction left "
            "out a group that holds copies (data, context, tensor-parallel replicas or the tied "
            "embedding's stages)"
        )
    raise ReplicasDiffer(
        f"{name}: rank {rank_a} and rank {rank_b} hold copies that differ (largest difference "
        f"{gap:.3e}): {why}. Refusing to assemble one model from them"
    )
