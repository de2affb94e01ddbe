"""Grader of exercise 2.2, mixed precision: ``uv run pytest tests/test_phase2.py -m ex2_2``.

The hand-made loss scaler is compared with ``torch.amp.GradScaler`` bit for bit: the scale
sequence (also for growth and backoff factors that are not powers of two, over long runs), the
skipped steps, the unscaled gradients and the weights. In a process group every rank of the
scaler's group must make the same skip decision, and the flag must not leave the group.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from grading import exercise
from phase2_group_helpers import (
    SUBGROUP_SIZE,
    SUBGROUP_WORLD,
    crossing_message,
    demo_module,
    fail,
    fail_on_crossing,
    impl_flag,
    module,
    small_world,
)
from subgroups import split_into_groups
from torch import nn

from course.comm_counter import CommCounter
from course.distributed import current_info
from course.training import LoopConfig, train_data_parallel


def precision_module() -> Any:
    return module("mixed_precision")


def small_mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def batch(samples: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(samples, 6, generator=g), torch.randint(3, (samples,), generator=g)


# ----------------------------------------------------------------------------- unscale_, first
# unscale_ is the scaler's first TODO, and every stream below runs it: judged alone first, so
# that a way of unscaling gets its own name before a stream's weights differ.


UNSCALE_SCALE = 1000.0 * 1.3**7  # not a power of two: 1/scale is not exact


def unscaled_ways(scaled: torch.Tensor, scale: float) -> dict[str, torch.Tensor]:
    """The float32 gradients the usual ways of unscaling ``scaled`` give, by what they do."""
    scale32 = torch.tensor(scale, dtype=torch.float32)
    return {
        "it divides by the scale": scaled / scale32,
        "it multiplies by 1/scale computed in float32": scaled * (1 / scale32),
        "it divides in float64 and rounds each quotient": (scaled.double() / scale).float(),
        "it multiplies by 1/scale in float64 and rounds each product": (
            scaled.double() * (1 / scale)
        ).float(),
    }


def scaled_gradients(scale: float = UNSCALE_SCALE) -> torch.Tensor:
    """The gradient of scale * sum(param * direction) that the test's backward leaves, before any
    unscaling: direction times the float32 scale."""
    direction = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    return direction * torch.tensor(scale, dtype=torch.float32)


def unscale_verdict(
    ours: torch.Tensor, theirs: torch.Tensor, scaled: torch.Tensor, scale: float
) -> str | None:
    """What differs between our unscaled gradients and GradScaler's; a way of unscaling is named
    only when ours equals what it gives from the ``scaled`` gradients, and GradScaler's does not."""
    if torch.equal(ours, theirs):
        return None
    wrong = int((ours != theirs).sum())
    fits = [
        why
        for why, way in unscaled_ways(scaled, scale).items()
        if not torch.equal(way, theirs) and torch.equal(ours, way)
    ]
    said = (
        f"2.2 unscale_: {wrong} of {ours.numel()} gradients differ from GradScaler's unscaled "
        f"ones (scale {scale:.6g}, max difference {(ours - theirs).abs().max():.2e})"
    )
    how = (
        f": {fits[0]}"
        if len(fits) == 1
        else f": this fits each of: {'; '.join(fits)}"
        if fits
        else ""
    )
    return (
        f"{said}{how}; GradScaler multiplies every gradient by ONE float32 number, 1/scale "
        "computed in float64 and rounded to float32"
    )


@exercise("2.2")
def test_unscaled_gradients_equal_grad_scalers_bitwise() -> None:
    """With a scale that is not a power of two, 1/scale is not exact: every way of unscaling but
    GradScaler's (one float32 inverse computed in float64, multiplied in) rounds differently."""
    precision = precision_module()
    grads: dict[str, torch.Tensor] = {}
    for name, scaler in (
        ("ours", precision.DynamicLossScaler(init_scale=UNSCALE_SCALE)),
        ("theirs", torch.amp.GradScaler("cpu", init_scale=UNSCALE_SCALE)),
    ):
        param = nn.Parameter(torch.zeros(4096))
        optimizer = torch.optim.SGD([param], lr=0.1)
        direction = torch.randn(4096, generator=torch.Generator().manual_seed(3))
        scaler.scale((param * direction).sum()).backward()
        scaler.unscale_(optimizer)
        assert param.grad is not None
        grads[name] = param.grad.clone()
        scaler.step(optimizer)  # after unscale_, step must not unscale again
        assert param.grad is not None
        grads[name + " after step"] = param.grad.clone()
    ours, theirs = grads["ours"], grads["theirs"]
    verdict = unscale_verdict(ours, theirs, scaled_gradients(), UNSCALE_SCALE)
    if verdict:
        fail(verdict)
    if not torch.equal(grads["ours after step"], theirs):
        fail(
            "2.2 unscale_: the gradients changed again when the optimizer was stepped through "
            "the scaler (unscaled twice?): unscale_ must remember that it ran (self._unscaled) "
            "until the scaler's transition at the end of the iteration"
        )


