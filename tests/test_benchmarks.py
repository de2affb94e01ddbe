"""The benchmark scripts run and compute bandwidths by the nccl-tests definitions."""

from __future__ import annotations

import pytest

from solutions.phase1_data_parallel.benchmarks import all_reduce as bench

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


def test_all_reduce_benchmark_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--worlds", "2", "--max-mib", "0.001", "--strategies", "dist.all_reduce,direct_exchange"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "| 2 | 1 KiB | dist.all_reduce |" in out and "| 2 | 1 KiB | direct_exchange |" in out
    assert bench.main(["--strategies", "ring"]) == 2
    assert "ring" in capsys.readouterr().err
    assert bench.main(["--worlds", "two"]) == 2
    assert "--worlds" in capsys.readouterr().err


# ----------------------------------------------------------------------------- phase 2


def test_memory_benchmark_rows_and_table() -> None:
    import torch

    from solutions.phase2_advanced.benchmarks import memory as memory

    rows = memory.run(depth=4, width=16, batch=8, repeats=1, device=torch.device("cpu"))
    names = [row.name for row in rows]
    assert names == [
        "plain fp32",
        "checkpoint, 2 segments",
        "checkpoint, 4 segments",
        "accumulation, 4 micro-batches",
        "bf16 autocast",
    ]
    plain = rows[0].peak_saved_bytes
    assert plain > 0 and all(row.median_seconds > 0 for row in rows)
    # 2 segments of 4 blocks keep less than plain; 4 segments of one block each keep as much
    assert rows[1].peak_saved_bytes < plain == rows[2].peak_saved_bytes
    assert rows[3].peak_saved_bytes < plain  # one micro-batch alive at a time
    table = memory.format_table(rows)
    assert table.count("\n") == 1 + len(rows) and "| plain fp32 |" in table and "1.00x" in table


def test_memory_benchmark_refuses_every_bad_flag_at_once() -> None:
    from solutions.phase2_advanced.benchmarks import memory as memory

    config = memory.BenchmarkConfig(depth=1, batch=2, device="cpu")
    with pytest.raises(ValueError) as caught:
        memory.validate(config)
    assert "--depth 1 must be >= 2" in str(caught.value)
    assert "--batch 2 must be >= 4" in str(caught.value)
    assert memory.main(["--depth", "1"]) == 2
