"""Given for exercise 3.8: the 2-D layout of expert parallelism with data parallelism.

``ep x dp`` ranks. Each row of ``ep`` adjacent ranks is one **expert-parallel group**: together
they hold every expert once (rank j of the row holds experts ``j * E/ep ... (j+1) * E/ep - 1``)
and exchange tokens with all-to-alls. The ``dp`` rows are **replicas** of that group, each
training on its own tokens; the ranks that hold the same experts in different replicas form a
**data-parallel group** ("expert-data-parallel" in Megatron-LM) over which those experts'
gradients are reduced. The router is replicated on every rank::

    ep=2 x dp=2 = 4 ranks              ep groups (0, 1) (2, 3): all-to-all of tokens
            ep0      ep1               dp groups (0, 2) (1, 3): the experts' gradients
    dp0    [0        1]                world     (0, 1, 2, 3): the router's gradients
    dp1    [2        3]
    experts 0-1      2-3

ep is the fastest-varying index, so an expert-parallel group is adjacent ranks (one node, fast
links, for the all-to-alls of every layer); Megatron-LM orders its groups "tp-cp-ep-dp-pp" for the
same reason. The groups come from the course's one :class:`~course.topology.Topology`, whose
expert-parallel groups are carved out of its data-parallel ranks: ``Topology.build(dp=ep * dp,
ep=ep)`` has exactly these ep groups (``group("ep")``) and these data-parallel groups of the
experts (``group("edp")``), built once, collectively, on every rank. Exercise 4.7 lays the same
groups over data x context parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from course.topology import Topology


@dataclass(frozen=True, eq=False)
class ExpertLayout:
    """This rank's place in the ep x dp grid and its three groups; build it with
    :meth:`ExpertLayout.build` on every rank (it creates process groups: a collective)."""

    topology: Topology

    @classmethod
    def build(cls, ep: int, dp: int | None = None) -> ExpertLayout:
        """``ep`` ranks per expert-parallel group, ``dp`` replicas (None: what ep leaves of the
        world). ValueError when ep x dp is not the world size."""
        if ep < 1:
            raise ValueError(f"ep={ep}: an expert-parallel group has at least one rank")
        replicas = -1 if dp is None or dp == -1 else dp
        if replicas != -1 and replicas < 1:
            raise ValueError(f"dp={dp}: at least one replica of the expert-parallel group")
        world = dist.get_world_size()
        if replicas == -1:
            if world % ep:
                raise ValueError(
                    f"ep={ep} does not divide the world of {world} ranks: every replica of the "
                    "expert-parallel group needs ep ranks"
                )
            replicas = world // ep
        if ep * replicas != world:
            raise ValueError(
                f"ep={ep} x dp={replicas} = {ep * replicas} != world size {world}: the replicas "
                "of the expert-parallel group must fill the world"
            )
        return cls(Topology.build(dp=ep * replicas, ep=ep))

    @property
    def ep_group(self) -> dist.ProcessGroup:
        """The ranks that share the experts and exchange tokens (adjacent ranks)."""
        return self.topology.group("ep")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The ranks that hold the same experts in different replicas."""
        return self.topology.group("edp")

    @property
    def world_group(self) -> dist.ProcessGroup:
        """Every rank: the router is replicated on all of them."""
        world = dist.group.WORLD
        assert isinstance(world, dist.ProcessGroup), "the default process group is not set up"
        return world

    @property
    def ep_rank(self) -> int:
        return self.topology.rank_in("ep")

    @property
    def ep_size(self) -> int:
        return self.topology.ep_size

    @property
    def dp_rank(self) -> int:
        return self.topology.rank_in("edp")

    @property
    def dp_size(self) -> int:
        return self.topology.size_of("edp")

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def ep_ranks(self) -> tuple[int, ...]:
        """Global ranks of this rank's expert-parallel group."""
        return self.topology.group_ranks("ep")

    @property
    def dp_ranks(self) -> tuple[int, ...]:
        """Global ranks of this rank's data-parallel group."""
        return self.topology.group_ranks("edp")

    def describe(self, num_experts: int | None = None) -> str:
        """The grid: a row per replica, a column per expert-parallel rank (and, given the number
        of experts, which experts each column holds)."""
        ep, dp = self.ep_size, self.dp_size
        grid = self.topology.grid
        width = max(len(str(self.world_size - 1)), 5) + 2
        lines = [f"ep={ep} x dp={dp} = {self.world_size} ranks"]
        lines.append(" " * 9 + "".join(f"ep{j}".ljust(width) for j in range(ep)).rstrip())
        for d in range(dp):
            cells = "".join(str(grid.rank_at(dp=d * ep + j)).ljust(width) for j in range(ep))
            lines.append(f"dp{d}".ljust(9) + cells.rstrip())
        if num_experts is not None and num_experts % ep == 0:
            per = num_experts // ep
            held = "".join(
                (f"{j * per}-{j * per + per - 1}" if per > 1 else str(j * per)).ljust(width)
                for j in range(ep)
            )
            lines.append("experts".ljust(9) + held.rstrip())
        lines.append(
            "a row = one expert-parallel group (all-to-all); a column = one data-parallel group"
        )
        return "\n".join(lines)
