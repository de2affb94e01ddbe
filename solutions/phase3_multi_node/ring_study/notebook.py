"""Worker functions of notebooks/ring_allreduce.ipynb: record a real ring's messages, measure the
busbw curves, fit the model. Functions live here, not in the notebook, because the ranks of a
world must import them (``mp.spawn``/forkserver cannot run a function defined in a notebook).

:func:`record_ring` runs ``ring_all_reduce`` (``--impl``'s) in a world and records every
``dist.isend`` each rank posts: when, to whom, and which chunk of the tensor it carried (found
from the sent view's offset into the tensor, so nothing in the exercise code is instrumented).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from course.impl import load_impl
from course.world import run_world
from solutions.phase3_multi_node.benchmarks.collectives import Fit, Row, fit_models, run_benchmark

PHASE = "phase3_multi_node"


@dataclass(frozen=True)
class SendEvent:
    """One isend of one rank: seconds since the call began, peer, chunk, element range."""

    rank: int
    time: float
    peer: int
    chunk: int  # index of the chunk the elements belong to; -1 when not inside the tensor
    start: int  # element offset in the tensor
    numel: int
    clock: float = 0.0  # time.perf_counter() itself: CLOCK_MONOTONIC, one clock for every rank


@contextmanager
def _recording_sends(
    tensor: torch.Tensor, bounds: Sequence[tuple[int, int]], events: list[SendEvent], t0: float
) -> Iterator[None]:
    """Wrap ``dist.isend`` while the block runs; each call appends a :class:`SendEvent`."""
    original = c10d.isend
    base = tensor.data_ptr()
    size = tensor.element_size()
    rank = dist.get_rank()

    def isend(sent: torch.Tensor, dst: int | None = None, *args: Any, **kwargs: Any) -> Any:
        offset = (sent.data_ptr() - base) // size
        inside = 0 <= offset < tensor.numel()
        chunk = next((i for i, (lo, hi) in enumerate(bounds) if lo <= offset < hi), -1)
        peer = dst if dst is not None else int(kwargs.get("dst", -1))
        now = time.perf_counter()
        events.append(
            SendEvent(rank, now - t0, peer, chunk if inside else -1, offset, sent.numel(), now)
        )
        return original(sent, dst, *args, **kwargs)

    saved = [(module, module.isend) for module in (dist, c10d)]
    for module, _ in saved:
        module.isend = isend  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module, fn in saved:
            module.isend = fn  # type: ignore[attr-defined]


def _record_worker(numel: int, segment_bytes: int, impl: str) -> list[SendEvent]:
    ring = load_impl(PHASE, "ring_allreduce", impl)
    n = dist.get_world_size()
    tensor = torch.ones(numel)
    bounds = ring.chunk_bounds(numel, n)
    ring.ring_all_reduce(tensor.clone(), segment_bytes=segment_bytes)  # warm-up
    events: list[SendEvent] = []
    dist.barrier()
    t0 = time.perf_counter()
    with _recording_sends(tensor, bounds, events, t0):
        ring.ring_all_reduce(tensor, segment_bytes=segment_bytes)
    if not torch.equal(tensor, torch.full_like(tensor, float(n))):
        raise AssertionError("the recorded ring did not produce the sum")
    return events


def record_ring(
    world: int = 4, numel: int = 4096, segment_bytes: int = 1 << 30, impl: str = "solutions"
) -> list[SendEvent]:
    """Every isend of one ``ring_all_reduce`` of ``numel`` float32 values on ``world`` ranks.

    With the default (huge) ``segment_bytes`` each chunk is one message, so the k-th send of a
    rank is step k; a small ``segment_bytes`` shows the pipelined segments instead.
    """
    per_rank = run_world(_record_worker, world, (numel, segment_bytes, impl), timeout=120)
    return sorted((e for events in per_rank for e in events), key=lambda e: (e.rank, e.time))


def step_grid(events: Sequence[SendEvent], world: int) -> list[list[int]]:
    """``grid[rank][step]``: the chunk each rank sent at each step (one message per chunk)."""
    grid = []
    for rank in range(world):
        grid.append([e.chunk for e in events if e.rank == rank])
    return grid


def measure_curves(
    worlds: Sequence[int], sizes: Sequence[int], algorithms: Sequence[str], impl: str = "solutions",
    scale: float = 1.0,
) -> tuple[list[Row], list[Fit]]:  # fmt: skip
    """The benchmark's medians and the fitted alpha-beta model of each algorithm."""
    rows = run_benchmark(worlds, sizes, algorithms, impl=impl, scale=scale)
    return rows, fit_models(rows, 2, impl)


