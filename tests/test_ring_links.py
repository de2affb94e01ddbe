"""``RingLinks`` (given to exercise 3.1): neighbours as global ranks, and on gloo one connection
per direction of every link, so that no connection carries ring data both ways."""

from __future__ import annotations

from typing import Any

import pytest
from workers.ring_links_worker import describe_links

from course.world import run_world

pytestmark = pytest.mark.harness


def _links(world: int, members: list[int] | None) -> list[dict[str, Any]]:
    return [r for r in run_world(describe_links, world, (members,)) if r["member"]]


@pytest.mark.parametrize(
    ("world", "members"), [(2, None), (3, None), (4, [1, 2, 3])], ids=["2", "3", "group-1-2-3"]
)
def test_each_connection_carries_ring_data_one_way(world: int, members: list[int] | None) -> None:
    ranks = members or list(range(world))
    links = _links(world, members)
    n = len(ranks)
    by_global = {link["global"]: link for link in links}
    used: dict[tuple[str, frozenset[int]], set[tuple[int, int]]] = {}  # connection -> directions
    for i, link in enumerate(links):
        right, left = ranks[(i + 1) % n], ranks[(i - 1) % n]
        assert (link["right"], link["left"]) == (right, left), link
        receiver = by_global[right]
        assert link["send"] == receiver["recv"], (
            f"rank {link['global']} sends to {right} on {link['send']} but {right} receives on "
            f"{receiver['recv']}"
        )
        # a ring of two over the whole world: 1 -> 0 on the second connection; else one group
        expected = "second" if n == 2 and members is None and i > (i + 1) % n else link["group"]
        if expected == "second":
            assert link["send"] != link["group"], f"the wrap link {link['global']}->{right}"
        else:
            assert link["send"] == link["group"], f"the link {link['global']}->{right}"
        pair = (link["send"], frozenset((link["global"], right)))
        used.setdefault(pair, set()).add((link["global"], right))
        assert link["cached"], "the second connection must be created once per group"
        assert link["single"] == (link["group"], link["group"])
    both_ways = {pair: dirs for pair, dirs in used.items() if len(dirs) > 1}
    assert not both_ways, f"connections carrying ring data both ways: {both_ways}"


def overlapping_rings_worker() -> list[bool]:
    """Rings on overlapping subgroups, one after the other, then a plain new group: no rank may
    wait for a group name another rank computed differently."""
    import torch
    import torch.distributed as dist

    from solutions.phase3_multi_node.ring_allreduce import ring_all_reduce

    rank, results = dist.get_rank(), []
    for members in ([0, 1], [1, 2, 3], [0, 2, 3], [2, 3]):
        group = dist.new_group(members)
        if rank in members:
            assert isinstance(group, dist.ProcessGroup)
            data = torch.full((10,), float(rank))
            ring_all_reduce(data, group=group)
            results.append(bool((data == sum(members)).all()))
    late = dist.new_group([0, 1, 2, 3])
    assert isinstance(late, dist.ProcessGroup)
    data = torch.ones(5)
    ring_all_reduce(data, group=late)
    results.append(bool((data == 4).all()))
    return results


def test_rings_on_overlapping_subgroups_do_not_hang() -> None:
    results = run_world(overlapping_rings_worker, 4, (), timeout=60)
    assert all(all(r) for r in results), results
