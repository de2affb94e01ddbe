"""Demo of exercise 2.7: ring attention against one process, the work per rank, and training.

Every rank builds the same q, k, v (and gradient of the output) for the whole sequence from one
seed, keeps its chunks, runs your ring attention forward and backward, and rank 0 prints the
largest difference from ``scaled_dot_product_attention`` on the whole sequence over all ranks,
the bytes each rank sent against (cp - 1)/cp of K and V, and the attention work of every rank
(blocks computed, query-key pairs, CPU seconds), once in the contiguous layout and once in the
zig-zag one. Then it trains a small transformer block for ``--steps`` steps on zig-zag shards and
compares it with one process, and says what PyTorch's own context parallel does here.
``--cp-size`` splits the world into context-parallel groups of that size (consecutive ranks; 0:
the whole world), each on its own sequence. ``--impl templates`` runs your
``phase2_advanced/template_context_parallel*.py``.

    uv run torchrun --standalone --nproc_per_node=2 \
        -m solutions.phase2_advanced.demos.context_parallel
    uv run torchrun --standalone --nproc_per_node=4 \
        -m solutions.phase2_advanced.demos.context_parallel --seq-len 128 --impl templates
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course.cli import parse_config, refuse_before_start, run_main
from course.comm_counter import CommCounter
from course.distributed import current_info, distributed_session
from course.impl import IMPLS, load_impl
from course.rank_logging import log0
from phase2_advanced.context_parallel_model import build_block, sdpa_attention, train_steps
from phase2_advanced.ring_attention_blocks import BlockWork, record_block_work
from solutions.phase2_advanced.library.context_parallel import cp_mesh, cpu_refusal

PHASE = "phase2_advanced"
DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass
class DemoConfig:
    """Sizes of the demo; every rank must be given the same values."""

    batch_size: int = field(default=2, metadata={"ge": 1, "fix": "at least one sequence"})
    heads: int = field(default=4, metadata={"ge": 1, "fix": "at least one head"})
    seq_len: int = field(
        default=64,
        metadata={"ge": 2, "help": "whole sequence; a multiple of 2·cp", "fix": "e.g. 64"},
    )
    head_dim: int = field(default=16, metadata={"ge": 1, "fix": "e.g. 16"})
    dtype: str = field(default="float64", metadata={"choices": tuple(DTYPES)})
    causal: bool = field(default=True, metadata={"help": "causal self-attention"})
    steps: int = field(
        default=3, metadata={"ge": 0, "le": 100, "help": "training steps of the block (0: none)"}
    )
    seed: int = 0
    cp_size: int = field(
        default=0, metadata={"ge": 0, "help": "ranks per context-parallel group; 0: the world"}
    )
    impl: str = field(
        default="solutions",
        metadata={"choices": IMPLS, "help": "run the reference or your phase2_advanced templates"},
    )


def cp_size_of(config: DemoConfig, world_size: int) -> int:
    return config.cp_size or world_size


def validate_config(config: DemoConfig, world_size: int) -> None:
    """Every setting that cannot work with this world, each naming its flag, before any group."""
    problems = []
    cp = cp_size_of(config, world_size)
    if world_size % cp:
        sizes = [d for d in range(1, world_size + 1) if world_size % d == 0]
        problems.append(
            f"--cp-size {config.cp_size} does not divide the world size {world_size}: use one "
            f"of {sizes} (or 0 for the whole world)"
        )
    elif config.seq_len % (2 * cp):
        problems.append(
            f"--seq-len {config.seq_len} is not a multiple of 2·cp = {2 * cp} (the zig-zag "
            f"layout cuts it into {2 * cp} equal chunks): use e.g. "
            f"{-(-config.seq_len // (2 * cp)) * 2 * cp}"
        )
    if problems:
        raise ValueError("; ".join(problems))


@dataclass
class RingRun:
    """One ring-attention forward and backward on one rank: results, traffic, work."""

    out: torch.Tensor
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    forward_bytes: int
    backward_bytes: int
    work: BlockWork


def run_ring(
    cp_module: ModuleType,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    causal: bool,
    zigzag: bool,
) -> RingRun:
    """Ring attention forward and backward on this rank's local tensors, counted."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with record_block_work() as work:
        with CommCounter() as forward:
            out = cp_module.ring_attention(q, k, v, group, causal=causal, zigzag=zigzag)
        with CommCounter() as backward:
            out.backward(grad_out)
    assert q.grad is not None and k.grad is not None and v.grad is not None
    return RingRun(
        out.detach(), (q.grad, k.grad, v.grad), forward.bytes_sent, backward.bytes_sent, work
    )