# ----------------------------------------------------------------------------- against GradScaler

OVERFLOW_STEPS = {2, 3, 9, 16}


def run_scaler_stream(
    scaler: Any, steps: int, overflows: set[int], device: str = "cpu"
) -> tuple[list[float], list[bool], torch.Tensor]:
    """Feed a scaler a gradient stream with overflows; return scales, step decisions, weights."""
    param = nn.Parameter(torch.linspace(-1, 1, 5, device=device))
    optimizer = torch.optim.SGD([param], lr=0.01, momentum=0.9)
    scales, stepped = [], []
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        optimizer.zero_grad()
        direction = torch.randn(5, generator=g).to(device)
        if step in overflows:
            direction[step % 5] = float("inf") if step % 2 else float("nan")
        scaler.scale((param * direction).sum()).backward()
        before = param.detach().clone()
        scaler.step(optimizer)
        stepped.append(not torch.equal(before, param.detach()))
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, stepped, param.detach()


def scale_verdict(
    label: str, ours: list[float], theirs: list[float], overflows: set[int]
) -> str | None:
    """The first iteration after which the scale differs from GradScaler's, and what the size of
    the difference says: a rounding (the product rounded otherwise) when it is within a float32
    rounding, else the state machine; None when every scale is GradScaler's."""
    for step, (got, want) in enumerate(zip(ours, theirs, strict=True)):
        if got != want:
            event = "an overflow" if step in overflows else "a clean iteration"
            return (
                f"2.2 {label}, update: after iteration {step} ({event}) the scale is {got!r}; "
                f"GradScaler's is {want!r} (scales before: {theirs[max(0, step - 3) : step]}). "
                + (
                    "Check the state machine: back off on an overflow, grow after "
                    "growth_interval clean iterations in a row, restart the count after either"
                    if abs(got - want) > 1e-6 * abs(want)
                    else "Yours is no float32 number: GradScaler keeps the scale in float32, "
                    "multiplying it by the factor in float64 and rounding the product once"
                    if got != float(torch.tensor(got, dtype=torch.float32))
                    else "Yours is a float32 number rounded otherwise: GradScaler multiplies the "
                    "float32 scale by the factor in float64 and rounds the product to float32 once"
                )
            )
    return None


def compare_streams(
    kwargs: dict[str, Any], steps: int, overflows: set[int], label: str, device: str = "cpu"
) -> None:
    precision = precision_module()
    ours = run_scaler_stream(precision.DynamicLossScaler(**kwargs), steps, overflows, device)
    theirs = run_scaler_stream(torch.amp.GradScaler(device, **kwargs), steps, overflows, device)
    verdict = scale_verdict(label, ours[0], theirs[0], overflows)
    if verdict:
        fail(verdict)
    skipped_ours = [i for i, s in enumerate(ours[1]) if not s]
    skipped_theirs = [i for i, s in enumerate(theirs[1]) if not s]
    if skipped_ours != skipped_theirs:
        fail(f"2.2 {label}: skipped iterations {skipped_ours}, GradScaler skipped {skipped_theirs}")
    if not torch.equal(ours[2], theirs[2]):
        fail(
            f"2.2 {label}, unscale_: the weights after the stream differ from GradScaler's by "
            f"{(ours[2] - theirs[2]).abs().max():.2e} on {device}: multiply each gradient by one float32 "
            "inverse scale (1/scale computed in float64), as GradScaler does"
        )


