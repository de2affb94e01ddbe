"""The topology object: the (pp, dp, tp) grid as pure data, then its process groups in a world."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.distributed as dist

from course.comm_counter import CommCounter
from course.topology import GROUP_NAMES, Coords, GroupPool, RankGrid, Topology
from course.world import run_world

pytestmark = pytest.mark.harness

LAYOUTS = [(2, 2, 1), (1, 2, 2), (2, 1, 2), (4, 1, 1), (1, 4, 1), (1, 1, 4)]


def _every_rank_once(groups: list[tuple[int, ...]], world_size: int) -> bool:
    members = sorted(rank for group in groups for rank in group)
    return members == list(range(world_size))


# ---------------------------------------------------------------------- the grid, no processes


GRIDS = [(dp, tp, pp, 1, 1) for dp, tp, pp in [*LAYOUTS, (2, 2, 2)]] + [
    (2, 2, 2, 2, 1),
    (1, 1, 2, 2, 2),
    (2, 1, 1, 2, 4),
    (4, 1, 1, 1, 2),
    (2, 2, 1, 2, 2),
]
GRID_IDS = [f"dp{dp}-tp{tp}-pp{pp}-cp{cp}-ep{ep}" for dp, tp, pp, cp, ep in GRIDS]


@pytest.mark.parametrize(("dp", "tp", "pp", "cp", "ep"), GRIDS, ids=GRID_IDS)
def test_coords_round_trip_with_tp_fastest(dp: int, tp: int, pp: int, cp: int, ep: int) -> None:
    grid = RankGrid(dp, tp, pp, cp=cp, ep=ep)
    seen = []
    for rank in range(grid.world_size):
        here = grid.coords(rank)
        assert grid.rank_at(pp=here.pp, dp=here.dp, cp=here.cp, tp=here.tp) == rank
        seen.append(tuple(here))
    assert seen == sorted(seen)  # (pp, dp, cp, tp) in lexicographic order: tp varies fastest


@pytest.mark.parametrize(("dp", "tp", "pp", "cp", "ep"), GRIDS, ids=GRID_IDS)
def test_every_rank_is_in_exactly_one_group_of_each_kind(
    dp: int, tp: int, pp: int, cp: int, ep: int
) -> None:
    world = dp * tp * pp * cp
    grid = RankGrid(dp, tp, pp, ranks_per_node=2 if world % 2 == 0 else None, cp=cp, ep=ep)
    sizes = {
        "dp": dp,
        "cp": cp,
        "tp": tp,
        "pp": pp,
        "dp_cp": dp * cp,
        "ep": ep,
        "edp": dp * cp // ep,
        "embedding": min(pp, 2),
        "intra_node": 2 if world % 2 == 0 else 1,
        "inter_node": grid.num_nodes,
    }
    for name in GROUP_NAMES:
        groups = grid.groups(name)
        assert _every_rank_once(groups, grid.world_size), (name, groups)
        if name == "embedding":  # first and last stage; a middle stage alone
            assert {len(g) for g in groups} == {min(pp, 2)} | ({1} if pp > 2 else set())
            continue
        assert {len(group) for group in groups} == {sizes[name]}, (name, groups)
    varies = {"dp": {"dp"}, "cp": {"cp"}, "tp": {"tp"}, "pp": {"pp"}, "dp_cp": {"dp", "cp"}}
    varies.update(ep={"dp", "cp"}, edp={"dp", "cp"}, embedding={"pp"})
    for rank in range(grid.world_size):
        me = grid.coords(rank)._asdict()
        for name, axes in varies.items():  # a dp group varies only dp, and so on
            for other in grid.group_of(name, rank):
                theirs = grid.coords(other)._asdict()
                fixed = [a for a in me if a not in axes]
                assert [theirs[a] for a in fixed] == [me[a] for a in fixed], (name, rank, other)


def test_ep_groups_are_consecutive_ranks_of_dp_x_cp_and_edp_the_same_place_in_each() -> None:
    grid = RankGrid(2, 1, 2, cp=2, ep=2)  # pp=2: ranks 0-3 stage 0, 4-7 stage 1
    assert grid.dp_cp_groups() == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert grid.ep_groups() == [(0, 1), (2, 3), (4, 5), (6, 7)]  # the cp pairs
    assert grid.edp_groups() == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert grid.embedding_groups() == [(0, 4), (1, 5), (2, 6), (3, 7)]
    four = RankGrid(4, ep=4)
    assert four.ep_groups() == [(0, 1, 2, 3)] and four.edp_groups() == [(0,), (1,), (2,), (3,)]
    with_tp = RankGrid(2, 2, 1, cp=1, ep=2)
    assert with_tp.ep_groups() == [(0, 2), (1, 3)]  # same tp rank, different dp
    assert with_tp.embedding_groups() == [(0,), (1,), (2,), (3,)]  # pp == 1: one rank each


def test_groups_of_the_four_rank_layouts() -> None:
    assert RankGrid(2, 2, 1).dp_groups() == [(0, 2), (1, 3)]
    assert RankGrid(2, 2, 1).tp_groups() == [(0, 1), (2, 3)]
    assert RankGrid(2, 2, 1).pp_groups() == [(0,), (1,), (2,), (3,)]
    assert RankGrid(1, 2, 2).tp_groups() == [(0, 1), (2, 3)]
    assert RankGrid(1, 2, 2).pp_groups() == [(0, 2), (1, 3)]
    assert RankGrid(1, 2, 2).dp_groups() == [(0,), (1,), (2,), (3,)]
    assert RankGrid(2, 1, 2).dp_groups() == [(0, 1), (2, 3)]
    assert RankGrid(2, 1, 2).pp_groups() == [(0, 2), (1, 3)]
    assert RankGrid(4, 1, 1).dp_groups() == [(0, 1, 2, 3)]
    assert RankGrid(4, 1, 1).tp_groups() == [(0,), (1,), (2,), (3,)]


def test_eight_ranks_dp2_tp2_pp2_on_two_nodes() -> None:
    grid = RankGrid.for_world(8, dp=2, tp=2, pp=2, ranks_per_node=4)
    assert grid.coords(5) == Coords(pp=1, dp=0, cp=0, tp=1)
    assert grid.rank_at(pp=1, dp=1, tp=0) == 6
    assert grid.tp_groups() == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert grid.dp_groups() == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert grid.pp_groups() == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert grid.intra_node_groups() == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert grid.inter_node_groups() == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert [grid.node_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [grid.local_rank_of(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert grid.pipeline_neighbours(1) == (None, 5)
    assert grid.pipeline_neighbours(5) == (1, None)
    assert grid.tp_inside_nodes
    assert not RankGrid(1, 4, 2, ranks_per_node=2).tp_inside_nodes


def test_four_ranks_on_two_nodes_of_two() -> None:
    grid = RankGrid(2, 2, 1, ranks_per_node=2)
    assert grid.num_nodes == 2 and grid.per_node == 2
    assert grid.intra_node_groups() == [(0, 1), (2, 3)]
    assert grid.inter_node_groups() == [(0, 2), (1, 3)]
    assert grid.tp_groups() == grid.intra_node_groups()  # tp stays inside the node
    one_node = RankGrid(2, 2, 1)
    assert one_node.num_nodes == 1 and one_node.inter_node_groups() == [(0,), (1,), (2,), (3,)]


def test_pipeline_neighbours_walk_the_stages() -> None:
    grid = RankGrid(1, 1, 4)
    assert [grid.pipeline_neighbours(r) for r in range(4)] == [
        (None, 1),
        (0, 2),
        (1, 3),
        (2, None),
    ]


@pytest.mark.parametrize("dp", [None, -1])
def test_dp_none_takes_what_tp_and_pp_leave(dp: int | None) -> None:
    assert RankGrid.for_world(8, dp, tp=2, pp=2) == RankGrid(2, 2, 2)
    assert RankGrid.for_world(4, dp, tp=2) == RankGrid(2, 2, 1)
    assert RankGrid.for_world(8, dp, tp=2, cp=2) == RankGrid(2, 2, 1, cp=2)


def test_any_one_degree_may_be_the_rest() -> None:
    assert RankGrid.for_world(8, 2, tp=2, pp=2, cp=-1) == RankGrid(2, 2, 2, cp=1)
    assert RankGrid.for_world(8, 2, tp=-1, cp=2) == RankGrid(2, 2, 1, cp=2)
    assert RankGrid.for_world(8, 1, pp=-1, cp=2, ep=2) == RankGrid(1, 1, 4, cp=2, ep=2)
    with pytest.raises(ValueError, match="dp=-1 and cp=-1: only one degree can be 'the rest'"):
        RankGrid.for_world(8, -1, cp=-1)
    with pytest.raises(ValueError, match=r"dp=2 x tp=3 x pp=1 = 6 does not divide world size 8, so no cp"):
        RankGrid.for_world(8, 2, tp=3, cp=-1)


def test_describe_draws_the_grid() -> None:
    text = RankGrid(2, 2, 2, ranks_per_node=4).describe(mark=5)
    assert text.splitlines()[:4] == [
        "dp=2 x tp=2 x pp=2 = 8 ranks, 2 nodes of 4 ranks",
        "     dp0    dp1",
        "pp0  [0 1]  [2 3]",
        "pp1  [4 5*] [6 7]",
    ]
    assert "node 1: 4-7" in text


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dp": 3, "tp": 2}, "dp=3 x tp=2 x pp=1 = 6 != world size 4: .* e.g. dp=2"),
        ({"dp": 2}, "dp=2 x tp=1 x pp=1 = 2 != world size 4: .* e.g. dp=4"),
        ({"tp": 3}, r"tp=3 x pp=1 = 3 does not divide world size 4.*\[1, 2, 4\]"),
        ({"dp": 1, "tp": 3}, r"dp=1 x tp=3 x pp=1 = 3 != world size 4: .*\[1, 2, 4\]"),
        ({"dp": 0, "tp": 4}, "dp=0: every parallel degree must be >= 1"),
        ({"tp": 0}, "tp=0: every parallel degree must be >= 1"),
        ({"pp": -2}, "pp=-2: every parallel degree must be >= 1"),
        ({"ranks_per_node": 3}, r"ranks_per_node=3 does not divide world size 4.*\[1, 2, 4\]"),
    ],
)
def test_bad_layouts_name_the_values_and_a_fix(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RankGrid.for_world(4, **kwargs)


def test_bad_ranks_and_coordinates_are_refused() -> None:
    grid = RankGrid(2, 2, 1)
    with pytest.raises(ValueError, match="rank=4 is outside the world of 4 ranks"):
        grid.coords(4)
    with pytest.raises(ValueError, match=r"tp=2 is outside 0..1 \(tp degree 2\)"):
        grid.rank_at(0, 0, 2)
    with pytest.raises(ValueError, match="dp=None or -1 means 'the rest'"):
        RankGrid(-1, 2, 1)
    with pytest.raises(ValueError, match="group name 'sp'"):
        grid.groups("sp")
    with pytest.raises(ValueError, match="ep=3 does not divide dp=2 x cp=1 = 2"):
        RankGrid(2, 2, 1, ep=3)


# ---------------------------------------------------------------------- groups in a world


def _all_reduce_sums(topo: Topology) -> dict[str, Any]:
    """Every group all-reduces the global rank: each must get exactly its members' sum."""
    out: dict[str, Any] = {}
    for name in GROUP_NAMES:
        t = torch.tensor([float(topo.rank)])
        with CommCounter() as comm:
            dist.all_reduce(t, group=topo.group(name))
        out[name] = {
            "sum": t.item(),
            "ranks": topo.group_ranks(name),
            "recorded": comm.records[0].group_ranks,
            "crossing": comm.crossing(topo.group_ranks(name)),
            "size": dist.get_world_size(topo.group(name)),
            "group_rank": dist.get_rank(topo.group(name)),
        }
    return out


