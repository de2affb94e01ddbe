"""Rank function of tests/test_ring_links.py (module-level, so forked ranks can import it)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from phase3_multi_node.ring_links import RingLinks, second_connection


def describe_links(members: list[int] | None) -> dict[str, Any]:
    """This rank's links in a ring over ``members`` (None: the world), by group name."""
    group = dist.new_group(members) if members is not None else dist.group.WORLD
    if members is not None and dist.get_rank() not in members:
        return {"member": False}
    assert isinstance(group, dist.ProcessGroup)
    links = RingLinks.of(group)
    again = RingLinks.of(group)
    single = RingLinks.of(group, per_direction=False)
    return {
        "member": True,
        "global": dist.get_rank(),
        "right": links.right,
        "left": links.left,
        "send": links.send_group.group_name,
        "recv": links.recv_group.group_name,
        "group": group.group_name,
        "cached": second_connection(group) is second_connection(group)
        and again.send_group is links.send_group,
        "single": (single.send_group.group_name, single.recv_group.group_name),
    }
