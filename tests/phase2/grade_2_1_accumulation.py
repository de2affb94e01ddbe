"""Grader of exercise 2.1, gradient accumulation: ``uv run pytest tests/test_phase2.py -m ex2_1``.

Every check compares with one process taking one step on the whole batch (float64, to 1e-12),
and looks at the shape of the work: the model must run once per micro-batch, on that micro-batch
only (a forward hook records the batch sizes it sees), and the gradients must be all-reduced once
per optimizer step, on the data-parallel group only.
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
from torch.nn.parallel import DistributedDataParallel

from course.comm_counter import CommCounter

TOLERANCE = 1e-12


def accumulation_module() -> Any:
    return module("gradient_accumulation")


def small_mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()


PARAMETER_TENSORS = 4  # small_mlp(): two Linear layers, a weight and a bias each


def batch(samples: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(samples, 6, generator=g, dtype=torch.float64), torch.randint(
        3, (samples,), generator=g
    )


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def record_batch_sizes(model: nn.Module) -> list[int]:
    """Append the batch size of every forward of ``model``'s first layer to the returned list."""
    sizes: list[int] = []
    first = next(m for m in model.modules() if isinstance(m, nn.Linear))
    first.register_forward_hook(lambda _module, inputs, _output: sizes.append(len(inputs[0])))
    return sizes


def expected_sizes(samples: int, micro: int) -> list[int]:
    return [min(micro, samples - start) for start in range(0, samples, micro)]


def full_batch_reference(samples: int, steps: int, seed_offset: int = 0) -> dict[str, torch.Tensor]:
    return full_batch_steps(samples, steps, seed_offset)[-1]


def full_batch_steps(
    samples: int, steps: int, seed_offset: int = 0
) -> list[dict[str, torch.Tensor]]:
    """The parameters of one process stepping on the whole batch, after each step."""
    model = small_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    after = []
    for step in range(steps):
        x, y = batch(samples, seed=step + seed_offset)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        after.append(params_of(model))
    return after


def check_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    for name, ref in want.items():
        diff = (got[name] - ref).abs().max().item()
        if diff > TOLERANCE:
            fail(
                f"{what}: {name} differs from one process stepping on the whole batch by "
                f"{diff:.3e}. The micro-batches (and, data-parallel, the all-reduces) were "
                "checked before this and are right, so the usual cause is the weighting: weight "
                "each micro-batch's mean loss by its share of the samples, not equally (or "
                ".grad cleared between the micro-batches of one step, so that only the last "
                "one counts)"
            )


def check_sizes(got: list[int], want: list[int], what: str) -> None:
    if got != want:
        fail(
            f"{what}: the model ran forward on batches of {got}; expected {want}, one forward "
            "and backward per micro-batch, on that micro-batch only (that is what keeps one "
            "micro-batch's activations alive instead of the whole batch's)"
        )


# ----------------------------------------------------------------------------- one process


# micro-batches of 4 first: from 10 samples they are 4 + 4 + 2, where the plain mean, the sum
# and every other weighting of the micro-batches' means differ (at 1 the plain mean is right and
# a sum is also a sum of samples' losses; at 10 and 12 there is one micro-batch)
MICRO_BATCH_SIZES = (4, 1, 10, 12)
SAMPLES = 10


def micro_batch_means(micro_batch_size: int) -> tuple[float, list[float]]:
    """The batch's mean loss under the reference model, and each micro-batch's mean loss."""
    x, y = batch(SAMPLES)
    reference = small_mlp()
    with torch.no_grad():
        want = nn.functional.cross_entropy(reference(x), y).item()
        means = [
            nn.functional.cross_entropy(reference(x[i : i + micro_batch_size]),
                                        y[i : i + micro_batch_size]).item()
            for i in range(0, SAMPLES, micro_batch_size)
        ]  # fmt: skip
    return want, means


