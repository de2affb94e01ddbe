"""Exercise 2.4, naive model parallelism: the stages together are the single-device model.

The split must be the one ``split_sizes`` promises (earlier ranks take the extra layers), a header
must announce each activation's dtype and shape, and in float64 worlds of 2-4 processes the last
rank's loss and every rank's gradients must equal the single-device model's, with each step's
activations freed after its backward and exactly one activation forward and one gradient back
per boundary. The same model also runs in the groups (0, 1) and (2, 3) of a world of 4 at once,
on different data, each equal to its own single-device model, without a message leaving its
group. Expected values are computed here, on one process.
"""

from __future__ import annotations

import io
import weakref
from collections.abc import Callable
from contextlib import redirect_stderr
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from grading import exercise, impl, load
from p2p_grading import fail, only_inside, remarks, run, run_in_subgroups
from subgroups import SubgroupInfo
from torch import nn

from course.comm_counter import COLLECTIVE_OPS, SENDING_OPS, CommCounter
from course.models import MLP, BabyCNN

PHASE = "phase2_advanced"
F64 = torch.float64
HEADER_ALLOWANCE = 256  # bytes a rank may spend on shape headers per step
HANG_HINT = (
    "Each boundary carries a header and the data forward, then one gradient back, in that "
    "order: does every send have a matching recv on the neighbour (same peer, same order), and "
    "does the first rank receive the gradient even when it skips its backward?"
)


def mp() -> ModuleType:
    return load(PHASE, "model_parallel")


def max_diff(got: torch.Tensor | None, want: torch.Tensor) -> float:
    if got is None or got.shape != want.shape:
        return float("inf")
    return float((got - want).abs().max()) if want.numel() else 0.0


def describe(got: torch.Tensor | None, want: torch.Tensor) -> str:
    if got is None:
        return "got None (no gradient)"
    if got.shape != want.shape:
        return f"got shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if not got.any():
        return (
            f"it is all zeros (expected max |value| {float(want.abs().max()):.3g}): was the "
            "gradient sent back and received into the right buffer?"
        )
    return f"max difference {max_diff(got, want):.2e}"


# ============================================================================ the split


def expected_split(num_layers: int, world_size: int) -> list[int]:
    base, extra = divmod(num_layers, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


@exercise("2.4")
def test_split_is_as_even_as_possible_with_the_extra_layers_first() -> None:
    split_sizes = mp().split_sizes
    got = {(n, w): split_sizes(n, w) for n, w in SPLIT_CASES}
    verdict = split_verdict(got)
    if verdict:
        fail(verdict)


SPLIT_CASES = [(n, w) for n in range(1, 13) for w in range(1, n + 1)]


def split_verdict(got: dict[tuple[int, int], Any]) -> str | None:
    """The first (layers, ranks) whose split_sizes is not torch-style even with the extras first;
    "right counts in the wrong places" is said only when, on every case, the counts are the
    right ones in some order."""
    wrong = [case for case in SPLIT_CASES if got[case] != expected_split(*case)]
    if not wrong:
        return None
    placed_wrong = all(
        isinstance(got[c], list) and sorted(got[c]) == sorted(expected_split(*c)) for c in wrong
    )
    # the case to show: the first wrong one, or when the counts themselves are wrong somewhere,
    # the first case that shows it
    shown = wrong[0] if placed_wrong else next(
        (c for c in wrong if not isinstance(got[c], list)
         or sorted(got[c]) != sorted(expected_split(*c))),
        wrong[0],
    )  # fmt: skip
    num_layers, world_size = shown
    sizes, want = got[shown], expected_split(num_layers, world_size)
    if placed_wrong:
        why = (
            "the counts are right but in the wrong places: the first "
            f"num_layers % world_size = {num_layers % world_size} ranks take the extra "
            "layer, so every rank agrees on where each layer lives"
        )
    elif not isinstance(sizes, list) or not all(isinstance(x, int) for x in sizes):
        why = f"a list of {world_size} ints is expected; it returned a {type(sizes).__name__}"
    elif sum(sizes) != num_layers or len(sizes) != world_size:
        why = f"{len(sizes)} counts adding up to {sum(sizes)}, for {world_size} ranks and {num_layers} layers"
    elif min(sizes) < 1:
        why = "a rank holds no layer"
    else:
        why = (
            f"the counts differ by {max(sizes) - min(sizes)}; as even as possible, they differ "
            "by at most one"
        )
    return (
        f"2.4: split_sizes({num_layers}, {world_size}) returned {sizes}, expected {want}: {why}"
        f" ({len(wrong)} of {len(SPLIT_CASES)} (layers, ranks) cases wrong)"
    )


@exercise("2.4")
def test_more_ranks_than_layers_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from solutions.phase2_advanced.demos import model_parallel as model_parallel_demo

    with pytest.raises(ValueError) as caught:
        mp().split_sizes(3, 4)
    message = str(caught.value)
    for word in ("3", "4", "at most 3"):
        if word not in message:
            fail(
                f"2.4: the error for 3 layers over 4 ranks should name the values and the fix "
                f"(mention {word!r}); it says: {message!r}"
            )
    monkeypatch.setenv("WORLD_SIZE", "7")
    monkeypatch.setenv("RANK", "0")
    stderr = io.StringIO()
    with redirect_stderr(stderr):
        code = model_parallel_demo.main(["--model", "mlp", "--impl", impl()])
    assert code == 2, f"2.4: the demo with 7 ranks for a 6-layer MLP should exit 2, got {code}"
    assert not dist.is_initialized(), "2.4: the refusal must come before init_process_group"
    assert "6 layers over 7 ranks" in stderr.getvalue(), (
        "2.4: the demo's refusal for 7 ranks should say '6 layers over 7 ranks'; it printed: "
        f"{stderr.getvalue()!r}"
    )


# ============================================================================ the messages

# The first two have the byte size of the dtypes a receiver most often hard-codes (float32,
# float64), so a receiver that ignores the header's dtype gets them without gloo aborting.
DTYPE_PROBES = [
    torch.arange(6, dtype=torch.int32).view(2, 3),
    torch.arange(4, dtype=torch.int64),
]
ACTIVATIONS = [
    torch.arange(5, dtype=F64),
    torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(0)),  # float32, 4-d
    torch.arange(12, dtype=F64).view(3, 4).t(),  # not contiguous
    torch.arange(7, dtype=torch.int64).view(7, 1),
    torch.ones(3, 2, dtype=torch.bfloat16),
]


