"""What a pipeline schedule is made of: actions, one rank's list of them, and the size checks.

Given (not an exercise). A schedule (exercise 2.5, ``template_pipeline_schedules.py``) is a pure
function of (p stages, m micro-batches): ``schedule[rank]`` is that rank's ordered list of
:class:`Action`, "forward of micro-batch i through chunk c", "backward of ..." or "weight
gradients of ...". The schedules, the simulator, the executor, the demo, the tests and the
notebook all speak these types, so they are written once, here.

Three kinds of action, named as in Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024):

* **F**, the forward;
* **B**, the backward of the *input*: the gradient the previous stage is waiting for;
* **W**, the backward of the *weights*: the parameters' gradients, which nothing downstream
  waits for, so a schedule may run it later.

A rank's list holds one F and one B per (micro-batch, chunk). A W is optional: when the list
holds a W for the same (micro-batch, chunk), after its B, the B computes the input's gradient
only and the W the weights'; without one, the B computes both (the full backward of GPipe,
1F1B and interleaved 1F1B, whose lists hold no W).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FORWARD: Literal["forward"] = "forward"
BACKWARD: Literal["backward"] = "backward"
WEIGHT: Literal["weight"] = "weight"
ActionKind = Literal["forward", "backward", "weight"]


@dataclass(frozen=True)
class Action:
    """One unit of work on one rank: ``kind`` of ``microbatch`` through local model ``chunk``.

    ``chunk`` is 0 except when a rank holds several model chunks (interleaved, V-shaped
    schedules), where ``pipeline_layout.virtual_stage`` says which stage rank r's chunk c is.
    """

    kind: ActionKind
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        """``F3`` / ``B3`` / ``W3``, or ``F3c1`` for chunk 1: short enough for ASCII timelines."""
        suffix = f"c{self.chunk}" if self.chunk else ""
        return f"{self.kind[0].upper()}{self.microbatch}{suffix}"


Schedule = list[list[Action]]  # schedule[rank] = that rank's actions, in order


def forward(microbatch: int, chunk: int = 0) -> Action:
    """The forward (F) of ``microbatch`` through this rank's ``chunk``."""
    return Action(FORWARD, microbatch, chunk)


def backward(microbatch: int, chunk: int = 0) -> Action:
    """The backward (B) of ``microbatch`` through this rank's ``chunk``: the input's gradient,
    and the weights' too unless a :func:`weight` action of the same pair follows."""
    return Action(BACKWARD, microbatch, chunk)


def weight(microbatch: int, chunk: int = 0) -> Action:
    """The weight-gradient pass (W) of ``microbatch`` through this rank's ``chunk``, after its B."""
    return Action(WEIGHT, microbatch, chunk)


def check_sizes(num_stages: int, num_microbatches: int, num_chunks: int = 1) -> None:
    """Refuse sizes no schedule can run, naming the value and a fix."""
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages}: a pipeline needs at least one stage")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches}: split the batch at least once")
    if num_chunks < 1:
        raise ValueError(f"num_chunks={num_chunks}: every rank holds at least one model chunk")
