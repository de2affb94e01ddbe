"""What the 3.5 grader runs inside its ranks: a ZeRO training run, measured while it runs.

One run per (stage, world size) records everything the grader checks, so every check costs one
world: the parameters after each of 10 steps against one process's AdamW on the whole batch
(float64, 1e-12), the bytes held after a step against the paper's formulas, the collectives of one
step, and, in stage 3, the parameter bytes at every gather/free point of forward and backward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from grading import load
from torch import nn

from course.comm_counter import CommCounter
from solutions.phase3_multi_node import zero_accounting as acc

PHASE = "phase3_multi_node"
TOLERANCE = 1e-12
STEPS = 10
GLOBAL_BATCH = 24  # divides by 2, 3 and 4
ELEMENT = 8  # float64
ADAM_K = 2 * ELEMENT  # exp_avg + exp_avg_sq


def zero_module() -> Any:
    return load(PHASE, "zero")


def small_mlp() -> nn.Sequential:
    """Layers of 49, 40 and 18 parameters (107 in all): none divides by 4, most not by 2 or 3."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3)
    ).double()


def adamw(params: Any) -> torch.optim.Optimizer:
    # eps large enough that summing gradients instead of averaging them shows in the result
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1, eps=1e-6)


def batch(step: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * seed + step)
    x = torch.randn(GLOBAL_BATCH, 6, generator=g, dtype=torch.float64)
    return x, torch.randint(3, (GLOBAL_BATCH,), generator=g)


def reference(seed: int = 0, grad_scale: float = 1.0) -> list[dict[str, torch.Tensor]]:
    """One process, whole batch: the parameters after each step (``grad_scale`` N: summed)."""
    model = small_mlp()
    optimizer = adamw(model.parameters())
    out = []
    for step in range(STEPS):
        x, y = batch(step, seed)
        optimizer.zero_grad()
        (grad_scale * nn.functional.cross_entropy(model(x), y)).backward()
        optimizer.step()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    worst = max(want, key=lambda n: float((got[n] - want[n]).abs().max()))
    return float((got[worst] - want[worst]).abs().max()), worst


@dataclass
class ZeroRun:
    """What one rank saw: problems with the values, and the measurements."""

    value_problem: str | None = None
    held: acc.ModelStateBytes | None = None
    psi: int = 0
    largest_layer: int = 0
    units: int = 0
    calls: dict[str, int] = field(default_factory=dict)
    volume: int = 0
    other_group_calls: list[str] = field(default_factory=list)
    peak_param_bytes: int = 0
    after_forward_param_bytes: int = 0
    after_step_param_bytes: int = 0


def watch_parameter_bytes(model: nn.Module, optimizer: Any, seen: list[int]) -> None:
    """Record parameter bytes while each layer is gathered: after the code's forward pre-hook,
    before its forward hook (prepend), after its backward pre-hook (hooks run in order)."""

    def measure(*_: Any) -> None:
        seen.append(acc.parameter_bytes(model, optimizer))

    for layer in model.modules():
        if list(layer.parameters(recurse=False)):
            layer.register_forward_pre_hook(measure)
            layer.register_forward_hook(measure, prepend=True)
            layer.register_full_backward_pre_hook(measure)


def trajectory_problem(
    stage: int, model: nn.Module, optimizer: Any, rank: int, world: int, seed: int
) -> str | None:
    """Train 10 steps; the first step whose parameters differ from the reference, explained."""
    zero = zero_module()
    want, summed = reference(seed), reference(seed, grad_scale=world)
    shard = GLOBAL_BATCH // world
    for step in range(STEPS):
        if step > 0:
            x, y = batch(step, seed)
            xs, ys = x[rank * shard : (rank + 1) * shard], y[rank * shard : (rank + 1) * shard]
            nn.functional.cross_entropy(model(xs), ys).backward()
            optimizer.step()
            optimizer.zero_grad()
        got = zero.full_state_dict(model, optimizer)
        diff, name = max_diff(got, want[step])
        if diff <= TOLERANCE:
            continue
        where = f"after step {step + 1}, {name} differs by {diff:.3e}"
        if max_diff(got, summed[step])[0] <= TOLERANCE:
            return (
                f"{where} from one process's AdamW on the whole batch, and equals what summed "
                f"gradients give: divide the reduce-scattered gradient by the group size "
                f"({world}): each rank's loss is the mean over its own samples only"
            )
        return (
            f"{where} from one process's AdamW on the whole batch (tolerance {TOLERANCE}): each "
            "rank must end with its slice of the gradient averaged over the group, step exactly "
            "that slice, and all-gather the slices back in group-rank order"
            + (
                " (a difference this large after the first step means values landed in another "
                "rank's slice: slices follow the GROUP rank, dist.get_rank(group))"
                if step == 0 and diff > 1e-3
                else ""
            )
        )
    return None


@contextmanager
def freed_parameters_explained(stage: int, phase: str, hook: str) -> Iterator[None]:
    """Turn torch's "storage of size 0" error into what it means here."""
    try:
        yield
    except RuntimeError as err:
        if "storage of size 0" not in str(err):
            raise
        raise AssertionError(
            f"stage {stage}: a layer's parameters were still freed (0-byte storage) when its "
            f"{phase} ran: gather the layer in {hook} ({err})"
        ) from None


def zero_run(stage: int, seed: int = 0, subgroup: Any = None) -> ZeroRun:
    """Train ``small_mlp`` under ``zero_wrap(stage)`` on this rank's part of each global batch."""
    zero = zero_module()
    group = subgroup.group if subgroup is not None else None
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    run = ZeroRun()
    with CommCounter() as whole_run:
        model, optimizer = zero.zero_wrap(small_mlp(), adamw, stage, group=group)
        run.psi = acc.padded_psi(model, world)
        run.largest_layer = max(acc.layer_sizes(model, world))
        run.units = len(acc.layer_sizes(model, world))
        seen: list[int] = []
        if stage == 3:
            watch_parameter_bytes(model, optimizer, seen)
        x, y = batch(0, seed)
        shard = GLOBAL_BATCH // world
        xs, ys = x[rank * shard : (rank + 1) * shard], y[rank * shard : (rank + 1) * shard]
        with CommCounter() as step_comm:
            with freed_parameters_explained(stage, "forward", "a forward pre-hook"):
                loss = nn.functional.cross_entropy(model(xs), ys)
            run.after_forward_param_bytes = acc.parameter_bytes(model, optimizer)
            with freed_parameters_explained(stage, "backward", "a full backward pre-hook"):
                loss.backward()
            optimizer.step()
        run.after_step_param_bytes = acc.parameter_bytes(model, optimizer)
        run.peak_param_bytes = max(seen, default=0)
        run.held = acc.held_bytes(model, optimizer)
        run.calls = dict(step_comm.calls)
        run.volume = acc.collective_volume(step_comm.records, world)
        optimizer.zero_grad()
        run.value_problem = trajectory_problem(stage, model, optimizer, rank, world, seed)
    if subgroup is not None:
        rank_ = dist.get_rank()
        run.other_group_calls = [r.describe(rank_) for r in whole_run.crossing(subgroup.ranks)][:3]
    return run
