"""Programs that run this phase's exercises under torchrun (``--impl templates`` runs yours), each
a demo of one exercise.

* ``ddp``: Demo of exercise 3.4: train with DDP from scratch, then with torch's DDP, and
  compare.
* ``hierarchical``: Run the hierarchical all-reduce on real nodes (or torchrun agents standing
  in for them) and count the bytes that cross nodes, beside a flat ring's.
* ``moe``: Demo of exercise 3.8: train one mixture-of-experts layer with expert x data
  parallelism.
* ``parallel_3d``: Demo of exercise 3.6: train a stack of MLP blocks with data x tensor x
  pipeline parallelism.
* ``zero``: Demo of exercise 3.5: train an MLP under ZeRO stage 1, 2 or 3 and compare bytes with
  the paper.
"""
