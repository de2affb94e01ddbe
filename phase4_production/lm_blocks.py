"""Given for exercise 4.7: one rank's chunks of the language model, cut from the one-process model.

Not an exercise: this builds the pieces; where their collectives go and which groups reduce what
is yours (``template_lm_parallel.py``, ``template_lm_sequence_parallel.py``). A rank of the
pipeline holds one chunk per virtual stage (2.5's placements): a contiguous run of layers, the
embedding on virtual stage 0, the final norm and the head on the last one. Inside a chunk, every
layer is cut as Megatron-LM cuts a transformer layer (Shoeybi et al. 2019, section 3):

* attention: the fused q/k/v projection column-parallel by heads (2.6's
  ``ColumnParallelLinear.from_weights(..., fused_parts=3)``), rotary positions at the tokens'
  true positions (:meth:`CompositionFunctions.token_positions`), attention over the whole
  sequence by 2.7's ring attention on the cp group (``scaled_dot_product_attention`` when cp is
  1), the output projection row-parallel;
* SwiGLU: gate and up column-parallel (``fused_parts=2``), down row-parallel;
* a MoE MLP: 3.8's ``MoELayer`` on the ep group, its balance loss attached to the stage's
  backward (``AttachLoss``);
* RMSNorms, the embedding and the head are whole on every tp rank (the embedding and head work
  on this rank's share of the tokens under sequence parallelism).

Each tensor-parallel region starts with ``enter_tensor_parallel`` and ends with
``leave_tensor_parallel`` (yours). The layers keep the one-process model's attribute names, so
``blocks.2.attention.qkv.weight`` of a chunk is this rank's piece of the one-process
``blocks.2.attention.qkv.weight``; :class:`Piece` says which piece.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from course.language_model import (
    Attention,
    Block,
    LanguageModel,
    LMConfig,
    SwiGLU,
    apply_rotary,
    causal_attention,
    rotary_tables,
)
from course.tensor_header import TensorMeta
from course.topology import Topology
from phase2_advanced.pipeline_layout import virtual_stage
from phase3_multi_node.moe_experts import DenseMoE
from phase4_production.lm_functions import CompositionFunctions
from phase4_production.lm_layout import ParallelSettings
from phase4_production.lm_support import AttachLoss, sequence_share


@dataclass
class StepContext:
    """What the blocks need to know about the step in progress (set by the runtime): the number
    of sequences in the global batch, the balance-loss shares computed so far, and per MoE layer
    how many of this rank's token choices went to each expert (summed over micro-batches)."""

    global_sequences: int = 0
    balance: list[torch.Tensor] = field(default_factory=list)
    expert_choices: dict[int, torch.Tensor] = field(default_factory=dict)

    def clear(self, global_sequences: int) -> None:
        """A new step (or evaluation) of ``global_sequences`` sequences begins."""
        self.global_sequences = global_sequences
        self.balance.clear()
        self.expert_choices.clear()


@dataclass(frozen=True)
class Piece:
    """Which piece of a one-process parameter a chunk's parameter is.

    ``how``: ``"whole"``; ``"column"`` (this tp rank's rows, from each of ``fused_parts``
    stacked blocks); ``"row"`` (this tp rank's columns); ``"expert"`` (expert ``expert_id`` of
    the layer, whole; ``layer`` is the model's layer number). ``tp_replicated``, ``expert`` and
    ``tied`` as in ``HeldGradient``.
    """

    dense_name: str
    how: str = "whole"
    fused_parts: int = 1
    expert_id: int = -1
    layer: int = -1
    tp_replicated: bool = True
    expert: bool = False
    tied: bool = False


@dataclass(frozen=True)
class Wiring:
    """Everything a chunk's layers share: the functions, this rank's topology and settings, the
    model's sizes, the step's context, and the rotary tables of this rank's tokens."""

    functions: CompositionFunctions
    topology: Topology
    settings: ParallelSettings
    config: LMConfig
    context: StepContext
    cos: torch.Tensor
    sin: torch.Tensor

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Your ``enter_tensor_parallel`` on this rank's tp group; with tp = 1 the region is the
        whole layer already, and nothing runs (no collective on a group of one rank: each
        costs a call into the backend and back, 16 per step at pp4 with 4 layers)."""
        t = self.topology
        if t.tp_size == 1:
            return x
        return self.functions.enter_tensor_parallel(x, t.tp_group, self.settings.sequence_parallel)

    def leave(self, y: torch.Tensor) -> torch.Tensor:
        """Your ``leave_tensor_parallel`` on this rank's tp group; nothing with tp = 1."""
        t = self.topology
        if t.tp_size == 1:
            return y
        return self.functions.leave_tensor_parallel(y, t.tp_group, self.settings.sequence_parallel)


