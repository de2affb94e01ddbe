"""The benchmark scripts run and compute bandwidths by the nccl-tests definitions."""

from __future__ import annotations

import pytest

from solutions.phase1_data_parallel import benchmark_all_reduce as bench

pytestmark = pytest.mark.harness


def test_bus_bandwidth_follows_nccl_tests() -> None:
    assert bench.bus_bandwidth(1.0, 2) == 1.0
    assert bench.bus_bandwidth(1.0, 4) == 1.5
    assert bench.default_sizes(64 * 2**20)[0] == 1024
    assert bench.default_sizes(64 * 2**20)[-1] == 64 * 2**20


def test_all_reduce_benchmark_prints_a_row_per_world_size_and_strategy() -> None:
    measurements = bench.run_benchmark([2], [1024, 4096], list(bench.STRATEGIES))
    assert [(m.world_size, m.nbytes, m.strategy) for m in measurements] == [
        (2, size, name) for size in (1024, 4096) for name in bench.STRATEGIES
    ]
    assert all(m.median_seconds > 0 for m in measurements)
    table = bench.format_table(measurements)
    assert table.count("\n") == 1 + len(measurements)
    assert "| 2 | 1 KiB | dist.all_reduce |" in table and "1.00x" in table
    with pytest.raises(ValueError, match="ring"):
        bench.run_benchmark([2], [1024], ["ring"])
