"""The library way beside exercise 4.7: the same language model and layout with PyTorch's own APIs.

Exercise 4.7 composes the learner's own pieces (2.5's executor, 2.6's layers, 3.5's sharding,
3.6's clipping) on ``course/language_model.py``'s model. This module trains the same model, from
the same one-process weights, on the same layout with what PyTorch ships, the way torchtitan
trains Llama (``torchtitan/models/llama3/infra/parallelize.py``,
``torchtitan/distributed/pipeline_parallel.py``), and its program prints both losses per step::

    uv run python -m solutions.phase4_production.lm.library_compare            # the comparison
    uv run python -m solutions.phase4_production.lm.library_compare --record   # and write
                                                  # phase4_production/results/lm_library.json

* **A DeviceMesh with named dimensions**: ``topology.as_device_mesh("cpu")``, dims ("pp", "dp",
  "tp") (``init_device_mesh`` lays ranks out as the course's RankGrid does).
* **Tensor and sequence parallelism**: ``parallelize_module`` with torchtitan's ``apply_tp``
  plan (https://pytorch.org/docs/stable/distributed.tensor.parallel.html): ``ColwiseParallel``
  on wq/wk/wv and w1/w3, ``RowwiseParallel`` on wo and w2 (``output_layouts=Shard(1)``: the
  reduce-scatter), ``SequenceParallel`` on the norms, ``PrepareModuleInput`` (Shard(1) ->
  Replicate: the all-gather) in front of attention and the MLP, a ``RowwiseParallel`` embedding
  and a ``ColwiseParallel`` head. A style shards one ``nn.Linear``, so the library needs q, k, v
  and gate, up as separate projections: :class:`LibraryStage` is a library-shaped copy whose
  weights are cut from the dense model's fused ``qkv`` and ``gate_up`` rows
  (:func:`library_state`), the same function. Without sequence parallelism the norms are
  Replicate DTensors too (``distribute_module``), so every gradient is a DTensor.
* **Data parallelism**: FSDP2's ``fully_shard`` on the "dp" dim (each block one unit, then the
  root, as torchtitan's ``apply_fsdp``). FSDP2 always shards the parameters (ZeRO-3's memory);
  ``reshard_after_forward`` follows the settings' ``zero`` (3 or "fsdp": True) and is False
  with a pipeline (torchtitan's default). The numbers are the same for every ZeRO stage.
* **Pipeline parallelism**: ``torch.distributed.pipelining``: one ``PipelineStage`` per
  virtual stage (a manual split as torchtitan's ``pipeline_module_split``: each stage a module
  holding its layers, the embedding on the first, the final norm and head on the last) and the
  schedule of the settings: gpipe ``ScheduleGPipe``, 1f1b ``Schedule1F1B``, interleaved
  ``ScheduleInterleaved1F1B`` (stages r, r + pp, ...), zb-h1 ``ScheduleInterleavedZeroBubble``
  (ZB1P, one stage per rank), zb-v ``ScheduleZBVZeroBubble`` (stages r and 2pp - 1 - r)
  (https://pytorch.org/docs/stable/distributed.pipelining.html).
* **AdamW** (eps 1e-8, the course's settings) on the DTensor parameters; **clipping** as
  torchtitan's ``dist_utils.clip_grad_norm_``: ``torch.nn.utils.get_total_norm`` and
  ``clip_grads_with_norm_`` (the two halves of ``clip_grad_norm_``) on the DTensor gradients,
  the squared norm summed over the pipeline stages in between (``clip_grad_norm_`` alone would
  clip each stage by its own norm).
* **MoE layers** (ep = 1): the course's ``DenseMoE`` run by ``dropless_moe`` on each rank's
  tokens; each balance loss rides the backward with :class:`AttachAuxiliary` (Megatron-LM's
  ``MoEAuxLossAutoScaler``), since a pipeline's loss function sees the last stage's logits only.

**The loss normalization.** The course's loss is the mean cross-entropy over every valid target
of the global batch. The library's defaults give something else: ``F.cross_entropy``'s mean on
each micro-batch, divided by the micro-batches by the schedule (``scale_grads=True``) and by the
dp size by FSDP, is a mean of per-micro-batch means, which weighs a micro-batch with few valid
targets as much as one with many. torchtitan (since 2025) normalizes by the global token count:
its loss is ``local_loss_sum / global_valid_tokens``, the count all-reduced over the batch
ranks, its pipeline schedules are built with ``scale_grads=False`` and FSDP with
``set_gradient_divide_factor(1.0)`` (``disable_fsdp_gradient_division``: "We handle gradient
scaling ourselves in the training loop with global token count"). This module does the same, so
every gradient is summed, never averaged.

**What runs, torch 2.15 on CPU with gloo** (measured by the program, float64, 3 AdamW steps,
uneven masks; "equal" is the largest relative difference of a step's loss from the course's)::

    feature                                         runs on CPU gloo?     equal to the course's?
    parallelize_module: Colwise/Rowwise (tp)        yes                   yes, <= 3e-16
      + SequenceParallel, PrepareModuleInput (sp)   yes                   yes, <= 3e-16
    fully_shard (FSDP2) on dp                       yes                   yes, <= 3e-16
    pipelining: GPipe, 1F1B, Interleaved1F1B        yes                   yes, <= 3e-16
    pipelining: zero bubble (ZB1P, ZBV)             yes                   yes, <= 3e-16
    dp x tp+sp, tp x pp, dp x pp, dp x tp+sp x pp   yes                   yes, <= 3e-16
    a tied head on one rank (also the V of zb-v)    yes (re-tied after    yes, <= 3e-16
                                                    parallelize_module)
    a tied head across pipeline ranks               no API                -
    a tied head on the V's rank with dp > 1         no: fully_shard       -
                                                    unties it silently
    MoE layers with ep = 1 (dp, pp)                 yes (the course's     yes, <= 1e-15
                                                    layer, replicated)
    MoE layers with tp > 1                          no ParallelStyle      -
    expert parallelism (ep > 1)                     no API in torch 2.15  -
    context parallelism (cp > 1)                    no: NotImplementedError on CPU's SDPA

:func:`unsupported` says, for a layout, which of these stops it and the error torch gives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    PipelineStageInfo,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from course.language_model import (
    IGNORE_INDEX,
    LanguageModel,
    LMConfig,
    RMSNorm,
    apply_rotary,
    causal_attention,
    dropless_moe,
    rotary_tables,
    sequence_balance_loss,
)
from course.moe_model import DenseMoE
from course.topology import Topology
from phase4_production.lm_layout import ParallelSettings

NORM_TYPE = 2.0
CP_ERROR = (
    "NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default "
    "does not have a sharding strategy registered."
)

# ----------------------------------------------------------------------------- what cannot run


def unsupported(
    settings: ParallelSettings, config: LMConfig, device_type: str = "cpu"
) -> str | None:
    """Why this layout cannot run with the library on this device (one sentence naming the API
    and the error), or None when it runs."""
    if settings.communication != "library":
        return (
            f"communication={settings.communication}: the library's data parallelism reduces "
            "with its own collectives (fully_shard's reduce-scatter); a hand-made all-reduce "
            "would be a DDP communication hook (register_comm_hook), which fully_shard has no "
            "place for"
        )
    if settings.activation_checkpointing:
        return (
            "activation_checkpointing: the library's way is torch.distributed.algorithms."
            "_checkpoint.checkpoint_wrapper around each block; this module does not wire it"
        )
    if settings.cp > 1 and device_type == "cpu":
        return (
            "cp > 1: torch.distributed.tensor.experimental.context_parallel registers ring "
            "attention for the CUDA SDPA kernels only; on CPU, SDPA raises " + CP_ERROR
        )
    if settings.cp > 1:
        return (
            "cp > 1: context_parallel dispatches ring attention for CUDA's flash, efficient and "
            "cuDNN SDPA kernels, none of which takes float64, the comparison's dtype; this module "
            "does not wire it (not measured here: no GPU)"
        )
    if settings.ep > 1:
        return (
            "ep > 1: torch 2.15 ships no expert-parallel ParallelStyle (torch.distributed.tensor"
            ".parallel has Colwise/Rowwise/Sequence/PrepareModule* only; torchtitan's "
            "ExpertParallel is torchtitan's own code, torch.distributed._token_switch is a "
            "private CUDA NCCL-EP kernel)"
        )
    if config.moe_layers and settings.tp > 1:
        return (
            "MoE layers with tp > 1: no torch ParallelStyle shards a router or a list of experts "
            "(torchtitan writes its own TensorParallel/ExpertTensorParallel styles for them)"
        )
    if config.tied and settings.pp > 1 and settings.schedule != "zb-v":  # the V: one rank
        return (
            "a tied head across pipeline stages: torch.distributed.pipelining gives each stage "
            "its own module, and nothing in it sums the gradients of a weight two ranks hold "
            "(torchtitan raises NotImplementedError: Weight tying is not supported with "
            "Pipeline Parallel.)"
        )
    if config.tied and settings.schedule == "zb-v" and settings.pp > 1 and settings.dp > 1:
        return (
            "a tied head on the V's rank with dp > 1: fully_shard on each PipelineStage's module "
            "replaces a parameter shared by the two by one sharded DTensor per module, so the "
            "tie is lost without an error (measured: the losses drift apart from the second "
            "step, 1.5e-4 relative)"
        )
    return None


# ----------------------------------------------------------------------------- library-shaped


class LibraryAttention(nn.Module):
    """Causal attention with separate ``wq``, ``wk``, ``wv``, ``wo`` (torchtitan's names): what
    ``ColwiseParallel``/``RowwiseParallel`` shard one ``nn.Linear`` at a time. Under tensor
    parallelism the projections return this rank's heads (``view(..., -1, head_dim)``)."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.head_dim, self.rope_base = config.head_dim, config.rope_base
        self.wq, self.wk, self.wv, self.wo = (
            nn.Linear(config.width, config.width, bias=False) for _ in range(4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape

        def heads(projection: nn.Module) -> torch.Tensor:
            return projection(x).view(batch, tokens, -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.wq), heads(self.wk), heads(self.wv)
        cos, sin = rotary_tables(torch.arange(tokens), self.head_dim, self.rope_base, q.dtype)
        mixed = causal_attention(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v)
        return self.wo(mixed.transpose(1, 2).reshape(batch, tokens, -1))


class LibraryFeedForward(nn.Module):
    """SwiGLU with separate ``w1`` (gate), ``w3`` (up), ``w2`` (down), torchtitan's names."""

    def __init__(self, width: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(width, ffn, bias=False)
        self.w3 = nn.Linear(width, ffn, bias=False)
        self.w2 = nn.Linear(ffn, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class AttachAuxiliary(torch.autograd.Function):
    """Return ``x`` unchanged; in backward, also give ``aux`` the gradient 1, so a loss computed
    inside a pipeline stage is minimized with the stage's output (Megatron-LM's
    ``MoEAuxLossAutoScaler``; the pipeline's loss function only sees the last stage's logits)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape = aux.shape
        return x.clone()  # a new tensor: FSDP2 hooks a module's output, and a view would not do

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones(ctx.aux_shape, dtype=grad.dtype, device=grad.device)


@dataclass
class StepTally:
    """What the stages of one rank share during a step: the global counts the loss is divided
    by, and the balance-loss shares its MoE layers added (already weighted by
    ``aux_coefficient`` and divided by the global number of sequences), for the report."""

    global_valid: int = 0
    global_sequences: int = 0
    balance: list[torch.Tensor] = field(default_factory=list)
    probing: bool = False  # the pipeline's metadata-inference forward: not a step's work

    @contextlib.contextmanager
    def forward_context(self, info: PipelineStageInfo) -> Iterator[None]:
        """``PipelineStage.register_forward_context``'s factory: the first step of a stage
        runs one extra forward to learn the shapes it sends (``is_metadata_inference``); its
        balance loss must not be counted."""
        self.probing = info.is_metadata_inference
        try:
            yield
        finally:
            self.probing = False


class LibraryBlock(nn.Module):
    """``x + attention(attention_norm(x))``, then ``x + mlp(ffn_norm(x))``; the MLP is SwiGLU
    or the course's DenseMoE (run by ``dropless_moe``, its balance loss attached)."""

    def __init__(self, config: LMConfig, layer: int, tally: StepTally) -> None:
        super().__init__()
        self.config, self.tally = config, tally
        self.attention_norm = RMSNorm(config.width, config.norm_eps)
        self.attention = LibraryAttention(config)
        self.ffn_norm = RMSNorm(config.width, config.norm_eps)
        self.feed_forward: nn.Module
        if config.is_moe(layer):
            self.feed_forward = DenseMoE(config.moe_config())
        else:
            self.feed_forward = LibraryFeedForward(config.width, config.ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        if not isinstance(self.feed_forward, DenseMoE):
            return x + self.feed_forward(self.ffn_norm(x))
        mixed, routing = dropless_moe(self.feed_forward, self.ffn_norm(x))
        # this rank's sequences' share of the mean over the GLOBAL batch's sequences
        share = sequence_balance_loss(routing, self.config.num_experts) * x.shape[0]
        share = share / self.tally.global_sequences * self.config.aux_coefficient
        if not self.tally.probing:
            self.tally.balance.append(share.detach())
        return AttachAuxiliary.apply(x + mixed, share)


class LibraryStage(nn.Module):
    """One pipeline stage of the library-shaped model (the whole model when pp = 1): the
    embedding on the first stage, blocks ``layers`` (a ModuleDict keyed by the layer index, as
    torchtitan's, so parameter names do not depend on the split), the final norm and the head on
    the last stage. ``forward`` takes tokens on the first stage, hidden states elsewhere."""

    def __init__(
        self, config: LMConfig, layers: range, first: bool, last: bool, tally: StepTally
    ) -> None:
        super().__init__()
        self.embedding = nn.Embedding(config.vocab, config.width) if first else None
        self.layers = nn.ModuleDict({str(i): LibraryBlock(config, i, tally) for i in layers})
        self.final_norm = RMSNorm(config.width, config.norm_eps) if last else None
        self.head = nn.Linear(config.width, config.vocab, bias=False) if last else None

    def blocks(self) -> list[LibraryBlock]:
        return [cast(LibraryBlock, block) for block in self.layers.values()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embedding is not None:
            x = self.embedding(x)
        for block in self.blocks():
            x = block(x)
        if self.final_norm is not None and self.head is not None:
            x = self.head(self.final_norm(x))
        return x


def library_state(
    dense: dict[str, torch.Tensor], config: LMConfig, layers: range, first: bool, last: bool
) -> dict[str, torch.Tensor]:
    """The state dict of a stage, cut from the dense model's: ``qkv``'s rows [q; k; v] become
    wq, wk, wv; ``gate_up``'s [gate; up] become w1 and w3; every other weight is renamed."""
    out = {}
    if first:
        out["embedding.weight"] = dense["embedding.weight"]
    for i in layers:
        was, now = f"blocks.{i}.", f"layers.{i}."
        out[now + "attention_norm.weight"] = dense[was + "attention_norm.weight"]
        out[now + "ffn_norm.weight"] = dense[was + "mlp_norm.weight"]
        q, k, v = dense[was + "attention.qkv.weight"].chunk(3)
        for name, value in (("wq", q), ("wk", k), ("wv", v)):
            out[f"{now}attention.{name}.weight"] = value
        out[now + "attention.wo.weight"] = dense[was + "attention.out.weight"]
        if config.is_moe(i):
            for name, value in dense.items():
                if name.startswith(was + "mlp."):
                    out[now + "feed_forward." + name.removeprefix(was + "mlp.")] = value
        else:
            gate, up = dense[was + "mlp.gate_up.weight"].chunk(2)
            out[now + "feed_forward.w1.weight"] = gate
            out[now + "feed_forward.w3.weight"] = up
            out[now + "feed_forward.w2.weight"] = dense[was + "mlp.down.weight"]
    if last:
        out["final_norm.weight"] = dense["final_norm.weight"]
        out["head.weight"] = dense["head.weight"]
    return out


def library_stage(
    dense: LanguageModel, layers: range, first: bool, last: bool, tally: StepTally
) -> LibraryStage:
    """A library-shaped stage computing what the dense model's layers compute."""
    stage = LibraryStage(dense.config, layers, first, last, tally).to(dense.head.weight.dtype)
    if dense.config.tied and stage.embedding is not None and stage.head is not None:
        stage.head.weight = stage.embedding.weight
    cut = library_state(dense.state_dict(), dense.config, layers, first, last)
    stage.load_state_dict(cut, strict=True)
    return stage


# ----------------------------------------------------------------------------- tensor parallel


def _replicated(module: nn.Module, mesh: DeviceMesh) -> None:
    """Make ``module``'s parameters Replicate DTensors on the tp mesh, its input and output
    local: a weight every tp rank holds whole and uses on the same tokens (a norm without
    sequence parallelism), so that every parameter and gradient of the model is a DTensor."""

    def to_dtensor(_module: nn.Module, inputs: Any, device_mesh: DeviceMesh) -> Any:
        return tuple(DTensor.from_local(x, device_mesh, [Replicate()]) for x in inputs)

    def to_local(_module: nn.Module, output: Any, _mesh: DeviceMesh) -> Any:
        return output.to_local()

    distribute_module(module, mesh, input_fn=to_dtensor, output_fn=to_local)


def apply_tensor_parallel(stage: LibraryStage, mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """torchtitan's ``apply_tp`` on one stage: the embedding row-parallel (its vocabulary rows
    split), the head column-parallel; per block wq/wk/wv and w1/w3 column-parallel, wo and w2
    row-parallel. With sequence parallelism the activations between the tensor-parallel regions
    are Shard(1) (the sequence), the norms ``SequenceParallel`` and ``PrepareModuleInput``
    all-gathers in front of attention and the MLP; without it they are replicated."""
    between = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, Any] = {}
    if stage.embedding is not None:
        top["embedding"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if stage.head is not None:
        top["head"] = ColwiseParallel(input_layouts=between, output_layouts=Replicate())
    if sequence_parallel and stage.final_norm is not None:
        top["final_norm"] = SequenceParallel()
    if top:
        parallelize_module(stage, mesh, top)
    for block in stage.blocks():
        plan: dict[str, Any] = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=between),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=between),
        }
        if sequence_parallel:
            plan |= {
                "attention_norm": SequenceParallel(),
                "ffn_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
            }
        parallelize_module(block, mesh, plan)
        if not sequence_parallel:
            _replicated(block.attention_norm, mesh)
            _replicated(block.ffn_norm, mesh)
    if not sequence_parallel and stage.final_norm is not None:
        _replicated(stage.final_norm, mesh)


# ----------------------------------------------------------------------------- data parallel


def apply_fsdp(stage: LibraryStage, mesh: DeviceMesh, reshard_after_forward: bool) -> None:
    """torchtitan's ``apply_fsdp``: each block one unit, the embedding one, the final norm and
    head one (with a tied head the embedding and head are left to the root: one unit must hold
    a shared weight), then the root; gradients summed, not averaged (see the module doc)."""
    tied = (
        stage.head is not None
        and stage.embedding is not None
        and (stage.head.weight is stage.embedding.weight)
    )
    if stage.embedding is not None and not tied:
        fully_shard(stage.embedding, mesh=mesh, reshard_after_forward=reshard_after_forward)
    for block in stage.blocks():
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    if stage.final_norm is not None and stage.head is not None and not tied:
        fully_shard([stage.final_norm, stage.head], mesh=mesh, reshard_after_forward=False)
    fully_shard(stage, mesh=mesh, reshard_after_forward=reshard_after_forward)
    for module in stage.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # fp32 and bf16 divide with NCCL's PreMulSum, which gloo lacks ("Cannot use
            # ReduceOp.PREMUL_SUM with Gloo"): a plain sum and a separate division instead
            module.set_force_sum_reduction_for_comms(True)


# ----------------------------------------------------------------------------- pipeline


SCHEDULE_CLASSES: dict[str, Any] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
    "zb-h1": ScheduleInterleavedZeroBubble,
    "zb-v": ScheduleZBVZeroBubble,
}


def stage_indices(settings: ParallelSettings, pp_rank: int) -> list[int]:
    """The virtual stages a pipeline rank holds: one; ``chunks`` in a loop for interleaved
    (rank r: r, r + pp, ...); the V of zb-v (rank r: r and 2 pp - 1 - r)."""
    pp = settings.pp
    if settings.schedule == "interleaved":
        return [pp_rank + c * pp for c in range(settings.chunks)]
    if settings.schedule == "zb-v":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank]


def stage_layers(layers: int, stages: int, stage: int) -> range:
    """Contiguous, as even as can be (the first stages take one more when it does not divide)."""
    base, extra = divmod(layers, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


# ----------------------------------------------------------------------------- the whole


class LibraryLanguageModel:
    """The same model (weights from the same one-process LanguageModel) and layout with
    PyTorch's APIs: ``LibraryLanguageModel(dense, topology, settings)``, then
    :meth:`train_step` on the GLOBAL batch on every rank (each dp replica takes its contiguous
    rows, as the course's runtime does)."""

    def __init__(
        self, dense: LanguageModel, topology: Topology, settings: ParallelSettings
    ) -> None:
        config = dense.config
        settings.check(topology.world_size, config)
        reason = unsupported(settings, config, "cpu")
        if reason is not None:
            raise ValueError(f"the library cannot run this layout here: {reason}")
        self.config, self.settings = config, settings
        self.mesh = topology.as_device_mesh("cpu")
        self.pp_rank, self.dp_rank = self.mesh.get_local_rank("pp"), self.mesh.get_local_rank("dp")
        self.tally = StepTally()
        virtual = settings.virtual_stages
        self.indices = stage_indices(settings, self.pp_rank)
        self.stages = [
            library_stage(
                dense, stage_layers(config.layers, virtual, i), i == 0, i == virtual - 1,
                self.tally,
            )
            for i in self.indices
        ]  # fmt: skip
        self._tie()
        if settings.tp > 1:
            for stage in self.stages:
                apply_tensor_parallel(stage, self.mesh["tp"], settings.sequence_parallel)
            self._tie()  # parallelize_module replaced the shared weight by one DTensor per module
        if settings.dp > 1:
            reshard = settings.zero in (3, "fsdp") and settings.pp == 1
            for stage in self.stages:
                apply_fsdp(stage, self.mesh["dp"], reshard)
        self.parameters = _unique(p for stage in self.stages for p in stage.parameters())
        self.optimizer = torch.optim.AdamW(
            self.parameters, lr=settings.lr, betas=settings.betas,
            weight_decay=settings.weight_decay, eps=1e-8,
        )  # fmt: skip
        self.schedule = self._schedule() if settings.pp > 1 else None

    def _tie(self) -> None:
        """A tied head on this rank (one stage, or the V's first and last): one Parameter."""
        embedding = next((s.embedding for s in self.stages if s.embedding is not None), None)
        head = next((s.head for s in self.stages if s.head is not None), None)
        if self.config.tied and embedding is not None and head is not None:
            head.weight = embedding.weight

    def _schedule(self) -> Any:
        settings = self.settings
        group = self.mesh["pp"].get_group()
        stages = [
            PipelineStage(stage, index, settings.virtual_stages, torch.device("cpu"), group=group)
            for stage, index in zip(self.stages, self.indices, strict=True)
        ]
        for stage in stages:
            stage.register_forward_context(self.tally.forward_context)
        cls = SCHEDULE_CLASSES[settings.schedule]
        many = settings.schedule in ("interleaved", "zb-h1", "zb-v")
        return cls(
            stages if many else stages[0],
            n_microbatches=settings.microbatches,
            loss_fn=self._loss_fn,
            scale_grads=False,
        )

    def _loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The sum of this micro-batch's token losses over the global count (see the doc)."""
        summed = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            targets.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        return summed / self.tally.global_valid

    def _local_rows(self, batch: torch.Tensor) -> torch.Tensor:
        rows = batch.shape[0] // self.settings.dp
        return batch[self.dp_rank * rows : (self.dp_rank + 1) * rows]

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """One AdamW step on the GLOBAL batch; returns the step's loss (cross-entropy plus
        ``aux_coefficient`` x balance), the same on every rank."""
        settings = self.settings
        settings.check(self.mesh.size(), self.config, tokens.shape[0])
        x, y = self._local_rows(tokens), self._local_rows(targets)
        count = (y != IGNORE_INDEX).sum().to(torch.int64)
        dist.all_reduce(count, group=self.mesh["dp"].get_group())  # torchtitan's global count
        self.tally.global_valid, self.tally.global_sequences = int(count), tokens.shape[0]
        self.tally.balance.clear()
        self.optimizer.zero_grad(set_to_none=True)
        ce = self._forward_backward(x, y)
        if settings.max_norm is not None:
            norm = global_grad_norm(self.parameters, self.mesh["pp"].get_group())
            torch.nn.utils.clip_grads_with_norm_(self.parameters, settings.max_norm, norm)
        self.optimizer.step()
        return self._reported(ce)

    def _forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """This rank's cross-entropy share (zero off the last stage), gradients accumulated."""
        if self.schedule is None:
            loss = self._loss_fn(self.stages[0](x), y)
            loss.backward()
            return loss.detach()
        losses: list[torch.Tensor] = []
        first = 0 in self.indices
        last = self.settings.virtual_stages - 1 in self.indices
        self.schedule.step(*((x,) if first else ()), target=y if last else None, losses=losses)
        return torch.stack([t.detach() for t in losses]).sum() if losses else torch.zeros(())

    def _reported(self, ce: torch.Tensor) -> float:
        """Sum the shares over the ranks that hold other tokens (dp) or other layers (pp); the
        tp ranks hold copies of the same values."""
        balance = sum(self.tally.balance, torch.zeros((), dtype=torch.float64))
        parts = torch.stack([ce.double(), balance])
        for dim in ("dp", "pp"):
            if self.mesh[dim].size() > 1:
                dist.all_reduce(parts, group=self.mesh[dim].get_group())
        return float(parts.sum())


def _unique(params: Any) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for p in params:
        seen.setdefault(id(p), p)
    return list(seen.values())


def global_grad_norm(params: Sequence[nn.Parameter], pp_group: dist.ProcessGroup) -> torch.Tensor:
    """The 2-norm of every gradient of the model: ``get_total_norm`` per kind of DTensor (mesh
    and placements; plain tensors apart), each made whole with ``full_tensor()``, then the
    squares summed over the pipeline stages (torchtitan's ``clip_grad_norm_`` with a pp mesh)."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            grad = p.grad
            key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
            groups.setdefault(key, []).append(grad)
    squares = torch.zeros((), dtype=torch.float64)
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, NORM_TYPE)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares = squares + norm.double() ** 2
    if dist.get_world_size(pp_group) > 1:
        dist.all_reduce(squares, group=pp_group)
    return squares.sqrt().to(params[0].dtype)
