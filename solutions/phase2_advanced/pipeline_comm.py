"""Exercise 2.5 (messages): what pipeline stages send each other, over point-to-point messages.

Two kinds of message cross a stage boundary in a step: the activation of a micro-batch, forward
from stage s to stage s + 1, and the gradient of that activation, back from s + 1 to s. The
executor (``pipeline_executor.py``) decides *when*; this module says *how*:

* **Never block on a send.** A gloo ``dist.send`` returns only once the receiver has posted the
  matching receive, so two neighbours that both send first wait for each other forever (1F1B
  when receives are posted only when needed: rank 0 sends activation 1 while rank 1 sends
  gradient 0; interleaved 1F1B even with receives posted one action ahead). Every send is an
  ``isend``; the tensor it reads must stay alive and unchanged until the executor waits for it
  at the end of the step.
* **Post receives early.** ``irecv`` returns at once; the data lands in the buffer while the rank
  computes, and the executor waits just before the action that needs it.
* **Tag every message.** ``StageLinks.tag`` gives every message of a step its own tag, so the
  receiver asks for exactly the message it means. (gloo matches by
  source and tag; NCCL ignores tags and matches in posting order, which the schedules keep the
  same at both ends of every link.)
* **Headers first.** Before the data of a step, a header (``course/tensor_header.py``,
  the one format exercise 2.4 uses too) walks the stages in order with the shape and dtype of the
  *whole batch* at each boundary, so every stage knows its buffers, and every rank, not only
  the ones holding the batch, can check that the batch splits into m equal micro-batches before
  any data moves.

Peers are ranks within the pipeline's process group (the default group when ``group`` is None),
mapped once to global ranks with ``dist.get_global_rank``: torch's ``dst``/``src`` are global.
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
    # Hint 1: torch has a send that returns at once with a Work to wait on later. links (given,
    #   pipeline_links.py) knows who holds a stage and how a message of a step is tagged.
    # Hint 2: make the payload contiguous first (the same tensor goes into the send and into
    #   the Pending you return); the peer is the holder of the receiving stage, as a global
    #   rank; the tag names the receiving stage too; the group is the pipeline's.
    # Hint 3: dist.isend of the contiguous payload, its dst the global rank links.peer gives
    #   for to_stage, its group links.group, its tag links.tag of (kind, to_stage,
    #   microbatch); Pending pairs the work with that same payload.
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
    # Hint 1: meta describes the buffer (TensorMeta.empty). Gradients travel backward, from the
    #   stage after; activations and headers travel forward, from the stage before.
    # Hint 2: allocate the buffer; pick the neighbouring stage by the kind; post a receive
    #   that returns at once from the rank holding that stage (a global rank), on the
    #   pipeline's group, with the tag of (kind, the RECEIVING stage, micro-batch), not the
    #   neighbour's; return the work and the buffer together.
    # Hint 3: the buffer is meta's empty tensor on `device`; the neighbour is at_stage + 1 for
    #   a GRADIENT and at_stage − 1 for the other kinds; dist.irecv into the buffer from
    #   links.peer of the neighbour, on links.group, tagged links.tag of (kind, at_stage,
    #   microbatch): the receiving stage's tag, the one the sender used.
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
