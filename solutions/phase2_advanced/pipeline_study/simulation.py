"""Run a pipeline schedule on paper: unit costs, real dependencies, per-stage timelines.

``simulate`` plays every rank's action list in order, starting each action as soon as the rank
is free and what it needs is done:

* forward of micro-batch i on virtual stage s needs the forward of i on stage s - 1;
* backward (B) of i on stage s needs the forward of i on s (its stashed activations) and the
  backward of i on stage s + 1 (the gradient of its output), which stage s + 1 sends as soon as
  its B is done, split or not;
* weight gradients (W) of i on stage s need the B of i on s.

Messages are free and each kind of action costs a fixed amount: a forward F, a full backward B
(input and weights), and when a schedule splits it, B - W for the input's part and W for the
weights' (the default W is half of B: F = 1, B = 2 gives F = B = W = 1 for split schedules, the
paper's assumption). So the timelines show what a schedule *can* achieve; the executor's recorded
events show what a machine did. The idle share of each stage's timeline is its bubble.

* GPipe and 1F1B take (m + p - 1)·(F + B) for m·(F + B) of work per stage, a bubble of
  (p - 1)/(m + p - 1) whatever F and B are (Huang et al. 2019; Narayanan et al. 2021).
* Interleaving v chunks per rank cuts the fill and drain to (p - 1)·(F + B)/v, a bubble of
  (p - 1)/(v·m + p - 1): Megatron-LM's (1/v)·(p - 1)/m measured against the ideal time
  m·(F + B) instead of the whole step.
* ZB-H1 (Qi et al. 2024) idles (p - 1)·(F + B_in - W) per stage, with B_in = B - W the input's
  part: a third of 1F1B's (p - 1)·(F + B_in + W) when the three cost the same (m >= p; the
  paper's assumption W <= F and W <= B_in).
* ZB-V, with F = B_in = W per chunk, idles only the fill, (p - 1)·F per rank: stage p - 1 waits
  for the first micro-batch to cross p - 1 chunks, and no schedule can avoid that (m >= 2p).

A schedule that can never finish (an action waits for one that comes later on its own rank, or
for one no rank runs) raises :class:`ScheduleDeadlock` naming where each rank is stuck: it would
hang a real run the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from phase2_advanced.pipeline_layout import LOOP, virtual_stage
from solutions.phase2_advanced.pipeline_schedules import BACKWARD, FORWARD, WEIGHT, Action

_Key = tuple[str, int, int]  # (kind, virtual stage, micro-batch)


class ScheduleDeadlock(ValueError):
    """The schedule cannot finish: every unfinished rank waits for something that never ends."""


@dataclass(frozen=True)
class TimedAction:
    """An action placed on the time axis by :func:`simulate`."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Simulation:
    """Per-rank timelines; ``timelines[rank]`` is in the order the rank ran its actions."""

    timelines: list[list[TimedAction]]

    @property
    def makespan(self) -> float:
        """When the last action of any rank ends (everything starts at 0)."""
        return max((t.end for line in self.timelines for t in line), default=0.0)

    def bubble_fraction(self, rank: int) -> float:
        """Share of the makespan that ``rank`` spends idle."""
        busy = sum(t.end - t.start for t in self.timelines[rank])
        return 1.0 - busy / self.makespan

    def bubble_fractions(self) -> list[float]:
        return [self.bubble_fraction(rank) for rank in range(len(self.timelines))]


def gpipe_bubble(num_stages: int, num_microbatches: int) -> float:
    """(p - 1)/(m + p - 1): the idle share of every stage under GPipe and 1F1B."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def interleaved_bubble(num_stages: int, num_microbatches: int, num_chunks: int) -> float:
    """(p - 1)/(v·m + p - 1): Megatron-LM's (1/v)·(p - 1)/m bubble as a share of the step."""
    return (num_stages - 1) / (num_chunks * num_microbatches + num_stages - 1)


def zero_bubble_h1_bubble(
    num_stages: int,
    num_microbatches: int,
    forward_cost: float = 1.0,
    input_cost: float = 1.0,
    weight_cost: float = 1.0,
) -> float:
    """ZB-H1's idle share of the step, every stage (Qi et al. 2024, m >= p): the bubble
    (p - 1)(F + B - W) over the step m(F + B + W) + (p - 1)(F + B - W), with B the input's part
    of the backward; (p - 1)/(3m + p - 1) when the three cost the same."""
    idle = (num_stages - 1) * (forward_cost + input_cost - weight_cost)
    work = num_microbatches * (forward_cost + input_cost + weight_cost)
    return idle / (work + idle)


def zero_bubble_v_bubble(num_stages: int, num_microbatches: int) -> float:
    """ZB-V's idle share of the step with F = B = W per chunk (m >= 2p): only the fill,
    (p - 1)·F, against 2m chunks' F + B + W of work: (p - 1)/(6m + p - 1)."""
    return (num_stages - 1) / (6 * num_microbatches + num_stages - 1)


