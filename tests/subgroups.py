"""Split a world into equal groups of adjacent ranks, and check that a rank talked only inside its own.

Graders of code that runs on subgroups (3D parallelism, hierarchical all-reduce, a tensor-parallel
layer on a ``tp`` group) call these inside the ranks of a world: a function that takes ``group=``
must work when that group is not the world, and must not let a single message leave it. The usual
mistakes are a collective without ``group=`` (it runs on the world) and a peer given as a rank
*within* the group to an argument that wants a global one (``dst=1`` instead of
``dst=dist.get_global_rank(group, 1)``, or ``group_dst=1``).

Groups follow Megatron's ``parallel_state`` and picotron's ``process_group_manager``: every rank
calls ``dist.new_group`` for every group, in the same order, including groups it is not in
(``new_group`` is itself a collective on the world).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from course.comm_counter import CommCounter


@dataclass(frozen=True)
class SubgroupInfo:
    """This rank's group: the process group, its global ranks, which group it is, our rank in it."""

    group: dist.ProcessGroup
    ranks: tuple[int, ...]
    index: int
    group_rank: int

    @property
    def size(self) -> int:
        return len(self.ranks)


def split_into_groups(group_size: int) -> SubgroupInfo:
    """Create the groups [0..g-1], [g..2g-1], ... and return the one this rank belongs to.

    Call it on every rank of the world, at the same point of the program.
    """
    world_size = dist.get_world_size()
    if group_size < 1 or world_size % group_size:
        raise ValueError(
            f"group_size={group_size} does not divide the world size {world_size}: "
            f"choose one of {[g for g in range(1, world_size + 1) if world_size % g == 0]}"
        )
    rank = dist.get_rank()
    mine: SubgroupInfo | None = None
    for index in range(world_size // group_size):
        ranks = tuple(range(index * group_size, (index + 1) * group_size))
        group = dist.new_group(list(ranks))  # every rank creates every group, in the same order
        if rank in ranks:
            assert isinstance(group, dist.ProcessGroup), f"rank {rank} got no group for {ranks}"
            mine = SubgroupInfo(group, ranks, index, ranks.index(rank))
    assert mine is not None
    return mine


def assert_no_crossing(counter: CommCounter, info: SubgroupInfo) -> None:
    """Fail, listing each call, when this rank communicated with a rank outside ``info.ranks``."""
    crossing = counter.crossing(info.ranks)
    if not crossing:
        return
    rank = dist.get_rank()
    lines = [f"{record.describe(rank)} outside its group {info.ranks}" for record in crossing[:5]]
    if len(crossing) > 5:
        lines.append(f"... and {len(crossing) - 5} more")
    raise AssertionError(
        "; ".join(lines) + ": pass group= to every collective and map peers with "
        "dist.get_global_rank(group, r)"
    )
