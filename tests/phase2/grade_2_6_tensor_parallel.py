"""Grader of exercise 2.6, tensor parallelism: ``uv run pytest tests/test_phase2.py -m ex2_6``.

Each parallel piece is compared, in float64 and in real worlds of 2-4 processes, with the dense
module it splits: outputs, input gradients and every weight shard's gradient (against the
matching slice of the dense gradient). Beyond values, the tests check the shape of the
communication: exactly one all-reduce in forward and one in backward per parallel MLP or
attention block, none where Megatron has none, and, with ``group=`` a subgroup of the world,
not a single message outside it. Expected values are computed here, on one process, with
slicing written independently of the code under test.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from grading import defined_at, exercise, impl, learner_line
from phase2_group_helpers import (
    SUBGROUP_SIZE,
    SUBGROUP_WORLD,
    crossing_message,
    demo_module,
    describe,
    fail,
    fail_on_crossing,
    max_diff,
    module,
    small_world,
)
from subgroups import split_into_groups
from torch import nn
from tp_learner_calls import raised_at_learner, shard_shape_problem
from tp_namers import COLUMN_LAYER, ROW_LAYER, placement_verdict

from course.comm_counter import CommCounter

F64 = torch.float64
ATOL = 1e-10  # float64: the parallel code sums in a different order than the dense one


def tp_ops_module() -> ModuleType:
    return module("tensor_parallel_ops")


def tp_layers_module() -> ModuleType:
    return module("tensor_parallel_layers")


def tp_module() -> ModuleType:
    return module("tensor_parallel")


def close(got: torch.Tensor | None, want: torch.Tensor, atol: float = ATOL) -> bool:
    return max_diff(got, want) <= atol


def expect_close(
    got: torch.Tensor | None, want: torch.Tensor, message: str, atol: float = ATOL
) -> None:
    """Fail with ``message`` and how far off ``got`` is, unless it matches ``want``."""
    if not close(got, want, atol):
        fail(f"{message}: {describe(got, want)}")


# ============================================================================ 2.6 tensor parallel


def rows(tensor: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """Rank's equal slice of dim 0 (column-parallel weight rows, bias entries)."""
    width = tensor.shape[0] // n
    return tensor[rank * width : (rank + 1) * width]


