"""The capstone's model: a torchvision network, channels_last, optionally compiled, in DDP.

* **torchvision's models, untrained** (``weights=None``): ``resnet18``, ``resnet50``,
  ``vit_b_16`` (its ``image_size`` follows ``data.image_size``, so a tiny CPU run can use 32 px).
  ResNets start with the last BatchNorm of every residual block at zero (``zero_init_residual``,
  Goyal et al. 2017, section 5.1): each block starts as the identity, which large-batch training
  needs.
* **channels_last** (NHWC): cuDNN's tensor-core convolutions work in NHWC; with NCHW tensors
  every convolution is wrapped in two transposes. torchvision's reference leaves it off; here it
  is on by default (PyTorch tutorial "Channels Last Memory Format").
* **torch.compile**, optional: ``model.compile()`` compiles the module in place, so its
  ``state_dict`` keys stay unchanged (no ``_orig_mod.`` prefix in checkpoints) and DDP wraps it as
  any module.
* **DDP** with the bucket size from the config; a **communication hook** compresses the
  gradients when ``communication.compression`` asks for it (:func:`register_compression`, the
  single integration point with exercise 4.4's ``compression.py``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torchvision
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from course.impl import load_impl
from solutions.phase4_production.imagenet.config import CapstoneConfig

PHASE = "phase4_production"


def build_model(config: CapstoneConfig, num_classes: int, device: torch.device) -> nn.Module:
    """A fresh torchvision model on ``device``; the same initial weights on every rank."""
    kwargs: dict[str, Any] = {"weights": None, "num_classes": num_classes}
    if config.model.name.startswith("resnet"):
        kwargs["zero_init_residual"] = config.model.zero_init_residual
    if config.model.name.startswith("vit"):
        kwargs["image_size"] = config.data.image_size
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.train.seed)
        model = torchvision.models.get_model(config.model.name, **kwargs)
    if config.model.sync_batchnorm:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    if config.model.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if config.model.compile:
        model.compile()
    return model


def wrap_ddp(
    model: nn.Module,
    config: CapstoneConfig,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
) -> DistributedDataParallel:
    """DDP over ``group``: gradients all-reduced in buckets during backward (phase 3.4)."""
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=group,
        bucket_cap_mb=config.parallel.bucket_cap_mb,
        gradient_as_bucket_view=config.parallel.gradient_as_bucket_view,
        static_graph=config.parallel.static_graph,
    )
    register_compression(ddp, config, group)
    return ddp


# ---------------------------------------------------------------- integration point (4.4)
def register_compression(
    ddp: DistributedDataParallel, config: CapstoneConfig, group: dist.ProcessGroup | None
) -> Any:
    """THE integration point with exercise 4.4: register the gradient-compression hook built by
    its ``make_comm_hook(name, group, ...)`` (the learner's with ``impl: templates``). Returns
    the hook's state (top-k and PowerSGD keep their error feedback there), or None."""
    comm = config.communication
    if comm.compression == "none":
        return None
    compression = load_impl(PHASE, "compression", config.impl)
    made = compression.make_comm_hook(
        comm.compression, group, topk_ratio=comm.topk_ratio, powersgd_rank=comm.powersgd_rank
    )
    if made is None:
        return None
    state, hook = made
    ddp.register_comm_hook(state, hook)
    return state


# ---------------------------------------------------------------- end of integration point
