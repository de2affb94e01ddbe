"""One object that names the layout of the world: data x tensor x pipeline degrees, and nodes.

Parallel code never decides on its own which ranks it talks to: it is handed a :class:`Topology`
built once from the world, and takes its ``dp_group``, ``tp_group``, ``pp_group``,
``intra_node_group`` or ``inter_node_group`` from it (never from a module global, so two layouts
can live in one test, and a reader sees in the signature what a function depends on).

Two parts, after picotron's ``ProcessGroupManager`` (a grid ``torch.arange(world).view(...)``
whose slices are the groups) and torchtitan's ``ParallelDims`` (validated degrees, ``-1`` for
"whatever is left", then one ``init_device_mesh``):

* :class:`RankGrid` is pure data: which global rank sits at which (pp, dp, tp) coordinate, which
  ranks form each group, which node holds a rank. No processes, so it is unit-tested alone and
  printed for learners.
* :class:`Topology` is the grid plus this rank's process groups, each created once with
  ``dist.new_group`` in the same order on every rank.

Rank order: (pp, dp, tp), tp varying fastest, so ``rank = (pp_i * dp + dp_i) * tp + tp_i``. This
is Megatron-LM's default order (``parallel_state``: "tp-cp-ep-dp-pp", tp fastest, pp slowest) and
torchtitan's mesh order (pp outermost, tp innermost). The reason is bandwidth: tensor parallelism
all-reduces activations in every layer, forward and backward, so its group must be adjacent ranks
that share a node (NVLink); data parallelism all-reduces gradients once per step and overlaps them
with backward; pipeline parallelism only passes activations between neighbouring stages, point to
point, so it tolerates the slowest links and may span nodes. Ranks fill nodes in order (as
torchrun assigns them), so adjacent ranks share a node.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch.distributed as dist

GROUP_NAMES = ("dp", "tp", "pp", "intra_node", "inter_node")


class Coords(NamedTuple):
    """A rank's place in the grid: pipeline stage, data-parallel replica, tensor-parallel shard."""

    pp: int
    dp: int
    tp: int


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _resolve_dp(world_size: int, dp: int | None, tp: int, pp: int) -> int:
    """``dp`` itself, or ``world_size // (tp * pp)`` for None/-1 (torchtitan's ``dp_shard=-1``)."""
    for name, value in (("tp", tp), ("pp", pp)):
        if value < 1:
            raise ValueError(f"{name}={value}: every parallel degree must be >= 1")
    if dp is not None and dp != -1:
        return dp
    if world_size % (tp * pp):
        raise ValueError(
            f"tp={tp} x pp={pp} = {tp * pp} does not divide world size {world_size}, so no dp "
            f"fills the world: choose tp and pp whose product is one of {_divisors(world_size)}"
        )
    return world_size // (tp * pp)


