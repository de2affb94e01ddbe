"""One object that names the layout of the world: pipeline x data x context x tensor degrees, the
expert-parallel groups laid over data x context, and nodes.

Parallel code never decides on its own which ranks it talks to: it is handed a :class:`Topology`
built once from the world, and takes its groups from it (``tp_group``, ``dp_group``, or
``group("dp_cp")``, ``group("ep")``, ...), never from a module global, so two layouts can live in
one test, and a reader sees in the signature what a function depends on.

Two parts, after picotron's ``ProcessGroupManager`` (a grid ``torch.arange(world).view(...)``
whose slices are the groups) and torchtitan's ``ParallelDims`` (validated degrees, ``-1`` for
"whatever is left", then one ``init_device_mesh``):

* :class:`RankGrid` is pure data: which global rank sits at which (pp, dp, cp, tp) coordinate,
  which ranks form each group, which node holds a rank. No processes, so it is unit-tested alone
  and printed for learners.
* :class:`Topology` is the grid plus this rank's process groups, each created once with
  ``dist.new_group`` in the same order on every rank; the layouts a program builds in one world
  can share them through a :class:`GroupPool` (an idle gloo group is not free).

Rank order: (pp, dp, cp, tp), tp varying fastest, so
``rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i``. This is Megatron-LM's default order
(``parallel_state``: "tp-cp-ep-dp-pp", tp fastest, pp slowest) and torchtitan's mesh order (pp
outermost, tp innermost). The reason is bandwidth: tensor parallelism all-reduces activations in
every layer, forward and backward, so its group must be adjacent ranks that share a node
(NVLink); context parallelism passes key/value blocks around a ring in every attention layer, the
next most talkative; data parallelism all-reduces gradients once per step and overlaps them with
backward; pipeline parallelism only passes activations between neighbouring stages, point to
point, so it tolerates the slowest links and may span nodes. Ranks fill nodes in order (as
torchrun assigns them), so adjacent ranks share a node.

Expert parallelism does not add an axis of its own: the ``ep`` ranks that share the experts of an
MoE layer are carved out of data x context (Megatron-LM's expert-model-parallel group and
torchtitan's ``ep`` mesh borrow those ranks the same way). Those ranks hold different tokens, which
is what an expert layer needs: tokens to exchange. Along the flattened (dp, cp) index, cp
fastest, every ``ep`` consecutive ranks form an expert-parallel group; the ranks at the same
place of every such block hold the same experts and form the expert-data-parallel group
(``edp``) that reduces those experts' gradients.

The groups a composition of every axis needs (:data:`GROUP_NAMES`):

* ``dp``, ``cp``, ``tp``, ``pp``: one axis each, the other three coordinates fixed;
* ``dp_cp``: the ranks that hold the same weights and different tokens (data x context): the
  data-parallel gradient reduction runs over it;
* ``ep`` and ``edp``: the experts' all-to-all, and their gradients' reduction;
* ``embedding``: the first and the last pipeline stage of one (dp, cp, tp) position: a tied
  embedding's two copies add their gradients there (Megatron-LM's embedding group);
* ``intra_node``, ``inter_node``: hierarchical all-reduce's groups.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch.distributed as dist

AXES = ("pp", "dp", "cp", "tp")  # the world's axes, slowest to fastest
GROUP_NAMES = (
    "dp",
    "cp",
    "tp",
    "pp",
    "dp_cp",
    "ep",
    "edp",
    "embedding",
    "intra_node",
    "inter_node",
)


class Coords(NamedTuple):
    """A rank's place in the grid: pipeline stage, data-parallel replica, context-parallel
    shard of the sequence, tensor-parallel shard of each layer."""

    pp: int
    dp: int
    cp: int
    tp: int


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_degree(name: str, value: object, rest_allowed: bool) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        rest = "dp=None or -1" if name == "dp" else f"{name}=-1"
        hint = f" ({rest} means 'the rest': use RankGrid.for_world)" if rest_allowed else ""
        raise ValueError(f"{name}={value!r}: every parallel degree must be >= 1{hint}")


def _resolve_rest(world_size: int, degrees: dict[str, int]) -> dict[str, int]:
    """Replace the one degree given as -1 by what the others leave of the world."""
    rest = [name for name, value in degrees.items() if value == -1]
    if len(rest) > 1:
        raise ValueError(
            f"{' and '.join(f'{n}=-1' for n in rest)}: only one degree can be 'the rest' (-1); "
            "give the others as numbers"
        )
    for name, value in degrees.items():
        if value != -1 and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r}: every parallel degree must be >= 1")
    if not rest:
        return degrees
    fixed = {name: value for name, value in degrees.items() if value != -1}
    product = 1
    for value in fixed.values():
        product *= value
    if world_size % product:
        named = " x ".join(f"{n}={v}" for n, v in fixed.items() if n != "cp" or v != 1)
        raise ValueError(
            f"{named} = {product} does not divide world size {world_size}, so no {rest[0]} "
            f"fills the world: choose degrees whose product is one of {_divisors(world_size)}"
        )
    return {**degrees, rest[0]: world_size // product}


@dataclass(frozen=True)
class RankGrid:
    """The (pp, dp, cp, tp) grid of global ranks, the ep groups over dp x cp, and nodes of
    ``ranks_per_node`` consecutive ranks.

    ``RankGrid(dp=2, tp=2, pp=1, ranks_per_node=2)`` is 4 ranks on 2 nodes;
    ``RankGrid(dp=2, tp=2, pp=2, cp=2, ep=4)`` is 16 ranks whose experts are spread over groups
    of 4 (dp x cp). Use :meth:`for_world` to check the degrees against a world size (and to let
    one degree fill the rest). ``ranks_per_node=None`` means one node holds every rank.
    """

    dp: int
    tp: int = 1
    pp: int = 1
    ranks_per_node: int | None = None
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp", "ep"):
            _check_degree(name, getattr(self, name), rest_allowed=name != "ep")
        if (self.dp * self.cp) % self.ep:
            fits = _divisors(self.dp * self.cp)
            raise ValueError(
                f"ep={self.ep} does not divide dp={self.dp} x cp={self.cp} = {self.dp * self.cp}: "
                f"the expert-parallel groups are carved out of the data x context ranks, which "
                f"hold different tokens; choose ep in {fits}"
            )
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
        *,
        cp: int = 1,
        ep: int = 1,
    ) -> RankGrid:
        """The grid for ``world_size`` ranks. One of dp, cp, tp, pp may be -1 ("the rest");
        ``dp=None`` is -1. ValueError naming the degrees and a fix when they do not fill the
        world."""
        if world_size < 1:
            raise ValueError(f"world_size={world_size}: a world has at least one rank")
        degrees = {"dp": -1 if dp is None else dp, "tp": tp, "pp": pp, "cp": cp}
        resolved = _resolve_rest(world_size, degrees)
        product = resolved["dp"] * resolved["tp"] * resolved["pp"] * resolved["cp"]
        if product != world_size:
            named = " x ".join(
                f"{n}={resolved[n]}" for n in ("dp", "tp", "pp", "cp") if n != "cp" or cp != 1
            )
            others = product // resolved["dp"]
            if world_size % others == 0:
                fix = f"e.g. dp={world_size // others}, or dp=None to take the rest"
            else:
                fix = "choose degrees whose product is one of " + str(_divisors(world_size))
            raise ValueError(
                f"{named} = {product} != world size {world_size}: the degrees must multiply to "
                f"the number of ranks; {fix}"
            )
        return cls(
            resolved["dp"], resolved["tp"], resolved["pp"], ranks_per_node, resolved["cp"], ep
        )

    # ------------------------------------------------------------------ sizes and coordinates

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

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
        rest, shard = divmod(rank, self.tp)
        rest, context = divmod(rest, self.cp)
        stage, replica = divmod(rest, self.dp)
        return Coords(stage, replica, context, shard)

    def rank_at(self, pp: int = 0, dp: int = 0, tp: int = 0, cp: int = 0) -> int:
        """The global rank at a coordinate (pass them by name: ``rank_at(pp=1, tp=0)``)."""
        for name, value, size in (
            ("pp", pp, self.pp),
            ("dp", dp, self.dp),
            ("cp", cp, self.cp),
            ("tp", tp, self.tp),
        ):
            if not 0 <= value < size:
                raise ValueError(f"{name}={value} is outside 0..{size - 1} ({name} degree {size})")
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def node_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.per_node

    def local_rank_of(self, rank: int) -> int:
        """The rank's index on its node (torchrun's LOCAL_RANK)."""
        self._check_rank(rank)
        return rank % self.per_node

    # ------------------------------------------------------------------ groups

    def _along(self, axis: str) -> list[tuple[int, ...]]:
        """The groups that vary one axis, the other three fixed, in rank order."""
        sizes = {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp}
        others = [a for a in AXES if a != axis]
        groups = []
        for fixed in range(self.world_size // sizes[axis]):
            place: dict[str, int] = {}
            for other in reversed(others):  # fastest first
                fixed, place[other] = divmod(fixed, sizes[other])
            groups.append(tuple(self.rank_at(**place, **{axis: i}) for i in range(sizes[axis])))
        return sorted(groups)

    def dp_groups(self) -> list[tuple[int, ...]]:
        """Ranks that hold the same model shard and the same positions of different samples."""
        return self._along("dp")

    def cp_groups(self) -> list[tuple[int, ...]]:
        """Ranks that hold the same model shard and different positions of the same samples:
        ring attention's ring."""
        return self._along("cp")

    def tp_groups(self) -> list[tuple[int, ...]]:
        """Ranks that split each layer's matrices: adjacent ranks."""
        return self._along("tp")

    def pp_groups(self) -> list[tuple[int, ...]]:
        """One pipeline each: the stages, in order, of one (dp, cp, tp) position."""
        return self._along("pp")

    def _dp_cp_blocks(self) -> list[list[int]]:
        """For each (pp, tp) position, its dp x cp ranks in (dp, cp) order, cp fastest."""
        return [
            [self.rank_at(pp=p, dp=d, cp=c, tp=t) for d in range(self.dp) for c in range(self.cp)]
            for p in range(self.pp)
            for t in range(self.tp)
        ]

    def dp_cp_groups(self) -> list[tuple[int, ...]]:
        """Ranks that hold the same weights and different tokens (data x context)."""
        return sorted(tuple(block) for block in self._dp_cp_blocks())

    def ep_groups(self) -> list[tuple[int, ...]]:
        """Ranks that share the experts of a layer: ``ep`` consecutive ranks of dp x cp."""
        return sorted(
            tuple(block[start : start + self.ep])
            for block in self._dp_cp_blocks()
            for start in range(0, len(block), self.ep)
        )

    def edp_groups(self) -> list[tuple[int, ...]]:
        """Ranks that hold the same experts (the same place in every ep group of dp x cp)."""
        return sorted(
            tuple(block[i :: self.ep]) for block in self._dp_cp_blocks() for i in range(self.ep)
        )

    def embedding_groups(self) -> list[tuple[int, ...]]:
        """The first and the last stage of each pipeline (one rank when pp == 1); a middle
        stage holds neither copy of a tied embedding and is a group of its own."""
        groups = []
        for pipeline in self.pp_groups():
            groups.append(tuple(sorted({pipeline[0], pipeline[-1]})))
            groups.extend((middle,) for middle in pipeline[1:-1])
        return sorted(groups)

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
            "cp": self.cp_groups,
            "tp": self.tp_groups,
            "pp": self.pp_groups,
            "dp_cp": self.dp_cp_groups,
            "ep": self.ep_groups,
            "edp": self.edp_groups,
            "embedding": self.embedding_groups,
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
        here = self.coords(rank)
        place = {"dp": here.dp, "cp": here.cp, "tp": here.tp}
        prev = self.rank_at(pp=here.pp - 1, **place) if here.pp > 0 else None
        nxt = self.rank_at(pp=here.pp + 1, **place) if here.pp < self.pp - 1 else None
        return prev, nxt

    @property
    def tp_inside_nodes(self) -> bool:
        """True when no tensor-parallel group spans two nodes (what Megatron arranges for)."""
        return all(len({self.node_of(r) for r in group}) == 1 for group in self.tp_groups())

    # ------------------------------------------------------------------ printing

    def degrees(self) -> str:
        """``dp=2 x tp=2 x pp=2`` (cp and ep named when they are not 1)."""
        named = [f"dp={self.dp}", f"tp={self.tp}", f"pp={self.pp}"]
        if self.cp > 1:
            named.insert(1, f"cp={self.cp}")
        text = " x ".join(named)
        return text + (f" (ep={self.ep} over dp x cp)" if self.ep > 1 else "")

    def describe(self, mark: int | None = None) -> str:
        """The grid as a small table: a row per pipeline stage, a column per data-parallel
        replica, each cell its context-parallel shards, each ``[...]`` one tensor-parallel
        group; ``mark`` puts a ``*`` after one rank."""
        nodes = f"{self.num_nodes} node{'s' * (self.num_nodes > 1)} of {self.per_node} ranks"
        lines = [f"{self.degrees()} = {self.world_size} ranks, {nodes}"]

        def cell(p: int, d: int) -> str:
            parts = []
            for c in range(self.cp):
                ranks = [self.rank_at(pp=p, dp=d, cp=c, tp=t) for t in range(self.tp)]
                parts.append("[" + " ".join(f"{r}{'*' if r == mark else ''}" for r in ranks) + "]")
            return "".join(parts)

        cells = [[cell(p, d) for d in range(self.dp)] for p in range(self.pp)]
        width = max(len(c) for row in cells for c in [*row, f"dp{self.dp - 1}"])
        head = " " * 5 + " ".join(f"dp{d}".ljust(width) for d in range(self.dp))
        lines.append(head.rstrip())
        for p, row in enumerate(cells):
            lines.append(f"pp{p}".ljust(5) + " ".join(c.ljust(width) for c in row).rstrip())
        legend = "[...] = one tp group; same place in each row of a column = one pipeline"
        if self.cp > 1:
            legend += f"; the {self.cp} [...] of a cell = its cp shards (one ring)"
        lines.append(legend)
        if self.ep > 1:
            lines.append("ep groups: " + " ".join(str(g) for g in self.ep_groups()))
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


