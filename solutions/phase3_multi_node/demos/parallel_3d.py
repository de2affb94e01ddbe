"""Demo of exercise 3.6: train a stack of MLP blocks with data x tensor x pipeline parallelism.

Every rank builds the same dense stack from one seed, cuts its own part out of it (its pipeline
stage's blocks, its tensor-parallel shard of each), and trains a few SGD steps on random data
with ``Parallel3D``. It prints the grid (which rank sits at which (pp, dp, tp) coordinate), what
each rank holds, every step's loss next to the loss of the dense model trained on one process,
and the messages of one step per rank, sorted by the group they used (counted with
``CommCounter``). ``--impl templates`` runs your own ``phase3_multi_node/template_parallel_3d.py``
(on your phase 1 and 2 templates).

    uv run torchrun --standalone --nproc_per_node=4 \
        -m solutions.phase3_multi_node.demos.parallel_3d --dp 2 --tp 2 --pp 1
    uv run torchrun --standalone --nproc_per_node=4 \
        -m solutions.phase3_multi_node.demos.parallel_3d --dp 1 --tp 2 --pp 2 --impl templates
    uv run torchrun --standalone --nproc_per_node=8 \
        -m solutions.phase3_multi_node.demos.parallel_3d --dp 2 --tp 2 --pp 2

Degrees that do not multiply to the world size, or do not divide the model or the batch, are
refused before the process group exists, each named with a fix.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course.cli import parse_config, refuse_before_start, run_main
from course.comm_counter import POINT_TO_POINT_OPS, CommCounter, CommRecord
from course.distributed import distributed_session
from course.impl import IMPLS, load_impl
from course.rank_logging import log0
from course.topology import Topology
from solutions.phase3_multi_node.parallel_3d import SCHEDULES, StackConfig, check_layout

PHASE = "phase3_multi_node"


@dataclass
class DemoConfig:
    """Flags of the demo; every rank must be given the same values."""

    dp: int = field(
        default=-1,
        metadata={
            "help": "data-parallel degree; -1: what tp x pp leave",
            "ge": -1,
            "le": 1024,
            "fix": "-1 (what tp x pp leave) or a degree >= 1",
        },
    )
    tp: int = field(
        default=1,
        metadata={"help": "tensor-parallel degree", "ge": 1, "le": 1024, "fix": "e.g. --tp 2"},
    )
    pp: int = field(
        default=1,
        metadata={
            "help": "pipeline-parallel degree (stages)",
            "ge": 1,
            "le": 1024,
            "fix": "e.g. --pp 2",
        },
    )
    hidden: int = field(
        default=16, metadata={"ge": 1, "le": 8192, "fix": "a width from 1 to 8192, e.g. 16"}
    )
    ffn_hidden: int = field(
        default=64,
        metadata={
            "help": "inner width of each MLP block",
            "ge": 1,
            "le": 32768,
            "fix": "a multiple of --tp, e.g. 64",
        },
    )
    blocks: int = field(
        default=4,
        metadata={
            "help": "MLP blocks in the stack",
            "ge": 1,
            "le": 1024,
            "fix": "a multiple of --pp, e.g. 4",
        },
    )
    global_batch: int = field(
        default=32,
        metadata={
            "help": "samples per step, all replicas",
            "ge": 1,
            "le": 1 << 16,
            "fix": "a multiple of dp x --microbatches, e.g. 32",
        },
    )
    microbatches: int = field(
        default=4,
        metadata={
            "help": "micro-batches per replica",
            "ge": 1,
            "le": 4096,
            "fix": "e.g. --microbatches 4",
        },
    )
    steps: int = field(
        default=5, metadata={"ge": 1, "le": 10000, "fix": "1 to 10000 steps, e.g. 5"}
    )
    lr: float = field(
        default=0.1,
        metadata={"gt": 0, "le": 100, "fix": "a positive learning rate, e.g. 0.1"},
    )
    schedule: str = field(default="1f1b", metadata={"choices": SCHEDULES})
    seed: int = field(default=0, metadata={"ge": 0, "fix": "a seed >= 0, e.g. 0"})
    impl: str = field(
        default="solutions",
        metadata={"choices": IMPLS, "help": "run the reference or your phase3 templates"},
    )

    @property
    def stack(self) -> StackConfig:
        return StackConfig(self.hidden, self.ffn_hidden, self.blocks)


def validate(config: DemoConfig, world_size: int) -> None:
    """Every bad flag at once, naming each: raised before the process group exists."""
    problems = [
        f"--{name.replace('_', '-')} {getattr(config, name)} must be >= 1"
        for name in ("hidden", "ffn_hidden", "blocks", "global_batch", "microbatches", "steps")
        if getattr(config, name) < 1
    ]
    if config.lr <= 0:
        problems.append(f"--lr {config.lr} must be > 0")
    if config.dp == 0 or config.dp < -1:
        problems.append(f"--dp {config.dp}: give -1 (what tp x pp leave) or a degree >= 1")
    if not problems:
        try:
            check_layout(
                world_size,
                config.dp,
                config.tp,
                config.pp,
                config.stack,
                config.global_batch,
                config.microbatches,
            )
        except ValueError as err:
            problems.append(str(err))
    if problems:
        raise ValueError("; ".join(problems))


def synthetic_batch(step: int, config: DemoConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: the same random inputs and targets on every rank."""
    g = torch.Generator().manual_seed(1000 * config.seed + step)
    shape = (config.global_batch, config.hidden)
    return (
        torch.randn(shape, generator=g, dtype=torch.float64),
        torch.randn(shape, generator=g, dtype=torch.float64),
    )


