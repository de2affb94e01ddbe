# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase3.py
"""Exercise 3.3: topology-aware (hierarchical) all-reduce, crossing nodes with 1/k of the tensor.

Links inside a node (NVLink, shared memory) are an order of magnitude faster than the network
between nodes. A flat ring over N nodes of k ranks sends 2(n-1)/n·S from every rank, and the N
links that cross a node boundary each carry that much. The hierarchical all-reduce sends only
1/k of it across: each rank sends 2(N-1)/N·S/k bytes to other nodes, all ranks at once on their
own paths, built from the ring functions of 3.1 on the groups of the
:class:`~course.topology.Topology` built once for the run (Horovod's
``HOROVOD_HIERARCHICAL_ALLREDUCE``; Jia et al., "Highly scalable deep learning training system
with mixed-precision", 2018). Nothing here decides which ranks share a node. The contract and
the questions whose answers are the design: guidelines.md#33-hierarchical-all-reduce.
"""

from __future__ import annotations

import torch

from course.topology import Topology
from phase3_multi_node.collective_support import ReduceOp, check_reduce_args
from phase3_multi_node.template_ring_allreduce import (
    all_gather_ring,
    reduce_scatter_ring,
    ring_all_reduce,
)


def hierarchical_all_reduce(
    tensor: torch.Tensor, topology: Topology, op: object = ReduceOp.SUM
) -> torch.Tensor:
    """All-reduce ``tensor`` in place over the whole topology, crossing nodes with 1/k of it.

    ``topology`` gives this rank's ``intra_node_group`` (the k ranks of its node) and
    ``inter_node_group`` (the N ranks with its local rank, one per node). Returns ``tensor``.
    """
    check_reduce_args(tensor, op)
    if not isinstance(topology, Topology):
        raise TypeError(
            f"topology must be a course.topology.Topology (Topology.build(...) on every "
            f"rank), got {type(topology).__name__}"
        )
    # TODO 3.3: all-reduce over every rank of every node, crossing nodes with 1/k of the tensor
    # Invariant: tensor ends with the reduction over the whole world; each rank sends about
    #   2(N-1)/N·S/k bytes to other nodes, all on topology.inter_node_group, and what stays in
    #   its node on topology.intra_node_group; only 3.1's ring functions send.
    # Hint 1: your three ring functions of 3.1 each take a group.
    # More hints: uv run python -m tests.hint 3.3
    # See guidelines.md#33-hierarchical-all-reduce
    raise NotImplementedError(
        "TODO 3.3: all-reduce over every rank of every node, crossing nodes with 1/k of the tensor "
        "(see phase3_multi_node/guidelines.md#33-hierarchical-all-reduce)"
    )
