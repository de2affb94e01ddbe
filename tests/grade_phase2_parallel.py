"""Phase 2 grader, exercises 2.4 (naive model parallelism) and 2.6 (tensor parallelism).

Each parallel piece is compared, in float64 and in real worlds of 2-4 processes, with the
single-device model it splits: the loss and every gradient for model parallelism; outputs, input
gradients and every weight shard's gradient (against the matching slice of the dense gradient)
for tensor parallelism. Beyond values, the tests check the shape of the communication: one
activation and one gradient per stage boundary, and exactly one all-reduce in forward and one in
backward per parallel MLP or attention block. Expected values are computed here, on one process,
with slicing written independently of the code under test.

This module is not collected on its own: tests/test_phase2.py imports its tests, so
``uv run pytest tests/test_phase2.py`` grades the whole phase; ``-m ex2_4`` picks one exercise.
"""

from __future__ import annotations

import functools
import io
import os
from collections.abc import Callable
from contextlib import redirect_stderr
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from grading import exercise, load, world
from torch import nn

from solutions.common.comm_counter import COLLECTIVE_OPS, SENDING_OPS, CommCounter
from solutions.common.models import MLP, BabyCNN

PHASE = "phase2_advanced"
F64 = torch.float64
ATOL = 1e-10  # float64: the parallel code sums in a different order than the dense one
# These worlds finish in about a second; a mismatched send/recv hangs, so give up after 30 s
# unless DTFS_WORLD_TIMEOUT says otherwise (a slow machine, or a debugger).
WORLD_TIMEOUT = float(os.environ.get("DTFS_WORLD_TIMEOUT", "30"))
HEADER_ALLOWANCE = 256  # bytes a rank may spend on shape headers per step