def cp_groups(cp: int) -> tuple[dist.ProcessGroup | None, int]:
    """(this rank's context-parallel group, which group it is): consecutive ranks."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if cp == world_size:
        return None, 0
    mine = None
    for index in range(world_size // cp):
        group = dist.new_group(list(range(index * cp, (index + 1) * cp)))
        if rank // cp == index:
            assert isinstance(group, dist.ProcessGroup)
            mine = group
    return mine, rank // cp


def _max_over_world(values: Sequence[float], device: torch.device) -> list[float]:
    tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [float(x) for x in tensor.tolist()]


def compare_layout(
    config: DemoConfig,
    layout: ModuleType,
    cp_module: ModuleType,
    group: Any,
    replica: int,
    zigzag: bool,
) -> dict[str, Any]:
    """Ring attention in one layout against SDPA on the whole sequence, printed on rank 0."""
    info = current_info()
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    dtype = DTYPES[config.dtype]
    generator = torch.Generator().manual_seed(config.seed + 1 + replica)
    shape = (config.batch_size, config.heads, config.seq_len, config.head_dim)
    q, k, v, grad = (torch.randn(shape, dtype=dtype, generator=generator) for _ in range(4))
    q, k, v, grad = (t.to(info.device) for t in (q, k, v, grad))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = F.scaled_dot_product_attention(
        whole[0], whole[1], whole[2], is_causal=config.causal
    )
    reference.backward(grad)

    def shard(t: torch.Tensor) -> torch.Tensor:
        return layout.shard_sequence(t, rank, cp, zigzag=zigzag)

    run = run_ring(
        cp_module, shard(q), shard(k), shard(v), shard(grad), group,
        causal=config.causal, zigzag=zigzag,
    )  # fmt: skip
    diffs = [float((run.out - shard(reference.detach())).abs().max())]
    diffs += [
        float((got - shard(ref.grad)).abs().max())
        for got, ref in zip(run.grads, whole, strict=True)
        if ref.grad is not None
    ]
    out_diff, dq, dk, dv = _max_over_world(diffs, info.device)
    kv_bytes = 2 * shard(k).numel() * k.element_size()
    mine = (
        len(run.work.calls("forward")),
        run.work.score_entries("forward"),
        run.work.seconds(),
        run.forward_bytes,
        run.backward_bytes,
    )
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    name = "zig-zag" if zigzag else "contiguous"
    log0(
        f"{name:<10} max |out - sdpa| {out_diff:.1e}  |dq| {dq:.1e}  |dk| {dk:.1e}  "
        f"|dv| {dv:.1e}; each rank sent (cp-1)/cp of K and V per pass: "
        f"{(cp - 1) * kv_bytes / 1024:.1f} KiB forward, {2 * (cp - 1) * kv_bytes / 1024:.1f} KiB "
        "backward (K/V and dK/dV)"
    )
    for global_rank, (blocks, entries, seconds, sent_fwd, sent_bwd) in enumerate(every):
        log0(
            f"  rank {global_rank}: {blocks} block{'s' if blocks != 1 else ''} forward, "
            f"{entries} query-key pairs, "
            f"{seconds * 1e3:.1f} ms CPU in attention; sent {sent_fwd / 1024:.1f} + "
            f"{sent_bwd / 1024:.1f} KiB"
        )
    entries = [item[1] for item in every]
    log0(f"  slowest rank's pairs / mean: {max(entries) * len(entries) / sum(entries):.2f}x")
    return {
        "diffs": {"output": out_diff, "dq": dq, "dk": dk, "dv": dv},
        "forward_bytes": run.forward_bytes,
        "backward_bytes": run.backward_bytes,
        "expected_forward_bytes": (cp - 1) * kv_bytes,
        "pairs": entries,
    }


def compare_training(
    config: DemoConfig, layout: ModuleType, cp_module: ModuleType, group: Any, replica: int
) -> dict[str, float]:
    """The block trained on zig-zag shards against the same block trained in one process."""
    info = current_info()
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    dtype = DTYPES[config.dtype]
    dim = config.heads * config.head_dim
    generator = torch.Generator().manual_seed(config.seed + 100 + replica)
    x, target = (torch.randn(config.batch_size, config.seq_len, dim, dtype=dtype,
                             generator=generator).to(info.device) for _ in range(2))  # fmt: skip
    single = build_block(dim, config.heads, 2 * dim, config.seed, dtype, info.device)
    single_losses = train_steps(
        single, x, target, sdpa_attention(config.causal), steps=config.steps
    )
    parallel = build_block(dim, config.heads, 2 * dim, config.seed, dtype, info.device)

    def ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return cp_module.ring_attention(q, k, v, group, causal=config.causal, zigzag=True)

    def shard(t: torch.Tensor) -> torch.Tensor:
        return layout.shard_sequence(t, rank, cp, zigzag=True, dim=1)

    losses = train_steps(
        parallel, shard(x), shard(target), ring, steps=config.steps, group=group,
        total_elements=target.numel(),
    )  # fmt: skip
    loss_diff = max(abs(a - b) for a, b in zip(losses, single_losses, strict=True))
    param_diff = max(
        float((a - b).detach().abs().max())
        for a, b in zip(parallel.parameters(), single.parameters(), strict=True)
    )
    loss_diff, param_diff = _max_over_world([loss_diff, param_diff], info.device)
    log0(
        f"training    {config.steps} AdamW steps of a transformer block on zig-zag shards: "
        f"losses {', '.join(f'{loss:.6f}' for loss in losses)}; max |loss - one process| "
        f"{loss_diff:.1e}, max |weight - one process| {param_diff:.1e}"
    )
    return {"loss_diff": loss_diff, "param_diff": param_diff}


def library_status(group: Any) -> str:
    """One line on what PyTorch's context_parallel does on this device."""
    info = current_info()
    if info.device.type != "cuda":
        refusal = cpu_refusal(cp_mesh(group, "cpu"))
        return f"library     torch context_parallel on cpu/{info.backend}: {refusal or 'ran'}"
    return "library     torch context_parallel: CUDA present; see library/context_parallel.py"


