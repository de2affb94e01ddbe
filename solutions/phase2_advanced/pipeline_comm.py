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
* **Tag every message.** The tag names (kind, receiving stage, micro-batch), so no two messages
  of a step share one and the receiver asks for exactly the message it means. (gloo matches by
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

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from course.tensor_header import HEADER_SLOTS, TensorMeta, decode_header, encode_header
from phase2_advanced.pipeline_layout import stage_rank

ACTIVATION, GRADIENT, HEADER = 0, 1, 2  # the kinds of message; headers travel forward
HEADER_META = TensorMeta((HEADER_SLOTS,), torch.int64)  # what a header's receive buffer is


@dataclass(frozen=True)
class StageLinks:
    """How this rank reaches the stages of its pipeline: who holds each stage, and the tags.

    ``rank`` and ``num_ranks`` are within ``group``; ``peers[r]`` is the global rank of the
    group's rank r; ``num_stages`` counts virtual stages (p·v).
    """

    group: dist.ProcessGroup | None
    rank: int
    num_ranks: int
    num_stages: int
    num_microbatches: int
    peers: tuple[int, ...]

    @staticmethod
    def build(
        num_chunks: int, num_microbatches: int, group: dist.ProcessGroup | None = None
    ) -> StageLinks:
        """The links of this process in ``group`` (the default group when None)."""
        size = dist.get_world_size(group)
        whole = group if group is not None else dist.group.WORLD
        assert whole is not None, "the default process group is not initialised"
        peers = tuple(dist.get_global_rank(whole, r) for r in range(size))
        return StageLinks(
            group, dist.get_rank(group), size, size * num_chunks, num_microbatches, peers
        )

    @property
    def last_stage(self) -> int:
        return self.num_stages - 1

    def holds(self, stage: int) -> bool:
        """Whether this rank holds virtual stage ``stage``."""
        return stage_rank(stage, self.num_ranks) == self.rank

    def peer(self, stage: int) -> int:
        """The GLOBAL rank of the process holding virtual stage ``stage``: give it to dst/src."""
        return self.peers[stage_rank(stage, self.num_ranks)]

    def tag(self, kind: int, stage: int, microbatch: int) -> int:
        """The tag of one message of a step: (ACTIVATION, GRADIENT or HEADER, the stage that
        receives it, micro-batch; 0 for a header). Distinct for every message of a step."""
        return (kind * self.num_stages + stage) * self.num_microbatches + microbatch


@dataclass
class Pending:
    """A posted ``isend``/``irecv``: its work (None when it completed at once) and its tensor,
    kept alive until the work is done."""

    work: dist.Work | None
    tensor: torch.Tensor

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.tensor


def wait_all(pending: Sequence[Pending]) -> None:
    """Wait until every posted operation in ``pending`` has completed."""
    for item in pending:
        item.wait()


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
    #   so it stays alive and unchanged until the send completes; the tag is
    #   links.tag(kind, to_stage, microbatch), the one the receiver asks for.
    # Hint 1: dist.isend returns a Work at once; torch's dst= is a GLOBAL rank (links.peer
    #   gives it) and group= is the pipeline's group (links.group).
    # Hint 2: make the payload contiguous first (the same tensor goes into isend and into the
    #   Pending you return); the peer is the holder of the receiving stage; the tag names
    #   the receiving stage too.
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
    #   work completes (the executor waits just before the action that needs it);
    #   gradients come from stage at_stage + 1, activations and headers from stage
    #   at_stage - 1; the tag is the one the sender used: links.tag(kind, at_stage, microbatch).
    # Hint 1: allocate the buffer from meta (meta.empty(device)) and post dist.irecv into it
    #   from the rank holding the neighbouring stage (a global rank: links.peer), on
    #   links.group.
    # Hint 2: the neighbour depends on the kind: the stage after for a GRADIENT, the stage
    #   before for anything else. The tag names at_stage, the receiving stage, not the
    #   neighbour. Return the work and the buffer together.
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
    the stages this rank holds. One small message per boundary, sent and received with
    :func:`send_tensor` and :func:`post_receive` (kind HEADER), and waited for before returning,
    so nothing is left in flight.
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
        else:
            received = post_receive(links, HEADER_META, HEADER, stage, 0, device)
            meta = decode_header(received.wait())
        metas[stage] = meta
        if stage < links.last_stage:
            message = encode_header(output_meta(stage, meta), device)
            sent.append(send_tensor(links, message, HEADER, stage + 1, 0))
    wait_all(sent)
    return metas
