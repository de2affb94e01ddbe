"""The language model at one rank: tokens/s and model FLOPs utilisation (MFU), beside PyTorch.

Three rows on one device (a GPU when there is one), the same model, the same batches:

- **PyTorch, one process**: course/language_model.py's ``LanguageModel`` with
  ``torch.optim.AdamW`` and ``clip_grad_norm_``, in float32: the step everything is compared with;
- **4.7 composition, one rank**: ``ParallelLanguageModel`` (lm_parallel.py) on a one-rank
  Topology, float32: every group is trivial, so the ratio is what the composition's own machinery
  (the pipeline executor, the hooks, the sums over one-rank groups) costs when nothing is split.
  Its first losses are compared with the first row's (the same function, so they agree to
  float32's rounding);
- **PyTorch, one process, bf16 autocast**: the first row under ``torch.autocast`` in bfloat16,
  the precision GPU runs train in;
- with ``--compiled``, **4.7 composition, fused AdamW, compiled**: the second row with the
  framework's ``train.fused_adamw`` and ``train.compile`` (each chunk through ``torch.compile``:
  TorchDynamo's graphs between the hooks and collectives, Inductor's kernels inside them); and
  the same in the framework's ``precision: bf16-mixed`` (the chunks' forward under bf16
  autocast, float32 parameters and AdamW), whose losses follow the bf16 PyTorch row's.

MFU divides the model's FLOPs by the device's peak for the row's precision
(phase4_production/device_peaks.py: the datasheet's dense figure for a known GPU, a measured
matmul on a CPU). The model's FLOPs per token are PaLM's count (Chowdhery et al. 2022, appendix
B): ``6 N`` for the matrix parameters' forward and backward (N without the embedding lookup) plus
``12 L d T`` for attention's scores and values (L layers, width d, sequence T), causal mask
ignored as PaLM does::

    uv run python -m solutions.phase4_production.lm.throughput                 # tiny, on a CPU
    python3 -m solutions.phase4_production.lm.throughput --width 1024 --heads 16 --layers 8 \\
        --ffn 4096 --seq-len 1024 --batch 8 --record phase4_production/results/lm_gpu.json
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from course.cli import benchmark_main, run_main
from course.distributed import current_info
from course.impl import IMPLS, load_impl
from course.language_model import LanguageModel, LMConfig, build_language_model
from course.results import Table, write_results
from course.text_corpus import Corpus, random_windows
from course.topology import Topology
from course.world import run_world
from phase4_production.device_peaks import peak_flops_per_second
from phase4_production.lm_layout import ParallelSettings

PHASE = "phase4_production"
COMPILED_ROW = "4.7 composition, one rank, fused AdamW, compiled"
BF16_ROW = "4.7 composition, one rank, fused AdamW, compiled, bf16 autocast"


@dataclass
class ThroughputConfig:
    """Flags: the model's sizes, the batch, the steps timed."""

    width: int = field(default=64, metadata={"ge": 2, "le": 16384, "fix": "e.g. 1024"})
    heads: int = field(default=4, metadata={"ge": 1, "le": 256, "fix": "e.g. 16"})
    layers: int = field(default=2, metadata={"ge": 1, "le": 256, "fix": "e.g. 8"})
    ffn: int = field(default=128, metadata={"ge": 1, "le": 65536, "fix": "e.g. 4096"})
    seq_len: int = field(default=128, metadata={"ge": 2, "le": 65536, "fix": "e.g. 1024"})
    batch: int = field(default=4, metadata={"ge": 1, "le": 4096, "fix": "e.g. 8"})
    steps: int = field(default=10, metadata={"help": "timed steps per row", "ge": 3, "le": 10000,
                                             "fix": "e.g. 10"})  # fmt: skip
    warmup: int = field(default=3, metadata={"ge": 1, "le": 1000, "fix": "e.g. 3"})
    impl: str = field(default="solutions", metadata={"choices": IMPLS})
    compiled: bool = field(
        default=False,
        metadata={"help": "also the composition with fused AdamW and each chunk compiled"},
    )
    record: str = field(default="", metadata={"help": "write the table to this results file"})

    def model(self) -> LMConfig:
        return LMConfig(width=self.width, heads=self.heads, layers=self.layers, ffn=self.ffn,
                        seq_len=self.seq_len)  # fmt: skip


