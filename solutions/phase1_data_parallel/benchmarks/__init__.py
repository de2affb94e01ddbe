"""Benchmarks of this phase's exercises against PyTorch's built-ins: each prints a table of medians
and ratios measured in the same run, and records it with ``--record``.

* ``all_reduce``: Benchmark the hand-made all-reduces beside ``dist.all_reduce``.
"""
