"""Grader of exercise 2.3, activation checkpointing: ``uv run pytest tests/test_phase2.py -m ex2_3``.

Checkpointed gradients must equal the plain model's bit for bit, with dropout (RNG restored);
the bytes kept for backward must equal ``torch.utils.checkpoint``'s; and the work must be what
checkpointing promises: every layer of a checkpointed segment runs forward twice (once more in
backward), the last segment once. Checkpointing has no communication of its own; a checkpointed
model must still train under DDP.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from grading import defined_at, exercise
from phase2_group_helpers import demo_module, fail, impl_flag, module, small_world
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint_sequential as torch_checkpoint_sequential

from course.memory import SavedTensorMeter


def checkpointing_module() -> Any:
    return module("activation_checkpointing")


def deep_dropout_mlp(depth: int = 6, width: int = 32) -> nn.Sequential:
    torch.manual_seed(3)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.2)]
    return nn.Sequential(*layers).double()


def grads_after(
    model: nn.Module, forward: Callable[[], torch.Tensor]
) -> tuple[torch.Tensor, list[torch.Tensor | None], float]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(11)
    out = forward()
    out.square().mean().backward()
    after = torch.rand(1).item()  # the RNG stream after forward and backward
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return out.detach(), grads, after


# graded segment counts of the forward-count test: 4 does not divide the 18 layers, so a cut
# other than torch's (ceil, or one more layer per segment) shows in the counts
FORWARD_COUNT_SEGMENTS = (2, 3, 4, 6)


def segment_bounds(layers: int, segments: int) -> list[tuple[int, int]]:
    """(first, last) layer of each segment, as torch's checkpoint_sequential cuts them."""
    size = layers // segments
    bounds = [(start, start + size - 1) for start in range(0, size * (segments - 1), size)]
    return [*bounds, (size * (segments - 1), layers - 1)]


# graded segment counts of the bitwise-gradient test: from 3 on, the segments before the last
# checkpointed one and the checkpointed segments are different sets (their gradients' namer)
GRADIENT_SEGMENTS = (2, 3, 7, 18)


@exercise("2.3")
@pytest.mark.parametrize("segments", GRADIENT_SEGMENTS)
def test_checkpointed_gradients_equal_the_plain_model_bitwise_with_dropout(segments: int) -> None:
    checkpointing = checkpointing_module()
    model = deep_dropout_mlp()
    x = torch.randn(5, 32, dtype=torch.float64)  # does not require grad
    out, grads, after = grads_after(model, lambda: model(x))
    ck_out, ck_grads, ck_after = grads_after(
        model, lambda: checkpointing.checkpoint_sequential(model, segments, x)
    )
    where = f"2.3 checkpoint_sequential, {segments} segments of an 18-layer MLP with dropout"
    if not torch.equal(out, ck_out):
        fail(f"{where}: the output differs from the plain model's (max {describe(ck_out, out)})")
    names = [name for name, _ in model.named_parameters()]
    missing = [
        name
        for name, want, got in zip(names, grads, ck_grads, strict=True)
        if got is None or (want is not None and want.any() and not got.any())
    ]
    said = missing_gradients_verdict(segments, missing, len(model))
    if said:
        fail(f"{where}: {said}")
    for name, want, got in zip(names, grads, ck_grads, strict=True):
        assert want is not None and got is not None
        if not torch.equal(want, got):
            fail(
                f"{where}: the gradient of {name} is not bitwise equal to the plain model's "
                f"(max difference {(want - got).abs().max():.2e}). "
                + _why_gradients_differ(checkpointing, segments, x)
            )
    if after != ck_after:
        fail(
            f"{where}: the RNG stream after backward differs from the plain run's: restore the "
            "saved state inside torch.random.fork_rng, so the caller's stream is left as it was"
        )


def missing_gradients_verdict(segments: int, missing: list[str], layers: int) -> str | None:
    """What the parameters with no (or an all-zero) gradient say, None when there are none. A
    cause is named only when the segments they sit in single it out: every segment before the
    last checkpointed one (the gradient stopped at each recomputed segment's input); every
    checkpointed segment (their own parameters got nothing: two causes fit, both listed); any
    other set is described by its segments."""
    if not missing:
        return None
    bounds = segment_bounds(layers, segments)
    held = sorted(
        {next(i for i, (a, b) in enumerate(bounds) if a <= int(n.split(".")[0]) <= b)
         for n in missing}
    )  # fmt: skip
    said = (
        f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} got no (or an all-zero) "
        f"gradient while the plain model's is non-zero; they sit in segment(s) {held} of "
        f"0..{segments - 1}"
    )
    if held == list(range(segments - 2)):
        return said + (
            ": every segment before the last checkpointed one, so the gradient did not flow "
            "from a recomputed segment back to its input. In backward, give each detached input "
            "requires_grad_(its original requires_grad) and return its .grad"
        )
    if held == list(range(segments - 1)):
        return said + (
            ": every checkpointed segment, and no other, so their own parameters got nothing; "
            "the causes that fit: the segments ran without a graph (under torch.no_grad, not "
            "through checkpoint), or backward computed only the inputs' gradients "
            "(torch.autograd.grad fills no .grad; torch.autograd.backward does)"
        )
    return said