def _place(topo: Topology) -> dict[str, Any]:
    return {
        "coords": tuple(topo.coords),
        "ranks": (topo.dp_rank, topo.tp_rank, topo.pp_rank),
        "sizes": (topo.dp_size, topo.tp_size, topo.pp_size),
        "node": (topo.node, topo.local_rank, topo.num_nodes, topo.ranks_per_node),
        "pp": (topo.pp_prev, topo.pp_next, topo.is_first_stage, topo.is_last_stage),
        "same_objects": topo.dp_group is topo.group("dp") and topo.tp_group is topo.group("tp"),
    }


def topology_rank() -> dict[str, Any]:
    results: dict[str, Any] = {}
    for dp, tp, pp in [(2, 2, 1), (1, 2, 2)]:
        topo = Topology.build(dp, tp, pp)
        results[f"{dp}{tp}{pp}"] = {
            "sums": _all_reduce_sums(topo),
            "place": _place(topo),
            "describe": topo.describe(),
            "repr": repr(topo),
        }
    topo = Topology.build(1, 1, 2, cp=2, ep=2)
    results["cp2ep2"] = {"sums": _all_reduce_sums(topo), "describe": topo.describe()}
    pool = GroupPool()
    first = Topology.build(2, 2, 1, pool=pool)
    second = Topology.build(1, 2, 2, pool=pool)
    results["pool"] = {
        "tp_shared": first.tp_group is second.tp_group,  # (0, 1) and (2, 3) in both layouts
        "dp_apart": first.dp_group is not second.dp_group,
        "sets": len(pool),
        "sums": _all_reduce_sums(second),
    }
    pool.destroy()
    results["pool"]["sets_after_destroy"] = len(pool)
    topo = Topology.build(tp=2)  # dp=None: the rest of the world
    mesh = topo.as_device_mesh("cpu")
    results["mesh"] = {
        name: tuple(dist.get_process_group_ranks(mesh[name].get_group())) for name in ("dp", "tp")
    }
    results["mesh_expected"] = {name: topo.group_ranks(name) for name in ("dp", "tp")}
    return results


