"""Exercise 2.5 (partition): cut an ``nn.Sequential`` into p contiguous, balanced stages.

A pipeline runs at the pace of its slowest stage: in steady state every stage waits for it. So
the stages should cost about the same, where cost is what limits the run: parameter count when
memory does, measured time per layer when speed does. Cutting a list of n layer costs into p
contiguous, non-empty pieces so that the most expensive piece is as cheap as possible is the
classic *linear partition* problem (Skiena, "The Algorithm Design Manual", section 8.5), solved
exactly by dynamic programming in O(p·n²). GPipe's library (torchgpipe, Kim et al. 2020,
"balance by time" and "balance by size") and PipeDream's planner solve versions of it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
from torch import nn


def check_partition_args(costs: Sequence[float], num_stages: int) -> None:
    """Refuse what cannot be cut: no stages, more stages than layers, negative costs."""
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages}: a pipeline needs at least one stage")
    if num_stages > len(costs):
        raise ValueError(
            f"{num_stages} stages but the model has {len(costs)} layers: every stage needs at "
            f"least one layer, so use at most {len(costs)} stages or a deeper model"
        )
    negative = [i for i, cost in enumerate(costs) if cost < 0]
    if negative:
        raise ValueError(f"layer costs must be >= 0; layers {negative} have negative costs")


def stage_costs(costs: Sequence[float], parts: Sequence[range]) -> list[float]:
    """The summed cost of each part."""
    return [sum(costs[i] for i in part) for part in parts]


def balanced_partition(costs: Sequence[float], num_stages: int) -> list[range]:
    """Cut layers 0..n-1 into ``num_stages`` contiguous non-empty ranges, minimising the largest
    summed cost. Returns the ranges in order; they cover every layer exactly once."""
    check_partition_args(costs, num_stages)
    # TODO 2.5: split the cost list into num_stages contiguous pieces, minimising the largest.
    # Invariant: the ranges are non-empty, in order, and cover 0..n-1 exactly; no other split
    #   into num_stages contiguous pieces has a smaller maximum piece cost.
    # Hint 1: an exact answer must weigh every cut, and the cuts are many; but many of them
    #   begin the same way.
    # Hint 2: Take the best cut of the first j layers into k stages: where can its last stage
    #   begin, and what does the whole cut cost, given the best cut of the layers before that
    #   stage into k − 1 stages? What is the answer for one stage? Once every best cost is
    #   known, how do you recover the ranges themselves?
    # Hint 3: The best maximum for the first j layers in k stages is the smallest, over every
    #   start i of the last stage that leaves each earlier stage a layer (i from k − 1 to
    #   j − 1), of the larger of two numbers: the best for the first i layers in k − 1 stages,
    #   and the cost of layers i to j − 1. For one stage it is the cost of the whole prefix.
    # Hint 4: Prefix sums give any range's cost at once. Remember, for each (k, j), the start
    #   that won: the ranges come back from the end, the last stage starting at the start
    #   remembered for (num_stages, n), the stage before it ending there, and so on to layer 0.
    # Hint 5: Fill a table of best costs for k from 1 to num_stages and j from k to n, with the
    #   winning starts beside it; then walk back from (num_stages, n), putting each range in
    #   front of those found so far, and return them.
    # See guidelines.md#25-pipeline-parallelism
    # >>> solution
    n = len(costs)
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    for j in range(1, n + 1):
        best[1][j] = prefix[j]
    for k in range(2, num_stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                candidate = max(best[k - 1][i], prefix[j] - prefix[i])
                if candidate < best[k][j]:
                    best[k][j], cut[k][j] = candidate, i
    parts: list[range] = []
    end = n
    for k in range(num_stages, 0, -1):
        start = cut[k][end] if k > 1 else 0
        parts.insert(0, range(start, end))
        end = start
    return parts
    # <<< solution


def parameter_costs(model: nn.Sequential) -> list[int]:
    """Number of parameters of each layer: balance this when memory is what limits."""
    return [sum(p.numel() for p in layer.parameters()) for layer in model]


def measure_layer_costs(
    model: nn.Sequential, example_input: torch.Tensor, repeats: int = 5
) -> list[float]:
    """Median seconds of forward + backward of each layer alone, on ``example_input``'s path.

    Balance this when speed is what limits. The input of each layer is the previous layer's
    output, so shapes (and costs) are the real ones. Times are noisy on a busy machine: give
    ``repeats`` enough to see through it.
    """
    costs: list[float] = []
    x = example_input
    for layer in model:
        times = []
        for _ in range(repeats):
            inp = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            out = layer(inp)
            if out.requires_grad:
                out.backward(torch.ones_like(out))
            times.append(time.perf_counter() - start)
        costs.append(statistics.median(times))
        with torch.no_grad():
            x = layer(x)
    return costs


def split_model(model: nn.Sequential, parts: Sequence[range]) -> list[nn.Sequential]:
    """The stages as ``nn.Sequential``s sharing the model's layers (no copies)."""
    return [nn.Sequential(*(model[i] for i in part)) for part in parts]


def partition_model(
    model: nn.Sequential, num_stages: int, costs: Sequence[float] | None = None
) -> list[nn.Sequential]:
    """Cut ``model`` into ``num_stages`` balanced stages, by ``costs`` or else by parameters."""
    chosen = parameter_costs(model) if costs is None else list(costs)
    if len(chosen) != len(model):
        raise ValueError(f"{len(chosen)} costs for a model of {len(model)} layers: give one each")
    return split_model(model, balanced_partition(chosen, num_stages))
