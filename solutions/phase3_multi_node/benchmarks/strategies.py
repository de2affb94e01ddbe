"""Benchmark the training strategies of the course on one model: throughput and memory per rank.

The same MLP (``--layers`` Linear(width, width) layers with ReLU between, float32, one seed) is
trained with AdamW on the same global batches by every strategy, in one world of ``--world``
ranks:

* **torch DDP**: ``torch.nn.parallel.DistributedDataParallel``, the baseline (1.000x);
* **DDP (ours)**: exercise 3.4's ``DistributedDataParallel``, gloo's all-reduce per bucket;
* **DDP + ring hook (ours)**: the same with a communication hook that runs exercise 3.1's ring
  all-reduce on each bucket (``ddp.register_comm_hook(group, ring_allreduce_hook(...))``);
* **pipeline 1F1B (ours)**: exercise 2.5's executor, the layers cut into ``--world`` stages,
  the global batch in ``--microbatches`` micro-batches (no data parallelism);
* **ZeRO-2 (ours)**: exercise 3.5's ``zero_wrap(stage=2)``;
* **FSDP-style ZeRO-3 bf16 (ours)**: exercise 3.5's ``fsdp_wrap``, one unit per Linear, bf16
  compute and gathers, fp32 reduction and master weights, prefetch window 1 (its loss differs
  from the fp32 strategies' by bf16 rounding: the table says by how much).

Every data-parallel rank takes its slice of the global batch; the pipeline takes it whole. The
table shows, per strategy, the median step time of the slowest rank (``--steps`` timed steps
after 2 warm-up steps, the strategies' steps interleaved so that a change of load on the machine
hits all of them alike), samples per second, and, measured with one strategy in memory at a
time, the bytes the most loaded rank holds after a step: parameters, gradients and optimizer
state (distinct tensor storages, as ``references.zero_accounting.held_bytes`` counts them), the
peak of activations saved for backward (``SavedTensorMeter``, counted on CPU and GPU alike), DDP's
bucket buffers (torch's sizes from its logging data), and on GPU
``torch.cuda.max_memory_allocated``. Ratios are against torch DDP in the same run; the loss
after the last step shows that every strategy trained the same model.

    uv run python -m solutions.phase3_multi_node.benchmarks.strategies
    uv run python -m solutions.phase3_multi_node.benchmarks.strategies --world 4 --layers 8
    uv run python -m solutions.phase3_multi_node.benchmarks.strategies --impl templates
    uv run python -m solutions.phase3_multi_node.benchmarks.strategies \
        --record phase3_multi_node/results/strategies.json

``--record PATH`` writes the tables and the figures the guide quotes (course/results.py).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from course.cli import benchmark_main, run_main
from course.comm_counter import CommRecord
from course.distributed import current_info
from course.impl import IMPLS, load_impl
from course.memory import SavedTensorMeter
from course.results import Table, write_results
from course.world import run_world
from phase3_multi_node.moe_experts import MoEConfig
from phase3_multi_node.zero_fsdp_support import MixedPrecision
from solutions.phase3_multi_node.benchmarks.strategies_moe import (
    AUX_COEF,
    TRAFFIC_KINDS,
    build_expert_parallel,
    counting,
    loss_tolerance,
    one_process_losses,
    parameter_count,
)
from solutions.phase3_multi_node.references.zero_accounting import held_bytes

PHASE2, PHASE3 = "phase2_advanced", "phase3_multi_node"
STRATEGIES = (
    "torch DDP",
    "DDP (ours)",
    "DDP + ring hook (ours)",
    "pipeline 1F1B (ours)",
    "ZeRO-2 (ours)",
    "FSDP-style ZeRO-3 bf16 (ours)",
    "expert-parallel MoE (ours)",
)
MOE_STRATEGY = "expert-parallel MoE (ours)"  # another model: its loss is compared in one process
DENSE_STRATEGIES = tuple(name for name in STRATEGIES if name != MOE_STRATEGY)
FP32_STRATEGIES = tuple(name for name in DENSE_STRATEGIES if "bf16" not in name)  # one loss
MIB = 2**20


@dataclass
class StrategiesConfig:
    """The benchmark's flags."""

    world: int = field(
        default=2,
        metadata={"help": "number of ranks", "ge": 2, "le": 32, "fix": "2 to 32 ranks, e.g. 2"},
    )
    width: int = field(
        default=1024,
        metadata={
            "help": "width of each Linear layer",
            "ge": 1,
            "le": 16384,
            "fix": "a width from 1 to 16384, e.g. 1024",
        },
    )
    layers: int = field(
        default=4,
        metadata={
            "help": "Linear layers (a multiple of --world)",
            "ge": 1,
            "le": 256,
            "fix": "a multiple of --world, e.g. 4",
        },
    )
    global_batch: int = field(
        default=64,
        metadata={
            "help": "samples per step, all ranks",
            "ge": 1,
            "le": 1 << 20,
            "fix": "a multiple of --world and --microbatches, e.g. 64",
        },
    )
    microbatches: int = field(
        default=4,
        metadata={
            "help": "the pipeline's micro-batches",
            "ge": 1,
            "le": 4096,
            "fix": "a divisor of --global-batch, e.g. 4",
        },
    )
    steps: int = field(
        default=20,
        metadata={
            "help": "timed steps per strategy",
            "ge": 1,
            "le": 10000,
            "fix": "at least 1 step, e.g. 20",
        },
    )
    lr: float = field(
        default=1e-3,
        metadata={"help": "AdamW's learning rate", "gt": 0, "fix": "a positive rate, e.g. 1e-3"},
    )
    experts: int = field(
        default=4,
        metadata={
            "help": "the MoE row's experts (a multiple of --world)",
            "ge": 1,
            "le": 1024,
            "fix": "a multiple of --world, e.g. 4",
        },
    )
    k: int = field(
        default=2,
        metadata={
            "help": "experts per token (MoE row)",
            "ge": 1,
            "fix": "1 to --experts, e.g. 2",
        },
    )
    capacity_factor: float = field(
        default=1.25,
        metadata={
            "help": "each expert takes this times its fair share of choices (MoE row)",
            "gt": 0,
            "le": 1024,
            "fix": "a positive factor, e.g. 1.25",
        },
    )
    expert_hidden: int = field(
        default=256,
        metadata={
            "help": "each expert's hidden width (MoE row)",
            "ge": 1,
            "le": 65536,
            "fix": "a width from 1, e.g. 256",
        },
    )
    impl: str = field(
        default="solutions",
        metadata={"choices": IMPLS, "help": "run the reference or your templates"},
    )
    record: str = field(
        default="", metadata={"help": "write the tables to this results file (course/results.py)"}
    )


