"""ZB-V: the V-shaped zero-bubble schedule, one rank's actions (given, like interleaved 1F1B).

Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024, section 6 of the arXiv version): each
of the p ranks holds two model chunks in a V (the ``"v"`` placement of ``pipeline_layout.py``):
chunk 0 is stage r on the way down, chunk 1 is stage 2p - 1 - r on the way back up, so rank 0
holds the first and the last stage and a micro-batch turns on rank p - 1 without a message.
Every backward is split into B (the input's gradient) and W (the weights'). With a forward, a B
and a W of equal cost, the only idle time left is the fill: stage p - 1 cannot start before the
first micro-batch has crossed p - 1 chunks. It holds about 1F1B's activations (a chunk is half
a stage).

The order is torch's ``ScheduleZBVZeroBubble._calculate_single_rank_operations``
(torch/distributed/pipelining/schedules.py), which the tests compare action by action:

1. warm-up: 2(p - r) - 1 forwards through chunk 0; then r pairs "F chunk 1, F chunk 0"; then
   p - r triples "F, B, W through chunk 1" (the micro-batches that already turned);
2. steady state, while forwards are left: "F chunk 0 (while micro-batches are left), B and W
   chunk 0, F, B and W chunk 1";
3. cool-down: r pairs "B chunk 0, B chunk 1" (W's deferred), then p - r pairs "B chunk 0, the
   oldest W chunk 0", then the W's left, chunk 1's first.

The order is built for max(2p - 1, m) micro-batches and the actions of micro-batches >= m are
dropped, as torch does, so any m runs (the bubble is the formula's from m >= 2p).
"""

from __future__ import annotations

from phase2_advanced.pipeline_actions import Action, backward, check_sizes, forward, weight


def zero_bubble_v_rank_actions(rank: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """Rank ``rank``'s ZB-V actions over its two chunks (``num_stages`` is p, the ranks)."""
    check_sizes(num_stages, num_microbatches, 2)
    p, m = num_stages, num_microbatches
    planned = max(2 * p - 1, m)
    actions: list[Action] = []
    fwd = [0, 0]  # next forward's micro-batch, per chunk
    bwd = [0, 0]  # next backward's micro-batch, per chunk

    def run_forward(chunk: int) -> None:
        actions.append(forward(fwd[chunk], chunk))
        fwd[chunk] += 1

    def run_backward(chunk: int, with_weight: bool) -> None:
        actions.append(backward(bwd[chunk], chunk))
        if with_weight:
            actions.append(weight(bwd[chunk], chunk))
        bwd[chunk] += 1

    for _ in range(2 * (p - rank) - 1):
        run_forward(0)
    for _ in range(rank):
        run_forward(1)
        run_forward(0)
    for _ in range(p - rank):
        run_forward(1)
        run_backward(1, with_weight=True)
    while fwd[1] < fwd[0] or fwd[0] < planned:
        if fwd[0] < planned:
            run_forward(0)
        run_backward(0, with_weight=True)
        run_forward(1)
        run_backward(1, with_weight=True)
    weights = list(bwd)  # next W's micro-batch, per chunk: the cool-down defers some
    for _ in range(rank):
        run_backward(0, with_weight=False)
        run_backward(1, with_weight=False)
    for _ in range(p - rank):
        run_backward(0, with_weight=False)
        actions.append(weight(weights[0], 0))
        weights[0] += 1
    for chunk in (1, 0):
        while weights[chunk] < bwd[chunk]:
            actions.append(weight(weights[chunk], chunk))
            weights[chunk] += 1
    return [action for action in actions if action.microbatch < m]


def zero_bubble_v(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """ZB-V's actions for every rank: ``schedule[rank]``; run them with the ``"v"`` placement."""
    return [zero_bubble_v_rank_actions(r, num_stages, num_microbatches) for r in range(num_stages)]
