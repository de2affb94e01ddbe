"""Phase 2 grader: training within memory, and model, pipeline and tensor parallelism.

Each exercise is checked against what PyTorch ships (GradScaler, torch.utils.checkpoint,
DistributedDataParallel with no_sync) or against one process on the whole batch.
Run one exercise with ``uv run pytest tests/test_phase2.py -m ex2_1``.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from grading import exercise, load, world
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint_sequential as torch_checkpoint_sequential

from solutions.common.comm_counter import CommCounter
from solutions.common.distributed import current_info
from solutions.common.memory import SavedTensorMeter
from solutions.common.training import LoopConfig, train_data_parallel

PHASE = "phase2_advanced"


def accumulation_module() -> Any:
    return load(PHASE, "gradient_accumulation")


def precision_module() -> Any:
    return load(PHASE, "mixed_precision")


def checkpointing_module() -> Any:
    return load(PHASE, "activation_checkpointing")


def small_mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def batch(samples: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(samples, 6, generator=g, dtype=torch.float64), torch.randint(
        3, (samples,), generator=g
    )


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def full_batch_reference(samples: int, steps: int) -> dict[str, torch.Tensor]:
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = batch(samples, seed=step)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return params_of(model)


def assert_params_close(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str
) -> None:
    for name, ref in want.items():
        diff = (got[name] - ref).abs().max().item()
        assert diff < 1e-12, f"{what}: {name} differs from the full-batch reference by {diff:.3e}"


# ============================================================================ 2.1 accumulation


@exercise("2.1")
@pytest.mark.parametrize("micro_batch_size", [1, 4, 10, 12])
def test_accumulated_gradient_equals_one_big_batch(micro_batch_size: int) -> None:
    accumulation = accumulation_module()
    x, y = batch(10)  # micro-batches of 4 leave a short last one of 2
    model, reference = small_mlp(), small_mlp()
    nn.functional.cross_entropy(reference(x), y).backward()
    micro_batches = accumulation.split_micro_batches(x, y, micro_batch_size)
    assert sum(len(t) for _, t in micro_batches) == 10
    loss = accumulation.accumulate_gradients(model, nn.functional.cross_entropy, micro_batches)
    want = nn.functional.cross_entropy(reference(x), y).item()
    assert loss == pytest.approx(want, rel=1e-12), (
        f"2.1: micro-batch size {micro_batch_size}: returned loss {loss}, the batch's mean is {want}"
    )
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None, f"2.1: {name} has no gradient after accumulation"
        diff = (p.grad - q.grad).abs().max().item()  # type: ignore[operator]
        assert diff < 1e-12, (
            f"2.1: micro-batch size {micro_batch_size} (10 samples): {name}.grad differs from one "
            f"batch of 10 by {diff:.2e}; weight each micro-batch's mean loss by its samples/10"
        )
    with pytest.raises(ValueError, match="micro_batch_size=0"):
        accumulation.split_micro_batches(x, y, 0)


def accumulation_dp_worker(steps: int, global_batch: int, micro: int) -> dict[str, Any]:
    accumulation = accumulation_module()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    per_rank = global_batch // world_size
    with CommCounter() as comm:
        for step in range(steps):
            x, y = batch(global_batch, seed=step)
            shard = slice(rank * per_rank, (rank + 1) * per_rank)
            accumulation.accumulation_step(
                model,
                optimizer,
                nn.functional.cross_entropy,
                x[shard],
                y[shard],
                micro,
                data_parallel=True,
            )
    return {"params": params_of(model), "all_reduces": comm.count("all_reduce")}


@exercise("2.1")
def test_data_parallel_accumulation_all_reduces_once_per_step() -> None:
    steps = 3
    want = full_batch_reference(12, steps)
    for rank, result in enumerate(world(accumulation_dp_worker, 2, steps, 12, 4)):
        assert_params_close(result["params"], want, f"2.1 rank {rank}, 2 ranks x (4 + 2 samples)")
        assert result["all_reduces"] == steps, (
            f"2.1: {steps} optimizer steps of 2 micro-batches made {result['all_reduces']} "
            f"all-reduces; expected {steps}: average once per step, not once per micro-batch"
        )


def ddp_accumulation_worker(steps: int, global_batch: int, micro: int) -> dict[str, Any]:
    accumulation = accumulation_module()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    per_rank = global_batch // world_size
    # a tiny bucket cap gives several buckets, so "once per bucket" is visible
    ddp = DistributedDataParallel(small_mlp(), bucket_cap_mb=0.0005)
    count = accumulation.AllReduceCount()
    ddp.register_comm_hook(count, accumulation.counting_allreduce_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    # DDP's first iteration uses one provisional bucket and rebuilds them afterwards: warm up
    # with a backward that does not step, so every counted step sees the final buckets
    x, y = batch(global_batch, seed=99)
    nn.functional.cross_entropy(ddp(x[:per_rank]), y[:per_rank]).backward()
    optimizer.zero_grad()
    calls_per_step = []
    for step in range(steps):
        x, y = batch(global_batch, seed=step)
        shard = slice(rank * per_rank, (rank + 1) * per_rank)
        before = count.calls
        accumulation.ddp_accumulation_step(
            ddp, optimizer, nn.functional.cross_entropy, x[shard], y[shard], micro
        )
        calls_per_step.append(count.calls - before)
    # one plain step (no accumulation) shows how many buckets DDP has
    before = count.calls
    optimizer.zero_grad()
    nn.functional.cross_entropy(ddp(x[shard]), y[shard]).backward()
    buckets = count.calls - before
    return {"params": params_of(ddp.module), "calls": calls_per_step, "buckets": buckets}


@exercise("2.1")
def test_ddp_no_sync_accumulation_equals_one_big_batch() -> None:
    steps = 3
    want = full_batch_reference(12, steps)
    for rank, result in enumerate(world(ddp_accumulation_worker, 2, steps, 12, 2)):
        assert_params_close(result["params"], want, f"2.1 DDP rank {rank}, 3 micro-batches")
        buckets = result["buckets"]
        assert buckets > 1, "test setup: expected several DDP buckets"
        assert result["calls"] == [buckets] * steps, (
            f"2.1: DDP launched {result['calls']} bucket all-reduces per optimizer step with 3 "
            f"micro-batches; expected {buckets} (one per bucket): use no_sync() for all but the "
            "last micro-batch"
        )


def accumulation_main_worker() -> int:
    return int(
        accumulation_module().main(
            ["--epochs", "1", "--train-samples", "512", "--global-batch-size", "128"]
        )
    )


@exercise("2.1")
def test_accumulation_instructor_command_runs() -> None:
    assert world(accumulation_main_worker, 2) == [0, 0]


# ============================================================================ 2.2 mixed precision

OVERFLOW_STEPS = {2, 3, 9, 16}


def run_scaler_stream(scaler: Any, steps: int) -> tuple[list[float], list[bool], torch.Tensor]:
    """Feed a scaler a gradient stream with overflows; return scales, step decisions, weights."""
    param = nn.Parameter(torch.linspace(-1, 1, 5))
    optimizer = torch.optim.SGD([param], lr=0.01, momentum=0.9)
    scales, stepped = [], []
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        optimizer.zero_grad()
        direction = torch.randn(5, generator=g)
        if step in OVERFLOW_STEPS:
            direction[step % 5] = float("inf") if step % 2 else float("nan")
        scaler.scale((param * direction).sum()).backward()
        before = param.detach().clone()
        scaler.step(optimizer)
        stepped.append(not torch.equal(before, param.detach()))
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, stepped, param.detach()


@exercise("2.2")
def test_loss_scaler_follows_grad_scaler() -> None:
    precision = precision_module()
    kwargs: dict[str, Any] = {
        "init_scale": 2.0**10,
        "growth_factor": 2.0,
        "backoff_factor": 0.25,
        "growth_interval": 3,
    }
    ours = run_scaler_stream(precision.DynamicLossScaler(**kwargs), 24)
    theirs = run_scaler_stream(torch.amp.GradScaler("cpu", **kwargs), 24)
    assert ours[0] == theirs[0], (
        f"2.2: scale sequence with overflows at steps {sorted(OVERFLOW_STEPS)} and growth_interval"
        f" 3:\n  expected {theirs[0]}\n  got      {ours[0]}"
    )
    skipped_ours = [i for i, s in enumerate(ours[1]) if not s]
    skipped_theirs = [i for i, s in enumerate(theirs[1]) if not s]
    assert skipped_ours == skipped_theirs, (
        f"2.2: skipped steps {skipped_ours}, GradScaler skipped {skipped_theirs}"
    )
    assert torch.equal(ours[2], theirs[2]), (
        f"2.2: weights after the stream differ from GradScaler's by "
        f"{(ours[2] - theirs[2]).abs().max():.2e}: unscale with (1/scale computed in float64)"
    )


def one_rank_overflows_worker() -> dict[str, Any]:
    precision = precision_module()
    rank = dist.get_rank()
    torch.manual_seed(rank)  # model-parallel style: each rank owns different parameters
    param = nn.Parameter(torch.randn(4))
    optimizer = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    scaler = precision.DynamicLossScaler(init_scale=256.0, growth_interval=2)
    history = []
    for step in range(4):
        optimizer.zero_grad()
        direction = torch.ones(4)
        if step == 1 and rank == 1:
            direction[0] = float("inf")
        before = (param.detach().clone(), {k: v.clone() for k, v in optimizer.state[param].items()})
        scaler.scale((param * direction).sum()).backward()
        stepped = scaler.step(optimizer)
        unchanged = torch.equal(before[0], param.detach()) and all(
            torch.equal(v, optimizer.state[param][k]) for k, v in before[1].items()
        )
        scaler.update()
        history.append((bool(stepped), unchanged, scaler.get_scale()))
    return {"history": history}


@exercise("2.2")
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank() -> None:
    for rank, result in enumerate(world(one_rank_overflows_worker, 2)):
        stepped, unchanged, scale = result["history"][1]
        assert not stepped and unchanged, (
            f"2.2: rank 1 overflowed at step 1; rank {rank} {'stepped' if stepped else 'skipped'}"
            f" and its weights/optimizer state {'stayed' if unchanged else 'changed'}: all ranks "
            "must agree (all-reduce the overflow flag with MAX) and leave everything unchanged"
        )
        assert scale == 128.0, (
            f"2.2: rank {rank}'s scale after the overflow is {scale}, expected 128"
        )
        assert [h[0] for h in result["history"]] == [True, False, True, True]


@exercise("2.2")
def test_clipping_sees_unscaled_gradients_like_the_grad_scaler_recipe() -> None:
    precision = precision_module()
    x, y = batch(16)
    ours_model, ref_model = small_mlp().float(), small_mlp().float()
    ours_opt = torch.optim.SGD(ours_model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.5)
    scaler = precision.DynamicLossScaler(init_scale=2.0**12)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    for _ in range(3):
        loss, stepped = precision.mixed_precision_step(
            ours_model, ours_opt, nn.functional.cross_entropy, x.float(), y, scaler, None, 0.05
        )
        ref_opt.zero_grad()
        ref_loss = nn.functional.cross_entropy(ref_model(x.float()), y)
        ref_scaler.scale(ref_loss).backward()
        ref_scaler.unscale_(ref_opt)
        nn.utils.clip_grad_norm_(ref_model.parameters(), 0.05)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        assert stepped and loss == pytest.approx(ref_loss.item(), rel=1e-6)
    for (name, p), q in zip(ours_model.named_parameters(), ref_model.parameters(), strict=True):
        diff = (p - q).abs().max().item()
        assert diff < 1e-6, (
            f"2.2: after 3 clipped steps {name} differs from GradScaler's recipe (unscale_, "
            f"clip, step) by {diff:.2e}: clip after unscaling"
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
        assert master.master_params[0].dtype == torch.float32, "2.2: masters must stay fp32"
        assert torch.equal(model.weight, master.master_params[0].to(torch.bfloat16)), (
            "2.2: after a step the bf16 weights must equal the fp32 masters cast to bf16"
        )
    got = master.master_params[0][0, 0].item()
    assert got == pytest.approx(0.99, abs=1e-6), (
        f"2.2: ten updates of -0.001 on 1.0 should leave the master at 0.99, got {got} "
        "(bf16 alone rounds each update away: its neighbours of 1.0 are 0.99609375 and 1.0078125)"
    )
    assert model.weight[0, 0].item() == 0.98828125, "2.2: the bf16 copy of 0.99 is 0.98828125"


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
    from solutions.common.models import MLP

    config = LoopConfig(epochs=2, global_batch_size=64, train_samples=1536, test_samples=512)
    summaries = train_data_parallel(MLP(256), step, config, current_info())
    return {"loss": summaries[-1].loss, "accuracy": summaries[-1].test_accuracy}


@exercise("2.2")
def test_bf16_training_ends_close_to_fp32() -> None:
    fp32 = world(precision_training_worker, 2, "fp32")[0]
    bf16 = world(precision_training_worker, 2, "bf16")[0]
    assert bf16["accuracy"] > 0.3, f"2.2: bf16 training reached only {bf16['accuracy']:.2f}"
    assert abs(bf16["accuracy"] - fp32["accuracy"]) <= 0.05, (
        f"2.2: bf16 test accuracy {bf16['accuracy']:.3f} vs fp32 {fp32['accuracy']:.3f}: "
        "the stated tolerance is 5 points"
    )
    assert bf16["loss"] == pytest.approx(fp32["loss"], rel=0.1), (
        f"2.2: bf16 final loss {bf16['loss']:.4f} vs fp32 {fp32['loss']:.4f} (tolerance 10%)"
    )


# ============================================================================ 2.3 checkpointing


def deep_dropout_mlp(depth: int = 6, width: int = 32) -> nn.Sequential:
    torch.manual_seed(3)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.2)]
    return nn.Sequential(*layers).double()


def grads_after(model: nn.Module, forward: Any) -> tuple[torch.Tensor, list[torch.Tensor], float]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(11)
    out = forward()
    out.square().mean().backward()
    after = torch.rand(1).item()  # the RNG stream after forward and backward
    return out.detach(), [p.grad.clone() for p in model.parameters()], after  # type: ignore[union-attr]


@exercise("2.3")
@pytest.mark.parametrize("segments", [2, 3, 7, 18])
def test_checkpointed_gradients_equal_the_plain_model_bitwise_with_dropout(segments: int) -> None:
    checkpointing = checkpointing_module()
    model = deep_dropout_mlp()
    x = torch.randn(5, 32, dtype=torch.float64)  # does not require grad
    out, grads, after = grads_after(model, lambda: model(x))
    ck_out, ck_grads, ck_after = grads_after(
        model, lambda: checkpointing.checkpoint_sequential(model, segments, x)
    )
    assert torch.equal(out, ck_out), f"2.3: {segments} segments: the output differs"
    for index, (a, b) in enumerate(zip(grads, ck_grads, strict=True)):
        assert torch.equal(a, b), (
            f"2.3: {segments} segments: gradient of parameter {index} is not bitwise equal to the "
            f"plain model's (max diff {(a - b).abs().max():.2e}); is the RNG state restored "
            "before recomputing, so dropout draws the same masks?"
        )
    assert after == ck_after, (
        "2.3: the RNG stream after backward differs from the plain run: restore the state "
        "inside torch.random.fork_rng so the caller's stream is untouched"
    )


def peak_saved(model: nn.Module, run: Any) -> int:
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
        assert ours == torch_reentrant == torch_hooks, (
            f"2.3: {segments} segments: peak saved bytes {ours} (= {ours / activation:g} "
            f"activations); torch.utils.checkpoint keeps {torch_reentrant} "
            f"(= {torch_reentrant / activation:g}). Save only each segment's input."
        )
        bound = (segments + depth // segments + 1) * activation
        assert ours <= bound, (
            f"2.3: {segments} segments of {depth} layers kept {ours / activation:g} activations "
            f"at peak; theory allows k + n/k + 1 = {bound / activation:g}"
        )
        peaks[segments] = ours
    for bad in (0, len(model) + 1):
        with pytest.raises(ValueError, match=f"segments={bad}"):
            checkpointing.checkpoint_sequential(model, bad, x)
    best = min(peaks, key=lambda k: peaks[k])
    assert best == math.isqrt(depth), (
        f"2.3: the smallest peak should be at sqrt({depth}) = {math.isqrt(depth)} segments; "
        f"peaks in activations: { {k: v / activation for k, v in peaks.items()} }"
    )
    assert peaks[4] <= plain / 2


def checkpoint_ddp_worker() -> list[torch.Tensor]:
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
        (a.grad - b.grad).abs().max()  # type: ignore[operator]
        for a, b in zip(ddp.parameters(), plain.parameters(), strict=True)
    ]


@exercise("2.3")
def test_checkpointed_model_trains_under_ddp() -> None:
    for rank, diffs in enumerate(world(checkpoint_ddp_worker, 2)):
        worst = max(float(d) for d in diffs)
        assert worst < 1e-12, (
            f"2.3: rank {rank}: DDP gradients with checkpointing differ from plain DDP by {worst:.2e}"
        )


# ============================================================================ 2.4-2.6
# Model, pipeline and tensor parallelism are graded in their own modules (small files); their
# tests are imported here so that `uv run pytest tests/test_phase2.py` grades the whole phase.
from grade_phase2_parallel import *  # noqa: E402, F403
from grade_phase2_pipeline import *  # noqa: E402, F403

