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
from solutions.phase2_advanced.activation_checkpointing import checkpoint
from solutions.phase2_advanced.context_parallel import ring_attention
from solutions.phase2_advanced.context_parallel_layout import shard_sequence
from solutions.phase2_advanced.pipeline_executor import PipelineExecutor
from solutions.phase2_advanced.pipeline_schedules import make_schedule, placement_of
from solutions.phase2_advanced.tensor_parallel_layers import ColumnParallelLinear, RowParallelLinear
from solutions.phase3_multi_node.expert_parallel import MoELayer
from solutions.phase3_multi_node.grad_clipping import clip_grad_norm_
from solutions.phase3_multi_node.ring_allreduce import ring_all_reduce
from solutions.phase3_multi_node.tree_allreduce import halving_doubling_all_reduce
from solutions.phase3_multi_node.zero import full_state_dict, zero_wrap
from solutions.phase3_multi_node.zero_fsdp import fsdp_wrap
from solutions.phase4_production.lm_sequence_parallel import (
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
    # Hint 2: Which tensor holds the positions of a whole sequence? Which of your 2.7 functions
    #   gives a rank its chunks of a sequence, and along which dimension would it cut a tensor that
    #   has only one? Which layout, contiguous or zig-zag, did the tokens get?
    # Hint 3: the whole sequence's positions are 0 to seq_len - 1: torch.arange of seq_len (int64,
    #   as rotary embeddings want).
    # Hint 4: the cut is your 2.7 shard_sequence for cp_rank of cp, zig-zag on (the tokens' layout),
    #   along dimension 0, the only one a vector has: rank 0 of cp 2 over 16 tokens gets positions
    #   0-3 and 12-15, in that order.
    # Hint 5: In words: shard_sequence of the arange of seq_len, for cp_rank and cp, zig-zag, along
    #   dimension 0; return it.
    # See guidelines.md#47-the-pieces-meet-a-language-model-on-every-axis
    # >>> solution
    return shard_sequence(torch.arange(seq_len), cp_rank, cp, zigzag=True, dim=0)
    # <<< solution


def count_valid_tokens(targets: torch.Tensor, topology: Topology) -> int:
    """How many targets of the GLOBAL batch count (are not IGNORE_INDEX), from ``targets``,
    this rank's own: its replica's sequences, its cp shard of their positions (the same on every
    tp rank: before any sequence-parallel split). A collective."""
    # TODO 4.7: the global count of valid targets, from every rank's own.
    # Invariant: every rank returns the same number: the valid targets of the whole global batch,
    #   each counted once (tp ranks and pipeline stages hold the same targets as their neighbours in
    #   the group that differs only in dp and cp).
    # Hint 1: which ranks hold OTHER targets than this one? The module docstring's first rule.
    # Hint 2: List the ranks that hold exactly this rank's targets (the other tp ranks? the other
    #   pipeline stages?) and the ranks that hold other samples or other positions of the same
    #   samples. Which named group of the topology is the second list? Summed over a group that is
    #   too large, which targets are counted twice; too small, which are missed? In which dtype does
    #   a count travel exactly?
    # Hint 3: the ranks holding the same targets: the other tp ranks (the targets are taken before
    #   any sequence-parallel split) and the other pipeline stages. A sum over them counts each
    #   target once per copy.
    # Hint 4: the ranks holding other targets: the other replicas (dp) and the other context shards
    #   (cp), together the topology's group named dp_cp. The count travels as int64, which holds any
    #   count exactly.
    # Hint 5: In words: this rank's targets that are not IGNORE_INDEX, counted into an int64 tensor;
    #   one dist.all_reduce of it on topology.group of dp_cp; return it as a Python int.
    # See guidelines.md#47-the-pieces-meet-a-language-model-on-every-axis
    # >>> solution
    count = (targets != IGNORE_INDEX).sum().to(torch.int64)
    dist.all_reduce(count, group=topology.group("dp_cp"))
    return int(count)
    # <<< solution


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
    # Hint 2: What does F.cross_entropy return by default, a mean over which tokens, and what do you
    #   need from it instead so that the global count can divide it? After backward, the
    #   data-parallel reduction AVERAGES the gradients over dp x cp: what becomes of a share that
    #   was right as a term of a sum? Under sequence parallelism the tp ranks hold other tokens too:
    #   are their shares averaged or summed on the way back? And the executor's division by m: does
    #   the runtime already undo it?
    # Hint 3: the sum: F.cross_entropy of the flattened logits and targets, IGNORE_INDEX ignored,
    #   with the reduction "sum" (the default "mean" divides by this rank's own count), divided by
    #   global_valid, the count of the whole batch.
    # Hint 4: the average: the data-parallel reductions divide the summed gradients by the dp x cp
    #   size, so each share is multiplied by that size (topology.size_of with dp_cp) to come out of
    #   the average as a term of the sum.
    # Hint 5: no tp factor: under sequence parallelism the tp ranks' parts are summed on the way
    #   back (the shared weights' gradients over tp, the activations' through the sequence
    #   collectives), never averaged. No m: the runtime multiplies your share by m and the executor
    #   divides it by m.
    # Hint 6: In words: the summed cross-entropy of this rank's valid targets, times the size of dp
    #   x cp, divided by global_valid.
    # See guidelines.md#47-the-pieces-meet-a-language-model-on-every-axis
    # >>> solution
    summed = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return summed * topology.size_of("dp_cp") / global_valid
    # <<< solution


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
    # Hint 2: For one sequence, which ranks hold its other tokens: cp, and under sequence
    #   parallelism tp too? f is a share of the whole sequence's choices: which groups must this
    #   rank's counts visit, and do they carry a gradient? P is a mean over tokens and the loss is
    #   linear in it: does this rank need the others' probabilities, or only its own tokens' part?
    #   Which count of sequences divides at the end, and which factor keeps the mean right after the
    #   gradients are averaged over dp x cp?
    # Hint 3: f: this rank's choices counted per expert for each sequence (a one-hot over the E
    #   experts, summed over its tokens and its k choices: integers, no gradient), all-reduced over
    #   the cp group, and under sequence parallelism over the tp group too; then divided by k times
    #   seq_len.
    # Hint 4: P: the loss is linear in P once f is known, so this rank adds only its own tokens'
    #   part: its probabilities summed over its tokens, divided by seq_len (the whole sequence's
    #   length, not its own t). A whole sequence's P on every rank would count the sequence once per
    #   rank holding tokens of it.
    # Hint 5: the scale: per sequence, E times the sum over the experts of f times that part; summed
    #   over the b sequences, divided by global_sequences, times the dp x cp size, as loss_share,
    #   for the average that follows.
    # Hint 6: In words: counts per sequence and expert, all-reduced over cp (and tp with sequence
    #   parallelism), over k times seq_len; this rank's probabilities summed over its tokens, over
    #   seq_len; per sequence E times the sum over experts of their product; summed, times the dp x
    #   cp size, over global_sequences.
    # See guidelines.md#47-the-pieces-meet-a-language-model-on-every-axis
    # >>> solution
    k = experts.shape[-1]
    counts = F.one_hot(experts, num_experts).sum(dim=(1, 2))  # [b, E], this rank's tokens
    dist.all_reduce(counts, group=topology.cp_group)
    if sequence_parallel:
        dist.all_reduce(counts, group=topology.tp_group)
    fraction = counts.to(probs.dtype) / (seq_len * k)
    my_mean_prob = probs.sum(dim=1) / seq_len  # [b, E]: this rank's part of P
    per_sequence = num_experts * (fraction * my_mean_prob).sum(dim=-1)
    return per_sequence.sum() * topology.size_of("dp_cp") / global_sequences
    # <<< solution


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
    # Hint 2: Take each flag of HeldGradient in turn and ask: which other ranks hold a copy of this
    #   weight, or of this piece of it? Did those copies see other tokens (then the parts must be
    #   added) or the same tokens (then each copy is complete already), and does that change with
    #   sequence parallelism? Each rank's loss share was scaled for an AVERAGE over dp x cp: for a
    #   sum over some group, which count divides it, the size of that group or the number of ranks
    #   whose shares were so scaled? Which gradients has ZeRO averaged already? Which of the sums
    #   are data-parallel (the only ones all_reduce_fn is for)? Last: the two copies of a tied
    #   embedding must end with the same bits; if a copy's value goes through another reduction
    #   after the tie's, can they still differ?
    # Hint 3: the tp sum: with sequence parallelism only, the tp-replicated gradients summed over
    #   the tp group (each tp rank saw 1/tp of the tokens); without it every tp rank computed the
    #   same gradient from the same tokens, complete already. torch's all-reduce: not data-parallel.
    # Hint 4: the dp x cp sum: every gradient that is neither expert nor reduced, summed over the
    #   dp_cp group with all_reduce_fn (the replicas and context shards saw other tokens). A ZeRO
    #   slice (reduced) was averaged in backward and gets nothing more.
    # Hint 5: the experts' sum: every expert gradient summed over the edp group (the ranks holding
    #   the same expert) with all_reduce_fn; the all-to-all's backward already brought the tokens of
    #   the expert's ep group.
    # Hint 6: the divisor: the gradients of both data-parallel sums are divided by the dp x cp size,
    #   the experts' too: every share was scaled for an average over dp x cp, whatever group a sum
    #   ran on. With dp x cp of 4 and experts on ep 2, an expert's edp group has 2 ranks and its
    #   divisor is 4.
    # Hint 7: the order: the tied copies are summed over the embedding group with torch's
    #   all-reduce, last of all. A hand-made all-reduce rounds each element by where it falls in its
    #   buffer, and the two copies fall in different places on their stages: a data-parallel sum
    #   after the tie's would leave them a few bits apart. After the tie's sum nothing touches them,
    #   and both hold one shared result.
    # Hint 8: In words: under sequence parallelism, sum the tp-replicated gradients over tp; sum the
    #   dense ones (not expert, not reduced) over dp_cp and the experts' over edp, both through
    #   all_reduce_flat with all_reduce_fn; divide both lists by the dp x cp size; last, sum the
    #   tied copies over the embedding group with torch's all-reduce.
    # See guidelines.md#47-the-pieces-meet-a-language-model-on-every-axis
    # >>> solution
    if sequence_parallel:
        all_reduce_flat([h.grad for h in held if h.tp_replicated], topology.tp_group)
    dense = [h.grad for h in held if not h.expert and not h.reduced]
    all_reduce_flat(dense, topology.group("dp_cp"), all_reduce_fn=all_reduce_fn)
    experts = [h.grad for h in held if h.expert]
    all_reduce_flat(experts, topology.group("edp"), all_reduce_fn=all_reduce_fn)
    for grad in dense + experts:
        grad.div_(topology.size_of("dp_cp"))
    # last, so both copies end on one shared sum (a hand-made all-reduce rounds by position)
    all_reduce_flat([h.grad for h in held if h.tied], topology.group("embedding"))
    # <<< solution


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
    # Hint 2: After finish_gradients, along which named groups does every rank hold the very same
    #   tensor as this one? For a whole non-expert gradient, which ranks averaged it together? For a
    #   ZeRO slice, do the other dp x cp ranks hold the same slice or another? For an expert, which
    #   ranks hold the same expert? For a tp-replicated weight (with and without sequence
    #   parallelism) and for a tied copy, which further group holds an equal copy?
    # Hint 3: the base: an expert's copies are on edp; a ZeRO slice (reduced) has none over dp x cp,
    #   where every rank holds another slice; every other gradient was averaged over dp x cp and is
    #   equal along dp_cp.
    # Hint 4: the extras: tp for a tp-replicated weight, equal on every tp rank either way (summed
    #   under sequence parallelism, computed from the same tokens without it); embedding for a tied
    #   copy, whose partner on the other stage holds the same sum.
    # Hint 5: In words: one GradShard per held gradient, with its name and its grad, replicated_on a
    #   frozenset of edp for an expert, nothing for a reduced slice, dp_cp for the rest; plus tp
    #   when it is tp-replicated, plus embedding when it is tied.
    # See guidelines.md#47-the-pieces-meet-a-language-model-on-every-axis
    # >>> solution
    shards = []
    for h in held:
        axes = {"edp"} if h.expert else (set() if h.reduced else {"dp_cp"})
        if h.tp_replicated:
            axes.add("tp")
        if h.tied:
            axes.add("embedding")
        shards.append(GradShard(h.name, h.grad, frozenset(axes)))
    return shards
    # <<< solution


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