def cols(tensor: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """Rank's equal slice of the last dim (row-parallel weight columns, sliced activations)."""
    width = tensor.shape[-1] // n
    return tensor[..., rank * width : (rank + 1) * width]


def qkv_rows(tensor: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """Rank's rows of each of q, k and v in a fused [q; k; v] projection (its heads only)."""
    return torch.cat([rows(part, rank, n) for part in tensor.chunk(3, dim=0)])


def seeded(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def make_linear(in_features: int, out_features: int) -> nn.Linear:
    torch.manual_seed(11)
    linear = nn.Linear(in_features, out_features).to(F64)
    with torch.no_grad():
        linear.bias.uniform_(0.5, 1.5)  # clearly non-zero: a bias added n times shows
    return linear


def loss_weights(shape: tuple[int, ...]) -> torch.Tensor:
    """Fixed weights for the loss sum(output * w), so every output element gets its own gradient."""
    count = 1
    for size in shape:
        count *= size
    return torch.linspace(-1.0, 1.0, count, dtype=F64).view(shape)


def dense_run(
    module: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and input gradient of a dense module under the loss sum(out * w)."""
    x = x.clone().requires_grad_()
    out = module(x)
    (out * loss_weights(tuple(out.shape))).sum().backward()
    assert x.grad is not None
    return out.detach(), x.grad


# ---------------------------------------------------------------------------- f and g


def _needs_a_process_group(exc: Exception) -> bool:
    return "process group" in str(exc).lower()


def _in_process(what: str, site: str, call: Callable[[], Any]) -> tuple[bool, Any]:
    """``(True, call())`` run in this process with no process group; ``(False, None)`` when the
    code reached for one without calling a collective (left to the worlds' test); a collective
    it called fails here, named with the calls."""
    with CommCounter() as comm:
        try:
            return True, call()
        except (RuntimeError, ValueError) as exc:
            if not _needs_a_process_group(exc):
                raise
    if comm.records:
        fail(
            f"2.6 {what} must not communicate: every rank already holds what it needs; it "
            f"called {dict(comm.calls)}{site}"
        )
    return False, None


@exercise("2.6")
def test_f_forward_and_g_backward_hand_their_input_on_in_process() -> None:
    """In process, before any world starts: the two directions that need no other rank (f's
    forward, g's backward) hand their input on unchanged, as a new tensor, and call no
    collective. A mistake there shows in a second instead of after the first world; code that
    reaches for a process group without a collective is left to the worlds' test."""
    ops = tp_ops_module()
    x = seeded(1, 3, 4).requires_grad_()
    before = x.detach().clone()
    site = defined_at(ops.CopyToTensorParallelRegion.forward)
    ran, y = _in_process(
        "f (copy_to_tensor_parallel_region) forward",
        site,
        lambda: ops.copy_to_tensor_parallel_region(x, group=None),
    )
    if not ran:
        return
    if y is x:
        fail(
            "2.6 f (copy_to_tensor_parallel_region) forward returned the very tensor it was "
            f"handed; autograd needs a new tensor object to attach f's backward to{site}"
        )
    if not torch.equal(x.detach(), before):
        fail(f"2.6 f forward changed its input: {describe(x.detach(), before)}{site}")
    if not torch.equal(y.detach(), before):
        fail(
            "2.6 f (copy_to_tensor_parallel_region) forward must return its input's values: "
            f"{describe(y.detach(), before)}{site}"
        )
    upstream = seeded(2, 3, 4)
    site = defined_at(ops.ReduceFromTensorParallelRegion.backward)
    ran, returned = _in_process(
        "g (reduce_from_tensor_parallel_region) backward",
        site,
        lambda: ops.ReduceFromTensorParallelRegion.backward(SimpleNamespace(group=None), upstream),
    )
    if not ran:
        return
    if not (isinstance(returned, tuple) and len(returned) == 2):
        fail(
            "2.6 g (reduce_from_tensor_parallel_region) backward must return two values, the "
            f"gradient and None for the group; it returned {type(returned).__name__}{site}"
        )
    grad, none = returned
    if not (isinstance(grad, torch.Tensor) and torch.equal(grad, upstream)) or none is not None:
        fail(
            "2.6 g (reduce_from_tensor_parallel_region) backward must return (grad_output, "
            "None), this rank's gradient as it came: "
            f"{describe(grad if isinstance(grad, torch.Tensor) else None, upstream)}{site}"
        )


def written_in_place(
    what: str, after: torch.Tensor, before: torch.Tensor, summed: torch.Tensor
) -> str:
    """How a tensor a function was handed changed ("" when it did not): the in-place all-reduce
    is named only when the tensor now holds exactly the sum over the group's ranks; any other
    change (a mean, a sum over other ranks, a scaled copy) is described by its difference."""
    if torch.equal(after, before):
        return ""
    if close(after, summed):
        return f"it now holds the sum over the ranks: an all-reduce wrote into {what} itself"
    return f"its values changed, {describe(after, before)} from what was handed in"


def grad_output_verdict(
    after: torch.Tensor, handed: torch.Tensor, summed: torch.Tensor
) -> str | None:
    """What f's backward did to the gradient autograd handed it, None when it left it alone."""
    how = written_in_place("grad_output", after, handed, summed)
    if not how:
        return None
    return (
        f"f backward changed the gradient autograd handed it ({how}). Autograd may hand that "
        "tensor to other functions too, and after loss.sum().backward() it is an expanded "
        "view of one element (stride 0), which an in-place all-reduce corrupts or crashes the "
        "rank on (SIGSEGV seen). The invariant asks that grad_output be left as it was: "
        "which tensor may the all-reduce write into?"
    )


def g_input_verdict(after: torch.Tensor, before: torch.Tensor, summed: torch.Tensor) -> str | None:
    """What g's forward did to its input, None when it left it alone."""
    how = written_in_place("g's input", after, before, summed)
    if not how:
        return None
    return (
        f"g (reduce_from_tensor_parallel_region) forward changed its input ({how}); it must "
        "leave its input as it was and return the sum in a tensor of its own"
    )


def operators_worker() -> list[str]:
    return operator_problems(None, 0)


def operator_problems(group: dist.ProcessGroup | None, offset: int) -> list[str]:
    """Check f, g, gather and scatter on ``group``; inputs depend on ``offset`` (per group)."""
    ops = tp_ops_module()
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    problems: list[str] = []

    def per_rank(seed: int, r: int) -> torch.Tensor:
        return seeded(100 * seed + r + offset, 3, 4)

    # f: identity forward, all-reduce backward
    x = per_rank(1, rank).requires_grad_()
    with CommCounter() as forward:
        y = ops.copy_to_tensor_parallel_region(x, group=group)
    upstream = per_rank(2, rank)
    handed = upstream.clone()
    with CommCounter() as backward:
        y.backward(upstream)  # autograd hands f's backward this very tensor as grad_output
    summed = torch.stack([per_rank(2, r) for r in range(n)]).sum(dim=0)
    said = grad_output_verdict(upstream, handed, summed)
    if said:
        problems.append(said)
    if not torch.equal(y.detach(), x.detach()):
        problems.append("f (copy_to_tensor_parallel_region) forward must return its input")
    if forward.records:
        problems.append(f"f forward must not communicate; it called {dict(forward.calls)}")
    if not close(x.grad, summed):
        problems.append(
            f"f backward must return the sum of every rank's gradient: {describe(x.grad, summed)}"
        )
    if backward.count("all_reduce") != 1 or len(backward.records) != 1:
        problems.append(f"f backward must be one all-reduce; it called {dict(backward.calls)}")

    # g: all-reduce forward, identity backward
    x = per_rank(3, rank).requires_grad_()
    before = x.detach().clone()
    with CommCounter() as forward:
        y = ops.reduce_from_tensor_parallel_region(x, group=group)
    upstream = per_rank(4, rank)
    with CommCounter() as backward:
        y.backward(upstream)
    want = torch.stack([per_rank(3, r) for r in range(n)]).sum(dim=0)
    if not close(y.detach(), want):
        problems.append(
            f"g (reduce_from_tensor_parallel_region) forward must return the sum over ranks: "
            f"{describe(y.detach(), want)}"
        )
    said = g_input_verdict(x.detach(), before, want)
    if said:
        problems.append(said)
    if forward.count("all_reduce") != 1 or len(forward.records) != 1:
        problems.append(f"g forward must be one all-reduce; it called {dict(forward.calls)}")
    if not close(x.grad, upstream):
        problems.append(f"g backward must be the identity: {describe(x.grad, upstream)}")
    if backward.records:
        problems.append(f"g backward must not communicate; it called {dict(backward.calls)}")

    # gather: all-gather forward, own slice backward
    x = per_rank(5, rank).requires_grad_()
    y = ops.gather_from_tensor_parallel_region(x, group=group)
    want = torch.cat([per_rank(5, r) for r in range(n)], dim=-1)
    if not close(y.detach(), want):
        problems.append(
            "gather_from_tensor_parallel_region forward must concatenate every rank's tensor "
            f"along the last dim, in rank order: {describe(y.detach(), want)}"
        )
    upstream = seeded(6 + offset, 3, 4 * n)  # the same on every rank of the group
    try:
        y.backward(upstream)
    except RuntimeError as err:
        hint = " (is the slice picked by the rank in the group, dist.get_rank(group)?)"
        return [
            f"rank {dist.get_rank()}: gather backward raised {err}{learner_line(err)}"
            + (hint if group else "")
        ]
    want = cols(upstream, rank, n)
    if not close(x.grad, want):
        problems.append(
            f"gather backward must keep this rank's slice of the gradient: {describe(x.grad, want)}"
        )

    # scatter: own slice forward, all-gather backward
    full = seeded(7 + offset, 3, 4 * n).requires_grad_()
    y = ops.scatter_to_tensor_parallel_region(full, group=group)
    y.backward(per_rank(8, rank))
    want = torch.cat([per_rank(8, r) for r in range(n)], dim=-1)
    if not close(full.grad, want):
        problems.append(
            "scatter_to_tensor_parallel_region backward must gather every rank's gradient: "
            f"{describe(full.grad, want)}"
        )
    return [f"rank {dist.get_rank()}: {p}" for p in problems]


@exercise("2.6")
@pytest.mark.parametrize("world_size", [2])
def test_megatron_f_and_g_operators(world_size: int) -> None:
    problems = [
        p for rank_problems in small_world(operators_worker, world_size) for p in rank_problems
    ]
    if problems:
        fail(f"2.6 operators on {world_size} ranks:\n  " + "\n  ".join(problems[:8]))


# ---------------------------------------------------------------------------- linear layers

IN, OUT, BATCH, SEQ = 8, 12, 2, 3


SHARD_CASES = [(n, rank) for n in (2, 4) for rank in range(n)]  # (world size, rank)
FUSED_WEIGHT = torch.arange(24, dtype=F64).view(24, 1)  # 3 parts of 8 rows: row i holds i
ROW_WEIGHT = torch.arange(32, dtype=F64).view(4, 8)  # entry (i, j) holds 8 i + j


def column_shard_verdict(got: dict[tuple[int, int], torch.Tensor]) -> str | None:
    """What is wrong with column_shard(FUSED_WEIGHT, rank, n, fused_parts=3) on every graded
    (n, rank); None when each is this rank's rows of q, of k and of v. The contiguous block is
    named only when every wrong case holds exactly that block."""
    wrong = [c for c in SHARD_CASES
             if not (got[c].shape == qkv_rows(FUSED_WEIGHT, c[1], c[0]).shape
                     and torch.equal(got[c], qkv_rows(FUSED_WEIGHT, c[1], c[0])))]  # fmt: skip
    if not wrong:
        return None
    n, rank = wrong[0]
    shard, want = got[wrong[0]], qkv_rows(FUSED_WEIGHT, rank, n)
    held = [int(v) for v in shard.flatten().tolist()] if shard.numel() <= 24 else "..."
    contiguous = all(
        got[c].shape == rows(FUSED_WEIGHT, c[1], c[0]).shape
        and torch.equal(got[c], rows(FUSED_WEIGHT, c[1], c[0]))
        for c in wrong
    )
    advice = ""
    if shard.dim() != 2 or shard.shape[1] != FUSED_WEIGHT.shape[1]:
        advice = (
            f": its shape is {list(shard.shape)} where the weight's is [24, 1]; it cut the "
            "second dimension, the input features, but a column-parallel layer splits its "
            "output features"
        )
    elif contiguous:
        advice = (
            ": that is a contiguous block of rows, which gives rank 0 only queries; with "
            "fused_parts=3 each rank takes its own slice of each of the 3 stacked parts"
        )
    return (
        f"2.6 column_shard(weight of 24 rows, rank={rank}, world_size={n}, fused_parts=3) "
        f"should hold rows {[int(v) for v in want.flatten().tolist()]} (this rank's "
        f"rows of q, then of k, then of v); it holds rows {held}{advice}"
    )


def row_shard_verdict(got: dict[tuple[int, int], torch.Tensor]) -> str | None:
    """What is wrong with row_shard(ROW_WEIGHT, rank, n) on every graded (n, rank); None when
    each holds the columns that read this rank's input features. The cut along the output
    features is named only when every wrong case holds exactly those rows."""
    wrong = [c for c in SHARD_CASES
             if not (got[c].shape == cols(ROW_WEIGHT, c[1], c[0]).shape
                     and torch.equal(got[c], cols(ROW_WEIGHT, c[1], c[0])))]  # fmt: skip
    if not wrong:
        return None
    n, rank = wrong[0]
    want = cols(ROW_WEIGHT, rank, n)
    cut_rows = all(
        got[c].shape == rows(ROW_WEIGHT, c[1], c[0]).shape
        and torch.equal(got[c], rows(ROW_WEIGHT, c[1], c[0]))
        for c in wrong
    )
    advice = (
        ": it cut the first dimension, the output features, but a row-parallel layer splits its "
        "input features"
        if cut_rows
        else ""
    )
    return (
        f"2.6 row_shard(weight [4, 8], rank={rank}, world_size={n}) should hold the entries of "
        f"shape {list(want.shape)} that read this rank's input features; it holds shape "
        f"{list(got[wrong[0]].shape)}{advice}"
    )


@exercise("2.6")
def test_column_shard_takes_this_ranks_rows_of_each_fused_part() -> None:
    """In process, no world: the rows of a fused [q; k; v] weight each rank holds."""
    column_shard = tp_layers_module().column_shard
    got = {(n, r): column_shard(FUSED_WEIGHT.clone(), r, n, fused_parts=3) for n, r in SHARD_CASES}
    verdict = column_shard_verdict(got)
    if verdict:
        fail(verdict + defined_at(column_shard))


@exercise("2.6")
def test_row_shard_takes_this_ranks_input_features() -> None:
    """In process, no world: the part of a [4, 8] weight each rank of a row-parallel layer holds."""
    row_shard = tp_layers_module().row_shard
    verdict = row_shard_verdict(
        {(n, r): row_shard(ROW_WEIGHT.clone(), r, n) for n, r in SHARD_CASES}
    )
    if verdict:
        fail(verdict + defined_at(row_shard))


COLUMN_ALL_REDUCES = (0, 1)  # a column-parallel layer alone: f's all-reduce backward only


def column_worker() -> dict[bool, dict[str, Any]]:
    layers = tp_layers_module()
    rank, n = dist.get_rank(), dist.get_world_size()
    dense = make_linear(IN, OUT)
    results: dict[bool, dict[str, Any]] = {}
    problem = shard_shape_problem(layers, "column", dense.weight.detach(), rank, n)
    if problem:
        return {False: {"error": problem}}
    for gather_output in (False, True):
        layer = raised_at_learner(
            functools.partial(
                layers.ColumnParallelLinear.from_dense, dense, gather_output=gather_output
            ),
            "ColumnParallelLinear.from_dense",
        )
        x = seeded(1, BATCH, SEQ, IN).requires_grad_()
        with CommCounter() as forward:
            out = layer(x)
        want_shape = (BATCH, SEQ, OUT if gather_output else OUT // n)
        if tuple(out.shape) != want_shape:
            results[gather_output] = {"shape": tuple(out.shape), "want_shape": want_shape}
            continue
        weights = loss_weights((BATCH, SEQ, OUT))
        with CommCounter() as backward:
            (out * (weights if gather_output else cols(weights, rank, n))).sum().backward()
        results[gather_output] = {
            "all_reduces": (forward.count("all_reduce"), backward.count("all_reduce")),
            "out": out.detach(),
            "x_grad": x.grad,
            "weight": layer.weight.detach(),
            "weight_grad": layer.weight.grad,
            "bias_grad": layer.bias.grad,
        }
    return results


@exercise("2.6")
@pytest.mark.parametrize("world_size", [2])
def test_column_parallel_linear_equals_the_dense_layer(world_size: int) -> None:
    dense = make_linear(IN, OUT)
    out, x_grad = dense_run(dense, seeded(1, BATCH, SEQ, IN))
    assert dense.bias.grad is not None and dense.weight.grad is not None
    for rank, results in enumerate(small_world(column_worker, world_size)):
        for gather_output, got in results.items():
            where = f"2.6 ColumnParallelLinear(gather_output={gather_output}), rank {rank} of "
            where += f"{world_size}"
            if "error" in got:
                fail(f"{where}: {got['error']}")
            if "shape" in got:
                whole = "the whole output" if gather_output else "this rank's slice of the output"
                fail(
                    f"{where}: the output should be {whole}, of shape {list(got['want_shape'])}; "
                    f"it has shape {list(got['shape'])}"
                )
            want_out = out if gather_output else cols(out, rank, world_size)
            if got["all_reduces"] != COLUMN_ALL_REDUCES:
                verdict = placement_verdict(
                    got["all_reduces"], close(got["out"], want_out), COLUMN_LAYER
                )
                site = defined_at(tp_layers_module().ColumnParallelLinear.forward)
                fail(f"{where}: {verdict}; its output: {describe(got['out'], want_out)}{site}")
            checks = [
                ("its weight shard (rows of the dense weight)", got["weight"],
                 rows(dense.weight.detach(), rank, world_size)),
                ("its output", got["out"], out if gather_output else cols(out, rank, world_size)),
                ("the input's gradient (f sums it over ranks)", got["x_grad"], x_grad),
                ("its weight shard's gradient", got["weight_grad"],
                 rows(dense.weight.grad, rank, world_size)),
                ("its bias shard's gradient", got["bias_grad"],
                 rows(dense.bias.grad, rank, world_size)),
            ]  # fmt: skip
            for what, value, want in checks:
                expect_close(
                    value,
                    want,
                    f"{where}: {what} should equal the dense layer's matching slice",
                )


ROW_ALL_REDUCES = (1, 0)  # a row-parallel layer alone: g's all-reduce forward, none backward


def row_worker() -> dict[bool, dict[str, Any]]:
    layers = tp_layers_module()
    rank, n = dist.get_rank(), dist.get_world_size()
    dense = make_linear(OUT, IN)
    results: dict[bool, dict[str, Any]] = {}
    problem = shard_shape_problem(layers, "row", dense.weight.detach(), rank, n)
    if problem:
        return {False: {"error": problem}}
    for input_is_parallel in (False, True):
        layer = raised_at_learner(
            functools.partial(
                layers.RowParallelLinear.from_dense, dense, input_is_parallel=input_is_parallel
            ),
            "RowParallelLinear.from_dense",
        )
        full = seeded(2, BATCH, SEQ, OUT)
        x = (cols(full, rank, n).clone() if input_is_parallel else full).requires_grad_()
        with CommCounter() as forward:
            out = layer(x)
        with CommCounter() as backward:
            (out * loss_weights((BATCH, SEQ, IN))).sum().backward()
        results[input_is_parallel] = {
            "all_reduces": (forward.count("all_reduce"), backward.count("all_reduce")),
            "out": out.detach(),
            "x_grad": x.grad,
            "weight": layer.weight.detach(),
            "weight_grad": layer.weight.grad,
            "bias_grad": layer.bias.grad,
        }
    return results


@exercise("2.6")
@pytest.mark.parametrize("world_size", [2])
def test_row_parallel_linear_equals_the_dense_layer(world_size: int) -> None:
    dense = make_linear(OUT, IN)
    out, x_grad = dense_run(dense, seeded(2, BATCH, SEQ, OUT))
    assert dense.bias.grad is not None and dense.weight.grad is not None
    for rank, results in enumerate(small_world(row_worker, world_size)):
        for input_is_parallel, got in results.items():
            where = f"2.6 RowParallelLinear(input_is_parallel={input_is_parallel}), rank {rank} "
            where += f"of {world_size}"
            if "error" in got:
                fail(f"{where}: {got['error']}")
            if got["all_reduces"] != ROW_ALL_REDUCES:
                verdict = placement_verdict(got["all_reduces"], close(got["out"], out), ROW_LAYER)
                site = defined_at(tp_layers_module().RowParallelLinear.forward)
                fail(f"{where}: {verdict}; its output: {describe(got['out'], out)}{site}")
            want_x_grad = cols(x_grad, rank, world_size) if input_is_parallel else x_grad
            got_x_grad = got["x_grad"]
            if not input_is_parallel and got_x_grad is not None and not close(got_x_grad, x_grad):
                outside = got_x_grad.clone()
                cols(outside, rank, world_size).zero_()
                if close(cols(got_x_grad, rank, world_size), cols(x_grad, rank, world_size)) and (
                    not outside.any()
                ):
                    fail(
                        f"{where}: the whole input's gradient is zero outside this rank's slice "
                        "of its features: x was cut with no operator whose backward brings the "
                        "other ranks' parts of dL/dx back; it should equal the dense layer's "
                        f"dL/dx ({describe(got_x_grad, x_grad)})"
                    )
            site = defined_at(tp_layers_module().RowParallelLinear.forward)
            if close(got["out"], out + (world_size - 1) * dense.bias.detach()):
                fail(
                    f"{where}: the output holds the bias {world_size} times: each rank added it "
                    f"to its partial sum before the all-reduce. Add it once, after the reduction"
                    f"{site}"
                )
            if close(got["out"], out) and close(got["bias_grad"], dense.bias.grad / world_size):
                fail(f"{where}: the {bias_share_words(world_size)}{site}")
            checks = [
                ("its weight shard (columns of the dense weight)", got["weight"],
                 cols(dense.weight.detach(), rank, world_size)),
                ("its output (the whole output, on every rank)", got["out"], out),
                ("the input's gradient", got["x_grad"], want_x_grad),
                ("its weight shard's gradient", got["weight_grad"],
                 cols(dense.weight.grad, rank, world_size)),
                ("its (replicated) bias's gradient", got["bias_grad"], dense.bias.grad),
            ]  # fmt: skip
            for what, value, want in checks:
                expect_close(
                    value,
                    want,
                    f"{where}: {what} should equal the dense layer's",
                )


def bias_worker() -> dict[str, torch.Tensor | None]:
    layers = tp_layers_module()
    rank, n = dist.get_rank(), dist.get_world_size()
    layer = layers.RowParallelLinear.from_dense(make_linear(OUT, IN), input_is_parallel=True)
    x = cols(seeded(2, BATCH, SEQ, OUT), rank, n).clone()
    out = layer(x)
    (out * loss_weights((BATCH, SEQ, IN))).sum().backward()
    return {"out": out.detach(), "bias_grad": layer.bias.grad}


# ---------------------------------------------------------------------------- MLP and attention

HIDDEN, FFN, HEADS, EMBED = 8, 16, 4, 16


def make_dense_mlp() -> nn.Module:
    torch.manual_seed(21)
    return tp_module().DenseMLP(HIDDEN, FFN).to(F64)


def make_attention() -> nn.MultiheadAttention:
    torch.manual_seed(22)
    return nn.MultiheadAttention(EMBED, HEADS, batch_first=True).to(F64)


def run_counted(module: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    """Forward and backward of a parallel block, each inside its own CommCounter."""
    x = x.clone().requires_grad_()
    with CommCounter() as forward:
        out = module(x)
    with CommCounter() as backward:
        (out * loss_weights(tuple(out.shape))).sum().backward()
    return {
        "out": out.detach(),
        "x_grad": x.grad,
        "grads": {n: p.grad for n, p in module.named_parameters()},
        "forward": [(r.op, r.nbytes) for r in forward.records],
        "backward": [(r.op, r.nbytes) for r in backward.records],
    }


def shards_problem(pieces: list[tuple[str, Any, int]]) -> str | None:
    """The first of (kind, dense weight, fused parts) whose learner's shard has the wrong shape:
    said at column_shard or row_shard, before the given from_weights breaks on it."""
    layers = tp_layers_module()
    rank, n = dist.get_rank(), dist.get_world_size()
    for kind, weight, parts in pieces:
        problem = shard_shape_problem(layers, kind, weight.detach(), rank, n, parts)
        if problem:
            return problem
    return None


def mlp_worker() -> dict[str, Any]:
    tp = tp_module()
    dense: Any = make_dense_mlp()
    problem = shards_problem([("column", dense.fc1.weight, 1), ("row", dense.fc2.weight, 1)])
    if problem:
        return {"error": problem}
    mlp = raised_at_learner(lambda: tp.ParallelMLP.from_dense(make_dense_mlp()), "ParallelMLP")
    return run_counted(mlp, seeded(3, BATCH, SEQ, HIDDEN))


BLOCK_ALL_REDUCES = (1, 1)  # a Megatron block: g's all-reduce forward, f's backward


def check_block(
    label: str,
    world_size: int,
    results: list[dict[str, Any]],
    out: torch.Tensor,
    x_grad: torch.Tensor,
    expected_grads: Callable[[int], dict[str, torch.Tensor]],
) -> None:
    """Outputs, gradients and communication of a parallel block on every rank."""
    activation_bytes = out.numel() * out.element_size()
    for rank, got in enumerate(results):
        where = f"2.6 {label}, rank {rank} of {world_size}"
        if "error" in got:
            fail(f"{where}: {got['error']}")
        counts = tuple(sum(op == "all_reduce" for op, _ in got[p]) for p in ("forward", "backward"))
        if counts != BLOCK_ALL_REDUCES:
            verdict = placement_verdict((counts[0], counts[1]), close(got["out"], out))
            fail(f"{where}: {verdict}; its output: {describe(got['out'], out)}")
        expect_close(
            got["out"],
            out,
            f"{where}: output should equal the dense block's",
        )
        expect_close(
            got["x_grad"],
            x_grad,
            f"{where}: the input's gradient should equal the dense block's",
        )
        for name, want in expected_grads(rank).items():
            value = got["grads"].get(name)
            expect_close(
                value,
                want,
                f"{where}: {name}'s gradient should equal this rank's slice of the dense gradient",
            )
        for phase in ("forward", "backward"):
            calls = got[phase]
            if [op for op, _ in calls] != ["all_reduce"]:
                fail(
                    f"{where}: {phase} should communicate exactly once, one all-reduce of the "
                    f"[batch, seq, hidden] activation (Megatron's "
                    f"{'g' if phase == 'forward' else 'f'}); it called {[op for op, _ in calls]}"
                )
            if calls[0][1] != activation_bytes:
                fail(
                    f"{where}: the {phase} all-reduce should carry the [batch, seq, hidden] "
                    f"activation, {activation_bytes} bytes; it carried {calls[0][1]}"
                )


@exercise("2.6")
@pytest.mark.parametrize("world_size", [2])
def test_parallel_mlp_equals_dense_with_one_all_reduce_each_way(world_size: int) -> None:
    dense = make_dense_mlp()
    out, x_grad = dense_run(dense, seeded(3, BATCH, SEQ, HIDDEN))
    grads = {n: p.grad for n, p in dense.named_parameters() if p.grad is not None}

    def expected(rank: int) -> dict[str, torch.Tensor]:
        return {
            "fc1.weight": rows(grads["fc1.weight"], rank, world_size),
            "fc1.bias": rows(grads["fc1.bias"], rank, world_size),
            "fc2.weight": cols(grads["fc2.weight"], rank, world_size),
            "fc2.bias": grads["fc2.bias"],
        }

    check_block(
        "ParallelMLP", world_size, small_world(mlp_worker, world_size), out, x_grad, expected
    )


def attention_worker() -> dict[bool, dict[str, Any]]:
    tp = tp_module()
    results: dict[bool, dict[str, Any]] = {}
    dense = make_attention()
    problem = shards_problem(
        [("column", dense.in_proj_weight, 3), ("row", dense.out_proj.weight, 1)]
    )
    if problem:
        return {causal: {"error": problem} for causal in (False, True)}
    for causal in (False, True):
        attention = raised_at_learner(
            functools.partial(tp.ParallelSelfAttention.from_dense, make_attention(), causal=causal),
            "ParallelSelfAttention.from_dense",
        )
        shards = {n: p.detach().clone() for n, p in attention.named_parameters()}
        results[causal] = {**run_counted(attention, seeded(4, BATCH, 5, EMBED)), "shards": shards}
    return results


def qkv_shard_problem(shard: torch.Tensor | None, rank: int, n: int) -> str | None:
    """What is wrong with rank's qkv.weight of n, None when it holds its heads' rows of q, k
    and v. The contiguous block is named only when the shard is exactly that block."""
    in_proj = make_attention().in_proj_weight.detach()
    want = qkv_rows(in_proj, rank, n)
    if shard is not None and shard.shape == want.shape and torch.equal(shard, want):
        return None
    advice = ""
    contiguous = rows(in_proj, rank, n)
    if shard is not None and shard.shape == contiguous.shape and torch.equal(shard, contiguous):
        advice = (
            ": it holds a contiguous block of in_proj_weight's rows, which gives rank 0 "
            "only queries; in_proj_weight is q's, k's and v's projections stacked, and "
            "each rank needs its own heads' rows of each"
        )
    elif shard is not None and shard.shape != want.shape:
        advice = f": it has shape {list(shard.shape)}, expected {list(want.shape)}"
    elif shard is not None:
        advice = f": {describe(shard, want)}"
    return (
        "qkv.weight should hold this rank's heads' rows of in_proj_weight "
        f"(q's, then k's, then v's){advice}"
    )


def check_attention_shards(label: str, world_size: int, results: list[dict[str, Any]]) -> None:
    """This rank's heads' parameters, before any value: a wrong shard names itself."""
    dense = make_attention()
    for rank, got in enumerate(results):
        where = f"2.6 {label}, rank {rank} of {world_size}"
        if "error" in got:
            fail(f"{where}: {got['error']}")
        said = qkv_shard_problem(got["shards"].get("qkv.weight"), rank, world_size)
        if said:
            fail(f"{where}: {said}")
        shard = got["shards"].get("out_proj.weight")
        want = cols(dense.out_proj.weight.detach(), rank, world_size)
        if shard is None or shard.shape != want.shape or not torch.equal(shard, want):
            fail(
                f"{where}: out_proj.weight should hold the out-projection's columns that read "
                "this rank's heads"
            )


def check_attention_output(
    label: str, world_size: int, results: list[dict[str, Any]], out: torch.Tensor
) -> None:
    """With the shards right, a wrong output can only come from forward's layout of the heads."""
    for rank, got in enumerate(results):
        if got["out"].shape == out.shape and close(got["out"], out):
            continue
        fail(
            f"2.6 {label}, rank {rank} of {world_size}: the output should equal "
            f"nn.MultiheadAttention's: {describe(got['out'], out)}. This rank's qkv and out_proj "
            "shards are right, so the difference is in forward: how qkv's output becomes q, k "
            "and v of shape [batch, local heads, seq, head_dim], or how the heads' results go "
            "back into the layout out_proj reads (this rank's heads side by side, per position)"
        )


def dense_attention_forward(
    attention: nn.MultiheadAttention, causal: bool, x: torch.Tensor
) -> torch.Tensor:
    """PyTorch's own multi-head self-attention, the reference the parallel one must match."""
    mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], dtype=F64) if causal else None
    out, _ = attention(x, x, x, attn_mask=mask, is_causal=causal, need_weights=False)
    return out


def attention_grad_slices(
    attention: nn.MultiheadAttention, rank: int, n: int
) -> dict[str, torch.Tensor]:
    """The slices of the dense attention's gradients that rank's heads should hold."""
    grads = {name: p.grad for name, p in attention.named_parameters() if p.grad is not None}
    return {
        "qkv.weight": qkv_rows(grads["in_proj_weight"], rank, n),
        "qkv.bias": qkv_rows(grads["in_proj_bias"], rank, n),
        "out_proj.weight": cols(grads["out_proj.weight"], rank, n),
        "out_proj.bias": grads["out_proj.bias"],
    }


@exercise("2.6")
@pytest.mark.parametrize("world_size", [2])
def test_parallel_attention_splits_heads_and_equals_dense(world_size: int) -> None:
    results = small_world(attention_worker, world_size)
    for causal in (False, True):
        attention = make_attention()
        forward = functools.partial(dense_attention_forward, attention, causal)
        out, x_grad = dense_run(forward, seeded(4, BATCH, 5, EMBED))
        expected = functools.partial(attention_grad_slices, attention, n=world_size)
        label = f"ParallelSelfAttention(causal={causal}), {HEADS // world_size} of {HEADS} heads"
        per_rank = [result[causal] for result in results]
        check_attention_shards(label, world_size, per_rank)
        check_attention_output(label, world_size, per_rank, out)
        check_block(label, world_size, per_rank, out, x_grad, expected)


# ---------------------------------------------------------------------------- on 4 ranks
# The same checks on 4 ranks, after every 2-rank world: a mistake shows on 2 ranks already, so a
# learner's first failure in a later piece does not wait for the earlier pieces' 4-rank worlds.


@exercise("2.6")
def test_megatron_f_and_g_operators_on_4_ranks() -> None:
    test_megatron_f_and_g_operators(4)


@exercise("2.6")
def test_column_parallel_linear_equals_the_dense_layer_on_4_ranks() -> None:
    test_column_parallel_linear_equals_the_dense_layer(4)


@exercise("2.6")
def test_row_parallel_linear_equals_the_dense_layer_on_4_ranks() -> None:
    test_row_parallel_linear_equals_the_dense_layer(4)


@exercise("2.6")
def test_row_parallel_bias_is_added_once_and_every_copy_learns() -> None:
    verdict = bias_verdict(small_world(bias_worker, BIAS_WORLD))
    if verdict:
        fail(verdict + defined_at(tp_layers_module().RowParallelLinear.forward))


BIAS_WORLD = 4  # 4 ranks: a bias added on every rank shows 4 times, one added twice 2 times


def bias_reference() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The dense layer's output, its bias and its bias's gradient on the bias test's input."""
    dense = make_linear(OUT, IN)
    out, _ = dense_run(dense, seeded(2, BATCH, SEQ, OUT))
    assert dense.bias.grad is not None
    return out, dense.bias.detach(), dense.bias.grad


def bias_share_words(world_size: int) -> str:
    """The output is right and the bias's gradient is 1/n of the dense one: a share b/n added on
    every rank before g sums to b, and each share learns 1/n."""
    return (
        f"bias got 1/{world_size} of its gradient (bias / n added before the all-reduce?): every "
        "copy of the replicated bias needs the full gradient, which adding it after the "
        "reduction gives"
    )


def bias_verdict(per_rank: list[dict[str, torch.Tensor | None]]) -> str | None:
    """What the row-parallel layer's output and bias gradient on each rank say about where its
    bias is added; None when every rank's are the dense layer's."""
    world_size = len(per_rank)
    out, bias, bias_grad = bias_reference()
    for rank, got in enumerate(per_rank):
        got_out, got_grad = got["out"], got["bias_grad"]
        if got_out is not None and close(got_out, out + (world_size - 1) * bias):
            return (
                f"2.6: rank {rank}'s output holds the bias {world_size} times: each rank added "
                "it to its partial sum before the all-reduce. Add it once, after the reduction"
            )
        if not close(got_out, out):
            return (
                f"2.6: RowParallelLinear output on rank {rank} should equal the dense layer's: "
                f"{describe(got_out, out)}"
            )
        if got_grad is None:
            return (
                f"2.6: rank {rank}'s bias got no gradient: the bias was added on some ranks only "
                "(before the all-reduce), so the other copies never learn and drift apart. "
                "Add it after the reduction, on every rank"
            )
        if close(got_grad, bias_grad / world_size):
            return f"2.6: rank {rank}'s {bias_share_words(world_size)}"
        if not close(got_grad, bias_grad):
            return (
                f"2.6: rank {rank}'s bias gradient should equal the dense layer's: "
                f"{describe(got_grad, bias_grad)}"
            )
    return None


@exercise("2.6")
def test_parallel_mlp_equals_dense_with_one_all_reduce_each_way_on_4_ranks() -> None:
    test_parallel_mlp_equals_dense_with_one_all_reduce_each_way(4)


@exercise("2.6")
def test_parallel_attention_splits_heads_and_equals_dense_on_4_ranks() -> None:
    test_parallel_attention_splits_heads_and_equals_dense(4)


# ---------------------------------------------------------------------------- on subgroups


def subgroup_worker() -> dict[str, Any]:
    """Operators, MLP and attention on the groups (0, 1) and (2, 3), each on its own input."""
    info = split_into_groups(SUBGROUP_SIZE)
    tp = tp_module()
    offset = 10 * info.index
    with CommCounter() as comm:
        problems = operator_problems(info.group, 1000 * info.index)
        mlp = tp.ParallelMLP.from_dense(make_dense_mlp(), info.group)
        mlp_result = run_counted(mlp, seeded(3 + offset, BATCH, SEQ, HIDDEN))
        attention = tp.ParallelSelfAttention.from_dense(make_attention(), info.group, causal=True)
        attention_result = run_counted(attention, seeded(4 + offset, BATCH, 5, EMBED))
    return {
        "problems": problems,
        "mlp": mlp_result,
        "attention": attention_result,
        "index": info.index,
        "crossing": crossing_message(comm, info),
    }


def mlp_grad_slices(dense: nn.Module, rank: int, n: int) -> dict[str, torch.Tensor]:
    """The slices of the dense MLP's gradients that rank's shards should hold."""
    grads = {name: p.grad for name, p in dense.named_parameters() if p.grad is not None}
    return {
        "fc1.weight": rows(grads["fc1.weight"], rank, n),
        "fc1.bias": rows(grads["fc1.bias"], rank, n),
        "fc2.weight": cols(grads["fc2.weight"], rank, n),
        "fc2.bias": grads["fc2.bias"],
    }


@exercise("2.6")
def test_tensor_parallel_blocks_work_inside_a_group_and_stay_there() -> None:
    results = small_world(subgroup_worker, SUBGROUP_WORLD)
    label = "2.6 on two tensor-parallel groups of 2 (ranks 0-1 and 2-3)"
    fail_on_crossing(label, results)
    problems = [p for result in results for p in result["problems"]]
    if problems:
        fail(f"{label}, operators with group=:\n  " + "\n  ".join(problems[:8]))
    for index in range(SUBGROUP_WORLD // SUBGROUP_SIZE):
        members = [result for result in results if result["index"] == index]
        ranks = f"ranks {index * SUBGROUP_SIZE}-{(index + 1) * SUBGROUP_SIZE - 1}"
        dense = make_dense_mlp()
        out, x_grad = dense_run(dense, seeded(3 + 10 * index, BATCH, SEQ, HIDDEN))
        check_block(
            f"ParallelMLP(group=...) in the group of {ranks} (rank within the group)",
            SUBGROUP_SIZE,
            [member["mlp"] for member in members],
            out,
            x_grad,
            functools.partial(mlp_grad_slices, dense, n=SUBGROUP_SIZE),
        )
        attention = make_attention()
        forward = functools.partial(dense_attention_forward, attention, True)
        out, x_grad = dense_run(forward, seeded(4 + 10 * index, BATCH, 5, EMBED))
        check_block(
            f"ParallelSelfAttention(group=..., causal=True) in the group of {ranks} (rank "
            "within the group)",
            SUBGROUP_SIZE,
            [member["attention"] for member in members],
            out,
            x_grad,
            functools.partial(attention_grad_slices, attention, n=SUBGROUP_SIZE),
        )


def library_subgroup_worker() -> dict[str, Any]:
    library = demo_module("library.tensor_parallel")
    info = split_into_groups(SUBGROUP_SIZE)
    model = library.library_parallel_mlp(make_dense_mlp(), group=info.group)
    out = model(seeded(3 + 10 * info.index, BATCH, SEQ, HIDDEN))
    return {"out": torch.Tensor(out.detach()).clone(), "index": info.index}


@exercise("2.6")
@pytest.mark.reference
def test_library_tensor_parallel_mlp_on_a_subgroup() -> None:
    for rank, got in enumerate(small_world(library_subgroup_worker, SUBGROUP_WORLD)):
        out, _ = dense_run(make_dense_mlp(), seeded(3 + 10 * got["index"], BATCH, SEQ, HIDDEN))
        expect_close(
            got["out"],
            out,
            f"2.6 library_parallel_mlp(group=...), rank {rank} of two groups of 2: the output "
            "should equal the dense MLP's on its group's input",
        )


# ---------------------------------------------------------------------------- refusals


def indivisible_worker() -> list[tuple[str, str | None, int]]:
    layers, tp = tp_layers_module(), tp_module()
    torch.manual_seed(0)
    cases: list[tuple[str, Callable[[], object]]] = [
        ("ParallelMLP with MLP hidden size 10", lambda: tp.ParallelMLP.from_dense(
            tp.DenseMLP(8, 10))),
        ("ParallelSelfAttention with 6 heads", lambda: tp.ParallelSelfAttention.from_dense(
            nn.MultiheadAttention(12, 6, batch_first=True))),
        ("ColumnParallelLinear with 10 outputs", lambda: layers.ColumnParallelLinear.from_dense(
            nn.Linear(8, 10))),
        ("RowParallelLinear with 10 inputs", lambda: layers.RowParallelLinear.from_dense(
            nn.Linear(10, 8))),
    ]  # fmt: skip
    outcomes: list[tuple[str, str | None, int]] = []
    for label, build in cases:
        with CommCounter() as comm:
            try:
                build()
                message = None
            except ValueError as err:
                message = str(err)
        outcomes.append((label, message, len(comm.records)))
    return outcomes


@exercise("2.6")
def test_sizes_that_do_not_divide_are_refused_before_any_communication() -> None:
    for label, message, communicated in small_world(indivisible_worker, 4)[0]:
        size = label.split()[-2]
        if message is None:
            fail(f"2.6: {label} on 4 ranks should raise ValueError; it did not")
        for word in (size, "not divisible", "tensor-parallel size 4"):
            if word not in message:
                fail(
                    f"2.6: the error for {label} on 4 ranks should say '{size} is not divisible "
                    f"by the tensor-parallel size 4' and how to fix it; it says: {message!r}"
                )
        if communicated:
            fail(
                f"2.6: {label}: the ValueError must come before any communication; "
                f"{communicated} calls to torch.distributed came first"
            )


# ---------------------------------------------------------------------------- the library way


def library_worker() -> dict[str, Any]:
    library = demo_module("library.tensor_parallel")
    model = library.library_parallel_mlp(make_dense_mlp())
    x = seeded(3, BATCH, SEQ, HIDDEN).requires_grad_()
    out = model(x)
    (out * loss_weights(tuple(out.shape))).sum().backward()
    return {
        "out": torch.Tensor(out.detach()).clone(),
        "x_grad": x.grad,
        "shards": {n: p.detach().to_local().clone() for n, p in model.named_parameters()},
        "grads": {n: p.grad.to_local().clone() for n, p in model.named_parameters()},
    }


@exercise("2.6")
@pytest.mark.reference
def test_library_tensor_parallel_mlp_equals_dense() -> None:
    world_size = 2
    dense = make_dense_mlp()
    out, x_grad = dense_run(dense, seeded(3, BATCH, SEQ, HIDDEN))
    params = dict(dense.named_parameters())
    for rank, got in enumerate(small_world(library_worker, world_size)):
        where = f"2.6 library_parallel_mlp (parallelize_module), rank {rank} of {world_size}"
        expect_close(
            got["out"],
            out,
            f"{where}: the output should equal the dense MLP's",
        )
        expect_close(
            got["x_grad"],
            x_grad,
            f"{where}: the input's gradient should equal the dense MLP's",
        )
        slicing = {"fc1.weight": rows, "fc1.bias": rows, "fc2.weight": cols}
        for name, param in params.items():
            assert param.grad is not None
            cut = slicing.get(name)
            want_shard = cut(param.detach(), rank, world_size) if cut else param.detach()
            want_grad = cut(param.grad, rank, world_size) if cut else param.grad
            expect_close(
                got["shards"][name],
                want_shard,
                f"{where}: {name}'s local shard should be the slice ParallelMLP holds",
            )
            expect_close(
                got["grads"][name],
                want_grad,
                f"{where}: {name}'s local gradient should be that slice of the dense gradient",
            )


def tp_demo_worker(impl_name: str, world_size: int, tp_size: int) -> dict[str, Any]:
    demo = demo_module("demos.tensor_parallel")
    config = demo.DemoConfig(
        hidden=16, ffn_hidden=32, heads=4, batch_size=2, seq_len=4, tp_size=tp_size, impl=impl_name
    )
    return demo.run_demo(config)


@exercise("2.6")
@pytest.mark.parametrize(("world_size", "tp_size"), [(2, 0), (4, 2)])
def test_instructor_demo_reports_dense_equality_and_one_all_reduce_each_way(
    world_size: int, tp_size: int
) -> None:
    results = small_world(tp_demo_worker, world_size, impl(), world_size, tp_size)[0]
    label = f"2.6 tensor_parallel_demo on {world_size} ranks, --tp-size {tp_size}"
    for name in ("mlp", "attention", "library_mlp"):
        result = results[name]
        worst = max(result.output_diff, result.input_grad_diff, result.weight_grad_diff)
        if worst > ATOL:
            fail(f"{label}: the {name} differs from dense by {worst:.2e}")
    for name in ("mlp", "attention"):
        counts = (results[name].forward_all_reduces, results[name].backward_all_reduces)
        if counts != (1, 1):
            fail(
                f"{label}: the {name} made {counts[0]} all-reduces in forward and {counts[1]} "
                "in backward; expected 1 and 1"
            )


@exercise("2.6")
@pytest.mark.reference
def test_demo_refuses_every_size_that_does_not_divide_at_once() -> None:
    demo = demo_module("demos.tensor_parallel")
    config = demo.DemoConfig(hidden=60, ffn_hidden=256, heads=8)
    with pytest.raises(ValueError) as caught:
        demo.validate_config(config, 3)
    message = str(caught.value)
    for part in (
        "--hidden 60 is not divisible by --heads 8",
        "--ffn-hidden 256 is not divisible by the tensor-parallel size 3",
        "--heads 8 is not divisible by the tensor-parallel size 3",
    ):
        assert part in message, f"the refusal should say {part!r}: {message}"
    with pytest.raises(ValueError, match="--tp-size 3 does not divide the world size 4"):
        demo.validate_config(demo.DemoConfig(tp_size=3), 4)
