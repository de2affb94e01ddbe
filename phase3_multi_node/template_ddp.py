# Exercise template (made by course/template_maker.py; this copy is yours to edit).
# Replace every `raise NotImplementedError(...)` with your code; the comments above each
# one say what to build. Grade yourself: uv run pytest tests/test_phase3.py
"""Exercise 3.4, part 2: ``DistributedDataParallel`` from scratch, a drop-in for torch's.

Phase 1 averaged the gradients after ``backward()`` returned: the network sat idle during
backward, then the processors sat idle during the all-reduce. torch's DDP overlaps the two (Li et
al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020; the
C++ ``Reducer`` in torch/csrc/distributed/c10d/reducer.cpp). So does this module:

1. **Construction**: every parameter and buffer is broadcast from rank 0 of the group, so all
   replicas start equal; the parameters that need gradients are packed into buckets
   (:func:`assign_buckets`: reverse registration order, closed at ``bucket_cap_mb``); a hook is
   registered on each with ``Tensor.register_post_accumulate_grad_hook``.
2. **During backward**: when a parameter's gradient has been accumulated into ``.grad``, its hook
   copies it, multiplied by 1/world, into its slot of the bucket's flat buffer. When a bucket's
   last slot is filled (and every earlier bucket has been launched), its all-reduce starts with
   ``dist.all_reduce(buffer, async_op=True)`` while backward goes on computing earlier layers.
3. **When backward ends**: a callback queued on the autograd engine (``Variable._execution_engine
   .queue_callback``, as torch's DDP does) waits for every bucket's all-reduce and writes the
   averages back into ``.grad`` (or points ``.grad`` at the bucket itself:
   ``gradient_as_bucket_view=True``). So when ``loss.backward()`` returns, every ``.grad`` holds
   the average over the group: an ordinary training loop works unchanged.

Why divide *before* the sum: the sum of n gradients can overflow fp16 (max 65504) where the
average does not; torch multiplies by 1/world while copying into the bucket (reducer.cpp,
``mark_variable_ready_dense``). Why launch buckets *in order*: collectives are matched by the
order they are issued on each rank, so every rank must issue them in the same order, whatever
order its gradients arrive in.

Communication hooks (torch's ``register_comm_hook``, the seam phase 4's compression uses): a
hook ``hook(state, bucket) -> torch.futures.Future[Tensor]`` replaces a bucket's all-reduce. As in
torch's Reducer, the bucket then holds the raw local gradients (the hook divides, e.g.
``default_hooks.fp16_compress_hook`` casts, divides by the world and all-reduces), and the
tensor the future returns is what the bucket's parameters receive. torch's own hooks
(``default_hooks``, ``powerSGD_hook``) run unchanged on this class: :class:`HookBucket` offers
the methods of ``dist.GradBucket`` they call.

Differences from torch, on purpose: torch's first iteration uses one bucket and rebuilds the
buckets afterwards in the order the gradients arrived; here the buckets are formed at
construction in reverse registration order, which is what torch ends with whenever gradients
arrive in that order (any chain of layers). With ``find_unused_parameters=True`` torch finds
unused parameters by walking the autograd graph in ``forward`` and keeps its initial buckets;
here parameters without a gradient are marked ready when backward ends. Values are the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from phase3_multi_node.template_ddp_buckets import assign_buckets, bucket_size_limits


@dataclass
class Bucket:
    """One bucket: which parameters it holds, where each sits in its flat buffer, and its state
    during the current backward (``pending`` gradients still to come, the all-reduce ``work``).
    """

    index: int
    params: list[int]  # indices into DistributedDataParallel.params, in bucket order
    names: list[str]
    shapes: list[torch.Size]
    offsets: list[int]  # element offset of each parameter in ``buffer``
    buffer: torch.Tensor  # flat, one dtype: what is all-reduced
    pending: int = 0  # gradients not yet copied in during this backward
    work: Any = None  # the dist.Work of this backward's all-reduce, None before its launch
    numels: list[int] = field(default_factory=list)

    def slot(self, position: int) -> torch.Tensor:
        """The part of ``buffer`` that holds ``params[position]``, shaped like that parameter."""
        start = self.offsets[position]
        return self.buffer[start : start + self.numels[position]].view(self.shapes[position])

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


class HookBucket:
    """What a communication hook sees of a bucket: the methods of torch's ``dist.GradBucket``
    (torch/csrc/distributed/c10d/comm.hpp) that torch's hooks call."""

    def __init__(self, bucket: Bucket, params: Sequence[torch.Tensor], is_last: bool) -> None:
        self._bucket, self._params, self._is_last = bucket, params, is_last

    def index(self) -> int:
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        """The flat buffer of the bucket's gradients (not divided by the world)."""
        return self._bucket.buffer

    def gradients(self) -> list[torch.Tensor]:
        """One view into :meth:`buffer` per parameter, shaped like it (writes land in the
        buffer, as PowerSGD's decompression expects)."""
        return [self._bucket.slot(k) for k in range(len(self._bucket.params))]

    def parameters(self) -> list[torch.Tensor]:
        return [self._params[i] for i in self._bucket.params]

    def is_last(self) -> bool:
        """True for the bucket launched last in a backward (hooks count iterations on it)."""
        return self._is_last

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._bucket.buffer.copy_(tensor)