@remarks("2.4 send_activation / recv_activation")
def exchange_worker(tensors: list[torch.Tensor]) -> None:
    """Rank 0 sends each tensor; rank 1 checks each as it arrives and raises at the first wrong
    one (before the next one, whose size may differ, can make gloo abort; raising, not
    returning, stops rank 0 at once instead of leaving it waiting)."""
    module = mp()
    if dist.get_rank() == 0:
        for tensor in tensors:
            module.send_activation(tensor, 1)
        return
    for sent in tensors:
        got = module.recv_activation(0, torch.device("cpu"))
        if not isinstance(got, torch.Tensor):
            raise AssertionError(
                f"2.4: recv_activation returned {type(got).__name__}, not a tensor"
            )
        if got.dtype != sent.dtype or got.shape != sent.shape:
            raise AssertionError(
                f"2.4: rank 0 sent a {sent.dtype} tensor of shape {tuple(sent.shape)}; rank 1 "
                f"received {got.dtype} {tuple(got.shape)}. Allocate the receive buffer with the "
                "dtype and shape the header announces (decode_header(header).empty(device))"
            )
        if not torch.equal(got, sent):
            raise AssertionError(
                f"2.4: a {sent.dtype} tensor of shape {tuple(sent.shape)} arrived with "
                "different values (send from contiguous memory: tensor.detach().contiguous())"
            )


@exercise("2.4")
def test_the_receiver_allocates_the_dtype_the_header_announces() -> None:
    run("2.4 header dtype", exchange_worker, 2, DTYPE_PROBES, hang_hint=HANG_HINT)


@exercise("2.4")
def test_activations_arrive_with_their_shape_and_dtype() -> None:
    run("2.4 activations", exchange_worker, 2, ACTIVATIONS, hang_hint=HANG_HINT)


# ============================================================================ the model


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
    # 7 layers over 3 ranks: [3, 2, 2]; the other way round, [2, 2, 3], feeds a wrong width
    "seven": lambda: nn.Sequential(
        nn.Flatten(),
        nn.Linear(12, 9),
        nn.Tanh(),
        nn.Linear(9, 7),
        nn.Tanh(),
        nn.Linear(7, 5),
        nn.Linear(5, 3),
    ),
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