def validate(config: ThroughputConfig) -> None:
    """Sizes the model refuses (heads not dividing the width, an odd head size for rotary)."""
    config.model().check()


def flops_per_token(model: LanguageModel) -> float:
    """PaLM's count: 6 x the matrix parameters + 12 x layers x width x sequence."""
    c = model.config
    matrix = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("embedding"))
    return 6.0 * matrix + 12.0 * c.layers * c.width * c.seq_len


@dataclass
class Row:
    name: str
    precision: torch.dtype
    seconds: list[float]
    losses: list[float]
    peak_bytes: int | None


def timed_steps(step: Callable[[int], float], config: ThroughputConfig, device: torch.device,
                ) -> tuple[list[float], list[float], int | None]:  # fmt: skip
    """Warm-up steps, then ``config.steps`` timed one by one (the device synchronised around
    each); the losses of every step in order."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    losses, seconds = [], []
    for i in range(config.warmup + config.steps):
        if i == config.warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sync(device)
        began = time.perf_counter()
        losses.append(step(i))
        sync(device)
        if i >= config.warmup:
            seconds.append(time.perf_counter() - began)
    peak = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    return seconds, losses, peak


def plain_step(
    model: LanguageModel, batches: list[Any], device: torch.device,
    autocast: torch.dtype | None, max_norm: float, lr: float,
) -> Callable[[int], float]:  # fmt: skip
    """One-process AdamW step with the runtime's settings (betas, eps, clipping)."""
    settings = ParallelSettings()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=settings.betas,
                                  weight_decay=settings.weight_decay, eps=1e-8)  # fmt: skip

    def step(i: int) -> float:
        tokens, targets = (t.to(device, non_blocking=True) for t in batches[i])
        context = (torch.autocast(device.type, dtype=autocast) if autocast
                   else contextlib.nullcontext())  # fmt: skip
        with context:
            loss, _ = model.loss(tokens, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        return float(loss.detach())

    return step


def composed_step(model: Any, batches: list[Any]) -> Callable[[int], float]:
    """The composition's step on batch ``i`` (it takes the global batch on the CPU)."""
    return lambda i: float(model.train_step(*batches[i]).loss)


def measure_rank(config: ThroughputConfig) -> dict[str, Any]:
    """Every row, in a one-rank world (on ``cuda:0`` under NCCL when there is a GPU)."""
    device = current_info().device
    model_config = config.model()
    corpus = Corpus.load()
    generator = torch.Generator().manual_seed(0)
    batches = [random_windows(corpus.train, config.batch, config.seq_len, generator)
               for _ in range(config.warmup + config.steps)]  # fmt: skip
    max_norm, lr = 1.0, 3e-3
    rows = []

    dense = build_language_model(model_config, 0, torch.float32).to(device)
    per_token = flops_per_token(dense)
    parameters = sum(p.numel() for p in dense.parameters())
    rows.append(Row("PyTorch, one process", torch.float32,
                    *timed_steps(plain_step(dense, batches, device, None, max_norm, lr),
                                 config, device)))  # fmt: skip
    del dense

    lm = load_impl(PHASE, "lm_parallel", config.impl)
    settings = ParallelSettings(max_norm=max_norm, lr=lr)
    composed = lm.ParallelLanguageModel(build_language_model(model_config, 0, torch.float32),
                                        Topology.build(1, 1, 1), settings)  # fmt: skip
    rows.append(Row("4.7 composition, one rank", torch.float32,
                    *timed_steps(composed_step(composed, batches), config, device)))  # fmt: skip
    del composed
    if config.compiled:  # the framework's train.fused_adamw and train.compile
        fast = replace(settings, fused_adamw=True, compile=True)
        composed = lm.ParallelLanguageModel(build_language_model(model_config, 0, torch.float32),
                                            Topology.build(1, 1, 1), fast)  # fmt: skip
        timed = timed_steps(composed_step(composed, batches), config, device)
        rows.append(Row(COMPILED_ROW, torch.float32, *timed))
        del composed
        fast = replace(fast, bf16_autocast=True)  # the framework's precision: bf16-mixed
        composed = lm.ParallelLanguageModel(build_language_model(model_config, 0, torch.float32),
                                            Topology.build(1, 1, 1), fast)  # fmt: skip
        timed = timed_steps(composed_step(composed, batches), config, device)
        rows.append(Row(BF16_ROW, torch.bfloat16, *timed))
        del composed

    dense = build_language_model(model_config, 0, torch.float32).to(device)
    rows.append(Row("PyTorch, one process, bf16 autocast", torch.bfloat16,
                    *timed_steps(plain_step(dense, batches, device, torch.bfloat16, max_norm, lr),
                                 config, device)))  # fmt: skip
    peaks = {row.name: peak_flops_per_second(device, row.precision) for row in rows}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"rows": rows, "peaks": peaks, "per_token": per_token, "parameters": parameters,
            "device": f"{device} ({name})"}  # fmt: skip


