"""Exercise 3.3, the hierarchical all-reduce: on simulated nodes (2x2, 2x3, 3x2: ranks laid out as
torchrun lays them, with its environment) and once on two real torchrun agents meeting at a c10d
rendezvous on loopback. The result equals ``dist.all_reduce``; the bytes each rank sends across
nodes equal 2(N-1)/N·S/k (S/k: its chunk of the intra-node reduce-scatter) and, summed over the
ranks, are fewer than a flat ring's.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.distributed as dist
from grading import exercise, impl
from learner_calls import learner_world
from phase3_helpers import fail, first_problems, module
from phase3_helpers import small_world as world_of_ranks

from course.topology import Topology
from course.torchrun_runner import run_torchrun
from course.world import WorldError
from solutions.phase3_multi_node.demos.hierarchical import check_hierarchical

DEMO = "solutions.phase3_multi_node.demos.hierarchical"


# an error a rank raises in given code is reported at the learner's call that caused it
small_world = learner_world(world_of_ranks, "3.3")


def simulated_worker(numel: int) -> dict[str, Any]:
    topology = Topology.build()  # nodes come from LOCAL_WORLD_SIZE, as under torchrun
    return check_hierarchical(topology, numel, impl())


def wrong_values_note(result: dict[str, Any]) -> str:
    """What the wrong result shows, from what the rank holds (see check_hierarchical)."""
    if not result["ring_equal"]:
        return " (and so does ring_all_reduce on the same world: fix 3.1 first)"
    if result.get("node_sum_only"):
        return (
            ": it holds the sum over its own node only, so nothing crossed nodes: step 2 "
            "all-reduces the rank's chunk over topology.inter_node_group (the ranks with the "
            "same local rank on every node)"
        )
    wrong, k, local = result.get("wrong_chunks", []), result["per_node"], result["local_rank"]
    if wrong and len(wrong) == k - 1 and local not in wrong:
        return (
            f": of the node's {k} chunks only its own (chunk {local}) is right, so the others "
            "never came back: step 3 all-gathers the chunk into the tensor over "
            "topology.intra_node_group"
        )
    if wrong:
        return (
            f" in chunks {wrong} of its node's {k} (torch.tensor_split's): each rank's chunk "
            "after step 1 must be the one step 2 all-reduces across nodes and step 3 gathers "
            "back, all on the same tensor (reduce_scatter_ring with inplace=True returns a view)"
        )
    return ""


def ring_worker(numel: int) -> bool:
    data = torch.randint(-8, 9, (numel,), generator=torch.Generator().manual_seed(3)).float()
    data = data * (dist.get_rank() + 1)
    ref = data.clone()
    module("ring_allreduce").ring_all_reduce(data)
    dist.all_reduce(ref)
    return torch.equal(data, ref)


def ring_verdict(nodes: int, per_node: int, numel: int) -> str:
    """After the hierarchical all-reduce failed: does 3.1's flat ring work on the same world?"""
    try:
        works = all(small_world(ring_worker, nodes * per_node, numel, nodes=nodes))
    except WorldError:
        works = False
    if not works:
        return (
            f"3.3 on {nodes} simulated nodes of {per_node}: 3.1's ring_all_reduce fails on this "
            "world too (checked just now): fix 3.1 first (uv run pytest -m ex3_1)."
        )
    return (
        f"3.3 on {nodes} simulated nodes of {per_node}: 3.1's ring_all_reduce works on this "
        "world (checked just now), so what fails is how the three steps are put together; "
        "causes that fit: a step on another group than the topology's for it (intra_node_group "
        "for the reduce-scatter and the all-gather, inter_node_group for the all-reduce across "
        "nodes; without group= a ring runs over the whole world), or the middle step on another "
        "tensor than the chunk the first one returned."
    )


def _ring_sends(numel: int, m: int, place: int) -> tuple[int, int]:
    """Bytes that a rank at ``place`` of a ring of ``m`` ranks sends for ``numel`` float32
    elements: (in the reduce-scatter, in the all-gather), chunks as torch.tensor_split cuts."""
    if m == 1:
        return 0, 0
    chunks = [p.numel() * 4 for p in torch.tensor_split(torch.empty(numel), m)]
    return numel * 4 - chunks[place], numel * 4 - chunks[(place + 1) % m]


