"""What the 3.6 grader runs inside its ranks, and the single-process references it compares with.

One world per (dp, tp, pp) layout records everything the grader checks, so each layout costs one
world: the parameters this rank's stage holds right after it was built and after each of
``STEPS`` SGD steps, the losses of the last stage, the sizes of the micro-batches its first block
saw, and every message of one steady-state step (the second: the first also infers shapes on the
meta device). The parent process builds the dense model, trains it on one process, cuts the
expected shard of every rank out of it (independently of the code under test) and compares.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from grading import load
from torch import nn

from course.comm_counter import CommCounter
from course.topology import Topology
from solutions.phase2_advanced.tensor_parallel import DenseMLP

PHASE = "phase3_multi_node"
HIDDEN, FFN, BLOCKS = 8, 16, 4
GLOBAL_BATCH, MICROBATCHES = 16, 2
STEPS, LR, SEED = 3, 0.5, 0
TOLERANCE = 1e-10
ELEMENT = 8  # float64


def parallel_3d_module() -> Any:
    return load(PHASE, "parallel_3d")


def dense_model() -> nn.Sequential:
    """The reference stack, built here (not with the code under test's ``dense_stack``)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        blocks = [DenseMLP(HIDDEN, FFN) for _ in range(BLOCKS)]
    return nn.Sequential(*blocks).double()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(GLOBAL_BATCH, HIDDEN, generator=g, dtype=torch.float64)
    return x, torch.randn(GLOBAL_BATCH, HIDDEN, generator=g, dtype=torch.float64)


# ----------------------------------------------------------------------------- inside the ranks


@dataclass
class Run3D:
    """What one rank saw and did."""

    coords: tuple[int, int, int] = (0, 0, 0)  # (pp, dp, tp)
    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)
    shards: list[dict[str, torch.Tensor]] = field(default_factory=list)  # after build, each step
    losses: list[float | None] = field(default_factory=list)
    microbatch_sizes: list[list[int]] = field(default_factory=list)  # per step
    microbatch_sums: list[list[float]] = field(default_factory=list)  # per step: input sums
    records: list[tuple[str, int, tuple[int, ...] | None, int | None]] = field(
        default_factory=list
    )  # (op, bytes, group ranks, peer) of step 2
    grad_bytes: int = 0


def _snapshot(stage: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in stage.named_parameters()}


def run_3d(dp: int, tp: int, pp: int) -> Run3D:
    """Build the 3D model on this rank and train it ``STEPS`` steps on the global batches."""
    p3d = parallel_3d_module()
    topology = Topology.build(dp, tp, pp)
    here = topology.coords
    pp_rank, dp_rank, tp_rank = here.pp, here.dp, here.tp
    groups = {n: topology.group_ranks(n) for n in ("dp", "tp", "pp")}
    run = Run3D((pp_rank, dp_rank, tp_rank), groups)
    model = p3d.Parallel3D(dense_model(), topology, MICROBATCHES, LR, schedule="1f1b")
    stage = model.stage
    run.shards.append(_snapshot(stage))
    run.grad_bytes = sum(p.numel() * p.element_size() for p in stage.parameters())
    sizes: list[int] = []
    sums: list[float] = []
    first = next(iter(stage.children()), stage)

    def record_input(_module: nn.Module, args: tuple[Any, ...]) -> None:
        if args and isinstance(args[0], torch.Tensor) and args[0].device.type != "meta":
            sizes.append(int(args[0].shape[0]))
            sums.append(float(args[0].detach().sum()))

    first.register_forward_pre_hook(record_input)
    for step in range(STEPS):
        x, y = batch(step)
        sizes.clear()
        sums.clear()
        with CommCounter() as counter:
            loss = model.train_step(x, y)
        run.microbatch_sizes.append(list(sizes))
        run.microbatch_sums.append(list(sums))
        if step == 1:
            run.records = [(r.op, r.nbytes, r.group_ranks, r.peer) for r in counter.records]
        run.losses.append(loss)
        run.shards.append(_snapshot(stage))
    dist.barrier()
    return run


# ----------------------------------------------------------------------------- the references


def microbatch_sums(step: int, dp: int) -> list[list[float]]:
    """For each replica, the sums of its micro-batches' inputs in ``step`` (what stage 0 of
    that replica must feed its first block)."""
    x = batch(step)[0]
    share, micro = GLOBAL_BATCH // dp, GLOBAL_BATCH // dp // MICROBATCHES
    return [
        [
            float(x[d * share + j * micro : d * share + (j + 1) * micro].sum())
            for j in range(MICROBATCHES)
        ]
        for d in range(dp)
    ]


def train_dense(
    steps: int = STEPS, grad_scale: float = 1.0, replica0_of: int = 1
) -> tuple[list[nn.Sequential], list[float]]:
    """One process: the model after 0..steps SGD steps, and the loss of each step.

    ``grad_scale`` multiplies the gradient (dp: what summing instead of averaging gives);
    ``replica0_of`` > 1 trains on replica 0's slice only (every replica fed the same data)."""
    model = dense_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    states, losses = [_copy(model)], []
    for step in range(steps):
        x, y = batch(step)
        size = GLOBAL_BATCH // replica0_of
        x, y = x[:size], y[:size]
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        (grad_scale * loss).backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        states.append(_copy(model))
    return states, losses


def _copy(model: nn.Sequential) -> nn.Sequential:
    clone = dense_model()
    clone.load_state_dict(model.state_dict())
    return clone


def expected_shard(dense: nn.Sequential, block: int, tp_rank: int, tp: int) -> dict[str, Any]:
    """Block ``block``'s parameters as tp rank ``tp_rank`` of ``tp`` must hold them."""
    mlp = cast(DenseMLP, dense[block])
    w = FFN // tp
    rows = slice(tp_rank * w, (tp_rank + 1) * w)
    return {
        "fc1.weight": mlp.fc1.weight.detach()[rows],
        "fc1.bias": mlp.fc1.bias.detach()[rows],
        "fc2.weight": mlp.fc2.weight.detach()[:, rows],
        "fc2.bias": mlp.fc2.bias.detach(),
    }


def expected_stage(dense: nn.Sequential, coords: tuple[int, int, int], tp: int, pp: int) -> dict:
    """Every parameter this rank's stage must hold, named as ``nn.Sequential`` of
    ``ParallelMLP`` names them ("0.fc1.weight", ...)."""
    stage, _, tp_rank = coords
    per = BLOCKS // pp
    out = {}
    for local in range(per):
        for name, tensor in expected_shard(dense, stage * per + local, tp_rank, tp).items():
            out[f"{local}.{name}"] = tensor
    return out


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    worst, where = 0.0, ""
    for name, tensor in want.items():
        mine = got.get(name)
        if mine is None or mine.shape != tensor.shape:
            return float("inf"), name
        diff = float((mine - tensor).abs().max()) if tensor.numel() else 0.0
        if diff > worst:
            worst, where = diff, name
    return worst, where
