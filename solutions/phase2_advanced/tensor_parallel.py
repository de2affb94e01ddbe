"""Exercise 2.6, part 3: Megatron's parallel MLP and self-attention, and the library way.

A transformer layer is attention + MLP. Megatron-LM (Shoeybi et al., 2019, section 3, figure 3)
parallelizes both with the same pattern: a column-parallel layer, an element-wise (or per-head)
middle, a row-parallel layer. The middle needs no communication, so each block costs exactly one
all-reduce in forward (g, after the row-parallel layer) and one in backward (f, before the
column-parallel one): four per transformer layer per step, each of batch x sequence x hidden
values.

* ``ParallelMLP``: fc1 (hidden -> ffn) split by output features, GELU on the slice, fc2
  (ffn -> hidden) split by input features.
* ``ParallelSelfAttention``: heads split across ranks. The fused QKV projection is
  column-parallel so each rank computes q, k and v of *its* heads; attention runs per head, on
  this rank's heads only; the output projection is row-parallel. Its dense reference is PyTorch's
  own ``nn.MultiheadAttention``.
* ``library_parallel_mlp``: the same MLP parallelized by ``torch.distributed.tensor.parallel``
  (``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` on a DeviceMesh; see
  https://pytorch.org/docs/stable/distributed.tensor.parallel.html).

Run it (instructor command; the sizes must divide by the number of processes):

    uv run torchrun --standalone --nproc_per_node=2 -m solutions.phase2_advanced.tensor_parallel
    uv run torchrun --standalone --nproc_per_node=4 -m solutions.phase2_advanced.tensor_parallel
"""

from __future__ import annotations

import copy
import functools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from solutions.common.cli import parse_config, refuse_before_start
from solutions.common.comm_counter import CommCounter
from solutions.common.distributed import (
    current_info,
    distributed_session,
)
from solutions.common.rank_logging import log0
from solutions.common.seeding import seed_everything
from solutions.phase2_advanced.tensor_parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    check_divisible,
    column_shard,
    row_shard,
)
from solutions.phase2_advanced.tensor_parallel_ops import Group, tp_rank_and_size

# ----------------------------------------------------------------------------- the MLP


