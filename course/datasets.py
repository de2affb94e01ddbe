"""The built-in dataset: generated on the fly, nothing to download, and learnable.

Each class is a smooth random 16x16 "prototype" image. A sample is its class prototype moved by a
random shift of up to ``max_shift`` pixels, scaled in contrast, plus Gaussian noise. Chance is
1/num_classes; a small CNN reaches high accuracy in a few epochs, an MLP somewhat lower, so the
accuracy a run prints means something. Every rank generates the same tensors from the same seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset


@dataclass(frozen=True)
class PatternSpec:
    """The knobs of the generated task; the defaults are what the trainers use."""

    num_classes: int = 10
    image_size: int = 16
    max_shift: int = 3
    noise: float = 2.0
    seed: int = 1234


def class_prototypes(spec: PatternSpec) -> torch.Tensor:
    """[num_classes, 1, H, W] smooth random patterns, zero mean and unit std each."""
    g = torch.Generator().manual_seed(spec.seed)
    coarse = torch.randn(spec.num_classes, 1, 4, 4, generator=g)
    protos = F.interpolate(coarse, size=spec.image_size, mode="bilinear", align_corners=False)
    protos = protos - protos.mean(dim=(1, 2, 3), keepdim=True)
    return protos / protos.std(dim=(1, 2, 3), keepdim=True)


def make_pattern_dataset(
    num_samples: int, spec: PatternSpec = PatternSpec(), split_seed: int = 0
) -> TensorDataset:
    """``num_samples`` pairs of (image [1, H, W] float32, label int64); ``split_seed`` picks
    the split (0 for training, 1 for testing), the classes stay the same."""
    if num_samples < 1:
        raise ValueError(f"num_samples={num_samples}: the dataset needs at least one sample")
    protos = class_prototypes(spec)
    g = torch.Generator().manual_seed(spec.seed * 1000 + split_seed + 1)
    labels = torch.randint(spec.num_classes, (num_samples,), generator=g)
    images = protos[labels]
    s = spec.max_shift
    shifts = torch.randint(-s, s + 1, (num_samples, 2), generator=g)
    shifted = torch.empty_like(images)
    for i in range(num_samples):  # torch.roll has no per-sample shifts
        shifted[i] = torch.roll(
            images[i], shifts=(int(shifts[i, 0]), int(shifts[i, 1])), dims=(1, 2)
        )
    contrast = 0.7 + 0.6 * torch.rand(num_samples, 1, 1, 1, generator=g)
    noisy = contrast * shifted + spec.noise * torch.randn(shifted.shape, generator=g)
    return TensorDataset(noisy.float(), labels)
