"""Exercise 1.2, broadcast and gradient averaging: N ranks step like one process on the union.

``broadcast_parameters`` copies parameters and buffers in place; ``average_gradients`` leaves the
mean over ranks; ``data_parallel_step`` matches one process on the whole batch and
``DistributedDataParallel``, and splits its time correctly: a slow forward or optimizer step lands
in ``compute_seconds``, a slow all-reduce in ``communication_seconds``. Each also runs inside the
groups (0, 1) and (2, 3) of a world of 4, at the same time, and must match a world of 2.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from grading import exercise
from phase1_helpers import (
    fail,
    first_problems,
    only_inside,
    run_in_subgroups,
    small_world,
    trainer_module,
)
from subgroups import SubgroupInfo
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class ToyNet(nn.Module):
    """A float64 MLP with a frozen layer, a parameter no forward uses, and a buffer."""

    scale: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(8, 3)
        self.unused = nn.Linear(8, 8)  # requires grad, never receives one
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.embed(x))
        hidden = torch.tanh(self.frozen(hidden)) * self.scale
        return self.head(hidden)


REDUCED = ["embed.weight", "embed.bias", "head.weight", "head.bias"]


def make_toy(seed: int) -> ToyNet:
    torch.manual_seed(seed)
    return ToyNet().double()


def global_batches(
    steps: int, batch: int, seed: int = 99
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(batch, 6, generator=g, dtype=torch.float64),
            torch.randint(3, (batch,), generator=g),
        )
        for _ in range(steps)
    ]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


# ============================================================================ broadcast


def broadcast_worker() -> dict[str, Any]:
    trainer = trainer_module()
    model = make_toy(seed=100 + dist.get_rank())  # deliberately different on each rank
    model.scale.fill_(float(dist.get_rank() + 2))
    params_before = list(model.parameters())
    trainer.broadcast_parameters(model, src=1)
    in_place = all(a is b for a, b in zip(params_before, model.parameters(), strict=True))
    return {"state": {k: v.clone() for k, v in model.state_dict().items()}, "in_place": in_place}


@exercise("1.2")
def test_broadcast_parameters_copies_parameters_and_buffers_from_src() -> None:
    results = small_world(broadcast_worker, 3)
    expected = make_toy(seed=101).state_dict()
    expected["scale"] = torch.full((8,), 3.0, dtype=torch.float64)
    for rank, result in enumerate(results):
        if not result["in_place"]:
            fail(
                f"1.2: broadcast_parameters replaced rank {rank}'s Parameter objects; it must "
                "update them in place (the optimizer holds references to them)"
            )
        for name, value in expected.items():
            if not torch.equal(result["state"][name], value):
                what = "buffer" if name == "scale" else "parameter"
                fail(
                    f"1.2: after broadcast_parameters(model, src=1) on 3 ranks, rank {rank}'s "
                    f"{what} {name} should equal rank 1's bitwise; it differs by "
                    f"{max_diff(result['state'][name], value):.3e} (broadcast parameters AND "
                    "buffers, from src)"
                )


# ============================================================================ averaging


def set_rank_grads(model: ToyNet, value: float) -> None:
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.full_like(p, value)
    model.unused.weight.grad = None
    model.unused.bias.grad = None


def average_worker() -> tuple[dict[str, torch.Tensor | None], int]:
    trainer = trainer_module()
    model = make_toy(seed=0)
    set_rank_grads(model, float(dist.get_rank() + 1))
    nbytes = trainer.average_gradients(model)
    grads = {
        n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()
    }
    return grads, nbytes


# what a realistic averaging mistake leaves, as got / mean, for a group of ``ranks`` in
# ``world``: the words that name it, the shorter ones that list it, the ratio it gives
AVERAGING_MISTAKES: list[tuple[str, str, Callable[[int, int], float]]] = [
    ("the sum: divide by the number of ranks", "the sum", lambda ranks, world: float(ranks)),
    (
        "divided by the world's size instead of the group's: dist.get_world_size(group)",
        "a division by the world's size",
        lambda ranks, world: ranks / world,
    ),
    (
        "divided by the number of ranks twice: divide once, after the all-reduce",
        "two divisions by the group's size",
        lambda ranks, world: 1 / ranks,
    ),
]


def averaging_remark(seen: list[tuple[float, int, int]]) -> str:
    """Why averaged gradients are off, from what was seen: (got / mean, ranks, world) for each
    averaging measured in one run. A mistake is named only when it alone fits every
    observation; several that fit are listed; none: the ratio is said."""
    if not seen or any(not math.isfinite(ratio) for ratio, _, _ in seen):
        return ""
    fits = [
        (words, short)
        for words, short, predicted in AVERAGING_MISTAKES
        if all(math.isclose(ratio, predicted(r, w), rel_tol=1e-9) for ratio, r, w in seen)
        and any(predicted(r, w) != 1 for _, r, w in seen)
    ]
    if len(fits) == 1:
        return f" ({fits[0][0]})"
    ratio = seen[0][0]
    if fits:
        listed = " or ".join(short for _, short in fits)
        return f" ({ratio:g} times the mean, which each of these gives here: {listed})"
    return f" ({ratio:g} times the mean)"


def check_mean(
    grads: dict[str, torch.Tensor | None],
    mean: float,
    where: str,
    ranks: int,
    world: int,
    whole_world: float | None = None,
) -> list[str]:
    """Problems with one rank's averaged gradients (the first bad parameter only).
    ``whole_world``: got / mean of an averaging over the whole world in the same run."""
    problems = []
    for name in REDUCED:
        grad = grads[name]
        if grad is None or not torch.allclose(grad, torch.full_like(grad, mean)):
            got = None if grad is None else grad.flatten()[:3].tolist()
            seen = [(got[0] / mean, ranks, world)] if got else []
            if seen and whole_world is not None:
                seen.append((whole_world, world, world))
            problems.append(
                f"{where}: {name}.grad should be the mean {mean:g} of the ranks' gradients, "
                f"got {got}{averaging_remark(seen)}"
            )
            break
    for name in ("frozen.weight", "unused.weight"):
        if grads[name] is not None:
            problems.append(f"{where}: {name} had no gradient and must keep none (.grad is None)")
    return problems


@exercise("1.2")
@pytest.mark.parametrize("world_size", [2, 4])
def test_average_gradients_is_the_mean_over_ranks(world_size: int) -> None:
    mean = (world_size + 1) / 2  # mean of 1..world_size
    expected_bytes = sum(make_toy(0).get_parameter(n).numel() for n in REDUCED) * 8
    problems = []
    for rank, (grads, nbytes) in enumerate(small_world(average_worker, world_size)):
        problems += check_mean(grads, mean, f"rank {rank}", world_size, world_size)
        if nbytes != expected_bytes:
            problems.append(
                f"rank {rank}: average_gradients should return {expected_bytes} (the bytes of "
                f"the float64 gradients that exist, handed to the all-reduce), got {nbytes}"
            )
    first_problems(
        problems, f"1.2 average_gradients on {world_size} ranks, rank r's gradients all r+1:"
    )


class MixedNet(nn.Module):
    """Gradients in two dtypes: a float64 layer and a float32 layer (no forward needed)."""

    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.Linear(5, 4).double()
        self.narrow = nn.Linear(4, 3)  # float32


def buffers_worker() -> list[dict[str, Any]]:
    """What average_gradients hands to all_reduce_fn, for ToyNet (one dtype) and MixedNet."""
    trainer = trainer_module()
    handed: list[tuple[str, int]] = []

    def recording_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        handed.append((str(tensor.dtype).removeprefix("torch."), tensor.numel()))
        return dist.all_reduce(tensor, *args, **kwargs)

    runs = []
    for model in (make_toy(seed=0), MixedNet()):
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.full_like(p, float(dist.get_rank() + 1))
        if isinstance(model, ToyNet):
            model.unused.weight.grad = None
            model.unused.bias.grad = None
        handed.clear()
        nbytes = trainer.average_gradients(model, recording_all_reduce)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        runs.append(
            {
                "model": type(model).__name__,
                "handed": list(handed),
                "nbytes": nbytes,
                "tensors": len(grads),
                "by_dtype": {
                    str(dtype).removeprefix("torch."): sum(
                        g.numel() for g in grads if g.dtype == dtype
                    )
                    for dtype in {g.dtype for g in grads}
                },
                "bytes": sum(g.numel() * g.element_size() for g in grads),
                "means": all(torch.allclose(g, torch.full_like(g, 1.5)) for g in grads),
            }
        )
    return runs


@exercise("1.2")
def test_average_gradients_hands_over_one_buffer_per_dtype() -> None:
    problems = []
    for run in small_world(buffers_worker, 2)[0]:
        where = (
            f"{run['model']} ({run['tensors']} gradient tensors: "
            + ", ".join(f"{n} {dtype} values" for dtype, n in sorted(run["by_dtype"].items()))
            + ")"
        )
        handed = ", ".join(f"{n} {dtype}" for dtype, n in run["handed"])
        dtypes = len(run["by_dtype"])
        if len(run["handed"]) > dtypes:
            problems.append(
                f"{where}: average_gradients called all_reduce_fn {len(run['handed'])} times "
                f"({handed}); each call costs one message latency, and one call can carry every "
                f"gradient of one dtype: {dtypes} call(s)"
            )
        elif sorted(run["handed"]) != sorted(run["by_dtype"].items()):
            problems.append(
                f"{where}: all_reduce_fn was handed {handed}; each dtype's gradients travel in "
                "their own dtype (a float32 gradient widened to float64 doubles its bytes on the "
                "wire, and tensors of two dtypes cannot share one buffer without that)"
            )
        if run["nbytes"] != run["bytes"]:
            problems.append(
                f"{where}: average_gradients returned {run['nbytes']}, but the gradients that "
                f"exist hold {run['bytes']} bytes, which is what it hands to all_reduce_fn"
            )
        if not run["means"]:
            problems.append(f"{where}: the gradients are not the mean 1.5 of 1 and 2 afterwards")
    first_problems(problems, "1.2 average_gradients on 2 ranks, rank r's gradients all r+1:")


# ============================================================================ the DP step

STEPS, GLOBAL_BATCH = 4, 12


def dp_step_worker(compare_ddp: bool) -> dict[str, object]:
    trainer = trainer_module()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    per_rank = GLOBAL_BATCH // world_size
    model = make_toy(seed=5 + rank)  # rank 0's weights reach everyone through the broadcast
    trainer.broadcast_parameters(model, src=0)
    ddp_model = DistributedDataParallel(make_toy(seed=5), find_unused_parameters=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ddp_optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    losses, ddp_losses = [], []
    for inputs, targets in global_batches(STEPS, GLOBAL_BATCH):
        shard = slice(rank * per_rank, (rank + 1) * per_rank)
        stats = trainer.data_parallel_step(model, optimizer, loss_fn, inputs[shard], targets[shard])
        losses.append(stats.loss)
        if compare_ddp:
            ddp_optimizer.zero_grad(set_to_none=True)
            ddp_loss = loss_fn(ddp_model(inputs[shard]), targets[shard])
            ddp_loss.backward()
            ddp_optimizer.step()
            ddp_losses.append(ddp_loss.item())
    return {
        "losses": losses,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "ddp_params": {n: p.detach().clone() for n, p in ddp_model.module.named_parameters()},
        "ddp_losses": ddp_losses,
    }


def single_process_reference(
    seed: int = 5, data_seed: int = 99, batch: int = GLOBAL_BATCH
) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = make_toy(seed=seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for inputs, targets in global_batches(STEPS, batch, data_seed):
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


# what the first step whose loss differs says (a step's loss is computed before its update)
LOSS_ADVICE = {
    0: " (before any update: the ranks did not start from the same weights, or a rank's loss is "
    "not its batch's mean)",
    1: " (step 0 matched, so the start was right and the first update was not: is every "
    "gradient the mean over the ranks before optimizer.step()?)",
    2: " (the steps before matched, so the first update was right and a later one was not: that "
    "is what gradients left over from the previous step do; clear them before each backward)",
}


def loss_advice(step: int) -> str:
    """What the first step whose mean loss differs says about the cause (LOSS_ADVICE)."""
    return LOSS_ADVICE[min(step, 2)]


def compare_with_reference(
    results: list[dict[str, Any]],
    ref_losses: list[float],
    ref_params: dict[str, torch.Tensor],
    where: str,
    ranks: tuple[int, ...] | None = None,
) -> list[str]:
    problems = []
    n = len(results)
    ranks = ranks or tuple(range(n))
    for step in range(STEPS):
        mean_loss = sum(r["losses"][step] for r in results) / n
        if mean_loss != pytest.approx(ref_losses[step], rel=1e-12):
            problems.append(
                f"{where}, step {step}: the mean of the ranks' losses should equal one process's "
                f"loss on the whole batch, {ref_losses[step]:.12f}; got {mean_loss:.12f}"
                + loss_advice(step)
            )
            break
    for rank, result in zip(ranks, results, strict=True):
        for name, ref in ref_params.items():
            got = result["params"][name]
            if not torch.allclose(got, ref, rtol=0, atol=1e-12):
                problems.append(
                    f"{where}: after {STEPS} steps, rank {rank}'s {name} differs from one process "
                    f"on the whole batch by {max_diff(got, ref):.3e} (expected <= 1e-12)"
                )
                break
    return problems


@exercise("1.2")
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_dp_step_equals_one_process_on_the_whole_batch(world_size: int) -> None:
    ref_losses, ref_params = single_process_reference()
    results = small_world(dp_step_worker, world_size, False)
    first_problems(
        compare_with_reference(results, ref_losses, ref_params, f"{world_size} ranks"),
        f"1.2 data_parallel_step, float64, ranks starting from different weights (so the "
        f"broadcast matters), global batch {GLOBAL_BATCH} split in contiguous blocks, SGD with "
        "momentum:",
    )


@exercise("1.2")
def test_dp_step_equals_distributed_data_parallel() -> None:
    problems = []
    for rank, result in enumerate(small_world(dp_step_worker, 2, True)):
        for name, ddp_param in result["ddp_params"].items():
            got = result["params"][name]
            if not torch.allclose(got, ddp_param, rtol=0, atol=1e-12):
                problems.append(
                    f"rank {rank}: {name} after {STEPS} steps differs from "
                    f"DistributedDataParallel's by {max_diff(got, ddp_param):.3e}"
                )
        if result["losses"] != pytest.approx(result["ddp_losses"], rel=1e-12):
            problems.append(
                f"rank {rank}: losses {result['losses']} differ from DDP's {result['ddp_losses']}"
            )
    first_problems(problems, "1.2 data_parallel_step vs DistributedDataParallel on 2 ranks:")


# ============================================================================ timing

SLEEP = 0.05  # seconds one part of the step is made to take, on the stand-in clock


class StandInClock:
    """Stands in for ``time.perf_counter`` (and ``time.time``, ``time.monotonic``) while a step
    runs: it moves only when a part of the step is made slow, by exactly SLEEP. Which interval
    the slow part lands in is then exact, whatever the machine's load (a real sleep would also
    count the time a busy machine takes to wake the other rank)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