class _HookWork:
    """A hook's future behind ``dist.Work``'s ``wait()``: its result lands in the bucket."""

    def __init__(self, future: torch.futures.Future[Any], bucket: Bucket) -> None:
        self.future, self.bucket = future, bucket

    def wait(self) -> bool:
        result = self.future.wait()
        if isinstance(result, list):  # a hook may return the all-reduce future's [tensor]
            result = result[0]
        if result.data_ptr() != self.bucket.buffer.data_ptr():
            self.bucket.buffer.copy_(result.view(-1))
        return True


def _global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


class DistributedDataParallel(nn.Module):
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
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        if not dist.is_initialized():
            raise RuntimeError("call dist.init_process_group (or setup_distributed()) first")
        limits = bucket_size_limits(bucket_cap_mb)  # refuses a negative cap
        if dist.get_rank(group) < 0:
            raise ValueError(
                f"rank {dist.get_rank()} is not a member of the group it was given: build DDP "
                "on the ranks of the group only"
            )
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(
                "the module has no parameter that requires a gradient: there is nothing to "
                "average, so DistributedDataParallel is not needed"
            )
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.broadcast_buffers = broadcast_buffers
        self.require_backward_grad_sync = True  # no_sync() turns it off (torch's name)
        self.params = [p for _, p in named]  # named_parameters() lists a tied weight once
        self.param_names = [name for name, _ in named]
        self._sync_module_states()
        self.buckets = self._build_buckets(limits)
        self._locate: list[tuple[Bucket, int]] = [(self.buckets[0], 0)] * len(self.params)
        for bucket in self.buckets:
            for position, index in enumerate(bucket.params):
                self._locate[index] = (bucket, position)
        self._next_bucket = 0  # the first bucket whose all-reduce is not launched yet
        self._comm_hook: Any = None  # register_comm_hook's hook and state
        self._comm_state: Any = None
        self._grad_ready = [False] * len(self.params)
        self._expect_hooks = False  # set by forward: the next backward synchronizes
        self._callback_queued = False
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(self._make_hook(index))
            for index, p in enumerate(self.params)
        ]

    # ----------------------------------------------------------------- construction (given)

    def _sync_module_states(self) -> None:
        """Every parameter (frozen ones too) and buffer takes the values of group rank 0's."""
        source = _global_rank(self.group, 0)
        with torch.no_grad():
            for tensor in [*self.module.parameters(), *self.module.buffers()]:
                dist.broadcast(tensor.detach(), src=source, group=self.group)

    def _build_buckets(self, limits: list[int]) -> list[Bucket]:
        sizes = [p.numel() * p.element_size() for p in self.params]
        kinds = [(p.dtype, p.device) for p in self.params]
        groups = assign_buckets(sizes, limits, kinds)
        placed = sorted(index for members in groups for index in members)
        if placed != list(range(len(self.params))):
            raise RuntimeError(
                f"assign_buckets placed the parameter indices {placed}; expected each of "
                f"0..{len(self.params) - 1} exactly once"
            )
        buckets = []
        for number, members in enumerate(groups):
            if len({kinds[i] for i in members}) != 1:
                mixed = sorted({str(kinds[i][0]) for i in members})
                raise RuntimeError(f"assign_buckets put dtypes {mixed} in bucket {number}")
            numels = [self.params[i].numel() for i in members]
            offsets = [sum(numels[:k]) for k in range(len(numels))]
            first = self.params[members[0]]
            buckets.append(
                Bucket(
                    index=number,
                    params=list(members),
                    names=[self.param_names[i] for i in members],
                    shapes=[self.params[i].shape for i in members],
                    offsets=offsets,
                    buffer=torch.zeros(sum(numels), dtype=first.dtype, device=first.device),
                    pending=len(members),
                    numels=numels,
                )
            )
        return buckets

    def _make_hook(self, index: int) -> Any:
        def hook(_param: torch.Tensor) -> None:
            self._on_grad_ready(index)

        return hook

    # ----------------------------------------------------------------- communication (given)

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """Replace every bucket's all-reduce by ``hook(state, bucket) -> Future[Tensor]``, as
        torch's ``DistributedDataParallel.register_comm_hook`` does; once, before training."""
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook may only be called once (as in torch's DDP)")
        if self._next_bucket or any(b.work is not None for b in self.buckets):
            raise RuntimeError("register_comm_hook must be called before a backward, not during")
        if not callable(hook):
            raise TypeError(f"hook must be callable (state, bucket) -> Future, got {hook!r}")
        self._comm_state, self._comm_hook = state, hook

    @property
    def _copy_factor(self) -> float:
        """What a gradient is multiplied by on its way into its bucket: 1/world, so the sum is
        the average; 1 when a communication hook is registered (the hook divides, as torch's
        Reducer leaves it to the hook)."""
        return 1.0 if self._comm_hook is not None else 1.0 / self.world_size

    def _launch(self, bucket: Bucket) -> Any:
        """Start the bucket's all-reduce without waiting: ``dist.all_reduce(async_op=True)`` on
        the group, or the registered hook. Returns something with ``wait()``."""
        if self._comm_hook is None:
            return dist.all_reduce(bucket.buffer, async_op=True, group=self.group)
        view = HookBucket(bucket, self.params, is_last=bucket.index == len(self.buckets) - 1)
        return _HookWork(self._comm_hook(self._comm_state, view), bucket)

    # ----------------------------------------------------------------- forward (given)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the module; the next backward averages the gradients unless under no_sync()."""
        if self.broadcast_buffers and self.world_size > 1:
            source = _global_rank(self.group, 0)
            with torch.no_grad():
                for buffer in self.module.buffers():
                    dist.broadcast(buffer, src=source, group=self.group)
        # like torch (prepare_for_backward): a forward with grad on, outside no_sync(), arms the
        # hooks until the end of the next backward; other forwards leave them as they are
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self._expect_hooks = True
        return self.module(*inputs, **kwargs)

    # ----------------------------------------------------------------- backward

    def _on_grad_ready(self, index: int) -> None:
        """Hook of ``params[index]``: its gradient for this backward is now in ``.grad``."""
        if not self._expect_hooks:
            return  # forward ran under no_sync() (or without grad): accumulate locally only
        if self._grad_ready[index]:
            raise RuntimeError(
                f"parameter {self.param_names[index]!r} was reported ready twice in one "
                "backward: is its hook registered twice (a tied weight listed twice)?"
            )
        self._grad_ready[index] = True
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)
        self._mark_ready(index)

    def _mark_ready(self, index: int) -> None:
        """Copy ``params[index].grad`` (None counts as zeros), divided by the group size, into
        its bucket slot; launch every bucket, in bucket order, whose slots are all filled.

        ``self._locate[index]`` is (bucket, position in it); ``bucket.slot(position)`` is the
        slot; ``bucket.pending`` counts the gradients still to come; ``self._next_bucket`` is
        the first bucket not launched yet; ``bucket.work`` keeps the all-reduce's handle.
        """
        # TODO 3.4: copy the gradient into its bucket (divided by the world) and launch buckets.
        # Invariant: a bucket's all-reduce starts (async, through self._launch) as soon as its
        #   last gradient is in and every earlier bucket has started, never later (overlap) and
        #   never out of bucket order; each bucket is all-reduced once per backward.
        # Hint 1: divide while copying (torch.mul(grad, self._copy_factor, out=slot): 1/world),
        #   not after the sum: n fp16 gradients can overflow when summed, their average cannot.
        # More hints: uv run python -m tests.hint 3.4
        # See guidelines.md#34-ddp-from-scratch
        raise NotImplementedError(
            "TODO 3.4: copy the gradient into its bucket (divided by the world) and launch buckets "
            "(see phase3_multi_node/guidelines.md#34-ddp-from-scratch)"
        )

    def _finalize_backward(self) -> None:
        """Queued on the autograd engine by the first hook of a backward; runs as it ends."""
        self._callback_queued = False
        self._expect_hooks = False
        missing = [i for i, ready in enumerate(self._grad_ready) if not ready]
        self._grad_ready = [False] * len(self.params)
        if missing and not self.find_unused_parameters:
            names = ", ".join(repr(self.param_names[i]) for i in missing)
            raise RuntimeError(
                f"parameters {names} received no gradient in this backward (not used to compute "
                "the loss), so their buckets can never be all-reduced. Pass "
                "find_unused_parameters=True if the model leaves parameters unused, or make "
                "every output of forward take part in the loss"
            )
        for index in missing:
            self._mark_ready(index)  # counts as a zero gradient, like torch
        kept: dict[int, torch.Tensor | None] = {}
        if self.find_unused_parameters:
            # after every bucket was launched, so all ranks issue collectives in one order;
            # torch leaves the .grad of a parameter that no rank used untouched
            kept = {i: self.params[i].grad for i in self._unused_everywhere(missing)}
        silent = [bucket for bucket in self.buckets if bucket.work is None]
        if silent:
            bucket = silent[0]
            raise RuntimeError(
                f"backward is over but bucket {bucket.index} ({', '.join(bucket.names)}) was "
                "never all-reduced (its work is None): _mark_ready must launch a bucket's "
                "all-reduce with async_op=True as soon as its last gradient is in and keep the "
                "returned work on the bucket; _finish_reduction must reset the state of a "
                "backward (pending counts, works, self._next_bucket) for the next one"
            )
        self._finish_reduction()
        for index, grad in kept.items():
            self.params[index].grad = grad

    def _unused_everywhere(self, missing: list[int]) -> list[int]:
        """The parameters that got no gradient on any rank (one small all-reduce, as torch's
        Reducer does with its ``local_used_map``)."""
        used = torch.ones(len(self.params), dtype=torch.int32, device=self.buckets[0].buffer.device)
        used[missing] = 0
        dist.all_reduce(used, group=self.group)
        return [i for i in missing if int(used[i]) == 0]

    def _finish_reduction(self) -> None:
        """Wait for every bucket's all-reduce, put the averages in ``.grad``, reset the state
        of this backward so the next one starts afresh."""
        # TODO 3.4: wait for the all-reduces, write the averaged gradients, reset for next step.
        # Invariant: when backward returns every .grad holds the group's average (a copy, or
        #   with gradient_as_bucket_view the bucket slot itself); every bucket is again
        #   waiting for all its gradients and no all-reduce is remembered from this step.
        # Hint 1: an async all-reduce's result is in the buffer only after work.wait().
        # More hints: uv run python -m tests.hint 3.4
        # See guidelines.md#34-ddp-from-scratch
        raise NotImplementedError(
            "TODO 3.4: wait for the all-reduces, write the averaged gradients, reset for next step "
            "(see phase3_multi_node/guidelines.md#34-ddp-from-scratch)"
        )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, backward only accumulates into ``.grad``; the first backward of a forward run
        outside all-reduces the accumulated sum (torch's ``DistributedDataParallel.no_sync``)."""
        # TODO 3.4: switch gradient synchronization off inside the block, restore it after.
        # Invariant: forwards run inside the block build backwards that do not communicate;
        #   after the block (also when it raises) synchronization is as it was before.
        # Hint 1: forward reads self.require_backward_grad_sync to decide.
        # More hints: uv run python -m tests.hint 3.4
        # See guidelines.md#34-ddp-from-scratch
        raise NotImplementedError(
            "TODO 3.4: switch gradient synchronization off inside the block, restore it after "
            "(see phase3_multi_node/guidelines.md#34-ddp-from-scratch)"
        )

    def bucket_bytes(self) -> list[int]:
        """Bytes of each bucket, in launch order."""
        return [bucket.nbytes for bucket in self.buckets]
