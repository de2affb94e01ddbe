"""Exercise 3.6, gradient clipping across shards: ``uv run pytest tests/test_phase3.py -m ex3_6``.

One process computes the gradients of 3.6's stack of 4 MLP blocks (float64) and clips them with
``torch.nn.utils.clip_grad_norm_(max_norm = half the norm)``, for the 2-norm and the inf-norm.
In one world of 4 ranks, every rank then holds the pieces of the same gradients a sharded model
holds, with their placement (``GradShard.replicated_on``), and calls your ``clip_grad_norm_``:

* 3D layouts (dp, tp, pp) = (2, 2, 1), (1, 2, 2), (2, 1, 2): fc1 rows and fc2 columns per tp
  rank, fc2's bias whole on every tp rank, a stage's blocks per pp rank, everything the same on
  every dp rank;
* ZeRO-2/3 gradient slices on dp = 4, and on dp = 2 x pp = 2: each rank's slice of every
  layer's flat, padded gradient.

Checked: the norm every rank returns equals one process's (1e-12 relative), and every rank's
gradients afterwards equal its pieces of one process's clipped gradients. A wrong norm is
matched against the classic mistakes, simulated on the same pieces, and named: the local norm
only, a tp-replicated bias counted tp times, pipeline stages not reduced, dp replicas counted
dp times, dp slices not reduced, the inf-norm summed. ``counted_here`` is also tried alone on
every rank of a (2, 2, 2) grid.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from clip_helpers import (
    LAYOUTS,
    NORMS,
    TOLERANCE,
    Layout,
    clip_worker,
    close,
    dense_grads,
    named_mistakes,
    pieces,
    torch_clip,
)
from grading import exercise, load
from phase3_helpers import first_problems, small_world

from course.topology import RankGrid
from phase3_multi_node.clip_placement import GradShard

PHASE = "phase3_multi_node"
_RUNS: list[list[dict[str, Any]]] | BaseException | None = None


def runs() -> list[list[dict[str, Any]]]:
    """Per rank, the results of every layout and norm (one world of 4 for all of them)."""
    global _RUNS
    if _RUNS is None:
        try:
            _RUNS = small_world(clip_worker, 4)
        except BaseException as exc:
            _RUNS = exc
    if isinstance(_RUNS, BaseException):
        raise _RUNS
    return _RUNS


def _ppdptp(grid: RankGrid, rank: int) -> tuple[int, int, int]:
    here = grid.coords(rank)
    return here.pp, here.dp, here.tp


def norm_name(norm_type: float) -> str:
    return "inf-norm" if math.isinf(norm_type) else f"{norm_type:g}-norm"


@exercise("3.6")
def test_counted_here_counts_every_set_of_copies_once() -> None:
    clipping = load(PHASE, "grad_clipping")
    grid = RankGrid(dp=2, tp=2, pp=2)
    problems = []
    for axes in (frozenset(), frozenset({"dp"}), frozenset({"tp"}), frozenset({"dp", "tp"})):
        shard = GradShard("g", torch.zeros(1), axes)
        counted: dict[tuple[int, ...], list[int]] = {}
        for rank in range(grid.world_size):
            here = grid.coords(rank)
            pp, dp, tp = here.pp, here.dp, here.tp
            topology = SimpleNamespace(
                rank=rank, dp_rank=dp, tp_rank=tp, pp_rank=pp, cp_rank=0, dp_size=2, tp_size=2,
                pp_size=2, cp_size=1, coords=grid.coords(rank),
                rank_in=lambda name, rank=rank: grid.group_of(name, rank).index(rank),
            )  # fmt: skip
            # the ranks holding the same copy differ only along the replicated axes
            key = tuple(c for c, axis in zip((pp, dp, tp), ("pp", "dp", "tp"), strict=True)
                        if axis not in axes)  # fmt: skip
            if clipping.counted_here(shard, topology):
                counted.setdefault(key, []).append(rank)
            else:
                counted.setdefault(key, [])
        for key, who in counted.items():
            if len(who) != 1:
                copies = [r for r in range(8) if tuple(
                    c for c, a in zip(_ppdptp(grid, r), ("pp", "dp", "tp"), strict=True)
                    if a not in axes) == key]  # fmt: skip
                what = f"replicated on {sorted(axes)}" if axes else "held by its rank alone"
                problems.append(
                    f"a gradient {what}: of the ranks {copies} holding the same copy, "
                    f"{'ranks ' + str(who) if who else 'none'} counted it; exactly one must "
                    "(e.g. the one whose coordinate is 0 on every replicated axis)"
                )
                break
    first_problems(problems, "3.6 counted_here on every rank of a dp=2 x tp=2 x pp=2 grid:")


def layout_problems(layout: Layout, results: list[list[dict[str, Any]]]) -> list[str]:
    grads = dense_grads()
    problems = []
    for norm_type in NORMS:
        want, max_norm, clipped = torch_clip(norm_type)
        got = [
            next(r for r in per_rank if r["layout"] == layout and r["norm_type"] == norm_type)
            for per_rank in results
        ]
        norms = [r["norm"] for r in got]
        name = norm_name(norm_type)
        if not all(close(n, want) for n in norms):
            shown = ", ".join(f"{n:.6g}" for n in norms)
            named = named_mistakes(layout, norm_type, norms, grads)
            problems.append(
                f"{name}: the ranks returned {shown}; one process's clip_grad_norm_ returns "
                f"{want:.6g}" + (f": {named}" if named else "")
            )
            continue
        for rank, result in enumerate(got):
            expected = {p.name: p.values for p in pieces(layout, rank, clipped)}
            for piece_name, tensor in expected.items():
                mine = result["grads"].get(piece_name)
                if mine is None or not torch.allclose(mine, tensor, rtol=TOLERANCE, atol=0):
                    problems.append(
                        f"{name}: rank {rank}'s {piece_name} after clipping differs from its "
                        f"piece of one process's clipped gradient (max_norm {max_norm:.4g}): "
                        "every gradient is scaled by min(1, max_norm / (norm + 1e-6)) with the "
                        "GLOBAL norm"
                    )
                    break
    return problems


@exercise("3.6")
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.label.replace(" ", ""))
def test_clip_grad_norm_over_shards_equals_one_process(layout: Layout) -> None:
    first_problems(
        layout_problems(layout, runs()),
        f"3.6 clip_grad_norm_ over {layout.label}, against torch.nn.utils.clip_grad_norm_ on "
        "one process holding the whole model (float64):",
    )
