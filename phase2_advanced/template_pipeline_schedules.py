# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase2.py
"""Exercise 2.5 (schedules): which forward and backward each pipeline stage runs, in what order.

A pipeline cuts a model into p stages, one per rank, and the batch into m micro-batches. A
schedule is a pure function of (p, m): for each rank, the ordered list of actions "forward of
micro-batch i" (F), "backward of micro-batch i" (B) and, in zero-bubble schedules, "weight
gradients of micro-batch i" (W). Nothing here touches a process group, so schedules can be
tested, simulated (``pipeline_study/simulation.py``) and drawn without processes;
``pipeline_executor.py`` runs any of them over point-to-point messages.

* **GPipe** (Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline
  Parallelism", NeurIPS 2019), also called all-forward-all-backward: every stage runs the m
  forwards, then the m backwards. A stage holds the activations of all m micro-batches at once.
* **1F1B** (PipeDream-Flush: Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN
  Training", ICML 2021): each rank runs a few warm-up forwards (the first rank the most, the
  last rank none), then alternates one forward and one backward, then drains the remaining
  backwards. Same bubble as GPipe, but far fewer micro-batches in flight than m.
* **Interleaved 1F1B** (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", SC 2021): the model is cut into p·v stages and rank r holds the v
  chunks at virtual stages r, r + p, r + 2p, ...; the bubble shrinks about v times for v times
  more messages. Micro-batches go through the chunks in groups of p, so m must be a multiple of p.
* **ZB-H1** (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): 1F1B with each backward
  split into B, the input's gradient that the stage before waits for, and W, the weights'
  gradient that nobody waits for. B keeps 1F1B's place; the W's are deferred to where 1F1B
  idles, so the bubble shrinks from (p-1)(F+B+W) to (p-1)(F+B-W) per stage, with the same
  activations held at the peak (p micro-batches).
* **ZB-V** (same paper, section 6; given, ``pipeline_v_schedule.py``): two chunks per rank in a
  V (rank r holds stages r and 2p-1-r: the ``"v"`` placement), every backward split; with F, B
  and W of equal cost only the fill is left idle.

The bubble formulas assume fixed costs per action and free messages: GPipe and 1F1B idle
(p-1)/(m+p-1) of the step on every stage, interleaved (p-1)/(v·m+p-1), ZB-H1
(p-1)(F+B-W)/(m(F+B+W) + (p-1)(F+B-W)) (m >= p), ZB-V (p-1)F/(2m(F+B+W) + (p-1)F) with the
costs of one chunk, all equal (m >= 2p); ``pipeline_study/simulation.py`` computes each.
"""

from __future__ import annotations

from collections.abc import Callable

from phase2_advanced.pipeline_actions import (
    BACKWARD,
    FORWARD,
    WEIGHT,
    Action,
    ActionKind,
    Schedule,
    backward,
    check_sizes,
    forward,
    weight,
)
from phase2_advanced.pipeline_layout import LOOP, VEE
from phase2_advanced.pipeline_v_schedule import zero_bubble_v

__all__ = [  # given, used by callers
    "BACKWARD",
    "FORWARD",
    "WEIGHT",
    "Action",
    "ActionKind",
    "Schedule",
    "zero_bubble_v",
]


# ----------------------------------------------------------------------------- exercise 2.5


