"""Exercise 2.5 (executor): run any pipeline schedule over point-to-point messages.

Each rank holds one model chunk per virtual stage it owns (one, or v when interleaved; the
stage-to-rank rule is ``pipeline_layout.py``) and plays its own list of actions from a schedule
(``pipeline_schedules.py``). A step starts with the headers (``pipeline_comm.walk_headers``):
every stage learns the shape of its input for this batch, and every rank checks that the batch
splits into m equal micro-batches before any data moves. Then each action is three steps, timed
apart so that timelines show compute and communication separately:

* receive what it consumes ("wait"): stage s - 1's output for a forward (nothing on stage 0),
  the gradient of stage s's output from stage s + 1 for a backward (nothing on the last stage).
  Each receive is posted one action ahead, so a message can arrive during the previous compute;
* compute ("forward"/"backward"): a forward runs the chunk and keeps (input, output) in the
  step's *stash* until its backward, since autograd needs the graph; the last stage computes the
  loss. A backward takes its stash entry out and backpropagates the loss or the received
  gradient;
* send what it produced ("send"): the output to stage s + 1, or the input's gradient to s - 1,
  with ``isend`` (``pipeline_comm.py`` says why), awaited at the end of the step.

Received activations are fresh leaf tensors, so they need ``requires_grad_()``: that is what
makes autograd fill ``input.grad``, the gradient the previous stage is waiting for.

The last stage scales each micro-batch's (mean) loss by 1/m: the m scaled losses sum to the mean
over the whole batch, so the accumulated gradients are exactly those of one big batch. What a
step needs (micro-batches, stash, pending sends, losses) lives in a :class:`StepState` made by
``step`` and dropped when it returns: nothing of one step survives into the next.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from course.events import Event, EventRecorder
from course.tensor_header import TensorMeta
from phase2_advanced.pipeline_layout import rank_chunks, stage_chunk, virtual_stage
from solutions.phase2_advanced.activation_checkpointing import checkpoint
from solutions.phase2_advanced.pipeline_comm import (
    ACTIVATION,
    GRADIENT,
    Pending,
    StageLinks,
    post_receive,
    send_tensor,
    wait_all,
    walk_headers,
)
from solutions.phase2_advanced.pipeline_schedules import FORWARD, Action

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
WAIT, SEND = "wait", "send"  # events of communication, recorded apart from compute
__all__ = [
    "ACTIVATION",
    "GRADIENT",
    "PipelineExecutor",
    "StepResult",
    "StepState",
    "check_actions",
    "infer_output_meta",
    "rank_chunks",
    "split_microbatches",
]


@dataclass
class StepResult:
    """What one step did on this rank.

    loss: the batch's mean loss on the rank holding the last stage, ``None`` elsewhere.
    peak_stashed: the most (micro-batch, chunk) activations held at once.
    left_stashed: how many were still held when the step ended (0 when every backward popped
        its entry).
    events: per action, a "forward" or "backward" event (labels: microbatch, chunk, stage),
        preceded by a "wait" event while its input arrives and followed by a "send" event when
        it has something to send; times from ``time.perf_counter``.
    """

    loss: float | None
    peak_stashed: int
    events: list[Event] = field(default_factory=list)
    left_stashed: int = 0


@dataclass
class StepState:
    """Everything one step needs, made by ``PipelineExecutor.step`` and dropped after it.

    inputs / targets: the micro-batches (on the ranks holding the first / last stage).
    stash: ``(microbatch, chunk) -> (input, output or scaled loss)`` from a forward until its
        backward.
    sends: the posted sends, awaited at the end of the step.
    losses: the last stage's scaled micro-batch losses (detached).
    """

    inputs: list[torch.Tensor] = field(default_factory=list)
    targets: list[torch.Tensor] = field(default_factory=list)
    stash: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    sends: list[Pending] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)


def check_actions(actions: Sequence[Action], num_microbatches: int, num_chunks: int) -> None:
    """Refuse an action list that cannot be run: each (micro-batch, chunk) must be forwarded
    once, then backwarded once. Checked before any message is sent."""
    seen: set[tuple[str, int, int]] = set()
    for action in actions:
        key = (action.kind, action.microbatch, action.chunk)
        if not (0 <= action.microbatch < num_microbatches and 0 <= action.chunk < num_chunks):
            raise ValueError(f"{action}: outside {num_microbatches} micro-batches x {num_chunks}")
        if key in seen:
            raise ValueError(f"{action} appears twice in this rank's schedule")
        if action.kind != FORWARD and (FORWARD, action.microbatch, action.chunk) not in seen:
            raise ValueError(f"{action} comes before its forward in this rank's schedule")
        seen.add(key)
    if len(seen) != 2 * num_microbatches * num_chunks:
        raise ValueError(
            f"this rank's schedule has {len(seen)} actions; {num_microbatches} micro-batches x "
            f"{num_chunks} chunks need {2 * num_microbatches * num_chunks} (a forward and a "
            "backward each)"
        )


def check_microbatches(batch_size: int, num_microbatches: int) -> None:
    """Refuse a batch that does not cut into m equal micro-batches (every rank runs this)."""
    if batch_size % num_microbatches:
        raise ValueError(
            f"a batch of {batch_size} samples cannot be cut into {num_microbatches} equal "
            "micro-batches: equal sizes are what make the 1/m-scaled losses sum to the batch mean"
        )


def split_microbatches(batch: torch.Tensor, num_microbatches: int) -> list[torch.Tensor]:
    """``batch`` cut into m equal micro-batches along dimension 0 (ValueError otherwise)."""
    check_microbatches(batch.shape[0], num_microbatches)
    return list(batch.chunk(num_microbatches))


def infer_output_meta(module: nn.Module, meta: TensorMeta) -> TensorMeta:
    """The shape and dtype ``module`` outputs for an input described by ``meta``, computed on
    the meta device: nothing is computed, no RNG is drawn, no buffer changes."""
    state = {name: t.to("meta") for name, t in module.state_dict(keep_vars=True).items()}
    with torch.no_grad():
        output = functional_call(module, state, (meta.empty("meta"),))
    return TensorMeta(tuple(output.shape), output.dtype)


def _with_batch(meta: TensorMeta, batch_size: int) -> TensorMeta:
    return TensorMeta((batch_size, *meta.shape[1:]), meta.dtype)


class PipelineExecutor:
    """Runs this rank's ``actions`` over its model ``chunks`` (chunk c is virtual stage
    c·p + rank), exchanging activations and gradients with the neighbouring stages.

    The pipeline's ranks are those of ``group`` (the default group when None); p is its size
    and "rank" is this process's rank in it. ``loss_fn(output, target)`` must return the mean
    loss of a micro-batch; the executor scales it by 1/m. With ``checkpoint_chunks`` each chunk's
    forward keeps only its input and is recomputed in backward (exercise 2.3's ``checkpoint``).
    """

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        actions: Sequence[Action],
        num_microbatches: int,
        loss_fn: LossFn = F.cross_entropy,
        checkpoint_chunks: bool = False,
        *,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.chunks = list(chunks)
        self.actions = list(actions)
        self.num_microbatches = num_microbatches
        self.loss_fn = loss_fn
        self.checkpoint_chunks = checkpoint_chunks
        if not self.chunks:
            raise ValueError("a pipeline rank needs at least one model chunk")
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches={num_microbatches}: split the batch at least once")
        check_actions(self.actions, num_microbatches, len(self.chunks))
        self.links = StageLinks.build(len(self.chunks), num_microbatches, group)
        self.rank, self.num_ranks = self.links.rank, self.links.num_ranks
        if self.num_ranks == 1 and len(self.chunks) > 1:
            raise ValueError(
                "interleaving needs at least 2 ranks: neighbouring chunks would share one"
            )
        self.last_stage = self.links.last_stage
        self.device = next(
            (p.device for c in self.chunks for p in c.parameters()), torch.device("cpu")
        )
        # (chunk, micro-batch input meta) -> output meta; inferred once per input shape
        self._inferred: dict[tuple[int, TensorMeta], TensorMeta] = {}

    def stage_of(self, chunk: int) -> int:
        """The virtual stage of this rank's ``chunk``."""
        return virtual_stage(self.rank, chunk, self.num_ranks)

    # ------------------------------------------------------------------ the step

    def step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> StepResult:
        """Forward and backward of one batch; gradients accumulate into the chunks' ``.grad``.

        ``inputs`` are needed on the rank holding stage 0 and ``targets`` on the rank holding
        the last stage (others may pass ``None``); both are cut into m equal micro-batches.
        Every rank refuses a batch that does not cut so, before any data message.
        """
        m = self.num_microbatches
        holds_first, holds_last = self.links.holds(0), self.links.holds(self.last_stage)
        if holds_first and inputs is None:
            raise ValueError("the rank holding stage 0 needs the inputs")
        if holds_last and targets is None:
            raise ValueError("the rank holding the last stage needs the targets")
        batch = TensorMeta.of(inputs) if holds_first and inputs is not None else None
        # Headers first: every stage learns its input's shape for the whole batch, so every
        # rank (not only those holding the batch) can refuse it before any data moves.
        batch_metas = walk_headers(self.links, batch, self._output_meta, self.device)
        batch_size = next(iter(batch_metas.values())).shape[0]
        check_microbatches(batch_size, m)
        state = StepState()
        if holds_first and inputs is not None:
            state.inputs = split_microbatches(inputs, m)
        if holds_last and targets is not None:
            if targets.shape[0] != batch_size:
                raise ValueError(
                    f"{targets.shape[0]} targets for a batch of {batch_size} inputs: give the "
                    "rank holding the last stage the targets of the same batch"
                )
            state.targets = split_microbatches(targets, m)
        micro = {
            stage_chunk(stage, self.num_ranks): _with_batch(meta, batch_size // m)
            for stage, meta in batch_metas.items()
        }
        return self._run(state, micro)

    def _output_meta(self, stage: int, batch_meta: TensorMeta) -> TensorMeta:
        """What ``stage`` outputs for the whole batch (``walk_headers`` sends it on)."""
        m = self.num_microbatches
        batch_size = batch_meta.shape[0]
        if batch_size % m:  # refused right after the walk, on every rank; keep the walk going
            return batch_meta
        chunk = stage_chunk(stage, self.num_ranks)
        output = self._chunk_output(chunk, _with_batch(batch_meta, batch_size // m))
        return _with_batch(output, batch_size)

    def _chunk_output(self, chunk: int, micro: TensorMeta) -> TensorMeta:
        key = (chunk, micro)
        if key not in self._inferred:
            self._inferred[key] = infer_output_meta(self.chunks[chunk], micro)
        return self._inferred[key]

    def _run(self, state: StepState, micro: dict[int, TensorMeta]) -> StepResult:
        """Play this rank's actions: receives posted one action ahead, sends awaited at the end."""
        recorder = EventRecorder()
        peak = 0

        def post_incoming(action: Action) -> Pending | None:
            stage = self.stage_of(action.chunk)
            if action.kind == FORWARD:
                if stage == 0:
                    return None
                meta, kind = micro[action.chunk], ACTIVATION
            else:
                if stage == self.last_stage:
                    return None
                meta, kind = self._chunk_output(action.chunk, micro[action.chunk]), GRADIENT
            return post_receive(self.links, meta, kind, stage, action.microbatch, self.device)

        # Post each action's receive one action ahead: a message that arrives while the rank
        # is still computing the previous action is there when needed (gloo moves the data
        # once both sides have posted), instead of starting to move only when asked for.
        receives = {0: post_incoming(self.actions[0])}
        for index, action in enumerate(self.actions):
            if index + 1 < len(self.actions):
                receives[index + 1] = post_incoming(self.actions[index + 1])
            stage = self.stage_of(action.chunk)
            labels = {"microbatch": action.microbatch, "chunk": action.chunk, "stage": stage}
            received = None
            pending = receives.pop(index)
            if pending is not None:
                with recorder.span(WAIT, **labels):
                    received = pending.wait()
            with recorder.span(action.kind, **labels):
                if action.kind == FORWARD:
                    outgoing = self._forward(state, action, received)
                else:
                    outgoing = self._backward(state, action, received)
            if outgoing is not None:
                kind = ACTIVATION if action.kind == FORWARD else GRADIENT
                to_stage = stage + 1 if action.kind == FORWARD else stage - 1
                with recorder.span(SEND, **labels):
                    state.sends.append(
                        send_tensor(self.links, outgoing, kind, to_stage, action.microbatch)
                    )
            peak = max(peak, len(state.stash))
        wait_all(state.sends)
        loss = float(torch.stack(state.losses).sum()) if state.losses else None
        return StepResult(loss, peak, list(recorder.events), len(state.stash))

    def _run_chunk(self, chunk: int, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_chunks:
            return checkpoint(self.chunks[chunk], x)
        return self.chunks[chunk](x)

    # ------------------------------------------------------------------ exercise 2.5

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
        # Invariant: stage 0 reads state.inputs[microbatch], other stages use `received` and
        #   make it require grad; the last stage turns its output into loss_fn(output, target)
        #   / m (and appends it, detached, to state.losses) and returns None; other stages
        #   return their output detached (the message is data; the graph stays here).
        #   Afterwards state.stash[(microbatch, chunk)] holds (input, output or scaled loss).
        # Hint 1: a received tensor is a leaf with no history: without requires_grad_() autograd
        #   will not compute its .grad, which is what the previous stage waits for. Run the
        #   chunk with self._run_chunk (it checkpoints when asked).
        # Hint 2: pick the input by stage (the micro-batch on stage 0, the received tensor,
        #   marked as needing a gradient, elsewhere); run the chunk; on the last stage replace
        #   the output by the scaled loss against state.targets and record it; stash the pair
        #   under (microbatch, chunk); hand back the detached output unless this is the last
        #   stage.
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
        # Hint 1: the last stage backpropagates its scaled loss (gradient None), the others
        #   their output with the received gradient: torch.autograd.backward(output, grad). A
        #   stage whose output needs no grad (no parameters, and an input that needs none) has
        #   nothing to backpropagate. Removing the stash entry frees its activations.
        # Hint 2: take the entry out of the stash (pop, not get: a step holds only what its
        #   schedule says); backpropagate when the stashed output requires grad; stage 0 sends
        #   nothing back, the others return their input's .grad (zeros shaped like the input
        #   when autograd left it None: the output did not depend on it).
        # See guidelines.md#25-pipeline-parallelism
        # >>> solution
        x, output = state.stash.pop((microbatch, chunk))
        if output.requires_grad:
            torch.autograd.backward(output, received)
        if stage == 0:
            return None
        return x.grad if x.grad is not None else torch.zeros_like(x)
        # <<< solution
