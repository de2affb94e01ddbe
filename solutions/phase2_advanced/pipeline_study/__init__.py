"""The pipeline schedules studied: a simulation on paper (unit costs, dependencies), the real
executor measured, and the timelines drawn (notebooks/pipeline_bubbles.ipynb).

* ``experiments``: Measure the real pipeline executor and draw what it did
  (notebooks/pipeline_bubbles.ipynb, and the measured section of guidelines.md#25-pipeline-
  parallelism).
* ``simulation``: Run a pipeline schedule on paper: unit costs, real dependencies, per-stage
  timelines.
* ``timeline``: Draw the timeline of your own pipeline run: what each stage did, and its bubble
  by the formula.
"""