CLOCK = StandInClock()


class SlowForward(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CLOCK.advance(SLEEP)
        return self.inner(x)


class SlowSGD(torch.optim.SGD):
    def step(self, closure: Any = None) -> Any:
        CLOCK.advance(SLEEP)
        return super().step(closure)


def slow_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    CLOCK.advance(SLEEP)
    return dist.all_reduce(tensor, *args, **kwargs)


def timing_worker(slow: str) -> list[tuple[float, float, float]]:
    trainer = trainer_module()
    model: nn.Module = make_toy(seed=5)
    if slow == "forward":
        model = SlowForward(model)
    optimizer_class = SlowSGD if slow == "optimizer step" else torch.optim.SGD
    optimizer = optimizer_class(model.parameters(), lr=0.1)
    all_reduce_fn = slow_all_reduce if slow == "all-reduce" else None
    rank = dist.get_rank()
    timings = []
    for inputs, targets in global_batches(3, 8):
        shard = slice(4 * rank, 4 * rank + 4)
        dist.barrier()
        with (
            mock.patch("time.perf_counter", CLOCK),
            mock.patch("time.time", CLOCK),
            mock.patch("time.monotonic", CLOCK),
        ):
            start = CLOCK()
            stats = trainer.data_parallel_step(
                model,
                optimizer,
                nn.functional.cross_entropy,
                inputs[shard],
                targets[shard],
                all_reduce_fn,
            )
            wall = CLOCK() - start
        timings.append((stats.compute_seconds, stats.communication_seconds, wall))
    return timings


@exercise("1.2")
@pytest.mark.parametrize("slow", ["forward", "optimizer step", "all-reduce"])
def test_dp_step_times_compute_and_communication_apart(slow: str) -> None:
    lands_in = "communication_seconds" if slow == "all-reduce" else "compute_seconds"
    other = "compute_seconds" if slow == "all-reduce" else "communication_seconds"
    for rank, timings in enumerate(small_world(timing_worker, 2, slow)):
        for step, (compute, communication, wall) in enumerate(timings[1:], start=1):
            got = {"compute_seconds": compute, "communication_seconds": communication}
            measured = (
                f"got compute_seconds {compute:.4f}, communication_seconds {communication:.4f}"
            )
            if min(compute, communication) < 0:
                fail(
                    f"1.2 data_parallel_step timing: rank {rank}, step {step}: negative time; {measured}"
                )
            if compute + communication < 0.5 * wall:
                fail(
                    f"1.2 data_parallel_step timing: rank {rank}, step {step}: the {slow} was made "
                    f"to take {1e3 * SLEEP:.0f} ms on time.perf_counter (a stand-in clock in this "
                    f"test), but compute + communication add up to {compute + communication:.4f} "
                    f"s; {measured}. Read the clock with time.perf_counter(), at the start and "
                    "after each part, so that the two intervals cover the whole step."
                )
            if got[lands_in] != pytest.approx(SLEEP) or got[other] != pytest.approx(0.0, abs=1e-9):
                fail(
                    f"1.2 data_parallel_step timing: on rank {rank}, step {step}, the {slow} was made "
                    f"to take {1e3 * SLEEP:.0f} ms (on a stand-in clock that moves only then), so "
                    f"{lands_in} should be {1e3 * SLEEP:.0f} ms and {other} 0; {measured}. "
                    "Communication is the averaging alone; forward, backward and the optimizer "
                    "step are compute."
                )


WORK = ("forward", "backward", "all-reduce", "optimizer step")


def waiting_worker() -> list[str]:
    """The order of the step's work, its clock readings and its synchronize calls, on one rank
    (synchronize is replaced by a recorder: on a CPU the real one does nothing)."""
    trainer = trainer_module()
    events: list[str] = []

    class Logged(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            events.append("forward")
            out = self.inner(x)
            out.register_hook(lambda grad: events.append("backward"))
            return out

    class LoggedSGD(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            events.append("optimizer step")
            return super().step(closure)

    def logged_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        events.append("all-reduce")
        return dist.all_reduce(tensor, *args, **kwargs)

    def reading() -> float:
        events.append("clock")
        return 1000.0

    def recording_synchronize(device: torch.device) -> None:
        events.append(f"synchronize {torch.device(device).type}")

    model = Logged(make_toy(seed=5))
    optimizer = LoggedSGD(model.parameters(), lr=0.1)
    inputs, targets = global_batches(1, 8)[0]
    shard = slice(4 * dist.get_rank(), 4 * dist.get_rank() + 4)
    with (
        mock.patch.object(trainer, "synchronize", recording_synchronize),
        mock.patch("time.perf_counter", reading),
        mock.patch("time.time", reading),
        mock.patch("time.monotonic", reading),
    ):
        trainer.data_parallel_step(
            model,
            optimizer,
            nn.functional.cross_entropy,
            inputs[shard],
            targets[shard],
            logged_all_reduce,
        )
    return events


def unwaited_readings(events: list[str]) -> list[str]:
    """For each clock reading that follows work with no synchronize since: that work."""
    found, last_work, waited = [], None, True
    for event in events:
        if event in WORK:
            last_work, waited = event, False
        elif event.startswith("synchronize"):
            waited = True
        elif event == "clock" and not waited:
            found.append(last_work or "")
            waited = True  # one remark per piece of work
    return found


@exercise("1.2")
def test_dp_step_waits_for_the_device_before_each_reading() -> None:
    for rank, events in enumerate(small_world(waiting_worker, 2)):
        seen = " -> ".join(events)
        if "clock" not in events:
            fail(f"1.2 data_parallel_step: rank {rank} never read time.perf_counter ({seen})")
        missed = unwaited_readings(events)
        if missed and not any(e.startswith("synchronize") for e in events):
            fail(
                f"1.2 data_parallel_step on rank {rank} read the clock after the {missed[0]} "
                "without ever calling synchronize (given): on a GPU a call returns once its "
                "kernels are queued, so that reading times the launch, not the work. What the "
                f"step did, in order: {seen}"
            )
        if missed:
            fail(
                f"1.2 data_parallel_step on rank {rank} read the clock after the {missed[0]} with "
                "no synchronize between them: on a GPU that reading would time the launch of the "
                f"{missed[0]}'s kernels, not the work. What the step did, in order: {seen}"
            )
        wrong = [e for e in events if e.startswith("synchronize") and e != "synchronize cpu"]
        if wrong:
            fail(
                f"1.2 data_parallel_step on rank {rank}: {wrong[0]}, but the batch is on the cpu: "
                "wait for the device the inputs are on"
            )


# ============================================================================ subgroups


def subgroup_worker(info: SubgroupInfo) -> dict[str, Any]:
    trainer = trainer_module()
    rank = dist.get_rank()
    out: dict[str, Any] = {"group": info.index}
    # broadcast from the group's rank 1 (global rank 1 or 3): each group gets its own weights
    model = make_toy(seed=200 + rank)
    with only_inside(info, "broadcast_parameters(model, src=1, group=group)"):
        trainer.broadcast_parameters(model, src=1, group=info.group)
    out["broadcast"] = {k: v.clone() for k, v in model.state_dict().items()}
    # averaging: rank r's gradients are all r+1, so group (0, 1) averages 1.5, (2, 3) 3.5
    set_rank_grads(model, float(rank + 1))
    with only_inside(info, "average_gradients(model, group=group)"):
        trainer.average_gradients(model, group=info.group)
    out["grads"] = {
        n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()
    }
    # the same averaging over the whole world (no group): what tells "divided by the world's
    # size" from "divided twice", which both halve a group of 2's mean in a world of 4
    set_rank_grads(model, float(rank + 1))
    trainer.average_gradients(model)
    grad = model.embed.weight.grad
    out["whole_world"] = float(grad.flatten()[0]) / 2.5 if grad is not None else math.nan
    # the DP step: each group trains its own model on its own data
    model = make_toy(seed=5 + info.index + 10 * rank)
    with only_inside(info, "broadcast_parameters + data_parallel_step(..., group=group)"):
        trainer.broadcast_parameters(model, src=0, group=info.group)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses = []
        per_rank = GLOBAL_BATCH // info.size
        for inputs, targets in global_batches(STEPS, GLOBAL_BATCH, 99 + info.index):
            shard = slice(info.group_rank * per_rank, (info.group_rank + 1) * per_rank)
            stats = trainer.data_parallel_step(
                model,
                optimizer,
                nn.functional.cross_entropy,
                inputs[shard],
                targets[shard],
                group=info.group,
            )
            losses.append(stats.loss)
    out["losses"] = losses
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


@exercise("1.2")
def test_broadcast_averaging_and_step_inside_subgroups() -> None:
    results = run_in_subgroups("1.2", subgroup_worker)
    problems = []
    for index, members in enumerate(((0, 1), (2, 3))):
        where = f"group {index} (global ranks {members[0]}, {members[1]})"
        src_state = make_toy(seed=200 + members[1]).state_dict()
        for rank in members:
            for name, value in src_state.items():
                if not torch.equal(results[rank]["broadcast"][name], value):
                    holds = [
                        m
                        for m in range(4)
                        if torch.equal(
                            results[rank]["broadcast"][name], make_toy(200 + m).state_dict()[name]
                        )
                    ]
                    if len(holds) == 1:
                        whose = f"it holds global rank {holds[0]}'s {name}"
                        if holds[0] == members[0]:
                            whose += " (the group's rank 0, not its rank 1)"
                    elif holds:
                        whose = f"its {name} is that of ranks {holds}"
                    else:
                        whose = f"its {name} is no rank's"
                    problems.append(
                        f"{where}: broadcast_parameters(src=1, group=group) should give rank "
                        f"{rank} the weights of global rank {members[1]} (the group's rank 1); "
                        f"{whose}"
                    )
                    break
            problems += check_mean(
                results[rank]["grads"],
                sum(members) / 2 + 1,
                f"{where}, rank {rank}: average_gradients(group=group)",
                2,
                4,
                results[rank]["whole_world"],
            )
        ref_losses, ref_params = single_process_reference(
            seed=5 + index + 10 * members[0], data_seed=99 + index
        )
        problems += compare_with_reference(
            [results[rank] for rank in members],
            ref_losses,
            ref_params,
            f"{where}: data_parallel_step(group=group), compared with one process (what a world "
            "of 2 gives)",
            members,
        )
    first_problems(
        problems,
        "1.2 inside a subgroup: a world of 4 split into the groups (0, 1) and (2, 3), both "
        "running at once on different data:",
    )
