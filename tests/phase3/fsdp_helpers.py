"""What the 3.5 FSDP-style grader runs inside its ranks: the wrapper trained, its collectives and
its gathers recorded, beside torch's ``fully_shard`` and one process.

The model is four blocks ``Linear(6, h), Tanh, Linear(h, 6)`` with h = 7, 5, 9, 3: units of 97,
71, 123 and 45 parameters (padding is needed on 2 and 3 ranks, and every unit has its own size,
so a collective's size says which unit it moved). A :class:`CollectiveLog` wraps
``dist.all_gather_into_tensor`` and ``dist.reduce_scatter_tensor`` to record, per call, the
dtype, the elements of the full buffer, whether it was asynchronous, and, with the hooks of
:func:`watch_units`, the order of events: all-gathers issued and waited for, each unit's compute
starting (with the units gathered at that moment) and ending. With ``defer=True`` an async
all-gather fills its output with NaN when issued and with the gathered values only at
``wait()``, so code that reads parameters before waiting computes NaN, deterministically.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from grading import learner_line, load
from phase3_helpers import with_sites
from torch import nn

from phase3_multi_node.zero_fsdp_support import in_backward
from solutions.phase3_multi_node.references import zero_accounting as acc

PHASE = "phase3_multi_node"
WIDTHS = (7, 5, 9, 3)
IN = 6
PER_RANK = 4
STEPS = 4
LR = 1e-2
TOLERANCE_64 = 1e-12
WINDOWS = (0, 1, 2)


def fsdp_module() -> Any:
    return load(PHASE, "zero_fsdp")


def units_module() -> Any:
    return load(PHASE, "zero_fsdp_units")


def blocks_model(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        blocks = [nn.Sequential(nn.Linear(IN, h), nn.Tanh(), nn.Linear(h, IN)) for h in WIDTHS]
    return nn.Sequential(*blocks).to(dtype)


def unit_sizes(world: int) -> list[int]:
    """Padded elements of each block's unit on ``world`` ranks."""
    return [-(-(13 * h + IN) // world) * world for h in WIDTHS]


def batch(step: int, world: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    shape = (PER_RANK * world, IN)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def train_step(model: nn.Module, optimizer: Any, step: int, rank: int, world: int,
               dtype: torch.dtype, zero_grad: bool = True) -> None:  # fmt: skip
    x, y = batch(step, world, dtype)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    out = model(x[mine])
    nn.functional.mse_loss(out, y[mine].to(out.dtype)).backward()
    optimizer.step()
    if zero_grad:
        optimizer.zero_grad()


def one_process_float64(world: int) -> list[dict[str, torch.Tensor]]:
    """One process, the whole batch, float64: the parameters after each step."""
    model = blocks_model(torch.float64)
    optimizer = adamw(model.parameters())
    out = []
    for step in range(STEPS):
        x, y = batch(step, world, torch.float64)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    worst, where = -1.0, ""
    for name, tensor in want.items():
        mine = got.get(name)
        if mine is None or mine.shape != tensor.shape:
            return math.inf, name
        diff = float((mine.double() - tensor.double()).abs().max())
        if math.isnan(diff):
            return math.nan, name
        if diff > worst:
            worst, where = diff, name
    return worst, where


# ----------------------------------------------------------------------------- recording


@dataclass
class Call:
    """One collective: op, dtype, elements of its full buffer, async or not, which unit."""

    op: str
    dtype: str
    numel: int
    asynchronous: bool
    unit: int | None
    to_compute_buffer: bool = True  # the all-gather's output was a unit's flat_param


@dataclass
class Event:
    """``kind`` is issue, wait, fwd_start, fwd_end, bwd_start or reduce; ``gathered`` the units
    holding memory at a compute start."""

    kind: str
    unit: int | None
    gathered: tuple[int, ...] = ()
    in_backward: bool = False  # recorded while the autograd engine ran (a recompute's forward)


class DeferredGather:
    """Stands for an all-gather whose values arrive only when someone waits for it."""

    def __init__(self, deliver: Callable[[], object], log: CollectiveLog, unit: int | None) -> None:
        self._deliver: Callable[[], object] | None = deliver
        self._log, self._unit = log, unit

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        self._log.events.append(Event("wait", self._unit))
        if self._deliver is not None:
            self._deliver()
            self._deliver = None
            self._log.pending -= 1
        return True

    def is_completed(self) -> bool:
        return self._deliver is None


@dataclass
class CollectiveLog:
    """``with CollectiveLog(sizes, defer) as log:`` records the all-gathers and reduce-scatters."""

    sizes: list[int]  # padded elements of each unit, to tell units apart
    defer: bool = False
    compute_buffers: Callable[[], set[int]] = lambda: set()  # data pointers of flat_params
    calls: list[Call] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    pending: int = 0  # deferred all-gathers not waited for
    _saved: list[tuple[str, Any]] = field(default_factory=list)

    def unit_of(self, numel: int) -> int | None:
        return self.sizes.index(numel) if numel in self.sizes else None

    def __enter__(self) -> CollectiveLog:
        gather, scatter = dist.all_gather_into_tensor, dist.reduce_scatter_tensor
        self._saved = [("all_gather_into_tensor", gather), ("reduce_scatter_tensor", scatter)]

        def all_gather(output: torch.Tensor, input: torch.Tensor, group: Any = None,
                       async_op: bool = False) -> Any:  # fmt: skip
            unit = self.unit_of(output.numel())
            held = output.untyped_storage().nbytes()
            if held < output.numel() * output.element_size():  # torch would write past it
                raise AssertionError(
                    f"all_gather_into_tensor into a tensor whose storage holds {held} bytes, "
                    f"{output.numel() * output.element_size()} needed: flat_param is freed (0 "
                    "bytes) until its storage is grown back (resize_ to padded_bytes) before "
                    "the gather"
                )
            self.calls.append(
                Call("all_gather", str(input.dtype).removeprefix("torch."), output.numel(),
                     async_op, unit, output.data_ptr() in self.compute_buffers())
            )  # fmt: skip
            self.events.append(Event("issue", unit, in_backward=in_backward()))
            if not (self.defer and async_op):
                return gather(output, input, group=group, async_op=async_op)
            arrived = torch.empty_like(output)
            gather(arrived, input, group=group)
            output.fill_(math.nan)
            self.pending += 1
            return DeferredGather(lambda: output.copy_(arrived), self, unit)

        def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: Any = dist.ReduceOp.SUM,
                           group: Any = None, async_op: bool = False) -> Any:  # fmt: skip
            unit = self.unit_of(input.numel())
            self.calls.append(
                Call("reduce_scatter", str(input.dtype).removeprefix("torch."), input.numel(),
                     async_op, unit)
            )  # fmt: skip
            self.events.append(Event("reduce", unit))
            return scatter(output, input, op=op, group=group, async_op=async_op)

        dist.all_gather_into_tensor = all_gather  # type: ignore[assignment]
        dist.reduce_scatter_tensor = reduce_scatter
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved:
            setattr(dist, name, original)


def watch_units(modules: list[nn.Module], units: list[Any], log: CollectiveLog) -> None:
    """Hooks registered after the wrapper's (so they see what its pre-hooks did) and, for the
    end of forward, before its forward hook (prepend: before it frees): a compute start records
    which units hold memory then."""

    def gathered() -> tuple[int, ...]:
        return tuple(i for i, u in enumerate(units) if u.flat_param.untyped_storage().nbytes())

    for i, module in enumerate(modules):
        module.register_forward_pre_hook(
            lambda *_, i=i: log.events.append(
                Event("fwd_start", i, gathered(), in_backward=in_backward())
            )
        )
        module.register_forward_hook(
            lambda *_, i=i: log.events.append(Event("fwd_end", i)), prepend=True
        )
        module.register_full_backward_pre_hook(
            lambda *_, i=i: log.events.append(Event("bwd_start", i, gathered()))
        )


# ----------------------------------------------------------------------------- inside the ranks


@dataclass
class WindowRun:
    """One prefetch window, float64, no mixed precision, gathers delivered at ``wait()``."""

    window: int
    value_problem: str | None = None
    error: str | None = None
    events: list[Event] = field(default_factory=list)  # the second step's (or the failed one's)
    calls: list[Call] = field(default_factory=list)
    unwaited: int = 0
    held: acc.ModelStateBytes | None = None
    psi: int = 0


def window_run(window: int) -> WindowRun:
    """Train ``STEPS`` steps in float64 with prefetch ``window``; record the second step."""
    fsdp = fsdp_module()
    rank, world = dist.get_rank(), dist.get_world_size()
    run = WindowRun(window, psi=sum(unit_sizes(world)))
    model = blocks_model(torch.float64)
    modules = list(model)
    model, optimizer = fsdp.fsdp_wrap(model, modules, adamw, None, window)
    want = one_process_float64(world)
    log = CollectiveLog(unit_sizes(world), defer=True)
    log.compute_buffers = lambda: {u.flat_param.data_ptr() for u in optimizer.units}
    watch_units(modules, optimizer.units, log)
    with log:
        for step in range(STEPS):
            first = len(log.events), len(log.calls)
            try:
                train_step(model, optimizer, step, rank, world, torch.float64, zero_grad=False)
            except NotImplementedError:
                raise  # an unwritten TODO: the harness names it
            except RuntimeError as err:
                run.error = (
                    f"step {step + 1} raised RuntimeError: {str(err).splitlines()[0]}"
                    + learner_line(err)
                )
                run.events, run.calls = log.events[first[0] :], log.calls[first[1] :]
                break
            if step == 1:
                run.events, run.calls = log.events[first[0] :], log.calls[first[1] :]
            if step == 0:
                run.held = acc.held_bytes(model, optimizer)
            optimizer.zero_grad()
            got = full_state(model, optimizer)
            diff, name = max_diff(got, want[step])
            if run.value_problem is None and not diff <= TOLERANCE_64:
                run.value_problem = (
                    f"after step {step + 1}, {name} "
                    + ("is NaN" if math.isnan(diff) else f"differs by {diff:.3e}")
                    + " from one process's AdamW on the whole batch (float64, tolerance "
                    f"{TOLERANCE_64})"
                )
    run.unwaited = log.pending
    return run


class Recomputed(nn.Module):
    """A block whose forward is checkpointed (2.3's ``checkpoint``, the reference's: this grades
    3.5, not 2.3): backward runs the block's forward again, and the block's hooks fire again."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> Any:
        from solutions.phase2_advanced.activation_checkpointing import checkpoint

        return checkpoint(self.block, x)


@dataclass
class RecomputeRun:
    """One prefetch window with every block checkpointed, float64, gathers delivered at wait()."""

    window: int
    value_problem: str | None = None
    error: str | None = None
    left_behind: list[int] = field(default_factory=list)  # units holding memory after backward
    issued_in_recompute: dict[int, int] = field(default_factory=dict)  # unit -> recomputed unit
    gathers: dict[int | None, int] = field(default_factory=dict)  # unit -> all-gathers, step 2
    step: int = 0  # the step after which the first problem showed


def recompute_issuers(events: list[Event], units: list[int]) -> dict[int, int]:
    """For each of ``units`` whose last all-gather was issued inside backward just before a
    recomputed forward began: that recomputed unit (the wrapper's pre-hook issues before the
    watcher's records the compute start)."""
    found = {}
    for unit in units:
        issued = [i for i, e in enumerate(events) if e.kind == "issue" and e.unit == unit]
        if not issued or not events[issued[-1]].in_backward:
            continue
        after = (e for e in events[issued[-1] :] if e.kind in ("fwd_start", "bwd_start"))
        start = next(after, None)
        if start is not None and start.kind == "fwd_start" and start.in_backward:
            found[unit] = start.unit
    return found  # type: ignore[return-value]


def recompute_run(window: int) -> RecomputeRun:
    """Train ``STEPS`` steps in float64 with prefetch ``window``, each block checkpointed."""
    fsdp = fsdp_module()
    rank, world = dist.get_rank(), dist.get_world_size()
    run = RecomputeRun(window)
    blocks = list(blocks_model(torch.float64))
    model = nn.Sequential(*[Recomputed(block) for block in blocks])
    model, optimizer = fsdp.fsdp_wrap(model, blocks, adamw, None, window)
    want = one_process_float64(world)
    log = CollectiveLog(unit_sizes(world), defer=True)
    watch_units(blocks, optimizer.units, log)
    with log:
        for step in range(STEPS):
            first = len(log.events)
            x, y = batch(step, world, torch.float64)
            mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            try:
                nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
            except NotImplementedError:
                raise  # an unwritten TODO: the harness names it
            except RuntimeError as err:
                run.error = (
                    f"step {step + 1} raised RuntimeError: {str(err).splitlines()[0]}"
                    + learner_line(err)
                )
                break
            events = log.events[first:]
            if step == 1:
                run.gathers = {}
                for event in events:
                    if event.kind == "issue":
                        run.gathers[event.unit] = run.gathers.get(event.unit, 0) + 1
            held = [i for i, u in enumerate(optimizer.units[: len(blocks)])
                    if u.flat_param.untyped_storage().nbytes() or u.work is not None]  # fmt: skip
            if held and not run.left_behind:
                run.left_behind, run.step = held, step + 1
                run.issued_in_recompute = recompute_issuers(events, held)
            optimizer.step()
            optimizer.zero_grad()
            diff, name = max_diff(
                {k.replace(".block", ""): v for k, v in full_state(model, optimizer).items()},
                want[step],
            )
            if run.value_problem is None and not diff <= TOLERANCE_64:
                run.value_problem = (
                    f"after step {step + 1}, {name} "
                    + ("is NaN" if math.isnan(diff) else f"differs by {diff:.3e}")
                    + " from one process's AdamW on the whole batch (float64, tolerance "
                    f"{TOLERANCE_64})"
                )
    return run


def full_state(model: nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
    from phase3_multi_node.zero_fsdp_support import full_master_state

    return full_master_state(model, optimizer.units)


@dataclass
class PolicyRun:
    """Ours and ``fully_shard`` with one policy: the largest difference, our step's calls."""

    policy: str
    diff: float = 0.0
    where: str = ""
    calls: list[Call] = field(default_factory=list)
    held: acc.ModelStateBytes | None = None
    psi: int = 0


def torch_fsdp_state(policy_name: str) -> dict[str, torch.Tensor]:
    """``fully_shard`` on every block and the root, the same policy, steps and data."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from phase3_multi_node.zero_fsdp_support import POLICIES

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = blocks_model()
    mp = POLICIES[policy_name].torch_policy()
    for block in model:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    optimizer = adamw(model.parameters())
    for step in range(STEPS):
        train_step(model, optimizer, step, rank, world, torch.float32)
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}  # type: ignore[attr-defined]


def policy_run(policy_name: str) -> PolicyRun:
    """Our wrapper (prefetch 1) against ``fully_shard``, fp32 masters, one policy."""
    from phase3_multi_node.zero_fsdp_support import POLICIES

    fsdp = fsdp_module()
    rank, world = dist.get_rank(), dist.get_world_size()
    run = PolicyRun(policy_name, psi=sum(unit_sizes(world)))
    want = torch_fsdp_state(policy_name)
    model = blocks_model()
    model, optimizer = fsdp.fsdp_wrap(model, list(model), adamw, POLICIES[policy_name], 1)
    log = CollectiveLog(unit_sizes(world))
    for step in range(STEPS):
        with log:
            first = len(log.calls)
            train_step(model, optimizer, step, rank, world, torch.float32, zero_grad=False)
        if step == 1:
            run.calls = log.calls[first:]
        if step == 0:
            run.held = acc.held_bytes(model, optimizer)
        optimizer.zero_grad()
    run.diff, run.where = max_diff(full_state(model, optimizer), want)
    return run


# ----------------------------------------------------------------------------- one unit alone


def unit_problems(policy_name: str) -> dict[str, str]:
    """``FsdpUnit``'s methods tried one by one on a throwaway block with rank-distinct values.
    Returns, per method, what it did wrong (empty when all behave)."""
    from phase3_multi_node.zero_fsdp_support import POLICIES

    units = units_module()
    policy = POLICIES[policy_name]
    rank, world = dist.get_rank(), dist.get_world_size()
    block = blocks_model()[0]
    unit = units.FsdpUnit(list(block.parameters()), policy, None)
    size, padded = unit.layout.shard_numel, unit.layout.padded_numel
    compute = policy.compute_dtype(torch.float32)
    reduce = policy.reduction_dtype(torch.float32)
    c_name, r_name = (str(d).removeprefix("torch.") for d in (compute, reduce))
    found: dict[str, str] = {}
    with torch.no_grad():
        unit.shard.copy_(torch.arange(size, dtype=torch.float32) / 64 + 1000 * (rank + 1))
    expected = torch.cat(
        [torch.arange(size, dtype=torch.float32) / 64 + 1000 * (r + 1) for r in range(world)]
    ).to(compute)
    log = CollectiveLog([padded], defer=True, compute_buffers=lambda: {unit.flat_param.data_ptr()})
    with log:
        try:
            unit.start_gather()
        except RuntimeError as exc:
            if "invalid tensor type" not in str(exc):
                raise
            # gloo refuses an all-gather whose input and output dtypes differ (every rank
            # does, so every rank returns here)
            found["start_gather"] = (
                "FsdpUnit.start_gather() all-gathered this rank's shard in its master dtype "
                f"(float32) into flat_param, which holds {c_name}: cast the shard to "
                f"param_dtype BEFORE the all-gather, so each element travels in "
                f"{compute.itemsize} bytes and lands in flat_param's dtype (the backend said: "
                f"{str(exc).splitlines()[0][:120]})"
            )
            return found
        started = list(log.calls)
        storage = unit.flat_param.untyped_storage().nbytes()
        unit.start_gather()  # a second call must start nothing
        again = len(log.calls) - len(started)
        unit.wait_gather()
    if not started:
        found["start_gather"] = (
            "FsdpUnit.start_gather() issued no all_gather_into_tensor: it must start the gather "
            "itself (wait_gather only waits)"
        )
    else:
        call = started[0]
        if call.dtype != c_name:
            found["start_gather"] = (
                f"FsdpUnit.start_gather() all-gathered {call.dtype} elements; the compute dtype "
                f"is {c_name}: cast this rank's shard to param_dtype BEFORE the all-gather, so "
                f"each element travels in {compute.itemsize} bytes (casting after gathering "
                "moves the master's 4 bytes per element: the same values, twice the traffic)"
            )
        elif not call.asynchronous:
            found["start_gather"] = (
                "FsdpUnit.start_gather() waited for its all-gather (async_op=False): it must "
                "issue it with async_op=True and keep the Work, so the gather travels while the "
                "previous unit computes"
            )
        elif not call.to_compute_buffer:
            found["start_gather"] = (
                "FsdpUnit.start_gather() gathered into another tensor than flat_param: the "
                "parameters are views of flat_param, so the gather must fill it"
            )
        elif storage != unit.padded_bytes:
            found["start_gather"] = (
                f"after start_gather() flat_param's storage held {storage} bytes; expected "
                f"padded_bytes = {unit.padded_bytes}: grow it before gathering into it"
            )
        elif again:
            found["start_gather"] = (
                "a second start_gather() on a unit whose gather was in flight issued another "
                "all-gather: return when the unit is gathered or a work is pending"
            )
    if "start_gather" not in found and log.pending:
        found["wait_gather"] = (
            "FsdpUnit.wait_gather() returned without waiting for the all-gather start_gather "
            "issued: until its Work's wait() returns, flat_param may hold anything (here: NaN)"
        )
    elif "start_gather" not in found and not torch.equal(unit.flat_param, expected):
        found["wait_gather"] = (
            "after start_gather() and wait_gather(), flat_param did not hold every rank's shard "
            f"cast to {c_name}, in rank order"
        )
    elif "start_gather" not in found and unit.work is not None:
        found["wait_gather"] = (
            "after wait_gather() the unit still keeps its Work: forget it (and the tensor it "
            "sent), or the next start_gather() thinks a gather is in flight"
        )
    if "start_gather" not in found and "wait_gather" not in found:
        unit.free()
        with CollectiveLog([padded], defer=True) as cold:
            unit.wait_gather()
        if len([c for c in cold.calls if c.op == "all_gather"]) != 1 or cold.pending:
            found["wait_gather"] = (
                "wait_gather() on a unit nobody prefetched did not gather it (and wait): a "
                "unit outside every prefetch window is gathered on demand"
            )
        unit.free()
    # reduced_gradient: rank-distinct gradients in the compute dtype
    grad = (torch.arange(padded, dtype=torch.float32) % 17 / 8 + rank + 1).to(compute)
    total = torch.zeros(padded, dtype=torch.float64)
    for r in range(world):
        total += (torch.arange(padded, dtype=torch.float32) % 17 / 8 + r + 1).to(compute).double()
    want = (total[rank * size : (rank + 1) * size] / world).float()
    with CollectiveLog([padded]) as log2:
        got = unit.reduced_gradient(grad.clone())
    scatters = [c for c in log2.calls if c.op == "reduce_scatter"]
    if not isinstance(got, torch.Tensor) or got.shape != (size,):
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        found["reduced_gradient"] = (
            f"FsdpUnit.reduced_gradient returned {shape}; expected this rank's slice "
            f"({size} elements)"
        )
    elif not scatters:
        found["reduced_gradient"] = (
            "FsdpUnit.reduced_gradient called no reduce_scatter_tensor: each rank must receive "
            "only its slice of the summed gradient"
        )
    elif scatters[0].dtype != r_name:
        found["reduced_gradient"] = (
            f"FsdpUnit.reduced_gradient reduce-scattered {scatters[0].dtype} elements; the "
            f"policy's reduce dtype is {r_name}: cast the gradient to reduce_dtype before the "
            "reduce-scatter (the sum is computed in the dtype the collective carries)"
        )
    elif got.dtype != torch.float32:
        found["reduced_gradient"] = (
            f"FsdpUnit.reduced_gradient returned {str(got.dtype).removeprefix('torch.')}; the "
            "master shard is float32: cast the reduced slice back to the master dtype (the "
            "optimizer steps fp32 master weights with an fp32 gradient)"
        )
    elif not torch.allclose(got, want, rtol=1e-2, atol=0):
        summed = torch.allclose(got, want * world, rtol=1e-2, atol=0)
        found["reduced_gradient"] = (
            f"FsdpUnit.reduced_gradient returned values {got[:3].tolist()}...; expected slice "
            f"{rank} of the mean over {world} ranks {want[:3].tolist()}..."
            + (": that is the sum, divide by the group size (divide_factors splits the "
               "division around the reduce-scatter)" if summed else "")
        )  # fmt: skip
    return with_sites(found, type(unit))