def random_overflows(steps: int) -> set[int]:
    """The iterations (a fifth of them, seeded) that overflow in the long streams."""
    g = torch.Generator().manual_seed(5)
    return {i for i in range(steps) if torch.rand((), generator=g).item() < 0.2}


def stream_cases() -> list[tuple[str, dict[str, Any], int, set[int]]]:
    """(label, the scaler's settings, iterations, the overflowing ones) of each graded stream:
    factors of 2 and 0.25 (exact in float32) and an interval of 3, then factors that round."""
    cases: list[tuple[str, dict[str, Any], int, set[int]]] = [
        (
            f"scaler (growth 2, backoff 0.25, interval 3, overflows at {sorted(OVERFLOW_STEPS)})",
            {"init_scale": 2.0**10, "growth_factor": 2.0, "backoff_factor": 0.25,
             "growth_interval": 3},
            24,
            OVERFLOW_STEPS,
        )
    ]  # fmt: skip
    for growth, backoff in ANY_FACTORS:
        kwargs = {
            "init_scale": 1000.0,
            "growth_factor": growth,
            "backoff_factor": backoff,
            "growth_interval": 2,
        }
        label = f"scaler (growth {growth}, backoff {backoff}, 400 steps)"
        cases.append((label, kwargs, 400, random_overflows(400)))
    return cases


ANY_FACTORS = [(1.3, 0.7), (1.001, 0.9)]


@exercise("2.2")
def test_loss_scaler_follows_grad_scaler() -> None:
    label, kwargs, steps, overflows = stream_cases()[0]
    compare_streams(kwargs, steps, overflows, label)


@exercise("2.2")
@pytest.mark.parametrize("index", [1, 2], ids=[f"{g}-{b}" for g, b in ANY_FACTORS])
def test_loss_scaler_equals_grad_scaler_for_any_factor(index: int) -> None:
    label, kwargs, steps, overflows = stream_cases()[index]
    compare_streams(kwargs, steps, overflows, label)


# ----------------------------------------------------------------------------- on a GPU
# GradScaler takes other code on CUDA (fused kernels that check and unscale in one pass): the same
# comparisons there, and a real fp16 autocast run. They need a CUDA device and are skipped without.

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="a CUDA check: needs a GPU (runs on one, see issue 28)"
)


@exercise("2.2")
@needs_cuda
def test_loss_scaler_follows_grad_scaler_on_cuda() -> None:
    kwargs = {"init_scale": 1000.0, "growth_factor": 1.3, "backoff_factor": 0.7}
    compare_streams(
        {**kwargs, "growth_interval": 2},
        60,
        {i for i in range(60) if i % 7 in (2, 3)},
        "scaler on CUDA (growth 1.3, backoff 0.7, interval 2)",
        device="cuda",
    )


