"""The ring all-reduce studied: what the notebook records of a real ring
(notebooks/ring_allreduce.ipynb), and other rings for the benchmark's ablation.

* ``notebook``: Worker functions of notebooks/ring_allreduce.ipynb: record a real ring's
  messages, measure the busbw curves, fit the model. Functions live here, not in the notebook,
  because the ranks of a world must import them (``mp.spawn``/forkserver cannot run a function
  defined in a notebook).
* ``variants``: Other rings, for the benchmark's ablation: what each technique of the exercise's
  ring buys. Not an exercise; ``benchmarks.collectives --algorithms ring_simple,ring_plain,ring_
  unpipelined,ring_unfused,ring_one_connection,ring,dist.all_reduce`` runs them beside the
  exercise's ring (``ring``).
"""