def run_demo(config: DemoConfig) -> dict[str, Any]:
    """Both layouts against SDPA, the training comparison and the library's status."""
    info = current_info()
    validate_config(config, info.world_size)
    layout = load_impl(PHASE, "context_parallel_layout", config.impl)
    cp_module = load_impl(PHASE, "context_parallel", config.impl)
    cp = cp_size_of(config, info.world_size)
    group, replica = cp_groups(cp)
    log0(
        f"context parallel ({config.impl}): {info.world_size // cp} group(s) of {cp} ranks, "
        f"backend {info.backend}, {config.dtype}; q, k, v {config.batch_size}x{config.heads}x"
        f"{config.seq_len}x{config.head_dim} (batch x heads x sequence x head_dim), "
        f"causal={config.causal}; {config.seq_len // cp} positions per rank"
    )
    results: dict[str, Any] = {
        name: compare_layout(config, layout, cp_module, group, replica, zigzag)
        for name, zigzag in (("contiguous", False), ("zigzag", True))
    }
    if config.steps:
        results["training"] = compare_training(config, layout, cp_module, group, replica)
    status = library_status(group)
    log0(status)
    results["library"] = status
    return results


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(DemoConfig, argv, __doc__)
    if (code := refuse_before_start(lambda world: validate_config(config, world))) is not None:
        return code
    with distributed_session():
        run_demo(config)
    return 0


if __name__ == "__main__":
    run_main(main)