@pytest.fixture(scope="module")
def topology_world() -> list[dict[str, Any]]:
    return run_world(topology_rank, 4, nodes=2)


@pytest.mark.parametrize("layout", ["221", "122"])
def test_each_group_reduces_exactly_its_members(
    topology_world: list[dict[str, Any]], layout: str
) -> None:
    dp, tp, pp = (int(c) for c in layout)
    grid = RankGrid(dp, tp, pp, ranks_per_node=2)
    for rank, result in enumerate(topology_world):
        for name, got in result[layout]["sums"].items():
            members = grid.group_of(name, rank)
            assert got["ranks"] == members, (rank, name)
            assert got["sum"] == sum(members), (rank, name, got)
            assert got["recorded"] == members and got["crossing"] == [], (rank, name)
            assert (got["size"], got["group_rank"]) == (len(members), members.index(rank))


def test_cp_and_ep_groups_reduce_exactly_their_members(
    topology_world: list[dict[str, Any]],
) -> None:
    grid = RankGrid(1, 1, 2, ranks_per_node=2, cp=2, ep=2)
    for rank, result in enumerate(topology_world):
        for name, got in result["cp2ep2"]["sums"].items():
            members = grid.group_of(name, rank)
            assert got["ranks"] == members, (rank, name)
            assert got["sum"] == sum(members), (rank, name, got)
            assert got["crossing"] == [], (rank, name)
    text = topology_world[1]["cp2ep2"]["describe"]
    assert "dp=1 x cp=2 x tp=1 x pp=2 (ep=2 over dp x cp) = 4 ranks" in text
    assert "pp0  [0][1*]" in text and "ep (0, 1)" in text and "edp (1,)" in text


