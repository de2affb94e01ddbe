"""Benchmarks of this phase's exercises against PyTorch's built-ins: each prints a table of medians
and ratios measured in the same run, and records it with ``--record``.

* ``context_parallel``: Benchmark of exercise 2.7: the work per rank with and without zig-zag,
  and when a pass hides.
* ``memory``: Benchmark the memory/compute trade of phase 2, part 1: checkpointing,
  accumulation, bf16.
"""
