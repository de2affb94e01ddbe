"""A rank's two links in a ring: whom it sends to, whom it receives from, and on which connection.

Given to the ring of exercise 3.1 (not an exercise itself). Rings are written in group ranks and
``dst=``/``src=`` want global ones (:func:`~phase3_multi_node.collective_support.peer`);
:class:`RingLinks` does that mapping once, and adds one thing that only matters for speed:

**A connection per direction (gloo).** gloo's TCP transport keeps one connection per pair of
ranks, and one mutex per connection (gloo/transport/tcp/pair.cc, ``Pair::m_``). The device
thread holds it while it reads an arriving message out of the socket (``handleEvents`` ->
``read``), and ``Pair::send`` holds it while it writes a message in the caller's thread. On a
connection that carries data both ways, a rank therefore cannot write its outgoing segment while
its incoming one is being read: the two copies take turns. In a ring of two ranks the right and
the left neighbour are the same rank, so *every* message of the ring shares one connection. Here,
in a ring of two, the message from group rank 0 to 1 travels on ``group`` and the one from 1 to 0
on a second group over the same ranks, so that each connection carries data one way only (the
``ring_one_connection`` row of the ablation in guidelines.md, "3.1-3.3 measured on this machine",
measures what it buys). With three ranks or more the left and right links are different
connections already: each carries ring data one way, and ``group`` serves both.

NCCL's point-to-point channels have no such lock (sends and receives run on their own CUDA
streams), so for any backend but gloo both directions use ``group``.

The second group is created once per group, the first time a ring runs on it, and only for a
group that spans the whole world: creating a group advances a counter on the ranks that create
it, and torch names groups by that counter (``_process_group_name`` in
torch/distributed/distributed_c10d.py, hashed with the ranks under
``use_local_synchronization=True``). If only some ranks created one, a later group created by
other ranks (the ring on another subgroup, or any ``dist.new_group``) would get different names
on different ranks and hang in its rendezvous. A 2-rank subgroup of a larger world therefore
keeps one connection: correct, only without the speed-up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from phase3_multi_node.collective_support import group_and_size, peer

# Hang reports (course/p2p_ledger.py) name the line that called RingLinks.isend/irecv.
__p2p_ledger_transparent__ = True
# group -> the second group over the same ranks (kept alive with its group: keyed by the object)
_SECOND_CONNECTIONS: dict[dist.ProcessGroup, dist.ProcessGroup] = {}


def second_connection(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A process group over ``group``'s ranks with connections of its own, for a gloo group that
    spans the whole world; else ``group`` itself (see the module docstring for why).

    Collective over the world (every rank is a member) the first time it is called for a group.
    """
    if dist.get_backend(group) != "gloo" or dist.get_world_size(group) != dist.get_world_size():
        return group
    second = _SECOND_CONNECTIONS.get(group)
    if second is None:
        created = dist.new_group(
            dist.get_process_group_ranks(group),
            use_local_synchronization=True,
            group_desc="ring_second_connection",
        )
        assert isinstance(created, dist.ProcessGroup)  # only members call this
        second = _SECOND_CONNECTIONS[group] = created
    return second


@dataclass(frozen=True)
class RingLinks:
    """This rank's place in a ring over a group, and the two links it uses.

    ``rank``/``size`` are group ranks; ``right``/``left`` are the GLOBAL ranks of group ranks
    ``(rank + 1) % size`` and ``(rank - 1) % size``, what ``dst=``/``src=`` want.
    """

    rank: int
    size: int
    right: int
    left: int
    send_group: dist.ProcessGroup  # the connection to the right neighbour
    recv_group: dist.ProcessGroup  # the connection from the left neighbour

    @classmethod
    def of(cls, group: dist.ProcessGroup | None, *, per_direction: bool = True) -> RingLinks:
        """The links of this rank in a ring over ``group`` (None: the default group).

        ``per_direction=False`` sends both directions on ``group`` (the benchmark's ablation).
        Only a ring of two needs a second connection; with more ranks ``group`` serves both.
        """
        group, rank, size = group_and_size(group)
        if size == 1:
            return cls(rank, size, peer(group, 0), peer(group, 0), group, group)
        second = second_connection(group) if per_direction and size == 2 else group
        right, left = (rank + 1) % size, (rank - 1) % size
        return cls(
            rank=rank,
            size=size,
            right=peer(group, right),
            left=peer(group, left),
            send_group=group if rank < right else second,  # a < b: group; a > b: second
            recv_group=group if left < rank else second,
        )

    def isend(self, tensor: torch.Tensor, tag: int = 0) -> dist.Work | None:
        """Post a send of ``tensor`` to the right neighbour."""
        return dist.isend(tensor, dst=self.right, group=self.send_group, tag=tag)

    def irecv(self, tensor: torch.Tensor, tag: int = 0) -> dist.Work | None:
        """Post a receive into ``tensor`` from the left neighbour."""
        return dist.irecv(tensor, src=self.left, group=self.recv_group, tag=tag)
