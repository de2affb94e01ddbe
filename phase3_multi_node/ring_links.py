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
the left neighbour are the same rank, so *every* message of the ring shares one connection. Here a
message from group rank a to group rank b travels on ``group`` when a < b and on a second group
over the same ranks when a > b, so that each connection carries data one way only. Measured on a
2-core machine (gloo, loopback, 8 MiB each way between two ranks, medians of 41): 4.9-5.3 ms with
a connection per direction against 5.8-8.1 ms on one; the 2-rank ring at 16 MiB runs at
1.14-1.25x ``dist.all_reduce``'s bandwidth with it and 0.96-1.05x without (guidelines.md, "3.1-3.3
measured on this machine"). With three ranks or more the left and right links are different
connections already and nothing changes.

NCCL's point-to-point channels have no such lock (sends and receives run on their own CUDA
streams), so for any backend but gloo both directions use ``group``.

The second group is created once per group, the first time a ring runs on it, by the group's
members only (``dist.new_group(..., use_local_synchronization=True)``): every member calls the
ring on the same group at the same point, so they create it together.
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
    """A process group over ``group``'s ranks with connections of its own (gloo); else ``group``.

    Collective over the members of ``group`` the first time it is called for that group.
    """
    if dist.get_backend(group) != "gloo":
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
        """
        group, rank, size = group_and_size(group)
        if size == 1:
            return cls(rank, size, peer(group, 0), peer(group, 0), group, group)
        second = second_connection(group) if per_direction else group
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
