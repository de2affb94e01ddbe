# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase1.py
"""Exercise 1.1: a distributed sampler that gives each rank its own shard of every epoch.

Data parallelism only works if the N ranks see N *different* slices of the data, in equal
counts, and together cover the whole dataset once per epoch, in a new order every epoch. This
sampler yields, index for index, what ``torch.utils.data.DistributedSampler``
(torch/utils/data/distributed.py) yields.

It adds one thing PyTorch's sampler lacks: ``set_epoch(epoch, start_index=k)`` skips the first
``k`` samples of this rank's shard, which is what a run resumed in the middle of an epoch needs
(phase 4).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import torch
import torch.distributed as dist
from torch.utils.data import Sampler


class DistributedShardSampler(Sampler[int]):
    """Yields this rank's indices of a dataset, reshuffled each epoch, equal in count on all ranks.

    Args:
        dataset: anything with ``len()``.
        num_replicas: how many ranks share the data; defaults to the size of ``group``.
        rank: this process's rank among them; defaults to its rank within ``group``.
        shuffle: a new order every epoch, DistributedSampler's for ``seed`` and the epoch.
        seed: must be the same on every rank.
        drop_last: drop the tail so shards divide evenly, instead of padding with repeats.
        group: the process group whose ranks share the data (None: the default group). Inside a
            data-parallel subgroup every group sees the whole dataset, split over its members.
    """

    num_samples: int  # this rank's samples per epoch (the same on every rank)
    total_size: int  # num_samples * num_replicas: the epoch's index count after padding

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if num_replicas is None:
            num_replicas = dist.get_world_size(group) if dist.is_initialized() else 1
        if rank is None:
            rank = dist.get_rank(group) if dist.is_initialized() else 0
        if num_replicas < 1:
            raise ValueError(f"num_replicas={num_replicas}: it must be at least 1")
        if not 0 <= rank < num_replicas:
            raise ValueError(
                f"rank={rank} is outside [0, {num_replicas - 1}] for num_replicas={num_replicas}"
            )
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.start_index = 0
        n = len(dataset)
        # TODO 1.1: work out how many samples each rank yields per epoch.
        # Invariant: every rank gets the same count, so ranks run the same number of steps
        #   (a rank with one batch more would wait forever in its extra all-reduce); it is
        #   DistributedSampler's count for every n, num_replicas and drop_last.
        # Hint 1: the guide's table of counts: which rounding of n / num_replicas gives each row?
        # More hints: uv run python -m tests.hint 1.1
        # See guidelines.md#11-the-distributed-sampler
        raise NotImplementedError(
            "TODO 1.1: work out how many samples each rank yields per epoch "
            "(see phase1_data_parallel/guidelines.md#11-the-distributed-sampler)"
        )
        self.total_size = self.num_samples * self.num_replicas

    def epoch_indices(self) -> list[int]:
        """All ranks' indices for the current epoch, padded or cut to ``total_size``."""
        n = len(self.dataset)
        # TODO 1.1: build the epoch's list of indices, every rank's together.
        # Invariant: the same (seed, epoch) gives the same list on every rank, without a message;
        #   its length is total_size; the process's global random stream is neither read nor
        #   moved; it is the list DistributedSampler's shards come from.
        # Hint 1: the guide's worked example shows the epoch's permutation and what each rank
        #   yields: which entries does rank 2's last index repeat?
        # More hints: uv run python -m tests.hint 1.1
        # See guidelines.md#11-the-distributed-sampler
        raise NotImplementedError(
            "TODO 1.1: build the epoch's list of indices, every rank's together "
            "(see phase1_data_parallel/guidelines.md#11-the-distributed-sampler)"
        )

    def __iter__(self) -> Iterator[int]:
        # TODO 1.1: yield this rank's indices of the epoch, without its first start_index.
        # Invariant: every rank's shard has num_samples indices before skipping; the shards of
        #   different ranks are disjoint apart from padding and together are the epoch's list;
        #   each is DistributedSampler's shard for its rank.
        # Hint 1: the guide's worked example: at which positions of the permutation do rank 2's
        #   indices sit?
        # More hints: uv run python -m tests.hint 1.1
        # See guidelines.md#11-the-distributed-sampler
        raise NotImplementedError(
            "TODO 1.1: yield this rank's indices of the epoch, without its first start_index "
            "(see phase1_data_parallel/guidelines.md#11-the-distributed-sampler)"
        )

    def __len__(self) -> int:
        return self.num_samples - self.start_index

    def set_epoch(self, epoch: int, start_index: int = 0) -> None:
        """Pick the epoch's permutation; call it before every epoch, on every rank.

        ``start_index`` skips that many of this rank's samples of the epoch (resuming part-way).
        Without ``set_epoch`` every epoch repeats epoch 0's order.
        """
        if not 0 <= start_index <= self.num_samples:
            raise ValueError(
                f"start_index={start_index} is outside [0, {self.num_samples}], the number of "
                "samples this rank has per epoch"
            )
        self.epoch = epoch
        self.start_index = start_index
