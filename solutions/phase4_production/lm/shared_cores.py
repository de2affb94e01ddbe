"""Ranks that share cores: what one rank's step costs them in CPU seconds, in parts, priced from
the layout's description (``lm.layout_work``).

When one machine runs more ranks than it has cores (this course's CPU runs: 4 or 8 ranks on 2
cores), the kernel's scheduler lends each core to whichever rank can run, so a step takes about
every rank's CPU time over the cores, not one rank's critical path slowed by ``ranks / cores``
(which charges a pipeline's bubble and a rank's waits as if no other rank could use the core).
This module prices one rank's CPU from what its description says it does:

* ``compute``: its stages' layers at their tensor-parallel share (``Rates.rank_layer_seconds``,
  the share timed per degree), each backward walked once, or for a zero-bubble stage after the
  first at the measured ratio of its B and W walks to one backward (``Rates.zero_bubble_walks``),
  a recomputed forward under activation checkpointing, the head on the last stage, and the
  optimizer on the elements it owns; all times ``Rates.contention`` (a layer computes slower
  when every rank computes at once);
* ``actions``: the framework's CPU per pipeline action (``Rates.action_cpu``: F and B per
  micro-batch and chunk, and W under a zero-bubble schedule);
* one part per kind of collective (``lm.layout_work.KINDS``): its rounds and bytes at
  ``Rates.comm_cpu`` (an alpha-beta fit of the CPU gloo's threads spend between computations),
  counted call by call as ``lm.traffic`` counts them, and with ``framework`` the tiny model's
  ``call_cpu`` per call and ``round_cpu`` per round.

:func:`kind_amounts` lists what the anchors' calibration (``lm.calibration``) fits each kind's
extra CPU on: calls, ring rounds, bytes sent, ring-attention calls, pipeline steps and actions.
"""

from __future__ import annotations

from solutions.phase4_production.lm.layout_work import LayoutWork
from solutions.phase4_production.lm.rates import Rates


def rank_cpu_parts(
    work: LayoutWork, rates: Rates, pp_rank: int, framework: bool = True
) -> dict[str, float]:
    """CPU seconds one rank of pipeline rank ``pp_rank`` spends in the step ``work`` describes,
    in parts (see the module doc): ``compute``, ``actions``, and one per kind of collective;
    with ``framework`` the tiny model's constants per call and per round are in them (the
    anchors, when measured, stand in for those two)."""
    s, rank = work.settings, work.ranks[pp_rank]
    assert rates.comm_cpu is not None
    m, tokens = s.microbatches, work.micro.tokens
    forward, backward = rates.rank_layer_seconds(tokens, s.tp, s.sequence_parallel)
    compute = 0.0
    for stage in rank.stages:
        # B for the input, then W again for the weights (measured: Rates.zero_bubble_walks)
        walks = rates.zero_bubble_walks if stage.passes == 2 else 1.0
        recompute = forward if s.activation_checkpointing else 0.0
        compute += m * len(stage.layers) * (forward + walks * backward + recompute)
        if stage.index == s.virtual_stages - 1:
            compute += rates.head_per_token * tokens * m
    compute += rates.optimizer_per_element * rank.owned
    parts = {"compute": rates.contention * compute, "actions": rates.action_cpu * rank.actions}
    per_call = rates.call_cpu if framework else 0.0
    per_round = rates.comm_cpu.alpha + (rates.round_cpu if framework else 0.0)
    for kind, (cost, calls) in rank.kinds.items():
        parts[kind] = per_call * calls + cost.time(per_round, rates.comm_cpu.beta)
    return parts


def kind_amounts(work: LayoutWork, pp_rank: int) -> dict[str, float]:
    """For one rank of pipeline rank ``pp_rank``: each kind's calls (``KINDS``), ``tp_round``
    and ``tp_byte``, the ring rounds and bytes sent of its tensor-parallel calls, ``cp_call``,
    its ring-attention calls (each layer's forward and backward: its passes over ``cp - 1``),
    ``cp_byte``, the bytes its passes send (on this rank's ``heads / tp`` heads), ``zero_byte``,
    the bytes its ZeRO calls send, and on a pipelined rank ``pp_step`` (1) and ``pp_action``,
    its F and B actions (each sends a message and waits for one; a zero-bubble W does neither:
    its work is in the compute)."""
    s, rank = work.settings, work.ranks[pp_rank]
    costs = rank.kinds
    amounts = {kind: float(calls) for kind, (_, calls) in costs.items()}
    amounts["cp_call"] = amounts["cp"] / (s.cp - 1) if s.cp > 1 else 0.0
    amounts["cp_byte"] = float(costs["cp"][0].bytes_sent)
    amounts["tp_round"] = float(costs["tp"][0].rounds)
    amounts["tp_byte"] = float(costs["tp"][0].bytes_sent)
    amounts["zero_byte"] = float(costs["zero"][0].bytes_sent)
    pipelined = s.pp > 1
    amounts["pp_step"] = 1.0 if pipelined else 0.0
    amounts["pp_action"] = float(rank.messaging) if pipelined else 0.0
    return amounts