def model_busbw(fit: Fit, sizes: Sequence[float], impl: str = "solutions") -> list[float]:
    """busbw (GB/s) the fitted model predicts at each size."""
    from solutions.phase3_multi_node.benchmarks.collectives import cost_of

    world = fit.world
    factor = 2 * (world - 1) / world
    out = []
    for s in sizes:
        t = cost_of(fit.algorithm, s, world, 2, impl).time(fit.alpha, fit.beta)
        out.append(s / t * factor / 1e9)
    return out


def model_time(fit: Fit, impl: str = "solutions") -> Callable[[float], float]:
    """Seconds for S bytes under the fitted model."""
    from solutions.phase3_multi_node.benchmarks.collectives import cost_of

    return lambda s: cost_of(fit.algorithm, s, fit.world, 2, impl).time(fit.alpha, fit.beta)


# ----------------------------------------------------------------------------- conclusions
# Every sentence the notebook states about its results is printed by one of these, computed from
# the run's own data (tests/test_ring_notebook_claims.py recomputes them from the printed tables).


def grid_lines(grid: Sequence[Sequence[int]]) -> list[str]:
    """What the recorded grid shows: one chunk per link per step; the all-gather's start."""
    world = len(grid)
    steps = min(len(row) for row in grid)
    permutation = all(
        sorted(grid[rank][step] for rank in range(world)) == list(range(world))
        for step in range(steps)
    )
    own_first = all(grid[rank][world - 1] == rank for rank in range(world))
    forwarded = all(
        grid[rank][step + 1] == grid[(rank - 1) % world][step]
        for rank in range(world)
        for step in range(steps - 1)
    )
    return [
        f"every one of the {steps} steps sends each chunk exactly once (a permutation): "
        f"{'yes' if permutation else 'no'}",
        f"each rank's first all-gather send is its own chunk: {'yes' if own_first else 'no'}",
        "at every step after the first a rank sends what its left neighbour sent the step "
        "before: "
        f"{'yes' if forwarded else 'no'}",
    ]


def seam_lines(events: Sequence[SendEvent], world: int) -> list[str]:
    """Per rank r: when it sent the first segment of its own chunk (its all-gather's first
    step), how many segments of chunk r its left neighbour still had to send it (the
    reduce-scatter's last step). Both sides are read on ``time.perf_counter``, the machine's
    monotonic clock, the same in every process of one machine."""
    lines = []
    for rank in range(world):
        own = [e.clock for e in events if e.rank == rank and e.chunk == rank]
        left = (rank - 1) % world
        incoming = [e.clock for e in events if e.rank == left and e.chunk == rank]
        if not own or not incoming:
            continue
        later = sum(t > min(own) for t in incoming)
        lines.append(
            f"rank {rank}: its all-gather began while its left neighbour still had {later} of "
            f"the {len(incoming)} reduce-scatter segments of chunk {rank} to send it"
        )
    return lines


def curve_lines(rows: Sequence[Row]) -> list[str]:
    """Per world and algorithm: the size where busbw was highest, and whether that is the
    largest size measured (still rising) or busbw fell after it."""
    lines = []
    for world in sorted({r.world for r in rows}):
        largest = max(r.nbytes for r in rows if r.world == world)
        for algorithm in dict.fromkeys(r.algorithm for r in rows if r.world == world):
            mine = [r for r in rows if r.world == world and r.algorithm == algorithm]
            best = max(mine, key=lambda r: r.busbw)
            shape = (
                "at the largest size measured"
                if best.nbytes == largest
                else "below the largest size measured, then lower"
            )
            lines.append(
                f"world {world}, {algorithm}: busbw highest at {_human(best.nbytes)}, {shape}"
            )
    return lines


def model_lines(fits: Sequence[Fit], smallest: float, largest: float, impl: str) -> list[str]:
    """Per world: which fitted model predicts the shortest time at the smallest and at the
    largest size measured."""
    lines = []
    for world in sorted({f.world for f in fits}):
        mine = [f for f in fits if f.world == world]
        for label, size in (("smallest", smallest), ("largest", largest)):
            best = min(mine, key=lambda f: model_time(f, impl)(size))
            lines.append(
                f"world {world}: at the {label} size measured ({_human(size)}) the fitted models "
                f"predict {best.algorithm} fastest"
            )
    return lines


def alpha_lines(fits: Sequence[Fit]) -> list[str]:
    """The fitted per-message costs, per world (what sets the crossovers)."""
    lines = []
    for world in sorted({f.world for f in fits}):
        alphas = [1e6 * f.alpha for f in fits if f.world == world]
        lines.append(
            f"world {world}: fitted alpha from {min(alphas):.0f} to {max(alphas):.0f} us per "
            "message"
        )
    return lines


def _human(nbytes: float) -> str:
    from solutions.phase3_multi_node.benchmarks.collectives import human

    return human(nbytes)
