"""The given part of exercise 3.4's ``DistributedDataParallel``: buckets, hooks and wiring.

torch's DDP (Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training", VLDB 2020) is a thin Python module around a C++ ``Reducer``
(torch/csrc/distributed/c10d/reducer.cpp). The exercise is the Reducer's heart: what happens
when a gradient is ready (``_mark_ready``), when backward is over (``_finish_reduction``), and
``no_sync``. Everything around it lives here, complete, in :class:`DDPBase`, which the
exercise's class extends:

* **Construction** (:meth:`DDPBase.__init__`): every parameter and buffer is broadcast from rank
  0 of the group, so all replicas start equal; the parameters that need gradients are packed
  into :class:`Bucket` s (the assignment is yours, ``assign_buckets`` of 3.4, passed in as
  ``assign``); a hook is registered on each with ``Tensor.register_post_accumulate_grad_hook``,
  which fires once the parameter's gradient of this backward has been accumulated into
  ``.grad`` (torch hooks the ``AccumulateGrad`` node itself).
* **forward** arms the hooks for the next backward, unless ``require_backward_grad_sync`` is off
  (``no_sync``), as torch's ``prepare_for_backward``; with ``broadcast_buffers`` it broadcasts
  the buffers from rank 0 first.
* **The hook** (``_on_grad_ready``) does the bookkeeping: a parameter reported twice in one
  backward is an error; the first hook of a backward queues ``_finalize_backward`` on the
  autograd engine (``Variable._execution_engine.queue_callback``, the call torch's Python
  ``_DDPSink`` makes), so it runs when backward ends; then it calls your ``_mark_ready(index)``.
* **The end of backward** (``_finalize_backward``): parameters that got no gradient are an error
  naming them (``find_unused_parameters=False``) or are marked ready as zeros (``True``); one
  small all-reduce then tells which parameters no rank used, whose ``.grad`` is left as it was
  (torch's ``local_used_map``); a bucket never launched is an error that says why; then your
  ``_finish_reduction()`` runs. When ``loss.backward()`` returns, the gradients are averaged.
* **Communication hooks** (:meth:`DDPBase.register_comm_hook`, torch's seam for compression,
  phase 4): ``hook(state, bucket) -> torch.futures.Future[Tensor]`` replaces a bucket's
  all-reduce. As in torch's Reducer, the hook does the division by the world itself
  (``default_hooks.fp16_compress_hook`` casts, divides by the world and all-reduces), and the
  tensor the future returns is what the bucket's parameters receive. torch's own hooks
  (``default_hooks``, ``powerSGD_hook``) run unchanged: :class:`HookBucket` offers the methods
  of ``dist.GradBucket`` they call. :meth:`DDPBase._launch` starts a bucket's all-reduce either
  way; :attr:`DDPBase._copy_factor` is the factor between a rank's gradient and its share of the
  average (1/world, or 1 with a hook, which divides).

Differences from torch, on purpose: torch's first iteration uses one bucket and rebuilds the
buckets afterwards in the order the gradients arrived; here the buckets are formed once, at
construction, by ``assign_buckets``, which must give what torch ends with for any chain of
layers. With ``find_unused_parameters=True`` torch finds
unused parameters by walking the autograd graph in ``forward`` and keeps its initial buckets;
here parameters without a gradient are marked ready when backward ends (same values, less
overlap for the buckets after them).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# assign_buckets(sizes, limits, kinds) -> buckets of parameter indices, in launch order (3.4)
AssignBuckets = Callable[[Sequence[int], Sequence[int], Sequence[Hashable]], list[list[int]]]


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
        """The flat buffer of the bucket's gradients (with a hook: as this rank computed
        them; the hook divides)."""
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


class HookWork:
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


def global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The global rank of member ``group_rank`` of ``group`` (None: the default group)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def build_buckets(
    params: Sequence[torch.Tensor], names: Sequence[str], groups: Sequence[Sequence[int]]
) -> list[Bucket]:
    """One :class:`Bucket` per group of parameter indices, each with a zeroed flat buffer.

    Refuses an assignment that does not place every parameter exactly once, or that mixes
    dtypes in a bucket (one flat buffer holds one dtype).
    """
    placed = sorted(index for members in groups for index in members)
    if placed != list(range(len(params))):
        raise RuntimeError(
            f"assign_buckets placed the parameter indices {placed}; expected each of "
            f"0..{len(params) - 1} exactly once"
        )
    buckets = []
    for number, members in enumerate(groups):
        dtypes = sorted({str(params[i].dtype) for i in members})
        if len(dtypes) != 1 or len({params[i].device for i in members}) != 1:
            raise RuntimeError(f"assign_buckets put dtypes/devices {dtypes} in bucket {number}")
        numels = [params[i].numel() for i in members]
        offsets = [sum(numels[:k]) for k in range(len(numels))]
        first = params[members[0]]
        buckets.append(
            Bucket(
                index=number,
                params=list(members),
                names=[names[i] for i in members],
                shapes=[params[i].shape for i in members],
                offsets=offsets,
                buffer=torch.zeros(sum(numels), dtype=first.dtype, device=first.device),
                pending=len(members),
                numels=numels,
            )
        )
    return buckets


class DDPBase(nn.Module):
    """Everything of ``DistributedDataParallel`` but the exercise (see the module docstring).

    A subclass defines ``_mark_ready(index)`` (a gradient is in ``.grad``),
    ``_finish_reduction()`` (backward is over) and ``no_sync()``. State they use:
    ``self.buckets`` (:class:`Bucket` s in launch order),
    ``self.params`` (the trainable parameters, each once), ``self._locate[index]`` (its bucket
    and position there), ``self._next_bucket`` (the first bucket not launched in this backward),
    ``self.gradient_as_bucket_view``, ``self.require_backward_grad_sync``, and the methods
    :meth:`_launch` and :attr:`_copy_factor`.
    """

    def __init__(
        self,
        module: nn.Module,
        limits: list[int],
        assign: AssignBuckets,
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
        sizes = [p.numel() * p.element_size() for p in self.params]
        kinds = [(p.dtype, p.device) for p in self.params]
        self.buckets = build_buckets(self.params, self.param_names, assign(sizes, limits, kinds))
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

    # ----------------------------------------------------------------- construction

    def _sync_module_states(self) -> None:
        """Every parameter (frozen ones too) and buffer takes the values of group rank 0's."""
        source = global_rank(self.group, 0)
        with torch.no_grad():
            for tensor in [*self.module.parameters(), *self.module.buffers()]:
                dist.broadcast(tensor.detach(), src=source, group=self.group)

    def _make_hook(self, index: int) -> Any:
        def hook(_param: torch.Tensor) -> None:
            self._on_grad_ready(index)

        return hook

    # ----------------------------------------------------------------- communication

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
        """The factor between a rank's gradient and its share of the group's average: 1/world;
        1 when a communication hook is registered (the hook divides, as torch's Reducer leaves
        it to the hook)."""
        return 1.0 if self._comm_hook is not None else 1.0 / self.world_size

    def _launch(self, bucket: Bucket) -> Any:
        """Start the bucket's all-reduce without waiting: ``dist.all_reduce(async_op=True)`` on
        the group, or the registered hook. Returns something with ``wait()``."""
        if self._comm_hook is None:
            return dist.all_reduce(bucket.buffer, async_op=True, group=self.group)
        view = HookBucket(bucket, self.params, is_last=bucket.index == len(self.buckets) - 1)
        return HookWork(self._comm_hook(self._comm_state, view), bucket)

    # ----------------------------------------------------------------- forward

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the module; the next backward averages the gradients unless under no_sync()."""
        if self.broadcast_buffers and self.world_size > 1:
            source = global_rank(self.group, 0)
            with torch.no_grad():
                for buffer in self.module.buffers():
                    dist.broadcast(buffer, src=source, group=self.group)
        # like torch (prepare_for_backward): a forward with grad on, outside no_sync(), arms the
        # hooks until the end of the next backward; other forwards leave them as they are
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self._expect_hooks = True
        return self.module(*inputs, **kwargs)

    # ----------------------------------------------------------------- backward

    def _mark_ready(self, index: int) -> None:
        """The exercise (3.4): defined by ``DistributedDataParallel``."""
        raise TypeError(f"{type(self).__name__} must define _mark_ready(index)")

    def _finish_reduction(self) -> None:
        """The exercise (3.4): defined by ``DistributedDataParallel``."""
        raise TypeError(f"{type(self).__name__} must define _finish_reduction()")

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
            raise RuntimeError(self._never_launched(silent[0]))
        self._finish_reduction()
        for index, grad in kept.items():
            self.params[index].grad = grad

    def _never_launched(self, bucket: Bucket) -> str:
        """Why a bucket has no work when backward ends, from what its state shows."""
        where = f"backward is over but bucket {bucket.index} ({', '.join(bucket.names)})"
        expected = len(bucket.params)
        if self._next_bucket > bucket.index:
            return (
                f"{where} was never all-reduced, yet self._next_bucket is {self._next_bucket}, "
                "past it: it was not set back to 0 after the previous backward (reset it in "
                "_finish_reduction, with every bucket's pending count and work)"
            )
        if bucket.pending <= 0:
            return (
                f"{where} has all its gradients (pending {bucket.pending}) but was never "
                "launched: _mark_ready must launch every bucket whose gradients are all in, in "
                "bucket order (from self._next_bucket on), and keep the work self._launch "
                "returns on bucket.work"
            )
        if bucket.pending == expected:
            return (
                f"{where} was never all-reduced: its pending count is still {expected}, its "
                "number of parameters, although all of them were marked ready: _mark_ready must "
                "count the bucket's pending gradients down and launch it at 0"
            )
        return (
            f"{where} was never all-reduced: {bucket.pending} of its gradients are still "
            f"pending although all {expected} were marked ready, so its count did not start "
            f"this backward at {expected}: _finish_reduction must set every bucket's pending "
            "count back to the number of its parameters (and work to None, self._next_bucket "
            "to 0)"
        )

    def _unused_everywhere(self, missing: list[int]) -> list[int]:
        """The parameters that got no gradient on any rank (one small all-reduce, as torch's
        Reducer does with its ``local_used_map``)."""
        used = torch.ones(len(self.params), dtype=torch.int32, device=self.buckets[0].buffer.device)
        used[missing] = 0
        dist.all_reduce(used, group=self.group)
        return [i for i in missing if int(used[i]) == 0]

    def bucket_bytes(self) -> list[int]:
        """Bytes of each bucket, in launch order."""
        return [bucket.nbytes for bucket in self.buckets]