def _why_gradients_differ(checkpointing: Any, segments: int, x: torch.Tensor) -> str:
    """The cause of gradients that differ while the output matched: the same run without
    dropout tells a recomputation that draws other masks from a backward that starts wrong."""
    model = deep_dropout_mlp()
    model.apply(lambda m: setattr(m, "p", 0.0) if isinstance(m, nn.Dropout) else None)
    _, grads, _ = grads_after(model, lambda: model(x))
    _, ck_grads, _ = grads_after(
        model, lambda: checkpointing.checkpoint_sequential(model, segments, x)
    )
    return why_gradients_differ(
        all(
            want is not None and got is not None and torch.equal(want, got)
            for want, got in zip(grads, ck_grads, strict=True)
        )
    )


def why_gradients_differ(equal_without_dropout: bool) -> str:
    """The words for gradients that differ while the output matched, from whether they match
    with dropout off: the random state is named only when nothing else differs."""
    if equal_without_dropout:
        return (
            "The output matched, and with dropout off the gradients match too: the "
            "recomputation in backward draws other random numbers than the first forward did "
            "(dropout masks): the RNG state the first forward started from must be restored "
            "before recomputing"
        )
    return (
        "The output matched, and the gradients differ even with dropout off, so something "
        "besides the random state is wrong (the random state may be too; that shows once the "
        "rest is right): the backward through the recomputed segment does not start from what "
        "autograd handed it (each recomputed output that requires grad, with its incoming "
        "gradient), or what it returns is not the gradient of each input"
    )