def fp16_autocast_run(scaler: Any, steps: int = 40) -> tuple[list[float], torch.Tensor]:
    """A small MLP trained with fp16 autocast on CUDA; the scales and the final weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    scales = []
    for _ in range(steps):
        x = torch.randn(128, 64, generator=g).cuda()
        y = torch.randint(8, (128,), generator=g).cuda()
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, torch.cat([p.detach().flatten() for p in model.parameters()])


@exercise("2.2")
@needs_cuda
def test_fp16_autocast_training_on_cuda_equals_grad_scaler() -> None:
    kwargs: dict[str, Any] = {"init_scale": 2.0**24, "growth_interval": 5}  # backs off first
    ours = fp16_autocast_run(precision_module().DynamicLossScaler(**kwargs))
    theirs = fp16_autocast_run(torch.amp.GradScaler("cuda", **kwargs))
    if ours[0] != theirs[0]:
        step = next(i for i, (a, b) in enumerate(zip(*[ours[0], theirs[0]], strict=True)) if a != b)
        fail(
            f"2.2 fp16 autocast on CUDA: after step {step} the scale is {ours[0][step]!r}, "
            f"GradScaler's {theirs[0][step]!r}: an overflow in fp16 gradients on the GPU must be "
            "found (inf or nan anywhere) and back the scale off, as on the CPU"
        )
    if not torch.equal(ours[1], theirs[1]):
        fail(
            "2.2 fp16 autocast on CUDA: the weights after 40 steps differ from GradScaler's by "
            f"{(ours[1] - theirs[1]).abs().max():.2e}: unscale with one float32 inverse scale, "
            "skip exactly the steps GradScaler skips"
        )


# ----------------------------------------------------------------------------- across ranks


def one_rank_overflows_worker(group_size: int = 0) -> dict[str, Any]:
    """Rank 1 (of each group: global rank 1 only) overflows at step 1; the rest are clean."""
    precision = precision_module()
    info = split_into_groups(group_size) if group_size else None
    rank = dist.get_rank()
    torch.manual_seed(rank)  # model-parallel style: each rank owns different parameters
    param = nn.Parameter(torch.randn(4))
    optimizer = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    kwargs = {"group": info.group} if info else {}
    scaler = precision.DynamicLossScaler(init_scale=256.0, growth_interval=2, **kwargs)
    history = []
    with CommCounter() as comm:
        for step in range(4):
            optimizer.zero_grad()
            direction = torch.ones(4)
            if step == 1 and rank == 1:
                direction[0] = float("inf")
            state = {k: v.clone() for k, v in optimizer.state[param].items()}
            before = param.detach().clone()
            scaler.scale((param * direction).sum()).backward()
            stepped = scaler.step(optimizer)
            unchanged = torch.equal(before, param.detach()) and all(
                torch.equal(v, optimizer.state[param][k]) for k, v in state.items()
            )
            scaler.update()
            history.append((bool(stepped), unchanged, scaler.get_scale()))
    return {
        "history": history,
        "crossing": crossing_message(comm, info) if info else None,
        "index": info.index if info else 0,
    }


def check_skips(results: list[dict[str, Any]], label: str) -> None:
    said = skip_verdict(results, label)
    if said:
        fail(said)


def _iteration_one(rank: int, result: dict[str, Any]) -> str:
    stepped, unchanged, _ = result["history"][1]
    return f"rank {rank} {'stepped' if stepped else 'skipped'}" + (
        "" if stepped or unchanged else " and changed its weights/optimizer state"
    )


def skip_verdict(results: list[dict[str, Any]], label: str) -> str | None:
    """What every rank's 4 iterations say (rank 1, of the first group, overflows at iteration 1),
    None when each did what GradScaler does. A cause is named only when it explains every rank
    of the overflowing group at iteration 1: rank 1 skipped and the others stepped (the flag
    never reached them), or every one stepped (no rank saw the overflow: causes listed); a rank
    of the other group that skipped iteration 1 and only it names the flag reduced over the
    world. Anything else is described, rank by rank."""
    group = [r for r, result in enumerate(results) if result["index"] == 0]
    at_one = {r: results[r]["history"][1] for r in group}
    if any(stepped or not unchanged for stepped, unchanged, _ in at_one.values()):
        seen = ", ".join(_iteration_one(r, results[r]) for r in group)
        stepped = [r for r in group if at_one[r][0]]
        if at_one[1][:2] == (False, True) and set(stepped) == set(group) - {1}:
            why = (
                f"rank 1's overflow did not reach rank(s) {stepped}: every rank of the group must "
                "agree (all-reduce the overflow flag with MAX on the scaler's group, and skip on "
                "the reduced flag)"
            )
        elif set(stepped) == set(group):
            why = (
                "no rank saw the overflow, rank 1 itself included; the causes that fit: the "
                "check for inf/NaN in the gradients, or a reduction of the flag that keeps the "
                "smaller value (MIN) where MAX keeps any overflow"
            )
        else:
            why = "every rank of the group must skip it and leave its weights and state unchanged"
        return f"{label}, unscale_: rank 1 overflowed at iteration 1; {seen}: {why}"
    for rank, result in enumerate(results):
        steps = [h[0] for h in result["history"]]
        if result["index"] != 0 and not steps[1]:
            if steps == [True, False, True, True]:
                return (
                    f"{label}, unscale_: rank {rank} skipped iteration 1, and only it, but only "
                    "rank 1, in the OTHER group, overflowed: the flag was reduced over the world; "
                    "all-reduce it on the scaler's group"
                )
            return (
                f"{label}, unscale_: rank {rank} stepped {steps} over 4 iterations; expected "
                "[True, True, True, True]: only rank 1, in the OTHER group, overflowed (at "
                "iteration 1)"
            )
    for rank, result in enumerate(results):
        overflowed = result["index"] == 0
        scale = result["history"][1][2]
        want_scale = 128.0 if overflowed else 512.0
        if scale != want_scale:
            return (
                f"{label}: rank {rank}'s scale after iteration 1 is {scale}, expected {want_scale}"
            )
        want = [True, False, True, True] if overflowed else [True, True, True, True]
        got = [h[0] for h in result["history"]]
        if got != want:
            return f"{label}: rank {rank} stepped {got} over 4 steps; expected {want}"
    return None


@exercise("2.2")
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank() -> None:
    check_skips(small_world(one_rank_overflows_worker, 2), "2.2 DynamicLossScaler on 2 ranks")


@exercise("2.2")
def test_the_overflow_flag_stays_inside_the_scalers_group() -> None:
    results = small_world(one_rank_overflows_worker, SUBGROUP_WORLD, SUBGROUP_SIZE)
    label = "2.2 DynamicLossScaler(group=...) on two groups of 2"
    fail_on_crossing(label, results)
    check_skips(results, label)


def no_gradient_worker() -> list[int]:
    """Two iterations in which this rank's optimizer holds a parameter without a gradient."""
    precision = precision_module()
    param = nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = precision.DynamicLossScaler(init_scale=256.0)
    collectives = []
    for _ in range(2):
        optimizer.zero_grad(set_to_none=True)
        with CommCounter() as comm:
            scaler.step(optimizer)
        scaler.update()
        collectives.append(len(comm.records))
    return collectives


