"""Programs that run this phase's exercises under torchrun (``--impl templates`` runs yours), each
a demo of one exercise.

* ``monitoring``: Demo of exercise 4.5: train with one rank slowed on purpose, and find it.
* ``plot_metrics``: Plot the per-rank step breakdown from the monitor's JSONL file (exercise
  4.5) to a PNG.
"""