def loss_verdict(micro_batch_size: int, loss: Any) -> str | None:
    """What is wrong with accumulate_gradients' returned loss, None when it is the batch's mean.
    A weighting is named only when the loss is that weighting's and the batch's mean is not."""
    want, means = micro_batch_means(micro_batch_size)
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        loss = loss.item()  # judged by its value, as before: the contract's type is float
    if not isinstance(loss, (int, float)):
        return f"returned {loss!r} ({type(loss).__name__}); expected the batch's mean loss, {want}"
    if loss == pytest.approx(want, rel=1e-12):
        return None
    if loss == pytest.approx(sum(means) / len(means), rel=1e-9):
        advice = (
            ": that is the plain mean of the micro-batches' means, which over-weights the "
            f"short last one; weight each by its samples / {SAMPLES}"
        )
    elif loss == pytest.approx(sum(means), rel=1e-9):
        advice = ": that is the sum of the micro-batches' means, each unweighted"
    else:
        advice = (
            f": {loss / want:.4g} times it; weight each micro-batch's mean by its samples / "
            f"{SAMPLES}"
        )
    return f"returned loss {loss}, the batch's mean loss is {want}{advice}"


@exercise("2.1")
@pytest.mark.parametrize("micro_batch_size", MICRO_BATCH_SIZES)
def test_accumulated_gradient_equals_one_big_batch(micro_batch_size: int) -> None:
    accumulation = accumulation_module()
    x, y = batch(10)  # micro-batches of 4 leave a short last one of 2
    model, reference = small_mlp(), small_mlp()
    nn.functional.cross_entropy(reference(x), y).backward()
    micro_batches = accumulation.split_micro_batches(x, y, micro_batch_size)
    sizes = record_batch_sizes(model)
    loss = accumulation.accumulate_gradients(model, nn.functional.cross_entropy, micro_batches)
    where = f"2.1 accumulate_gradients, micro-batches of {micro_batch_size} from 10 samples"
    check_sizes(sizes, expected_sizes(10, micro_batch_size), where)
    verdict = loss_verdict(micro_batch_size, loss)
    if verdict:
        fail(f"{where}: {verdict}")
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        if p.grad is None:
            fail(f"{where}: {name} has no gradient after accumulation")
        assert q.grad is not None
        diff = (p.grad - q.grad).abs().max().item()
        if diff > TOLERANCE:
            fail(
                f"{where}: {name}.grad differs from one backward on all 10 samples by "
                f"{diff:.2e}; weight each micro-batch's mean loss by its samples / 10 (dividing "
                "by the number of micro-batches over-weights the short last one)"
            )
    with pytest.raises(ValueError, match="micro_batch_size=0"):
        accumulation.split_micro_batches(x, y, 0)


# ----------------------------------------------------------------------------- data parallel


