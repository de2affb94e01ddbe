"""The machinery around exercise 2.5's executor: one step of a pipeline rank, minus the TODOs.

Given (not an exercise). ``template_pipeline_executor.py``'s ``PipelineExecutor`` is a
:class:`PipelineRuntime` that adds the work of one action (``_forward``, ``_backward``, and for
zero-bubble schedules ``_backward_input`` and ``_backward_weight``). This module does the rest
of a step:

1. **Headers.** Every stage learns the shape and dtype of its input for this step's whole batch
   (``walk_headers`` of ``pipeline_comm``), and every rank checks that the batch cuts into m equal
   micro-batches before any data moves (a middle rank that did not would wait forever).
2. **Actions.** Each action of this rank's schedule is three parts, timed apart so that timelines
   separate compute from communication:

   * ``wait``: the receive this action needs (posted one action ahead with ``post_receive``, so
     the message can arrive during the previous compute) completes: the activation from stage
     s - 1 for a forward, the gradient from stage s + 1 for a backward (a W needs none);
   * ``forward`` / ``backward`` / ``weight``: the subclass's method for it (the exercise). A
     backward whose (micro-batch, chunk) has a W later in this rank's list is split: B runs
     ``_backward_input`` (the input's gradient, which stage s - 1 waits for) and W runs
     ``_backward_weight`` (the parameters'); any other backward runs ``_backward`` (both);
   * ``send``: what it returned goes to the neighbouring stage with ``send_tensor`` (awaited
     at the end of the step). When this rank holds that stage too (the turn
     of a V placement, ``pipeline_layout.py``) the tensor is handed over in memory instead.
3. **The result.** :class:`StepResult`: the loss (last stage), the stash's peak and what was left
   in it, and the recorded events (``course/events.py``).

The runtime calls functions of other exercises (2.5's messages, 2.3's ``checkpoint``); it does not
import them (given code never imports an answer). The executor names them in
:class:`StageFunctions`, so a template executor runs on the learner's own messages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from course.events import Event, EventRecorder
from course.tensor_header import TensorMeta
from phase2_advanced.pipeline_actions import BACKWARD, FORWARD, WEIGHT, Action
from phase2_advanced.pipeline_layout import LOOP, check_placement, stage_chunk, virtual_stage
from phase2_advanced.pipeline_links import ACTIVATION, GRADIENT, Pending, StageLinks, wait_all

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
WAIT, SEND = "wait", "send"  # events of communication, recorded apart from compute


@dataclass
class StepResult:
    """What one step did on this rank.

    loss: the batch's mean loss on the rank holding the last stage, ``None`` elsewhere.
    peak_stashed: the most (micro-batch, chunk) activations held at once: entries of the stash
        (forward done, backward not) plus entries of the weight stash (B done, W not).
    left_stashed: how many stash entries were still held when the step ended (0 when no entry
        outlived its backward).
    events: per action, a "forward", "backward" or "weight" event (labels: microbatch, chunk,
        stage), preceded by a "wait" event while its input arrives and followed by a "send"
        event when it has something to send; times from ``time.perf_counter``.
    left_weight_stashed: weight-stash entries still held when the step ended (0 when no entry
        outlived its W).
    """

    loss: float | None
    peak_stashed: int
    events: list[Event] = field(default_factory=list)
    left_stashed: int = 0
    left_weight_stashed: int = 0


@dataclass
class StepState:
    """Everything one step needs, made by ``PipelineRuntime.step`` and dropped after it.

    inputs / targets: the micro-batches (on the ranks holding the first / last stage).
    stash: ``(microbatch, chunk) -> (input, output or scaled loss)`` from a forward until its
        backward.
    weight_stash: ``(microbatch, chunk) -> (output or scaled loss, gradient of the output or
        None)`` from a split backward's B until its W: what the weights' gradients start from.
    sends: the posted sends, awaited at the end of the step.
    losses: the last stage's scaled micro-batch losses (detached).
    local: tensors handed from one of this rank's stages to another (the turn of a V), keyed by
        (ACTIVATION or GRADIENT, receiving stage, micro-batch), until that stage takes them.
    """

    inputs: list[torch.Tensor] = field(default_factory=list)
    targets: list[torch.Tensor] = field(default_factory=list)
    stash: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    weight_stash: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = field(
        default_factory=dict
    )
    sends: list[Pending] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)
    local: dict[tuple[int, int, int], torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class StageFunctions:
    """The functions of other exercises a runtime calls, from the implementation its executor
    imports (yours in the templates): 2.5's messages and 2.3's checkpoint."""

    send_tensor: Callable[[StageLinks, torch.Tensor, int, int, int], Pending]
    post_receive: Callable[[StageLinks, TensorMeta, int, int, int, torch.device], Pending]
    walk_headers: Callable[..., dict[int, TensorMeta]]
    checkpoint: Callable[..., Any]


def check_actions(actions: Sequence[Action], num_microbatches: int, num_chunks: int) -> None:
    """Refuse an action list that cannot be run: each (micro-batch, chunk) must be forwarded
    once, then backwarded once, and may have one W (weight gradients) after its backward.
    Checked before any message is sent."""
    seen: set[tuple[str, int, int]] = set()
    for action in actions:
        key = (action.kind, action.microbatch, action.chunk)
        if action.kind not in (FORWARD, BACKWARD, WEIGHT):
            raise ValueError(f"{action!r}: the kind must be forward, backward or weight")
        if not (0 <= action.microbatch < num_microbatches and 0 <= action.chunk < num_chunks):
            raise ValueError(f"{action}: outside {num_microbatches} micro-batches x {num_chunks}")
        if key in seen:
            raise ValueError(f"{action} appears twice in this rank's schedule")
        if action.kind == BACKWARD and (FORWARD, action.microbatch, action.chunk) not in seen:
            raise ValueError(f"{action} comes before its forward in this rank's schedule")
        if action.kind == WEIGHT and (BACKWARD, action.microbatch, action.chunk) not in seen:
            raise ValueError(
                f"W before B: {action} comes before its backward B{str(action)[1:]} in this "
                "rank's schedule: W computes the weights' gradients from the gradient of the "
                "output, which arrives for B"
            )
        seen.add(key)
    kinds = [kind for kind, _, _ in seen]
    needed = num_microbatches * num_chunks
    if kinds.count(FORWARD) != needed or kinds.count(BACKWARD) != needed:
        raise ValueError(
            f"this rank's schedule has {kinds.count(FORWARD)} forwards and "
            f"{kinds.count(BACKWARD)} backwards; {num_microbatches} micro-batches x "
            f"{num_chunks} chunks need {needed} of each"
        )


def check_microbatches(batch_size: int, num_microbatches: int) -> None:
    """Refuse a batch that does not cut into m equal micro-batches (every rank runs this)."""
    if batch_size % num_microbatches:
        raise ValueError(
            f"a batch of {batch_size} samples cannot be cut into {num_microbatches} equal "
            "micro-batches: equal sizes are what make the scaled micro-batch losses sum to the "
            "batch mean"
        )


def split_microbatches(batch: torch.Tensor, num_microbatches: int) -> list[torch.Tensor]:
    """``batch`` cut into m equal micro-batches along dimension 0 (ValueError otherwise)."""
    check_microbatches(batch.shape[0], num_microbatches)
    return list(batch.chunk(num_microbatches))


def infer_output_meta(module: nn.Module, meta: TensorMeta) -> TensorMeta:
    """The shape and dtype ``module`` outputs for an input described by ``meta``, computed on
    the meta device: nothing is computed, no RNG is drawn, no buffer changes.

    A module that knows its output without running asks to be trusted instead, with a method
    ``output_meta(meta) -> TensorMeta``: a chunk whose forward sends point-to-point messages
    (4.7's ring attention) cannot run on the meta device."""
    known = getattr(module, "output_meta", None)
    if callable(known):
        result = known(meta)
        assert isinstance(result, TensorMeta), type(result)
        return result
    state = {name: t.to("meta") for name, t in module.state_dict(keep_vars=True).items()}
    with torch.no_grad():
        output = functional_call(module, state, (meta.empty("meta"),))
    return TensorMeta(tuple(output.shape), output.dtype)


def _with_batch(meta: TensorMeta, batch_size: int) -> TensorMeta:
    return TensorMeta((batch_size, *meta.shape[1:]), meta.dtype)


class PipelineRuntime:
    """Runs this rank's ``actions`` over its model ``chunks`` (chunk c is virtual stage
    c·p + rank), exchanging activations and gradients with the neighbouring stages.

    The pipeline's ranks are those of ``group`` (the default group when None); p is its size
    and "rank" is this process's rank in it. ``loss_fn(output, target)`` must return the mean
    loss of a micro-batch; the executor scales it so that the m micro-batches' losses sum to the
    batch mean. With ``checkpoint_chunks`` each chunk runs through exercise 2.3's
    ``checkpoint`` (recomputed in backward).

    ``placement`` is the stage-to-rank rule the schedule was written for (``"loop"`` or
    ``"v"``, ``pipeline_layout.py``; ``pipeline_schedules.placement_of(name)`` says which).

    A subclass sets :attr:`functions` and writes ``_forward`` and ``_backward``, and for
    schedules with W actions ``_backward_input`` and ``_backward_weight`` (exercise 2.5).
    Attributes they use: ``num_microbatches`` (m), ``loss_fn``, ``last_stage`` (p·v - 1),
    ``chunks``, ``stage_of(chunk)``, and ``_run_chunk(chunk, x)``.
    """

    functions: ClassVar[StageFunctions]

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        actions: Sequence[Action],
        num_microbatches: int,
        loss_fn: LossFn = F.cross_entropy,
        checkpoint_chunks: bool = False,
        *,
        group: dist.ProcessGroup | None = None,
        placement: str = LOOP,
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
        check_placement(placement)
        self.placement = placement
        # the (micro-batch, chunk) pairs whose backward is split: B now, W later
        self.split_backward = {(a.microbatch, a.chunk) for a in self.actions if a.kind == WEIGHT}
        if checkpoint_chunks and self.split_backward:
            raise ValueError(
                "checkpoint_chunks with a schedule that has W actions: 2.3's checkpoint "
                "recomputes a chunk inside one backward that computes the input's and the "
                "weights' gradients together, so B could not leave the weights to W; "
                "checkpoint with gpipe, 1f1b or interleaved"
            )
        self.links = StageLinks.build(len(self.chunks), num_microbatches, group, placement)
        if placement != LOOP and dist.get_backend(group) == "nccl":
            # A V's link between two ranks carries activations (the way down) and gradients
            # (the way up); the receiver takes them in another order than the sender sends
            # them. gloo pairs messages by tag; NCCL ignores tags and pairs them in posting
            # order, so a receive would get the wrong message.
            raise ValueError(
                f"the {placement!r} placement on NCCL: its links carry activations and "
                "gradients in different orders at their two ends, and NCCL pairs messages in "
                "posting order (tags ignored); run it on gloo, or use torch's "
                "ScheduleZBVZeroBubble, which posts receives from the whole schedule"
            )
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
        """The virtual stage of this rank's ``chunk`` (under the executor's placement)."""
        return virtual_stage(self.rank, chunk, self.num_ranks, self.placement)

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
        batch_metas = self.functions.walk_headers(self.links, batch, self._output_meta, self.device)
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
            stage_chunk(stage, self.num_ranks, self.placement): _with_batch(meta, batch_size // m)
            for stage, meta in batch_metas.items()
        }
        return self._run(state, micro)

    def _forward(
        self, state: StepState, action: Action, received: torch.Tensor | None
    ) -> torch.Tensor | None:
        raise NotImplementedError("a PipelineRuntime subclass writes _forward (exercise 2.5)")

    def _backward(
        self, state: StepState, action: Action, received: torch.Tensor | None
    ) -> torch.Tensor | None:
        raise NotImplementedError("a PipelineRuntime subclass writes _backward (exercise 2.5)")

    def _backward_input(
        self, state: StepState, action: Action, received: torch.Tensor | None
    ) -> torch.Tensor | None:
        raise NotImplementedError(
            "a PipelineRuntime subclass writes _backward_input (exercise 2.5, zero bubble)"
        )

    def _backward_weight(self, state: StepState, action: Action) -> None:
        raise NotImplementedError(
            "a PipelineRuntime subclass writes _backward_weight (exercise 2.5, zero bubble)"
        )

    def _run_chunk(self, chunk: int, x: torch.Tensor) -> torch.Tensor:
        """This rank's ``chunk`` on ``x``, through 2.3's ``checkpoint`` when asked to."""
        if self.checkpoint_chunks:
            return self.functions.checkpoint(self.chunks[chunk], x)
        return self.chunks[chunk](x)

    def _output_meta(self, stage: int, batch_meta: TensorMeta) -> TensorMeta:
        """What ``stage`` outputs for the whole batch (``walk_headers`` sends it on)."""
        m = self.num_microbatches
        batch_size = batch_meta.shape[0]
        if batch_size % m:  # refused right after the walk, on every rank; keep the walk going
            return batch_meta
        chunk = stage_chunk(stage, self.num_ranks, self.placement)
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
        functions = self.functions

        def post_incoming(action: Action) -> Pending | tuple[int, int, int] | None:
            """The receive ``action`` waits for: a posted message, the key of a tensor another
            of this rank's stages hands over, or None (nothing to receive)."""
            stage = self.stage_of(action.chunk)
            if action.kind == FORWARD:
                if stage == 0:
                    return None
                meta, kind, sender = micro[action.chunk], ACTIVATION, stage - 1
            elif action.kind == BACKWARD:
                if stage == self.last_stage:
                    return None
                meta = self._chunk_output(action.chunk, micro[action.chunk])
                kind, sender = GRADIENT, stage + 1
            else:
                return None  # a W works on what its B kept
            if self.links.holds(sender):
                return (kind, stage, action.microbatch)
            return functions.post_receive(
                self.links, meta, kind, stage, action.microbatch, self.device
            )

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
            if isinstance(pending, tuple):
                received = self._handed_over(state, pending, action)
            elif pending is not None:
                with recorder.span(WAIT, **labels):
                    received = pending.wait()
            outgoing = None
            with recorder.span(action.kind, **labels):
                if action.kind == FORWARD:
                    outgoing = self._forward(state, action, received)
                elif action.kind == WEIGHT:
                    self._backward_weight(state, action)
                elif (action.microbatch, action.chunk) in self.split_backward:
                    outgoing = self._backward_input(state, action, received)
                else:
                    outgoing = self._backward(state, action, received)
            if outgoing is not None:
                kind = ACTIVATION if action.kind == FORWARD else GRADIENT
                to_stage = stage + 1 if action.kind == FORWARD else stage - 1
                self._check_outgoing(action, stage, to_stage)
                if self.links.holds(to_stage):
                    state.local[(kind, to_stage, action.microbatch)] = outgoing
                else:
                    with recorder.span(SEND, **labels):
                        state.sends.append(
                            functions.send_tensor(
                                self.links, outgoing, kind, to_stage, action.microbatch
                            )
                        )
            peak = max(peak, len(state.stash) + len(state.weight_stash))
        wait_all(state.sends)
        loss = float(torch.stack(state.losses).sum()) if state.losses else None
        return StepResult(
            loss,
            peak,
            list(recorder.events),
            len(state.stash),
            len(state.weight_stash),
        )

    def _handed_over(
        self, state: StepState, key: tuple[int, int, int], action: Action
    ) -> torch.Tensor:
        """The tensor another of this rank's stages handed to ``action`` (the turn of a V)."""
        if key not in state.local:
            what = "activation" if key[0] == ACTIVATION else "gradient"
            raise ValueError(
                f"{action} needs the {what} of micro-batch {key[2]} from another stage of this "
                "same rank, which its schedule has not computed yet: the action that produces "
                f"it must come earlier in this rank's list (placement {self.placement!r})"
            )
        return state.local.pop(key)

    def _check_outgoing(self, action: Action, stage: int, to_stage: int) -> None:
        """Refuse a tensor that has no stage to go to, before it is sent to a wrong rank."""
        if 0 <= to_stage <= self.last_stage:
            return
        if action.kind == FORWARD:
            raise ValueError(
                f"{action} ran on stage {stage}, the last stage (of {self.last_stage + 1}, "
                f"placement {self.placement!r}), and returned a tensor to send: the last stage "
                "computes the loss and returns None (ask self.stage_of(chunk) which stage a "
                "chunk is)"
            )
        raise ValueError(
            f"{action} ran on stage 0 and returned a gradient to send: stage 0 has no stage "
            "before it, so its backward returns None"
        )