def small_world(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """A world of 2-4 ranks that reports a hang after WORLD_TIMEOUT seconds."""
    return world(fn, world_size, *args, timeout=WORLD_TIMEOUT)


def model_parallel_module() -> ModuleType:
    return load(PHASE, "model_parallel")


def tp_ops_module() -> ModuleType:
    return load(PHASE, "tensor_parallel_ops")


def tp_layers_module() -> ModuleType:
    return load(PHASE, "tensor_parallel_layers")


def tp_module() -> ModuleType:
    return load(PHASE, "tensor_parallel")


def max_diff(got: torch.Tensor | None, want: torch.Tensor) -> float:
    if got is None:
        return float("inf")
    if got.shape != want.shape:
        return float("inf")
    return float((got - want).abs().max()) if want.numel() else 0.0


def close(got: torch.Tensor | None, want: torch.Tensor, atol: float = ATOL) -> bool:
    return max_diff(got, want) <= atol


def expect_close(
    got: torch.Tensor | None, want: torch.Tensor, message: str, atol: float = ATOL
) -> None:
    """Fail with ``message`` and how far off ``got`` is, unless it matches ``want``."""
    if not close(got, want, atol):
        pytest.fail(f"{message}: {describe(got, want)}", pytrace=False)


def describe(got: torch.Tensor | None, want: torch.Tensor) -> str:
    """What differs, in a few words: missing, wrong shape, or how far off."""
    if got is None:
        return "got None (no value / no gradient)"
    if got.shape != want.shape:
        return f"got shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    return f"max difference {max_diff(got, want):.2e}"


# ============================================================================ 2.4 model parallel


def tapered_model() -> nn.Sequential:
    """6 layers whose boundaries carry activations of different widths (8, then 5)."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 3)
    )


MP_MODELS: dict[str, Callable[[], nn.Sequential]] = {
    # 6 layers: split [3, 3] over 2 ranks, [2, 2, 1, 1] over 4 (rank 2: a lone ReLU)
    "mlp": lambda: MLP(12, hidden=10, num_classes=3, depth=2),
    # 6 layers with distinct boundary widths
    "tapered": tapered_model,
    # 4 layers over 4 ranks: rank 0 holds only Flatten (no parameters: its output needs no grad)
    "flatten-first": lambda: nn.Sequential(
        nn.Flatten(), nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 3)
    ),
    # 8 layers, 4-d activations: [2, 2, 2, 2] over 4 ranks (rank 2: ReLU + pooling)
    "cnn": lambda: BabyCNN(in_channels=1, num_classes=3, width=4),
}
MP_STEPS, MP_BATCH, MP_LR = 2, 6, 0.1


def make_mp_model(name: str) -> nn.Sequential:
    torch.manual_seed(7)
    return MP_MODELS[name]().to(F64)


def mp_batches(name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    shape = (MP_BATCH, 1, 8, 8) if name == "cnn" else (MP_BATCH, 3, 4)
    return [
        (torch.randn(shape, generator=g, dtype=F64), torch.randint(3, (MP_BATCH,), generator=g))
        for _ in range(MP_STEPS)
    ]


@exercise("2.4")
def test_split_is_as_even_as_possible() -> None:
    split_sizes = model_parallel_module().split_sizes
    for num_layers in range(1, 13):
        for world_size in range(1, num_layers + 1):
            sizes = split_sizes(num_layers, world_size)
            base, extra = divmod(num_layers, world_size)
            example = [base + (1 if r < extra else 0) for r in range(world_size)]
            ok = (
                isinstance(sizes, list)
                and len(sizes) == world_size
                and sum(sizes) == num_layers
                and min(sizes) >= 1
                and max(sizes) - min(sizes) <= 1
            )
            assert ok, (
                f"2.4: split_sizes({num_layers}, {world_size}) returned {sizes}: expected "
                f"{world_size} layer counts that add up to {num_layers}, each at least 1 and "
                f"differing by at most one, e.g. {example}"
            )


@exercise("2.4")
def test_more_ranks_than_layers_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    mp = model_parallel_module()
    with pytest.raises(ValueError) as caught:
        mp.split_sizes(3, 4)
    message = str(caught.value)
    for word in ("3", "4", "at most 3"):
        assert word in message, (
            f"2.4: the error for 3 layers over 4 ranks should name the values and the fix "
            f"(mention {word!r}); it says: {message!r}"
        )
    monkeypatch.setenv("WORLD_SIZE", "7")
    monkeypatch.setenv("RANK", "0")
    stderr = io.StringIO()
    with redirect_stderr(stderr):
        code = mp.main(["--model", "mlp"])
    assert code == 2, f"2.4: main() with 7 ranks for a 6-layer MLP should return 2, got {code}"
    assert not dist.is_initialized(), "2.4: the error must come before init_process_group"
    assert "6 layers over 7 ranks" in stderr.getvalue(), (
        f"2.4: main() should print why it refuses: {stderr.getvalue()!r}"
    )


ACTIVATIONS = [
    torch.arange(5, dtype=F64),
    torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(0)),  # float32, 4-d
    torch.arange(12, dtype=F64).view(3, 4).t(),  # not contiguous
    torch.arange(7, dtype=torch.int64).view(7, 1),
]


def activation_exchange_worker() -> list[torch.Tensor]:
    mp = model_parallel_module()
    if dist.get_rank() == 0:
        for tensor in ACTIVATIONS:
            mp.send_activation(tensor, 1)
        return []
    return [mp.recv_activation(0, torch.device("cpu")) for _ in ACTIVATIONS]


@exercise("2.4")
def test_activations_arrive_with_their_shape_and_dtype() -> None:
    received = small_world(activation_exchange_worker, 2)[1]
    for sent, got in zip(ACTIVATIONS, received, strict=True):
        assert got.dtype == sent.dtype and got.shape == sent.shape, (
            f"2.4: rank 0 sent a {sent.dtype} tensor of shape {tuple(sent.shape)}; rank 1 "
            f"received {got.dtype} {tuple(got.shape)}. The receiver must learn shape and dtype "
            "from a header sent first"
        )
        assert torch.equal(got, sent), (
            f"2.4: a tensor of shape {tuple(sent.shape)} arrived with different values "
            "(send from contiguous memory: .contiguous())"
        )


def model_parallel_worker(name: str) -> dict[str, Any]:
    mp = model_parallel_module()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    last = world_size - 1
    stage = mp.ModelParallelStage(make_mp_model(name))
    parameters = list(stage.parameters())
    optimizer = torch.optim.SGD(parameters, lr=MP_LR) if parameters else None
    losses, grads = [], []
    for step, (inputs, targets) in enumerate(mp_batches(name)):
        stage.zero_grad(set_to_none=True)
        output = stage(inputs if rank == 0 else None)
        if rank > 0 and (stage.stage_input is None or not stage.stage_input.requires_grad):
            raise AssertionError(
                f"2.4: step {step}: rank {rank}'s received activation (stage_input) does not "
                "require grad, so autograd computes no gradient to send back: call "
                ".requires_grad_() on the tensor recv_activation returns"
            )
        if (output is not None) != (rank == last):
            raise AssertionError(
                f"2.4: forward on rank {rank} of {world_size} returned "
                f"{'a tensor' if output is not None else 'None'}: only the last rank returns the "
                "model's output, the others send theirs on and return None"
            )
        loss = F.cross_entropy(output, targets) if output is not None else None
        stage.backward(loss)
        grads.append(
            {n: p.grad.clone() for n, p in stage.named_parameters_in_model() if p.grad is not None}
        )
        if loss is not None:
            losses.append(loss.item())
        if optimizer is not None:
            optimizer.step()
    owned = [n for n, _ in stage.named_parameters_in_model()]
    return {"losses": losses, "grads": grads, "owned": owned}


def single_device_reference(name: str) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    model = make_mp_model(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=MP_LR)
    losses, grads = [], []
    for inputs, targets in mp_batches(name):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
    return losses, grads


@exercise("2.4")
@pytest.mark.parametrize(
    ("name", "world_size"), [("mlp", 2), ("mlp", 4), ("flatten-first", 4), ("cnn", 4)]
)
def test_loss_and_gradients_equal_the_single_device_model(name: str, world_size: int) -> None:
    ref_losses, ref_grads = single_device_reference(name)
    results = small_world(model_parallel_worker, world_size, name)
    owned = [n for result in results for n in result["owned"]]
    everything = sorted(ref_grads[0])
    assert sorted(owned) == everything, (
        f"2.4: {name} on {world_size} ranks: the stages together should hold every parameter "
        f"exactly once, {everything}; they hold {sorted(owned)}"
    )
    losses = results[-1]["losses"]
    for step, ref in enumerate(ref_losses):
        assert step < len(losses) and losses[step] == pytest.approx(ref, rel=1e-12), (
            f"2.4: {name} on {world_size} ranks, step {step}: the last rank's loss should equal "
            f"the single-device model's, {ref:.12f}; got "
            f"{losses[step] if step < len(losses) else 'none'}"
        )
    for rank, result in enumerate(results):
        for step, step_grads in enumerate(ref_grads):
            for param in result["owned"]:
                got, want = result["grads"][step].get(param), step_grads[param]
                expect_close(
                    got,
                    want,
                    f"2.4: {name} on {world_size} ranks, step {step}: rank {rank}'s gradient of "
                    f"{param} should equal the single-device model's (is the gradient sent back "
                    "to the previous rank, and received in order?)",
                    atol=1e-12,
                )


def traffic_worker() -> dict[str, Any]:
    mp = model_parallel_module()
    stage = mp.ModelParallelStage(make_mp_model("tapered"))
    inputs, targets = mp_batches("tapered")[0]
    with CommCounter() as comm:
        mp.forward_backward(stage, inputs, targets, F.cross_entropy)
    return {"sent": comm.bytes_sent, "calls": dict(comm.calls)}


@exercise("2.4")
def test_each_boundary_carries_one_activation_forward_and_one_gradient_back() -> None:
    # tapered over 3 ranks: layers [0, 1] | [2, 3] | [4, 5]; boundaries carry widths 8 and 5
    activation = [MP_BATCH * 8 * 8, MP_BATCH * 5 * 8]  # bytes of float64 [batch, width]
    expected_data = [activation[0], activation[1] + activation[0], activation[1]]
    roles = [
        "its activation forward",
        "its activation forward and its input's gradient back",
        "its input's gradient back",
    ]
    for rank, result in enumerate(small_world(traffic_worker, 3)):
        collectives = {op: n for op, n in result["calls"].items() if op in COLLECTIVE_OPS}
        assert not collectives, (
            f"2.4: naive model parallelism needs only point-to-point messages; rank {rank} "
            f"called {collectives}"
        )
        sent, want = result["sent"], expected_data[rank]
        assert want <= sent <= want + HEADER_ALLOWANCE, (
            f"2.4: in one step rank {rank} of 3 should send {roles[rank]}: {want} bytes of data "
            f"(plus at most {HEADER_ALLOWANCE} of headers); it sent {sent}"
        )
        sends = sum(n for op, n in result["calls"].items() if op in SENDING_OPS)
        assert sends >= 1, f"2.4: rank {rank} sent nothing (use dist.send / dist.isend)"


def demo_worker() -> list[Any]:
    mp = model_parallel_module()
    return mp.run_demo(mp.DemoConfig(steps=2, batch_size=8, dtype="float64"))


@exercise("2.4")
def test_instructor_demo_matches_the_single_device_model() -> None:
    reports = small_world(demo_worker, 2)[0]
    assert len(reports) == 2, f"2.4: run_demo(steps=2) returned {len(reports)} step reports"
    for step, report in enumerate(reports):
        assert report.loss == pytest.approx(report.reference_loss, rel=1e-12), (
            f"2.4: demo step {step}: loss {report.loss} vs single device {report.reference_loss}"
        )
        assert report.max_grad_diff <= 1e-12, (
            f"2.4: demo step {step}: gradients differ by {report.max_grad_diff:.2e}"
        )


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


def operators_worker() -> list[str]:
    ops = tp_ops_module()
    rank, n = dist.get_rank(), dist.get_world_size()
    problems: list[str] = []

    def per_rank(seed: int, r: int) -> torch.Tensor:
        return seeded(100 * seed + r, 3, 4)

    # f: identity forward, all-reduce backward
    x = per_rank(1, rank).requires_grad_()
    with CommCounter() as forward:
        y = ops.copy_to_tensor_parallel_region(x)
    upstream = per_rank(2, rank)
    with CommCounter() as backward:
        y.backward(upstream)
    if not torch.equal(y.detach(), x.detach()):
        problems.append("f (copy_to_tensor_parallel_region) forward must return its input")
    if forward.records:
        problems.append(f"f forward must not communicate; it called {dict(forward.calls)}")
    want = torch.stack([per_rank(2, r) for r in range(n)]).sum(dim=0)
    if not close(x.grad, want):
        problems.append(
            f"f backward must return the sum of every rank's gradient: {describe(x.grad, want)}"
        )
    if backward.count("all_reduce") != 1 or len(backward.records) != 1:
        problems.append(f"f backward must be one all-reduce; it called {dict(backward.calls)}")

    # g: all-reduce forward, identity backward
    x = per_rank(3, rank).requires_grad_()
    before = x.detach().clone()
    with CommCounter() as forward:
        y = ops.reduce_from_tensor_parallel_region(x)
    upstream = per_rank(4, rank)
    with CommCounter() as backward:
        y.backward(upstream)
    want = torch.stack([per_rank(3, r) for r in range(n)]).sum(dim=0)
    if not close(y.detach(), want):
        problems.append(
            f"g (reduce_from_tensor_parallel_region) forward must return the sum over ranks: "
            f"{describe(y.detach(), want)}"
        )
    if not torch.equal(x.detach(), before):
        problems.append("g forward must not modify its input (all-reduce a copy)")
    if forward.count("all_reduce") != 1 or len(forward.records) != 1:
        problems.append(f"g forward must be one all-reduce; it called {dict(forward.calls)}")
    if not close(x.grad, upstream):
        problems.append(f"g backward must be the identity: {describe(x.grad, upstream)}")
    if backward.records:
        problems.append(f"g backward must not communicate; it called {dict(backward.calls)}")

    # gather: all-gather forward, own slice backward
    x = per_rank(5, rank).requires_grad_()
    y = ops.gather_from_tensor_parallel_region(x)
    want = torch.cat([per_rank(5, r) for r in range(n)], dim=-1)
    if not close(y.detach(), want):
        problems.append(
            "gather_from_tensor_parallel_region forward must concatenate every rank's tensor "
            f"along the last dim, in rank order: {describe(y.detach(), want)}"
        )
    upstream = seeded(6, 3, 4 * n)  # the same on every rank, as for a replicated output
    y.backward(upstream)
    want = cols(upstream, rank, n)
    if not close(x.grad, want):
        problems.append(
            f"gather backward must keep this rank's slice of the gradient: {describe(x.grad, want)}"
        )

    # scatter: own slice forward, all-gather backward
    full = seeded(7, 3, 4 * n).requires_grad_()
    y = ops.scatter_to_tensor_parallel_region(full)
    y.backward(per_rank(8, rank))
    want = torch.cat([per_rank(8, r) for r in range(n)], dim=-1)
    if not close(full.grad, want):
        problems.append(
            "scatter_to_tensor_parallel_region backward must gather every rank's gradient: "
            f"{describe(full.grad, want)}"
        )
    return [f"rank {rank}: {p}" for p in problems]


@exercise("2.6")
@pytest.mark.parametrize("world_size", [2, 4])
def test_megatron_f_and_g_operators(world_size: int) -> None:
    problems = [
        p for rank_problems in small_world(operators_worker, world_size) for p in rank_problems
    ]
    if problems:
        pytest.fail(
            f"2.6 operators on {world_size} ranks:\n  " + "\n  ".join(problems[:8]), pytrace=False
        )


# ---------------------------------------------------------------------------- linear layers

IN, OUT, BATCH, SEQ = 8, 12, 2, 3


def column_worker() -> dict[bool, dict[str, torch.Tensor | None]]:
    layers = tp_layers_module()
    rank, n = dist.get_rank(), dist.get_world_size()
    dense = make_linear(IN, OUT)
    results = {}
    for gather_output in (False, True):
        layer = layers.ColumnParallelLinear.from_dense(dense, gather_output=gather_output)
        x = seeded(1, BATCH, SEQ, IN).requires_grad_()
        out = layer(x)
        weights = loss_weights((BATCH, SEQ, OUT))
        (out * (weights if gather_output else cols(weights, rank, n))).sum().backward()
        results[gather_output] = {
            "out": out.detach(),
            "x_grad": x.grad,
            "weight": layer.weight.detach(),
            "weight_grad": layer.weight.grad,
            "bias_grad": layer.bias.grad,
        }
    return results


@exercise("2.6")
@pytest.mark.parametrize("world_size", [2, 4])
def test_column_parallel_linear_equals_the_dense_layer(world_size: int) -> None:
    dense = make_linear(IN, OUT)
    out, x_grad = dense_run(dense, seeded(1, BATCH, SEQ, IN))
    assert dense.bias.grad is not None and dense.weight.grad is not None
    for rank, results in enumerate(small_world(column_worker, world_size)):
        for gather_output, got in results.items():
            where = f"2.6 ColumnParallelLinear(gather_output={gather_output}), rank {rank} of "
            where += f"{world_size}"
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


def row_worker() -> dict[bool, dict[str, torch.Tensor | None]]:
    layers = tp_layers_module()
    rank, n = dist.get_rank(), dist.get_world_size()
    dense = make_linear(OUT, IN)
    results = {}
    for input_is_parallel in (False, True):
        layer = layers.RowParallelLinear.from_dense(dense, input_is_parallel=input_is_parallel)
        full = seeded(2, BATCH, SEQ, OUT)
        x = (cols(full, rank, n).clone() if input_is_parallel else full).requires_grad_()
        out = layer(x)
        (out * loss_weights((BATCH, SEQ, IN))).sum().backward()
        results[input_is_parallel] = {
            "out": out.detach(),
            "x_grad": x.grad,
            "weight": layer.weight.detach(),
            "weight_grad": layer.weight.grad,
            "bias_grad": layer.bias.grad,
        }
    return results


@exercise("2.6")
@pytest.mark.parametrize("world_size", [2, 4])
def test_row_parallel_linear_equals_the_dense_layer(world_size: int) -> None:
    dense = make_linear(OUT, IN)
    out, x_grad = dense_run(dense, seeded(2, BATCH, SEQ, OUT))
    assert dense.bias.grad is not None and dense.weight.grad is not None
    for rank, results in enumerate(small_world(row_worker, world_size)):
        for input_is_parallel, got in results.items():
            where = f"2.6 RowParallelLinear(input_is_parallel={input_is_parallel}), rank {rank} "
            where += f"of {world_size}"
            want_x_grad = cols(x_grad, rank, world_size) if input_is_parallel else x_grad
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


@exercise("2.6")
def test_row_parallel_bias_is_added_once_and_every_copy_learns() -> None:
    world_size = 4
    dense = make_linear(OUT, IN)
    out, _ = dense_run(dense, seeded(2, BATCH, SEQ, OUT))
    bias = dense.bias.detach()
    bias_grad = dense.bias.grad
    assert bias_grad is not None
    for rank, got in enumerate(small_world(bias_worker, world_size)):
        if close(got["out"], out + (world_size - 1) * bias):
            pytest.fail(
                f"2.6: rank {rank}'s output holds the bias {world_size} times: each rank added "
                "it to its partial sum before the all-reduce. Add it once, after the reduction",
                pytrace=False,
            )
        expect_close(
            got["out"],
            out,
            f"2.6: RowParallelLinear output on rank {rank} should equal the dense layer's",
        )
        if got["bias_grad"] is None:
            pytest.fail(
                f"2.6: rank {rank}'s bias got no gradient: the bias was added on some ranks only "
                "(before the all-reduce), so the other copies never learn and drift apart. "
                "Add it after the reduction, on every rank",
                pytrace=False,
            )
        if close(got["bias_grad"], bias_grad / world_size):
            pytest.fail(
                f"2.6: rank {rank}'s bias got 1/{world_size} of its gradient (bias / n added "
                "before the all-reduce?): every copy of the replicated bias needs the full "
                "gradient, which adding it after the reduction gives",
                pytrace=False,
            )
        expect_close(
            got["bias_grad"],
            bias_grad,
            f"2.6: rank {rank}'s bias gradient should equal the dense layer's",
        )


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


def mlp_worker() -> dict[str, Any]:
    tp = tp_module()
    return run_counted(tp.ParallelMLP.from_dense(make_dense_mlp()), seeded(3, BATCH, SEQ, HIDDEN))


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
            assert [op for op, _ in calls] == ["all_reduce"], (
                f"{where}: {phase} should communicate exactly once, one all-reduce of the "
                f"[batch, seq, hidden] activation (Megatron's {'g' if phase == 'forward' else 'f'})"
                f"; it called {[op for op, _ in calls]}"
            )
            assert calls[0][1] == activation_bytes, (
                f"{where}: the {phase} all-reduce should carry the [batch, seq, hidden] "
                f"activation, {activation_bytes} bytes; it carried {calls[0][1]}"
            )


@exercise("2.6")
@pytest.mark.parametrize("world_size", [2, 4])
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
    results = {}
    for causal in (False, True):
        attention = tp.ParallelSelfAttention.from_dense(make_attention(), causal=causal)
        results[causal] = run_counted(attention, seeded(4, BATCH, 5, EMBED))
    return results


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
@pytest.mark.parametrize("world_size", [2, 4])
def test_parallel_attention_splits_heads_and_equals_dense(world_size: int) -> None:
    results = small_world(attention_worker, world_size)
    for causal in (False, True):
        attention = make_attention()
        forward = functools.partial(dense_attention_forward, attention, causal)
        out, x_grad = dense_run(forward, seeded(4, BATCH, 5, EMBED))
        expected = functools.partial(attention_grad_slices, attention, n=world_size)
        label = f"ParallelSelfAttention(causal={causal}), {HEADS // world_size} of {HEADS} heads"
        per_rank = [result[causal] for result in results]
        check_block(label, world_size, per_rank, out, x_grad, expected)


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
        assert message is not None, f"2.6: {label} on 4 ranks should raise ValueError; it did not"
        for word in (size, "not divisible", "tensor-parallel size 4"):
            assert word in message, (
                f"2.6: the error for {label} on 4 ranks should say '{size} is not divisible by "
                f"the tensor-parallel size 4' and how to fix it; it says: {message!r}"
            )
        assert communicated == 0, (
            f"2.6: {label}: the ValueError must come before any communication; "
            f"{communicated} calls to torch.distributed came first"
        )


# ---------------------------------------------------------------------------- the library way


def library_worker() -> dict[str, Any]:
    tp = tp_module()
    model = tp.library_parallel_mlp(make_dense_mlp())
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


def tp_demo_worker() -> dict[str, Any]:
    tp = tp_module()
    config = tp.DemoConfig(hidden=16, ffn_hidden=32, heads=4, batch_size=2, seq_len=4)
    return tp.run_demo(config)


@exercise("2.6")
def test_instructor_demo_reports_dense_equality_and_one_all_reduce_each_way() -> None:
    results = small_world(tp_demo_worker, 2)[0]
    for name in ("mlp", "attention", "library_mlp"):
        result = results[name]
        worst = max(result.output_diff, result.input_grad_diff, result.weight_grad_diff)
        assert worst <= ATOL, f"2.6: the demo's {name} differs from dense by {worst:.2e}"
    for name in ("mlp", "attention"):
        counts = (results[name].forward_all_reduces, results[name].backward_all_reduces)
        assert counts == (1, 1), (
            f"2.6: the demo's {name} made {counts[0]} all-reduces in forward and {counts[1]} in "
            "backward; expected 1 and 1"
        )


# tests/test_phase2.py imports these; only the tests, so its own helpers keep their names
__all__ = [name for name in dir() if name.startswith("test_")]
