"""Programs that run this phase's exercises under torchrun (``--impl templates`` runs yours), each
a demo of one exercise.

* ``accumulation``: Demo of exercise 2.1: data-parallel training with gradient accumulation
  under DDP.
* ``checkpointing``: Demo of exercise 2.3: a deep MLP's saved activations with and without
  checkpointing, then DDP.
* ``context_parallel``: Demo of exercise 2.7: ring attention against one process, the work per
  rank, and training.
* ``mixed_precision``: Demo of exercise 2.2: data-parallel training in fp32, bf16 or fp16 with
  the hand-made scaler.
* ``model_parallel``: Demo of exercise 2.4: naive model parallelism trained beside the single-
  device model.
* ``pipeline``: Pipeline-parallel training put together (exercise 2.5's demo), and the library
  way beside it.
* ``support``: What the phase 2 demos share (not an exercise): their settings' bounds, and
  ``--record PATH``.
* ``tensor_parallel``: Demo of exercise 2.6: the parallel MLP, attention and library MLP against
  their dense selves.
"""
