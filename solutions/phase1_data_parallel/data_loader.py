"""Exercise 1.1: a distributed sampler that gives each rank its own shard of every epoch.

Data parallelism only works if the N ranks see N *different* slices of the data, and together
cover the whole dataset once per epoch. This sampler reproduces, index for index,
``torch.utils.data.DistributedSampler`` (torch/utils/data/distributed.py):

1. shuffle all indices with a generator seeded by ``seed + epoch`` (the same permutation on every
   rank, a new one every epoch),
2. pad by repeating indices from the front (or cut the tail with ``drop_last``) so the total is a
   multiple of the world size,
3. deal the list out to the ranks like cards: each rank gets its own positions, interleaved
   with the others' rather than one contiguous block.

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
        shuffle: shuffle with a generator seeded by ``seed + epoch``.
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
        # TODO 1.1: work out how many samples each rank gets per epoch.
        # Invariant: every rank gets the same count, so ranks run the same number of steps
        #   (a rank with one batch more would wait forever in its extra all-reduce).
        # Hint 1: padding rounds the epoch up to a multiple of num_replicas; drop_last rounds
        #   it down (only when n does not divide evenly). Each rank gets its share of that.
        # Hint 2: two cases. Padding: the smallest count that covers all n samples when every
        #   rank takes it. drop_last with a remainder: the largest count every rank can take
        #   without repeating a sample. Check n = 0, 1 and 10 on 4 ranks against the guide's
        #   table.
        # Hint 3: with R = num_replicas: padding takes ⌈n / R⌉ (math.ceil); drop_last with a
        #   remainder takes ⌈(n − R) / R⌉, which is ⌊n / R⌋ (DistributedSampler writes it the
        #   first way).
        # See guidelines.md#11-the-distributed-sampler
        # >>> solution
        if self.drop_last and n % num_replicas != 0:
            self.num_samples = math.ceil((n - num_replicas) / num_replicas)
        else:
            self.num_samples = math.ceil(n / num_replicas)
        # <<< solution
        self.total_size = self.num_samples * self.num_replicas

    def epoch_indices(self) -> list[int]:
        """All ranks' indices for the current epoch, padded or cut to ``total_size``."""
        n = len(self.dataset)
        # TODO 1.1: build the epoch's global index list, identical on every rank.
        # Invariant: same (seed, epoch) -> same list on every rank; its length is total_size.
        # Hint 1: the shuffle must be the same on every rank and new every epoch, and must not
        #   touch the global random stream (DistributedSampler seeds its own generator with
        #   seed + epoch); padding repeats indices from the front, as many times as needed (the
        #   padding can be longer than the dataset when n < num_replicas).
        # Hint 2: three steps. Order: a permutation from a generator of its own, or plain
        #   0..n-1 without shuffle. Cut: with drop_last keep the first total_size. Pad: append
        #   copies of the list's *start* until total_size, repeating the whole list when the
        #   gap is longer than it.
        # Hint 3: a fresh torch.Generator seeded with seed + epoch drives torch.randperm of n
        #   (as a Python list). The padding is the first `padding` entries of the list repeated
        #   ceil(padding / len) times, where padding = total_size minus the list's length.
        # See guidelines.md#11-the-distributed-sampler
        # >>> solution
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(n, generator=generator).tolist()
        else:
            indices = list(range(n))
        if self.drop_last:
            return indices[: self.total_size]
        padding = self.total_size - len(indices)
        if padding > 0:
            indices += (indices * math.ceil(padding / len(indices)))[:padding]
        return indices
        # <<< solution

    def __iter__(self) -> Iterator[int]:
        # TODO 1.1: yield this rank's shard of epoch_indices(), skipping start_index samples.
        # Invariant: shards of different ranks are disjoint (apart from padding) and together
        #   are the whole epoch; every shard has num_samples indices before skipping.
        # Hint 1: the guide's worked table (10 samples on 4 ranks) shows which positions each
        #   rank takes: not a contiguous block. Find the rule that gives those positions for any
        #   rank and any number of ranks.
        # Hint 2: one slice of the epoch list gives the shard; skip start_index *after*
        #   sharding (it counts this rank's samples, not the epoch's), and return an iterator.
        # Hint 3: a strided slice: from position rank, every num_replicas-th entry, stopping at
        #   total_size; then drop the shard's first start_index entries.
        # See guidelines.md#11-the-distributed-sampler
        # >>> solution
        shard = self.epoch_indices()[self.rank : self.total_size : self.num_replicas]
        return iter(shard[self.start_index :])
        # <<< solution

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
