"""The library way beside exercise 2.7: ``torch.distributed.tensor.experimental.context_parallel``.

PyTorch ships ring attention as a prototype (torch/distributed/tensor/experimental/
_context_parallel/_attention.py). ``with context_parallel(mesh, buffers=[q, k, v, ...],
buffer_seq_dims=[2, 2, 2, ...]):`` shards the buffers along the sequence *in place* (with the
head-tail load balancer, the same zig-zag layout as yours, when the length divides by 2·cp and
the attention is causal), and inside the block ``F.scaled_dot_product_attention`` runs as ring
attention on each rank's shard; ``context_parallel_unshard`` gathers an output back.

**It cannot run on CPU.** The ring is a DTensor dispatch rule registered only for the CUDA
attention kernels (``_scaled_dot_product_flash_attention``, ``_efficient_attention`` and
``_cudnn_attention``). On CPU, SDPA calls ``_scaled_dot_product_flash_attention_for_cpu``, which
has no context-parallel rule, and the call fails (torch 2.15, gloo)::

    NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default does
    not have a sharding strategy registered.

:func:`library_ring_attention` runs it where it can (CUDA, NCCL); :func:`cpu_refusal` returns that
error on CPU, so the demo and the grader show it instead of claiming it. The *sharding* half of
the library is plain DTensor and does run on CPU: :func:`library_cp_shard` shards a sequence
exactly as ``context_parallel`` does, and the grader checks that it lays out the positions as
the zig-zag layout of 2.7 does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._context_parallel import (
    _context_parallel_shard,
    _cp_options,
    _HeadTailLoadBalancer,
)

CPU_KERNEL = "_scaled_dot_product_flash_attention_for_cpu"


def cp_mesh(group: dist.ProcessGroup | None = None, device_type: str = "cpu") -> DeviceMesh:
    """A 1-D DeviceMesh over the context-parallel ``group`` (None: the whole world)."""
    process_group = group if group is not None else dist.group.WORLD
    assert process_group is not None
    return DeviceMesh.from_group(process_group, device_type)


def head_tail_order(seq_len: int, cp: int) -> torch.Tensor:
    """The library's load-balanced order of positions: rank r's shard is the r-th 1/cp of it."""
    return _HeadTailLoadBalancer(seq_len, cp, "cpu")._generate_indices()[0].long()


def library_cp_shard(
    x: torch.Tensor, mesh: DeviceMesh, *, seq_dim: int = 2, load_balance: bool = True
) -> torch.Tensor:
    """This rank's shard of the whole sequence ``x``, as ``context_parallel`` shards its buffers
    (``_context_parallel_shard``; the head-tail load balancer when ``load_balance``)."""
    balancer = (
        _HeadTailLoadBalancer(x.shape[seq_dim], mesh.size(), x.device) if load_balance else None
    )
    (shard,) = _context_parallel_shard(mesh, [x], [seq_dim], load_balancer=balancer)
    assert isinstance(shard, torch.Tensor)
    return shard.clone()


@contextlib.contextmanager
def _load_balance(enabled: bool) -> Iterator[None]:
    saved = _cp_options.enable_load_balance
    _cp_options.enable_load_balance = enabled
    try:
        yield
    finally:
        _cp_options.enable_load_balance = saved


def library_ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh: DeviceMesh, *, causal: bool
) -> torch.Tensor:
    """This rank's shard of ``sdpa(q, k, v)`` over the whole sequences ``q, k, v`` (equal on every
    rank), computed by the library's ring attention. The shard is in the head-tail (zig-zag)
    layout when causal, contiguous otherwise (the library balances causal attention only).

    Raises NotImplementedError on CPU (see the module docstring).
    """
    q, k, v = (t.detach().clone() for t in (q, k, v))  # context_parallel shards them in place
    with (
        _load_balance(causal),
        context_parallel(
            mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2], no_restore_buffers={q, k, v}
        ),
    ):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def cpu_refusal(mesh: DeviceMesh) -> str | None:
    """What the library's ring attention says on this mesh's CPU tensors (every rank of the mesh
    must call it): the error's first line, or None if it ran."""
    x = torch.zeros(1, 1, 2 * mesh.size(), 4)
    try:
        library_ring_attention(x, x, x, mesh, causal=True)
    except NotImplementedError as err:
        return f"{type(err).__name__}: {str(err).splitlines()[0]}"
    return None
