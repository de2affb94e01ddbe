"""Exercise 1.1, the distributed sampler: index for index what ``DistributedSampler`` yields.

Every combination of dataset size, world size, rank, shuffle, drop_last, seed and epoch is
compared with PyTorch's sampler; when they differ, the message names the likely mistake (the
epoch left out of the seed, padding taken from the end or repeated only once, blocks instead of
interleaved shards, drop_last ignored in the count). Then: the global random stream is left
alone, shards partition each epoch, set_epoch reshuffles, resuming part-way skips this rank's
first samples, and rank and size come from the process group, also inside a subgroup.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from grading import exercise
from phase1_helpers import (
    fail,
    first_problems,
    only_inside,
    run_in_subgroups,
    sampler_module,
    small_world,
)
from subgroups import SubgroupInfo
from torch.utils.data import DistributedSampler

DATASET_SIZES = [0, 1, 2, 3, 5, 7, 10, 17, 32]


def reference(
    n: int, world: int, rank: int, shuffle: bool, seed: int, drop_last: bool, epoch: int
) -> list[int]:
    data: Any = range(n)  # any Sized works; DistributedSampler's hints say Dataset
    ref: DistributedSampler[int] = DistributedSampler(
        data, world, rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    ref.set_epoch(epoch)
    return list(ref)


def _variant(
    n: int,
    world: int,
    rank: int,
    shuffle: bool,
    seed: int,
    drop_last: bool,
    epoch: int,
    mistake: str,
) -> list[int]:
    """The sampler with one known mistake, written independently of the code under test."""
    rounds_down = drop_last and mistake != "drop_last rounds up"
    per_rank = n // world if rounds_down else math.ceil(n / world)
    total = per_rank * world
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed if mistake == "epoch ignored" else seed + epoch)
        order = torch.randperm(n, generator=g).tolist()
    else:
        order = list(range(n))
    if drop_last:
        order = order[:total]
    elif total > n and n:
        pad = total - n
        if mistake == "pad from end":
            order += (order * math.ceil(pad / n))[-pad:]
        elif mistake == "pad once":
            order += order[:pad]
        else:
            order += (order * math.ceil(pad / n))[:pad]
    if mistake == "blocks":
        return order[rank * per_rank : (rank + 1) * per_rank]
    return order[rank:total:world]


MISTAKES = {
    "epoch ignored": "the order ignores the epoch: seed the generator with seed + epoch",
    "pad from end": "padding repeats the end of the list: repeat from its front",
    "pad once": (
        "the padding repeats the list at most once: when more padding is needed than there are "
        "samples (n < N), the list repeats as often as it takes"
    ),
    "blocks": "each rank takes a contiguous block: rank r takes positions r, r + N, r + 2N and on",
    "drop_last rounds up": (
        "the count ignores drop_last: with drop_last=True each rank gets only what divides "
        "evenly (the tail is cut, never padded), so num_samples rounds down"
    ),
}


# the grader's own shorter words for a mistake that fits one case but not every case
SHORT = {
    "epoch ignored": "a shuffle seeded without the epoch",
    "pad from end": "padding taken from the end",
    "pad once": "padding that repeats the list once at most",
    "blocks": "contiguous blocks per rank",
    "drop_last rounds up": "a count rounded up under drop_last",
}

Case = tuple[int, int, int, bool, int, bool, int]
Yielded = tuple[list[int], int]  # the indices and what len() said


def graded_cases() -> list[Case]:
    """Every (n, num_replicas, rank, shuffle, seed, drop_last, epoch) the grader compares."""
    return [
        (n, world_size, rank, shuffle, seed, drop_last, epoch)
        for n in DATASET_SIZES
        for world_size in (1, 2, 3, 4)
        for rank in range(world_size)
        for shuffle in (True, False)
        for drop_last in (False, True)
        for seed in (0, 7)
        for epoch in (0, 1, 5)
    ]


def diagnose(got: list[int], case: Case, yielded: dict[Case, Yielded] | None = None) -> str:
    """The mistake that explains this case, named only when it explains every case measured
    (``yielded``); a mistake that fits this case alone is described as such, not named."""
    fits_here = [m for m in MISTAKES if got == _variant(*case, mistake=m)]
    if not fits_here:
        return ""
    if yielded is None:
        fits_all = fits_here
    else:
        fits_all = [
            m
            for m in fits_here
            if all(out == _variant(*c, mistake=m) for c, (out, _) in yielded.items())
        ]
    if len(fits_all) == 1:
        return f" It looks like {MISTAKES[fits_all[0]]}."
    if fits_all:
        return " It fits each of: " + "; ".join(MISTAKES[m] for m in fits_all) + "."
    told = " or ".join(SHORT[m] for m in fits_here)
    return (
        f" This case alone is what {told} would give, but other cases are not: more than one "
        "thing differs from DistributedSampler, so compare the cases one at a time."
    )


def sampler_verdict(yielded: dict[Case, Yielded]) -> str | None:
    """The failure for the first case (in the grader's order) where the sampler differs from
    DistributedSampler; None when every case matches."""
    for case in graded_cases():
        got, length = yielded[case]
        want = reference(*case)
        if got != want or length != len(want):
            n, world_size, rank, shuffle, seed, drop_last, epoch = case
            return (
                f"1.1: n={n}, num_replicas={world_size}, rank={rank}, shuffle={shuffle}, "
                f"drop_last={drop_last}, seed={seed}, epoch={epoch}: DistributedSampler yields "
                f"{want} (len {len(want)}); yours yielded {got} (len() says {length})."
                + diagnose(got, case, yielded)
            )
    return None


@exercise("1.1")
def test_sampler_yields_what_pytorch_yields() -> None:
    Sampler = sampler_module().DistributedShardSampler
    yielded: dict[Case, Yielded] = {}
    samplers: dict[tuple[int, int, int, bool, int, bool], object] = {}
    for case in graded_cases():
        n, world_size, rank, shuffle, seed, drop_last, epoch = case
        key = case[:6]
        if key not in samplers:
            samplers[key] = Sampler(range(n), world_size, rank, shuffle, seed, drop_last)
        ours: Any = samplers[key]
        ours.set_epoch(epoch)
        yielded[case] = (list(ours), len(ours))
    verdict = sampler_verdict(yielded)
    if verdict:
        fail(verdict)
    assert len(yielded) > 1000


@exercise("1.1")
def test_the_shuffle_leaves_the_global_random_stream_alone() -> None:
    Sampler = sampler_module().DistributedShardSampler
    sampler = Sampler(range(50), 2, 1, shuffle=True, seed=3)
    sampler.set_epoch(2)
    orders = []
    for global_seed in (1234, 99):
        torch.manual_seed(global_seed)
        before = torch.get_rng_state()
        orders.append(list(sampler))
        if not torch.equal(before, torch.get_rng_state()):
            fail(
                "1.1: building the epoch's list moved the process's global random stream "
                "(torch.get_rng_state() differs before and after iterating the sampler): a "
                "model initialised or dropout drawn after the sampler would change with it. The "
                "permutation comes from a random stream of the sampler's own"
            )
    if orders[0] != orders[1]:
        fail(
            "1.1: the epoch's order changed with the global seed (torch.manual_seed 1234, then "
            "99): it read the process's global random stream, which other code also draws from. "
            "The permutation comes from a random stream of the sampler's own, seeded with "
            "seed + epoch"
        )


@exercise("1.1")
def test_sampler_shards_partition_each_epoch() -> None:
    Sampler = sampler_module().DistributedShardSampler
    n, world_size = 23, 4
    for epoch in range(3):
        shards = []
        for rank in range(world_size):
            sampler = Sampler(range(n), world_size, rank, shuffle=True, seed=3)
            sampler.set_epoch(epoch)
            shards.append(list(sampler))
        lengths = [len(shard) for shard in shards]
        if set(lengths) != {6}:
            fail(f"1.1: 23 samples on 4 ranks: every rank must get 6 (padded); got {lengths}")
        union = {i for shard in shards for i in shard}
        if union != set(range(n)):
            fail(
                f"1.1: epoch {epoch}: the 4 shards together must cover all 23 samples; "
                f"missing {sorted(set(range(n)) - union)}"
            )


@exercise("1.1")
def test_set_epoch_reshuffles_and_is_reproducible() -> None:
    Sampler = sampler_module().DistributedShardSampler
    sampler = Sampler(range(100), 2, 0, shuffle=True, seed=11)
    sampler.set_epoch(0)
    epoch0 = list(sampler)
    sampler.set_epoch(1)
    epoch1 = list(sampler)
    sampler.set_epoch(0)
    again = list(sampler)
    if epoch0 == epoch1:
        fail(
            "1.1: set_epoch(1) gave epoch 0's order: seed the shuffle's generator with "
            "seed + epoch, and build the order when iterating (not once in __init__)"
        )
    if epoch0 != again:
        fail(
            "1.1: set_epoch(0) a second time gave a different order than the first time: use a "
            "torch.Generator of your own, seeded each epoch, not the global RNG"
        )


@exercise("1.1")
def test_resuming_part_way_and_refusing_bad_arguments() -> None:
    Sampler = sampler_module().DistributedShardSampler
    full = Sampler(range(50), 3, 2, shuffle=True, seed=5)
    full.set_epoch(4)
    shard = list(full)
    for start in (0, 1, 7, len(shard)):
        resumed = Sampler(range(50), 3, 2, shuffle=True, seed=5)
        resumed.set_epoch(4, start_index=start)
        got = list(resumed)
        if got != shard[start:]:
            fail(
                f"1.1: set_epoch(4, start_index={start}) must yield this rank's shard without "
                f"its first {start} samples: expected {shard[start:]}, got {got} (skip after "
                "sharding: start_index counts this rank's samples)"
            )
        if len(resumed) != len(shard) - start:
            fail(
                f"1.1: len() after set_epoch(4, start_index={start}) should be "
                f"{len(shard) - start}, got {len(resumed)}"
            )
    refusals = [
        (
            lambda: resumed.set_epoch(0, start_index=len(shard) + 1),
            str(len(shard) + 1),
            f"set_epoch(0, start_index={len(shard) + 1}) on a shard of {len(shard)}",
        ),
        (lambda: Sampler(range(10), num_replicas=3, rank=3), "rank=3", "rank=3 of 3 ranks"),
        (lambda: Sampler(range(10), num_replicas=0, rank=0), "num_replicas=0", "num_replicas=0"),
    ]
    for call, word, what in refusals:
        try:
            call()
        except ValueError as err:
            if word not in str(err):
                fail(f"1.1: the ValueError for {what} should name {word!r}; it says: {err}")
        else:
            fail(f"1.1: {what} must raise ValueError naming {word!r}; it was accepted")


def sampler_defaults_worker(n: int) -> tuple[list[int], list[int]]:
    Sampler = sampler_module().DistributedShardSampler
    data: Any = range(n)
    ours = Sampler(data, seed=2)
    ref: DistributedSampler[int] = DistributedSampler(data, seed=2)
    ours.set_epoch(3)
    ref.set_epoch(3)
    return list(ours), list(ref)


@exercise("1.1")
@pytest.mark.parametrize("world_size", [2, 3])
def test_sampler_reads_rank_and_world_from_the_process_group(world_size: int) -> None:
    for rank, (ours, ref) in enumerate(small_world(sampler_defaults_worker, world_size, 19)):
        if ours != ref:
            fail(
                f"1.1: with no num_replicas/rank given, rank {rank} of {world_size} should read "
                f"them from the process group and yield {ref}; it yielded {ours}"
            )


def subgroup_sampler_worker(info: SubgroupInfo) -> list[str]:
    Sampler = sampler_module().DistributedShardSampler
    n = 19 if info.index == 0 else 26  # each group samples its own dataset
    data: Any = range(n)
    with only_inside(info, "DistributedShardSampler(dataset, group=group)"):
        ours = Sampler(data, seed=4, group=info.group)
    ref: DistributedSampler[int] = DistributedSampler(
        data, num_replicas=info.size, rank=info.group_rank, seed=4
    )
    problems = []
    me = f"global rank {info.ranks[info.group_rank]} (rank {info.group_rank} of group {info.ranks})"
    if (ours.num_replicas, ours.rank) != (info.size, info.group_rank):
        problems.append(
            f"{me}: expected num_replicas={info.size} and rank={info.group_rank} (the group's), "
            f"got num_replicas={ours.num_replicas} and rank={ours.rank}: with group= given, read "
            "them with dist.get_world_size(group) and dist.get_rank(group)"
        )
    for epoch in (0, 2):
        ours.set_epoch(epoch)
        ref.set_epoch(epoch)
        if list(ours) != list(ref):
            problems.append(
                f"{me}, epoch {epoch}: expected the indices of a world of {info.size}, "
                f"{list(ref)}; got {list(ours)}"
            )
    return problems


@exercise("1.1")
def test_sampler_inside_a_subgroup_uses_the_groups_rank_and_size() -> None:
    results = run_in_subgroups("1.1 sampler", subgroup_sampler_worker)
    first_problems(
        [p for rank_problems in results for p in rank_problems],
        "1.1: a world of 4 split into the groups (0, 1) and (2, 3); each group's sampler "
        "(group=group) must split its data like a world of 2:",
    )
