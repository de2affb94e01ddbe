"""Exercise 3.3: topology-aware (hierarchical) all-reduce: intra-node, inter-node, intra-node.

Links inside a node (NVLink, shared memory) are an order of magnitude faster than the network
between nodes. A flat ring over N nodes of k ranks sends 2(n-1)/n·S from every rank, and the N
links that cross a node boundary each carry that much. The hierarchical all-reduce sends only
1/k of it across:

1. **reduce-scatter inside the node** (ring, over ``topology.intra_node_group``): local rank l
   ends with chunk l of its node's sum, S/k bytes;
2. **all-reduce across nodes** of that chunk (ring, over ``topology.inter_node_group``: the ranks
   with the same local rank on every node), so chunk l holds the sum over the whole world;
3. **all-gather inside the node**, so every rank holds every chunk.

Each rank sends 2(N-1)/N·S/k bytes across nodes, all ranks at once on their own paths, and
2(k-1)/k·S inside its node. The k inter-node rings run in parallel, one per local rank, which is
what uses every NIC of a node (NCCL's trees and rings across nodes are built per GPU for the same
reason; Horovod's ``HOROVOD_HIERARCHICAL_ALLREDUCE``; Jia et al., "Highly scalable deep learning
training system with mixed-precision", 2018, 2D/hierarchical all-reduce). The groups come from
the :class:`~course.topology.Topology` built once for the run; nothing here decides
which ranks share a node.
"""

from __future__ import annotations

import torch

from course.topology import Topology
from phase3_multi_node.collective_support import ReduceOp, check_reduce_args
from solutions.phase3_multi_node.ring_allreduce import (
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
    # TODO 3.3: reduce-scatter in the node, all-reduce across nodes, all-gather in the node.
    # Invariant: only the middle step crosses nodes, and it carries this rank's chunk (about
    #   S/k), not the whole tensor; every step runs on the topology's group for it.
    # Hint 1: your three ring functions of 3.1 each take a group; the reduce-scatter can work
    #   in place and hand back a view of tensor, which both later steps can use as it is.
    # Hint 2: three calls in order: the reduce-scatter over the ranks of this node (in place),
    #   an all-reduce of the chunk it returned over the ranks that share this local rank on
    #   every node, and an all-gather of that chunk into tensor over this node again. With one
    #   node, or one rank per node, the steps over a group of one rank do nothing.
    # Hint 3: reduce_scatter_ring of tensor with op on the topology's intra-node group, in
    #   place, returns the chunk; ring_all_reduce of that chunk with op on the inter-node
    #   group; all_gather_ring from the chunk into tensor on the intra-node group; return
    #   tensor.
    # See guidelines.md#33-hierarchical-all-reduce
    # >>> solution
    chunk = reduce_scatter_ring(tensor, op, topology.intra_node_group, inplace=True)
    ring_all_reduce(chunk, op, topology.inter_node_group)
    all_gather_ring(chunk, tensor, topology.intra_node_group)
    return tensor
    # <<< solution