def formula_bubble(name: str, num_stages: int, num_microbatches: int, num_chunks: int = 2) -> float:
    """The idle share of the step that schedule ``name``'s formula predicts on every stage:
    GPipe and 1F1B with any F and B, interleaved with ``num_chunks`` = v, ZB-H1 and ZB-V with F,
    B and W of equal cost (the paper's assumption, and the timed stages' of the bench)."""
    p, m = num_stages, num_microbatches
    if name == "interleaved":
        return interleaved_bubble(p, m, num_chunks)
    if name == "zb-h1":
        return zero_bubble_h1_bubble(p, m)
    if name == "zb-v":
        return zero_bubble_v_bubble(p, m)
    if name in ("gpipe", "1f1b"):
        return gpipe_bubble(p, m)
    raise ValueError(f"no bubble formula for schedule {name!r}")


def _needs(action: Action, stage: int, last_stage: int) -> list[_Key]:
    if action.kind == FORWARD:
        return [(FORWARD, stage - 1, action.microbatch)] if stage > 0 else []
    if action.kind == WEIGHT:
        return [(BACKWARD, stage, action.microbatch)]
    needs: list[_Key] = [(FORWARD, stage, action.microbatch)]
    if stage < last_stage:
        needs.append((BACKWARD, stage + 1, action.microbatch))
    return needs


def simulate(
    schedule: Sequence[Sequence[Action]],
    forward_cost: float = 1.0,
    backward_cost: float = 2.0,
    weight_cost: float | None = None,
    *,
    placement: str = LOOP,
) -> Simulation:
    """Place every action of ``schedule`` (``schedule[rank]``) on a time axis; see the module doc.

    ``forward_cost`` and ``backward_cost`` (a full backward) are per action, so per model chunk
    when a rank holds several; a split backward costs ``backward_cost - weight_cost`` for its B
    and ``weight_cost`` (default: half the backward) for its W. ``placement`` is the schedule's
    stage-to-rank rule (``pipeline_layout.py``). Raises :class:`ScheduleDeadlock` if some
    actions can never run.
    """
    p = len(schedule)
    chunks = 1 + max((a.chunk for actions in schedule for a in actions), default=0)
    last_stage = p * chunks - 1
    w_cost = backward_cost / 2 if weight_cost is None else weight_cost
    split = [{(a.microbatch, a.chunk) for a in actions if a.kind == WEIGHT} for actions in schedule]
    finished: dict[_Key, float] = {}
    timelines: list[list[TimedAction]] = [[] for _ in range(p)]
    next_index = [0] * p
    free_at = [0.0] * p
    progress = True
    while progress:
        progress = False
        for rank, actions in enumerate(schedule):
            while next_index[rank] < len(actions):
                action = actions[next_index[rank]]
                stage = virtual_stage(rank, action.chunk, p, placement)
                needs = _needs(action, stage, last_stage)
                if any(key not in finished for key in needs):
                    break
                start = max([free_at[rank], *(finished[key] for key in needs)])
                if action.kind == FORWARD:
                    cost = forward_cost
                elif action.kind == WEIGHT:
                    cost = w_cost
                elif (action.microbatch, action.chunk) in split[rank]:
                    cost = backward_cost - w_cost
                else:
                    cost = backward_cost
                free_at[rank] = start + cost
                finished[(action.kind, stage, action.microbatch)] = free_at[rank]
                timelines[rank].append(TimedAction(action, start, free_at[rank]))
                next_index[rank] += 1
                progress = True
    stuck = [rank for rank in range(p) if next_index[rank] < len(schedule[rank])]
    if stuck:
        waits = "; ".join(f"rank {r} waits at {schedule[r][next_index[r]]}" for r in stuck)
        raise ScheduleDeadlock(f"the schedule cannot finish: {waits}")
    return Simulation(timelines)


def format_timeline(simulation: Simulation, cell: int = 3) -> str:
    """ASCII timeline: one row per rank, ``cell`` characters per unit of time, ``.`` when idle.

    An action is its label followed by ``=`` up to its length: with F=1 and B=2, ``F0 `` is a
    forward of micro-batch 0 and ``B0 ===`` its backward; a split one is ``B0 `` then ``W0 ``.
    Meant for unit-cost simulations.
    """
    width = round(simulation.makespan) * cell
    rows = []
    for rank, line in enumerate(simulation.timelines):
        cells = ["."] * width
        for timed in line:
            first, last = round(timed.start) * cell, round(timed.end) * cell
            label = (str(timed.action) + " ").ljust(last - first, "=")[: last - first]
            cells[first:last] = list(label)
        rows.append(f"rank {rank} |" + "".join(cells) + "|")
    return "\n".join(rows)
