"""How the ranks of a pipeline reach each other: who holds each stage, the tags, pending messages.

Given (not an exercise). Exercise 2.5's messages (``template_pipeline_comm.py``: ``send_tensor``,
``post_receive``) and the executor use these:

* :class:`StageLinks`: for the pipeline's process group and placement (``pipeline_layout``),
  which GLOBAL rank holds each virtual stage (``links.peer(stage)``) and the tag of every
  message of a step (``links.tag(kind, stage, micro-batch)``), distinct for every message;
* :class:`Pending`: a posted message's work with the tensor it reads or fills, kept alive
  until the work is done; :func:`wait_all` waits for a list of them;
* the kinds of message (:data:`ACTIVATION`, :data:`GRADIENT`, :data:`HEADER`) and
  :data:`HEADER_META`, what a header's receive buffer looks like (``course/tensor_header.py``).

Peers are ranks within the pipeline's process group (the default group when ``group`` is None),
mapped once to global ranks with ``dist.get_global_rank``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from course.tensor_header import HEADER_SLOTS, TensorMeta
from phase2_advanced.pipeline_layout import LOOP, check_placement, stage_rank

ACTIVATION, GRADIENT, HEADER = 0, 1, 2  # the kinds of message; headers travel forward
HEADER_META = TensorMeta((HEADER_SLOTS,), torch.int64)  # what a header's receive buffer is


@dataclass(frozen=True)
class StageLinks:
    """How this rank reaches the stages of its pipeline: who holds each stage, and the tags.

    ``rank`` and ``num_ranks`` are within ``group``; ``peers[r]`` is the global rank of the
    group's rank r; ``num_stages`` counts virtual stages (p·v); ``placement`` is the
    stage-to-rank rule (``"loop"`` or ``"v"``, ``pipeline_layout.py``).
    """

    group: dist.ProcessGroup | None
    rank: int
    num_ranks: int
    num_stages: int
    num_microbatches: int
    peers: tuple[int, ...]
    placement: str = LOOP

    @staticmethod
    def build(
        num_chunks: int,
        num_microbatches: int,
        group: dist.ProcessGroup | None = None,
        placement: str = LOOP,
    ) -> StageLinks:
        """The links of this process in ``group`` (the default group when None)."""
        check_placement(placement)
        size = dist.get_world_size(group)
        whole = group if group is not None else dist.group.WORLD
        assert whole is not None, "the default process group is not initialised"
        peers = tuple(dist.get_global_rank(whole, r) for r in range(size))
        return StageLinks(
            group,
            dist.get_rank(group),
            size,
            size * num_chunks,
            num_microbatches,
            peers,
            placement,
        )

    @property
    def last_stage(self) -> int:
        return self.num_stages - 1

    def holds(self, stage: int) -> bool:
        """Whether this rank holds virtual stage ``stage`` (two neighbouring stages on one rank,
        the turn of a V, hand their tensors over without a message)."""
        return stage_rank(stage, self.num_ranks, self.placement) == self.rank

    def peer(self, stage: int) -> int:
        """The GLOBAL rank of the process holding virtual stage ``stage``."""
        return self.peers[stage_rank(stage, self.num_ranks, self.placement)]

    def tag(self, kind: int, stage: int, microbatch: int) -> int:
        """The tag of one message of a step, from its kind (ACTIVATION, GRADIENT or HEADER), a
        stage and its micro-batch (0 for a header): distinct for every (kind, stage,
        micro-batch) of a step. Both ends of a message must name the same three."""
        return (kind * self.num_stages + stage) * self.num_microbatches + microbatch


@dataclass
class Pending:
    """A posted message: its work (None when it completed at once) and its tensor, kept alive
    until the work is done."""

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