def mp_batches(name: str, seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (MP_BATCH, 1, 8, 8) if name == "cnn" else (MP_BATCH, 3, 4)
    return [
        (torch.randn(shape, generator=g, dtype=F64), torch.randint(3, (MP_BATCH,), generator=g))
        for _ in range(MP_STEPS)
    ]


def train_stage(
    label: str, name: str, seed: int, rank: int, world_size: int, group: dist.ProcessGroup | None
) -> dict[str, Any]:
    """Two SGD steps of the model-parallel model on this rank; what the tests compare."""
    module = mp()
    last = world_size - 1
    stage = module.ModelParallelStage(make_mp_model(name), group=group)
    parameters = list(stage.parameters())
    optimizer = torch.optim.SGD(parameters, lr=MP_LR) if parameters else None
    losses, grads = [], []
    for step, (inputs, targets) in enumerate(mp_batches(name, seed)):
        stage.zero_grad(set_to_none=True)
        output = stage(inputs if rank == 0 else None)
        if rank > 0 and (stage.stage_input is None or not stage.stage_input.requires_grad):
            raise AssertionError(
                f"{label}, step {step}: rank {rank}'s received activation (stage_input) does not require "
                "grad, so autograd computes no gradient to send back: call .requires_grad_() on "
                "the tensor recv_activation returns, before running the layers"
            )
        if (output is not None) != (rank == last):
            raise AssertionError(
                f"{label}: forward on rank {rank} of {world_size} returned "
                f"{'a tensor' if output is not None else 'None'}: only the last rank returns the "
                "model's output, the others send theirs on and return None"
            )
        saved = [t for t in (stage.stage_output, stage.stage_input if rank > 0 else None)]
        refs = [weakref.ref(t) for t in saved if t is not None]
        del saved
        loss = F.cross_entropy(output, targets) if output is not None else None
        stage.backward(loss)
        if loss is not None:
            losses.append(loss.item())
        del output, loss
        if any(ref() is not None for ref in refs):
            raise AssertionError(
                f"{label}, step {step}: after backward, rank {rank} still holds the step's activations "
                f"(stage_input={type(stage.stage_input).__name__}, stage_output="
                f"{type(stage.stage_output).__name__}): set both to None at the end of backward, "
                "so a step's activations, and the graph they keep, are freed before the next "
                "step instead of living on beside it"
            )
        grads.append(
            {n: p.grad.clone() for n, p in stage.named_parameters_in_model() if p.grad is not None}
        )
        if optimizer is not None:
            optimizer.step()
    owned = [n for n, _ in stage.named_parameters_in_model()]
    layers = [int(key) for key, _ in stage.layers.named_children()]
    return {
        "losses": losses,
        "grads": grads,
        "owned": owned,
        "layers": layers,
    }


@remarks("2.4 ModelParallelStage")
def model_parallel_worker(name: str) -> dict[str, Any]:
    rank, size = dist.get_rank(), dist.get_world_size()
    return train_stage(f"2.4: {name} on {size} ranks", name, 3, rank, size, None)


def single_device_reference(
    name: str, seed: int = 3
) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    model = make_mp_model(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=MP_LR)
    losses, grads = [], []
    for inputs, targets in mp_batches(name, seed):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
    return losses, grads


def check_against_reference(
    label: str, name: str, results: list[dict[str, Any]], seed: int
) -> None:
    ref_losses, ref_grads = single_device_reference(name, seed)
    owned = [n for result in results for n in result["owned"]]
    everything = sorted(ref_grads[0])
    if sorted(owned) != everything:
        held = {rank: result["owned"] for rank, result in enumerate(results)}
        fail(
            f"{label}: the stages together should hold every parameter exactly once, "
            f"{everything}; they hold {held}"
        )
    sizes = expected_split(len(make_mp_model(name)), len(results))
    for rank, result in enumerate(results):
        start = sum(sizes[:rank])
        layers = list(range(start, start + sizes[rank]))
        if result["layers"] != layers:
            fail(
                f"{label}: rank {rank} should hold layers {layers} (split {sizes}: the earlier "
                f"ranks take the extra layers), but holds {result['layers']}"
            )
    losses = results[-1]["losses"]
    for step, ref in enumerate(ref_losses):
        if step >= len(losses) or losses[step] != pytest.approx(ref, rel=1e-12):
            got = losses[step] if step < len(losses) else "none"
            fail(
                f"{label}, step {step}: the last rank's loss should equal the single-device "
                f"model's, {ref:.12f}; got {got}"
            )
    for rank, result in enumerate(results):
        for step, step_grads in enumerate(ref_grads):
            for param in result["owned"]:
                got, want = result["grads"][step].get(param), step_grads[param]
                if max_diff(got, want) > 1e-12:
                    fail(
                        f"{label}, step {step}: rank {rank}'s gradient of {param} differs from "
                        f"the single-device model's: {describe(got, want)}. Is the gradient "
                        "sent back to the previous rank, and received in order?"
                    )


@exercise("2.4")
@pytest.mark.parametrize(
    ("name", "world_size"),
    [("mlp", 2), ("seven", 3), ("mlp", 4), ("flatten-first", 4), ("cnn", 4)],
)
def test_loss_and_gradients_equal_the_single_device_model(name: str, world_size: int) -> None:
    label = f"2.4: {name} on {world_size} ranks"
    results = run(label, model_parallel_worker, world_size, name, hang_hint=HANG_HINT)
    check_against_reference(label, name, results, 3)


@remarks("2.4 forward_backward")
def traffic_worker() -> dict[str, Any]:
    module = mp()
    stage = module.ModelParallelStage(make_mp_model("tapered"))
    inputs, targets = mp_batches("tapered")[0]
    with CommCounter() as comm:
        module.forward_backward(stage, inputs, targets, F.cross_entropy)
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
    results = run("2.4 traffic", traffic_worker, 3, hang_hint=HANG_HINT)
    for rank, result in enumerate(results):
        collectives = {op: n for op, n in result["calls"].items() if op in COLLECTIVE_OPS}
        if collectives:
            fail(
                f"2.4: naive model parallelism needs only point-to-point messages; rank {rank} "
                f"called {collectives}"
            )
        sent, want = result["sent"], expected_data[rank]
        if not want <= sent <= want + HEADER_ALLOWANCE:
            fail(
                f"2.4: in one step rank {rank} of 3 should send {roles[rank]}: {want} bytes of "
                f"data (plus at most {HEADER_ALLOWANCE} of headers); it sent {sent}"
            )
        if not sum(n for op, n in result["calls"].items() if op in SENDING_OPS):
            fail(f"2.4: rank {rank} sent nothing (use dist.send)")


# ============================================================================ subgroups


@remarks("2.4 in a subgroup")
def subgroup_worker(info: SubgroupInfo, name: str) -> dict[str, Any]:
    with only_inside(info, "2.4 model parallelism"):
        label = f"2.4: {name} in the group {info.ranks}"
        result = train_stage(label, name, 10 + info.index, info.group_rank, info.size, info.group)
    result["group"] = info.index
    return result


@exercise("2.4")
def test_model_parallel_runs_inside_a_subgroup() -> None:
    results = run_in_subgroups("2.4 in subgroups", subgroup_worker, "tapered")
    for index in (0, 1):
        mine = [r for r in results if r["group"] == index]
        check_against_reference(
            f"2.4: tapered in the group of ranks {2 * index}-{2 * index + 1} of a world of 4 "
            "(every rank and peer is a rank within the group: group=, group_dst=, group_src=)",
            "tapered",
            mine,
            10 + index,
        )


# ============================================================================ the demo


def demo_worker(impl_name: str) -> list[Any]:
    from solutions.phase2_advanced.demos import model_parallel as model_parallel_demo

    config = model_parallel_demo.DemoConfig(steps=2, batch_size=8, dtype="float64", impl=impl_name)
    return model_parallel_demo.run_demo(config)


@exercise("2.4")
def test_instructor_demo_matches_the_single_device_model() -> None:
    reports = run("2.4 demo", demo_worker, 2, impl(), hang_hint=HANG_HINT)[0]
    assert len(reports) == 2, f"2.4: run_demo(steps=2) returned {len(reports)} step reports"
    for step, report in enumerate(reports):
        if report.loss != pytest.approx(report.reference_loss, rel=1e-12):
            fail(f"2.4: demo step {step}: loss {report.loss} vs one device {report.reference_loss}")
        if report.max_grad_diff > 1e-12:
            fail(f"2.4: demo step {step}: gradients differ by {report.max_grad_diff:.2e}")
