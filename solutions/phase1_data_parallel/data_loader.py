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
        # Hint 2: Without drop_last, may any sample be left out of the epoch? With drop_last,
        #   may any sample appear twice? So which count is the smallest that leaves nothing out,
        #   and which the largest that repeats nothing? Does drop_last change anything when n
        #   divides by num_replicas?
        # Hint 3: Without drop_last (or when n divides evenly) the count rounds n / num_replicas
        #   up: 10 samples on 4 ranks give 3 each, 12 places, 2 of them repeats.
        # Hint 4: With drop_last and a remainder it rounds down: 10 samples on 4 ranks give 2
        #   each, 8 places, the last 2 entries of the list cut. DistributedSampler writes it as
        #   the ceiling of (n − num_replicas) / num_replicas, the same number.
        # Hint 5: The answer in words: the ceiling of n over num_replicas (math.ceil), except with
        #   drop_last when num_replicas does not divide n: then the ceiling of n minus
        #   num_replicas, over num_replicas (which is the floor of n over num_replicas).
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
        # TODO 1.1: build the epoch's list of indices, every rank's together.
        # Invariant: the same (seed, epoch) gives the same list on every rank, without a message;
        #   its length is total_size; the process's global random stream is neither read nor
        #   moved; it is the list DistributedSampler's shards come from.
        # Hint 1: the guide's worked example shows the epoch's permutation and what each rank
        #   yields: which entries does rank 2's last index repeat?
        # Hint 2: Which random stream draws the permutation, so that every rank draws the same
        #   one, a new one each epoch, and the process's global stream stays as it was? With
        #   drop_last, which entries of the list survive? Without it, where do the extra
        #   total_size − n entries come from, and what if there are more of them than samples
        #   (n = 1 on 4 ranks)?
        # Hint 3: A torch.Generator of the sampler's own, seeded with seed + epoch each time the
        #   list is built, drives torch.randperm of n; without shuffle the list is 0 .. n − 1.
        # Hint 4: With drop_last the list keeps its first total_size entries. Otherwise the
        #   padding repeats the list from its front: the list 4 1 7 5 3 9 0 8 6 2 with
        #   total_size 12 gets 4 1; a list of one sample with total_size 4 gets that sample three
        #   more times.
        # Hint 5: The answer in words: the permutation (or the plain range) as a Python list;
        #   with drop_last, cut to its first total_size entries; otherwise append the first
        #   total_size − n entries of the list repeated as many times as it takes (the list
        #   repeated the ceiling of the padding over n times, then cut to the padding).
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
        # TODO 1.1: yield this rank's indices of the epoch, without its first start_index.
        # Invariant: every rank's shard has num_samples indices before skipping; the shards of
        #   different ranks are disjoint apart from padding and together are the epoch's list;
        #   each is DistributedSampler's shard for its rank.
        # Hint 1: the guide's worked example: at which positions of the permutation do rank 2's
        #   indices sit?
        # Hint 2: Is a rank's shard one contiguous block of the list, or spread through it? Write
        #   down the positions of rank 0's and rank 3's indices in the worked example: what rule
        #   gives them for any rank and any number of ranks? start_index counts this rank's
        #   samples: is it applied before this rank's positions are picked, or after?
        # Hint 3: Dealt like cards: rank r takes positions r, r + N, r + 2N, ... below
        #   total_size; in the worked example rank 2 takes positions 2, 6 and 10, so 7, 0 and 4.
        # Hint 4: start_index is cut from the shard, after dealing: rank 2's shard 7 0 4 with
        #   start_index 1 yields 0 and 4.
        # Hint 5: The answer in words: one strided slice of the epoch's list, from this rank's
        #   position in steps of num_replicas, stopping at total_size; then its first
        #   start_index entries dropped, and an iterator over the rest returned.
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