class DenseMLP(nn.Module):
    """The transformer MLP block on one device: Linear(hidden, ffn), GELU, Linear(ffn, hidden)."""

    def __init__(self, hidden: int, ffn_hidden: int, bias: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn_hidden, bias=bias)
        self.fc2 = nn.Linear(ffn_hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class ParallelMLP(nn.Module):
    """Megatron's MLP: fc1 column-parallel (no gather), GELU on the slice, fc2 row-parallel.

    GELU is element-wise, so applying it to this rank's slice of fc1's output is the same as
    applying it to the whole and slicing: the only communication is fc1's f (backward) and
    fc2's g (forward).
    """

    def __init__(self, fc1: ColumnParallelLinear, fc2: RowParallelLinear) -> None:
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    @classmethod
    def from_dense(cls, dense: DenseMLP, group: Group = None) -> ParallelMLP:
        """This rank's shard of ``dense`` (copied). Raises ValueError before any communication
        when the MLP's hidden size does not divide by the group's size."""
        _, tp_size = tp_rank_and_size(group)
        check_divisible(dense.fc1.out_features, "MLP hidden size", tp_size)
        # TODO 2.6: build fc1 and fc2 so that the MLP needs one all-reduce each way.
        # Invariant: fc1's output on this rank is exactly the slice of features fc2's weight
        #   shard expects, so nothing is gathered between them; the output is replicated.
        # Hint 1: fc1 keeps its output split (no gather); fc2 is told its input is already
        #   split, so it does not slice it again.
        # Hint 2: fc1 = ColumnParallelLinear.from_dense(dense.fc1, group, gather_output=False);
        #   fc2 = RowParallelLinear.from_dense(dense.fc2, group, input_is_parallel=True);
        #   return cls(fc1, fc2)
        # See guidelines.md#26-tensor-parallelism
        # >>> solution
        fc1 = ColumnParallelLinear.from_dense(dense.fc1, group, gather_output=False)
        fc2 = RowParallelLinear.from_dense(dense.fc2, group, input_is_parallel=True)
        return cls(fc1, fc2)
        # <<< solution

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


# ----------------------------------------------------------------------------- attention


def check_attention(attention: nn.MultiheadAttention) -> None:
    """Refuse the nn.MultiheadAttention options this parallel version does not reproduce."""
    problems = []
    if not attention.batch_first:
        problems.append("batch_first=False (build it with batch_first=True)")
    if not attention._qkv_same_embed_dim:
        problems.append("kdim/vdim differ from embed_dim (self-attention needs one input)")
    if attention.dropout:
        problems.append(
            f"dropout={attention.dropout} (would need a per-rank RNG, Megatron's RNG tracker)"
        )
    if attention.bias_k is not None or attention.add_zero_attn:
        problems.append("add_bias_kv / add_zero_attn")
    if problems:
        raise ValueError("cannot parallelize this nn.MultiheadAttention: " + "; ".join(problems))


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


class ParallelSelfAttention(nn.Module):
    """Multi-head self-attention with the heads split across ranks (batch-first input).

    ``qkv`` is column-parallel over the fused [q; k; v] projection (``fused_parts=3``), so rank
    r computes q, k and v for heads [r*h, (r+1)*h) where h = num_heads / tp_size. Heads are
    independent until the output projection, which is row-parallel: its input features are the
    concatenated heads, so this rank's heads are exactly its input slice.
    """

    def __init__(
        self,
        qkv: ColumnParallelLinear,
        out_proj: RowParallelLinear,
        num_heads: int,
        causal: bool = False,
    ) -> None:
        super().__init__()
        check_divisible(num_heads, "number of attention heads", qkv.tp_size)
        self.qkv, self.out_proj = qkv, out_proj
        self.num_heads = num_heads
        self.local_heads = num_heads // qkv.tp_size
        self.head_dim = qkv.in_features // num_heads
        self.causal = causal

    @classmethod
    def from_dense(
        cls, attention: nn.MultiheadAttention, group: Group = None, *, causal: bool = False
    ) -> ParallelSelfAttention:
        """This rank's heads of ``attention`` (copied). Raises ValueError before any
        communication when the number of heads does not divide by the group's size."""
        check_attention(attention)
        _, tp_size = tp_rank_and_size(group)
        check_divisible(attention.num_heads, "number of attention heads", tp_size)
        # TODO 2.6: shard the fused QKV projection by heads and the output projection by rows.
        # Invariant: this rank's qkv output holds [q; k; v] of its own heads only; out_proj
        #   takes those heads' outputs (input_is_parallel) and reduces once.
        # Hint 1: nn.MultiheadAttention keeps q, k, v stacked in in_proj_weight [3E, E] (and
        #   in_proj_bias); a contiguous slice of its rows would give rank 0 only q's. Use
        #   ColumnParallelLinear.from_weights with fused_parts=3; out_proj is an nn.Linear.
        # Hint 2: qkv = ColumnParallelLinear.from_weights(attention.in_proj_weight,
        #   attention.in_proj_bias, group, fused_parts=3); out_proj = RowParallelLinear
        #   .from_dense(attention.out_proj, group, input_is_parallel=True);
        #   return cls(qkv, out_proj, attention.num_heads, causal)
        # See guidelines.md#26-tensor-parallelism
        # >>> solution
        qkv = ColumnParallelLinear.from_weights(
            attention.in_proj_weight, attention.in_proj_bias, group, fused_parts=3
        )
        out_proj = RowParallelLinear.from_dense(attention.out_proj, group, input_is_parallel=True)
        return cls(qkv, out_proj, attention.num_heads, causal)
        # <<< solution

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[batch, seq, embed] -> [batch, seq, embed], replicated on every rank."""
        # TODO 2.6: attention over this rank's heads, then the row-parallel output projection.
        # Invariant: the result equals the dense attention's output on every rank; the only
        #   communication is qkv's f (backward) and out_proj's g (forward).
        # Hint 1: qkv(x) is [batch, seq, 3 * local_heads * head_dim], laid out [q; k; v], each
        #   head-major. Reshape to (batch, seq, 3, local_heads, head_dim), move the 3 and the
        #   heads in front of seq; F.scaled_dot_product_attention(q, k, v,
        #   is_causal=self.causal) works per head; put heads back next to each other.
        # Hint 2: batch, seq, _ = x.shape; q, k, v = self.qkv(x).view(batch, seq, 3,
        #   self.local_heads, self.head_dim).permute(2, 0, 3, 1, 4);
        #   heads = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal);
        #   return self.out_proj(heads.transpose(1, 2).reshape(batch, seq, -1))
        # See guidelines.md#26-tensor-parallelism
        # >>> solution
        batch, seq, _ = x.shape
        qkv = self.qkv(x).view(batch, seq, 3, self.local_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [batch, local_heads, seq, head_dim]
        heads = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out_proj(heads.transpose(1, 2).reshape(batch, seq, -1))
        # <<< solution


# ----------------------------------------------------------------------------- the library way


def tensor_parallel_mesh() -> DeviceMesh:
    """A 1-D DeviceMesh over the whole world, on this rank's device type (CPU under gloo)."""
    info = current_info()
    return init_device_mesh(info.device.type, (info.world_size,))


def library_parallel_mlp(dense: DenseMLP, mesh: DeviceMesh | None = None) -> nn.Module:
    """A copy of ``dense`` parallelized by ``torch.distributed.tensor.parallel``.

    ``ColwiseParallel`` on fc1 and ``RowwiseParallel`` on fc2 are the library's names for the
    column- and row-parallel layers above: the weights become DTensors (``weight.to_local()`` is
    this rank's shard, the same slice ``ParallelMLP`` holds), the input is taken as replicated,
    and the output comes back replicated as a local tensor (an ``AsyncCollectiveTensor`` that
    waits for its all-reduce on first use). Rank 0's weights are scattered to the others
    (``src_data_rank=0``), so the result matches a dense model built on rank 0.
    """
    model = copy.deepcopy(dense)
    model.zero_grad(set_to_none=True)  # deepcopy copies .grad too
    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    return parallelize_module(model, mesh or tensor_parallel_mesh(), plan)


# ----------------------------------------------------------------------------- the demo

DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass
class DemoConfig:
    """Sizes of the demo; every rank must be given the same values."""

    hidden: int = 64
    ffn_hidden: int = 256
    heads: int = 8
    batch_size: int = 4
    seq_len: int = 16
    dtype: str = "float64"
    causal: int = 1
    seed: int = 0


def validate_config(config: DemoConfig, tp_size: int) -> None:
    """Refuse sizes that do not split evenly, before any process group exists."""
    if config.dtype not in DTYPES:
        raise ValueError(f"--dtype {config.dtype!r} is unknown: choose one of {', '.join(DTYPES)}")
    if config.hidden % config.heads:
        raise ValueError(
            f"--hidden {config.hidden} is not divisible by --heads {config.heads}: every head "
            "needs the same width"
        )
    check_divisible(config.ffn_hidden, "MLP hidden size", tp_size)
    check_divisible(config.heads, "number of attention heads", tp_size)


def _mlp_grad_shards(dense: DenseMLP, rank: int, tp_size: int) -> dict[str, torch.Tensor]:
    grads = {name: p.grad for name, p in dense.named_parameters() if p.grad is not None}
    return {
        "fc1.weight": column_shard(grads["fc1.weight"], rank, tp_size),
        "fc1.bias": column_shard(grads["fc1.bias"], rank, tp_size),
        "fc2.weight": row_shard(grads["fc2.weight"], rank, tp_size),
        "fc2.bias": grads["fc2.bias"],
    }


def _attention_grad_shards(
    dense: nn.MultiheadAttention, rank: int, tp_size: int
) -> dict[str, torch.Tensor]:
    def grad(p: torch.Tensor) -> torch.Tensor:
        assert p.grad is not None, "the dense attention ran no backward"
        return p.grad

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


def local_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's gradient of every parameter: a DTensor's local shard, or the tensor itself."""
    grads = {}
    for name, param in module.named_parameters():
        if param.grad is not None:
            grad = param.grad
            grads[name] = grad.to_local() if isinstance(grad, DTensor) else grad
    return grads


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


def run_demo(config: DemoConfig) -> dict[str, Comparison]:
    """Compare the parallel MLP, attention and library MLP with their dense references.

    Returns, under "mlp", "attention" and "library_mlp", the worst differences over all ranks
    and this rank's all-reduce counts.
    """
    info = current_info()
    validate_config(config, info.world_size)
    rank, tp_size = info.rank, info.world_size
    dtype = DTYPES[config.dtype]
    causal = bool(config.causal)
    seed_everything(config.seed)
    dense_mlp = DenseMLP(config.hidden, config.ffn_hidden).to(info.device, dtype)
    dense_attention = nn.MultiheadAttention(config.hidden, config.heads, batch_first=True)
    dense_attention = dense_attention.to(info.device, dtype)
    x = torch.randn(
        config.batch_size, config.seq_len, config.hidden, dtype=dtype, device=info.device
    )
    log0(
        f"tensor parallel: {tp_size} ranks, backend {info.backend}, {config.dtype}; input "
        f"{config.batch_size}x{config.seq_len}x{config.hidden}; MLP {config.hidden}->"
        f"{config.ffn_hidden}->{config.hidden} ({config.ffn_hidden // tp_size} hidden units per "
        f"rank); attention {config.heads} heads ({config.heads // tp_size} per rank), "
        f"causal={causal}"
    )
    mlp_shards = functools.partial(_mlp_grad_shards, dense_mlp, rank, tp_size)
    mlp = ParallelMLP.from_dense(dense_mlp)
    results = {
        "mlp": _report("MLP", compare_with_dense(mlp, dense_mlp, x, mlp_shards), info.device)
    }
    attention = ParallelSelfAttention.from_dense(dense_attention, causal=causal)
    result = compare_with_dense(
        attention,
        dense_attention,
        x,
        functools.partial(_attention_grad_shards, dense_attention, rank, tp_size),
        run_dense=lambda t: dense_self_attention(dense_attention, t, causal),
    )
    results["attention"] = _report("attention", result, info.device)
    library = library_parallel_mlp(dense_mlp)
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
    sys.exit(main())
