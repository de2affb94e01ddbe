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

import pytest
import torch
import torch.distributed as dist
from grading import defined_at, learner_line, load
from phase3_helpers import with_sites
from torch import nn

from course.comm_counter import CommCounter
from solutions.phase3_multi_node.references import zero_accounting as acc

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
            "collective of a unit needs group=self.group" + defined_at(type(unit).reduce_scatter)
        ) from None
    wrong = reduce_scatter_problem(got, total, rank, dist.get_rank(), world, dist.get_world_size())
    if wrong:
        found["reduce_scatter"] = wrong
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
        return with_sites(found, type(unit))
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
    return with_sites(found, type(unit))


def reduce_scatter_problem(
    got: Any, total: torch.Tensor, rank: int, global_rank: int, group_size: int, world_size: int
) -> str | None:
    """What is wrong with ``ZeroUnit.reduce_scatter``'s slice ``got`` on group rank ``rank``
    (global rank ``global_rank``) of a group of ``group_size`` in a world of ``world_size``,
    ``total`` the sum of the group's flat gradients (None: nothing). A cause is named when the
    values are exactly what it gives: the sum, the mean over the world instead of the group,
    the slice of the global rank, the whole buffer."""
    size = total.numel() // group_size
    want = total[rank * size : (rank + 1) * size] / group_size
    if (
        isinstance(got, torch.Tensor)
        and got.shape == want.shape
        and torch.allclose(got, want, rtol=1e-12, atol=0)
    ):
        return None
    shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
    said = (
        f"ZeroUnit.reduce_scatter returned {shape} values on group rank {rank}; expected slice "
        f"{rank} ({size} elements) of the mean over the {group_size} ranks"
    )
    if not isinstance(got, torch.Tensor):
        return said

    def equals(other: torch.Tensor) -> bool:
        return got.shape == other.shape and torch.allclose(got, other, rtol=1e-12, atol=0)

    mine = total[rank * size : (rank + 1) * size]
    if equals(mine):
        return f"{said}: it is the sum, divide by the group size"
    if world_size != group_size and equals(mine / world_size):
        return (
            f"{said}: it is the sum divided by the WORLD's size ({world_size}), not the group's "
            f"({group_size}): take the size from the group (dist.get_world_size(group))"
        )
    if global_rank != rank and equals(
        total[global_rank * size : (global_rank + 1) * size] / group_size
    ):
        return (
            f"{said}: it is the slice of the GLOBAL rank {global_rank}: slices follow the group "
            "rank (dist.get_rank(group))"
        )
    if equals(total / group_size):
        return f"{said}: it is the whole mean buffer, not this rank's slice of it"
    return f"{said} ({differs_text(got, want)})"