@exercise("2.2")
def test_a_rank_without_gradients_still_takes_part_in_the_flag() -> None:
    for rank, counts in enumerate(small_world(no_gradient_worker, 2)):
        if counts != [1, 1]:
            fail(
                f"2.2 DynamicLossScaler on 2 ranks whose optimizers hold no gradient this "
                f"iteration: rank {rank} called {counts} collectives in its 2 iterations' "
                "unscale_ (which the scaler runs every iteration); expected one each. A rank of "
                "the group with no gradient, a pipeline stage or a frozen part, must still take "
                "part, or the ranks that hold gradients wait for it in theirs until the timeout"
            )


# ----------------------------------------------------------------------------- the step


def update_norm(before: list[torch.Tensor], after: Any) -> float:
    """How far one step moved the parameters (the norm of the update)."""
    squares = sum(((p.detach() - b) ** 2).sum() for b, p in zip(before, after, strict=True))
    return float(squares) ** 0.5


CLIP_SCALE = 2.0**12  # the clipping test's initial scale (no overflow: it stays)
CLIP_NORM = 0.05  # its max_norm: small enough to bind on every step of the recipe


def clipping_advice(moved: list[tuple[float, float]]) -> str:
    """What the earlier steps' update sizes say, when they differ from GradScaler's recipe. A
    step the scale times smaller names the clipping of the still-scaled gradients; any
    other step much smaller or larger is described (a ratio alone names no cause)."""
    for step, (ours, ref) in enumerate(moved):
        if ref > 0 and ours == pytest.approx(ref / CLIP_SCALE, rel=1e-2):  # float32 updates
            return (
                f". Step {step} moved the weights {ref / max(ours, 1e-30):.4g}x less than the "
                f"recipe, the scale ({CLIP_SCALE:g}) within rounding: the clipping saw gradients "
                "still multiplied by the scale (the scaler's unscaling comes before "
                "clip_grad_norm_)"
            )
        if ref > 0 and ours < ref / 100:
            return (
                f". Step {step} moved the weights {ref / max(ours, 1e-30):.3g}x less than the "
                f"recipe, and not by the scale ({CLIP_SCALE:g})"
            )
        if ref > 0 and ours > 1.5 * ref:
            return (
                f". Step {step} moved the weights {ours / ref:.3g}x more than the recipe, more "
                f"than a clipping at max_norm {CLIP_NORM} between the unscaling and the step "
                "allows"
            )
    return ""


