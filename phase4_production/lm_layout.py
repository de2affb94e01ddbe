"""Given for exercise 4.7: the settings of a run on every axis, and every refusal before launch.

Not an exercise. :class:`ParallelSettings` names the degrees (dp, cp, tp, pp, and ep laid over
dp x cp), sequence parallelism, the pipeline's schedule and micro-batches, the data-parallel
sharding (``zero``: 0 plain, 1-3 ZeRO's stages, ``"fsdp"`` 3.5's FSDP-style units), gradient
clipping and AdamW's settings. :meth:`ParallelSettings.problems` lists everything that cannot run
with a model (:class:`~course.language_model.LMConfig`) on a world, each with its fix, before any
process starts: degrees that do not fill the world, heads or widths that tp does not divide, a
sequence that does not cut into 2 x cp zig-zag chunks (and, with sequence parallelism, into tp
shares of those), experts that ep does not divide, more pipeline stages than layers, and the
combinations the course's pieces do not support (each says why).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from course.language_model import LMConfig
from course.topology import RankGrid

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
ZERO_BUBBLE = ("zb-h1", "zb-v")
ZERO_CHOICES = (0, 1, 2, 3, "fsdp")
# library: torch's all-reduce; ring: 3.1's ring_all_reduce; tree: 3.2's halving_doubling_all_reduce
COMMUNICATION = ("library", "ring", "tree")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelSettings:
    """One layout of the language model's training, and its optimizer."""

    dp: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    microbatches: int = 1
    chunks: int = 2  # virtual stages per rank, for the interleaved schedule
    zero: int | str = 0
    max_norm: float | None = None
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    # the all-reduce of the data-parallel gradient reductions: torch's, 3.1's ring, 3.2's
    # halving-doubling (COMMUNICATION); ZeRO reduces with its own reduce-scatter instead
    communication: str = "library"
    # each layer keeps only its input and recomputes its forward in backward (your 2.3
    # checkpoint, Megatron's full recompute): activations traded for a second forward
    activation_checkpointing: bool = False
    # speed without a change of values' meaning: AdamW's fused kernel (one kernel for all the
    # parameters, ``torch.optim.AdamW(fused=True)``), and each chunk compiled
    # (``nn.Module.compile``: TorchDynamo traces it, Inductor generates its kernels)
    fused_adamw: bool = False
    compile: bool = False
    # mixed precision: the chunks' forward under ``torch.autocast`` in bfloat16 (matrix products
    # in bf16, reductions and the loss in float32), the parameters, gradients and AdamW's states
    # float32, as GPU runs train (torchtitan's default; Micikevicius et al. 2018 for the idea)
    bf16_autocast: bool = False

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def chunks_per_rank(self) -> int:
        """Model chunks each pipeline rank holds: v for interleaved, 2 for the V of zb-v."""
        if self.schedule == "interleaved":
            return self.chunks
        return 2 if self.schedule == "zb-v" else 1

    @property
    def virtual_stages(self) -> int:
        return self.pp * self.chunks_per_rank

    def label(self) -> str:
        """``dp2 x cp2 x tp2 (sp) x pp2`` and the rest that is not the default."""
        shown = [
            f"{axis}{getattr(self, axis)}"
            for axis in ("dp", "cp", "tp", "pp", "ep")
            if getattr(self, axis) > 1
        ]
        text = " x ".join(shown) or "one rank"
        if self.sequence_parallel and self.tp > 1:
            text = text.replace(f"tp{self.tp}", f"tp{self.tp}+sp")
        if self.pp > 1:
            text += f" ({self.schedule}, m={self.microbatches})"
        if self.zero:
            text += f", zero={self.zero}"
        if self.communication != "library":
            text += f", {self.communication} all-reduce"
        if self.activation_checkpointing:
            text += ", recompute"
        if self.fused_adamw:
            text += ", fused AdamW"
        if self.compile:
            text += ", compiled"
        if self.bf16_autocast:
            text += ", bf16 autocast"
        return text

    def grid(self) -> RankGrid:
        return RankGrid(self.dp, self.tp, self.pp, cp=self.cp, ep=self.ep)

    def problems(self, config: LMConfig, global_batch: int | None = None) -> list[str]:
        """Everything that cannot run, each naming the value and the fix (empty when fine)."""
        out = [f"model: {p}" for p in config.problems()]
        for name in ("dp", "cp", "tp", "pp", "ep", "microbatches", "chunks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                out.append(f"{name}={value!r}: a whole number >= 1")
        if out:
            return out
        if (self.dp * self.cp) % self.ep:
            out.append(
                f"ep={self.ep} does not divide dp={self.dp} x cp={self.cp}: the expert-parallel "
                f"groups are carved out of the data x context ranks; choose ep in "
                f"{_divisors(self.dp * self.cp)}"
            )
        out += self._model_problems(config)
        out += self._pipeline_problems(config, global_batch)
        out += self._sharding_problems(config)
        return out

    def _model_problems(self, config: LMConfig) -> list[str]:
        out = []
        tp, cp = self.tp, self.cp
        if config.heads % tp:
            out.append(
                f"tp={tp} does not divide heads={config.heads}: every tp rank holds heads/tp "
                f"whole heads; choose tp in {_divisors(config.heads)}"
            )
        if config.ffn % tp:
            out.append(
                f"tp={tp} does not divide the SwiGLU width ffn={config.ffn}: choose tp in "
                f"{_divisors(config.ffn)[:8]} or an ffn that is a multiple of {tp}"
            )
        if config.seq_len % (2 * cp):
            out.append(
                f"seq_len={config.seq_len} does not cut into 2 x cp = {2 * cp} equal chunks: "
                f"the zig-zag layout gives every cp rank two chunks; use a seq_len that is a "
                f"multiple of {2 * cp}"
            )
        elif self.sequence_parallel and (config.seq_len // cp) % tp:
            out.append(
                f"seq_len={config.seq_len} / cp={cp} = {config.seq_len // cp} tokens per cp rank "
                f"do not cut into tp={tp} equal shares for sequence parallelism: use a seq_len "
                f"that is a multiple of {math.lcm(2 * cp, cp * tp)}"
            )
        if config.moe_layers:
            if config.num_experts % self.ep:
                out.append(
                    f"ep={self.ep} does not divide num_experts={config.num_experts}: every ep "
                    f"rank holds whole experts; choose ep in {_divisors(config.num_experts)}"
                )
        elif self.ep > 1:
            out.append(
                f"ep={self.ep} with no MoE layer (moe_layers is empty): there are no experts to "
                "spread; set moe_layers or ep=1"
            )
        return out

    def _pipeline_problems(self, config: LMConfig, global_batch: int | None) -> list[str]:
        out = []
        if self.schedule not in SCHEDULES:
            return [f"schedule={self.schedule!r}: choose one of {', '.join(SCHEDULES)}"]
        if self.schedule in ("interleaved", "zb-v") and self.pp < 2:
            out.append(f"schedule={self.schedule} needs pp >= 2: its chunks go to different ranks")
        if self.schedule == "interleaved" and self.chunks < 2:
            out.append(f"chunks={self.chunks}: interleaving puts at least 2 chunks on each rank")
        if self.schedule == "interleaved" and self.microbatches % self.pp:
            out.append(
                f"microbatches={self.microbatches} with the interleaved schedule: it plays "
                f"micro-batches in rounds of pp={self.pp}; use a multiple of {self.pp}"
            )
        if self.activation_checkpointing and self.schedule in ZERO_BUBBLE:
            out.append(
                f"activation_checkpointing with schedule={self.schedule}: a zero-bubble schedule "
                "computes the weights' gradients (W) apart from the input's (B), and 2.3's "
                "checkpoint computes both in one recomputed backward; use 1f1b, interleaved or "
                "gpipe"
            )
        if self.activation_checkpointing and config.moe_layers:
            out.append(
                "activation_checkpointing with MoE layers: the balance loss's shares are attached "
                "during the forward, and a recomputed forward would attach them again; turn one "
                "of them off"
            )
        if config.layers < self.virtual_stages:
            out.append(
                f"{config.layers} layers cannot fill {self.virtual_stages} pipeline stages "
                f"(pp={self.pp} x {self.chunks_per_rank} chunks per rank): every stage holds at "
                f"least one layer; use pp <= {config.layers // self.chunks_per_rank} or more layers"
            )
        if global_batch is not None:
            per_step = self.dp * self.microbatches
            if global_batch < per_step or global_batch % per_step:
                out.append(
                    f"global batch {global_batch} does not divide by dp={self.dp} x "
                    f"{self.microbatches} micro-batches = {per_step}: every replica takes an equal "
                    f"slice and cuts it into equal micro-batches; use a multiple of {per_step}"
                )
        return out

    def _sharding_problems(self, config: LMConfig) -> list[str]:
        out = []
        if self.zero not in ZERO_CHOICES or isinstance(self.zero, bool):
            return [f"zero={self.zero!r}: choose 0 (plain data parallel), 1, 2, 3 or 'fsdp'"]
        if self.communication not in COMMUNICATION:
            out.append(
                f"communication={self.communication!r}: choose one of {', '.join(COMMUNICATION)}"
            )
        elif self.communication != "library" and self.zero != 0:
            out.append(
                f"communication={self.communication} with zero={self.zero}: ZeRO reduces the "
                "gradients with its own reduce-scatter (3.5), not an all-reduce; use zero=0 with "
                "a hand-made all-reduce, or communication=library"
            )
        if self.max_norm is not None and not (math.isfinite(self.max_norm) and self.max_norm > 0):
            out.append(f"max_norm={self.max_norm}: a finite bound > 0, or None for no clipping")
        if not (math.isfinite(self.lr) and self.lr > 0):
            out.append(f"lr={self.lr}: a finite learning rate > 0")
        if self.zero and config.moe_layers:
            out.append(
                f"zero={self.zero} with MoE layers: ZeRO here shards every weight over the data x "
                "context ranks, but each of them holds other experts (their copies live on the "
                "edp group); use zero=0 with MoE layers"
            )
        if self.zero in (3, "fsdp") and self.schedule in ZERO_BUBBLE:
            out.append(
                f"zero={self.zero} with schedule={self.schedule}: a unit is gathered for its "
                "backward and freed once its gradients are reduced, but B leaves the weights' "
                "gradients to W; use 1f1b or interleaved, or zero 0-2"
            )
        one_rank_ties = self.pp == 1 or self.schedule == "zb-v"
        if self.zero == "fsdp" and config.tied and one_rank_ties:
            out.append(
                "zero='fsdp' with a tied head on the rank that holds the embedding: the "
                "FSDP-style units refuse a weight shared by two units; use zero=3 (it shards a "
                "tied weight once) or tied=False"
            )
        return out

    def check(self, world_size: int, config: LMConfig, global_batch: int | None = None) -> None:
        """Raise ValueError with every problem (and the world size) before any process work."""
        problems = self.problems(config, global_batch)
        if not problems and self.world_size != world_size:
            problems.append(
                f"{self.label()} = {self.world_size} ranks, but the world has {world_size}: "
                f"the degrees must multiply to the number of ranks"
            )
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