def gpipe_rank_actions(rank: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """Rank ``rank``'s GPipe actions: every forward, then every backward, micro-batch 0 first."""
    check_sizes(num_stages, num_microbatches)
    # TODO 2.5: list the GPipe (all-forward-all-backward) actions of one rank.
    # Invariant: each micro-batch's forward comes before its backward; this rank holds all m
    #   micro-batches' activations at the turn from forwards to backwards; forwards and
    #   backwards each go through the micro-batches in order 0, 1, ..., m-1.
    # Hint 1: the executor and the simulator make every action wait for the messages it needs: a
    #   rank's list only says in which order that rank runs its own actions.
    # More hints: uv run python -m tests.hint 2.5
    # See guidelines.md#25-pipeline-parallelism
    raise NotImplementedError(
        "TODO 2.5: list the GPipe (all-forward-all-backward) actions of one rank "
        "(see phase2_advanced/guidelines.md#25-pipeline-parallelism)"
    )


def one_f_one_b_order(num_warmup: int, num_forwards: int) -> list[tuple[ActionKind, int]]:
    """The 1F1B order of a rank's k-th forwards and k-th backwards, as (kind, k) pairs.

    ``num_forwards`` forwards and as many backwards, indexed k = 0, 1, ... in the order each kind
    runs; ``num_warmup`` (at most ``num_forwards``) forwards run before the first backward. The
    plain schedule maps k to micro-batch k; the interleaved one maps it to a (micro-batch, chunk).
    """
    if not 0 <= num_warmup <= num_forwards:
        raise ValueError(f"num_warmup={num_warmup} must be in [0, num_forwards={num_forwards}]")
    # TODO 2.5: order the k-th forwards and backwards of one rank: warm-up, steady 1F1B, drain.
    # Invariant: the forwards appear as k = 0, 1, ..., and so do the backwards; exactly
    #   num_warmup forwards come before the first backward; from then on the number of
    #   forwards without their backward (the stash) never grows: one in, one out.
    # Hint 1: once the warm-up is over, every forward that enters the stash is matched by a
    #   backward that leaves it, until the forwards run out.
    # More hints: uv run python -m tests.hint 2.5
    # See guidelines.md#25-pipeline-parallelism
    raise NotImplementedError(
        "TODO 2.5: order the k-th forwards and backwards of one rank: warm-up, steady 1F1B, drain "
        "(see phase2_advanced/guidelines.md#25-pipeline-parallelism)"
    )


def one_f_one_b_rank_actions(rank: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """Rank ``rank``'s 1F1B (PipeDream-Flush) actions: warm-up, steady 1F1B, cool-down."""
    check_sizes(num_stages, num_microbatches)
    # TODO 2.5: the 1F1B actions of one rank: its warm-up count, then one_f_one_b_order.
    # Invariant: no rank ever holds more than p micro-batches' activations, however large m
    #   is (the first rank holds the most); the k-th forward and the k-th backward are those
    #   of micro-batch k.
    # Hint 1: the warm-up count is all this function decides; one_f_one_b_order does the rest.
    # More hints: uv run python -m tests.hint 2.5
    # See guidelines.md#25-pipeline-parallelism
    raise NotImplementedError(
        "TODO 2.5: the 1F1B actions of one rank: its warm-up count, then one_f_one_b_order "
        "(see phase2_advanced/guidelines.md#25-pipeline-parallelism)"
    )


def zero_bubble_h1_rank_actions(rank: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """Rank ``rank``'s ZB-H1 actions: 1F1B's forwards and backwards (B, the input's gradient),
    each micro-batch's W (the weights' gradient) after its B, placed where 1F1B would idle."""
    check_sizes(num_stages, num_microbatches)
    # TODO 2.5: the ZB-H1 actions of one rank: 1F1B with each backward split into B and W.
    # Invariant: the F's and B's are exactly this rank's 1F1B order; every micro-batch has one
    #   W, after its B, and the W's run in micro-batch order; a rank never holds more
    #   micro-batches (forwarded, W not yet run) than rank 0 holds under 1F1B, p; the
    #   simulated bubble is the paper's (p-1)(F+B-W) per stage, a third of 1F1B's when F, B
    #   and W cost the same.
    # Hint 1: under 1F1B the first rank is busy from the start but holds the most activations;
    #   a later rank starts late, holds fewer, and idles at the end of the step. A W that
    #   waits keeps its micro-batch's activations alive, so memory (the invariant) bounds how
    #   many W's a rank may keep waiting. The guide's p = 4 picture shows the counts.
    # More hints: uv run python -m tests.hint 2.5
    # See guidelines.md#zero-bubble-split-the-backward-in-two
    raise NotImplementedError(
        "TODO 2.5: the ZB-H1 actions of one rank: 1F1B with each backward split into B and W "
        "(see phase2_advanced/guidelines.md#zero-bubble-split-the-backward-in-two)"
    )


# ----------------------------------------------------------------------------- interleaved


def check_interleaved_sizes(num_stages: int, num_microbatches: int, num_chunks: int) -> None:
    """Interleaving moves micro-batches through each chunk in groups of p: m must divide by p."""
    check_sizes(num_stages, num_microbatches, num_chunks)
    if num_microbatches % num_stages:
        multiple = num_stages * max(1, round(num_microbatches / num_stages))
        raise ValueError(
            f"interleaved 1F1B needs the number of micro-batches to be a multiple of the number "
            f"of stages, got m={num_microbatches} for p={num_stages}: use m={multiple}, or the "
            "gpipe or 1f1b schedule"
        )


def interleaved_rank_actions(
    rank: int, num_stages: int, num_microbatches: int, num_chunks: int
) -> list[Action]:
    """Rank ``rank``'s interleaved 1F1B actions over its ``num_chunks`` model chunks.

    Megatron-LM's ``forward_backward_pipelining_with_interleaving``: the k-th forward of a rank
    (k = 0 .. m·v - 1) runs chunk (k mod p·v) // p on micro-batch (k // p·v)·p + k mod p,
    that is p micro-batches through chunk 0, the same p through chunk 1, ..., then the next p.
    The k-th backward does the same with the chunks in reverse order. Rank r warms up with
    2(p - r - 1) + (v - 1)·p forwards (capped at m·v); the rest is :func:`one_f_one_b_order`,
    the same warm-up, steady state and drain as plain 1F1B over (micro-batch, chunk) pairs.
    """
    check_interleaved_sizes(num_stages, num_microbatches, num_chunks)
    p, v = num_stages, num_chunks
    total = num_microbatches * v

    def nth(k: int, kind: ActionKind) -> Action:
        position = k % (p * v)
        chunk = position // p if kind == FORWARD else v - 1 - position // p
        return Action(kind, (k // (p * v)) * p + position % p, chunk)

    warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
    return [nth(k, kind) for kind, k in one_f_one_b_order(warmup, total)]


# ----------------------------------------------------------------------------- whole schedules


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe's actions for every rank: ``schedule[rank]``."""
    return [gpipe_rank_actions(r, num_stages, num_microbatches) for r in range(num_stages)]


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B's actions for every rank: ``schedule[rank]``."""
    return [one_f_one_b_rank_actions(r, num_stages, num_microbatches) for r in range(num_stages)]


def zero_bubble_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1's actions for every rank: ``schedule[rank]``."""
    return [zero_bubble_h1_rank_actions(r, num_stages, num_microbatches) for r in range(num_stages)]


def interleaved_one_f_one_b(num_stages: int, num_microbatches: int, num_chunks: int) -> Schedule:
    """Interleaved 1F1B's actions for every rank; ValueError unless m is a multiple of p."""
    check_interleaved_sizes(num_stages, num_microbatches, num_chunks)
    return [
        interleaved_rank_actions(r, num_stages, num_microbatches, num_chunks)
        for r in range(num_stages)
    ]


SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
ZERO_BUBBLE_NAMES = ("zb-h1", "zb-v")  # the schedules whose backwards are split into B and W
_BUILDERS: dict[str, Callable[[int, int, int], Schedule]] = {
    "gpipe": lambda p, m, v: gpipe(p, m),
    "1f1b": lambda p, m, v: one_f_one_b(p, m),
    "interleaved": interleaved_one_f_one_b,
    "zb-h1": lambda p, m, v: zero_bubble_h1(p, m),
    "zb-v": lambda p, m, v: zero_bubble_v(p, m),
}


def chunks_per_rank(name: str, num_chunks: int = 2) -> int:
    """How many model chunks each rank holds under schedule ``name``: v for interleaved, 2 for
    the V of zb-v, 1 otherwise."""
    if name == "interleaved":
        return num_chunks
    return 2 if name == "zb-v" else 1


def placement_of(name: str) -> str:
    """The stage-to-rank rule schedule ``name`` is written for (``pipeline_layout.py``): the V
    for zb-v (rank r holds stages r and 2p-1-r), the loop for the others."""
    return VEE if name == "zb-v" else LOOP


def make_schedule(
    name: str, num_stages: int, num_microbatches: int, num_chunks: int = 2
) -> Schedule:
    """The schedule called ``name`` (gpipe, 1f1b, interleaved, zb-h1 or zb-v); ``num_chunks`` is
    v and only matters for interleaved. Raises ValueError for an unknown name or sizes it
    cannot run. Run it with ``placement_of(name)``."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown schedule {name!r}: choose one of {', '.join(SCHEDULE_NAMES)}")
    return _BUILDERS[name](num_stages, num_microbatches, chunks_per_rank(name, num_chunks))


def peak_in_flight(actions: list[Action]) -> int:
    """The most (micro-batch, chunk) activations one rank holds at once: forwarded, and not yet
    through their last backward action (the W when the list has one, else the B)."""
    split = {(a.microbatch, a.chunk) for a in actions if a.kind == WEIGHT}
    held = peak = 0
    for action in actions:
        if action.kind == FORWARD:
            held += 1
        elif action.kind == WEIGHT or (action.microbatch, action.chunk) not in split:
            held -= 1
        peak = max(peak, held)
    return peak


def format_schedule(schedule: Schedule) -> str:
    """One line per rank, actions in order: ``rank 0: F0 F1 B0 F2 B1 ...``."""
    return "\n".join(
        f"rank {rank}: " + " ".join(str(a) for a in actions)
        for rank, actions in enumerate(schedule)
    )