def group_kind(record: CommRecord, topology: Topology, grad_bytes: int) -> str:
    """Which of this rank's groups a message used: "dp", "tp", "pp", or "outside"."""
    if record.op in POINT_TO_POINT_OPS:
        return "pp" if record.peer in topology.group_ranks("pp") else "outside"
    members = record.group_ranks or tuple(range(topology.world_size))
    matches = [name for name in ("dp", "tp", "pp") if topology.group_ranks(name) == members]
    if len(matches) > 1:  # one-rank groups coincide: the gradient average is the dp one
        return "dp" if record.nbytes == grad_bytes and "dp" in matches else matches[-1]
    return matches[0] if matches else "outside"


def comm_rows(
    records: Sequence[CommRecord], topology: Topology, grad_bytes: int
) -> list[tuple[str, str, str, int, int]]:
    """(group kind, its ranks, op, calls, bytes) per kind and op, in a fixed order."""
    totals: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for record in records:
        key = (group_kind(record, topology, grad_bytes), record.op)
        totals[key][0] += 1
        totals[key][1] += record.nbytes
    order = {"tp": 0, "dp": 1, "pp": 2, "outside": 3}
    rows = []
    for (kind, op), (calls, nbytes) in sorted(totals.items(), key=lambda kv: order[kv[0][0]]):
        ranks = str(topology.group_ranks(kind)) if kind != "outside" else "-"
        rows.append((kind, ranks, op, calls, nbytes))
    return rows


def run_demo(config: DemoConfig) -> dict[str, Any]:
    """Train and report, inside an initialised process group; returns what rank 0 printed."""
    p3d = load_impl(PHASE, "parallel_3d", config.impl)
    topology = Topology.build(config.dp, config.tp, config.pp)
    dense = p3d.dense_stack(config.stack, seed=config.seed)
    reference = copy.deepcopy(dense)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=config.lr)
    model = p3d.Parallel3D(dense, topology, config.microbatches, config.lr, config.schedule)
    per_stage = len(model.stage)
    first = topology.pp_rank * per_stage
    block = model.stage[0] if per_stage else None
    shards = (
        ", ".join(f"{n} {'x'.join(map(str, p.shape))}" for n, p in block.named_parameters())
        if block is not None
        else "-"
    )
    grad_bytes = sum(p.numel() * p.element_size() for p in model.stage.parameters())
    log0(
        f"3D parallelism ({config.impl}): {config.blocks} MLP blocks {config.hidden} -> "
        f"{config.ffn_hidden} -> {config.hidden} (float64), global batch {config.global_batch}, "
        f"{config.microbatches} micro-batches per replica, {config.schedule}, SGD lr {config.lr}"
    )
    log0(topology.grid.describe())
    holding = {
        "rank": topology.rank,
        "coords": tuple(topology.coords),
        "blocks": f"{first}-{first + per_stage - 1}" if per_stage else "-",
        "shards": shards,
    }
    everyone: list[dict[str, Any] | None] = [None] * topology.world_size
    dist.all_gather_object(everyone, holding)
    log0("\nwhat each rank holds (one ParallelMLP per block; shapes of each block's shard):\n")
    log0("| rank | (pp, dp, tp) | blocks | shard of each block |\n|---:|---|---|---|")
    for row in everyone:
        assert row is not None
        log0(f"| {row['rank']} | {row['coords']} | {row['blocks']} | {row['shards']} |")
    losses: list[tuple[float, float]] = []
    log0("\n| step | loss (3D) | loss (one process) | difference |\n|---:|---:|---:|---:|")
    records: list[CommRecord] = []
    shown = min(1, config.steps - 1)  # a steady step: the first also infers shapes
    for step in range(config.steps):
        x, y = synthetic_batch(step, config)
        with CommCounter() as counter:
            loss = model.train_step(x, y)
        if step == shown:
            records = list(counter.records)
        mine = loss if loss is not None and topology.is_last_stage and topology.tp_rank == 0 else 0
        total = torch.tensor([float(mine)], dtype=torch.float64)
        dist.all_reduce(total)
        ours = float(total) / topology.dp_size
        reference_optimizer.zero_grad()
        reference_loss = F.mse_loss(reference(x), y)
        reference_loss.backward()
        reference_optimizer.step()
        want = float(reference_loss.detach())
        losses.append((ours, want))
        log0(f"| {step} | {ours:.12f} | {want:.12f} | {abs(ours - want):.1e} |")
    rows: list[dict[str, Any] | None] = [None] * topology.world_size
    mine_row = {**holding, "comm": comm_rows(records, topology, grad_bytes)}
    dist.all_gather_object(rows, mine_row)
    ranks = [row for row in rows if row is not None]
    log0(f"\nmessages of step {shown} per rank, by group (bytes handed to torch.distributed):")
    log0("\n| rank | group | its ranks | op | calls | bytes |\n|---:|---|---|---|---:|---:|")
    for row in ranks:
        for kind, members, op, calls, nbytes in row["comm"]:
            log0(f"| {row['rank']} | {kind} | {members} | {op} | {calls} | {nbytes} |")
    outside = [row["rank"] for row in ranks if any(r[0] == "outside" for r in row["comm"])]
    log0(
        "\nno message left its rank's dp, tp and pp groups"
        if not outside
        else f"\nranks {outside} sent messages outside their dp, tp and pp groups"
    )
    return {
        "losses": losses,
        "max_loss_diff": max(abs(a - b) for a, b in losses),
        "ranks": ranks,
    }


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(DemoConfig, argv, __doc__)
    if (code := refuse_before_start(lambda world: validate(config, world))) is not None:
        return code
    with distributed_session():
        run_demo(config)
    return 0


if __name__ == "__main__":
    run_main(main)