class GroupPool:
    """The process groups made in one world, by rank set, for every :class:`Topology` built with
    it: a program that builds many layouts in one world (a benchmark's interleaved rounds, the
    planner's anchor steps) then makes one group per distinct set of ranks, not one per layout.

    Why it matters: each gloo process group gets its own TCP device, whose event loop thread
    wakes every 10 ms even when idle (gloo/transport/tcp/loop.cc, ``Loop::run``:
    ``epoll_wait(..., 10)``). Groups are never freed until the world ends, so without a pool
    every layout built adds loops that wake on every rank, and on a machine whose ranks share
    few cores each one takes CPU from every later step: the steps of a world grow slower the
    more layouts it has built. :meth:`destroy` frees the pool's groups once its layouts are
    done (call it on every rank, at the same point).

    The pool belongs to the world it was filled in; every rank must build the same layouts with
    it in the same order, as :meth:`Topology.build` requires anyway."""

    def __init__(self) -> None:
        self._made: dict[tuple[int, ...], Any] = {}

    def group(self, ranks: tuple[int, ...], description: str) -> Any:
        """The group of ``ranks``, made with ``dist.new_group`` (a collective over the world)
        the first time those ranks are asked for; the non-member sentinel on other ranks."""
        if ranks not in self._made:
            self._made[ranks] = dist.new_group(list(ranks), group_desc=description)
        return self._made[ranks]

    def __len__(self) -> int:
        """How many distinct rank sets the pool has made groups for."""
        return len(self._made)

    def destroy(self) -> None:
        """Free the groups this rank belongs to; the pool is empty afterwards. Topologies built
        with it must not be used again."""
        for group in self._made.values():
            if isinstance(group, dist.ProcessGroup):
                dist.destroy_process_group(group)
        self._made.clear()