def validate(config: StrategiesConfig) -> None:
    """Every bad flag at once, naming each and a fix."""
    problems = []
    if config.layers % config.world:
        problems.append(
            f"--layers {config.layers} does not split into --world {config.world} equal pipeline "
            f"stages: use a multiple of {config.world} (e.g. {config.world * 2})"
        )
    if config.global_batch % config.world:
        problems.append(
            f"--global-batch {config.global_batch} does not split over {config.world} ranks: use "
            f"a multiple of {config.world}"
        )
    if config.global_batch % config.microbatches:
        problems.append(
            f"--global-batch {config.global_batch} does not cut into --microbatches "
            f"{config.microbatches} equal micro-batches"
        )
    if config.experts % config.world:
        problems.append(
            f"--experts {config.experts} does not split over --world {config.world} ranks (the "
            f"MoE row holds --experts/--world whole experts per rank): use a multiple of "
            f"{config.world} (e.g. {config.world * 2})"
        )
    if config.k > config.experts:
        problems.append(
            f"--k {config.k} > --experts {config.experts}: a token goes to k different experts; "
            f"use --k 1 to {config.experts}"
        )
    if problems:
        raise ValueError("; ".join(problems))


def moe_config(config: StrategiesConfig) -> MoEConfig:
    """The MoE row's layer: ``--experts`` experts ``width -> --expert-hidden -> width``."""
    return MoEConfig(
        config.width, config.expert_hidden, config.experts, config.k, config.capacity_factor
    )


