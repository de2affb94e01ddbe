# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase3.py
"""Exercise 3.4, part 2: ``DistributedDataParallel`` from scratch, a drop-in for torch's.

Phase 1 averaged the gradients after ``backward()`` returned: the network sat idle during
backward, then the processors sat idle during the all-reduce. torch's DDP overlaps the two (Li et
al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020; the
C++ ``Reducer`` in torch/csrc/distributed/c10d/reducer.cpp). So does this module:

1. **Construction** (given, :class:`~phase3_multi_node.ddp_support.DDPBase`): rank 0's
   parameters and buffers are broadcast; the trainable parameters are packed into buckets with
   your :func:`assign_buckets`; a post-accumulate-grad hook on each calls :meth:`_mark_ready`.
2. **During backward** (yours: :meth:`_mark_ready`): each time a parameter's gradient is in
   ``.grad``, the hook tells you; the buckets' all-reduces must run while backward goes on
   computing earlier layers.
3. **When backward ends** (the callback is given, the work is yours: :meth:`_finish_reduction`):
   when ``loss.backward()`` returns every ``.grad`` holds the average over the group, so an
   ordinary training loop works unchanged.

The contract of each method, and the questions whose answers are its design, are in
guidelines.md#34-ddp-from-scratch. phase3_multi_node/ddp_support.py documents the given part:
communication hooks, unused and tied parameters, what differs from torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from phase3_multi_node.ddp_support import DDPBase
from phase3_multi_node.template_ddp_buckets import assign_buckets, bucket_size_limits


class DistributedDataParallel(DDPBase):
    """Data parallelism with bucketed all-reduces that overlap backward, like torch's DDP.

    Args:
        module: the model, replicated on every rank of ``group``.
        bucket_cap_mb: bucket size in MiB; None is torch's default (25 MiB, and 1 MiB for the
            first bucket, the one backward fills first).
        group: the data-parallel group (None: the default group).
        find_unused_parameters: allow parameters that get no gradient in a backward (they count
            as zero; one that no rank used keeps its ``.grad`` untouched, like torch). Without
            it such a parameter is an error naming it.
        gradient_as_bucket_view: after backward each ``.grad`` is a view into its bucket (no
            copy back, no second copy of the gradients in memory).
        broadcast_buffers: broadcast the buffers from rank 0 before every forward (torch's
            default), so e.g. BatchNorm's running statistics stay equal.

    ``module`` is an attribute, so ``state_dict()`` keys start with ``module.`` as torch's do.
    What you use of the given base (``DDPBase``): ``self.buckets`` (in launch order; each has
    ``params``, ``slot(position)``, ``pending``, ``work``), ``self.params``, ``self._locate``,
    ``self._next_bucket``, ``self._launch(bucket)``, ``self._copy_factor``,
    ``self.gradient_as_bucket_view`` and ``self.require_backward_grad_sync``.
    """

    def __init__(
        self,
        module: nn.Module,
        bucket_cap_mb: float | None = None,
        group: dist.ProcessGroup | None = None,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        broadcast_buffers: bool = True,
    ) -> None:
        super().__init__(
            module,
            bucket_size_limits(bucket_cap_mb),  # refuses a negative cap
            assign_buckets,
            group=group,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
            broadcast_buffers=broadcast_buffers,
        )

    def _mark_ready(self, index: int) -> None:
        """``params[index].grad`` holds this backward's gradient (None: this rank did not use
        the parameter); start every all-reduce that may start now.

        ``self._locate[index]`` is (bucket, position in it); ``bucket.slot(position)`` is the
        slot; ``bucket.pending`` counts the gradients still to come; ``self._next_bucket`` is
        the first bucket not launched yet; ``bucket.work`` keeps the all-reduce's handle.
        """
        # TODO 3.4: one gradient is in .grad: take it into its bucket, start what may start
        # Invariant: over one backward every bucket's all-reduce starts once, through
        #   self._launch, on every rank in bucket order whatever order the gradients arrive in,
        #   as early as that order allows; nothing waits while backward runs; no value the
        #   all-reduce sums may overflow where the average fits (fp16).
        # Hint 1: collectives pair by the order each rank issues them, and one rank may see
        #   bucket 2's gradients before bucket 1's (a layer it did not use).
        # More hints: uv run python -m tests.hint 3.4
        # See guidelines.md#34-ddp-from-scratch
        raise NotImplementedError(
            "TODO 3.4: one gradient is in .grad: take it into its bucket, start what may start "
            "(see phase3_multi_node/guidelines.md#34-ddp-from-scratch)"
        )

    def _finish_reduction(self) -> None:
        """Wait for every bucket's all-reduce, put the averages in ``.grad``, reset the state
        of this backward so the next one starts afresh."""
        # TODO 3.4: backward is over: every .grad gets the group's average, ready for the next
        # Invariant: when backward returns every .grad holds the group's average (with
        #   gradient_as_bucket_view the bucket slot itself, otherwise a tensor of its own); the
        #   next backward finds the buckets and self._next_bucket as this one found them.
        # Hint 1: what did _mark_ready change during this backward?
        # More hints: uv run python -m tests.hint 3.4
        # See guidelines.md#34-ddp-from-scratch
        raise NotImplementedError(
            "TODO 3.4: backward is over: every .grad gets the group's average, ready for the next "
            "(see phase3_multi_node/guidelines.md#34-ddp-from-scratch)"
        )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, backward only accumulates into ``.grad``; the first backward of a forward run
        outside all-reduces the accumulated sum (torch's ``DistributedDataParallel.no_sync``)."""
        # TODO 3.4: inside the block, backwards do not synchronize
        # Invariant: forwards run inside the block build backwards that do not communicate;
        #   after the block synchronization is as it was before it, also when the block raises
        #   and when it is nested in another no_sync.
        # Hint 1: forward reads self.require_backward_grad_sync to decide.
        # More hints: uv run python -m tests.hint 3.4
        # See guidelines.md#34-ddp-from-scratch
        raise NotImplementedError(
            "TODO 3.4: inside the block, backwards do not synchronize "
            "(see phase3_multi_node/guidelines.md#34-ddp-from-scratch)"
        )
