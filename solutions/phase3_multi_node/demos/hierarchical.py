"""Run the hierarchical all-reduce on real nodes (or torchrun agents standing in for them) and
count the bytes that cross nodes, beside a flat ring's.

Two agents on one machine, meeting at a c10d rendezvous on loopback, are two "nodes" as far as
torchrun is concerned (GROUP_RANK, LOCAL_RANK, LOCAL_WORLD_SIZE are set as on a cluster):

    uv run torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \
        --rdzv-endpoint 127.0.0.1:29500 -m solutions.phase3_multi_node.demos.hierarchical &
    uv run torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \
        --rdzv-endpoint 127.0.0.1:29500 -m solutions.phase3_multi_node.demos.hierarchical

(on a real cluster, run the same command on each node with the first node's address). Add
``--impl templates`` to run your own code. Every rank prints one ``RESULT {json}`` line: whether
its result equals ``dist.all_reduce``'s, and the bytes it sent per group, across nodes, with the
hierarchical algorithm and with a flat ring; rank 0 then prints the totals.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from course.cli import parse_config, run_main
from course.comm_counter import CommCounter
from course.distributed import cleanup_distributed, setup_distributed
from course.impl import IMPLS, load_impl
from course.topology import Topology

PHASE = "phase3_multi_node"


def _sent_by_group(counter: CommCounter, topology: Topology) -> dict[str, int]:
    """Bytes this rank sent, split by where they went: inside its node or to another node."""
    out = {"intra_node": 0, "inter_node": 0}
    for record in counter.records:
        if record.op not in ("send", "isend") or record.peer is None:
            continue
        same_node = topology.grid.node_of(record.peer) == topology.node
        out["intra_node" if same_node else "inter_node"] += record.nbytes
    return out


def _sent_per_group(counter: CommCounter, topology: Topology) -> dict[str, int]:
    """Bytes this rank sent on each of its topology groups (and on any other group)."""
    names = {topology.group_ranks(name): name for name in ("intra_node", "inter_node")}
    out = {"intra_node": 0, "inter_node": 0, "other": 0}
    for record in counter.records:
        if record.op in ("send", "isend"):
            out[names.get(record.group_ranks or (), "other")] += record.nbytes
    return out


def check_hierarchical(topology: Topology, numel: int, impl: str) -> dict[str, Any]:
    """One hierarchical and one flat-ring all-reduce of ``numel`` float32 values: their results
    against ``dist.all_reduce``, and the bytes each sent inside and across nodes (a collective:
    call on every rank)."""
    hierarchical = load_impl(PHASE, "hierarchical_allreduce", impl).hierarchical_all_reduce
    ring = load_impl(PHASE, "ring_allreduce", impl).ring_all_reduce
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(100 + rank)
    data = torch.randint(-8, 9, (numel,), generator=g).float()  # exact in every order
    reference = data.clone()
    dist.all_reduce(reference)
    node_sum = data.clone()  # what a run that never crossed nodes would give
    dist.all_reduce(node_sum, group=topology.intra_node_group)
    mine, flat = data.clone(), data.clone()
    with CommCounter() as counter:
        hierarchical(mine, topology)
    k = topology.ranks_per_node
    pieces = zip(torch.tensor_split(mine, k), torch.tensor_split(reference, k), strict=True)
    wrong_chunks = [i for i, (a, b) in enumerate(pieces) if not torch.equal(a, b)]
    collectives = sorted({r.op for r in counter.records if not r.is_point_to_point})
    groups = sorted({r.group_ranks or () for r in counter.records if r.op in ("send", "isend")})
    hier_sent = _sent_by_group(counter, topology)
    with CommCounter() as flat_counter:
        ring(flat)
    return {
        "rank": rank,
        "node": topology.node,
        "local_rank": topology.local_rank,
        "nodes": topology.num_nodes,
        "per_node": topology.ranks_per_node,
        "nbytes": numel * 4,
        "equal": bool(torch.equal(mine, reference)),
        "node_sum_only": bool(torch.equal(mine, node_sum)) and topology.num_nodes > 1,
        "wrong_chunks": wrong_chunks,
        "ring_equal": bool(torch.equal(flat, reference)),
        "hierarchical": hier_sent,
        "per_group": _sent_per_group(counter, topology),
        "flat_ring": _sent_by_group(flat_counter, topology),
        "collectives": collectives,
        "groups": [list(g) for g in groups],
    }


@dataclass
class DemoConfig:
    """Flags of the demo."""

    numel: int = field(
        default=1 << 16,
        metadata={
            "help": "float32 elements to all-reduce",
            "ge": 1,
            "le": 1 << 28,
            "fix": "1 to 268435456 elements (1 GiB), e.g. 65536",
        },
    )
    impl: str = field(default="solutions", metadata={"choices": IMPLS, "help": "whose code runs"})


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(DemoConfig, argv, __doc__)  # refuses a bad --numel by name
    setup_distributed(timeout_seconds=60)
    try:
        topology = Topology.build()
        result = check_hierarchical(topology, config.numel, config.impl)
        print("RESULT " + json.dumps(result), flush=True)
        totals: list[dict[str, Any]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(totals, result)
        if result["rank"] == 0:
            hier = sum(r["hierarchical"]["inter_node"] for r in totals)
            flat = sum(r["flat_ring"]["inter_node"] for r in totals)
            ok = all(r["equal"] for r in totals)
            print(
                f"{topology.num_nodes} nodes x {topology.ranks_per_node} ranks, "
                f"{config.numel * 4} bytes: hierarchical all-reduce "
                f"{'equals' if ok else 'DIFFERS FROM'} dist.all_reduce; bytes across nodes "
                f"(all ranks): hierarchical {hier}, flat ring {flat}",
                flush=True,
            )
        dist.barrier()
    finally:
        cleanup_distributed()
    return 0


if __name__ == "__main__":
    run_main(main)