def make_mlp(width: int, layers: int) -> nn.Sequential:
    """``layers`` Linear(width, width) with ReLU between, from seed 0 (the same on every rank)."""
    torch.manual_seed(0)
    modules: list[nn.Module] = []
    for _ in range(layers):
        modules += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*modules[:-1])


def pipeline_stage(model: nn.Sequential, rank: int, world: int) -> nn.Sequential:
    """Rank ``rank``'s contiguous share of the Linear layers (with the ReLU after each)."""
    per = (len(model) + 1) // 2 // world
    start = 2 * rank * per
    end = len(model) if rank == world - 1 else 2 * (rank + 1) * per
    return nn.Sequential(*(model[i] for i in range(start, end)))


def ring_allreduce_hook(ring_all_reduce: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    """A DDP communication hook ``hook(group, bucket) -> Future`` that averages the bucket with
    ``ring_all_reduce`` (exercise 3.1). DDP hands a hook the raw, summed-to-be gradients, so it
    divides by the group's size first; the ring runs synchronously, so the future it returns is
    already complete (torch's own hooks return the all-reduce's future instead)."""

    def hook(group: dist.ProcessGroup | None, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        buffer.div_(dist.get_world_size(group))
        ring_all_reduce(buffer, group=group)
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(buffer)
        return future

    return hook


@dataclass
class Runner:
    """One strategy on this rank: its step, and what holds its bytes; ``traffic`` (the MoE row)
    reads the messages of a step run under a ``CommCounter``."""

    step: Callable[[torch.Tensor, torch.Tensor], float | None]
    model: nn.Module
    optimizer: Any
    buckets: Callable[[], int] = lambda: 0
    traffic: Callable[[Sequence[CommRecord]], dict[str, Any]] | None = None


def build_runner(name: str, config: StrategiesConfig, device: torch.device) -> Runner:
    """Build strategy ``name`` on this rank (a collective: every rank builds the same one)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    share = config.global_batch // world
    mine = slice(rank * share, (rank + 1) * share)
    if name == MOE_STRATEGY:
        run = build_expert_parallel(moe_config(config), config.impl, config.lr, device, mine)
        return Runner(run.step, run.model, run.optimizer, traffic=run.traffic)
    model = make_mlp(config.width, config.layers).to(device)

    def adamw(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=config.lr)

    def data_parallel(wrapped: nn.Module, optimizer: Any) -> Callable[..., float | None]:
        def step(x: torch.Tensor, y: torch.Tensor) -> float | None:
            optimizer.zero_grad(set_to_none=True)
            loss = F.mse_loss(wrapped(x[mine]).float(), y[mine])  # a bf16 output: fp32 loss
            loss.backward()
            optimizer.step()
            return float(loss.detach())

        return step

    if name == "torch DDP":
        ddp = TorchDDP(model)
        optimizer = adamw(ddp.parameters())

        def torch_buckets() -> int:
            sizes = str(ddp._get_ddp_logging_data().get("bucket_sizes", ""))
            return sum(int(s) for s in sizes.replace(" ", "").split(",") if s)

        return Runner(data_parallel(ddp, optimizer), ddp, optimizer, torch_buckets)
    if name in ("DDP (ours)", "DDP + ring hook (ours)"):
        ours = load_impl(PHASE3, "ddp", config.impl).DistributedDataParallel(model)
        if name == "DDP + ring hook (ours)":
            ring = load_impl(PHASE3, "ring_allreduce", config.impl)
            ours.register_comm_hook(None, ring_allreduce_hook(ring.ring_all_reduce))
        optimizer = adamw(ours.parameters())
        return Runner(
            data_parallel(ours, optimizer), ours, optimizer, lambda: sum(ours.bucket_bytes())
        )
    if name == "ZeRO-2 (ours)":
        zero = load_impl(PHASE3, "zero", config.impl)
        wrapped, optimizer = zero.zero_wrap(model, adamw, stage=2)
        return Runner(data_parallel(wrapped, optimizer), wrapped, optimizer)
    if name == "FSDP-style ZeRO-3 bf16 (ours)":
        fsdp = load_impl(PHASE3, "zero_fsdp", config.impl)
        units = [m for m in model.modules() if isinstance(m, nn.Linear)]
        policy = MixedPrecision(torch.bfloat16, torch.float32)
        wrapped, optimizer = fsdp.fsdp_wrap(model, units, adamw, policy, prefetch=1)
        return Runner(data_parallel(wrapped, optimizer), wrapped, optimizer)
    if name == "pipeline 1F1B (ours)":
        executor_impl = load_impl(PHASE2, "pipeline_executor", config.impl)
        schedules = load_impl(PHASE2, "pipeline_schedules", config.impl)
        stage = pipeline_stage(model, rank, world)
        actions = schedules.make_schedule("1f1b", world, config.microbatches)[rank]
        executor = executor_impl.PipelineExecutor([stage], actions, config.microbatches, F.mse_loss)
        optimizer = adamw(stage.parameters())

        def pipeline_step(x: torch.Tensor, y: torch.Tensor) -> float | None:
            optimizer.zero_grad(set_to_none=True)
            result = executor.step(x if rank == 0 else None, y if rank == world - 1 else None)
            optimizer.step()
            return result.loss

        return Runner(pipeline_step, stage, optimizer)
    raise ValueError(f"unknown strategy {name!r}: choose one of {', '.join(STRATEGIES)}")


def batch(
    step: int, config: StrategiesConfig, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    shape = (config.global_batch, config.width)
    return torch.randn(shape, generator=g).to(device), torch.randn(shape, generator=g).to(device)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def slowest(seconds: float, device: torch.device) -> float:
    value = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def global_loss(loss: float | None, ddp_like: bool, device: torch.device) -> float:
    """The whole batch's loss on every rank: the mean of the ranks' (data parallel), or the last
    stage's (pipeline)."""
    world = dist.get_world_size()
    value = torch.tensor([0.0 if loss is None else loss], dtype=torch.float64, device=device)
    dist.all_reduce(value)
    return float(value.item()) / (world if ddp_like else 1)


WARMUP = 2  # steps before measuring (torch DDP rebuilds its buckets after the first one)


class ActivationMeter(SavedTensorMeter):
    """``SavedTensorMeter`` that also leaves out tensors whose storage is a parameter's *when
    they are saved*: a sharded model's parameters live in compute buffers that are allocated
    only while gathered (FSDP-style), so they cannot be excluded up front; the weights autograd
    saves are parameters, not activations (their buffers are freed after forward)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(exclude=list(model.parameters()))
        self._model = model

    def _pack(self, tensor: torch.Tensor) -> object:
        storage = tensor.untyped_storage()
        if storage.nbytes() and any(
            p.untyped_storage().data_ptr() == storage.data_ptr() for p in self._model.parameters()
        ):
            return tensor
        return super()._pack(tensor)


def memory_of(name: str, config: StrategiesConfig, device: torch.device) -> dict[str, Any]:
    """Strategy ``name`` alone in memory: the bytes it holds after a step, its activations'
    peak during one, and (GPU) the peak allocated during one. The runner is freed after."""
    runner = build_runner(name, config, device)
    for step in range(WARMUP):
        runner.step(*batch(step, config, device))
    params = list(runner.model.parameters())
    x, y = batch(WARMUP, config, device)
    _synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with counting(runner.traffic is not None) as counter, ActivationMeter(runner.model) as meter:
        runner.step(x, y)
    _synchronize(device)
    held = held_bytes(runner.model, runner.optimizer)
    result: dict[str, Any] = {
        "params": held.params,
        "grads": held.grads,
        "optimizer": held.optimizer,
        "activations": meter.peak_bytes,
        "buckets": runner.buckets(),
        "gpu_peak": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }
    if runner.traffic is not None and counter is not None:
        result["traffic"] = runner.traffic(counter.records)
    del runner, params
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    dist.barrier()
    return result


def measure_worker(config: StrategiesConfig) -> dict[str, Any]:
    """Runs on every rank; returns this rank's numbers per strategy.

    Memory is measured with one strategy in memory at a time. Time is measured with all of
    them built and their steps interleaved (one step of each, in turn, ``--steps`` times), so
    that a change of load on the machine hits every strategy alike."""
    device = current_info().device
    results: dict[str, Any] = {name: memory_of(name, config, device) for name in STRATEGIES}
    runners = {name: build_runner(name, config, device) for name in STRATEGIES}
    for step in range(WARMUP):
        for runner in runners.values():
            runner.step(*batch(step, config, device))
    times: dict[str, list[float]] = {name: [] for name in STRATEGIES}
    last: dict[str, float | None] = {}
    for step in range(WARMUP, WARMUP + config.steps):
        x, y = batch(step, config, device)
        for name, runner in runners.items():
            dist.barrier()
            _synchronize(device)
            start = time.perf_counter()
            last[name] = runner.step(x, y)
            _synchronize(device)
            times[name].append(slowest(time.perf_counter() - start, device))
    for name in STRATEGIES:
        results[name]["step"] = statistics.median(times[name])
        results[name]["loss"] = global_loss(last[name], name != "pipeline 1F1B (ours)", device)
    if dist.get_rank() == 0:  # after the timing: the MoE model again, in one process
        batches = [batch(step, config, device) for step in range(WARMUP + config.steps)]
        losses = one_process_losses(moe_config(config), config.lr, dist.get_world_size(), batches)
        results[MOE_STRATEGY]["one_process_loss"] = losses[-1]
    results["device"] = str(device)
    return results


def _mib(nbytes: int) -> str:
    return f"{nbytes / MIB:.2f}"


def total_bytes(row: dict[str, Any]) -> int:
    return int(
        row["params"] + row["grads"] + row["optimizer"] + row["activations"] + row["buckets"]
    )


def moe_model_text(config: StrategiesConfig) -> str:
    """The MoE row's model in one phrase."""
    w, f, e = config.width, config.expert_hidden, config.experts
    return (
        f"Linear({w}, {w}), ReLU, x + MoE(x), Linear({w}, {w}); MoE: {e} experts "
        f"Linear({w}, {f})-GELU-Linear({f}, {w}), top-{config.k}, capacity factor "
        f"{config.capacity_factor:g}, load-balancing loss x {AUX_COEF:g}; "
        f"{parameter_count(moe_config(config)):,} parameters, {e // config.world} experts on each "
        "rank, the rest replicated"
    )


def header(per_rank: Sequence[dict[str, Any]], config: StrategiesConfig) -> str:
    params = sum(p.numel() for p in make_mlp(config.width, config.layers).parameters())
    return (
        f"dense MLP {config.layers} x Linear({config.width}, {config.width}), {params:,} "
        f"parameters, float32, AdamW; global batch {config.global_batch}, world {config.world} "
        f"on {per_rank[0]['device']}; pipeline: {config.microbatches} micro-batches; the "
        f"expert-parallel row trains the MoE MLP ({moe_model_text(config)}); medians of "
        f"{config.steps} steps, the strategies in turn (slowest rank); bytes in MiB after a "
        "step, each strategy alone, on the rank holding the most"
    )


def model_of(name: str) -> str:
    return "MoE MLP" if name == MOE_STRATEGY else "dense MLP"


def summary_table(per_rank: Sequence[dict[str, Any]], config: StrategiesConfig) -> Table:
    """One row per strategy: time, the most loaded rank's bytes, the loss."""
    gpu = str(per_rank[0]["device"]).startswith("cuda")
    table = Table(
        ["strategy", "model", "step ms", "samples/s", "vs torch DDP", "params", "grads",
         "optimizer", "activations (peak)", "DDP buckets", "total", "vs torch DDP"]
        + (["GPU peak allocated"] if gpu else [])
        + [f"loss at step {WARMUP + config.steps}"],
        note="the MoE MLP is another model than the dense MLP: compare its loss with the same "
        "MoE model in one process (below), not with the dense rows'",
    )  # fmt: skip
    base = per_rank[0]["torch DDP"]
    base_total = max(total_bytes(r["torch DDP"]) for r in per_rank)
    for name in STRATEGIES:
        rows = [r[name] for r in per_rank]
        heaviest = max(rows, key=total_bytes)
        step = rows[0]["step"]
        gpu_cell = [_mib(max(r["gpu_peak"] for r in rows))] if gpu else []
        table.add(
            name, model_of(name), f"{1e3 * step:.1f}", f"{config.global_batch / step:.0f}",
            f"{base['step'] / step:.3f}x", _mib(heaviest["params"]), _mib(heaviest["grads"]),
            _mib(heaviest["optimizer"]), _mib(heaviest["activations"]),
            _mib(heaviest["buckets"]), _mib(total_bytes(heaviest)),
            f"{total_bytes(heaviest) / base_total:.3f}x", *gpu_cell, f"{rows[0]['loss']:.6f}",
        )  # fmt: skip
    return table


def per_rank_table(per_rank: Sequence[dict[str, Any]]) -> Table:
    table = Table(["strategy", "model", "rank", "params", "grads", "optimizer",
                   "activations (peak)", "DDP buckets", "total"])  # fmt: skip
    for name in STRATEGIES:
        for rank, r in enumerate(per_rank):
            row = r[name]
            table.add(name, model_of(name), rank, _mib(row["params"]), _mib(row["grads"]),
                      _mib(row["optimizer"]), _mib(row["activations"]), _mib(row["buckets"]),
                      _mib(total_bytes(row)))  # fmt: skip
    return table


def traffic_table(per_rank: Sequence[dict[str, Any]]) -> Table:
    """The MoE row's bytes per rank in its counted step, by collective, against the formula."""
    table = Table(
        ["rank", "tokens", "choices routed", "kept (rows dispatched)", "rows received",
         "all-to-all", "all-gather (census)", "all-reduce (world)", "all-reduce (dp, 1 rank)",
         "total counted", "formula", "equal"],
        note="bytes handed to each collective in one step (forward, backward, gradient sync), "
        "counted by CommCounter; the formula from the census: see benchmarks/strategies_moe.py",
    )  # fmt: skip
    for rank, r in enumerate(per_rank):
        t = r[MOE_STRATEGY]["traffic"]
        counted, formula = t["counted"], t["formula"]
        total = sum(counted.values())
        table.add(
            rank, t["tokens"], sum(t["census"][rank]), t["sent_rows"], t["received_rows"],
            *(counted.get(kind, 0) for kind in TRAFFIC_KINDS), total,
            sum(formula.values()), "yes" if counted == formula else "no",
        )  # fmt: skip
    return table


def traffic_matches(per_rank: Sequence[dict[str, Any]]) -> int:
    """How many ranks' counted bytes equal the formula's, kind by kind."""
    return sum(
        r[MOE_STRATEGY]["traffic"]["counted"] == r[MOE_STRATEGY]["traffic"]["formula"]
        for r in per_rank
    )


def moe_values(per_rank: Sequence[dict[str, Any]]) -> dict[str, str]:
    """The MoE row's bytes against the formula, its drops, and its loss against one process."""
    traffic = [r[MOE_STRATEGY]["traffic"] for r in per_rank]
    a2a = [t["counted"]["all-to-all"] / 1024 for t in traffic]
    routed = sum(sum(row) for row in traffic[0]["census"])
    dropped = routed - sum(t["sent_rows"] for t in traffic)
    loss = per_rank[0][MOE_STRATEGY]["loss"]
    alone = per_rank[0][MOE_STRATEGY]["one_process_loss"]
    gap = abs(loss - alone) / abs(alone)
    tolerance = loss_tolerance(str(per_rank[0]["device"]))
    within = "yes" if gap <= tolerance else "no"
    return {
        "moe.bytes_exact": f"{traffic_matches(per_rank)} of {len(per_rank)} ranks",
        "moe.all_to_all_KiB": f"{min(a2a):.1f}-{max(a2a):.1f} KiB",
        "moe.all_reduce_world_MiB": f"{traffic[0]['counted']['all-reduce world'] / MIB:.2f} MiB",
        "moe.dropped": f"{dropped} of {routed} choices ({100 * dropped / routed:.1f}%)",
        "moe.loss": f"{loss:.6f}",
        "moe.one_process_loss": f"{alone:.6f}",
        "moe.loss_vs_one_process": f"{gap:.1e} relative, within {tolerance:g}: {within}",
    }


def summary_values(per_rank: Sequence[dict[str, Any]]) -> dict[str, str]:
    """Speed and memory of each strategy against torch DDP, and whether the losses agree."""
    base = per_rank[0]["torch DDP"]
    base_total = max(total_bytes(r["torch DDP"]) for r in per_rank)
    values: dict[str, str] = {}
    for name in STRATEGIES:
        key = name.split(" (")[0].replace(" ", "_").replace("+", "plus")
        heaviest = max((r[name] for r in per_rank), key=total_bytes)
        values[f"speed.{key}"] = f"{base['step'] / per_rank[0][name]['step']:.2f}x"
        values[f"memory.{key}"] = f"{total_bytes(heaviest) / base_total:.2f}x"
    losses = {f"{per_rank[0][name]['loss']:.6f}" for name in FP32_STRATEGIES}
    values["losses_agree"] = "yes" if len(losses) == 1 else f"no ({', '.join(sorted(losses))})"
    base_loss = per_rank[0]["torch DDP"]["loss"]
    for name in DENSE_STRATEGIES:
        if name not in FP32_STRATEGIES:
            key = name.split(" (")[0].replace(" ", "_")
            gap = abs(per_rank[0][name]["loss"] - base_loss) / abs(base_loss)
            values[f"loss_gap.{key}"] = f"{100 * gap:.3f}%"
    return values | moe_values(per_rank)


def format_tables(per_rank: Sequence[dict[str, Any]], config: StrategiesConfig) -> str:
    """The summary table (the most loaded rank's bytes) and the per-rank breakdown."""
    summary, ranks = summary_table(per_rank, config), per_rank_table(per_rank)
    traffic, values = traffic_table(per_rank), summary_values(per_rank)
    text = "\n".join([header(per_rank, config), "", summary.to_markdown(), "", summary.note, "",
                      "per rank (MiB):", "", ranks.to_markdown(), "",
                      "the expert-parallel row's bytes per rank, one step:", "",
                      traffic.to_markdown(), "", traffic.note, "",
                      f"its loss against the same MoE model in one process: "
                      f"{values['moe.loss']} and {values['moe.one_process_loss']}, "
                      f"{values['moe.loss_vs_one_process']}"])  # fmt: skip
    if config.record:
        path = write_results(
            config.record,
            tables={"setup": Table(["setup"], [[header(per_rank, config)]]),
                    "summary": summary, "per_rank": ranks, "expert_parallel": traffic},
            values=values,
        )  # fmt: skip
        text += f"\n\nrecorded: {path}"
    return text


def measure(config: StrategiesConfig) -> Any:
    return run_world(measure_worker, config.world, (config,), {}, timeout=900)


def main(argv: Sequence[str] | None = None) -> int:
    return benchmark_main(
        StrategiesConfig, argv, __doc__, validate=validate, measure=measure, report=format_tables
    )


if __name__ == "__main__":
    run_main(main)
