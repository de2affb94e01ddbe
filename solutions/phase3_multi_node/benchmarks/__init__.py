"""Benchmarks of this phase's exercises against PyTorch's built-ins: each prints a table of medians
and ratios measured in the same run, and records it with ``--record``.

* ``collectives``: Benchmark the ring, halving-doubling and hierarchical all-reduces beside
  ``dist.all_reduce``.
* ``ddp``: Benchmark DDP from scratch against torch's DistributedDataParallel, in the same run.
* ``fsdp_measure``: Measurements of 3.5's FSDP-style ZeRO-3 and of frozen parameters, for the
  benchmark and ``tests.bench 3.5``: bytes per step per dtype against the formula, gathered
  bytes against the prefetch window, the same training beside ``fully_shard`` (largest
  difference, step time in the same run), and the bytes ZeRO holds for a model with a frozen
  layer.
* ``moe``: Benchmark of exercise 3.8: load balance over a short training run, and all-to-all's
  cost.
* ``parameter_server``: The parameter server measured: consistency models under stragglers, and
  a server under attack.
* ``strategies``: Benchmark the training strategies of the course on one model: throughput and
  memory per rank.
* ``strategies_moe``: The expert-parallel row of ``benchmarks.strategies``: exercise 3.8's
  ``MoELayer`` in a model of the benchmark's size class, its traffic counted against a formula,
  its loss against one process.
* ``zero_memory``: Per-rank memory and communication of ZeRO stages 0-3, measured, beside the
  paper's formulas.
"""
