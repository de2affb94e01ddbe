"""The library way beside exercise 2.6: the same MLP parallelized by ``torch.distributed.tensor``.

``parallelize_module`` with ``ColwiseParallel`` on fc1 and ``RowwiseParallel`` on fc2 is the
library's version of ``ParallelMLP`` (see
https://pytorch.org/docs/stable/distributed.tensor.parallel.html). The weights become DTensors on
a 1-D DeviceMesh over the tensor-parallel group; ``weight.to_local()`` is this rank's shard, the
same slice ``ParallelMLP`` holds. Not an exercise: demos/tensor_parallel.py and the graders
compare it with the dense MLP and with yours.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from course.distributed import current_info


def tensor_parallel_mesh(group: dist.ProcessGroup | None = None) -> DeviceMesh:
    """A 1-D DeviceMesh over ``group`` (None: the whole world), on this rank's device type."""
    info = current_info()
    process_group = group if group is not None else dist.group.WORLD
    assert process_group is not None
    return DeviceMesh.from_group(process_group, info.device.type)


def library_parallel_mlp(
    dense: nn.Module, mesh: DeviceMesh | None = None, *, group: dist.ProcessGroup | None = None
) -> nn.Module:
    """A copy of ``dense`` (with ``fc1`` and ``fc2``) parallelized by ``parallelize_module``.

    ``mesh`` is a 1-D DeviceMesh of the tensor-parallel ranks; without it, one is made over
    ``group`` (None: the whole world). ``ColwiseParallel`` on fc1 and ``RowwiseParallel`` on fc2
    are the library's names for the column- and row-parallel layers: the input is taken as
    replicated, and the output comes back replicated as a local tensor (an
    ``AsyncCollectiveTensor`` that waits for its all-reduce on first use). The mesh's first
    rank's weights are scattered to the others (``src_data_rank=0``), so the result matches a
    dense model built there.
    """
    if mesh is not None and group is not None:
        raise ValueError("give library_parallel_mlp a mesh or a group, not both")
    model = copy.deepcopy(dense)
    model.zero_grad(set_to_none=True)  # deepcopy copies .grad too
    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    return parallelize_module(model, mesh or tensor_parallel_mesh(group), plan)


def local_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's gradient of every parameter: a DTensor's local shard, or the tensor itself."""
    grads: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        if param.grad is not None:
            grad = param.grad
            grads[name] = grad.to_local() if isinstance(grad, DTensor) else grad
    return grads
