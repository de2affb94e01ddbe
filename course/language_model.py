"""A small decoder-only language model in one process: the model exercise 4.7 trains on every axis.

Given (not an exercise). Byte-level (a vocabulary of 256: any text is its UTF-8 bytes, no
tokenizer), Llama-shaped (Touvron et al., "LLaMA", 2023, section 2.2): token embedding, then
``layers`` pre-norm blocks ::

    x = x + Attention(RMSNorm(x))     causal multi-head attention, rotary positions on q and k
    x = x + MLP(RMSNorm(x))           SwiGLU, or a mixture of experts on chosen layers

then a final RMSNorm and an output head, which may share its weight with the embedding
(``tied``: Press and Wolf, "Using the Output Embedding to Improve Language Models", 2017). No
biases anywhere, as in Llama: a row-parallel layer's bias would be one more replicated weight.

* **RMSNorm** (Zhang and Sennrich, 2019): ``x / sqrt(mean(x^2) + eps) * weight``, per token.
* **Rotary positions** (Su et al., "RoFormer", 2021): each pair of q's and k's features is turned
  by an angle proportional to the token's *position*, so q·k depends on the distance between the
  two positions only. The position is the token's place in the whole sequence: a rank that holds
  some chunks of the sequence (context parallelism) must use their true positions.
* **SwiGLU** (Shazeer, "GLU Variants Improve Transformer", 2020): ``down(silu(gate(x)) * up(x))``
  with gate and up fused into one ``[2 * ffn, width]`` weight (gate rows first), so a
  column-parallel shard takes its slice of each (2.6's ``fused_parts=2``).
* **Mixture of experts** on the layers listed in ``moe_layers``: exercise 3.8's ``DenseMoE``
  (router and GELU experts), dropless (every expert takes every token that chose it: capacity
  would make the result depend on which tokens share an expert-parallel group), its
  load-balancing loss computed per *sequence* (:func:`sequence_balance_loss`), which is the same
  whatever the layout, and added with ``aux_coefficient``.

The loss is the mean cross-entropy over every *valid* target (targets equal to
:data:`IGNORE_INDEX` are masked out, as ``F.cross_entropy``'s ``ignore_index``), plus the
coefficient times the sum over MoE layers of their balance loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from course.moe_model import DenseMoE, MoEConfig

IGNORE_INDEX = -100  # a target that does not count (F.cross_entropy's default ignore_index)
VOCAB = 256  # bytes

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LMConfig:
    """Every size of the model. Tiny defaults: a step on a CPU takes milliseconds."""

    width: int = 64
    heads: int = 4
    layers: int = 4
    ffn: int = 128  # SwiGLU's inner width
    seq_len: int = 128
    tied: bool = False
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 4
    top_k: int = 2
    expert_ffn: int = 64
    aux_coefficient: float = 0.01
    rope_base: float = 10000.0
    norm_eps: float = 1e-6
    vocab: int = VOCAB

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layers

    def moe_config(self) -> MoEConfig:
        """3.8's settings for one MoE layer; capacity E/k is dropless (see the module doc)."""
        return MoEConfig(
            hidden=self.width,
            ffn_hidden=self.expert_ffn,
            num_experts=self.num_experts,
            k=self.top_k,
            capacity_factor=self.num_experts / self.top_k,
        )

    def problems(self) -> list[str]:
        """Every setting that cannot build a model, each with its fix (empty when fine)."""
        out = []
        for name in ("width", "heads", "layers", "ffn", "seq_len", "vocab"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                out.append(f"{name}={value!r}: a whole number >= 1")
        if not out and self.width % self.heads:
            out.append(
                f"width={self.width} does not divide into heads={self.heads}: every head has "
                f"width/heads features; choose heads in "
                f"{[h for h in range(1, self.width + 1) if self.width % h == 0][:8]}"
            )
        elif not out and self.head_dim % 2:
            out.append(
                f"width/heads = {self.head_dim} is odd: rotary positions turn pairs of a head's "
                "features; choose an even head size"
            )
        bad = [m for m in self.moe_layers if not isinstance(m, int) or not 0 <= m < self.layers]
        if bad:
            out.append(f"moe_layers={list(self.moe_layers)}: layers are 0..{self.layers - 1}")
        if self.moe_layers and not 1 <= self.top_k <= self.num_experts:
            out.append(f"top_k={self.top_k} with num_experts={self.num_experts}: 1 <= k <= E")
        if self.moe_layers and self.expert_ffn < 1:
            out.append(f"expert_ffn={self.expert_ffn}: a whole number >= 1")
        if not math.isfinite(self.aux_coefficient) or self.aux_coefficient < 0:
            out.append(f"aux_coefficient={self.aux_coefficient}: a finite number >= 0")
        return out

    def check(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(problems))


# ----------------------------------------------------------------------------- pieces


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(
    positions: torch.Tensor, head_dim: int, base: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of every position's angles, each [len(positions), head_dim / 2]:
    feature pair i of a token at position p turns by ``p * base^(-2i / head_dim)``."""
    pairs = torch.arange(head_dim // 2, dtype=torch.float64, device=positions.device)
    frequencies = base ** (-2.0 * pairs / head_dim)
    angles = positions.to(torch.float64)[:, None] * frequencies[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Turn each (first-half, second-half) feature pair of ``x`` [batch, heads, tokens, d] by its
    token's angles (``cos``/``sin`` [tokens, d/2]), the "rotate half" form of GPT-NeoX/Llama."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One process's attention over the whole sequence."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary positions; fused ``qkv`` ([q; k; v] rows,
    each head-major) and ``out``, no biases."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = config.heads, config.head_dim
        self.qkv = nn.Linear(config.width, 3 * config.width, bias=False)
        self.out = nn.Linear(config.width, config.width, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        batch, tokens, _ = x.shape
        qkv = self.qkv(x).view(batch, tokens, 3, self.heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [batch, heads, tokens, head_dim]
        mixed = attention(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v)
        return self.out(mixed.transpose(1, 2).reshape(batch, tokens, -1))


class SwiGLU(nn.Module):
    """``down(silu(gate) * up)`` with ``gate_up`` = [gate; up] fused, no biases."""

    def __init__(self, width: int, ffn: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(width, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


@dataclass
class Routing:
    """What one MoE layer decided for a batch: router probabilities [batch, tokens, E] and each
    token's chosen experts [batch, tokens, k] (the balance loss is computed from both)."""

    probs: torch.Tensor
    experts: torch.Tensor


def dropless_moe(moe: DenseMoE, x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
    """One process's MoE layer on x [batch, tokens, width]: each token's k most probable
    experts (weights renormalized to sum to 1), every expert run on every token that chose it."""
    batch, tokens, width = x.shape
    flat = x.reshape(-1, width)
    probs = torch.softmax(moe.router(flat), dim=-1)
    top_probs, top_experts = probs.topk(moe.config.k, dim=-1)
    weights = top_probs / top_probs.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(flat)
    for expert_id, expert in enumerate(moe.experts):
        token, choice = torch.nonzero(top_experts == expert_id, as_tuple=True)
        if token.numel():
            contribution = expert(flat[token]) * weights[token, choice, None]
            out = out.index_add(0, token, contribution.to(out.dtype))  # bf16 under autocast
    routing = Routing(probs.view(batch, tokens, -1), top_experts.view(batch, tokens, -1))
    return out.view(batch, tokens, width), routing


def sequence_balance_loss(routing: Routing, num_experts: int) -> torch.Tensor:
    """The load-balancing loss of one MoE layer: per sequence b, ``E * sum_e f[b,e] * P[b,e]``
    (``f``: the share of the sequence's token choices that named expert e; ``P``: e's router
    probability averaged over the sequence's tokens; Switch Transformer's eq. 4 per sequence,
    as DeepSeek-V3's sequence-wise balance loss), averaged over the sequences."""
    _, tokens, k = routing.experts.shape
    counts = F.one_hot(routing.experts, num_experts).sum(dim=(1, 2)).to(routing.probs.dtype)
    fraction = counts / (tokens * k)  # [batch, E], no gradient
    mean_prob = routing.probs.mean(dim=1)  # [batch, E]
    return (num_experts * (fraction * mean_prob).sum(dim=-1)).mean()


class Block(nn.Module):
    """``x + attention(norm(x))``, then ``x + mlp(norm(x))``; the MLP is SwiGLU or a DenseMoE."""

    def __init__(self, config: LMConfig, layer: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.width, config.norm_eps)
        self.attention = Attention(config)
        self.mlp_norm = RMSNorm(config.width, config.norm_eps)
        self.mlp: nn.Module
        if config.is_moe(layer):
            self.mlp = DenseMoE(config.moe_config())
        else:
            self.mlp = SwiGLU(config.width, config.ffn)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionFn
    ) -> tuple[torch.Tensor, Routing | None]:
        x = x + self.attention(self.attention_norm(x), cos, sin, attention)
        if isinstance(self.mlp, DenseMoE):
            mixed, routing = dropless_moe(self.mlp, self.mlp_norm(x))
            return x + mixed, routing
        return x + self.mlp(self.mlp_norm(x)), None


@dataclass
class ModelOutput:
    """Logits [batch, tokens, vocab] and the routing of every MoE layer, by layer index."""

    logits: torch.Tensor
    routings: dict[int, Routing] = field(default_factory=dict)


class LanguageModel(nn.Module):
    """The whole model in one process. ``forward(tokens)`` on [batch, tokens] byte ids (at most
    ``seq_len`` of them); :meth:`loss` adds the targets."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        config.check()
        self.config = config
        self.embedding = nn.Embedding(config.vocab, config.width)
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.layers))
        self.final_norm = RMSNorm(config.width, config.norm_eps)
        self.head = nn.Linear(config.width, config.vocab, bias=False)
        nn.init.normal_(self.embedding.weight, std=0.02)  # GPT-2's scale: tied logits stay small
        if config.tied:
            self.head.weight = self.embedding.weight

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> ModelOutput:
        config = self.config
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        dtype = self.head.weight.dtype
        cos, sin = rotary_tables(positions, config.head_dim, config.rope_base, dtype)
        x = self.embedding(tokens)
        routings = {}
        for layer, block in enumerate(self.blocks):
            x, routing = block(x, cos.to(x.device), sin.to(x.device), causal_attention)
            if routing is not None:
                routings[layer] = routing
        return ModelOutput(self.head(self.final_norm(x)), routings)

    def loss(
        self, tokens: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cross_entropy, balance)``: the mean cross-entropy over every valid target, and the
        sum over MoE layers of their balance loss (zero without MoE). Train on
        ``cross_entropy + config.aux_coefficient * balance``."""
        output = self.forward(tokens)
        ce = F.cross_entropy(
            output.logits.reshape(-1, self.config.vocab),
            targets.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        ) / valid_count(targets)
        balance = torch.zeros((), dtype=ce.dtype, device=ce.device)
        for routing in output.routings.values():
            balance = balance + sequence_balance_loss(routing, self.config.num_experts)
        return ce, balance


def valid_count(targets: torch.Tensor) -> int:
    """How many targets count (are not :data:`IGNORE_INDEX`); ValueError when none does."""
    count = int((targets != IGNORE_INDEX).sum())
    if count == 0:
        raise ValueError("every target is masked: the mean loss over valid tokens is undefined")
    return count


def uneven_batch(
    step: int, config: LMConfig, global_batch: int = 8, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch of random bytes whose targets are masked unevenly: the second half of the
    rows loses most of its targets (75% against 15%) and even rows their last quarter, so that
    data-parallel replicas and context-parallel shards hold different numbers of valid targets;
    every row keeps its first target. The same for one ``(step, seed)`` on every rank."""
    g = torch.Generator().manual_seed(10_000 * seed + 1000 + step)
    shape = (global_batch, config.seq_len)
    tokens = torch.randint(0, config.vocab, shape, generator=g)
    targets = torch.randint(0, config.vocab, shape, generator=g)
    rows = torch.arange(global_batch)[:, None]
    cols = torch.arange(config.seq_len)[None, :]
    masked = torch.rand(shape, generator=g) < torch.where(rows >= global_batch // 2, 0.75, 0.15)
    masked |= (rows % 2 == 0) & (cols >= config.seq_len * 3 // 4)
    masked[:, 0] = False
    return tokens, targets.masked_fill(masked, IGNORE_INDEX)


def build_language_model(
    config: LMConfig, seed: int = 0, dtype: torch.dtype = torch.float64
) -> LanguageModel:
    """The same model on every rank for one seed (built under a forked RNG: the caller's random
    state is left alone)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LanguageModel(config)
    return model.to(dtype)


@torch.no_grad()
def generate(
    model: LanguageModel, prompt: bytes, length: int, *, temperature: float = 0.8, seed: int = 0
) -> bytes:
    """``length`` more bytes after ``prompt``, each sampled from the model's next-byte
    distribution at ``temperature`` (the context cut to the last ``seq_len`` bytes)."""
    if not prompt:
        raise ValueError("generate needs a prompt of at least one byte")
    generator = torch.Generator().manual_seed(seed)
    device = model.head.weight.device
    out = list(prompt)
    for _ in range(length):
        context = torch.tensor([out[-model.config.seq_len :]], device=device)
        logits = model(context).logits[0, -1].double() / max(temperature, 1e-6)
        probs = torch.softmax(logits, dim=-1).cpu()
        out.append(int(torch.multinomial(probs, 1, generator=generator)))
    return bytes(out)