def describe(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    return f"difference {(got - want).abs().max():.2e}"


@exercise("2.3")
@pytest.mark.parametrize("segments", FORWARD_COUNT_SEGMENTS)
def test_each_checkpointed_segment_runs_forward_twice_and_the_last_once(segments: int) -> None:
    checkpointing = checkpointing_module()
    model = deep_dropout_mlp()
    calls: Counter[int] = Counter()
    for index, layer in enumerate(model):
        layer.register_forward_hook(lambda *_, i=index: calls.update([i]))
    x = torch.randn(5, 32, dtype=torch.float64)
    checkpointing.checkpoint_sequential(model, segments, x).square().mean().backward()
    verdict = forward_count_verdict(segments, dict(calls), len(model))
    if verdict:
        fail(verdict + defined_at(checkpointing.checkpoint_sequential))


def forward_count_verdict(segments: int, calls: dict[int, int], layers: int) -> str | None:
    """What the forward calls per layer (``calls``) say about checkpoint_sequential's segments;
    None when every segment but the last ran twice and the last once. The last segment's
    recomputation is named only when every segment, the last one too, ran exactly twice: a
    segment whose layers ran unequally often is cut elsewhere than torch cuts it."""
    bounds = segment_bounds(layers, segments)
    ran = [sorted({calls.get(i, 0) for i in range(a, b + 1)}) for a, b in bounds]
    wants = [[2]] * (len(bounds) - 1) + [[1]]
    if ran == wants:
        return None
    where = f"2.3 checkpoint_sequential, {segments} segments of {layers} layers"
    if all(r == [2] for r in ran):
        first, last = bounds[-1]
        return (
            f"{where}: layers {first}-{last} (the last segment) ran forward twice, as every "
            "other segment; expected once. Its backward comes first, so checkpointing it only "
            "adds a forward: run the last segment plainly"
        )
    number = next(n for n, (r, w) in enumerate(zip(ran, wants, strict=True)) if r != w)
    first, last = bounds[number]
    is_last = number == len(bounds) - 1
    if len(ran[number]) > 1:
        counts = [calls.get(i, 0) for i in range(first, last + 1)]
        return (
            f"{where}: the layers {first}-{last} of segment {number + 1} ran forward "
            f"{counts} times, unequally: torch's checkpoint_sequential cuts {layers // segments} "
            "layers per segment (the last takes the rest), and every layer of a segment runs "
            "as often as the others"
        )
    if not is_last and ran[number] == [1]:
        return (
            f"{where}: layers {first}-{last} (segment {number + 1}) ran forward once; expected "
            "twice. Backward never ran them again, so their forward recorded a graph and kept "
            "its activations: run a checkpointed segment without a graph in forward, and once "
            "more, recording, in backward"
        )
    return (
        f"{where}: layers {first}-{last} ("
        + ("the last segment" if is_last else f"segment {number + 1}")
        + f") ran forward {ran[number]} times; expected "
        + ("once (the last segment runs plainly)" if is_last else "twice (forward, and backward)")
    )


def peak_saved(model: nn.Module, run: Callable[..., torch.Tensor]) -> int:
    with SavedTensorMeter(exclude=model.parameters()) as meter:
        run().square().mean().backward()
    model.zero_grad(set_to_none=True)
    return meter.peak_bytes


@exercise("2.3")
def test_saved_activations_fall_to_order_sqrt_n_and_match_torch_checkpoint() -> None:
    checkpointing = checkpointing_module()
    depth, width, samples = 16, 64, 32
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(depth):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*blocks)
    x = torch.randn(samples, width)
    activation = samples * width * 4  # bytes of one layer's output
    plain = peak_saved(model, lambda: model(x))
    assert plain == (depth + 1) * activation, (
        f"test setup: plain peak {plain / activation} activations, expected {depth + 1}"
    )
    peaks = {}
    for segments in (2, 4, 8, 16):
        ours = peak_saved(
            model, lambda s=segments: checkpointing.checkpoint_sequential(model, s, x)
        )
        torch_reentrant = peak_saved(
            model,
            lambda s=segments: torch_checkpoint_sequential(
                model, s, x.clone().requires_grad_(), use_reentrant=True
            ),
        )
        torch_hooks = peak_saved(
            model, lambda s=segments: torch_checkpoint_sequential(model, s, x, use_reentrant=False)
        )
        if not ours == torch_reentrant == torch_hooks:
            fail(
                f"2.3: {segments} segments: peak saved bytes {ours} (= {ours / activation:g} "
                f"activations); torch.utils.checkpoint keeps {torch_reentrant} "
                f"(= {torch_reentrant / activation:g}). Save only each segment's input, and "
                "compute the checkpointed forward under torch.no_grad()"
            )
        bound = (segments + depth // segments + 1) * activation
        if ours > bound:
            fail(
                f"2.3: {segments} segments of {depth} layers kept {ours / activation:g} "
                f"activations at peak; theory allows k + n/k + 1 = {bound / activation:g}"
            )
        peaks[segments] = ours
    for bad in (0, len(model) + 1):
        with pytest.raises(ValueError, match=f"segments={bad}"):
            checkpointing.checkpoint_sequential(model, bad, x)
    best = min(peaks, key=lambda k: peaks[k])
    if best != math.isqrt(depth) or peaks[4] > plain / 2:
        fail(
            f"2.3: the smallest peak should be at sqrt({depth}) = {math.isqrt(depth)} segments, "
            f"at most half of plain's {depth + 1}; peaks in activations: "
            f"{ {k: v / activation for k, v in peaks.items()} }"
        )


# ----------------------------------------------------------------------------- under DDP


def checkpoint_ddp_worker() -> list[float]:
    checkpointing = checkpointing_module()
    rank = dist.get_rank()
    model = checkpointing.CheckpointedSequential(deep_dropout_mlp(depth=4), segments=2)
    model.layers.apply(lambda m: setattr(m, "p", 0.0) if isinstance(m, nn.Dropout) else None)
    ddp = DistributedDataParallel(model)
    plain = DistributedDataParallel(deep_dropout_mlp(depth=4))
    plain.module.apply(lambda m: setattr(m, "p", 0.0) if isinstance(m, nn.Dropout) else None)
    x = torch.randn(4, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    ddp(x).sum().backward()
    plain(x).sum().backward()
    return [
        float("inf") if a.grad is None or b.grad is None else float((a.grad - b.grad).abs().max())
        for a, b in zip(ddp.parameters(), plain.parameters(), strict=True)
    ]


@exercise("2.3")
def test_checkpointed_model_trains_under_ddp() -> None:
    for rank, diffs in enumerate(small_world(checkpoint_ddp_worker, 2)):
        worst = max(diffs)
        if worst > 1e-12:
            fail(
                f"2.3: rank {rank}: DDP gradients with checkpointing differ from plain DDP by "
                f"{worst:.2e}"
            )


def checkpointing_demo_worker(impl_args: list[str]) -> int:
    demo = demo_module("demos.checkpointing")
    args = ["--epochs", "1", "--train-samples", "256", "--global-batch-size", "64"]
    return int(demo.main([*args, "--depth", "4", "--width", "64", *impl_args]))


@exercise("2.3")
def test_checkpointing_demo_runs_on_two_ranks() -> None:
    codes = small_world(checkpointing_demo_worker, 2, impl_flag())
    if codes != [0, 0]:
        fail(f"2.3: checkpointing_demo exited with {codes} on 2 ranks; expected [0, 0]")