class LocalLinear(nn.Module):
    """``x @ weight.T`` with this rank's piece of a weight: no bias, no communication (the
    region's entrance and exit do that). A module, so that ZeRO-3's hooks see it run."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class ParallelAttention(nn.Module):
    def __init__(self, dense: Attention, wiring: Wiring) -> None:
        super().__init__()
        fns, group = wiring.functions, wiring.topology.tp_group
        qkv = fns.column_parallel.from_weights(dense.qkv.weight, None, group, fused_parts=3)
        out = fns.row_parallel.from_weights(dense.out.weight, None, group, input_is_parallel=True)
        self.qkv, self.out = LocalLinear(qkv.weight), LocalLinear(out.weight)
        self.wiring = wiring
        self.local_heads = dense.heads // wiring.topology.tp_size
        self.head_dim = dense.head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.wiring
        topology = w.topology
        whole = w.enter(x)
        batch, tokens, _ = whole.shape
        qkv = self.qkv(whole).view(batch, tokens, 3, self.local_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [batch, local heads, tokens, head_dim]
        q, k = apply_rotary(q, w.cos, w.sin), apply_rotary(k, w.cos, w.sin)
        if topology.cp_size > 1:
            mixed = w.functions.ring_attention(q, k, v, topology.cp_group, causal=True, zigzag=True)
        else:
            mixed = causal_attention(q, k, v)
        partial = self.out(mixed.transpose(1, 2).reshape(batch, tokens, -1))
        return w.leave(partial)


class ParallelSwiGLU(nn.Module):
    def __init__(self, dense: SwiGLU, wiring: Wiring) -> None:
        super().__init__()
        fns, group = wiring.functions, wiring.topology.tp_group
        gate_up = fns.column_parallel.from_weights(dense.gate_up.weight, None, group, fused_parts=2)
        down = fns.row_parallel.from_weights(dense.down.weight, None, group, input_is_parallel=True)
        self.gate_up, self.down = LocalLinear(gate_up.weight), LocalLinear(down.weight)
        self.wiring = wiring

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.wiring
        gate, up = self.gate_up(w.enter(x)).chunk(2, dim=-1)
        return w.leave(self.down(F.silu(gate) * up))


class ParallelMoE(nn.Module):
    """3.8's MoELayer on this rank's tokens (whole or, with sequence parallelism, its share),
    and the layer's balance-loss share attached to the stage's backward."""

    def __init__(self, dense: DenseMoE, wiring: Wiring, layer: int) -> None:
        super().__init__()
        self.layer = wiring.functions.moe_layer(dense, wiring.topology.group("ep"))
        self.wiring = wiring
        self.index = layer  # the model's layer number

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.wiring
        batch, tokens, width = x.shape
        out, _ = self.layer(x.reshape(-1, width))  # 3.8's own per-rank loss is not the model's
        step = self.layer.last
        moe = w.config
        choices = torch.bincount(step.routing.experts.flatten().cpu(), minlength=moe.num_experts)
        counted = w.context.expert_choices.get(self.index)
        w.context.expert_choices[self.index] = choices if counted is None else counted + choices
        share = w.functions.balance_loss_share(
            step.routing.probs.view(batch, tokens, -1),
            step.routing.experts.view(batch, tokens, -1),
            moe.num_experts,
            moe.seq_len,
            w.context.global_sequences,
            w.topology,
            w.settings.sequence_parallel,
        )
        w.context.balance.append(share.detach())
        return AttachLoss.apply(out.view(batch, tokens, width), moe.aux_coefficient * share)


class ParallelBlock(nn.Module):
    def __init__(self, dense: Block, wiring: Wiring, layer: int) -> None:
        super().__init__()
        self.attention_norm = copy.deepcopy(dense.attention_norm)
        self.attention = ParallelAttention(dense.attention, wiring)
        self.mlp_norm = copy.deepcopy(dense.mlp_norm)
        self.mlp: nn.Module
        if isinstance(dense.mlp, DenseMoE):
            self.mlp = ParallelMoE(dense.mlp, wiring, layer)
        else:
            assert isinstance(dense.mlp, SwiGLU)
            self.mlp = ParallelSwiGLU(dense.mlp, wiring)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class StageChunk(nn.Module):
    """One virtual stage: [embedding] + a run of layers + [final norm and head]."""

    def __init__(
        self, dense: LanguageModel, layers: range, first: bool, last: bool, wiring: Wiring
    ) -> None:
        super().__init__()
        self.wiring = wiring
        self.layers = layers
        self.embedding = copy.deepcopy(dense.embedding) if first else None
        self.blocks = nn.ModuleDict(
            {str(i): ParallelBlock(cast(Block, dense.blocks[i]), wiring, i) for i in layers}
        )
        self.final_norm = copy.deepcopy(dense.final_norm) if last else None
        self.head = LocalLinear(dense.head.weight) if last else None
        self.dtype = dense.head.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        settings = self.wiring.settings
        topology, sp = self.wiring.topology, settings.sequence_parallel
        if self.embedding is not None:
            if sp:
                x = sequence_share(x, topology.tp_rank, topology.tp_size)
            x = self.embedding(x)
        recompute = settings.activation_checkpointing and torch.is_grad_enabled()
        # bf16 autocast: the products in bf16, the residual stream (float32 + bf16) float32
        with torch.autocast(x.device.type, torch.bfloat16, enabled=settings.bf16_autocast):
            for block in self.blocks.values():  # with recompute, your 2.3 checkpoint keeps x
                x = self.wiring.functions.checkpoint(block, x) if recompute else block(x)
            if self.final_norm is not None and self.head is not None:
                x = self.head(self.final_norm(x))
        return x.to(self.dtype)  # what output_meta promises the next stage and the loss

    def output_meta(self, meta: TensorMeta) -> TensorMeta:
        """The output's shape and dtype for an input described by ``meta`` (the pipeline asks
        before any data moves; ring attention cannot run on the meta device)."""
        batch, tokens = meta.shape[0], meta.shape[1]
        if self.embedding is not None and self.wiring.settings.sequence_parallel:
            tokens //= self.wiring.topology.tp_size
        width = self.wiring.config.vocab if self.head is not None else self.wiring.config.width
        return TensorMeta((batch, tokens, width), self.dtype)


def split_layers(layers: int, stages: int) -> list[range]:
    """``layers`` cut into ``stages`` contiguous runs, as equal as they can be (the first
    ``layers % stages`` runs one longer)."""
    if stages < 1 or layers < stages:
        raise ValueError(f"{layers} layers cannot fill {stages} stages: at least one each")
    base, extra = divmod(layers, stages)
    runs, start = [], 0
    for stage in range(stages):
        size = base + (stage < extra)
        runs.append(range(start, start + size))
        start += size
    return runs


def build_chunks(
    dense: LanguageModel,
    functions: CompositionFunctions,
    topology: Topology,
    settings: ParallelSettings,
    context: StepContext,
    placement: str,
) -> list[StageChunk]:
    """This rank's chunks, chunk 0 first (chunk c is virtual stage ``virtual_stage(pp_rank, c)``).

    When this rank holds both the embedding and the head of a tied model (pp == 1, or the V of
    zb-v), the head uses the embedding's own parameter: autograd then adds both uses."""
    config = dense.config
    positions = functions.token_positions(config.seq_len, topology.cp_rank, topology.cp_size)
    dtype = dense.head.weight.dtype
    device = dense.head.weight.device
    cos, sin = rotary_tables(positions, config.head_dim, config.rope_base, dtype)
    wiring = Wiring(functions, topology, settings, config, context, cos.to(device), sin.to(device))
    runs = split_layers(config.layers, settings.virtual_stages)
    last = settings.virtual_stages - 1
    chunks = []
    for chunk in range(settings.chunks_per_rank):
        stage = virtual_stage(topology.pp_rank, chunk, topology.pp_size, placement)
        chunks.append(StageChunk(dense, runs[stage], stage == 0, stage == last, wiring))
    embeddings = [c.embedding for c in chunks if c.embedding is not None]
    heads = [c.head for c in chunks if c.head is not None]
    if config.tied and embeddings and heads:
        heads[0].weight = cast(nn.Parameter, embeddings[0].weight)
    return chunks