@dataclass(frozen=True)
class RankGrid:
    """The (pp, dp, tp) grid of global ranks, and nodes of ``ranks_per_node`` consecutive ranks.

    ``RankGrid(dp=2, tp=2, pp=1, ranks_per_node=2)`` is 4 ranks on 2 nodes; use
    :meth:`for_world` to check the degrees against a world size (and to let dp fill the rest).
    ``ranks_per_node=None`` means one node holds every rank.
    """

    dp: int
    tp: int = 1
    pp: int = 1
    ranks_per_node: int | None = None

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                hint = " (dp=None or -1 means 'the rest': use RankGrid.for_world)" * (name == "dp")
                raise ValueError(f"{name}={value!r}: every parallel degree must be >= 1{hint}")
        per_node = self.ranks_per_node
        if per_node is not None and (per_node < 1 or self.world_size % per_node):
            raise ValueError(
                f"ranks_per_node={per_node} does not divide world size {self.world_size}: nodes "
                f"must hold the same number of ranks, one of {_divisors(self.world_size)}"
            )

    @classmethod
    def for_world(
        cls,
        world_size: int,
        dp: int | None = None,
        tp: int = 1,
        pp: int = 1,
        ranks_per_node: int | None = None,
    ) -> RankGrid:
        """The grid for ``world_size`` ranks; ``dp=None`` (or -1) takes what tp and pp leave."""
        if world_size < 1:
            raise ValueError(f"world_size={world_size}: a world has at least one rank")
        dp = _resolve_dp(world_size, dp, tp, pp)
        if dp < 1:
            raise ValueError(f"dp={dp}: every parallel degree must be >= 1 (or None for the rest)")
        if dp * tp * pp != world_size:
            if world_size % (tp * pp) == 0:
                fix = f"e.g. dp={world_size // (tp * pp)}, or dp=None to take the rest"
            else:
                fix = f"choose tp and pp whose product is one of {_divisors(world_size)}"
            raise ValueError(
                f"dp={dp} x tp={tp} x pp={pp} = {dp * tp * pp} != world size {world_size}: "
                f"the degrees must multiply to the number of ranks; {fix}"
            )
        return cls(dp, tp, pp, ranks_per_node)

    # ------------------------------------------------------------------ sizes and coordinates

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def per_node(self) -> int:
        """Ranks on each node (the whole world when ``ranks_per_node`` is None)."""
        return self.ranks_per_node or self.world_size

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.per_node

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside the world of {self.world_size} ranks")

    def coords(self, rank: int) -> Coords:
        self._check_rank(rank)
        stage, rest = divmod(rank, self.dp * self.tp)
        replica, shard = divmod(rest, self.tp)
        return Coords(stage, replica, shard)

    def rank_at(self, pp: int, dp: int, tp: int) -> int:
        for name, value, size in (("pp", pp, self.pp), ("dp", dp, self.dp), ("tp", tp, self.tp)):
            if not 0 <= value < size:
                raise ValueError(f"{name}={value} is outside 0..{size - 1} ({name} degree {size})")
        return (pp * self.dp + dp) * self.tp + tp

    def node_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.per_node

    def local_rank_of(self, rank: int) -> int:
        """The rank's index on its node (torchrun's LOCAL_RANK)."""
        self._check_rank(rank)
        return rank % self.per_node

    # ------------------------------------------------------------------ groups

    def dp_groups(self) -> list[tuple[int, ...]]:
        """Ranks that hold the same model shard and average gradients: same pp and tp."""
        return [
            tuple(self.rank_at(p, d, t) for d in range(self.dp))
            for p in range(self.pp)
            for t in range(self.tp)
        ]

    def tp_groups(self) -> list[tuple[int, ...]]:
        """Ranks that split each layer's matrices: same pp and dp; adjacent ranks."""
        return [
            tuple(self.rank_at(p, d, t) for t in range(self.tp))
            for p in range(self.pp)
            for d in range(self.dp)
        ]

    def pp_groups(self) -> list[tuple[int, ...]]:
        """One pipeline each: the stages, in order, of one (dp, tp) position."""
        return [
            tuple(self.rank_at(p, d, t) for p in range(self.pp))
            for d in range(self.dp)
            for t in range(self.tp)
        ]

    def intra_node_groups(self) -> list[tuple[int, ...]]:
        """The ranks of each node (fast links: hierarchical all-reduce's first and last steps)."""
        k = self.per_node
        return [tuple(range(n * k, (n + 1) * k)) for n in range(self.num_nodes)]

    def inter_node_groups(self) -> list[tuple[int, ...]]:
        """Ranks with the same local rank on every node: hierarchical all-reduce's middle step."""
        k = self.per_node
        return [tuple(n * k + local for n in range(self.num_nodes)) for local in range(k)]

    def groups(self, name: str) -> list[tuple[int, ...]]:
        """The groups of one kind: ``name`` is one of :data:`GROUP_NAMES`."""
        makers: dict[str, Callable[[], list[tuple[int, ...]]]] = {
            "dp": self.dp_groups,
            "tp": self.tp_groups,
            "pp": self.pp_groups,
            "intra_node": self.intra_node_groups,
            "inter_node": self.inter_node_groups,
        }
        if name not in makers:
            raise ValueError(f"group name {name!r}: choose one of {', '.join(GROUP_NAMES)}")
        return makers[name]()

    def group_of(self, name: str, rank: int) -> tuple[int, ...]:
        """The group of kind ``name`` that holds ``rank``."""
        self._check_rank(rank)
        return next(group for group in self.groups(name) if rank in group)

    def pipeline_neighbours(self, rank: int) -> tuple[int | None, int | None]:
        """Global ranks of the stages before and after ``rank`` (None at either end)."""
        stage, replica, shard = self.coords(rank)
        prev = self.rank_at(stage - 1, replica, shard) if stage > 0 else None
        nxt = self.rank_at(stage + 1, replica, shard) if stage < self.pp - 1 else None
        return prev, nxt

    @property
    def tp_inside_nodes(self) -> bool:
        """True when no tensor-parallel group spans two nodes (what Megatron arranges for)."""
        return all(len({self.node_of(r) for r in group}) == 1 for group in self.tp_groups())

    # ------------------------------------------------------------------ printing

    def describe(self, mark: int | None = None) -> str:
        """The grid as a small table: a row per pipeline stage, a column per data-parallel replica,
        each cell one tensor-parallel group; ``mark`` puts a ``*`` after one rank."""
        nodes = f"{self.num_nodes} node{'s' * (self.num_nodes > 1)} of {self.per_node} ranks"
        lines = [f"dp={self.dp} x tp={self.tp} x pp={self.pp} = {self.world_size} ranks, {nodes}"]

        def cell(p: int, d: int) -> str:
            ranks = [self.rank_at(p, d, t) for t in range(self.tp)]
            return "[" + " ".join(f"{r}{'*' if r == mark else ''}" for r in ranks) + "]"

        cells = [[cell(p, d) for d in range(self.dp)] for p in range(self.pp)]
        width = max(len(c) for row in cells for c in [*row, f"dp{self.dp - 1}"])
        head = " " * 5 + " ".join(f"dp{d}".ljust(width) for d in range(self.dp))
        lines.append(head.rstrip())
        for p, row in enumerate(cells):
            lines.append(f"pp{p}".ljust(5) + " ".join(c.ljust(width) for c in row).rstrip())
        lines.append("[...] = one tp group; same place in each row of a column = one pipeline")
        if self.num_nodes > 1:
            spans = [f"node {n}: {g[0]}-{g[-1]}" for n, g in enumerate(self.intra_node_groups())]
            lines.append("; ".join(spans))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


