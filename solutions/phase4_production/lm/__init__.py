"""The language-model framework of exercise 4.7: one validated YAML config picks every strategy or
the planner does; its checkpoints, planner, rates, memory and traffic models, benchmarks,
library comparison and records.

* ``benchmark``: Benchmark of exercise 4.7: tokens/s, held bytes and each axis's traffic, layout
  by layout.
* ``calibration``: The anchors' calibration of the shared-core model: the model's own steps.
* ``checkpoint``: The language-model framework's checkpoints: saved at one layout, resumed at
  any other, and never resumed from damage.
* ``config``: The language-model framework's configuration: one YAML file that picks every
  strategy.
* ``configs``: The framework's named configs (``lm-*.yaml``) and the default's name.
* ``framework``: The language-model framework: one YAML config picks every strategy, or the
  planner does (its command line, read before torch loads).
* ``framework_run``: The framework's run behind that command line: validate, plan, train.
* ``layout_work``: What every rank holds and does in one step under a layout, described once.
* ``layouts_notebook``: What notebooks/lm_layouts.ipynb draws and says, read from the recorded
  results files.
* ``library``: The library way beside exercise 4.7: the same language model and layout with
  PyTorch's own APIs.
* ``library_cases``: The layouts the library comparison runs, named without importing it.
* ``library_compare``: The library way beside exercise 4.7, compared: PyTorch's composition and
  the course's.
* ``memory``: The bytes one rank holds under a layout of the language model, from the model's
  shapes alone.
* ``metrics``: The language model's record of every step: one JSON line per optimizer step
  (``--metrics``).
* ``planner``: The layout planner: every legal layout of a world, its bytes per rank and its
  step time, predicted from the course's own cost models and this machine's measured rates.
* ``planner_check``: The layout planner checked against reality: predicted and measured, layout
  by layout.
* ``progress``: What the language model's run shows while it runs: the steps on rank 0's stderr.
* ``rates``: The measured rates the layout planner predicts from: compute, activations, links,
  this machine.
* ``record``: Record exercise 4.7's real-text run: one model, one seed, two layouts, the same
  curve.
* ``shard_compute``: The compute one tensor-parallel rank runs for one dense layer, without its
  collectives.
* ``shared_cores``: Ranks that share cores: one rank's step in CPU seconds, in parts.
* ``throughput``: The language model at one rank: tokens/s and model FLOPs utilisation (MFU),
  beside PyTorch.
* ``traffic``: What each axis of exercise 4.7's composition sends in a step: formulas, and
  CommCounter's count.
* ``trainer``: Train the byte-level language model on real text, on every axis at once (exercise
  4.7).
* ``worked_example``: A 70B-class model on 1,024 GPUs, from the formulas alone: computed, not
  measured.
"""
