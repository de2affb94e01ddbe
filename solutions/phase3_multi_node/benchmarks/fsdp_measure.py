"""Measurements of 3.5's FSDP-style ZeRO-3 and of frozen parameters, for the benchmark and
``tests.bench 3.5``: bytes per step per dtype against the formula, gathered bytes against the
prefetch window, the same training beside ``fully_shard`` (largest difference, step time in the
same run), and the bytes ZeRO holds for a model with a frozen layer.

The model is 3.5's benchmark MLP (fp32); every Linear is one unit. Workers run inside
``course.world.run_world`` and return plain data; the tables are made by the callers.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from course.impl import load_impl
from course.models import MLP
from phase3_multi_node.zero_fsdp_support import POLICIES, full_master_state
from solutions.phase3_multi_node.references import zero_accounting as acc

PHASE = "phase3_multi_node"
IN_FEATURES = 256
PER_RANK = 16


def make_mlp(hidden: int) -> nn.Sequential:
    torch.manual_seed(0)
    return MLP(IN_FEATURES, hidden=hidden, depth=3)


def linears(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def _data(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(PER_RANK * world, IN_FEATURES, generator=g)
    return x, torch.randint(10, (PER_RANK * world,), generator=g)


def _step(model: nn.Module, optimizer: Any, step: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = _data(step, world)
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    nn.functional.cross_entropy(model(x[mine]).float(), y[mine]).backward()
    optimizer.step()


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def _torch_fsdp(hidden: int, policy: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = make_mlp(hidden)
    mp = POLICIES[policy].torch_policy()
    for layer in linears(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model, _adamw(model.parameters())


def policy_worker(hidden: int, steps: int, impl: str) -> list[dict[str, Any]]:
    """Per policy: ours (prefetch 1) and fully_shard trained ``steps`` steps on the same data,
    timed in turn; our bytes per dtype in the second step; the largest parameter difference."""
    fsdp = load_impl(PHASE, "zero_fsdp", impl)
    world = dist.get_world_size()
    out = []
    for name, policy in POLICIES.items():
        plain = make_mlp(hidden)
        ours, ours_opt = fsdp.fsdp_wrap(plain, linears(plain), _adamw, policy, 1)
        theirs, theirs_opt = _torch_fsdp(hidden, name)
        times: dict[str, list[float]] = {"ours": [], "fully_shard": []}
        comm: dict[str, dict[str, int]] = {}
        for step in range(steps):
            for who, model, optimizer in (("ours", ours, ours_opt), ("fully_shard", theirs,
                                                                      theirs_opt)):  # fmt: skip
                dist.barrier()
                start = time.perf_counter()
                with acc.DtypeCounter() as counter:
                    _step(model, optimizer, step)
                times[who].append(time.perf_counter() - start)
                if who == "ours" and step == 1:
                    assert counter.by_op is not None
                    comm = counter.by_op
                optimizer.zero_grad()
        got = full_master_state(ours, ours_opt.units)
        want = {n: p.full_tensor().detach() for n, p in theirs.named_parameters()}  # type: ignore[attr-defined]
        diff = max(float((got[n] - want[n]).abs().max()) for n in want)
        psi = sum(u.layout.padded_numel for u in ours_opt.units)
        compute = policy.compute_dtype(torch.float32)
        reduce = policy.reduction_dtype(torch.float32)
        out.append({
            "world": world, "policy": name, "describe": policy.describe(), "psi": psi,
            "comm": comm, "formula": acc.fsdp_formula_volume(psi, compute, reduce),
            "diff": diff, "ours_ms": 1e3 * statistics.median(times["ours"][1:]),
            "torch_ms": 1e3 * statistics.median(times["fully_shard"][1:]),
        })  # fmt: skip
    return out


def window_worker(hidden: int, impl: str, policy: str = "bf16-fp32") -> list[dict[str, Any]]:
    """Per prefetch window (0, 1, 2, every unit): the largest bytes of gathered parameters at
    any unit's compute start in one step (counted storages, not timing), against the formula."""
    fsdp = load_impl(PHASE, "zero_fsdp", impl)
    out = []
    units_count = len(linears(make_mlp(hidden)))
    for window in (0, 1, 2, units_count):
        model = make_mlp(hidden)
        layers = linears(model)
        model, optimizer = fsdp.fsdp_wrap(model, layers, _adamw, POLICIES[policy], window)
        seen: list[int] = []

        def measure(*_: Any, seen: list[int] = seen, units: list[Any] = optimizer.units) -> None:
            seen.append(sum(u.flat_param.untyped_storage().nbytes() for u in units))

        for layer in layers:  # after the wrapper's hooks: what its pre-hooks left gathered
            layer.register_forward_pre_hook(measure)
            layer.register_full_backward_pre_hook(measure)
        _step(model, optimizer, 0)
        optimizer.zero_grad()
        sizes = [u.padded_bytes for u in optimizer.units]
        out.append({"world": dist.get_world_size(), "window": window, "units": len(sizes),
                    "peak": max(seen), "formula": acc.window_peak(sizes, window),
                    "all": sum(sizes)})  # fmt: skip
    return out


def frozen_worker(hidden: int, impl: str) -> list[dict[str, Any]]:
    """ZeRO stages 1-3 on the MLP with its first Linear frozen: bytes held after a step against
    the formulas with the frozen parameters whole on every rank (Φ)."""
    zero = load_impl(PHASE, "zero", impl)
    world = dist.get_world_size()
    out = []
    for stage in (1, 2, 3):
        model = make_mlp(hidden)
        linears(model)[0].requires_grad_(False)
        model, optimizer = zero.zero_wrap(model, _adamw, stage)
        _step(model, optimizer, 0)
        psi, frozen = acc.padded_psi(model, world), acc.frozen_numel(model)
        out.append({"world": world, "stage": stage, "psi": psi, "frozen": frozen,
                    "held": acc.held_bytes(model, optimizer),
                    "formula": acc.formula_bytes(stage, psi, world, frozen=frozen)})  # fmt: skip
        optimizer.zero_grad()
    return out


