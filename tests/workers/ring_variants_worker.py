"""Rank function of tests/test_phase3_benchmarks.py: the benchmark's ring variants against
``dist.all_reduce`` (module-level, so forked ranks can import it)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from solutions.phase3_multi_node.ring_study.variants import (
    one_connection_ring_all_reduce,
    plain_ring_all_reduce,
    unfused_ring_all_reduce,
)


def variants_equal_all_reduce(sizes: list[int]) -> list[str]:
    """Integer-valued inputs, so every order of additions gives the same bits."""
    rank, problems = dist.get_rank(), []
    for size in sizes:
        g = torch.Generator().manual_seed(100 * rank + size)
        x = torch.randint(-50, 50, (size,), generator=g).to(torch.float64)
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
            want = x.clone()
            dist.all_reduce(want, op=op)
            got_by_name = {
                "plain": plain_ring_all_reduce(x.clone(), op=op),
                "unfused": unfused_ring_all_reduce(x.clone(), op=op, segment_bytes=4096),
                "one-connection": one_connection_ring_all_reduce(
                    x.clone(), op=op, segment_bytes=4096
                ),
            }
            for name, got in got_by_name.items():
                if not torch.equal(got, want):
                    problems.append(f"{name} ring, size {size}, {op}: differs from dist.all_reduce")
    return problems