def hierarchical_sends(
    nodes: int, k: int, numel: int, rank: int, plan: str = "right"
) -> tuple[int, int]:
    """(bytes inside the node, bytes to other nodes) that ``rank`` sends in a world of ``nodes``
    nodes of ``k`` ranks laid out as torchrun lays them, for the right three steps or for
    ``plan``, one of HIERARCHICAL_MISTAKES."""
    node, local = divmod(rank, k)
    chunk = torch.tensor_split(torch.empty(numel), k)[local].numel()
    rs, ag = _ring_sends(numel, k, local)
    if plan == "groups swapped":
        across = torch.tensor_split(torch.empty(numel), nodes)[node].numel()
        return sum(_ring_sends(across, k, local)), sum(_ring_sends(numel, nodes, node))
    if plan == "flat ring":
        sent = sum(_ring_sends(numel, nodes * k, rank))
        crosses = (rank + 1) % (nodes * k) // k != node
        return (0, sent) if crosses else (sent, 0)
    inter = {
        "skip all-reduce": 0,
        "whole tensor across": sum(_ring_sends(numel, nodes, node)),
    }.get(plan, sum(_ring_sends(chunk, nodes, node)))
    return rs + (0 if plan == "skip all-gather" else ag), inter


# The realistic mistakes of hierarchical_all_reduce that show in where its bytes go, and the
# words a failure uses when exactly one of them gives every rank's bytes inside and across
# nodes on both sizes of a layout (tests/phase3/mistakes_ex3_3.py plants each and its
# neighbours).
HIERARCHICAL_MISTAKES: dict[str, str] = {
    "skip all-reduce": (
        "no byte crossed nodes: the all-reduce across nodes (step 2, on "
        "topology.inter_node_group) never ran"
    ),
    "skip all-gather": (
        "each rank sent only its reduce-scatter inside the node: the all-gather over "
        "topology.intra_node_group (step 3) never ran"
    ),
    "groups swapped": (
        "the reduce-scatter and the all-gather ran across nodes and the all-reduce inside the "
        "node: the steps' groups are swapped, so S/N crossed where S/k should"
    ),
    "whole tensor across": (
        "the whole tensor crossed nodes, where only the rank's chunk should: step 2 "
        "all-reduces the chunk that step 1 returned, not the tensor"
    ),
    "flat ring": (
        "every rank sent what one flat ring over the whole world sends: ring_all_reduce "
        "without group=, not the three steps on the topology's groups"
    ),
}


