"""Exercise 2.5 (executor): the work of one pipeline action, and the stash between them.

A rank of a pipeline holds one model chunk per virtual stage it owns (one, or several when
interleaved or V-shaped; ``pipeline_layout.py``) and plays its own list of actions from a
schedule. The given :class:`~phase2_advanced.pipeline_runtime.PipelineRuntime` does a step's
bookkeeping: the headers that tell every stage its input's shape, the receive each action waits
for (posted one action ahead), the send of what an action returns, the timing of every part, and
the result. What is left is the exercise, the work of one action:

* a **forward** runs the chunk on its input and keeps what its backward will need in the step's
  *stash*, since autograd needs the graph; the last stage turns its output into the loss;
* a **backward** takes its stash entry out and backpropagates from the loss or from the
  gradient that came back, and hands on the gradient of its input;
* in a zero-bubble schedule the backward is split in two (Qi et al., "Zero Bubble Pipeline
  Parallelism", ICLR 2024): **B** computes only the gradient of the input, which the previous
  stage is waiting for, and keeps what the weights' gradients need in the *weight stash*;
  **W**, later, computes the weights' gradients, which no other stage waits for.

Received activations are fresh leaf tensors, with no history: autograd computes a gradient
only for tensors that ask for one, and that gradient is what the previous stage is waiting for.

``loss_fn`` returns each micro-batch's mean loss; with m equal micro-batches, scaling each by 1/m
makes the m losses sum to the mean over the whole batch, so the gradients that accumulate in
``.grad`` are exactly those of one big batch.
"""

from __future__ import annotations

import torch

from phase2_advanced.pipeline_actions import Action
from phase2_advanced.pipeline_runtime import (
    PipelineRuntime,
    StageFunctions,
    StepResult,
    StepState,
    check_actions,
    infer_output_meta,
    split_microbatches,
)
from solutions.phase2_advanced.activation_checkpointing import checkpoint
from solutions.phase2_advanced.pipeline_comm import post_receive, send_tensor, walk_headers

__all__ = [
    "PipelineExecutor",
    "StepResult",
    "StepState",
    "check_actions",
    "infer_output_meta",
    "split_microbatches",
]