def pieces_of(chunks: list[StageChunk], tied_elsewhere: bool) -> dict[int, Piece]:
    """``id(parameter) -> Piece`` for every parameter of this rank's chunks; ``tied_elsewhere``:
    the model is tied and the other copy of the embedding lives on another rank."""
    out: dict[int, Piece] = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if id(param) not in out:
                out[id(param)] = _piece(chunk, name, tied_elsewhere)
    return out


def _piece(chunk: StageChunk, name: str, tied_elsewhere: bool) -> Piece:
    parts = name.split(".")
    if parts[0] in ("embedding", "head"):
        return Piece(f"{parts[0]}.weight", tied=tied_elsewhere)
    if parts[0] == "final_norm" or parts[2] in ("attention_norm", "mlp_norm"):
        return Piece(name)
    layer, kind = parts[1], parts[3]
    if kind in ("qkv", "gate_up"):
        return Piece(name, "column", 3 if kind == "qkv" else 2, tp_replicated=False)
    if kind in ("out", "down"):
        return Piece(name, "row", tp_replicated=False)
    # MoE: blocks.L.mlp.layer.router.weight, blocks.L.mlp.layer.experts.experts.j.fcN.weight
    if parts[4] == "router":
        return Piece(f"blocks.{layer}.mlp.router.weight")
    moe = chunk.blocks[layer].mlp
    assert isinstance(moe, ParallelMoE), name
    expert_id = moe.layer.experts.first + int(parts[6])
    tail = ".".join(parts[7:])
    dense = f"blocks.{layer}.mlp.experts.{expert_id}.{tail}"
    return Piece(dense, "expert", expert_id=expert_id, layer=int(layer), expert=True)
