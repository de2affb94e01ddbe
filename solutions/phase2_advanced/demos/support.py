"""What the phase 2 demos share (not an exercise): their settings' bounds, and ``--record PATH``.

* :func:`bound_problems`: every number of a demo's config outside the bounds its field declares
  (``metadata={"bounds": {"ge": 1, "fix": "..."}}``, read as ``course.cli.setting_problem``
  reads ``ge``/``gt``/``le``/``lt``). A demo's validate function adds them to its other problems,
  so every bad flag is named at once, before any process group exists (``parse_config`` itself
  stops at the first bounded flag, which is why the demos keep the bounds under their own key).
* :func:`batch_problems`: the data-parallel demos' global batch against the world and the
  training set, each problem naming its flag.
* :func:`record_demo`: rank 0 writes what the demo printed to a results file
  (``course/results.py``), which a guide quotes, so the page shows what a recorded run printed,
  with the command that printed it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist

from course.cli import setting_problem
from course.results import Table, command_line, write_results
from course.training import EpochSummary, check_global_batch


def bound_problems(config: Any) -> list[str]:
    """One line per field of the dataclass ``config`` outside its ``metadata["bounds"]``, each
    naming the flag, the value and the fix."""
    problems = []
    for field in dataclasses.fields(config):
        bounds = field.metadata.get("bounds")
        if bounds:
            flag = "--" + field.name.replace("_", "-")
            problem = setting_problem(flag, getattr(config, field.name), bounds)
            if problem:
                problems.append(problem)
    return problems



def batch_problems(global_batch_size: int, train_samples: int, world_size: int) -> list[str]:
    """A global batch that does not split evenly over the ranks, or a training set smaller than
    one global batch, each naming its flag and the fix."""
    problems = []
    try:
        check_global_batch(global_batch_size, world_size)
    except ValueError as err:
        problems.append(f"--global-batch-size: {err}")
    if train_samples < global_batch_size:
        problems.append(
            f"--train-samples {train_samples} is smaller than one global batch "
            f"({global_batch_size}): use more samples or a smaller batch"
        )
    return problems


def epochs_table(summaries: Sequence[EpochSummary]) -> Table:
    """One row per epoch: loss, test accuracy and samples per second, as the demo prints them."""
    table = Table(["epoch", "loss", "test acc", "samples/s"])
    for summary in summaries:
        table.add(
            f"{summary.epoch + 1}/{len(summaries)}",
            f"{summary.loss:.4f}",
            f"{100 * summary.test_accuracy:.1f}%",
            f"{summary.samples_per_second:.0f}",
        )
    return table


def record_demo(
    path: str, summaries: Sequence[EpochSummary], values: Mapping[str, str] | None = None
) -> None:
    """On rank 0 (or without a process group), write the epochs and ``values`` to ``path``."""
    if not path or (dist.is_initialized() and dist.get_rank() != 0):
        return
    world = dist.get_world_size() if dist.is_initialized() else 1
    last = summaries[-1]
    every = {
        "world": str(world),
        "final_loss": f"{last.loss:.4f}",
        "final_accuracy": f"{100 * last.test_accuracy:.1f}%",
        "samples_per_second": f"{last.samples_per_second:.0f}",
        **(values or {}),
    }
    written = write_results(
        path,
        tables={"epochs": epochs_table(summaries)},
        values=every,
        command=command_line(),
    )
    print(f"recorded {written}", flush=True)
