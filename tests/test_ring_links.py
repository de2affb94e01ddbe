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
        expected = link["group"] if i < (i + 1) % n else "second"
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