def measure(config: ThroughputConfig) -> dict[str, Any]:
    result: dict[str, Any] = run_world(measure_rank, 1, args=(config,), timeout=1800)[0]
    return result


def report(result: dict[str, Any], config: ThroughputConfig) -> str:
    rows: list[Row] = result["rows"]
    tokens = config.batch * config.seq_len
    base = statistics.median(rows[0].seconds)
    table = Table(["step", "precision", "median step ms", "tokens/s", "vs PyTorch fp32",
                   "MFU", "peak used", "max allocated MiB"])  # fmt: skip
    values: dict[str, str] = {}
    keys = {"PyTorch, one process": "plain", "4.7 composition, one rank": "composed",
            "PyTorch, one process, bf16 autocast": "bf16", COMPILED_ROW: "compiled",
            BF16_ROW: "compiled_bf16"}  # fmt: skip
    for row in rows:
        key = keys[row.name]
        median = statistics.median(row.seconds)
        peak, source = result["peaks"][row.name]
        mfu = result["per_token"] * tokens / median / peak
        table.add(row.name, str(row.precision).removeprefix("torch."), f"{median * 1e3:.1f}",
                  f"{tokens / median:,.0f}", f"{base / median:.2f}x", f"{100 * mfu:.1f}%",
                  f"{peak / 1e12:.3g} TFLOP/s ({source})",
                  "-" if row.peak_bytes is None else f"{row.peak_bytes / 2**20:,.0f}")  # fmt: skip
        values[f"{key}_tokens_per_second"] = f"{tokens / median:,.0f}"
        values[f"{key}_mfu"] = f"{100 * mfu:.1f}%"
    plain, composed = rows[0].losses, rows[1].losses
    agree = max(abs(a - b) / abs(b) for a, b in zip(composed[:3], plain[:3], strict=True))
    values["composed_vs_plain_loss"] = f"{agree:.1e}"
    table.note = (
        f"{result['parameters']:,} parameters (width {config.width}, {config.layers} layers, "
        f"{config.heads} heads, ffn {config.ffn}), sequence {config.seq_len}, batch "
        f"{config.batch} ({tokens:,} tokens/step), {result['per_token'] / 1e6:.1f} MFLOP/token; "
        f"medians of {config.steps} steps after {config.warmup} warm-up; {result['device']}, "
        f"torch {torch.__version__}; the composition's first 3 losses vs PyTorch's: relative "
        f"difference {agree:.1e}"
    )
    if config.record:
        path = write_results(config.record, tables={"throughput": table}, values=values)
        table.note += f"\nrecorded {path}"
    return f"{table.to_markdown()}\n\n{table.note}"


def main(argv: Sequence[str] | None = None) -> int:
    return benchmark_main(ThroughputConfig, argv, __doc__, validate=validate, measure=measure,
                          report=report)  # fmt: skip


if __name__ == "__main__":
    run_main(main)