def test_a_pool_shares_one_group_per_rank_set_across_layouts(
    topology_world: list[dict[str, Any]],
) -> None:
    """Two layouts built with one GroupPool: one process group per distinct set of ranks over
    both (gloo gives each group an event loop that wakes every 10 ms), each still reducing
    exactly its members; destroy empties the pool."""
    grids = [RankGrid(2, 2, 1, ranks_per_node=2), RankGrid(1, 2, 2, ranks_per_node=2)]
    distinct = {ranks for grid in grids for name in GROUP_NAMES for ranks in grid.groups(name)}
    for rank, result in enumerate(topology_world):
        pooled = result["pool"]
        assert pooled["tp_shared"] and pooled["dp_apart"], (rank, pooled)
        assert pooled["sets"] == len(distinct), (rank, pooled["sets"], sorted(distinct))
        for name, got in pooled["sums"].items():
            members = grids[1].group_of(name, rank)
            assert got["ranks"] == members and got["sum"] == sum(members), (rank, name, got)
        assert pooled["sets_after_destroy"] == 0


def test_each_rank_knows_its_place(topology_world: list[dict[str, Any]]) -> None:
    places = [result["221"]["place"] for result in topology_world]
    assert [p["coords"] for p in places] == [(0, 0, 0, 0), (0, 0, 0, 1), (0, 1, 0, 0), (0, 1, 0, 1)]
    assert [p["ranks"] for p in places] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    assert {p["sizes"] for p in places} == {(2, 2, 1)}
    assert [p["node"] for p in places] == [(0, 0, 2, 2), (0, 1, 2, 2), (1, 0, 2, 2), (1, 1, 2, 2)]
    assert {p["pp"] for p in places} == {(None, None, True, True)}
    assert all(p["same_objects"] for p in places)
    pipeline = [result["122"]["place"]["pp"] for result in topology_world]
    first, last = (None, 2, True, False), (0, None, False, True)
    assert pipeline == [first, (None, 3, True, False), last, (1, None, False, True)]


