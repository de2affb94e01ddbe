"""What the 3.5 grader runs inside its ranks: a ZeRO training run, measured while it runs.

One run per (stage, world size) records everything the grader checks, so every check costs one
world: the parameters after each of 10 steps against one process's AdamW on the whole batch
(float64, 1e-12), the bytes held after a step against the paper's formulas, the collectives of one
step, and, in stage 3, the parameter bytes at every gather/free point of forward and backward.
"""

from __future__ import annotations

import re
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
    unit_problems: dict[str, str] = field(default_factory=dict)  # method -> what it did wrong


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


def unit_problems(stage: int, group: Any) -> dict[str, str]:
    """ZeroUnit's collectives and storage methods tried one by one on a throwaway model, with
    values that show where each element came from (a collective: every rank of ``group`` calls
    it). Returns, per method, what it did wrong; empty when all behave."""
    zero = zero_module()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    _, optimizer = zero.zero_wrap(small_mlp(), adamw, stage, group=group)
    unit = optimizer.units[0]
    size, padded = unit.layout.shard_numel, unit.layout.padded_numel
    found: dict[str, str] = {}
    full = torch.arange(padded, dtype=torch.float64) * (rank + 1)  # rank-distinct gradients
    total = full.clone()
    dist.all_reduce(total, group=group)
    try:
        got = unit.reduce_scatter(full.clone())
    except RuntimeError as err:
        sizes = re.search(r"\((\d+) vs\.? (\d+)\)", str(err))
        whole_world = sizes is not None and int(sizes[1]) == size * dist.get_world_size()
        if group is None or not whole_world:
            raise
        raise AssertionError(
            f"ZeroUnit.reduce_scatter, in a group of {world} ranks of a world of "
            f"{dist.get_world_size()}, failed inside torch: it expected an input of "
            f"{sizes[1] if sizes else '?'} elements, the output's size times the WORLD's "
            f"{dist.get_world_size()} ranks, so the reduce-scatter ran on the whole world; every "
            "collective of a unit needs group=self.group"
        ) from None
    want = total[rank * size : (rank + 1) * size] / world
    if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-12, atol=0):
        summed = got.shape == want.shape and torch.allclose(got, want * world, rtol=1e-12, atol=0)
        found["reduce_scatter"] = (
            f"ZeroUnit.reduce_scatter returned {tuple(got.shape)} values on group rank {rank}; "
            f"expected slice {rank} ({size} elements) of the mean over the {world} ranks"
            + (": it is the sum, divide by the group size" if summed else "")
        )
    with torch.no_grad():
        unit.shard.copy_(torch.arange(size, dtype=torch.float64) + 1000 * (rank + 1))
    expected = torch.cat(
        [torch.arange(size, dtype=torch.float64) + 1000 * (r + 1) for r in range(world)]
    )
    if stage < 3:
        unit.all_gather_params()
        if not torch.equal(unit.flat_param, expected):
            found["all_gather_params"] = (
                "ZeroUnit.all_gather_params left flat_param without every rank's shard in "
                "group-rank order (rank r's shard at [r·S, (r+1)·S))"
            )
        return found
    unit.flat_param.untyped_storage().resize_(0)  # freed by hand: gather() alone is tried
    unit.gather()
    storage = unit.flat_param.untyped_storage()
    if storage.nbytes() == 0:
        found["gather"] = "ZeroUnit.gather() left flat_param's storage at 0 bytes: regrow it"
    elif not torch.equal(unit.flat_param, expected):
        found["gather"] = (
            "ZeroUnit.gather() regrew flat_param but did not fill it with every rank's shard "
            "(all_gather_params): the layer holds stale or uninitialised values"
        )
    unit.free()
    if unit.flat_param.untyped_storage().nbytes() != 0:
        found["free"] = (
            f"ZeroUnit.free() left flat_param's storage at "
            f"{unit.flat_param.untyped_storage().nbytes()} bytes: it must shrink the storage to "
            "0 bytes (the parameters stay views of it)"
        )
    return found


def _flat(params: Any, values: dict[str, torch.Tensor], names: dict[int, str]) -> torch.Tensor:
    return torch.cat([values[names[id(p)]].reshape(-1) for p in params])