def clipping_verdict(
    losses: list[float],
    ref_losses: list[float],
    moved: list[tuple[float, float]],
    worst: tuple[str, float],
) -> str | None:
    """The clipping test's failure from its 3 iterations: each loss against the recipe's (with
    what the earlier steps' sizes say), then the parameter that differs most after them."""
    for step, (loss, ref_loss) in enumerate(zip(losses, ref_losses, strict=True)):
        if loss != pytest.approx(ref_loss, rel=1e-6):
            return (
                f"2.2 mixed_precision_step (init scale 2^12, clipping at {CLIP_NORM}): iteration "
                f"{step} loss {loss}, expected {ref_loss}" + clipping_advice(moved[:step])
            )
    name, diff = worst
    if diff > 1e-6:
        return (
            f"2.2 mixed_precision_step: after 3 clipped iterations {name} differs from "
            f"GradScaler's recipe by {diff:.2e}: clip after unscaling, and unscale once"
        )
    return None


@exercise("2.2")
def test_clipping_sees_unscaled_gradients_like_the_grad_scaler_recipe() -> None:
    precision = precision_module()
    x, y = batch(16)
    ours_model, ref_model = small_mlp(), small_mlp()
    ours_opt = torch.optim.SGD(ours_model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.5)
    scaler = precision.DynamicLossScaler(init_scale=CLIP_SCALE)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=CLIP_SCALE)
    moved: list[tuple[float, float]] = []  # (ours, reference) size of each step's update
    losses: list[float] = []
    ref_losses: list[float] = []
    for step in range(3):
        before = [p.detach().clone() for p in ours_model.parameters()]
        ref_before = [p.detach().clone() for p in ref_model.parameters()]
        loss, stepped = precision.mixed_precision_step(
            ours_model, ours_opt, nn.functional.cross_entropy, x, y, scaler, None, CLIP_NORM
        )
        ref_opt.zero_grad()
        ref_loss = nn.functional.cross_entropy(ref_model(x), y)
        ref_scaler.scale(ref_loss).backward()
        ref_scaler.unscale_(ref_opt)
        nn.utils.clip_grad_norm_(ref_model.parameters(), CLIP_NORM)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        moved.append(
            (
                update_norm(before, ours_model.parameters()),
                update_norm(ref_before, ref_model.parameters()),
            )
        )
        if not stepped:
            fail(f"2.2 mixed_precision_step: iteration {step} has no overflow but reported a skip")
        losses.append(loss)
        ref_losses.append(ref_loss.item())
    worst = max(
        ((name, (p - q).abs().max().item()) for (name, p), q in
         zip(ours_model.named_parameters(), ref_model.parameters(), strict=True)),
        key=lambda named: named[1],
    )  # fmt: skip
    said = clipping_verdict(losses, ref_losses, moved, worst)
    if said:
        fail(said)


