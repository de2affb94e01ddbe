"""Benchmarks of this phase's exercises against PyTorch's built-ins: each prints a table of medians
and ratios measured in the same run, and records it with ``--record``.

* ``checkpoint``: How long training is blocked per checkpoint: atomic torch.save, DCP save, DCP
  async_save.
* ``compression``: Benchmark the compression hooks of exercise 4.4: bytes, step time and
  accuracy, against none.
"""
