"""Exercise 2.5 (executor): the work of one pipeline action, and the stash between them.

A rank of a pipeline holds one model chunk per virtual stage it owns (one, or several when
interleaved or V-shaped; ``pipeline_layout.py``) and plays its own list of actions from a
schedule. The given :class:`~phase2_advanced.pipeline_runtime.PipelineRuntime` does a step's
bookkeeping: the headers that tell every stage its input's shape, the receive each action waits
for (posted one action ahead), the send of what an action returns, the timing of every part, and
the result. What is left is the exercise, the work of one action:

* a **forward** runs the chunk on its input and keeps what its backward will need in the step's
  *stash*, since autograd needs the graph; the last stage turns its output into the loss;
* a **backward** takes its stash entry out, backpropagates through what its forward kept, and
  hands on the gradient of its input;
* in a zero-bubble schedule the backward is split in two (Qi et al., "Zero Bubble Pipeline
  Parallelism", ICLR 2024): **B** computes only the gradient of the input, which the previous
  stage is waiting for, and keeps what the weights' gradients need in the *weight stash*;
  **W**, later, computes the weights' gradients, which no other stage waits for.

Received activations are fresh tensors, with no history.

``loss_fn`` returns each micro-batch's mean loss; the losses the last stage records must sum to
the mean over the whole batch, so that the gradients that accumulate in ``.grad`` over the m
backwards are exactly those of one big batch.
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
        # Invariant: afterwards state.stash[(microbatch, chunk)] holds this chunk's input and what
        #   its backward will start from; an input that arrived from another stage will get a .grad
        #   in backward; the last stage records its micro-batch loss, scaled so the m of them sum to
        #   the batch mean, in state.losses (detached) and returns None; the other stages return
        #   plain data for the next stage (the graph stays here).
        # Hint 1: self._run_chunk runs a chunk (through 2.3's checkpoint when asked); state holds
        #   this step's micro-batches, targets and stash.
        # Hint 2: Where does stage 0's input come from, and every other stage's? What does autograd
        #   need of a leaf tensor before it fills its .grad? What does the last stage turn its
        #   output into, and by what factor must it scale it so that the m backwards add up to one
        #   big batch's gradients? What is sent on: the output with its graph, or its data alone?
        # Hint 3: Stage 0's input is its micro-batch of state.inputs; every other stage's is the
        #   received tensor, marked as requiring a gradient (requires_grad_) before the chunk runs,
        #   or its .grad never exists.
        # Hint 4: On the last stage the output becomes loss_fn of the output and the micro-batch's
        #   targets, divided by m: m means of equal micro-batches, each over m, sum to the batch
        #   mean. Its detached copy goes into state.losses.
        # Hint 5: Run the chunk on the input; on the last stage make its output the scaled loss and
        #   record it; store the pair (input, output or loss) in the stash under (microbatch,
        #   chunk); return None on the last stage and the detached output elsewhere.
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
        """One backward of one micro-batch through one chunk. ``received`` is the gradient of
        the chunk's output from stage + 1 (``None`` on the last stage). Returns the gradient of
        the input, to send to stage - 1, or ``None`` on stage 0."""
        chunk, microbatch = action.chunk, action.microbatch
        stage = self.stage_of(chunk)
        # TODO 2.5: run the backward of one micro-batch through one chunk and free its stash.
        # Invariant: afterwards the stash no longer holds (microbatch, chunk) and the chunk's
        #   parameters' .grad have accumulated this micro-batch's share; every stage but 0 returns
        #   the gradient of its input (same shape as the input).
        # Hint 1: torch.autograd.backward takes the tensors to start from and the gradients flowing
        #   into them (None for a scalar), and accumulates into .grad.
        # Hint 2: From which tensor, and with which incoming gradient, does the last stage start,
        #   and every other stage? How does the stash entry leave the stash, so that nothing else
        #   keeps the micro-batch's graph alive? What is there to backpropagate when the stashed
        #   output needs no gradient (a stage without parameters whose input needs none)? What does
        #   a stage return when autograd left its input's .grad empty?
        # Hint 3: The last stage backpropagates from its scaled loss (a scalar: no incoming
        #   gradient); every other stage from its output, with received as the output's gradient.
        # Hint 4: The entry is popped, not read: the stash's reference to the graph goes with it. An
        #   output that does not require grad has nothing to backpropagate; its input's gradient is
        #   then zeros shaped like the input.
        # Hint 5: Pop the (input, output) pair under (microbatch, chunk); when the output requires
        #   grad, torch.autograd.backward of the output with received; return None on stage 0, else
        #   the input's .grad, or zeros shaped like the input when it is None.
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
        # Invariant: afterwards the stash no longer holds (microbatch, chunk) and the weight stash
        #   does, with what W starts from; no parameter's .grad has changed yet; every stage but 0
        #   returns the gradient of its input (same shape as the input), as _backward does.
        # Hint 1: the input's gradient goes to stage − 1 at once; the weights' gradients wait for
        #   this micro-batch's W, which reads the weight stash (the API table says what an entry
        #   holds).
        # Hint 2: Which autograd call returns the gradient of chosen tensors and fills no .grad?
        #   With respect to which tensor does B differentiate? Autograd frees the graph it walks:
        #   what must B ask of it, given that W walks the same graph later? Stage 0's input needs no
        #   gradient: what must its B still do so that its W can run?
        # Hint 3: torch.autograd.grad of the output with respect to the input alone, from received
        #   (None on the last stage): it returns the gradient and leaves every .grad as it was.
        # Hint 4: retain_graph keeps the graph for W's walk; allow_unused covers a chunk whose
        #   output does not use its input. Every B, stage 0's included, moves its entry: the pair
        #   (output, received) goes into the weight stash under the same key.
        # Hint 5: Pop the stash entry; put (output, received) in the weight stash; return None on
        #   stage 0; elsewhere, when the output requires grad, the input's gradient from
        #   torch.autograd.grad with the graph retained and unused inputs allowed (a one-element
        #   tuple), returned, or zeros shaped like the input when it is None.
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
        #   parameter of the chunk has accumulated this micro-batch's share in .grad, exactly what
        #   the full backward would have added; nothing is sent.
        # Hint 1: everything W needs is in the entry its B left in the weight stash.
        # Hint 2: From which output and which incoming gradient does W start? With respect to which
        #   tensors does it differentiate? How must its result reach .grad so that the m
        #   micro-batches add up, and which autograd call does that while touching nothing else?
        #   What is there to do for a chunk without trainable parameters?
        # Hint 3: W starts from the same output and incoming gradient as B, both in its weight-stash
        #   entry, and differentiates with respect to the chunk's parameters that require grad.
        # Hint 4: torch.autograd.backward with its inputs argument set to those parameters adds into
        #   their .grad (accumulating, as the m micro-batches need) and touches nothing else; this
        #   last walk may free the graph. A chunk without such parameters, or an output that needs
        #   no grad, has nothing to compute.
        # Hint 5: Pop the weight-stash entry; collect the chunk's parameters that require grad; when
        #   there are any and the output requires grad, torch.autograd.backward of the output with
        #   the stashed gradient, restricted to them.
        # See guidelines.md#zero-bubble-split-the-backward-in-two
        # >>> solution
        output, grad_output = state.weight_stash.pop((microbatch, chunk))
        params = [q for q in self.chunks[chunk].parameters() if q.requires_grad]
        if params and output.requires_grad:
            torch.autograd.backward(output, grad_output, inputs=params)
        # <<< solution