def autocast_losses(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """The loss with the forward and the loss under bf16 autocast (float32: autocast computes
    cross-entropy in float32), and with the loss computed after it, on the bf16 logits."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
        inside = nn.functional.cross_entropy(logits, y)
    return inside.item(), nn.functional.cross_entropy(logits, y).item()


def autocast_loss_verdict(loss: float, ref_loss: float, outside_loss: float) -> str | None:
    """What the returned loss says, None when it is the loss under autocast. A loss in bf16 is
    told only when the returned loss is exactly the one computed outside autocast, and then with
    both causes that give that number (here they coincide)."""
    if loss == pytest.approx(ref_loss, rel=1e-6):
        return None
    said = (
        f"the loss is {loss}; the forward and the loss under the same autocast give {ref_loss} "
        "(a float32 loss: autocast computes cross-entropy in float32)"
    )
    if loss == outside_loss and outside_loss != ref_loss:
        return said + (
            f". Yours is exactly the loss in bf16 ({outside_loss}); the causes that fit: the "
            "cross-entropy computed after autocast, on its bf16 logits, or the float32 loss "
            "rounded to bf16 on its way back: compute the loss inside autocast and return it "
            "as it is"
        )
    return said + f"; yours is {loss / ref_loss:.6g} times that"


@exercise("2.2")
def test_mixed_precision_step_runs_the_forward_and_the_loss_under_autocast() -> None:
    precision = precision_module()
    x, y = batch(16)
    model, ref_model = small_mlp(), small_mlp()
    seen: list[torch.dtype] = []
    model[0].register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = precision.DynamicLossScaler(enabled=False)
    loss, _ = precision.mixed_precision_step(
        model, optimizer, nn.functional.cross_entropy, x, y, scaler, torch.bfloat16
    )
    ref_loss, outside_loss = autocast_losses(ref_model, x, y)
    if seen != [torch.bfloat16]:
        fail(
            f"2.2 mixed_precision_step(autocast_dtype=torch.bfloat16): the model's first Linear "
            f"returned {seen} in its forwards; expected [torch.bfloat16], one forward under "
            "autocast"
        )
    said = autocast_loss_verdict(loss, ref_loss, outside_loss)
    if said:
        fail(f"2.2 mixed_precision_step(autocast_dtype=torch.bfloat16): {said}")


@exercise("2.2")
def test_an_overflowing_step_changes_nothing_and_backs_off_once() -> None:
    precision = precision_module()
    x, y = batch(16)
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = precision.DynamicLossScaler(init_scale=2.0**10)
    loss_fn = nn.functional.cross_entropy
    precision.mixed_precision_step(model, optimizer, loss_fn, x, y, scaler, None)
    weights = [p.detach().clone() for p in model.parameters()]
    momentum = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    scale = scaler.get_scale()
    bad = x.clone()
    bad[3, 2] = float("nan")  # one sample: the loss, and every gradient, turn NaN
    _, stepped = precision.mixed_precision_step(model, optimizer, loss_fn, bad, y, scaler, None)
    changed = [
        name
        for (name, p), before, buffer in zip(
            model.named_parameters(), weights, momentum, strict=True
        )
        if not torch.equal(p.detach(), before)
        or not torch.equal(optimizer.state[p]["momentum_buffer"], buffer)
    ]
    if stepped or changed:
        fail(
            "2.2 mixed_precision_step on inputs holding a NaN (every gradient NaN): it returned "
            f"stepped={stepped}, and the weights or momentum of {changed or 'no parameter'} "
            "changed; an overflowing iteration must be skipped by the scaler and leave everything "
            "as it was"
        )
    if scaler.get_scale() != scale * 0.5:
        fail(
            f"2.2 mixed_precision_step: after the overflowing iteration the scale is "
            f"{scaler.get_scale()}; it was {scale}, and one back-off (factor 0.5) gives "
            f"{scale * 0.5}: the scaler's transition runs once per iteration, a skipped one "
            "included"
        )


class OneUsedOneUnused(nn.Module):
    """A bf16 weight the forward uses and one it never touches (its gradient stays None)."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        self.unused = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.used * x).sum()


@exercise("2.2")
def test_master_weights_skip_overflows_and_leave_unused_parameters_alone() -> None:
    precision = precision_module()
    model = OneUsedOneUnused()
    master = precision.MasterWeights(
        model, lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=0.1)
    )
    scaler = precision.DynamicLossScaler(init_scale=2.0**4)
    master.zero_grad()
    scaler.scale(model(torch.ones(4, dtype=torch.bfloat16))).backward()
    stepped = master.step(scaler)
    if scaler._found_inf is None:
        fail(
            "2.2 MasterWeights.step(scaler): the scaler never unscaled nor checked the masters' "
            "gradients (its step did not run): with a scaler, the scaler's step decides whether "
            "the masters' optimizer steps"
        )
    scaler.update()
    masters = dict(zip(("used", "unused"), master.master_params, strict=True))
    if not stepped or torch.equal(masters["used"].detach(), torch.ones(4)):
        fail("2.2 MasterWeights.step(scaler): a clean step did not move the used weight's master")
    if masters["unused"].grad is not None or not torch.equal(
        masters["unused"].detach(), torch.ones(4)
    ):
        fail(
            "2.2 MasterWeights.step: a parameter the forward never used (no gradient) had its "
            f"master moved to {masters['unused'].detach().tolist()} (gradient "
            f"{masters['unused'].grad}); with weight decay a zero gradient still moves it: "
            "its master must get no gradient either"
        )
    before = [m.detach().clone() for m in master.master_params]
    model_before = [p.detach().clone() for p in model.parameters()]
    master.zero_grad()
    scaler.scale(model(torch.full((4,), float("inf"), dtype=torch.bfloat16))).backward()
    stepped = master.step(scaler)
    scaler.update()
    moved = not all(
        torch.equal(m.detach(), b) for m, b in zip(master.master_params, before, strict=True)
    ) or not all(
        torch.equal(p.detach(), b) for p, b in zip(model.parameters(), model_before, strict=True)
    )
    if stepped or moved:
        fail(
            "2.2 MasterWeights.step(scaler) with an inf gradient: it returned "
            f"{stepped} and the masters or the model {'changed' if moved else 'stayed'}; the "
            "scaler decides: an overflow skips the step and changes nothing"
        )


