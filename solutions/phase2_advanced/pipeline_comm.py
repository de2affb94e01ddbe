"""Exercise 2.5 (messages): what pipeline stages send each other, over point-to-point messages.

Two kinds of message cross a stage boundary in a step: the activation of a micro-batch, forward
from stage s to stage s + 1, and the gradient of that activation, back from s + 1 to s. The
executor (``pipeline_executor.py``) decides *when*; this module says *how*, under three rules:

* **A send returns before its receiver has posted the matching receive.** Two neighbours that
  both send first would otherwise wait for each other forever (1F1B when receives are posted
  only when needed: rank 0 sends activation 1 while rank 1 sends gradient 0; interleaved 1F1B
  even with receives posted one action ahead). The tensor being sent must stay alive and
  unchanged until the executor waits for it at the end of the step.
* **A receive returns at once** too: the data lands in its buffer while the rank computes, and
  the executor waits just before the action that needs it.
* **Both ends name the same message.** ``StageLinks.tag`` gives every message of a step its own
  tag, and ``StageLinks.peer`` the global rank holding a stage. (gloo matches by source and tag;
  NCCL ignores tags and matches in posting order, which the schedules keep the same at both
  ends of every link.)

**Headers first.** Before the data of a step, a header (``course/tensor_header.py``, the one
format exercise 2.4 uses too) walks the stages in order with the shape and dtype of the *whole
batch* at each boundary, so every stage knows its buffers, and every rank, not only the ones
holding the batch, can check that the batch splits into m equal micro-batches before any data
moves.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from course.tensor_header import TensorMeta, decode_header, encode_header
from phase2_advanced.pipeline_links import (
    ACTIVATION,
    GRADIENT,
    HEADER,
    HEADER_META,
    Pending,
    StageLinks,
    wait_all,
)

__all__ = ["ACTIVATION", "GRADIENT", "HEADER", "HEADER_META", "Pending", "StageLinks", "wait_all"]

# ----------------------------------------------------------------------------- exercise 2.5


def send_tensor(
    links: StageLinks, tensor: torch.Tensor, kind: int, to_stage: int, microbatch: int
) -> Pending:
    """Start sending ``tensor`` (an activation, a gradient or a header) to the rank holding
    ``to_stage``, without waiting; the caller keeps what this returns until the send has
    completed."""
    # TODO 2.5: start sending tensor to the rank holding to_stage, without waiting for it.
    # Invariant: returns before the receiver has posted its receive (a blocking send here
    #   deadlocks interleaved 1F1B); the returned Pending holds the very tensor being sent,
    #   so it stays alive and unchanged until the send completes; the receiver finds the
    #   message by its peer and tag, so both ends must name the same ones.
    # Hint 1: links (given, pipeline_links.py) knows the global rank holding each stage and the
    #   tag of every message of a step.
    # Hint 2: Which of torch's sends returns before the receiver has posted its receive, and what
    #   does it give back to wait on later? Which tensor must the Pending hold so that it stays
    #   alive and unchanged until the send completes? In which numbering does torch's dst count
    #   when a group is given? Which stage's number goes into the tag, here and at the receiver?
    # Hint 3: dist.isend returns at once with a Work; dist.send waits for the receiver. The payload
    #   is made contiguous first, and that same tensor goes into the send and into the Pending.
    # Hint 4: dst is the global rank holding to_stage (links.peer), on the pipeline's group
    #   (links.group); the tag names the receiving stage, to_stage, as the receiver's does.
    # Hint 5: dist.isend of the contiguous payload to links.peer of to_stage, on links.group,
    #   tagged links.tag of (kind, to_stage, microbatch); return the Pending of that work and
    #   that same payload.
    # See guidelines.md#25-pipeline-parallelism
    # >>> solution
    payload = tensor.contiguous()
    work = dist.isend(
        payload,
        dst=links.peer(to_stage),
        group=links.group,
        tag=links.tag(kind, to_stage, microbatch),
    )
    return Pending(work, payload)
    # <<< solution


def post_receive(
    links: StageLinks,
    meta: TensorMeta,
    kind: int,
    at_stage: int,
    microbatch: int,
    device: torch.device,
) -> Pending:
    """Post (do not wait for) the receive of the ``kind`` message of ``microbatch`` for stage
    ``at_stage`` of this rank, into a new buffer described by ``meta``. Gradients come from the
    stage after; activations and headers from the stage before."""
    # TODO 2.5: post the receive of the message (kind, at_stage, microbatch); do not wait.
    # Invariant: returns at once; the data lands in the returned Pending's tensor once its
    #   work completes (the executor waits just before the action that needs it); the buffer
    #   has exactly the message's shape and dtype; the peer and the tag are the ones the
    #   sender of this message used.
    # Hint 1: meta describes the message (its shape and dtype); the docstring says which
    #   neighbour sends each kind.
    # Hint 2: Which of torch's receives returns at once? What must the buffer be for the message to
    #   fit it exactly? Which stage sends each kind of message here, and which rank holds it, in
    #   the numbering src uses? The sender tagged the message with the stage that receives it:
    #   which stage is that here?
    # Hint 3: The buffer is meta's empty tensor on device (TensorMeta.empty): the shape and dtype
    #   the header announced.
    # Hint 4: The sender is at_stage + 1 for a GRADIENT and at_stage − 1 for the other kinds; src
    #   is its global rank, links.peer of it; the tag names at_stage, the receiving stage, as
    #   the sender's did.
    # Hint 5: dist.irecv into that buffer from links.peer of the sending stage, on links.group,
    #   tagged links.tag of (kind, at_stage, microbatch); return the Pending of the work and the
    #   buffer.
    # See guidelines.md#25-pipeline-parallelism
    # >>> solution
    buffer = meta.empty(device)
    neighbour = at_stage + 1 if kind == GRADIENT else at_stage - 1
    work = dist.irecv(
        buffer,
        src=links.peer(neighbour),
        group=links.group,
        tag=links.tag(kind, at_stage, microbatch),
    )
    return Pending(work, buffer)
    # <<< solution


# ----------------------------------------------------------------------------- the headers


def walk_headers(
    links: StageLinks,
    batch: TensorMeta | None,
    output_meta: Callable[[int, TensorMeta], TensorMeta],
    device: torch.device,
) -> dict[int, TensorMeta]:
    """Tell every stage what its input looks like for this step's whole batch.

    The stages are walked in order: stage 0's rank knows ``batch`` (the inputs' meta); every
    stage this rank holds receives its input's meta from the stage before, and sends
    ``output_meta(stage, input_meta)`` to the stage after. Returns ``{stage: input meta}`` for
    the stages this rank holds. One small message per boundary between two ranks, sent and
    received with :func:`send_tensor` and :func:`post_receive` (kind HEADER), and waited for
    before returning, so nothing is left in flight; where both stages of a boundary are on this
    rank (the turn of a V placement) the meta is handed over without a message.
    """
    metas: dict[int, TensorMeta] = {}
    sent: list[Pending] = []
    for stage in range(links.num_stages):
        if not links.holds(stage):
            continue
        if stage == 0:
            if batch is None:
                raise ValueError("the rank holding stage 0 needs the batch's inputs")
            meta = batch
        elif links.holds(stage - 1):
            meta = output_meta(stage - 1, metas[stage - 1])
        else:
            received = post_receive(links, HEADER_META, HEADER, stage, 0, device)
            meta = decode_header(received.wait())
        metas[stage] = meta
        if stage < links.last_stage and not links.holds(stage + 1):
            message = encode_header(output_meta(stage, meta), device)
            sent.append(send_tensor(links, message, HEADER, stage + 1, 0))
    wait_all(sent)
    return metas
