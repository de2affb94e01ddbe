"""The library way to do what exercise 3.5 builds: ``ZeroRedundancyOptimizer`` and FSDP2.

* ``torch.distributed.optim.ZeroRedundancyOptimizer`` (torch/distributed/optim/
  zero_redundancy_optimizer.py) is ZeRO stage 1 in the style of FairScale's OSS: it assigns whole
  parameters (not flat slices) to ranks, greedily by size, runs the wrapped optimizer on each
  rank's own parameters and broadcasts the updated ones. Gradients are still all-reduced by DDP,
  so every rank keeps full gradients; optimizer state is ~1/N but not exactly (no padding, whole
  tensors: a 4x4 weight cannot be split).
* FSDP2 ``torch.distributed.fsdp.fully_shard`` (torch/distributed/fsdp/_fully_shard/) is ZeRO
  stage 3: each call makes one unit whose parameters become ``DTensor`` shards on a device mesh
  (dim-0 sharding, padded), all-gathered before forward/backward and reduce-scattered after, as
  ``zero_wrap(..., stage=3)``. ``reshard_after_forward=False`` gives stage 2 (parameters stay
  gathered between forward and backward).
* DeepSpeed (``deepspeed.initialize`` with ``zero_optimization.stage`` 1/2/3) is the paper's own
  implementation; it needs its package and a config file, so the course only describes it.

Both PyTorch classes work on CPU with gloo (torch 2.15): the mesh is ``init_device_mesh("cpu",
(N,))``, or ``DeviceMesh.from_group(group, "cpu")`` for a subgroup.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel


def zero_redundancy_adamw(
    model: nn.Module, group: dist.ProcessGroup | None = None, **adamw: Any
) -> tuple[nn.Module, ZeroRedundancyOptimizer]:
    """DDP (gradients all-reduced, averaged) + ``ZeroRedundancyOptimizer`` over AdamW."""
    ddp = DistributedDataParallel(model, process_group=group)
    optimizer = ZeroRedundancyOptimizer(
        ddp.parameters(), optimizer_class=torch.optim.AdamW, process_group=group, **adamw
    )
    return ddp, optimizer


def cpu_mesh(group: dist.ProcessGroup | None = None) -> DeviceMesh:
    """A one-dimensional CPU mesh over ``group`` (None: the whole world)."""
    world = dist.group.WORLD
    assert world is not None, "initialise the process group first"
    return DeviceMesh.from_group(group or world, "cpu")


def fsdp2_adamw(
    model: nn.Module,
    group: dist.ProcessGroup | None = None,
    reshard_after_forward: bool = True,
    **adamw: Any,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``fully_shard`` every layer with parameters, then the root; AdamW on the DTensor shards."""
    mesh = cpu_mesh(group)
    for module in list(model.modules())[1:]:
        if any(True for _ in module.parameters(recurse=False)):
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model, torch.optim.AdamW(model.parameters(), **adamw)


def fsdp2_full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every FSDP2 parameter in full (``DTensor.full_tensor()`` all-gathers): call on every rank."""
    out = {}
    for name, p in model.named_parameters():
        full = getattr(p, "full_tensor", None)
        out[name] = (full() if callable(full) else p).detach().clone()
    return out