def accumulation_dp_worker(
    steps: int, global_batch: int, micro: int, group_size: int = 0
) -> dict[str, Any]:
    """Train with accumulation_step(data_parallel=True) on the world or on a subgroup."""
    accumulation = accumulation_module()
    info = split_into_groups(group_size) if group_size else None
    group = info.group if info else None
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    seed_offset = 100 * info.index if info else 0  # each group trains on its own data
    model = small_mlp()
    sizes = record_batch_sizes(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    per_rank = global_batch // size
    after: list[dict[str, torch.Tensor]] = []
    with CommCounter() as comm:
        for step in range(steps):
            x, y = batch(global_batch, seed=step + seed_offset)
            shard = slice(rank * per_rank, (rank + 1) * per_rank)
            kwargs = {"group": group} if info else {}
            accumulation.accumulation_step(
                model,
                optimizer,
                nn.functional.cross_entropy,
                x[shard],
                y[shard],
                micro,
                data_parallel=True,
                **kwargs,
            )
            after.append(params_of(model))
    return {
        "params": params_of(model),
        "after": after,
        "all_reduces": comm.count("all_reduce"),
        "sizes": sizes,
        "crossing": crossing_message(comm, info) if info else None,
        "index": info.index if info else 0,
    }


def all_reduce_advice(
    made: int, steps: int, micro_batches: int, per_step: int = 1, tensors: int = 0
) -> str:
    """What a wrong count of all-reduces says, from the count itself; ``tensors``: the model's
    parameter tensors (a count that is one per tensor per step, or per micro-batch, says so)."""
    if made == 0:
        return "none at all: the gradients were never averaged across the ranks"
    if made == steps * micro_batches * per_step:
        return "that is one per micro-batch: average once per step, after the last micro-batch"
    if tensors and made in (steps * tensors, steps * micro_batches * tensors):
        when = "step" if made == steps * tensors else "micro-batch"
        return (
            f"that is one per parameter tensor ({tensors}) each {when}: average once per step, "
            "all of the gradients in one all-reduce (phase 1's average_gradients)"
        )
    return f"that is {made / steps:g} per step: average once per step, after the last micro-batch"


def check_data_parallel(results: list[dict[str, Any]], steps: int, label: str) -> None:
    for rank, result in enumerate(results):
        check_sizes(result["sizes"], [4, 2] * steps, f"{label}, rank {rank}")
        if result["all_reduces"] != steps:
            fail(
                f"{label}: {steps} optimizer steps of 2 micro-batches made "
                f"{result['all_reduces']} all-reduces on rank {rank}; expected {steps}: "
                + all_reduce_advice(result["all_reduces"], steps, 2, tensors=PARAMETER_TENSORS)
            )
        wants = full_batch_steps(12, steps, 100 * result["index"])
        where = f"{label}, rank {rank}, 2 ranks x (4 + 2 samples)"
        first_wrong = next(
            (
                step
                for step, (got, want) in enumerate(zip(result["after"], wants, strict=True))
                if any((got[n] - want[n]).abs().max().item() > TOLERANCE for n in want)
            ),
            None,
        )
        if first_wrong is not None and first_wrong > 0:
            fail(
                f"{where}: after step {first_wrong - 1} the weights equal one process stepping "
                f"on the whole batch, after step {first_wrong} they differ: the gradients that "
                f"step {first_wrong} applied are not that step's alone (backward adds into "
                ".grad, and the previous step's gradients are still there when a step starts)"
            )
        check_params(result["params"], wants[-1], where)


@exercise("2.1")
def test_data_parallel_accumulation_all_reduces_once_per_step() -> None:
    steps = 3
    results = small_world(accumulation_dp_worker, 2, steps, 12, 4)
    check_data_parallel(results, steps, "2.1 accumulation_step(data_parallel=True)")


@exercise("2.1")
def test_data_parallel_accumulation_stays_inside_its_group() -> None:
    steps = 3
    results = small_world(accumulation_dp_worker, SUBGROUP_WORLD, steps, 12, 4, SUBGROUP_SIZE)
    label = "2.1 accumulation_step(data_parallel=True, group=...) on two groups of 2"
    fail_on_crossing(label, results)
    check_data_parallel(results, steps, label)


# ----------------------------------------------------------------------------- DDP


def ddp_accumulation_worker(steps: int, global_batch: int, micro: int) -> dict[str, Any]:
    accumulation = accumulation_module()
    demo = demo_module("demos.accumulation")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    per_rank = global_batch // world_size
    # a tiny bucket cap gives several buckets, so "once per bucket" is visible
    ddp = DistributedDataParallel(small_mlp(), bucket_cap_mb=0.0005)
    count = demo.AllReduceCount()
    ddp.register_comm_hook(count, demo.counting_allreduce_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    # DDP's first iteration uses one provisional bucket and rebuilds them afterwards: warm up
    # with a backward that does not step, so every counted step sees the final buckets
    x, y = batch(global_batch, seed=99)
    nn.functional.cross_entropy(ddp(x[:per_rank]), y[:per_rank]).backward()
    optimizer.zero_grad()
    sizes = record_batch_sizes(ddp.module)
    calls_per_step = []
    for step in range(steps):
        x, y = batch(global_batch, seed=step)
        shard = slice(rank * per_rank, (rank + 1) * per_rank)
        before = count.calls
        accumulation.ddp_accumulation_step(
            ddp, optimizer, nn.functional.cross_entropy, x[shard], y[shard], micro
        )
        calls_per_step.append(count.calls - before)
    counted_sizes = list(sizes)
    # one plain step (no accumulation) shows how many buckets DDP has
    before = count.calls
    optimizer.zero_grad()
    nn.functional.cross_entropy(ddp(x[shard]), y[shard]).backward()
    buckets = count.calls - before
    return {
        "params": params_of(ddp.module),
        "calls": calls_per_step,
        "buckets": buckets,
        "sizes": counted_sizes,
    }


NO_SYNC_MICRO_BATCHES = 3  # 5 samples per rank in micro-batches of 2 + 2 + 1


def no_sync_verdict(calls: list[int], buckets: int, micro_batches: int) -> str | None:
    """What DDP's bucket all-reduces per optimizer step say, None when each step launched one per
    bucket. DDP decides at a micro-batch's forward whether its backward all-reduces, so a step
    launches ``buckets`` per micro-batch whose forward ran outside no_sync(): none (every one
    inside) and every one (no forward inside: nothing wrapped, or only the backwards) are told
    as such; any other count is described."""
    if calls == [buckets] * len(calls):
        return None
    if not any(calls):
        advice = (
            "none at all: the last micro-batch (its forward and backward) must run "
            "outside no_sync(), so that its backward all-reduces the accumulated sum"
        )
    elif all(c == micro_batches * buckets for c in calls):
        advice = (
            f"that is one per micro-batch ({micro_batches} x {buckets}): no micro-batch's "
            "forward ran inside no_sync() (none was wrapped, or only its backward was: DDP "
            "decides at the forward); run every micro-batch but the last, forward and backward, "
            "inside no_sync()"
        )
    else:
        times = ", ".join(f"{c / buckets:g}" for c in calls)
        advice = (
            f"{times} times the bucket count, step by step; run every micro-batch but the last, "
            "forward and backward, inside no_sync()"
        )
    return (
        f"DDP launched {calls} bucket all-reduces per optimizer step; expected {buckets} (one "
        f"per bucket): {advice}"
    )


@exercise("2.1")
def test_ddp_no_sync_accumulation_equals_one_big_batch() -> None:
    steps = 3
    want = full_batch_reference(10, steps)
    label = "2.1 ddp_accumulation_step, 2 ranks x 5 samples in micro-batches of 2 + 2 + 1"
    for rank, result in enumerate(small_world(ddp_accumulation_worker, 2, steps, 10, 2)):
        check_sizes(result["sizes"], [2, 2, 1] * steps, f"{label}, rank {rank}")
        buckets = result["buckets"]
        assert buckets > 1, "test setup: expected several DDP buckets"
        said = no_sync_verdict(result["calls"], buckets, NO_SYNC_MICRO_BATCHES)
        if said:
            fail(f"{label}: {said} (rank {rank})")
        check_params(result["params"], want, f"{label}, rank {rank}")


# ----------------------------------------------------------------------------- the demo


def accumulation_demo_worker(impl_args: list[str]) -> int:
    demo = demo_module("demos.accumulation")
    args = ["--epochs", "1", "--train-samples", "512", "--global-batch-size", "128"]
    return int(demo.main([*args, *impl_args]))


@exercise("2.1")
def test_accumulation_demo_runs_on_two_ranks() -> None:
    codes = small_world(accumulation_demo_worker, 2, impl_flag())
    if codes != [0, 0]:
        fail(f"2.1: accumulation_demo exited with {codes} on 2 ranks; expected [0, 0]")


@exercise("2.1")
@pytest.mark.reference
def test_accumulation_demo_refuses_bad_flags_all_at_once() -> None:
    demo = demo_module("demos.accumulation")
    config = demo.AccumulationConfig(global_batch_size=100, micro_batch_size=0)
    with pytest.raises(ValueError) as caught:
        demo.validate(config, 3)
    message = str(caught.value)
    for word in ("--micro-batch-size 0", "--global-batch-size", "100"):
        assert word in message, f"the refusal should name {word!r}: {message}"
