"""CommCounter records where each message went (global ranks), and subgroups.py checks with it.

One world of 4 split in two pairs, (0, 1) and (2, 3), runs every scenario once (a world of 4 on
2 cores costs seconds); the tests below read its results.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from grading import world
from subgroups import SubgroupInfo, assert_no_crossing, split_into_groups

from course.comm_counter import CommCounter, CommRecord

pytestmark = pytest.mark.harness

NBYTES = 64  # 16 float32


def _message() -> torch.Tensor:
    return torch.full((16,), float(dist.get_rank()))


def _violation(counter: CommCounter, info: SubgroupInfo) -> str | None:
    try:
        assert_no_crossing(counter, info)
    except AssertionError as exc:
        return str(exc)
    return None


def _scenario(counter: CommCounter, info: SubgroupInfo) -> dict[str, Any]:
    return {
        "records": list(counter.records),
        "crossing": counter.crossing(info.ranks),
        "violation": _violation(counter, info),
        "sent": counter.bytes_sent,
        "received": counter.bytes_received,
    }


def pairs_rank() -> dict[str, Any]:
    info = split_into_groups(2)
    partner = 1 - info.group_rank
    out: dict[str, Any] = {"info": (info.ranks, info.index, info.group_rank, info.size)}

    with CommCounter() as comm:  # point-to-point with ranks within the group
        t = _message()
        if info.group_rank == 0:
            dist.send(t, group=info.group, group_dst=1)
        else:
            dist.recv(t, group=info.group, group_src=0)
        out["p2p_received"] = t[0].item()
    out["p2p_group_dst"] = _scenario(comm, info)

    with CommCounter() as comm:  # point-to-point with global ranks mapped from the group
        peer = dist.get_global_rank(info.group, partner)
        t = _message()
        if info.group_rank == 0:
            dist.send(t, dst=peer, group=info.group)
        else:
            dist.recv(t, src=peer, group=info.group)
    out["p2p_global"] = _scenario(comm, info)

    before = dist.P2POp(dist.isend, _message(), group=info.group, group_peer=partner)
    with CommCounter() as comm:  # batched, one op built before the counter was installed
        inbox = torch.zeros(16)
        receive = dist.P2POp(dist.irecv, inbox, group=info.group, group_peer=partner)
        for work in dist.batch_isend_irecv([before, receive]):
            work.wait()
        out["batch_received"] = inbox[0].item()
    out["batch"] = _scenario(comm, info)

    with CommCounter() as comm:
        t = _message()
        dist.all_reduce(t, group=info.group)
        dist.broadcast(t, group=info.group, group_src=1)
    out["subgroup_collectives"] = _scenario(comm, info)

    with CommCounter() as comm:
        dist.all_reduce(_message())  # forgot group=: runs on the world
    out["world_collective"] = _scenario(comm, info)
    out["world_inside_world"] = comm.crossing(range(dist.get_world_size()))

    with CommCounter() as comm:  # all-to-alls take (output, input): the input is what is sent
        outgoing = torch.zeros(6)  # 2 elements to the partner, 4 kept: uneven splits
        incoming = torch.zeros(6)
        splits = [4, 2] if info.group_rank == 0 else [2, 4]
        dist.all_to_all_single(
            incoming, outgoing, output_split_sizes=splits, input_split_sizes=splits,
            group=info.group,
        )
        dist.all_to_all_single(output=torch.zeros(4), input=torch.zeros(4), group=info.group)
    out["all_to_all"] = [record.nbytes for record in comm.records]

    with CommCounter() as comm:  # the classic slip: a group rank passed where a global one goes
        t = _message()
        if dist.get_rank() == 2:
            dist.send(t, dst=1)  # meant group rank 1 (global 3); reaches global rank 1
        elif dist.get_rank() == 1:
            dist.recv(t, src=2)
    out["wrong_peer"] = _scenario(comm, info)
    return out


@pytest.fixture(scope="module")
def pairs() -> list[dict[str, Any]]:
    return world(pairs_rank, 4)


def test_split_into_groups_gives_adjacent_pairs(pairs: list[dict[str, Any]]) -> None:
    assert [r["info"] for r in pairs] == [
        ((0, 1), 0, 0, 2),
        ((0, 1), 0, 1, 2),
        ((2, 3), 1, 0, 2),
        ((2, 3), 1, 1, 2),
    ]


def test_group_dst_and_group_src_are_recorded_as_global_peers(
    pairs: list[dict[str, Any]],
) -> None:
    for rank, result in enumerate(pairs):
        scenario = result["p2p_group_dst"]
        pair = (0, 1) if rank < 2 else (2, 3)
        partner = rank ^ 1
        op = "send" if rank % 2 == 0 else "recv"
        assert scenario["records"] == [CommRecord(op, NBYTES, partner, pair)], rank
        assert scenario["crossing"] == [] and scenario["violation"] is None
        assert result["p2p_received"] == float(rank & ~1)  # what group rank 0 sent
        assert result["p2p_global"]["records"] == scenario["records"]
    assert [r["p2p_group_dst"]["sent"] for r in pairs] == [NBYTES, 0, NBYTES, 0]


def test_batch_isend_irecv_records_each_op_with_its_global_peer(
    pairs: list[dict[str, Any]],
) -> None:
    for rank, result in enumerate(pairs):
        pair = (0, 1) if rank < 2 else (2, 3)
        partner = rank ^ 1
        assert result["batch"]["records"] == [
            CommRecord("isend", NBYTES, partner, pair),
            CommRecord("irecv", NBYTES, partner, pair),
        ]
        assert result["batch"]["sent"] == result["batch"]["received"] == NBYTES
        assert result["batch_received"] == float(partner)
        assert result["batch"]["crossing"] == []


def test_collectives_on_the_subgroup_do_not_cross(pairs: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(pairs):
        pair = (0, 1) if rank < 2 else (2, 3)
        assert result["subgroup_collectives"]["records"] == [
            CommRecord("all_reduce", NBYTES, None, pair),
            CommRecord("broadcast", NBYTES, pair[1], pair),  # group_src=1 is the global pair[1]
        ]
        assert result["subgroup_collectives"]["violation"] is None


def test_a_collective_on_the_world_group_crosses(pairs: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(pairs):
        scenario = result["world_collective"]
        assert scenario["records"] == [CommRecord("all_reduce", NBYTES, None, None)]
        assert scenario["crossing"] == scenario["records"]
        message = scenario["violation"]
        assert message is not None and f"rank {rank} called all_reduce" in message
        assert "on the world group" in message and "pass group=" in message
        assert result["world_inside_world"] == []  # the whole world is allowed: nothing crosses


def test_a_peer_outside_the_group_is_named(pairs: list[dict[str, Any]]) -> None:
    rank2 = pairs[2]["wrong_peer"]
    assert rank2["crossing"] == [CommRecord("send", NBYTES, 1, None)]
    assert rank2["violation"] == (
        "rank 2 sent 64 bytes to rank 1 with send outside its group (2, 3): pass group= to "
        "every collective and map peers with dist.get_global_rank(group, r)"
    )
    assert "rank 1 received 64 bytes from rank 2" in pairs[1]["wrong_peer"]["violation"]
    assert pairs[0]["wrong_peer"]["violation"] is None
    assert pairs[3]["wrong_peer"]["violation"] is None


def test_crossing_without_a_world_treats_the_default_group_as_outside() -> None:
    counter = CommCounter(
        records=[
            CommRecord("all_reduce", 4, None, (0, 1)),
            CommRecord("all_reduce", 4, None, None),
            CommRecord("isend", 4, 2, (0, 1, 2, 3)),
            CommRecord("irecv", 4, None, (0, 1)),
        ]
    )
    assert counter.crossing([0, 1]) == counter.records[1:3]
    assert counter.crossing([0, 1, 2, 3]) == [counter.records[1]]  # no world to compare with


def test_all_to_all_counts_the_input_it_hands_over(pairs: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(pairs):
        # positional (output, input) and keyword calls alike: the input's 24 and 16 bytes
        assert result["all_to_all"] == [24, 16], (rank, result["all_to_all"])
