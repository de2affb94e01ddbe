"""Exercise 3.5, the library way and the programs (reference, not scored):
``uv run pytest tests/test_phase3.py -m ex3_5``.

``ZeroRedundancyOptimizer`` and FSDP2 ``fully_shard`` on grade_3_5_zero.py's model against one
process's AdamW, the ZeRO demo, and the memory benchmark (its FSDP-style rows included). They
run after grade_3_5_zero.py and grade_3_5_zero_fsdp.py (file order): the demo and the benchmark
run your ZeRO and FSDP-style code, whose mistakes those graders name first.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from grading import exercise, impl
from phase3_helpers import fail, small_world
from torch import nn
from zero_helpers import (
    STEPS,
    TOLERANCE,
    batch,
    max_diff,
    needs_partition,
    reference,
    small_mlp,
)

# ----------------------------------------------------------------------------- the library way


def library_worker(kind: str) -> float:
    import torch.distributed as dist

    from solutions.phase3_multi_node.library import zero as lib

    rank, world = dist.get_rank(), dist.get_world_size()
    kwargs: dict[str, Any] = {"lr": 0.05, "weight_decay": 0.1, "eps": 1e-6}
    model: nn.Module
    optimizer: torch.optim.Optimizer
    if kind == "ZeroRedundancyOptimizer":
        model, optimizer = lib.zero_redundancy_adamw(small_mlp(), **kwargs)
    else:
        model, optimizer = lib.fsdp2_adamw(small_mlp(), **kwargs)
    shard = len(batch(0)[0]) // world
    for step in range(STEPS):
        x, y = batch(step)
        part = slice(rank * shard, (rank + 1) * shard)
        nn.functional.cross_entropy(model(x[part]), y[part]).backward()
        optimizer.step()
        optimizer.zero_grad()
    got = {k.removeprefix("module."): v for k, v in lib.fsdp2_full_state(model).items()}
    return max_diff(got, reference()[-1])[0]


@exercise("3.5")
@pytest.mark.reference
@pytest.mark.parametrize("kind", ["ZeroRedundancyOptimizer", "fully_shard"])
def test_the_library_way_gives_the_same_parameters(kind: str) -> None:
    diffs = small_world(library_worker, 2, kind)
    if max(diffs) > TOLERANCE:
        fail(f"3.5 reference: {kind} ended {max(diffs):.3e} away from one process's AdamW")


def demo_worker(impl_name: str) -> int:
    import importlib

    demo = importlib.import_module("solutions.phase3_multi_node.demos.zero")
    return int(demo.main(["--stage", "3", "--steps", "3", "--impl", impl_name]))


@exercise("3.5")
@pytest.mark.reference
def test_the_demo_runs_on_two_ranks() -> None:
    needs_partition()
    codes = small_world(demo_worker, 2, impl())
    assert codes == [0, 0], f"zero_demo exited with {codes}"


@exercise("3.5")
@pytest.mark.reference
def test_the_benchmark_table_has_every_row_and_zero_rows_equal_their_formula(
    capsys: pytest.CaptureFixture[str],
) -> None:
    needs_partition()
    import importlib

    bench = importlib.import_module("solutions.phase3_multi_node.benchmarks.zero_memory")
    assert bench.main(["--worlds", "2", "--hidden", "8", "--steps", "1", "--impl", impl()]) == 0
    out = capsys.readouterr().out
    memory, _, rest = out.partition("ZeRO with the first Linear frozen")
    for name in bench.ROWS:
        assert f"| 2 | {name} |" in memory, f"no row for {name} in\n{out}"
    assert memory.count("(equal)") == 4, f"every stage 0-3 row should equal its formula:\n{out}"
    frozen, _, fsdp = rest.partition("FSDP-style ZeRO-3 (prefetch 1) beside fully_shard")
    assert frozen.count("| yes |") == 3, f"frozen rows should equal their formula:\n{out}"
    assert fsdp.count("(equal)") == 8, f"FSDP-style bytes per dtype should be the formula's:\n{out}"
    assert bench.main(["--worlds", "two"]) == 2