def test_describe_and_repr_name_the_rank(topology_world: list[dict[str, Any]]) -> None:
    text = topology_world[3]["122"]["describe"]
    assert "pp1  [2 3*]" in text
    assert "rank 3* (pp=1, dp=0, tp=1; node 1, local rank 1)" in text
    assert "tp (2, 3)" in text and "pp (1, 3)" in text and "inter_node (1, 3)" in text
    assert re.fullmatch(
        r"Topology\(rank=3, dp=1, tp=2, pp=2, nodes=2x2, coords=\(1, 0, 1\)\)",
        topology_world[3]["122"]["repr"],
    )


def test_device_mesh_has_the_same_groups(topology_world: list[dict[str, Any]]) -> None:
    for result in topology_world:
        assert result["mesh"] == result["mesh_expected"]


# ---------------------------------------------------------------------- torchrun's environment


def test_ranks_per_node_comes_from_torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from course.topology import ranks_per_node_from_env

    for key in ("LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert ranks_per_node_from_env(4, 3) == 4  # no torchrun: one node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("GROUP_RANK", "1")
    assert ranks_per_node_from_env(4, 3) == 2
    with pytest.raises(ValueError, match="GROUP_RANK=1 but rank 1 would be on node 0"):
        ranks_per_node_from_env(4, 1)
    monkeypatch.setenv("GROUP_WORLD_SIZE", "3")
    with pytest.raises(
        ValueError, match="GROUP_WORLD_SIZE=3 nodes x LOCAL_WORLD_SIZE=2 != world size 4"
    ):
        ranks_per_node_from_env(4, 3)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=3 does not divide world size 4"):
        ranks_per_node_from_env(4, 3)