# ---------------------------------------------------------------------- with processes


def ranks_per_node_from_env(world_size: int, rank: int) -> int:
    """Ranks per node as torchrun exported them (LOCAL_WORLD_SIZE), checked; else one node.

    When GROUP_RANK/GROUP_WORLD_SIZE (the node's index and the node count) are there too, they
    must agree with nodes of LOCAL_WORLD_SIZE consecutive ranks; heterogeneous nodes
    (``--nproc-per-node`` differing between agents) cannot be laid out as a grid and are refused.
    """
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is None:
        return world_size
    per_node = int(local)
    if per_node < 1 or world_size % per_node:
        raise ValueError(
            f"LOCAL_WORLD_SIZE={per_node} does not divide world size {world_size}: every node "
            "must run the same number of ranks (the same --nproc-per-node on every agent)"
        )
    nodes = os.environ.get("GROUP_WORLD_SIZE")
    if nodes is not None and int(nodes) * per_node != world_size:
        raise ValueError(
            f"GROUP_WORLD_SIZE={nodes} nodes x LOCAL_WORLD_SIZE={per_node} != world size "
            f"{world_size}: nodes run different numbers of ranks; pass ranks_per_node= explicitly"
        )
    node = os.environ.get("GROUP_RANK")
    if node is not None and int(node) != rank // per_node:
        raise ValueError(
            f"GROUP_RANK={node} but rank {rank} would be on node {rank // per_node} with "
            f"{per_node} ranks per node: ranks do not fill nodes in order; pass ranks_per_node="
        )
    return per_node