def hierarchical_cause(results: list[dict[str, Any]]) -> str:
    """The mistake every rank's bytes fit, when exactly one of HIERARCHICAL_MISTAKES does (on
    every result given: every rank, every size); the list when several do; "" otherwise."""
    fits = [
        key
        for key in HIERARCHICAL_MISTAKES
        if all(
            (r["hierarchical"]["intra_node"], r["hierarchical"]["inter_node"])
            == hierarchical_sends(r["nodes"], r["per_node"], r["nbytes"] // 4, r["rank"], key)
            for r in results
        )
    ]
    if len(fits) == 1:
        return f"every rank's bytes fit one mistake: {HIERARCHICAL_MISTAKES[fits[0]]}"
    if fits:
        return f"every rank's bytes fit more than one mistake: {', or '.join(fits)}"
    return ""


def cross_node_problems(results: list[dict[str, Any]], label: str) -> list[str]:
    """Compare each rank's traffic with the formulas; the same for simulated and real nodes."""
    problems = []
    for result in results:
        rank, nodes, k = result["rank"], result["nodes"], result["per_node"]
        numel = result["nbytes"] // 4
        chunk = torch.tensor_split(torch.empty(numel), k)[result["local_rank"]].numel() * 4
        if not result["equal"]:
            problems.append(
                f"rank {rank} (node {result['node']}, local rank {result['local_rank']}): the "
                f"result differs from dist.all_reduce{wrong_values_note(result)}"
            )
        if result["collectives"]:
            problems.append(
                f"rank {rank} called {result['collectives']}: build it from the ring functions "
                "of 3.1 (isend/irecv), so the bytes can be counted"
            )
        per_group = result["per_group"]
        if (per_group["intra_node"], per_group["inter_node"]) != (
            result["hierarchical"]["intra_node"],
            result["hierarchical"]["inter_node"],
        ):
            problems.append(
                f"rank {rank} sent {per_group['intra_node']} bytes on topology.intra_node_group, "
                f"{per_group['inter_node']} on topology.inter_node_group and "
                f"{per_group['other']} on other groups, but {result['hierarchical']['intra_node']} "
                f"bytes went to its own node and {result['hierarchical']['inter_node']} to other "
                "nodes: traffic inside the node belongs on intra_node_group, traffic across on "
                "inter_node_group"
            )
        across = result["hierarchical"]["inter_node"]
        expected = 2 * (nodes - 1) * chunk // nodes
        if numel % (k * nodes) == 0 and across != expected:
            problems.append(
                f"rank {rank} sent {across} bytes to other nodes; the hierarchical all-reduce "
                f"sends 2(N-1)/N·S/k = 2·{nodes - 1}/{nodes}·{chunk} = {expected} (only its chunk "
                "of the intra-node reduce-scatter crosses, over topology.inter_node_group)"
            )
    hier = sum(r["hierarchical"]["inter_node"] for r in results)
    flat = sum(r["flat_ring"]["inter_node"] for r in results)
    if results and results[0]["nodes"] > 1 and not hier < flat:
        problems.append(
            f"in all, {hier} bytes crossed nodes with the hierarchical all-reduce and {flat} with "
            "a flat ring: the hierarchical one must send fewer across"
        )
    del label
    return problems


def layout_problems(results: list[dict[str, Any]], label: str) -> list[str]:
    """What the graders say about one layout (every rank's results on every size): the mistake
    the bytes single out first, when they do, then each problem."""
    problems: list[str] = []
    for numel in dict.fromkeys(r["nbytes"] for r in results):
        problems += cross_node_problems([r for r in results if r["nbytes"] == numel], label)
    cause = hierarchical_cause(results) if problems else ""
    return ([cause] if cause else []) + problems


SIMULATED_LAYOUTS = ((2, 2), (2, 3), (3, 2))  # nodes x ranks per node: N != k in two of them
SIMULATED_NUMELS = (600, 601)  # 601 divides by neither k nor N


@exercise("3.3")
@pytest.mark.parametrize("nodes, per_node", SIMULATED_LAYOUTS, ids=["2x2", "2x3", "3x2"])
def test_hierarchical_on_simulated_nodes(nodes: int, per_node: int) -> None:
    module("hierarchical_allreduce")  # an import error is reported as such, before any world
    results = []
    for numel in SIMULATED_NUMELS:
        try:
            results += small_world(simulated_worker, nodes * per_node, numel, nodes=nodes)
        except WorldError as exc:
            if getattr(exc, "exc_type", "") != "NotImplementedError":  # a TODO speaks for itself
                exc.args = (f"{ring_verdict(nodes, per_node, numel)}\n{exc}",)
            raise
    first_problems(
        layout_problems(results, f"{nodes}x{per_node}"),
        f"3.3 hierarchical_all_reduce on {nodes} simulated nodes of {per_node} ranks "
        "(float32, integer-valued):",
    )


def preflight_worker() -> None:
    """A world of one runs the code once, so an unwritten TODO costs a second, not a torchrun."""
    tensor = torch.ones(3)
    module("hierarchical_allreduce").hierarchical_all_reduce(tensor, Topology.build())


@exercise("3.3")
@pytest.mark.torchrun
def test_hierarchical_on_two_torchrun_agents() -> None:
    small_world(preflight_worker, 1)
    run = run_torchrun(
        DEMO,
        ["--impl", impl(), "--numel", "1200"],
        nproc_per_node=2,
        agents=2,
        time_limit=90,
        fork_workers=True,
    )
    results = [
        json.loads(line.removeprefix("RESULT "))
        for agent in (0, 1)
        for log in run.last_attempt(agent)
        for line in log.stdout.splitlines()
        if line.startswith("RESULT ")
    ]
    if not run.ok or len(results) != 4:
        fail(
            "3.3 hierarchical_all_reduce under two torchrun agents (--nnodes 2 --nproc-per-node 2, "
            f"c10d rendezvous on 127.0.0.1) did not finish with 4 RESULT lines:\n{run.describe(800)}"
        )
    nodes = {(r["rank"], r["node"]) for r in results}
    if sorted(r["rank"] for r in results) != [0, 1, 2, 3] or {n for _, n in nodes} != {0, 1}:
        fail(f"3.3 expected ranks 0-3 on nodes 0 and 1, got {sorted(nodes)}")
    first_problems(
        layout_problems(results, "torchrun"),
        "3.3 hierarchical_all_reduce on two torchrun agents (2 nodes x 2 ranks, loopback):",
    )