class PipelineExecutor(PipelineRuntime):
    """Runs this rank's ``actions`` over its model ``chunks`` (chunk c is the virtual stage
    ``self.stage_of(c)``): ``PipelineExecutor(chunks, actions, num_microbatches,
    loss_fn=F.cross_entropy, checkpoint_chunks=False, *, group=None, placement="loop")``, then
    ``step(inputs, targets)`` per batch.

    The pipeline's ranks are those of ``group`` (the default group when None); ``placement`` is
    the schedule's stage-to-rank rule (``"v"`` for zb-v). ``loss_fn(output, target)`` returns
    the mean loss of a micro-batch. With ``checkpoint_chunks`` each chunk's forward keeps only
    its input and is recomputed in backward (exercise 2.3's ``checkpoint``). Everything but the
    methods below is given (``pipeline_runtime.py``).
    """

    functions = StageFunctions(send_tensor, post_receive, walk_headers, checkpoint)

    def _forward(
        self, state: StepState, action: Action, received: torch.Tensor | None
    ) -> torch.Tensor | None:
        """One forward: run the chunk on the input, stash what the backward needs.

        ``received`` is the activation from stage - 1 (``None`` on stage 0). Returns what to
        send to stage + 1, or ``None`` on the last stage, which computes the loss instead.
        """
        chunk, microbatch = action.chunk, action.microbatch
        stage = self.stage_of(chunk)
        # TODO 2.5: run the forward of one micro-batch through one chunk.
        # Invariant: afterwards state.stash[(microbatch, chunk)] holds this chunk's input and
        #   what its backward will start from; an input that arrived from another stage will
        #   get a .grad in backward; the last stage records its micro-batch loss, scaled so the
        #   m of them sum to the batch mean, in state.losses (detached) and returns None; the
        #   other stages return plain data for the next stage (the graph stays here).
        # Hint 1: a received tensor is a leaf with no history, and autograd fills .grad only
        #   for leaves that ask for it. Run the chunk with self._run_chunk (it checkpoints when
        #   asked). See "Why 1/m" in the guide for the scale.
        # Hint 2: pick the input by stage (the micro-batch on stage 0, the received tensor,
        #   marked as needing a gradient, elsewhere); run the chunk; on the last stage replace
        #   the output by the scaled loss against this micro-batch's targets and record it;
        #   stash the pair under (microbatch, chunk); hand back the detached output unless this
        #   is the last stage.
        # Hint 3: stage 0's input is state.inputs[microbatch]; elsewhere it is the received
        #   tensor after requires_grad_(); self._run_chunk(chunk, input) gives the output; on
        #   the last stage the output becomes loss_fn(output, that micro-batch's targets) / m
        #   and its detached copy goes into state.losses; the stash maps (microbatch, chunk)
        #   to the pair (input, output).
        # See guidelines.md#25-pipeline-parallelism
        # >>> solution
        if stage == 0:
            x = state.inputs[microbatch]
        else:
            assert received is not None, "stages after the first receive their input"
            x = received.requires_grad_()
        output = self._run_chunk(chunk, x)
        if stage == self.last_stage:
            output = self.loss_fn(output, state.targets[microbatch]) / self.num_microbatches
            state.losses.append(output.detach())
        state.stash[(microbatch, chunk)] = (x, output)
        return None if stage == self.last_stage else output.detach()
        # <<< solution

    def _backward(
        self, state: StepState, action: Action, received: torch.Tensor | None
    ) -> torch.Tensor | None:
        """One backward: autograd through the stash from the scaled loss (last stage) or from
        ``received``, the gradient of the output. Returns the gradient of the input, to send
        to stage - 1, or ``None`` on stage 0."""
        chunk, microbatch = action.chunk, action.microbatch
        stage = self.stage_of(chunk)
        # TODO 2.5: run the backward of one micro-batch through one chunk and free its stash.
        # Invariant: afterwards the stash no longer holds (microbatch, chunk) and the chunk's
        #   parameters' .grad have accumulated this micro-batch's share; every stage but 0
        #   returns the gradient of its input (same shape as the input).
        # Hint 1: the last stage starts backward from its scaled loss, the others from their
        #   output and the gradient that came back for it. A stage whose output needs no grad
        #   (no parameters, and an input that needs none) has nothing to backpropagate.
        #   Removing the stash entry is what frees the micro-batch's activations.
        # Hint 2: take the entry out of the stash (pop, not get: a step holds only what its
        #   schedule says); backpropagate when the stashed output requires grad; stage 0 sends
        #   nothing back, the others return their input's .grad (zeros shaped like the input
        #   when autograd left it None: the output did not depend on it).
        # Hint 3: pop the (input, output) pair under (microbatch, chunk); torch.autograd.backward
        #   of the output with `received` as its gradient (None on the last stage: the loss is
        #   a scalar); return the input's .grad, or torch.zeros_like of the input when it is
        #   None.
        # See guidelines.md#25-pipeline-parallelism
        # >>> solution
        x, output = state.stash.pop((microbatch, chunk))
        if output.requires_grad:
            torch.autograd.backward(output, received)
        if stage == 0:
            return None
        return x.grad if x.grad is not None else torch.zeros_like(x)
        # <<< solution

    # ------------------------------------------------------------------------- zero bubble

    def _backward_input(
        self, state: StepState, action: Action, received: torch.Tensor | None
    ) -> torch.Tensor | None:
        """B of a split backward: the gradient of the input only, from the scaled loss (last
        stage) or from ``received``; the weights' gradients are left to this micro-batch's W.
        Returns the gradient of the input, to send to stage - 1, or ``None`` on stage 0."""
        chunk, microbatch = action.chunk, action.microbatch
        stage = self.stage_of(chunk)
        # TODO 2.5: the input's gradient of one micro-batch through one chunk; keep the rest for W.
        # Invariant: afterwards the stash no longer holds (microbatch, chunk) and the weight
        #   stash does, with what W starts from; no parameter's .grad has changed yet; every
        #   stage but 0 returns the gradient of its input (same shape as the input), as
        #   _backward does.
        # Hint 1: autograd can differentiate with respect to chosen tensors only, and frees the
        #   graph it walked unless asked to keep it; W walks the same graph later. Stage 0's
        #   input needs no gradient: its B has nothing to compute, its W does all the work.
        # Hint 2: take the entry out of the stash; unless this is stage 0 (or the output needs
        #   no grad), ask autograd for the gradient of the output with respect to the input
        #   alone, starting from the gradient that came back (none on the last stage), keeping
        #   the graph; put the output and that incoming gradient in the weight stash under the
        #   same key; return the input's gradient (zeros shaped like the input when autograd
        #   found none), or None on stage 0.
        # Hint 3: torch.autograd.grad of the output with respect to the input alone, with
        #   `received` as the output's gradient, keeping the graph (retain_graph) and allowing
        #   an input the output does not use; it returns a one-element tuple. The weight
        #   stash maps the same key to the pair (output, received).
        # See guidelines.md#zero-bubble-split-the-backward-in-two
        # >>> solution
        x, output = state.stash.pop((microbatch, chunk))
        state.weight_stash[(microbatch, chunk)] = (output, received)
        if stage == 0:
            return None
        grad = None
        if output.requires_grad:
            # retain_graph: W walks this graph again, from the same output, to the weights
            (grad,) = torch.autograd.grad(output, x, received, retain_graph=True, allow_unused=True)
        return grad if grad is not None else torch.zeros_like(x)
        # <<< solution

    def _backward_weight(self, state: StepState, action: Action) -> None:
        """W of a split backward: the gradients of this chunk's parameters for one micro-batch,
        accumulated into their ``.grad`` from what its B kept; frees the weight stash entry."""
        chunk, microbatch = action.chunk, action.microbatch
        # TODO 2.5: the weights' gradients of one micro-batch through one chunk, after its B.
        # Invariant: afterwards the weight stash no longer holds (microbatch, chunk) and every
        #   parameter of the chunk has accumulated this micro-batch's share in .grad, exactly
        #   what the full backward would have added; nothing is sent.
        # Hint 1: the same graph and the same incoming gradient as B, now differentiated with
        #   respect to the chunk's parameters; accumulating into .grad (not replacing) is what
        #   sums the m micro-batches. A chunk without parameters, or an output that needs no
        #   grad, has nothing to compute.
        # Hint 2: take the entry out of the weight stash; collect the chunk's parameters that
        #   require grad; if there are any and the output requires grad, backpropagate from the
        #   output with the stashed gradient, restricted to those parameters (this last walk
        #   may free the graph).
        # Hint 3: torch.autograd.backward of the output with the stashed gradient, its
        #   `inputs` argument set to the list of parameters: it accumulates into each of their
        #   .grad and touches nothing else.
        # See guidelines.md#zero-bubble-split-the-backward-in-two
        # >>> solution
        output, grad_output = state.weight_stash.pop((microbatch, chunk))
        params = [q for q in self.chunks[chunk].parameters() if q.requires_grad]
        if params and output.requires_grad:
            torch.autograd.backward(output, grad_output, inputs=params)
        # <<< solution