@dataclass(frozen=True, eq=False)  # process groups compare by identity: so do topologies
class Topology:
    """The grid and this rank's process groups. Build it with :meth:`Topology.build` on every rank.

    Pass it to parallel code; read ``tp_group``/``tp_rank``/``tp_size`` (and the dp, cp, pp, node
    equivalents) there, or any group by name: ``group("dp_cp")``, ``rank_in("ep")``,
    ``size_of("edp")``. ``group_ranks(name)`` gives the global ranks of one of this rank's groups.
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
        cp: int = 1,
        ep: int = 1,
        world_size: int | None = None,
        ranks_per_node: int | None = None,
        pool: GroupPool | None = None,
    ) -> Topology:
        """Create every group once, in the same order on every rank (a collective: call it on all).

        Order: the groups of each name of :data:`GROUP_NAMES` in turn; each rank calls
        ``dist.new_group`` for every group, including the ones it is not in, because
        ``new_group`` is itself a collective over the world (as Megatron's
        ``initialize_model_parallel`` does). With a :class:`GroupPool`, a set of ranks that an
        earlier topology of the pool already has takes that group instead of a new one.
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
        grid = RankGrid.for_world(actual, dp, tp, pp, ranks_per_node, cp=cp, ep=ep)
        mine: dict[str, dist.ProcessGroup] = {}
        made = GroupPool() if pool is None else pool
        for name in GROUP_NAMES:
            for index, ranks in enumerate(grid.groups(name)):
                # one process group per set of ranks: a name whose groups repeat another's (cp
                # when cp == 1 and tp == 1, say) shares its objects, and its creation costs nothing
                group = made.group(ranks, f"{name}{index}")
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

    def rank_in(self, name: str) -> int:
        """This rank's index in its group of kind ``name`` (no communication)."""
        return self.group_ranks(name).index(self.rank)

    def size_of(self, name: str) -> int:
        """How many ranks this rank's group of kind ``name`` holds."""
        return len(self.group_ranks(name))

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self._groups["dp"]

    @property
    def cp_group(self) -> dist.ProcessGroup:
        return self._groups["cp"]

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
    def cp_rank(self) -> int:
        return self.coords.cp

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
    def cp_size(self) -> int:
        return self.grid.cp

    @property
    def tp_size(self) -> int:
        return self.grid.tp

    @property
    def pp_size(self) -> int:
        return self.grid.pp

    @property
    def ep_size(self) -> int:
        return self.grid.ep

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
        c = self.coords
        cp = f", cp={c.cp}" if self.cp_size > 1 else ""
        where = (
            f"rank {self.rank}* (pp={c.pp}, dp={c.dp}{cp}, tp={c.tp}; "
            f"node {self.node}, local rank {self.local_rank})"
        )
        shown = [
            name
            for name in GROUP_NAMES
            if name in ("dp", "tp", "pp", "intra_node", "inter_node")
            or (name in ("cp", "dp_cp") and self.cp_size > 1)
            or (name in ("ep", "edp") and self.ep_size > 1)
        ]
        groups = ", ".join(f"{name} {self.group_ranks(name)}" for name in shown)
        return f"{self.grid.describe(mark=self.rank)}\n{where}: {groups}"

    def __repr__(self) -> str:
        extra = f", cp={self.cp_size}" * (self.cp_size > 1) + f", ep={self.ep_size}" * (
            self.ep_size > 1
        )
        coords = (
            tuple(self.coords) if self.cp_size > 1 else (self.pp_rank, self.dp_rank, self.tp_rank)
        )
        return (
            f"Topology(rank={self.rank}, dp={self.dp_size}, tp={self.tp_size}, pp={self.pp_size}"
            f"{extra}, nodes={self.num_nodes}x{self.ranks_per_node}, coords={coords})"
        )

    def as_device_mesh(self, device_type: str = "cpu") -> Any:
        """torch's ``DeviceMesh`` with the same layout, dims ("pp", "dp", "cp", "tp") (cp left
        out when it is 1), for the library comparisons (FSDP2, ``parallelize_module``). It
        creates its own process groups: call it on every rank. ``init_device_mesh`` lays ranks
        out as ``arange(world).view(pp, dp, cp, tp)``, the same order as :class:`RankGrid`."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.cp_size == 1:
            return init_device_mesh(
                device_type,
                (self.pp_size, self.dp_size, self.tp_size),
                mesh_dim_names=("pp", "dp", "tp"),
            )
        return init_device_mesh(
            device_type,
            (self.pp_size, self.dp_size, self.cp_size, self.tp_size),
            mesh_dim_names=("pp", "dp", "cp", "tp"),
        )
