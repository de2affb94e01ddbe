"""The library way beside this phase's from-scratch pieces: the same small models trained with
PyTorch's own implementation.

* ``zero``: The library way to do what exercise 3.5 builds: ``ZeroRedundancyOptimizer`` and
  FSDP2.
"""