@dataclass(frozen=True, eq=False)  # process groups compare by identity: so do topologies
class Topology:
    """The grid and this rank's process groups. Build it with :meth:`Topology.build` on every rank.

    Pass it to parallel code; read ``tp_group``/``tp_rank``/``tp_size`` (and the dp, pp, node
    equivalents) there. ``group_ranks(name)`` gives the global ranks of one of this rank's groups.
    """

    rank: int
    grid: RankGrid
    _groups: dict[str, dist.ProcessGroup] = field(repr=False)

    @classmethod
    def build(
        cls,
        dp: int | None = None,
        tp: int = 1,
        pp: int = 1,
        *,
        world_size: int | None = None,
        ranks_per_node: int | None = None,
    ) -> Topology:
        """Create every group once, in the same order on every rank (a collective: call it on all).

        Order: all dp groups, then tp, pp, intra-node, inter-node; each rank calls
        ``dist.new_group`` for every group, including the ones it is not in, because
        ``new_group`` is itself a collective over the world (as Megatron's
        ``initialize_model_parallel`` does).
        """
        if not dist.is_initialized():
            raise RuntimeError(
                "Topology.build needs a process group: call dist.init_process_group first "
                "(or RankGrid.for_world for the layout alone)"
            )
        actual = dist.get_world_size()
        if world_size is not None and world_size != actual:
            raise ValueError(
                f"world_size={world_size} but the process group has {actual} ranks: "
                "leave world_size=None to use the process group's"
            )
        rank = dist.get_rank()
        if ranks_per_node is None:
            ranks_per_node = ranks_per_node_from_env(actual, rank)
        grid = RankGrid.for_world(actual, dp, tp, pp, ranks_per_node)
        mine: dict[str, dist.ProcessGroup] = {}
        for name in GROUP_NAMES:
            for index, ranks in enumerate(grid.groups(name)):
                group = dist.new_group(list(ranks), group_desc=f"{name}{index}")
                if rank in ranks:
                    assert isinstance(group, dist.ProcessGroup), (name, ranks, rank)
                    mine[name] = group
        return cls(rank, grid, mine)

    # ------------------------------------------------------------------ groups

    def group(self, name: str) -> dist.ProcessGroup:
        if name not in self._groups:
            raise ValueError(f"group name {name!r}: choose one of {', '.join(GROUP_NAMES)}")
        return self._groups[name]

    def group_ranks(self, name: str) -> tuple[int, ...]:
        """Global ranks of this rank's group of kind ``name`` (one of :data:`GROUP_NAMES`)."""
        return self.grid.group_of(name, self.rank)

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self._groups["dp"]

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self._groups["tp"]

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self._groups["pp"]

    @property
    def intra_node_group(self) -> dist.ProcessGroup:
        return self._groups["intra_node"]

    @property
    def inter_node_group(self) -> dist.ProcessGroup:
        return self._groups["inter_node"]

    # ------------------------------------------------------------------ this rank's place

    @property
    def world_size(self) -> int:
        return self.grid.world_size

    @property
    def coords(self) -> Coords:
        return self.grid.coords(self.rank)

    @property
    def dp_rank(self) -> int:
        return self.coords.dp

    @property
    def tp_rank(self) -> int:
        return self.coords.tp

    @property
    def pp_rank(self) -> int:
        return self.coords.pp

    @property
    def dp_size(self) -> int:
        return self.grid.dp

    @property
    def tp_size(self) -> int:
        return self.grid.tp

    @property
    def pp_size(self) -> int:
        return self.grid.pp

    @property
    def node(self) -> int:
        return self.grid.node_of(self.rank)

    @property
    def local_rank(self) -> int:
        return self.grid.local_rank_of(self.rank)

    @property
    def num_nodes(self) -> int:
        return self.grid.num_nodes

    @property
    def ranks_per_node(self) -> int:
        return self.grid.per_node

    @property
    def pp_prev(self) -> int | None:
        """Global rank of the previous pipeline stage, None on the first stage."""
        return self.grid.pipeline_neighbours(self.rank)[0]

    @property
    def pp_next(self) -> int | None:
        """Global rank of the next pipeline stage, None on the last stage."""
        return self.grid.pipeline_neighbours(self.rank)[1]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    # ------------------------------------------------------------------ printing and libraries

    def describe(self) -> str:
        """The grid table with this rank starred, and this rank's coordinates and groups."""
        where = (
            f"rank {self.rank}* (pp={self.pp_rank}, dp={self.dp_rank}, tp={self.tp_rank}; "
            f"node {self.node}, local rank {self.local_rank})"
        )
        groups = ", ".join(f"{name} {self.group_ranks(name)}" for name in GROUP_NAMES)
        return f"{self.grid.describe(mark=self.rank)}\n{where}: {groups}"

    def __repr__(self) -> str:
        return (
            f"Topology(rank={self.rank}, dp={self.dp_size}, tp={self.tp_size}, pp={self.pp_size}, "
            f"nodes={self.num_nodes}x{self.ranks_per_node}, coords={tuple(self.coords)})"
        )

    def as_device_mesh(self, device_type: str = "cpu") -> Any:
        """torch's ``DeviceMesh`` with the same layout, dims ("pp", "dp", "tp"), for the library
        comparisons (FSDP2, ``parallelize_module``). It creates its own process groups: call it on
        every rank. ``init_device_mesh`` lays ranks out as ``arange(world).view(pp, dp, tp)``,
        the same order as :class:`RankGrid`."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(
            device_type,
            (self.pp_size, self.dp_size, self.tp_size),
            mesh_dim_names=("pp", "dp", "tp"),
        )