def differs_text(got: torch.Tensor, want: torch.Tensor) -> str:
    """Which elements differ and by what ratio, or the shapes when they differ."""
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} {got.dtype}, expected {tuple(want.shape)} {want.dtype}"
    bad = (got - want).abs().gt(1e-12 * want.abs().clamp(min=1)).nonzero().flatten()
    ratio = got[bad[:1]] / want[bad[:1]] if len(bad) and bool(want[bad[0]] != 0) else None
    shown = f", {float(ratio):.4g} times the right value there" if ratio is not None else ""
    return f"{len(bad)} of {want.numel()} elements differ, the first at {int(bad[0])}{shown}"


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
                if (
                    other != r
                    and ohi - olo == hi - lo
                    and torch.allclose(g[lo:hi], w[olo:ohi], rtol=0, atol=TOLERANCE)
                ):
                    moved = True
    own_right = all(
        torch.allclose(
            _flat(u.layout.params, got, names)[rank * u.layout.shard_numel :][
                : u.layout.shard_numel
            ],
            _flat(u.layout.params, want, names)[rank * u.layout.shard_numel :][
                : u.layout.shard_numel
            ],
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
def freed_parameters_explained(
    stage: int, phase: str, hook: str, unit_problems: dict[str, str] | None = None
) -> Iterator[None]:
    """Turn torch's "storage of size 0" error into what it means here; any other error of the
    model's own computation, when a ZeroUnit method misbehaved alone first, into that method's
    remark (a free() that replaced the parameters' data makes forward fail deep inside torch)."""
    try:
        yield
    except RuntimeError as err:
        first = str(err).splitlines()[0][:160]
        if "storage of size 0" in str(err):
            raise AssertionError(
                f"stage {stage}: a layer's parameters were still freed (0-byte storage) when its "
                f"{phase} ran: gather the layer in {hook} ({err})"
            ) from None
        if unit_problems:
            raise AssertionError(
                f"stage {stage}: the model's {phase} raised RuntimeError ({first}) after "
                "ZeroUnit's methods, tried alone first, misbehaved: "
                + "; ".join(unit_problems.values())
            ) from None
        raise


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
            with freed_parameters_explained(
                stage, "forward", "a forward pre-hook", run.unit_problems
            ):
                loss = nn.functional.cross_entropy(model(xs), ys)
            run.after_forward_param_bytes = acc.parameter_bytes(model, optimizer)
            with freed_parameters_explained(
                stage, "backward", "a full backward pre-hook", run.unit_problems
            ):
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


# ----------------------------------------------------------------------------- frozen and tied


class TiedLM(nn.Module):
    """Embedding -> Linear -> tanh -> output layer whose weight IS the embedding's (tied, as in
    GPT-2 and T5): 11 tokens x 6 features (66, shared), 42 + 11 other parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11)
        self.head.weight = self.embed.weight  # one parameter, two uses

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.embed(tokens))))


FROZEN = ("0.bias", "2.weight")  # a layer half frozen, and a layer whose weight is frozen
KINDS = ("frozen", "tied")


class Scaled(nn.Module):
    """A layer that owns a parameter AND has a child with parameters (a unit of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(6))
        self.inner = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x * self.scale)


def special_model(kind: str) -> nn.Module:
    """``small_mlp`` with two frozen parameters, or the tied model (float64, seed 0)."""
    if kind == "tied":
        torch.manual_seed(0)
        return TiedLM().double()
    model = small_mlp()
    for name in FROZEN:
        model.get_parameter(name).requires_grad_(False)
    return model


def special_batch(kind: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "frozen":
        return batch(step)
    g = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(11, (GLOBAL_BATCH,), generator=g)
    return tokens, torch.randint(11, (GLOBAL_BATCH,), generator=g)


SPECIAL_STEPS = 6


def special_reference(kind: str, grad_scale: float = 1.0) -> list[dict[str, torch.Tensor]]:
    """One process, whole batch, torch's AdamW on ``model.parameters()`` (it skips the frozen
    ones: no gradient); ``grad_scale`` 2 doubles the tied weight's gradient only."""
    model = special_model(kind)
    optimizer = adamw(model.parameters())
    out = []
    for step in range(SPECIAL_STEPS):
        x, y = special_batch(kind, step)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if grad_scale != 1.0 and kind == "tied":
            grad = model.get_parameter("embed.weight").grad
            assert grad is not None
            grad.mul_(grad_scale)
        optimizer.step()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


@dataclass
class SpecialRun:
    """One stage on the frozen or the tied model, on one rank."""

    kind: str
    stage: int
    error: str | None = None
    value_problem: str | None = None
    held: acc.ModelStateBytes | None = None
    psi: int = 0
    frozen: int = 0
    volume: int = 0
    placement: str | None = None  # what the units hold wrongly (frozen or tied parameters)


def placement_problem(model: nn.Module, optimizer: Any) -> str | None:
    """A frozen parameter inside a unit, a parameter inside two units, or one in none, named."""
    names = {id(p): n for n, p in model.named_parameters()}
    units_of: dict[str, int] = {}
    for unit in getattr(optimizer, "units", []):
        for p in unit.layout.params:
            name = names.get(id(p), "?")
            units_of[name] = units_of.get(name, 0) + 1
    for name in units_of:
        if name in names.values() and not model.get_parameter(name).requires_grad:
            return (
                f"the frozen parameter {name} is in a unit: it would be sharded into the "
                "optimizer and updated (weight decay moves it although it has no gradient); "
                "unit_parameters must leave out parameters with requires_grad=False"
            )
    for name, count in units_of.items():
        if count > 1:
            return (
                f"the tied parameter {name} is in {count} units (one per module that registers "
                "it): shard it once, in the unit of the first layer that registers it "
                "(unit_parameters skips what `owned` holds already), or its gradient is reduced "
                "and stepped twice"
            )
    for name, p in model.named_parameters():
        if p.requires_grad and name not in units_of:
            return (
                f"the trainable parameter {name} is in no unit: it would never be updated; "
                "every trainable parameter belongs to the unit of the first layer that "
                "registers it"
            )
    return None


def unit_parameters_problem(zero: Any, kind: str) -> str | None:
    """``unit_parameters`` called on every layer in order, as zero_wrap does, against the rule:
    every trainable parameter once, in the first layer that registers it; no frozen one
    (``kind`` "nested": a layer with a parameter of its own and a child layer)."""
    model = Scaled().double() if kind == "nested" else special_model(kind)
    names = {id(p): n for n, p in model.named_parameters()}
    owned: set[int] = set()
    where: dict[str, str] = {}  # parameter -> the layer that returned it first
    for layer_name, layer in model.named_modules():
        if not any(True for _ in layer.parameters(recurse=False)):
            continue
        call = f"unit_parameters({layer_name or 'the root'}, owned)"
        got = zero.unit_parameters(layer, owned)
        for p in got:
            name = names.get(id(p), "?")
            if not p.requires_grad:
                return (
                    f"{call} returned the frozen parameter {name}: a parameter with "
                    "requires_grad=False gets no gradient, so it must stay out of the units "
                    "(in a unit, the optimizer would step it: weight decay moves it)"
                )
            if name in where:
                return (
                    f"{call} returned {name}, which {where[name]} returned already: a tied "
                    "parameter is the same object in both modules and belongs to the first "
                    "layer's unit only (skip what `owned` holds)"
                )
            where[name] = layer_name or "the root"
            if id(p) not in owned:
                return (
                    f"{call} returned {name} but did not add it to `owned`: zero_wrap passes "
                    "the same set to every layer, so a later layer that registers the same "
                    "(tied) parameter would shard it again"
                )
        own = [names[id(p)] for p in layer.parameters(recurse=False)]
        strangers = [names.get(id(p), "?") for p in got if names.get(id(p)) not in own]
        if strangers:
            return (
                f"{call} returned {strangers}, which {layer_name or 'the root'} does not "
                "register itself (a child layer does, and has units of its own): each layer's "
                "units hold its own parameters (recurse=False)"
            )
    missing = [n for n, p in model.named_parameters() if p.requires_grad and n not in where]
    if missing:
        return (
            f"no layer returned the trainable parameter {missing[0]}: every trainable parameter "
            "goes into exactly one unit, that of the first layer that registers it"
        )
    return None


def special_run(kind: str, stage: int) -> SpecialRun:
    """Train the frozen or the tied model ``SPECIAL_STEPS`` steps under ``zero_wrap(stage)``."""
    zero = zero_module()
    rank, world = dist.get_rank(), dist.get_world_size()
    run = SpecialRun(kind, stage)
    run.placement = unit_parameters_problem(zero, kind)
    if run.placement:  # a parameter in two units, or frozen in one: wrapping may read freed memory
        return run
    model = special_model(kind)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        model, optimizer = zero.zero_wrap(model, adamw, stage)
    except NotImplementedError:
        raise  # an unwritten TODO: the harness names it
    except (RuntimeError, ValueError) as err:
        raised = (
            f"zero_wrap raised {type(err).__name__}: {str(err).splitlines()[0]}{learner_line(err)}"
        )
        seen = unit_parameters_problem(zero, kind)
        run.error = f"{seen} (here {raised})" if seen else raised
        return run
    run.placement = placement_problem(model, optimizer)
    run.psi, run.frozen = acc.padded_psi(model, world), acc.frozen_numel(model)
    want = special_reference(kind)
    shard = GLOBAL_BATCH // world
    try:
        for step in range(SPECIAL_STEPS):
            x, y = special_batch(kind, step)
            xs, ys = x[rank * shard : (rank + 1) * shard], y[rank * shard : (rank + 1) * shard]
            with CommCounter() as comm:
                nn.functional.cross_entropy(model(xs), ys).backward()
                optimizer.step()
            if step == 0:
                run.held = acc.held_bytes(model, optimizer)
                run.volume = acc.collective_volume(comm.records, world)
            optimizer.zero_grad()
            got = zero.full_state_dict(model, optimizer)
            if run.value_problem is None:
                run.value_problem = special_values_problem(kind, got, want, initial, step, world)
    except NotImplementedError:
        raise
    except (RuntimeError, TypeError, AttributeError) as err:
        run.error = (
            f"training raised {type(err).__name__}: {str(err).splitlines()[0]}{learner_line(err)}"
        )
    return run


def special_values_problem(
    kind: str,
    got: dict[str, torch.Tensor],
    want: list[dict[str, torch.Tensor]],
    initial: dict[str, torch.Tensor],
    step: int,
    world: int,
) -> str | None:
    """Step ``step``'s parameters against one process's, explained for frozen and tied ones."""
    if set(got) != set(want[step]):
        return f"full_state_dict returned {sorted(got)}; one process has {sorted(want[step])}"
    if kind == "frozen":
        for name in FROZEN:
            if not torch.equal(got[name], initial[name]):
                moved = float((got[name] - initial[name]).abs().max())
                return (
                    f"after step {step + 1}, the frozen parameter {name} moved by {moved:.3e}: "
                    "a parameter with requires_grad=False is never updated (torch's AdamW "
                    "skips it: no gradient); it must stay outside the units and the optimizer"
                )
    diff, name = max_diff(got, want[step])
    if diff <= TOLERANCE:
        return None
    where = f"after step {step + 1}, {name} differs by {diff:.3e} from one process's AdamW"
    if kind == "tied":
        doubled = special_reference(kind, grad_scale=2.0)[step]
        if max_diff(got, doubled)[0] <= TOLERANCE:
            return (
                f"{where}, and equals what the tied weight's gradient counted twice gives: "
                "both uses are summed by autograd into one .grad; reduce and step it once"
            )
    return where + f" (tolerance {TOLERANCE})"


# ----------------------------------------------------------------------------- the partition


def partition_problem() -> str | None:
    """What is wrong with zero_partition's padded_size and shard_bounds (None: nothing)."""
    part = load(PHASE, "zero_partition")
    for world in range(1, 6):
        for numel in [*range(0, 14), 107]:
            padded = part.padded_size(numel, world)
            want = -(-numel // world) * world
            if padded != want:
                return (
                    f"3.5 padded_size({numel}, {world}) returned {padded}; expected {want}: the "
                    f"smallest multiple of {world} that holds {numel} elements (every rank must "
                    "own a slice of the same length for reduce_scatter_tensor/all_gather_into_"
                    "tensor)"
                )
        padded = part.padded_size(107, world)
        bounds = [tuple(part.shard_bounds(padded, world, r)) for r in range(world)]
        size = padded // world
        want_bounds = [(r * size, (r + 1) * size) for r in range(world)]
        if bounds != want_bounds:
            return (
                f"3.5 shard_bounds({padded}, {world}, rank) for ranks 0..{world - 1} returned "
                f"{bounds}; expected {want_bounds}: equal contiguous slices in rank order, the "
                "layout all_gather_into_tensor produces"
            )
    return None


def needs_partition() -> None:
    """Step aside while the partition is wrong: every flat buffer, shard, byte count and
    collective of ZeRO and of the FSDP-style units is cut by it, so the tests below would only
    repeat that failure as other causes (an unwritten one raises its TODO here, once)."""
    try:
        problem = partition_problem()
    except NotImplementedError:
        raise
    except Exception as exc:
        problem = f"the partition raised {type(exc).__name__}: {exc}{learner_line(exc)}"
    if problem:
        pytest.skip(
            "blocked by the failure above "
            "(test_partition_pads_to_the_world_and_gives_each_rank_one_slice): every buffer and "
            "shard is cut by padded_size and shard_bounds, which are wrong"
        )
