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

The data-parallel reductions of the course *average* (phase 1's average_gradients, 3.5's ZeRO
reduce-scatter): keep it in mind for every share you return.
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
    #   over the cp ranks every position 0..seq_len-1 appears once; with cp = 1 it is
    #   0, 1, ..., seq_len-1. A rotary angle at a local index instead would make q·k depend on
    #   distances that are not the tokens' distances.
    # Hint 1: the positions are data laid out exactly like the tokens they belong to.
    # Hint 2: Which tensor holds the positions of a whole sequence? Which of your 2.7 functions
    #   gives a rank its chunks of a sequence, and along which dimension would it cut a tensor that
    #   has only one? Which layout, contiguous or zig-zag, did the tokens get?
    # Hint 3: The whole sequence's positions 0 to seq_len − 1 (an arange), cut by your 2.7
    #   shard_sequence for cp_rank of cp, zig-zag on, along dimension 0: the chunks the tokens got,
    #   in the same order.
    # See guidelines.md#47-the-pieces-meet-a-language-model-on-every-axis
    # >>> solution
    return shard_sequence(torch.arange(seq_len), cp_rank, cp, zigzag=True, dim=0)
    # <<< solution


def count_valid_tokens(targets: torch.Tensor, topology: Topology) -> int:
    """How many targets of the GLOBAL batch count (are not IGNORE_INDEX), from ``targets``,
    this rank's own: its replica's sequences, its cp shard of their positions (the same on every
    tp rank: before any sequence-parallel split). A collective."""
    # TODO 4.7: the global count of valid targets, from every rank's own.
    # Invariant: every rank returns the same number: the valid targets of the whole global
    #   batch, each counted once (tp ranks and pipeline stages hold the same targets as their
    #   neighbours in the group that differs only in dp and cp).
    # Hint 1: which ranks hold OTHER targets than this one? The module docstring's first rule.
    # Hint 2: List the ranks that hold exactly this rank's targets (the other tp ranks? the other
    #   pipeline stages?) and the ranks that hold other samples or other positions of the same
    #   samples. Which named group of the topology is the second list? Summed over a group that is
    #   too large, which targets are counted twice; too small, which are missed? In which dtype does
    #   a count travel exactly?
    # Hint 3: This rank's targets that are not IGNORE_INDEX, counted into one int64 tensor, summed
    #   by one all-reduce on the dp x cp group (topology.group with "dp_cp"), returned as a Python
    #   int. Not over tp, not over pp: those ranks hold the same targets.
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
    [batch, tokens, vocab] and targets [batch, tokens] (IGNORE_INDEX masked), scaled for the
    AVERAGE over dp x cp that its gradients go through afterwards."""
    # TODO 4.7: the loss this rank backpropagates.
    # Invariant: summed over the ranks that hold other tokens (dp x cp, and tp under sequence
    #   parallelism), the shares divided by the dp x cp size give the mean cross-entropy over
    #   every valid target of the global batch, whatever the number of valid targets on each
    #   rank; averaging the shares' gradients over dp x cp then gives that mean's gradient.
    # Hint 1: a mean of per-rank means weighs a rank with few valid targets as much as one with
    #   many; a sum over tokens divided by the global count does not.
    # Hint 2: What does F.cross_entropy return by default, a mean over which tokens, and what do you
    #   need from it instead so that the global count can divide it? After backward, the
    #   data-parallel reduction AVERAGES the gradients over dp x cp: what becomes of a share that
    #   was right as a term of a sum? Under sequence parallelism the tp ranks hold other tokens too:
    #   are their shares averaged or summed on the way back? And the executor's division by m: does
    #   the runtime already undo it?
    # Hint 3: The cross-entropy of the flattened logits and targets, IGNORE_INDEX ignored, with
    #   reduction "sum"; times the dp x cp size (topology.size_of with "dp_cp"); divided by
    #   global_valid. No tp factor (the tp ranks' parts are summed: the gradients of the weights
    #   they share are summed over tp, the activations' through the sequence collectives), and no m
    #   (the runtime multiplies your share by m, the executor divides it by m).
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
    # Invariant: for each sequence, the shares of the ranks holding its tokens add up to
    #   E · sum_e f[e] · P[e] of the whole sequence (f: the share of its k·seq_len choices that
    #   named e; P: e's probability averaged over its seq_len tokens); over the global batch,
    #   divided by the dp x cp size, the mean over its sequences. A rank never holds, nor adds,
    #   a whole sequence's loss that other ranks add too.
    # Hint 1: f needs every token of the sequence (a count: no gradient); P is a sum over tokens
    #   divided by seq_len, and the loss is linear in P once f is known: each rank can add its
    #   own tokens' part of P.
    # Hint 2: For one sequence, which ranks hold its other tokens: cp, and under sequence
    #   parallelism tp too? f is a share of the whole sequence's choices: which groups must this
    #   rank's counts visit, and do they carry a gradient? P is a mean over tokens and the loss is
    #   linear in it: does this rank need the others' probabilities, or only its own tokens' part?
    #   Which count of sequences divides at the end, and which factor keeps the mean right after the
    #   gradients are averaged over dp x cp?
    # Hint 3: Per sequence, this rank's choices counted per expert (one-hot over the E experts,
    #   summed over its tokens and the k choices), all-reduced over the cp group and, with sequence
    #   parallelism, over the tp group too; f is those counts over k times seq_len. This rank's part
    #   of P is its probabilities summed over its tokens, over seq_len. Per sequence E times the sum
    #   over experts of f times that part; summed over the b sequences, times the dp x cp size,
    #   divided by global_sequences.
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
    # Invariant: afterwards every gradient equals, for this rank's piece of its weight, the
    #   gradient of the global loss of one process (every token that used the weight counted
    #   once, none twice), and every rank holding a copy of that piece holds the same bits.
    #   The data-parallel sums go through all_reduce_fn, and no other reduction does.
    # Hint 1: the HeldGradient flags say what each tensor is; for each kind, the guide's two
    #   rules ask which ranks hold its other copies and whether those saw other tokens.
    #   all_reduce_flat reduces a list in one collective per dtype, with the all-reduce you
    #   hand it.
    # Hint 2: Take each flag of HeldGradient in turn and ask: which other ranks hold a copy of this
    #   weight, or of this piece of it? Did those copies see other tokens (then the parts must be
    #   added) or the same tokens (then each copy is complete already), and does that change with
    #   sequence parallelism? Each rank's loss share was scaled for an AVERAGE over dp x cp: for a
    #   sum over some group, which count divides it, the size of that group or the number of ranks
    #   whose shares were so scaled? Which gradients has ZeRO averaged already? Which of the sums
    #   are data-parallel (the only ones all_reduce_fn is for)? Last: the two copies of a tied
    #   embedding must end with the same bits; if a copy's value goes through another reduction
    #   after the tie's, can they still differ?
    # Hint 3: Four reductions, each a list handed to all_reduce_flat. (1) With sequence parallelism
    #   only: the tp-replicated gradients summed over the tp group (each tp rank saw 1/tp of the
    #   tokens; without it they saw the same tokens and are complete). (2) Every gradient that is
    #   neither expert nor reduced summed over dp x cp, with all_reduce_fn. (3) Every expert
    #   gradient summed over the edp group (the ranks holding the same expert), with all_reduce_fn.
    #   Then the gradients of (2) and (3) divided by the dp x cp size, the experts' too (the
    #   all-to-all's backward already brought their ep group's tokens; every share was scaled for dp
    #   x cp, not for edp). ZeRO slices (reduced) get nothing more. (4) Last, after the
    #   data-parallel sums, the tied copies summed over the embedding group with torch's all-reduce:
    #   a hand-made all-reduce rounds each element by its position in the buffer, and the two copies
    #   sit at different positions on their stages, so summing the tie first would leave the copies
    #   a few bits apart; summed last, both end on one shared sum.
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
    # Invariant: for every gradient, replicated_on names exactly the groups of the topology
    #   along which every rank holds the same tensor as this one once finish_gradients is done;
    #   the global norm then counts every distinct piece once.
    # Hint 1: 3.6's counted_here keeps one rank of every set of copies; groups missing here
    #   count a copy several times, groups too many drop pieces that are not copies.
    # Hint 2: After finish_gradients, along which named groups does every rank hold the very same
    #   tensor as this one? For a whole non-expert gradient, which ranks averaged it together? For a
    #   ZeRO slice, do the other dp x cp ranks hold the same slice or another? For an expert, which
    #   ranks hold the same expert? For a tp-replicated weight (with and without sequence
    #   parallelism) and for a tied copy, which further group holds an equal copy?
    # Hint 3: One GradShard per held gradient, with its name and its grad; replicated_on holds edp
    #   for an expert, nothing for a ZeRO slice (reduced), dp_cp for every other gradient; plus tp
    #   when it is tp-replicated (equal on every tp rank either way: summed under sequence
    #   parallelism, computed from the same tokens without it), plus embedding when it is tied.
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
