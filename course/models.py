"""The small models every phase trains: an MLP and a tiny CNN.

Both are ``nn.Sequential`` so that later phases (model and pipeline parallelism) can cut them
into stages by layer index without special cases.
"""

from __future__ import annotations

from torch import nn


class MLP(nn.Sequential):
    """Flatten, then ``depth`` hidden blocks of Linear + ReLU, then a Linear classifier."""

    def __init__(
        self, in_features: int, hidden: int = 128, num_classes: int = 10, depth: int = 2
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth={depth}: an MLP needs at least one hidden layer")
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        super().__init__(*layers)


class BabyCNN(nn.Sequential):
    """Two conv blocks and a linear head: small enough for CPU, big enough to learn patterns."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, width: int = 16) -> None:
        super().__init__(
            nn.Conv2d(in_channels, width, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(4),
            nn.Flatten(),
            nn.Linear(2 * width * 16, num_classes),
        )
