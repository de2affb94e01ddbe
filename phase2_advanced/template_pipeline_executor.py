# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase2.py
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
from phase2_advanced.template_activation_checkpointing import checkpoint
from phase2_advanced.template_pipeline_comm import post_receive, send_tensor, walk_headers

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
        # More hints: uv run python -m tests.hint 2.5
        # See guidelines.md#25-pipeline-parallelism
        raise NotImplementedError(
            "TODO 2.5: run the forward of one micro-batch through one chunk "
            "(see phase2_advanced/guidelines.md#25-pipeline-parallelism)"
        )

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
        # More hints: uv run python -m tests.hint 2.5
        # See guidelines.md#25-pipeline-parallelism
        raise NotImplementedError(
            "TODO 2.5: run the backward of one micro-batch through one chunk and free its stash "
            "(see phase2_advanced/guidelines.md#25-pipeline-parallelism)"
        )

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
        # More hints: uv run python -m tests.hint 2.5
        # See guidelines.md#zero-bubble-split-the-backward-in-two
        raise NotImplementedError(
            "TODO 2.5: the input's gradient of one micro-batch through one chunk; keep the rest "
            "for W "
            "(see phase2_advanced/guidelines.md#zero-bubble-split-the-backward-in-two)"
        )

    def _backward_weight(self, state: StepState, action: Action) -> None:
        """W of a split backward: the gradients of this chunk's parameters for one micro-batch,
        accumulated into their ``.grad`` from what its B kept; frees the weight stash entry."""
        chunk, microbatch = action.chunk, action.microbatch
        # TODO 2.5: the weights' gradients of one micro-batch through one chunk, after its B.
        # Invariant: afterwards the weight stash no longer holds (microbatch, chunk) and every
        #   parameter of the chunk has accumulated this micro-batch's share in .grad, exactly what
        #   the full backward would have added; nothing is sent.
        # Hint 1: everything W needs is in the entry its B left in the weight stash.
        # More hints: uv run python -m tests.hint 2.5
        # See guidelines.md#zero-bubble-split-the-backward-in-two
        raise NotImplementedError(
            "TODO 2.5: the weights' gradients of one micro-batch through one chunk, after its B "
            "(see phase2_advanced/guidelines.md#zero-bubble-split-the-backward-in-two)"
        )
