# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase4.py
"""Exercise 4.7: the thinking of a language model trained on every axis at once.

The pieces are yours already: 2.5's executor, 2.6's layers, 2.7's ring attention, 3.5's ZeRO,
3.6's clipping, 3.8's experts (``lm_blocks.py`` cuts the model with them, ``lm_runtime.py`` runs
the step; sequence parallelism's regions are in ``lm_sequence_parallel.py``). What none of
them decides is how they meet. Every rank holds some *weights* (its tp shard, its pipeline
stage, its experts) and some *tokens* (its dp replica's samples, its cp shard of their
positions, with sequence parallelism its tp share of those), and two rules decide every
reduction of the step:

* **a sum over tokens runs over the ranks that hold other tokens of the same weights**;
* **a gradient is complete once every rank whose tokens used that weight has added its part**:
  the copies of a weight that saw different tokens must be combined, and copies that saw the
  same tokens must not be.

Which ranks those are, for each sum and each kind of weight, is what you decide here
(guidelines.md asks it function by function).

Get a group wrong and nothing crashes: the loss still falls, a little off. torchtitan (a loss
reduced on the wrong mesh with tp and cp: shown 2x off) and Megatron-LM (cp = 2 halving the
gradient under uneven valid-token counts; MoE counts under cp) fixed exactly these in 2026. The
grader compares every loss and parameter with one process, in float64, so nothing slips by.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course.language_model import IGNORE_INDEX
from course.topology import Topology
from phase3_multi_node.clip_placement import GradShard
from phase4_production.lm_functions import CompositionFunctions
from phase4_production.lm_runtime import LanguageModelRuntime
from phase4_production.lm_support import AllReduceFn, HeldGradient, all_reduce_flat
from phase2_advanced.template_activation_checkpointing import checkpoint
from phase2_advanced.template_context_parallel import ring_attention
from phase2_advanced.template_context_parallel_layout import shard_sequence
from phase2_advanced.template_pipeline_executor import PipelineExecutor
from phase2_advanced.template_pipeline_schedules import make_schedule, placement_of
from phase2_advanced.template_tensor_parallel_layers import ColumnParallelLinear, RowParallelLinear
from phase3_multi_node.template_expert_parallel import MoELayer
from phase3_multi_node.template_grad_clipping import clip_grad_norm_
from phase3_multi_node.template_ring_allreduce import ring_all_reduce
from phase3_multi_node.template_tree_allreduce import halving_doubling_all_reduce
from phase3_multi_node.template_zero import full_state_dict, zero_wrap
from phase3_multi_node.template_zero_fsdp import fsdp_wrap
from phase4_production.template_lm_sequence_parallel import (
    enter_tensor_parallel,
    leave_tensor_parallel,
)


def token_positions(seq_len: int, cp_rank: int, cp: int) -> torch.Tensor:
    """The position in the whole sequence of each token this rank holds, in its local order
    (2.7's zig-zag layout over ``cp`` ranks): int64, ``seq_len / cp`` of them."""
    # TODO 4.7: the true positions of this rank's tokens, for the rotary angles.
    # Invariant: result[i] is the place in the whole sequence of the i-th token this rank holds;
    #   over the cp ranks every position 0..seq_len-1 appears once; with cp = 1 it is 0, 1, ...,
    #   seq_len-1. A rotary angle at a local index instead would make q·k depend on distances that
    #   are not the tokens' distances.
    # Hint 1: the positions are data laid out exactly like the tokens they belong to.
    # More hints: uv run python -m tests.hint 4.7
    # See guidelines.md#47-the-pieces-meet-a-language-model-on-every-axis
    raise NotImplementedError(
        "TODO 4.7: the true positions of this rank's tokens, for the rotary angles "
        "(see phase4_production/guidelines.md#47-the-pieces-meet-a-language-model-on-every-axis)"
    )


def count_valid_tokens(targets: torch.Tensor, topology: Topology) -> int:
    """How many targets of the GLOBAL batch count (are not IGNORE_INDEX), from ``targets``,
    this rank's own: its replica's sequences, its cp shard of their positions (the same on every
    tp rank: before any sequence-parallel split). A collective."""
    # TODO 4.7: the global count of valid targets, from every rank's own.
    # Invariant: every rank returns the same number: the valid targets of the whole global batch,
    #   each counted once (tp ranks and pipeline stages hold the same targets as their neighbours in
    #   the group that differs only in dp and cp).
    # Hint 1: which ranks hold OTHER targets than this one? The module docstring's first rule.
    # More hints: uv run python -m tests.hint 4.7
    # See guidelines.md#47-the-pieces-meet-a-language-model-on-every-axis
    raise NotImplementedError(
        "TODO 4.7: the global count of valid targets, from every rank's own "
        "(see phase4_production/guidelines.md#47-the-pieces-meet-a-language-model-on-every-axis)"
    )


def loss_share(
    logits: torch.Tensor, targets: torch.Tensor, global_valid: int, topology: Topology
) -> torch.Tensor:
    """This rank's share of the global batch's mean cross-entropy, for its logits
    [batch, tokens, vocab] and targets [batch, tokens] (IGNORE_INDEX masked): the scalar it
    backpropagates, such that the gradients are one process's once the data-parallel reductions
    after backward have run."""
    # TODO 4.7: the loss this rank backpropagates.
    # Invariant: whatever the number of valid targets on each rank, once every rank's share has been
    #   backpropagated and the data-parallel reductions that follow have run, the gradients are
    #   those of one process's mean cross-entropy over every valid target of the global batch.
    # Hint 1: a mean of per-rank means weighs a rank with few valid targets as much as one with
    #   many; a sum over tokens divided by the global count does not.
    # More hints: uv run python -m tests.hint 4.7
    # See guidelines.md#47-the-pieces-meet-a-language-model-on-every-axis
    raise NotImplementedError(
        "TODO 4.7: the loss this rank backpropagates "
        "(see phase4_production/guidelines.md#47-the-pieces-meet-a-language-model-on-every-axis)"
    )


def balance_loss_share(
    probs: torch.Tensor,
    experts: torch.Tensor,
    num_experts: int,
    seq_len: int,
    global_sequences: int,
    topology: Topology,
    sequence_parallel: bool,
) -> torch.Tensor:
    """This rank's share of one MoE layer's balance loss (``sequence_balance_loss`` of the whole
    global batch), in the scale of :func:`loss_share`. ``probs`` [b, t, E] and ``experts``
    [b, t, k]: the router's probabilities and choices for this rank's t tokens of each of its b
    sequences (its cp shard; under sequence parallelism its tp share of that)."""
    # TODO 4.7: the balance loss of sequences whose tokens are spread over several ranks.
    # Invariant: for each sequence, the shares of the ranks holding its tokens add up to E · sum_e
    #   f[e] · P[e] of the whole sequence (f: the share of its k·seq_len choices that named e; P:
    #   e's probability averaged over its seq_len tokens); over the global batch, in loss_share's
    #   scale, the mean over its sequences once the data-parallel reductions have run. A rank never
    #   holds, nor adds, a whole sequence's loss that other ranks add too.
    # Hint 1: f is a share of the whole sequence's choices, P a mean over its tokens: ask of each
    #   what it needs from the other ranks holding tokens of the sequence.
    # More hints: uv run python -m tests.hint 4.7
    # See guidelines.md#47-the-pieces-meet-a-language-model-on-every-axis
    raise NotImplementedError(
        "TODO 4.7: the balance loss of sequences whose tokens are spread over several ranks "
        "(see phase4_production/guidelines.md#47-the-pieces-meet-a-language-model-on-every-axis)"
    )


def finish_gradients(
    held: list[HeldGradient],
    topology: Topology,
    sequence_parallel: bool,
    all_reduce_fn: AllReduceFn | None = None,
) -> None:
    """After the pipeline's step, make every gradient this rank holds complete, in place:
    the gradient of the global loss (for its piece of the weight), the same on every rank that
    holds a copy of that piece. ``all_reduce_fn`` (None: torch's) is the all-reduce of the
    data-parallel reductions, the config's ``communication`` (3.1's ring, 3.2's halving-doubling),
    as a DDP communication hook would be (3.4): the other reductions keep torch's."""
    # TODO 4.7: the reductions after backward, each on its own group.
    # Invariant: afterwards every gradient equals, for this rank's piece of its weight, the gradient
    #   of the global loss of one process (every token that used the weight counted once, none
    #   twice), and every rank holding a copy of that piece holds the same bits. The data-parallel
    #   sums go through all_reduce_fn, and no other reduction does.
    # Hint 1: the HeldGradient flags say what each tensor is; for each kind, the guide's two rules
    #   ask which ranks hold its other copies and whether those saw other tokens. all_reduce_flat
    #   reduces a list in one collective per dtype, with the all-reduce you hand it.
    # More hints: uv run python -m tests.hint 4.7
    # See guidelines.md#47-the-pieces-meet-a-language-model-on-every-axis
    raise NotImplementedError(
        "TODO 4.7: the reductions after backward, each on its own group "
        "(see phase4_production/guidelines.md#47-the-pieces-meet-a-language-model-on-every-axis)"
    )


def gradient_placements(held: list[HeldGradient], topology: Topology) -> list[GradShard]:
    """3.6's ``GradShard`` for every gradient this rank holds (after :func:`finish_gradients`):
    which groups of the topology hold identical copies of it, so that the global norm counts
    every distinct gradient once."""
    # TODO 4.7: where the copies of each complete gradient live.
    # Invariant: for every gradient, replicated_on names exactly the groups of the topology along
    #   which every rank holds the same tensor as this one once finish_gradients is done; the global
    #   norm then counts every distinct piece once.
    # Hint 1: 3.6's counted_here keeps one rank of every set of copies; groups missing here count a
    #   copy several times, groups too many drop pieces that are not copies.
    # More hints: uv run python -m tests.hint 4.7
    # See guidelines.md#47-the-pieces-meet-a-language-model-on-every-axis
    raise NotImplementedError(
        "TODO 4.7: where the copies of each complete gradient live "
        "(see phase4_production/guidelines.md#47-the-pieces-meet-a-language-model-on-every-axis)"
    )


class ParallelLanguageModel(LanguageModelRuntime):
    """The language model on every axis, with your functions (``lm_runtime.py`` has the rest):
    ``ParallelLanguageModel(build_language_model(config, seed), topology, settings)``, then
    ``train_step(tokens, targets)`` on the global batch."""

    functions = CompositionFunctions(
        enter_tensor_parallel=enter_tensor_parallel,
        leave_tensor_parallel=leave_tensor_parallel,
        token_positions=token_positions,
        count_valid_tokens=count_valid_tokens,
        loss_share=loss_share,
        balance_loss_share=balance_loss_share,
        finish_gradients=finish_gradients,
        gradient_placements=gradient_placements,
        column_parallel=ColumnParallelLinear,
        row_parallel=RowParallelLinear,
        ring_attention=ring_attention,
        shard_sequence=shard_sequence,
        executor=PipelineExecutor,
        make_schedule=make_schedule,
        placement_of=placement_of,
        zero_wrap=zero_wrap,
        full_state_dict=full_state_dict,
        fsdp_wrap=fsdp_wrap,
        clip_grad_norm=clip_grad_norm_,
        moe_layer=MoELayer,
        checkpoint=checkpoint,
        ring_all_reduce=ring_all_reduce,
        halving_doubling_all_reduce=halving_doubling_all_reduce,
    )
