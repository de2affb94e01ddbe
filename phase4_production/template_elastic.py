# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase4.py
"""Exercise 4.3: elastic training: the world grows and shrinks, the epoch goes on.

Under ``torchrun --nnodes=1:2 --rdzv-backend=c10d`` a node may join or leave while training
runs. torchrun does not move a running process into a bigger group: it stops every worker and
starts new ones in a new rendezvous round with the new world size
(torch/distributed/elastic/agent/server/api.py: ``num_nodes_waiting() > 0`` triggers
``_restart_workers``, which does not count against ``--max-restarts``). So a membership change
is a restart, and the program resumes from its newest checkpoint with a different
``WORLD_SIZE``. Two things then have to be recomputed, and they are this exercise:

* **the data**: a checkpoint saved by 2 ranks cannot say "rank 1 was at sample 40 of its shard":
  shards depend on the world size. It stores the *global* position instead (samples of this
  epoch's permutation already consumed, by all ranks together), and the new world splits what
  is left of the same permutation. :class:`ElasticSampler` does that: no sample is
  seen twice or skipped within the epoch, whatever the world sizes along the way.
* **the batch**: with W ranks and a per-rank micro-batch m, one step sees W·m·A samples for A
  accumulation steps. :func:`plan_batches` applies one of two documented policies:
  ``keep-global`` keeps the global batch B and the learning rate whatever the world (the
  optimisation is the same, only slower or faster; the default), ``scale-lr`` trains one
  micro-batch per rank per step, so the global batch follows the world, and scales the learning
  rate with it (Goyal et al., "Accurate, Large Minibatch SGD", 2017, the linear scaling rule),
  which changes the optimisation.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from dataclasses import dataclass

import torch
from torch.utils.data import Sampler

POLICIES = ("keep-global", "scale-lr")


@dataclass(frozen=True)
class BatchPlan:
    """How one world size trains: per-rank batch = micro_batch x accumulation_steps."""

    world_size: int
    micro_batch: int
    accumulation_steps: int
    global_batch: int  # samples per optimizer step over all ranks
    lr: float

    @property
    def per_rank_batch(self) -> int:
        return self.micro_batch * self.accumulation_steps


def plan_batches(
    global_batch: int,
    micro_batch: int,
    world_size: int,
    base_lr: float,
    policy: str = "keep-global",
) -> BatchPlan:
    """The batch plan of ``world_size`` ranks under ``policy`` (see the module docstring).

    ``global_batch`` and ``base_lr`` are the configured values: ``base_lr`` is the rate for
    ``global_batch`` samples per step, which ``scale-lr`` rescales linearly to the samples a step
    of this world takes. Raises ValueError naming the values when ``keep-global`` cannot split
    ``global_batch`` evenly.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is unknown: choose one of {', '.join(POLICIES)}")
    if min(global_batch, micro_batch, world_size) < 1:
        raise ValueError(
            f"global_batch={global_batch}, micro_batch={micro_batch}, world_size={world_size}: "
            "all must be at least 1"
        )
    # TODO 4.3: the batch plan of this world under the policy.
    # Invariant: keep-global: world_size x micro_batch x accumulation_steps == global_batch and the
    #   lr is base_lr, or a ValueError naming global_batch, world_size and micro_batch; scale-lr:
    #   one micro-batch per rank per step, lr proportional to the samples per step (base_lr when
    #   they equal global_batch).
    # Hint 1: one micro-step of the whole world takes world_size x micro_batch samples.
    # More hints: uv run python -m tests.hint 4.3
    # See guidelines.md#43-elastic-training
    raise NotImplementedError(
        "TODO 4.3: the batch plan of this world under the policy "
        "(see phase4_production/guidelines.md#43-elastic-training)"
    )


class ElasticSampler(Sampler[int]):
    """This rank's indices of what is left of an epoch, from a *global* sample position.

    The epoch's order is a permutation of the dataset seeded by ``seed + epoch`` (the same on
    every rank and for every world size), cut to whole global batches. After
    :meth:`set_position` (``position`` samples of that order already trained, all ranks
    together), the ranks share what is left so that each step's per-rank batches together are
    the next ``global_batch`` samples of the order, and every sample of the epoch is trained
    exactly once, whatever world sizes the epoch went through. ``position`` is any count: the
    world that saved it may have stepped by another global batch (scale-lr: 2 ranks x 8 = 16 per
    step, resumed by 3 ranks x 8), so the new world need not divide it.
    """

    def __init__(
        self, dataset: Sized, global_batch: int, rank: int, world_size: int, seed: int = 0
    ) -> None:
        if global_batch < 1 or global_batch % world_size:
            raise ValueError(
                f"global_batch={global_batch} must be a positive multiple of world_size="
                f"{world_size}: each rank takes the same share of every block"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is outside [0, {world_size - 1}]")
        self.size = len(dataset)
        if self.size < global_batch:
            raise ValueError(
                f"the dataset has {self.size} samples, fewer than one global batch ({global_batch})"
            )
        self.global_batch, self.rank, self.world_size, self.seed = (
            global_batch, rank, world_size, seed,
        )  # fmt: skip
        self.epoch = 0
        self.position = 0

    @property
    def epoch_samples(self) -> int:
        """Samples trained per epoch: whole global batches (the tail is dropped, as drop_last)."""
        return self.size // self.global_batch * self.global_batch

    def set_position(self, epoch: int, position: int = 0) -> None:
        """Start ``epoch`` after ``position`` of its samples (all ranks together) were trained."""
        if not 0 <= position <= self.epoch_samples:
            raise ValueError(
                f"position={position} is outside the epoch's [0, {self.epoch_samples}] samples"
            )
        self.epoch, self.position = epoch, position

    def set_epoch(self, epoch: int, start_index: int = 0) -> None:
        """TrainingLoop's hook: ``start_index`` counts this rank's samples, as in phase 1."""
        self.set_position(epoch, start_index * self.world_size)

    def epoch_order(self) -> list[int]:
        """The whole epoch's order, the same for every world size."""
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.size, generator=g)[: self.epoch_samples].tolist()

    def shard(self) -> list[int]:
        """This rank's indices of the rest of the epoch, in training order."""
        # TODO 4.3: split what is left of the epoch's order over this world, step by step.
        # Invariant: over all ranks the shards are disjoint and together are exactly
        #   epoch_order()[position:]; the first global_batch / world_size indices of every rank
        #   together are the next global_batch samples of that order (and so on, step by step), also
        #   when world_size does not divide position.
        # Hint 1: two things happen to the order: what the earlier worlds trained goes away, and the
        #   rest is dealt out to the ranks like cards. Which comes first matters.
        # More hints: uv run python -m tests.hint 4.3
        # See guidelines.md#43-elastic-training
        raise NotImplementedError(
            "TODO 4.3: split what is left of the epoch's order over this world, step by step "
            "(see phase4_production/guidelines.md#43-elastic-training)"
        )

    def __iter__(self) -> Iterator[int]:
        return iter(self.shard())

    def __len__(self) -> int:
        left = self.epoch_samples - self.position  # dealt out as evenly as possible
        return left // self.world_size + int(self.rank < left % self.world_size)