def slice_diagnosis(
    model: nn.Module,
    optimizer: Any,
    got: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    before: dict[str, torch.Tensor],
    rank: int,
) -> str:
    """What the wrong parameters show, slice by slice of each unit's flat buffer: this rank's
    slice right and the others stale; this rank holding another rank's slice; or neither."""
    names = {id(p): n for n, p in model.named_parameters()}
    stale = moved = False
    for unit in optimizer.units:
        params, size = unit.layout.params, unit.layout.shard_numel
        g, w, b = (_flat(params, v, names) for v in (got, want, before))
        world = unit.layout.world_size
        for r in range(world):
            lo, hi = r * size, min((r + 1) * size, g.numel())
            if lo >= hi or torch.allclose(g[lo:hi], w[lo:hi], rtol=0, atol=TOLERANCE):
                continue
            if r != rank and torch.equal(g[lo:hi], b[lo:hi]):
                stale = True
            for other in range(world):
                olo, ohi = other * size, min((other + 1) * size, g.numel())
                if other != r and ohi - olo == hi - lo and torch.allclose(
                    g[lo:hi], w[olo:ohi], rtol=0, atol=TOLERANCE
                ):
                    moved = True
    own_right = all(
        torch.allclose(
            _flat(u.layout.params, got, names)[rank * u.layout.shard_numel :][: u.layout.shard_numel],
            _flat(u.layout.params, want, names)[rank * u.layout.shard_numel :][: u.layout.shard_numel],
            rtol=0,
            atol=TOLERANCE,
        )
        for u in optimizer.units
    )
    if stale and own_right:
        return (
            ": this rank's own slice is right, but other ranks' slices still hold their values "
            "from before the step: the updated slices were not all-gathered back (stages 1-2: "
            "every unit's all_gather_params after the inner optimizer's step)"
        )
    if moved:
        return (
            ": some slice holds values that belong to another rank's slice: slices follow the "
            "GROUP rank (dist.get_rank(group)), and all_gather_into_tensor lays them out in "
            "group-rank order"
        )
    return (
        ": each rank must end with its slice of the gradient averaged over the group, step "
        "exactly that slice, and all-gather the slices back in group-rank order"
    )


def trajectory_problem(
    stage: int,
    model: nn.Module,
    optimizer: Any,
    rank: int,
    world: int,
    seed: int,
    units: dict[str, str] | None = None,
    calls: dict[str, int] | None = None,
) -> str | None:
    """Train 10 steps; the first step whose parameters differ from the reference, explained by
    what was seen: a ZeroUnit method that misbehaved alone (``units``), a collective missing
    from the first step (``calls``), summed gradients, stale or misplaced slices."""
    zero = zero_module()
    want, summed = reference(seed), reference(seed, grad_scale=world)
    initial = {n: p.detach().clone() for n, p in small_mlp().named_parameters()}
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
        if units:
            return (
                f"{where} from one process's AdamW on the whole batch; tried alone, "
                + "; ".join(units.values())
            )
        missing = [op for op in ("reduce_scatter_tensor", "all_gather_into_tensor")
                   if calls is not None and not calls.get(op)]  # fmt: skip
        if missing:
            return (
                f"{where} from one process's AdamW on the whole batch, and one step called no "
                f"{' and no '.join(missing)}: every step reduce-scatters each unit's gradient "
                "(stage 1 in ZeroOptimizer.step, stages 2-3 in backward) and all-gathers its "
                "parameters (stages 1-2 after the step, stage 3 before use)"
            )
        if max_diff(got, summed[step])[0] <= TOLERANCE:
            return (
                f"{where} from one process's AdamW on the whole batch, and equals what summed "
                f"gradients give: divide the reduce-scattered gradient by the group size "
                f"({world}): each rank's loss is the mean over its own samples only"
            )
        before = want[step - 1] if step > 0 else initial
        return (
            f"{where} from one process's AdamW on the whole batch (tolerance {TOLERANCE})"
            + slice_diagnosis(model, optimizer, got, want[step], before, rank)
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
        run.unit_problems = unit_problems(stage, group)
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
        run.value_problem = trajectory_problem(
            stage, model, optimizer, rank, world, seed, run.unit_problems, run.calls
        )
    if subgroup is not None:
        rank_ = dist.get_rank()
        run.other_group_calls = [r.describe(rank_) for r in whole_run.crossing(subgroup.ranks)][:3]
    return run
