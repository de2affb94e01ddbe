"""Demo of exercise 2.6: the parallel MLP, attention and library MLP against their dense selves.

Every rank builds the same dense MLP and ``nn.MultiheadAttention`` from one seed, takes its shard
of each, runs forward and backward, and rank 0 prints the largest difference from the dense
module over all ranks, with the all-reduces counted in forward and backward. ``--tp-size`` splits
the world into tensor-parallel groups of that size (consecutive ranks; 0: one group of every
rank), each working on its own input at the same time. ``--impl templates`` runs your own
``phase2_advanced/template_tensor_parallel*.py``.

    uv run torchrun --standalone --nproc_per_node=2 \
        -m solutions.phase2_advanced.demos.tensor_parallel
    uv run torchrun --standalone --nproc_per_node=4 \
        -m solutions.phase2_advanced.demos.tensor_parallel --tp-size 2 --impl templates
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from course.cli import parse_config, refuse_before_start, run_main
from course.comm_counter import CommCounter
from course.distributed import current_info, distributed_session
from course.impl import IMPLS, load_impl
from course.rank_logging import log0
from course.seeding import seed_everything
from solutions.phase2_advanced.demos.support import bound_problems
from solutions.phase2_advanced.library.tensor_parallel import library_parallel_mlp, local_grads

PHASE = "phase2_advanced"
DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass
class DemoConfig:
    """Sizes of the demo; every rank must be given the same values."""

    hidden: int = field(
        default=64, metadata={"bounds": {"ge": 1, "fix": "a multiple of --heads, e.g. 64"}}
    )
    ffn_hidden: int = field(
        default=256,
        metadata={
            "help": "MLP hidden size (split over ranks)",
            "bounds": {"ge": 1, "fix": "e.g. 256"},
        },
    )
    heads: int = field(
        default=8,
        metadata={
            "help": "attention heads (split over ranks)",
            "bounds": {"ge": 1, "fix": "e.g. 8"},
        },
    )
    batch_size: int = field(default=4, metadata={"bounds": {"ge": 1, "fix": "e.g. --batch-size 4"}})
    seq_len: int = field(default=16, metadata={"bounds": {"ge": 1, "fix": "e.g. --seq-len 16"}})
    dtype: str = field(default="float64", metadata={"choices": tuple(DTYPES)})
    causal: bool = field(default=True, metadata={"help": "causal self-attention"})
    seed: int = field(default=0, metadata={"bounds": {"ge": 0, "fix": "a seed >= 0"}})
    tp_size: int = field(
        default=0,
        metadata={
            "help": "ranks per tensor-parallel group; 0: the whole world",
            "bounds": {
                "ge": 0,
                "fix": "0 (the whole world) or a divisor of the number of processes",
            },
        },
    )
    impl: str = field(
        default="solutions",
        metadata={"choices": IMPLS, "help": "run the reference or your phase2_advanced templates"},
    )


def tp_size_of(config: DemoConfig, world_size: int) -> int:
    return config.tp_size or world_size


def validate_config(config: DemoConfig, world_size: int) -> None:
    """Every size that does not split evenly, each naming its flag, before any process group."""
    problems = bound_problems(config)
    tp = tp_size_of(config, world_size)
    if tp < 1 or world_size % tp:
        sizes = [d for d in range(1, world_size + 1) if world_size % d == 0]
        problems.append(
            f"--tp-size {config.tp_size} does not divide the world size {world_size}: use one "
            f"of {sizes} (or 0 for the whole world)"
        )
        tp = 0
    if config.heads >= 1 and config.hidden % config.heads:
        problems.append(
            f"--hidden {config.hidden} is not divisible by --heads {config.heads}: every head "
            f"needs the same width (try --hidden "
            f"{max(config.heads, round(config.hidden / config.heads) * config.heads)})"
        )
    if tp >= 1:
        for flag, value in (("--ffn-hidden", config.ffn_hidden), ("--heads", config.heads)):
            if value >= 1 and value % tp:
                nearest = max(tp, round(value / tp) * tp)
                problems.append(
                    f"{flag} {value} is not divisible by the tensor-parallel size {tp} "
                    f"(try {nearest})"
                )
    if problems:
        raise ValueError("; ".join(problems))


def dense_self_attention(
    attention: nn.MultiheadAttention, x: torch.Tensor, causal: bool = False
) -> torch.Tensor:
    """The dense reference: ``attention(x, x, x)`` on [batch, seq, embed], causal if asked."""
    mask = None
    if causal:
        mask = nn.Transformer.generate_square_subsequent_mask(
            x.shape[1], device=x.device, dtype=x.dtype
        )
    output, _ = attention(x, x, x, attn_mask=mask, is_causal=causal, need_weights=False)
    return output


def _mlp_grad_shards(
    layers: object, dense: nn.Module, rank: int, tp_size: int
) -> dict[str, torch.Tensor]:
    grads = {name: p.grad for name, p in dense.named_parameters() if p.grad is not None}
    column_shard, row_shard = layers.column_shard, layers.row_shard  # type: ignore[attr-defined]
    return {
        "fc1.weight": column_shard(grads["fc1.weight"], rank, tp_size),
        "fc1.bias": column_shard(grads["fc1.bias"], rank, tp_size),
        "fc2.weight": row_shard(grads["fc2.weight"], rank, tp_size),
        "fc2.bias": grads["fc2.bias"],
    }


def _attention_grad_shards(
    layers: object, dense: nn.MultiheadAttention, rank: int, tp_size: int
) -> dict[str, torch.Tensor]:
    def grad(p: torch.Tensor) -> torch.Tensor:
        assert p.grad is not None, "the dense attention ran no backward"
        return p.grad

    column_shard, row_shard = layers.column_shard, layers.row_shard  # type: ignore[attr-defined]
    return {
        "qkv.weight": column_shard(grad(dense.in_proj_weight), rank, tp_size, fused_parts=3),
        "qkv.bias": column_shard(grad(dense.in_proj_bias), rank, tp_size, fused_parts=3),
        "out_proj.weight": row_shard(grad(dense.out_proj.weight), rank, tp_size),
        "out_proj.bias": grad(dense.out_proj.bias),
    }


@dataclass
class Comparison:
    """How far a parallel block is from its dense reference, and what it communicated."""

    output_diff: float
    input_grad_diff: float
    weight_grad_diff: float
    forward_all_reduces: int
    backward_all_reduces: int
    bytes_all_reduced: int


def compare_with_dense(
    parallel: nn.Module,
    dense: nn.Module,
    x: torch.Tensor,
    expected_grads: Callable[[], dict[str, torch.Tensor]],
    run_dense: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Comparison:
    """Run both on ``x`` (loss: a fixed weighted sum of the output), compare, count all-reduces.

    ``expected_grads`` returns, after the dense backward, the slice of each dense gradient this
    rank's shard should hold, under the parallel module's parameter names.
    """
    dense.zero_grad(set_to_none=True)
    parallel.zero_grad(set_to_none=True)
    dense_x = x.detach().clone().requires_grad_()
    dense_out = (run_dense or dense)(dense_x)
    weights = torch.linspace(-1.0, 1.0, dense_out.numel(), dtype=x.dtype, device=x.device)
    weights = weights.view_as(dense_out)
    (dense_out * weights).sum().backward()
    parallel_x = x.detach().clone().requires_grad_()
    with CommCounter() as forward_comm:
        out = parallel(parallel_x)
    with CommCounter() as backward_comm:
        (out * weights).sum().backward()
    assert dense_x.grad is not None and parallel_x.grad is not None
    expected = expected_grads()
    grads = local_grads(parallel)
    all_reduced = [
        record.nbytes
        for comm in (forward_comm, backward_comm)
        for record in comm.records
        if record.op == "all_reduce"
    ]
    return Comparison(
        output_diff=float((out - dense_out).detach().abs().max()),
        input_grad_diff=float((parallel_x.grad - dense_x.grad).abs().max()),
        weight_grad_diff=max(float((grads[n] - g).abs().max()) for n, g in expected.items()),
        forward_all_reduces=forward_comm.count("all_reduce"),
        backward_all_reduces=backward_comm.count("all_reduce"),
        bytes_all_reduced=sum(all_reduced),
    )


def _report(
    label: str, result: Comparison, device: torch.device, counted: bool = True
) -> Comparison:
    """Print the worst difference over all ranks on rank 0; return it (the same on every rank)."""
    diffs = torch.tensor(
        [result.output_diff, result.input_grad_diff, result.weight_grad_diff],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    out_diff, x_diff, w_diff = diffs.tolist()
    traffic = (
        f"all-reduces: {result.forward_all_reduces} forward + {result.backward_all_reduces} "
        f"backward ({result.bytes_all_reduced / 1024:.1f} KiB in all)"
        if counted
        else "collectives: inside DTensor, not seen by CommCounter"
    )
    log0(
        f"{label:<12} max |output - dense| {out_diff:.1e}  |dx - dense| {x_diff:.1e}  "
        f"|dW shard - dense slice| {w_diff:.1e}  {traffic}"
    )
    return replace(result, output_diff=out_diff, input_grad_diff=x_diff, weight_grad_diff=w_diff)


def tensor_parallel_groups(tp_size: int) -> tuple[dist.ProcessGroup | None, DeviceMesh, int]:
    """(this rank's tensor-parallel group, its 1-D mesh, which group it is).

    The group is None (the world) when ``tp_size`` is the world size; otherwise a 2-D mesh
    (replica x tensor-parallel) of consecutive ranks, like Megatron's and torchtitan's layouts.
    """
    info = current_info()
    if tp_size == info.world_size:
        mesh = init_device_mesh(info.device.type, (tp_size,))
        return None, mesh, 0
    replicas = info.world_size // tp_size
    mesh2d = init_device_mesh(
        info.device.type, (replicas, tp_size), mesh_dim_names=("replica", "tp")
    )
    return mesh2d["tp"].get_group(), mesh2d["tp"], info.rank // tp_size


def run_demo(config: DemoConfig) -> dict[str, Comparison]:
    """Compare the parallel MLP, attention and library MLP with their dense references.

    Returns, under "mlp", "attention" and "library_mlp", the worst differences over all ranks
    and this rank's all-reduce counts.
    """
    info = current_info()
    validate_config(config, info.world_size)
    tp = load_impl(PHASE, "tensor_parallel", config.impl)
    layers = load_impl(PHASE, "tensor_parallel_layers", config.impl)
    tp_size = tp_size_of(config, info.world_size)
    group, mesh, replica = tensor_parallel_groups(tp_size)
    rank = dist.get_rank(group)
    dtype = DTYPES[config.dtype]
    seed_everything(config.seed)
    dense_mlp = tp.DenseMLP(config.hidden, config.ffn_hidden).to(info.device, dtype)
    dense_attention = nn.MultiheadAttention(config.hidden, config.heads, batch_first=True)
    dense_attention = dense_attention.to(info.device, dtype)
    generator = torch.Generator().manual_seed(config.seed + 1 + replica)  # each group its own x
    x = torch.randn(
        config.batch_size, config.seq_len, config.hidden, dtype=dtype, generator=generator
    ).to(info.device)
    groups = info.world_size // tp_size
    log0(
        f"tensor parallel ({config.impl}): {groups} group(s) of {tp_size} ranks, backend "
        f"{info.backend}, {config.dtype}; input {config.batch_size}x{config.seq_len}x"
        f"{config.hidden}; MLP {config.hidden}->{config.ffn_hidden}->{config.hidden} "
        f"({config.ffn_hidden // tp_size} hidden units per rank); attention {config.heads} heads "
        f"({config.heads // tp_size} per rank), causal={config.causal}"
    )
    mlp_shards = functools.partial(_mlp_grad_shards, layers, dense_mlp, rank, tp_size)
    mlp = tp.ParallelMLP.from_dense(dense_mlp, group)
    results = {
        "mlp": _report("MLP", compare_with_dense(mlp, dense_mlp, x, mlp_shards), info.device)
    }
    attention = tp.ParallelSelfAttention.from_dense(dense_attention, group, causal=config.causal)
    result = compare_with_dense(
        attention,
        dense_attention,
        x,
        functools.partial(_attention_grad_shards, layers, dense_attention, rank, tp_size),
        run_dense=lambda t: dense_self_attention(dense_attention, t, config.causal),
    )
    results["attention"] = _report("attention", result, info.device)
    library = library_parallel_mlp(dense_mlp, mesh)
    result = compare_with_dense(library, dense_mlp, x, mlp_shards)
    results["library_mlp"] = _report("library MLP", result, info.device, counted=False)
    activation = config.batch_size * config.seq_len * config.hidden * x.element_size()
    log0(
        f"cost per transformer layer (attention + MLP) per step: 4 all-reduces of "
        f"{activation / 1024:.1f} KiB (batch x seq x hidden), 2 in forward and 2 in backward"
    )
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
