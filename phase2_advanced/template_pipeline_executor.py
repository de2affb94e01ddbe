# Exercise template generated from solutions/phase2_advanced/pipeline_executor.py.
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase2.py
"""Exercise 2.5 (executor): run any pipeline schedule over point-to-point messages.

Each rank holds one model chunk per virtual stage it owns (one, or v when interleaved) and plays
its own list of actions from a schedule (``pipeline_schedules.py``). Each action is three steps,
timed apart so that timelines show compute and communication separately:

* receive what it consumes ("wait"): stage s - 1's output for a forward (nothing on stage 0),
  the gradient of stage s's output from stage s + 1 for a backward (nothing on the last stage).
  Each receive is posted one action ahead, so a message can arrive during the previous compute;
* compute ("forward"/"backward"): a forward runs the chunk and keeps (input, output) in a
  *stash* until its backward, since autograd needs the graph; the last stage computes the loss.
  A backward takes its stash entry out and backpropagates the loss or the received gradient;
* send what it produced ("send"): the output to stage s + 1, or the input's gradient to s - 1.

Received activations are fresh leaf tensors, so they need ``requires_grad_()``: that is what
makes autograd fill ``input.grad``, the gradient the previous stage is waiting for. Every send is
an ``isend`` whose completion is only awaited at the end of the step. A blocking send returns
only once the receiver has posted the matching receive, so two neighbours that both send first
wait for each other forever: in 1F1B when receives are posted only when needed (rank 0 sends
activation 1 while rank 1 sends gradient 0), and in interleaved 1F1B even with the receives
posted one action ahead as here. Messages carry a tag naming (kind, stage, micro-batch), so
gloo matches them whatever order they are posted in (NCCL ignores tags and matches in order;
the schedules here post sends and receives in the same order on both ends of every link).

The last stage scales each micro-batch's (mean) loss by 1/m: the m scaled losses sum to the mean
over the whole batch, so the accumulated gradients are exactly those of one big batch.
Before the first step the ranks agree on activation shapes: stage 0 knows the micro-batch's
shape, each stage infers its output's shape on the ``meta`` device (no compute, no RNG, no
state change) and sends it to the next stage, one small message per stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from solutions.common.events import Event, EventRecorder
from phase2_advanced.template_activation_checkpointing import checkpoint
from phase2_advanced.template_pipeline_schedules import FORWARD, Action, virtual_stage

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
PendingReceive = tuple[dist.Work | None, torch.Tensor]  # (work to wait for, buffer)
ACTIVATION, GRADIENT = 0, 1
WAIT, SEND = "wait", "send"  # events of communication, recorded apart from compute
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32)
_MAX_DIMS = 8


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver must know to allocate a buffer: shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def encode(self) -> torch.Tensor:
        if len(self.shape) > _MAX_DIMS or self.dtype not in _DTYPES:
            raise ValueError(f"cannot send activations of shape {self.shape} and {self.dtype}")
        padded = list(self.shape) + [0] * (_MAX_DIMS - len(self.shape))
        return torch.tensor([len(self.shape), _DTYPES.index(self.dtype), *padded])

    @staticmethod
    def decode(message: torch.Tensor) -> TensorMeta:
        ndim, dtype = int(message[0]), _DTYPES[int(message[1])]
        return TensorMeta(tuple(int(d) for d in message[2 : 2 + ndim]), dtype)


@dataclass
class StepResult:
    """What one step did on this rank.

    loss: the batch's mean loss on the rank holding the last stage, ``None`` elsewhere.
    peak_stashed: the most micro-batches (per chunk) whose activations were held at once.
    events: per action, a "forward" or "backward" event (labels: microbatch, chunk, stage),
        preceded by a "wait" event while its input arrives and followed by a "send" event when
        it has something to send; times from ``time.perf_counter``.
    """

    loss: float | None
    peak_stashed: int
    events: list[Event] = field(default_factory=list)


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


def rank_chunks(stages: Sequence[nn.Module], rank: int, num_ranks: int) -> list[nn.Module]:
    """The stages rank ``rank`` holds: virtual stages rank, rank + p, rank + 2p, ..."""
    if len(stages) % num_ranks:
        raise ValueError(f"{len(stages)} stages cannot be dealt evenly to {num_ranks} ranks")
    return list(stages[rank::num_ranks])


def split_microbatches(batch: torch.Tensor, num_microbatches: int) -> list[torch.Tensor]:
    """``batch`` cut into m equal micro-batches along dimension 0 (ValueError otherwise)."""
    if batch.shape[0] % num_microbatches:
        raise ValueError(
            f"a batch of {batch.shape[0]} samples cannot be cut into {num_microbatches} equal "
            "micro-batches: equal sizes are what make the 1/m-scaled losses sum to the batch mean"
        )
    return list(batch.chunk(num_microbatches))


def infer_output_meta(module: nn.Module, meta: TensorMeta) -> TensorMeta:
    """The shape and dtype ``module`` outputs for an input described by ``meta``, computed on
    the meta device: nothing is computed, no RNG is drawn, no buffer changes."""
    state = {name: t.to("meta") for name, t in module.state_dict(keep_vars=True).items()}
    with torch.no_grad():
        output = functional_call(
            module, state, (torch.empty(meta.shape, dtype=meta.dtype, device="meta"),)
        )
    return TensorMeta(tuple(output.shape), output.dtype)


class PipelineExecutor:
    """Runs this rank's ``actions`` over its model ``chunks`` (chunk c is virtual stage
    c·p + rank), exchanging activations and gradients with the neighbouring stages.

    ``loss_fn(output, target)`` must return the mean loss of a micro-batch; the executor scales
    it by 1/m. With ``checkpoint_chunks`` each chunk's forward keeps only its input and is
    recomputed in backward (exercise 2.3's ``checkpoint``).
    """

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        actions: Sequence[Action],
        num_microbatches: int,
        loss_fn: LossFn = F.cross_entropy,
        checkpoint_chunks: bool = False,
    ) -> None:
        self.rank, self.num_ranks = dist.get_rank(), dist.get_world_size()
        self.chunks = list(chunks)
        self.actions = list(actions)
        self.num_microbatches = num_microbatches
        self.loss_fn = loss_fn
        self.checkpoint_chunks = checkpoint_chunks
        if not self.chunks:
            raise ValueError("a pipeline rank needs at least one model chunk")
        if self.num_ranks == 1 and len(self.chunks) > 1:
            raise ValueError(
                "interleaving needs at least 2 ranks: neighbouring chunks would share one"
            )
        check_actions(self.actions, num_microbatches, len(self.chunks))
        self.last_stage = self.num_ranks * len(self.chunks) - 1
        self.device = next(
            (p.device for c in self.chunks for p in c.parameters()), torch.device("cpu")
        )
        self.recorder = EventRecorder()
        self._input_meta: dict[int, TensorMeta] = {}  # chunk -> what it receives
        self._output_meta: dict[int, TensorMeta] = {}  # chunk -> what it sends
        self._inputs: list[torch.Tensor] = []
        self._targets: list[torch.Tensor] = []
        self._stash: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._pending_sends: list[tuple[dist.Work | None, torch.Tensor]] = []
        self._losses: list[torch.Tensor] = []

    @property
    def stashed(self) -> int:
        """Micro-batches (per chunk) whose activations are held now; 0 after a full step."""
        return len(self._stash)

    # ------------------------------------------------------------------ where things are

    def stage_of(self, chunk: int) -> int:
        """The virtual stage of this rank's ``chunk``."""
        return virtual_stage(self.rank, chunk, self.num_ranks)

    def rank_of(self, stage: int) -> int:
        """The rank holding virtual stage ``stage``."""
        return stage % self.num_ranks

    def _tag(self, kind: int, stage: int, microbatch: int) -> int:
        """One tag per message of a step: (activation or gradient, receiving stage, micro-batch)."""
        return (kind * (self.last_stage + 1) + stage) * self.num_microbatches + microbatch

    def _shape_tag(self, stage: int) -> int:
        """Tags of the shape messages, above every step message's tag."""
        return 2 * (self.last_stage + 1) * self.num_microbatches + stage

    # ------------------------------------------------------------------ the step

    def step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> StepResult:
        """Forward and backward of one batch; gradients accumulate into the chunks' ``.grad``.

        ``inputs`` are needed on the rank holding stage 0 and ``targets`` on the rank holding
        the last stage (others may pass ``None``); both are cut into m equal micro-batches.
        """
        m = self.num_microbatches
        self._inputs, self._targets = [], []
        if self.rank_of(0) == self.rank:
            if inputs is None:
                raise ValueError("the rank holding stage 0 needs the inputs")
            self._inputs = split_microbatches(inputs, m)
        if self.rank_of(self.last_stage) == self.rank:
            if targets is None:
                raise ValueError("the rank holding the last stage needs the targets")
            self._targets = split_microbatches(targets, m)
        first = (
            TensorMeta(tuple(self._inputs[0].shape), self._inputs[0].dtype)
            if self._inputs
            else None
        )
        if not self._output_meta:
            self._agree_shapes(first)
        elif first is not None and first != self._input_meta[0]:
            raise ValueError(
                f"micro-batches of {first} after the pipeline agreed on {self._input_meta[0]} at "
                "the first step: keep the batch shape fixed (drop_last=True in the DataLoader)"
            )
        self._stash, self._losses, self._pending_sends = {}, [], []
        self.recorder.clear()
        peak = 0
        # Post each action's receive one action ahead: a message that arrives while the rank
        # is still computing the previous action is there when needed (gloo moves the data
        # once both sides have posted), instead of starting to move only when asked for.
        receives = {0: self._post_incoming(self.actions[0])}
        for index, action in enumerate(self.actions):
            if index + 1 < len(self.actions):
                receives[index + 1] = self._post_incoming(self.actions[index + 1])
            labels = {
                "microbatch": action.microbatch,
                "chunk": action.chunk,
                "stage": self.stage_of(action.chunk),
            }
            received = None
            pending = receives.pop(index)
            if pending is not None:
                with self.recorder.span(WAIT, **labels):
                    work, received = pending
                    if work is not None:
                        work.wait()
            with self.recorder.span(action.kind, **labels):
                if action.kind == FORWARD:
                    outgoing = self._forward(action, received)
                else:
                    outgoing = self._backward(action, received)
            if outgoing is not None:
                with self.recorder.span(SEND, **labels):
                    self._outgoing(action, outgoing)
            peak = max(peak, len(self._stash))
        for work, _ in self._pending_sends:
            if work is not None:  # None: the send already completed
                work.wait()
        self._pending_sends = []
        loss = float(torch.stack(self._losses).sum()) if self._losses else None
        return StepResult(loss, peak, list(self.recorder.events))

    def _agree_shapes(self, first_input: TensorMeta | None) -> None:
        """Walk the virtual stages in order; each learns its input shape from its predecessor."""
        received: TensorMeta | None = first_input
        for stage in range(self.last_stage + 1):
            if self.rank_of(stage) != self.rank:
                continue
            chunk = stage // self.num_ranks
            if stage > 0:
                message = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=self.device)
                dist.recv(message, src=self.rank_of(stage - 1), tag=self._shape_tag(stage))
                received = TensorMeta.decode(message)
            assert received is not None, "stage 0 has its input's shape from the micro-batch"
            self._input_meta[chunk] = received
            self._output_meta[chunk] = infer_output_meta(self.chunks[chunk], received)
            if stage < self.last_stage:
                message = self._output_meta[chunk].encode().to(self.device)
                dist.send(message, dst=self.rank_of(stage + 1), tag=self._shape_tag(stage + 1))

    def _post_incoming(self, action: Action) -> PendingReceive | None:
        """Post the receive of what ``action`` consumes, if anything: an activation for a
        forward after stage 0, a gradient for a backward before the last stage."""
        chunk, microbatch = action.chunk, action.microbatch
        stage = self.stage_of(chunk)
        if action.kind == FORWARD:
            if stage == 0:
                return None
            return self._post_receive(self._input_meta[chunk], ACTIVATION, stage, microbatch)
        if stage == self.last_stage:
            return None
        return self._post_receive(self._output_meta[chunk], GRADIENT, stage, microbatch)

    def _outgoing(self, action: Action, tensor: torch.Tensor) -> None:
        """Send what ``action`` produced: an activation on, or an input gradient back."""
        stage = self.stage_of(action.chunk)
        if action.kind == FORWARD:
            self._send(tensor, ACTIVATION, stage + 1, action.microbatch)
        else:
            self._send(tensor, GRADIENT, stage - 1, action.microbatch)

    def _run_chunk(self, chunk: int, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint_chunks:
            return checkpoint(self.chunks[chunk], x)
        return self.chunks[chunk](x)

    # ------------------------------------------------------------------ exercise 2.5

    def _send(self, tensor: torch.Tensor, kind: int, to_stage: int, microbatch: int) -> None:
        """Start sending ``tensor`` to the rank of ``to_stage``; never wait for it here."""
        # TODO 2.5: start sending tensor to the rank holding to_stage, without waiting.
        # Invariant: this call returns before the receiver has posted its receive (a blocking
        #   send here deadlocks interleaved 1F1B); the tensor stays alive and unchanged until
        #   the send completes; the tag says which message it is.
        # Hint 1: dist.isend returns a Work; keep it (with the tensor) in self._pending_sends,
        #   step() waits for them all at the end.
        # Hint 2: payload = tensor.contiguous(); work = dist.isend(payload,
        #   dst=self.rank_of(to_stage), tag=self._tag(kind, to_stage, microbatch));
        #   self._pending_sends.append((work, payload))
        # See guidelines.md#25-pipeline-parallelism
        raise NotImplementedError(
            "TODO 2.5: start sending tensor to the rank holding to_stage, without waiting "
            "(see phase2_advanced/guidelines.md#25-pipeline-parallelism)"
        )

    def _post_receive(
        self, meta: TensorMeta, kind: int, at_stage: int, microbatch: int
    ) -> PendingReceive:
        """Post (do not wait for) the receive of the ``kind`` message for ``at_stage`` and
        ``microbatch``; returns the pending work and the buffer the data will land in."""
        # TODO 2.5: post the receive of the message (kind, at_stage, microbatch), do not wait.
        # Invariant: returns at once; the data lands in the returned buffer once the returned
        #   work completes (step() waits for it just before the action that needs it);
        #   activations come from stage at_stage - 1, gradients from stage at_stage + 1; the
        #   sender used the same tag.
        # Hint 1: allocate torch.empty(meta.shape, dtype=meta.dtype, device=self.device) and
        #   post dist.irecv into it from the rank holding the neighbouring stage.
        # Hint 2: src = self.rank_of(at_stage - 1 if kind == ACTIVATION else at_stage + 1);
        #   return dist.irecv(buffer, src=src, tag=self._tag(kind, at_stage, microbatch)), buffer
        # See guidelines.md#25-pipeline-parallelism
        raise NotImplementedError(
            "TODO 2.5: post the receive of the message (kind, at_stage, microbatch), do not wait "
            "(see phase2_advanced/guidelines.md#25-pipeline-parallelism)"
        )

    def _forward(self, action: Action, received: torch.Tensor | None) -> torch.Tensor | None:
        """One forward: run the chunk on the input, stash what the backward needs.

        ``received`` is the activation from stage - 1 (``None`` on stage 0). Returns what to
        send to stage + 1, or ``None`` on the last stage, which computes the loss instead.
        """
        chunk, microbatch = action.chunk, action.microbatch
        stage = self.stage_of(chunk)
        # TODO 2.5: run the forward of one micro-batch through one chunk.
        # Invariant: stage 0 reads self._inputs[microbatch], other stages use `received` and
        #   make it require grad; the last stage turns its output into loss_fn(output, target)
        #   / m (and appends it, detached, to self._losses) and returns None; other stages
        #   return their output detached (the message is data; the graph stays here).
        #   Afterwards self._stash[(microbatch, chunk)] holds (input, output or scaled loss).
        # Hint 1: a received tensor is a leaf with no history: without requires_grad_() autograd
        #   will not compute its .grad, which is what the previous stage waits for. Run the
        #   chunk with self._run_chunk (it checkpoints when asked).
        # Hint 2: x = self._inputs[mb] if stage == 0 else received.requires_grad_();
        #   out = self._run_chunk(chunk, x); if stage == self.last_stage: out = self.loss_fn(
        #   out, self._targets[mb]) / self.num_microbatches; self._losses.append(out.detach());
        #   self._stash[(mb, chunk)] = (x, out); return None if last stage else out.detach()
        # See guidelines.md#25-pipeline-parallelism
        raise NotImplementedError(
            "TODO 2.5: run the forward of one micro-batch through one chunk "
            "(see phase2_advanced/guidelines.md#25-pipeline-parallelism)"
        )

    def _backward(self, action: Action, received: torch.Tensor | None) -> torch.Tensor | None:
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
        #   nothing to backpropagate. Popping the stash entry frees its activations.
        # Hint 2: x, out = self._stash.pop((mb, chunk)); if out.requires_grad:
        #   torch.autograd.backward(out, received); return None if stage == 0 else x.grad
        #   (or torch.zeros_like(x) if x.grad is None: the input did not affect the output)
        # See guidelines.md#25-pipeline-parallelism
        raise NotImplementedError(
            "TODO 2.5: run the backward of one micro-batch through one chunk and free its stash "
            "(see phase2_advanced/guidelines.md#25-pipeline-parallelism)"
        )
