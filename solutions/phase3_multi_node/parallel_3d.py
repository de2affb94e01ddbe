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
from solutions.phase1_data_parallel.trainer import average_gradients
from solutions.phase2_advanced.pipeline_executor import PipelineExecutor
from solutions.phase2_advanced.pipeline_schedules import make_schedule
from solutions.phase2_advanced.tensor_parallel import DenseMLP, ParallelMLP

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
    # Hint 2: Which blocks must stage pp_rank hold for stage 0's output to feed stage 1's
    #   first block? How many blocks does a stage hold? Which of the topology's groups
    #   splits one block into shards, and which ranks hold the same shard?
    # Hint 3: the stages hold contiguous runs of the blocks in order: with 4 blocks and
    #   pp = 2, stage 0 holds blocks 0 and 1, stage 1 blocks 2 and 3 (dense_blocks lists them).
    # Hint 4: a block is split among the ranks of one tp group (adjacent ranks, the same
    #   stage and replica): ParallelMLP.from_dense gets topology.tp_group, not the world and
    #   not the dp or pp group.
    # Hint 5: the blocks per stage are the number of blocks divided (whole) by the pipeline
    #   size; this stage's run starts at its pipeline rank times that; each block of the run
    #   goes through ParallelMLP.from_dense with the tp group, all of them in one nn.Sequential.
    # See guidelines.md#36-3d-parallelism
    # >>> solution
    blocks = dense_blocks(dense)
    per_stage = len(blocks) // topology.pp_size
    first = topology.pp_rank * per_stage
    return nn.Sequential(
        *(
            ParallelMLP.from_dense(block, topology.tp_group)
            for block in blocks[first : first + per_stage]
        )
    )
    # <<< solution


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
    # Hint 2: Which dimension holds the samples? How large is each replica's slice, and how
    #   many samples come before replica dp_rank's?
    # Hint 3: one slice is the first dimension's size divided by dp_size: 12 samples over 3
    #   replicas give slices of 4.
    # Hint 4: replica 2 of those 3 starts after the 8 samples of replicas 0 and 1.
    # Hint 5: replica dp_rank takes the samples from dp_rank times the slice size up to
    #   dp_rank + 1 times it, a slice of the first dimension.
    # See guidelines.md#36-3d-parallelism
    # >>> solution
    size = batch.shape[0] // dp_size
    return batch[dp_rank * size : (dp_rank + 1) * size]
    # <<< solution


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
        # Hint 2: Which coordinate of this rank picks its samples, and which ranks must see the
        #   same ones? Which stage needs the inputs, which the targets? Which ranks hold a copy
        #   of the same shard, so which group averages the gradients, and by how many? What
        #   does .grad hold when the step starts?
        # Hint 3: the data-parallel rank picks the slice (replica_batch with the dp rank and
        #   size): the tp ranks and the stages of one replica work on the same samples.
        # Hint 4: the copies of a shard are the ranks with the same stage and tp rank in the
        #   other replicas: topology.dp_group, averaged (each replica's loss is a mean over its
        #   own samples only). The executor accumulates into .grad: zero it first.
        # Hint 5: zero the gradients; this replica's slices of inputs and targets; the executor
        #   step with the inputs on the first stage and the targets on the last (None
        #   elsewhere); average_gradients of self.stage on the dp group; the optimizer step;
        #   return the step result's loss.
        # See guidelines.md#36-3d-parallelism
        # >>> solution
        self.optimizer.zero_grad(set_to_none=True)
        x = replica_batch(inputs, topology.dp_rank, topology.dp_size)
        y = replica_batch(targets, topology.dp_rank, topology.dp_size)
        result = self.executor.step(
            x if topology.is_first_stage else None, y if topology.is_last_stage else None
        )
        average_gradients(self.stage, group=topology.dp_group)
        self.optimizer.step()
        return result.loss
        # <<< solution
