# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase3.py
"""Exercise 3.6: 3D parallelism, data x tensor x pipeline, on the groups of one ``Topology``.

Each kind of parallelism alone hits a wall: data parallelism keeps a whole model per rank,
tensor parallelism all-reduces activations in every layer (fine inside a node, too slow across
nodes), pipeline parallelism idles (p-1)/(m+p-1) of each step in its bubble. Megatron-LM's
"PTD-P" (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC 2021, sections 2-3) combines the three, each on its own process groups of the
(pp, dp, tp) grid that ``course/topology.py`` lays out:

* **tensor** (tp, innermost, adjacent ranks): every block of a stage is phase 2's
  ``ParallelMLP``, one all-reduce forward and one backward per block and micro-batch;
* **pipeline** (pp, outermost): the blocks are cut into pp stages, run by phase 2's
  ``PipelineExecutor`` on ``topology.pp_group``;
* **data** (dp): each replica of the whole (pipelined, tensor-parallel) model trains on its own
  part of the global batch, and every replica must apply the same update.

Which ranks hold what, and which group each reduction runs on, is the exercise: the contract and
the questions are in guidelines.md#36-3d-parallelism.

The model is a stack of Megatron MLP blocks (``DenseMLP``: Linear, GELU, Linear), built dense
from one seed so that one process can compute the reference; the 3D model is cut from its
weights. Use::

    topology = Topology.build(dp=2, tp=2, pp=2)            # on every rank
    model = Parallel3D(dense_stack(StackConfig(), seed=0), topology, num_microbatches=4, lr=0.1)
    loss = model.train_step(inputs, targets)               # the GLOBAL batch, on every rank
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from course.topology import RankGrid, Topology
from phase1_data_parallel.template_trainer import average_gradients
from phase2_advanced.template_pipeline_executor import PipelineExecutor
from phase2_advanced.template_pipeline_schedules import make_schedule
from phase2_advanced.template_tensor_parallel import DenseMLP, ParallelMLP

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
SCHEDULES = ("1f1b", "gpipe")


@dataclass(frozen=True)
class StackConfig:
    """The model: ``blocks`` MLP blocks ``hidden -> ffn_hidden -> hidden`` (GELU between)."""

    hidden: int = 16
    ffn_hidden: int = 64
    blocks: int = 4

    @classmethod
    def of(cls, dense: nn.Sequential) -> StackConfig:
        """The config of a stack built by :func:`dense_stack` (ValueError for anything else)."""
        first = dense_blocks(dense)[0]
        return cls(first.fc1.in_features, first.fc1.out_features, len(dense))


def dense_blocks(dense: nn.Sequential) -> list[DenseMLP]:
    """The blocks of a stack like :func:`dense_stack`'s, in order: modules with Linear layers
    ``fc1`` and ``fc2`` (checked by shape, not class: the solutions' ``DenseMLP`` and the
    templates' are two classes). ValueError for anything else."""
    blocks = list(dense)

    def is_block(module: nn.Module) -> bool:
        fc1, fc2 = getattr(module, "fc1", None), getattr(module, "fc2", None)
        return isinstance(fc1, nn.Linear) and isinstance(fc2, nn.Linear)

    if not blocks or not all(is_block(b) for b in blocks):
        kinds = sorted({type(b).__name__ for b in blocks}) or ["nothing"]
        raise ValueError(
            f"expected an nn.Sequential of MLP blocks with Linear fc1 and fc2 (dense_stack), "
            f"got {kinds}"
        )
    return cast(list[DenseMLP], blocks)


def dense_stack(
    config: StackConfig, seed: int = 0, dtype: torch.dtype = torch.float64
) -> nn.Sequential:
    """The single-process model: ``config.blocks`` ``DenseMLP`` blocks from ``seed``.

    Built under a forked RNG, so it does not disturb the caller's random state; every rank
    builds the same weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        blocks = [DenseMLP(config.hidden, config.ffn_hidden) for _ in range(config.blocks)]
    return nn.Sequential(*blocks).to(dtype)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_layout(
    world_size: int,
    dp: int | None,
    tp: int,
    pp: int,
    stack: StackConfig,
    global_batch: int | None = None,
    num_microbatches: int = 1,
) -> int:
    """Refuse a layout that cannot run, before any process group work; return dp resolved.

    Every problem at once, each naming the bad degree and a fix: the degrees must multiply to
    the world size (``dp`` None or -1 takes what tp x pp leave), tp must divide the MLP's
    inner width (each tp rank holds ffn_hidden/tp of fc1's outputs and fc2's inputs), pp the
    number of blocks (equal stages), and dp x micro-batches the global batch (each replica
    cuts its equal slice into equal micro-batches)."""
    problems: list[str] = []
    resolved = dp if dp is not None and dp != -1 else None
    try:
        resolved = RankGrid.for_world(world_size, dp, tp, pp).dp
    except ValueError as err:
        problems.append(str(err))
    if tp >= 1 and stack.ffn_hidden % tp:
        fits = [d for d in _divisors(stack.ffn_hidden) if d <= world_size]
        problems.append(
            f"tp={tp} does not divide the MLP's inner width ffn_hidden={stack.ffn_hidden}: each "
            f"tp rank holds ffn_hidden/tp of fc1's outputs and fc2's inputs; choose tp in "
            f"{fits} or an ffn_hidden that is a multiple of {tp} (e.g. "
            f"{stack.ffn_hidden // tp * tp + tp})"
        )
    if pp >= 1 and stack.blocks % pp:
        fits = [d for d in _divisors(stack.blocks) if d <= world_size]
        problems.append(
            f"pp={pp} does not divide the number of blocks {stack.blocks}: every stage holds "
            f"blocks/pp whole blocks; choose pp in {fits} or a number of blocks that is a "
            f"multiple of {pp} (e.g. {stack.blocks // pp * pp + pp})"
        )
    if num_microbatches < 1:
        problems.append(f"num_microbatches={num_microbatches}: cut each batch at least once")
    elif global_batch is not None and resolved is not None and resolved >= 1:
        per_step = resolved * num_microbatches
        if global_batch < per_step or global_batch % per_step:
            problems.append(
                f"global batch {global_batch} does not divide by dp={resolved} x "
                f"{num_microbatches} micro-batches = {per_step}: every replica takes an equal "
                f"slice and cuts it into equal micro-batches; use a global batch that is a "
                f"multiple of {per_step} (e.g. {max(per_step, global_batch // per_step * per_step)}"
                f") or fewer micro-batches"
            )
    if problems:
        raise ValueError("; ".join(problems))
    assert resolved is not None
    return resolved


# ----------------------------------------------------------------------------- exercise 3.6


def build_stage(dense: nn.Sequential, topology: Topology) -> nn.Sequential:
    """This rank's pipeline stage: its blocks of ``dense``, each a ``ParallelMLP`` holding this
    rank's tensor-parallel shard (copies: ``dense`` is left unchanged); the stages of one
    pipeline, run in order, compute ``dense``."""
    stack = StackConfig.of(dense)
    check_layout(topology.world_size, topology.dp_size, topology.tp_size, topology.pp_size, stack)
    # TODO 3.6: this pipeline stage's blocks, each turned into this rank's tensor-parallel shard
    # Invariant: the pp stages hold equal numbers of blocks, and the stages of one pipeline,
    #   run one after the other, compute the dense model; each block is this rank's shard as
    #   your 2.6 ParallelMLP.from_dense makes it, over the ranks that split blocks.
    # Hint 1: the executor sends stage s's output to stage s + 1.
    # More hints: uv run python -m tests.hint 3.6
    # See guidelines.md#36-3d-parallelism
    raise NotImplementedError(
        "TODO 3.6: this pipeline stage's blocks, each turned into this rank's tensor-parallel "
        "shard "
        "(see phase3_multi_node/guidelines.md#36-3d-parallelism)"
    )


def replica_batch(batch: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
    """Data-parallel replica ``dp_rank``'s part of a global ``batch``: its contiguous, equal
    slice along dimension 0 (every rank of the replica, all its stages and tp shards, gets the
    same slice). ValueError when the batch does not split into ``dp_size`` equal slices."""
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} is outside a data-parallel group of {dp_size}")
    if batch.shape[0] % dp_size:
        raise ValueError(
            f"a global batch of {batch.shape[0]} samples does not split into {dp_size} equal "
            f"replica slices: use a multiple of dp={dp_size}"
        )
    # TODO 3.6: replica dp_rank's own slice of the global batch
    # Invariant: the dp_size slices are disjoint, equal, contiguous and in replica order, so
    #   together they are the whole batch.
    # Hint 1: the samples lie along the first dimension.
    # More hints: uv run python -m tests.hint 3.6
    # See guidelines.md#36-3d-parallelism
    raise NotImplementedError(
        "TODO 3.6: replica dp_rank's own slice of the global batch "
        "(see phase3_multi_node/guidelines.md#36-3d-parallelism)"
    )


class Parallel3D:
    """One rank's part of the 3D-parallel model and its training step.

    ``dense`` is the whole model (the same on every rank, e.g. :func:`dense_stack` with one
    seed); the constructor cuts this rank's stage from it (:func:`build_stage`), sets up the
    pipeline executor on ``topology.pp_group`` under ``schedule`` (1f1b or gpipe) with
    ``num_microbatches`` micro-batches per replica, and plain SGD on the stage's parameters.
    """

    def __init__(
        self,
        dense: nn.Sequential,
        topology: Topology,
        num_microbatches: int,
        lr: float,
        schedule: str = "1f1b",
        loss_fn: LossFn = F.mse_loss,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r}: choose one of {', '.join(SCHEDULES)}")
        self.stack = StackConfig.of(dense)
        check_layout(
            topology.world_size,
            topology.dp_size,
            topology.tp_size,
            topology.pp_size,
            self.stack,
            None,
            num_microbatches,
        )
        self.topology = topology
        self.num_microbatches = num_microbatches
        self.stage = build_stage(dense, topology)
        actions = make_schedule(schedule, topology.pp_size, num_microbatches)[topology.pp_rank]
        self.executor = PipelineExecutor(
            [self.stage], actions, num_microbatches, loss_fn, group=topology.pp_group
        )
        self.optimizer = torch.optim.SGD(self.stage.parameters(), lr=lr)

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float | None:
        """One SGD step on the GLOBAL batch (the same ``inputs`` and ``targets`` on every rank).

        Returns this replica's mean loss on the ranks of the last stage, None elsewhere; the
        mean over the dp replicas is the whole batch's loss. Afterwards every rank's stage
        holds the shard of the parameters one process would have after SGD on the whole batch.
        """
        topology = self.topology
        check_layout(
            topology.world_size,
            topology.dp_size,
            topology.tp_size,
            topology.pp_size,
            self.stack,
            inputs.shape[0],
            self.num_microbatches,
        )
        # TODO 3.6: one SGD step of this replica on the global batch, every replica the same
        # Invariant: afterwards every rank holds its shard of what one process's SGD on the
        #   whole global batch gives; every tp rank of a replica trains on the same samples;
        #   the gradients' reduction moves the stage's gradients once and stays inside the
        #   ranks holding the same shard; the step returns the executor's loss.
        # Hint 1: self.executor.step runs every micro-batch and sums their gradients into .grad;
        #   phase 1's average_gradients averages .grad over the group it is given.
        # More hints: uv run python -m tests.hint 3.6
        # See guidelines.md#36-3d-parallelism
        raise NotImplementedError(
            "TODO 3.6: one SGD step of this replica on the global batch, every replica the same "
            "(see phase3_multi_node/guidelines.md#36-3d-parallelism)"
        )
