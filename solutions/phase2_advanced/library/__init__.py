"""The library way beside this phase's from-scratch pieces: the same small models trained with
PyTorch's own implementation.

* ``context_parallel``: The library way beside exercise 2.7:
  ``torch.distributed.tensor.experimental.context_parallel``.
* ``tensor_parallel``: The library way beside exercise 2.6: the same MLP parallelized by
  ``torch.distributed.tensor``.
"""