# ----------------------------------------------------------------------------- tables


def _kib(nbytes: float) -> str:
    return f"{nbytes / 1024:.1f}"


def _per_dtype(counts: dict[str, int]) -> str:
    return " + ".join(f"{_kib(n)} {dtype}" for dtype, n in sorted(counts.items())) or "0"


def policy_table(rows: list[dict[str, Any]]) -> Any:
    from course.results import Table

    table = Table(["N", "policy", "Ψ (padded)", "all-gathers KiB (formula)",
                   "reduce-scatters KiB (formula)", "total vs fp32",
                   "largest difference from fully_shard", "ours ms", "fully_shard ms"])  # fmt: skip
    fp32 = {r["world"]: _total(r["comm"]) for r in rows if r["policy"] == "off"}
    for r in rows:
        ag, rs = r["comm"].get("all_gather", {}), r["comm"].get("reduce_scatter", {})
        fag, frs = r["formula"]["all_gather"], r["formula"]["reduce_scatter"]
        table.add(
            r["world"], f"{r['policy']} ({r['describe']})", r["psi"],
            f"{_per_dtype(ag)} ({'equal' if ag == fag else _per_dtype(fag)})",
            f"{_per_dtype(rs)} ({'equal' if rs == frs else _per_dtype(frs)})",
            f"{_total(r['comm']) / fp32[r['world']]:.2f}x",
            "0 (bitwise)" if r["diff"] == 0 else f"{r['diff']:.1e}",
            f"{r['ours_ms']:.1f}", f"{r['torch_ms']:.1f}",
        )  # fmt: skip
    return table


def _total(comm: dict[str, dict[str, int]]) -> int:
    return sum(n for per_dtype in comm.values() for n in per_dtype.values())


def window_table(rows: list[dict[str, Any]]) -> Any:
    from course.results import Table

    table = Table(["N", "prefetch window", "peak gathered KiB", "formula KiB",
                   "whole model KiB"])  # fmt: skip
    for r in rows:
        window = f"{r['window']} (every unit)" if r["window"] >= r["units"] else r["window"]
        table.add(r["world"], window, _kib(r["peak"]), _kib(r["formula"]), _kib(r["all"]))
    return table


def frozen_table(rows: list[dict[str, Any]]) -> Any:
    from course.results import Table

    table = Table(["N", "stage", "Ψ trainable (padded)", "Φ frozen", "params KiB", "grads KiB",
                   "optimizer KiB", "formula KiB (p/g/opt)", "equal"])  # fmt: skip
    for r in rows:
        held, want = r["held"], r["formula"]
        formula = f"{_kib(want.params)}/{_kib(want.grads)}/{_kib(want.optimizer)}"
        table.add(r["world"], r["stage"], r["psi"], r["frozen"], _kib(held.params),
                  _kib(held.grads), _kib(held.optimizer), formula,
                  "yes" if held == want else "NO")  # fmt: skip
    return table


def summary(policies: list[dict[str, Any]], windows: list[dict[str, Any]],
            frozen: list[dict[str, Any]]) -> dict[str, str]:  # fmt: skip
    """Counts the guide quotes: rows equal to their formula, bitwise agreements, the largest
    difference of the 16-bit reductions on more than 2 ranks, the traffic of bf16 gathers."""
    bytes_equal = sum(r["comm"] == r["formula"] for r in policies)
    two = [r for r in policies if r["world"] == 2]
    more = [r for r in policies if r["world"] > 2]
    fp32_reduce_more = [r for r in more if r["policy"] in ("off", "bf16-fp32")]
    sixteen_more = [r for r in more if r["policy"] in ("bf16", "fp16")]
    fp32 = {r["world"]: _total(r["comm"]) for r in policies if r["policy"] == "off"}
    mixed = [_total(r["comm"]) / fp32[r["world"]] for r in policies if r["policy"] == "bf16-fp32"]
    return {
        "fsdp_bytes_equal": f"{bytes_equal} of {len(policies)}",
        "fsdp_bitwise_2": f"{sum(r['diff'] == 0 for r in two)} of {len(two)}",
        "fsdp_fp32_reduce_more": f"{max((r['diff'] for r in fp32_reduce_more), default=0):.1e}",
        "fsdp_16bit_reduce_more": f"{max((r['diff'] for r in sixteen_more), default=0):.1e}",
        "fsdp_mixed_traffic": f"{max(mixed, default=0):.2f}x",
        "fsdp_speed": (
            f"{min(r['ours_ms'] / r['torch_ms'] for r in policies):.2f}-"
            f"{max(r['ours_ms'] / r['torch_ms'] for r in policies):.2f}x"
        ),
        "fsdp_windows_equal": (
            f"{sum(r['peak'] == r['formula'] for r in windows)} of {len(windows)}"
        ),
        "frozen_equal": f"{sum(r['held'] == r['formula'] for r in frozen)} of {len(frozen)}",
    }


def measure_worker(hidden: int, steps: int, impl: str, with_fsdp: bool) -> dict[str, Any]:
    """The frozen-layer rows and, when ``with_fsdp``, the policy and window rows: one world."""
    out: dict[str, Any] = {"frozen": frozen_worker(hidden, impl), "policies": [], "windows": []}
    if with_fsdp:
        out["policies"] = policy_worker(hidden, steps, impl)
        out["windows"] = window_worker(hidden, impl)
    return out
