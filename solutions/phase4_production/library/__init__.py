"""The library way beside this phase's from-scratch pieces: the same small models trained with
PyTorch's own implementation.

* ``sharded_checkpoint``: The library way for sharded state: ``torch.distributed.checkpoint``
  (DCP) with FSDP2.
"""