@exercise("2.2")
def test_master_weights_keep_updates_too_small_for_bf16() -> None:
    precision = precision_module()
    model = nn.Linear(4, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.fill_(1.0)
    master = precision.MasterWeights(model, lambda ps: torch.optim.SGD(ps, lr=1e-3))
    for _ in range(10):
        master.zero_grad()
        model(torch.ones(1, 4, dtype=torch.bfloat16)).sum().backward()  # gradient 1 per weight
        master.step()
        if master.master_params[0].dtype != torch.float32:
            fail("2.2 MasterWeights: the masters must stay float32")
        if not torch.equal(model.weight, master.master_params[0].to(torch.bfloat16)):
            fail("2.2 MasterWeights: after a step the bf16 weights must equal the fp32 masters "
                 "cast to bf16")  # fmt: skip
    got = master.master_params[0][0, 0].item()
    if got != pytest.approx(0.99, abs=1e-6):
        fail(
            f"2.2 MasterWeights: ten updates of -0.001 on 1.0 should leave the master at 0.99, "
            f"got {got} (bf16 alone rounds each update away: its neighbours of 1.0 are "
            "0.99609375 and 1.0078125)"
        )
    if model.weight[0, 0].item() != 0.98828125:
        fail("2.2 MasterWeights: the bf16 copy of 0.99 is 0.98828125")


def precision_training_worker(dtype_name: str) -> dict[str, float]:
    precision = precision_module()
    dtype = {"fp32": None, "bf16": torch.bfloat16}[dtype_name]
    scaler = precision.DynamicLossScaler(enabled=False)

    def step(model: nn.Module, optimizer: Any, x: torch.Tensor, y: torch.Tensor) -> float:
        loss, _ = precision.mixed_precision_step(
            model, optimizer, nn.functional.cross_entropy, x, y, scaler, dtype, 1.0
        )
        return float(loss)

    torch.manual_seed(0)
    from course.models import MLP

    config = LoopConfig(epochs=2, global_batch_size=64, train_samples=1536, test_samples=512)
    summaries = train_data_parallel(MLP(256), step, config, current_info())
    return {"loss": summaries[-1].loss, "accuracy": summaries[-1].test_accuracy}


@exercise("2.2")
def test_bf16_training_ends_close_to_fp32() -> None:
    fp32 = small_world(precision_training_worker, 2, "fp32")[0]
    bf16 = small_world(precision_training_worker, 2, "bf16")[0]
    if bf16["accuracy"] <= 0.3:
        fail(f"2.2: bf16 training reached only {bf16['accuracy']:.2f} test accuracy")
    if abs(bf16["accuracy"] - fp32["accuracy"]) > 0.05:
        fail(
            f"2.2: bf16 test accuracy {bf16['accuracy']:.3f} vs fp32 {fp32['accuracy']:.3f}: "
            "the stated tolerance is 5 points"
        )
    if bf16["loss"] != pytest.approx(fp32["loss"], rel=0.1):
        fail(f"2.2: bf16 final loss {bf16['loss']:.4f} vs fp32 {fp32['loss']:.4f} (tolerance 10%)")


# ----------------------------------------------------------------------------- the demo


def precision_demo_worker(impl_args: list[str]) -> int:
    demo = demo_module("demos.mixed_precision")
    args = ["--epochs", "1", "--train-samples", "256", "--global-batch-size", "64"]
    return int(demo.main([*args, "--precision", "fp16", *impl_args]))


@exercise("2.2")
def test_mixed_precision_demo_runs_in_fp16_on_two_ranks() -> None:
    codes = small_world(precision_demo_worker, 2, impl_flag())
    if codes != [0, 0]:
        fail(f"2.2: mixed_precision_demo --precision fp16 exited with {codes}; expected [0, 0]")
