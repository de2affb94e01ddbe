"""A 70B-class model on 1,024 GPUs, from the formulas alone: computed, not measured.

The planner of ``lm/planner.py`` ranks layouts from rates measured on the machine it runs on. At
the scale people train at, the same reasoning is done on paper first, from published figures:
this program does it for the course's language model at a Llama-3-70B shape (width 8192, 80
layers, 64 heads, SwiGLU 28672, a 128,256-token vocabulary, sequences of 8,192) on 128 nodes of 8
H100s, with a global batch of 1,024 sequences (8.4M tokens), for a few layouts, and prints per
layout the bytes one GPU holds and the step time, each term with its formula. Every input is a
figure from a paper or a datasheet, named in ``ASSUMPTIONS``; nothing here was run on a GPU.

The course's block uses full multi-head attention, so its q, k, v are 3 h^2 where Llama 3's
grouped-query attention has h^2 + 2 h^2/8: the model counted here has 79.9B parameters against
Llama 3 70B's 70.6B.

* **Bytes per GPU.** Mixed-precision Adam as ZeRO counts it (Rajbhandari et al., 2020, section 3):
  bf16 parameters (2 bytes) and gradients (2), fp32 master weights and two moments (12 = K); ZeRO-1
  shards the 12, ZeRO-2 the gradients too, ZeRO-3 everything, over the data-parallel ranks. A rank's
  parameters are its tp shard of its pipeline stage's layers (the units of the planner's
  description, ``lm.layout_work``: the same shapes the composition builds). Activations per layer
  and token: Korthikanti et al. (2022, "Reducing Activation Recomputation", section 4) count
  ``34 h`` bytes in 16-bit for a GPT layer without the attention scores (flash attention never
  stores them), divided by t under tensor + sequence parallelism; with full recompute a layer
  keeps only its input, 2 h / t. The pipeline's first stage holds p micro-batches in flight under
  1F1B (2.5's peak).
* **Step time.** Compute: PaLM's FLOPs per token (6 N + 12 L h T, forward and backward), one
  more forward (2 N + 4 L h T) when recomputing, spread over the GPUs and run at a sustained
  fraction of the bf16 peak. Tensor parallelism: per layer and micro-batch, 2 all-gathers and 2
  reduce-scatters forward and as many backward, of the micro-batch's activations, on NVLink (3.2's
  ring costs for a gather: (t-1)/t of the bytes). Pipeline: 2.5's ``simulate`` of 1F1B with those
  per-stage costs, so the bubble is in the makespan. Data parallelism: ZeRO-1's reduce-scatter of
  the gradients and all-gather of the parameters (ZeRO-3: gathers twice per micro-batch) on
  InfiniBand, across nodes. Nothing overlaps (as in the course's executor): a real run hides
  much of the data-parallel traffic behind the backward, so these step times are upper bounds.

Then the planner (``lm.planner.plan``) is handed the same figures as its rates (``published_rates``:
compute per token and layer from the FLOPs at the sustained rate, Korthikanti's activation bytes,
NVLink inside a node and InfiniBand for any group that spans nodes, mixed-precision AdamW's
state bytes) and searches the layouts itself (tp, pp in 1, 2, 4, 8; 1F1B; ZeRO 0-3; micro-batch
counts up to 8 per stage); its ranking is the second table. Its cost model is the course's, not
this page's hand arithmetic: the embedding and head are whole on every tp rank (the course's
model; Megatron splits the vocabulary), the head's FLOPs sit on the last stage, the tensor-parallel
traffic is two all-reduces of the activations per layer forward and two backward, and AdamW's step
is counted (memory-bound: 28 bytes moved per parameter at HBM speed).

    uv run python -m solutions.phase4_production.lm.worked_example
    uv run python -m solutions.phase4_production.lm.worked_example --record
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from course.language_model import LMConfig
from course.results import Table, write_results
from phase4_production.lm_layout import ParallelSettings
from solutions.phase2_advanced.pipeline_schedules import make_schedule
from solutions.phase2_advanced.pipeline_study.simulation import simulate
from solutions.phase3_multi_node.alpha_beta import AlphaBeta, Cost, ring_cost
from solutions.phase4_production.lm.layout_work import describe, layer_units
from solutions.phase4_production.lm.memory import MIXED_ADAMW
from solutions.phase4_production.lm.memory import state_bytes as unit_state_bytes
from solutions.phase4_production.lm.planner import Machine, Prediction, plan, predict
from solutions.phase4_production.lm.rates import Line, Rates

RESULTS = Path(__file__).resolve().parents[3] / "phase4_production" / "results" / "lm_70b.json"
GB = 1e9
MODEL = LMConfig(width=8192, heads=64, layers=80, ffn=28672, seq_len=8192, vocab=128256)
SEQUENCES = 1024  # global batch: 1,024 x 8,192 = 8.4M tokens (Llama 3 405B: 16M)
GPUS, PER_NODE, MEMORY = 1024, 8, 80 * GB  # H100 SXM 80 GB, 8 per node
PEAK = 989.4e12  # bf16 dense, NVIDIA H100 SXM datasheet
SUSTAINED = 0.40  # of the peak: Llama 3 405B reported 38-43% BF16 MFU on 8-16K H100s
NVLINK = (5e-6, 1 / 450e9)  # alpha, beta: NVLink 4, 450 GB/s per direction per GPU
INFINIBAND = (10e-6, 1 / 50e9)  # 8 x 400 Gb/s NDR per node = 50 GB/s per GPU
ACTIVATION_BYTES = 34  # per layer, token and h, 16-bit, no attention scores (Korthikanti et al.)
OUTSIDE_TP_BYTES = 10  # of the 34: what tp alone leaves whole (norms, dropouts: their 10 sbh)
HBM = 3.35e12  # bytes/s, H100 SXM datasheet
ADAMW_BYTES_MOVED = 28  # per parameter: read fp32 master + 2 moments + bf16 grad, write them back
ASSUMPTIONS = (
    "79.9B parameters (the course's block: full multi-head attention; Llama 3 70B: 70.6B with "
    "GQA); 1,024 H100 SXM 80 GB, 8 per node; bf16 peak 989.4 TFLOP/s (datasheet), sustained 40% "
    "(Llama 3 405B: 38-43% MFU, Dubey et al. 2024, table 4); NVLink 450 GB/s and InfiniBand "
    "50 GB/s per GPU per direction, latencies 5 and 10 us (datasheets; the latencies assumed); "
    "Adam in mixed precision: 2 + 2 + 12 bytes per parameter (ZeRO, Rajbhandari et al. 2020); "
    "activations 34 h bytes per layer and token, / t with sequence parallelism, 2 h / t with full "
    "recompute (Korthikanti et al. 2022); global batch 1,024 x 8,192 tokens; no overlap of "
    "communication and compute"
)


@dataclass(frozen=True)
class Layout:
    name: str
    settings: ParallelSettings


LAYOUTS = (
    Layout("dp1024", ParallelSettings(dp=1024)),
    Layout("dp1024, ZeRO-3 (FSDP)", ParallelSettings(dp=1024, zero=3)),
    Layout("dp1024, ZeRO-3, recompute",
           ParallelSettings(dp=1024, zero=3, activation_checkpointing=True)),
    Layout("tp8 x dp128, ZeRO-1", ParallelSettings(dp=128, tp=8, sequence_parallel=True, zero=1,
                                                   microbatches=8)),
    Layout("tp8 x pp4 x dp32, ZeRO-1", ParallelSettings(dp=32, tp=8, pp=4, sequence_parallel=True,
                                                        zero=1, microbatches=32)),
    Layout("tp8 x pp8 x dp16, ZeRO-1", ParallelSettings(dp=16, tp=8, pp=8, sequence_parallel=True,
                                                        zero=1, microbatches=64)),
    Layout("tp8 x pp8 x dp16, ZeRO-1, recompute",
           ParallelSettings(dp=16, tp=8, pp=8, sequence_parallel=True, zero=1, microbatches=64,
                            activation_checkpointing=True)),
)  # fmt: skip


@dataclass(frozen=True)
class Estimate:
    states: float  # bytes
    activations: float
    compute: float  # seconds per step
    tensor: float
    pipeline_total: float  # the schedule's makespan (compute + tp inside it, bubble included)
    data: float

    @property
    def held(self) -> float:
        return self.states + self.activations

    @property
    def seconds(self) -> float:
        return self.pipeline_total + self.data


def parameters(config: LMConfig) -> int:
    """Every parameter of the one-process model (embedding and head untied)."""
    return sum(describe(config, ParallelSettings(), 1, 2).ranks[0].units)


def state_bytes(elements: int, zero: int | str, shards: int) -> float:
    """ZeRO's mixed-precision Adam: (2 + 2 + 12) bytes per parameter, sharded by stage
    (``lm.memory.state_bytes`` with :data:`MIXED_ADAMW`, the planner's own count)."""
    return float(sum(unit_state_bytes([elements], zero, shards, MIXED_ADAMW)))


def flops_per_token(config: LMConfig, recompute: bool) -> float:
    """PaLM's count (forward and backward), plus one forward when recomputing."""
    n = parameters(config) - config.vocab * config.width  # the embedding lookup is no matmul
    attention = 12.0 * config.layers * config.width * config.seq_len
    return 6.0 * n + attention + ((2.0 * n + attention / 3) if recompute else 0.0)


def estimate(config: LMConfig, s: ParallelSettings) -> Estimate:
    """The busiest GPU's bytes and the step's time, term by term (see the module docstring)."""
    h, t, p, m = config.width, s.tp, s.pp, s.microbatches
    shards = s.dp * s.cp
    work = describe(config, s, SEQUENCES, 2)  # what each GPU holds: the planner's description
    units = work.busiest.units
    states = state_bytes(sum(units), s.zero, shards)
    tokens = SEQUENCES // (s.dp * m) * config.seq_len  # one micro-batch on one replica
    layers = math.ceil(config.layers / p)
    per_layer = (2.0 if s.activation_checkpointing else ACTIVATION_BYTES) * h / t * tokens
    live = ACTIVATION_BYTES * h / t * tokens if s.activation_checkpointing else 0.0
    activations = per_layer * layers * work.in_flight + live
    # compute: the whole step's FLOPs over every GPU at the sustained rate
    total = flops_per_token(config, s.activation_checkpointing) * SEQUENCES * config.seq_len
    compute = total / (GPUS * PEAK * SUSTAINED)
    # tensor parallelism: 4 gathers forward (with SP) and 4 backward per layer and micro-batch,
    # once more forward when recomputing
    gather = ring_cost(2.0 * tokens * h, t)  # an all-gather is half a ring all-reduce
    gather = Cost(gather.rounds / 2, gather.bytes_sent / 2) if t > 1 else Cost(0, 0)
    op = gather.time(*NVLINK)
    tp_forward = 4 * layers * op
    tp_backward = (4 + (4 if s.activation_checkpointing else 0)) * layers * op
    tensor = m * (tp_forward + tp_backward)
    forward = compute / (3 * m) + tp_forward  # per micro-batch on one stage; compute F : B = 1 : 2
    backward = 2 * compute / (3 * m) + tp_backward
    if p > 1:
        hop = Cost(1, 2.0 * tokens * h / t).time(*INFINIBAND)  # a stage boundary, across nodes
        played = simulate(make_schedule("1f1b", p, m), forward + hop, backward + hop)
        pipeline_total = played.makespan
    else:
        pipeline_total = m * (forward + backward)
    # data parallelism across nodes: gradients reduce-scattered, parameters all-gathered (bf16)
    grads = 2.0 * sum(units)
    half = Cost(shards - 1, (shards - 1) / shards * grads) if shards > 1 else Cost(0, 0)
    if s.zero == 0:
        data = ring_cost(grads, shards).time(*INFINIBAND) if shards > 1 else 0.0
    elif s.zero in (1, 2):
        data = 2 * half.time(*INFINIBAND)
    else:  # gathered for forward and for backward, every micro-batch; reduce-scattered once each
        data = 3 * m * half.time(*INFINIBAND)
    return Estimate(states, activations, compute, tensor, pipeline_total, data)


def published_rates(config: LMConfig) -> Rates:
    """The planner's rates from the published figures above: nothing measured."""
    h, speed = config.width, PEAK * SUSTAINED
    layer = sum(layer_units(config, 0, 1, 1))
    forward = (2.0 * layer + 4.0 * h * config.seq_len) / speed  # per token: PaLM's count / 3
    nvlink = AlphaBeta(*NVLINK)
    return Rates(
        layer_forward=Line(0.0, forward),
        layer_backward=Line(0.0, 2 * forward),
        norm_share=0.0,  # the norms' FLOPs are a rounding error next to the matmuls'
        head_per_token=6.0 * config.vocab * h / speed,
        activation_bytes_per_token=float(ACTIVATION_BYTES * h),
        norm_activation_bytes_per_token=float(OUTSIDE_TP_BYTES * h),
        optimizer_per_element=ADAMW_BYTES_MOVED / HBM,
        all_reduce=nvlink,
        point_to_point=nvlink,
        cores=PER_NODE,  # one GPU per rank: no sharing
        dtype="bfloat16",
        sources={"all": ASSUMPTIONS},
    )


PLANNED_MACHINE = Machine(GPUS, PER_NODE, MEMORY, element=2, states=MIXED_ADAMW,
                          inter_node=AlphaBeta(*INFINIBAND))  # fmt: skip
SEARCH = {
    "schedules": ("1f1b",),
    "zeros": (0, 1, 2, 3),
    "per_stage": (1, 2, 4, 8),
    "accumulation": (1, 2, 4, 8),
    "degrees": {"tp": (1, 2, 4, 8), "cp": (1,), "pp": (1, 2, 4, 8)},
}


def planned(config: LMConfig = MODEL) -> list[Prediction]:
    """The planner's ranking of the searched layouts on :data:`PLANNED_MACHINE`."""
    return plan(config, published_rates(config), PLANNED_MACHINE, SEQUENCES, **SEARCH)


def layout_name(s: ParallelSettings) -> str:
    parts = [f"tp{s.tp}" + ("+sp" if s.sequence_parallel else "")] if s.tp > 1 else []
    parts += [f"pp{s.pp}"] if s.pp > 1 else []
    parts.append(f"dp{s.dp}")
    name = " x ".join(parts) + f", m={s.microbatches}"
    name += f", ZeRO-{s.zero}" if s.zero else ""
    return name + (", recompute" if s.activation_checkpointing else "")


def plan_rows(predictions: list[Prediction], limit: int = 8) -> tuple[Table, dict[str, str]]:
    rows = Table(["planner's rank", "layout", "GB per GPU: states + activations",
                  "step s: pipeline + data-parallel + optimizer", "MFU"])  # fmt: skip
    tokens = SEQUENCES * MODEL.seq_len
    useful = flops_per_token(MODEL, False) * tokens
    fitting = [p for p in predictions if p.fits]
    for index, p in enumerate(fitting[:limit], 1):
        mfu = useful / (p.seconds * GPUS * PEAK)
        rows.add(str(index), layout_name(p.settings),
                 f"{p.held.states / GB:,.1f} + {p.held.activations / GB:,.1f}",
                 f"{p.seconds:.1f} = {p.pipeline:.1f} + {p.gradients:.2f} + {p.optimizer:.3f}",
                 f"{100 * mfu:.0f}%")  # fmt: skip
    first = fitting[0]
    hand = next(x for x in LAYOUTS if x.name == "tp8 x dp128, ZeRO-1")
    same = predict(MODEL, hand.settings, published_rates(MODEL), PLANNED_MACHINE, SEQUENCES)
    by_hand = estimate(MODEL, hand.settings)
    assert same.work is not None
    units = len(same.work.ranks[0].units)
    # each unit reduce-scattered and all-gathered on a ring of dp - 1 steps across nodes
    latency = 2 * units * (hand.settings.dp - 1) * INFINIBAND[0]
    values = {
        "planned_tp8xdp128_pipeline": f"{same.pipeline:.1f} s",
        "planned_tp8xdp128_data": f"{same.gradients:.2f} s",
        "planned_tp8xdp128_data_ratio": f"{same.gradients / by_hand.data:.1f}x",
        "planned_tp8xdp128_units": f"{units}",
        "planned_tp8xdp128_latency": f"{latency:.2f} s",
        "planned_layouts": f"{len(predictions):,}",
        "planned_fit": f"{len(fitting):,}",
        "planned_first": layout_name(first.settings),
        "planned_first_step": f"{first.seconds:.1f} s",
        "planned_first_gb": f"{first.held.total / GB:,.0f} GB",
    }
    rows.note = (
        f"the planner (lm.planner.plan) on the figures above: {len(predictions):,} layouts "
        f"searched, {len(fitting):,} fit 80 GB; the first {min(limit, len(fitting))} shown"
    )
    return rows, values


def table() -> tuple[Table, dict[str, str]]:
    rows = Table(["layout", "GB per GPU: states + activations", "fits 80 GB",
                  "step s: pipeline (compute, tp) + data-parallel", "tokens/s", "MFU"])  # fmt: skip
    values = {"parameters": f"{parameters(MODEL) / 1e9:.1f}B"}
    tokens = SEQUENCES * MODEL.seq_len
    useful = flops_per_token(MODEL, False) * tokens
    for layout in LAYOUTS:
        e = estimate(MODEL, layout.settings)
        fits = e.held <= MEMORY
        mfu = useful / (e.seconds * GPUS * PEAK)
        rows.add(layout.name, f"{e.states / GB:,.1f} + {e.activations / GB:,.1f}",
                 "yes" if fits else "no",
                 f"{e.pipeline_total:.1f} ({e.compute:.1f}, {e.tensor:.2f}) + {e.data:.2f}",
                 f"{tokens / e.seconds:,.0f}" if fits else "-",
                 f"{100 * mfu:.0f}%" if fits else "-")  # fmt: skip
        key = layout.name.split(",")[0].replace(" ", "")
        if layout.settings.activation_checkpointing:
            key += "_recompute"
        elif layout.settings.zero == 3:
            key += "_zero3"
        values[f"{key}_gb"] = f"{e.held / GB:,.0f} GB"
        if fits:
            values[f"{key}_mfu"] = f"{100 * mfu:.0f}%"
            values[f"{key}_step"] = f"{e.seconds:.1f} s"
    rows.note = f"computed, not measured: {ASSUMPTIONS}"
    return rows, values


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--record", action="store_true", help=f"write {RESULTS.name}")
    args = parser.parse_args(argv)
    rows, values = table()
    print(rows.to_markdown())
    print(f"\n{rows.note}\n")
    ranked, more = plan_rows(planned())
    print(ranked.to_markdown())
    print(f"\n{ranked.note}")
    if args.record:
        tables = {"layouts": rows, "planned": ranked}
        print(f"recorded {write_results(RESULTS, tables=tables, values={**values, **more})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
