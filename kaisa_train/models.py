"""Small image classifiers for the Fashion-MNIST example: a LeNet-style CNN and an MLP."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import torch
from pydantic import Field
from torch import nn

__all__ = ["MLP", "LeNetCNN", "WideMLP"]

# The constructors' parameters are what a job's ``model.params`` may set; their annotations
# (with these bounds) are how the JobSpec checks them before anything is built.
Width = Annotated[int, Field(ge=1, le=65536)]
Classes = Annotated[int, Field(ge=1, le=100_000)]


class LeNetCNN(nn.Module):
    """A LeNet-style CNN for 1×28×28 inputs.

    conv 1→8 (5×5, padding 2) → ReLU → max-pool 2 → conv 8→16 (5×5, padding 2) → ReLU →
    max-pool 2 → flatten → linear 784→128 → ReLU → linear 128→10.
    """

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, kernel_size=5, padding=2)
        self.conv2 = nn.Conv2d(8, 16, kernel_size=5, padding=2)
        self.pool = nn.MaxPool2d(2)
        self.relu = nn.ReLU()
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(16 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps images ``(N, 1, 28, 28)`` to logits ``(N, 10)``."""
        x = self.pool(self.relu(self.conv1(x)))
        x = self.pool(self.relu(self.conv2(x)))
        x = self.relu(self.fc1(self.flatten(x)))
        out: torch.Tensor = self.fc2(x)
        return out


class MLP(nn.Module):
    """A fully connected classifier that flattens its input first.

    Args:
        in_features: Number of input features after flattening (784 for 28×28 images).
        hidden: Widths of the hidden layers, each followed by a ReLU.
        num_classes: Number of output logits.
    """

    def __init__(
        self,
        in_features: Annotated[int, Field(ge=1, le=2**24)] = 784,
        hidden: Annotated[Sequence[Width], Field(max_length=64)] = (128,),
        num_classes: Classes = 10,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for size in hidden:
            layers += [nn.Linear(width, size), nn.ReLU()]
            width = size
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps inputs ``(N, ...)`` with ``in_features`` elements each to logits."""
        out: torch.Tensor = self.net(x)
        return out


class WideMLP(MLP):
    """A fully connected classifier whose K-FAC state outweighs the job itself: the workload
    where a memory budget decides K-FAC's strategy.

    Three hidden layers of ``width`` (512 by default) on Fashion-MNIST: about 0.93 M
    parameters (3.7 MB), while K-FAC keeps, per layer, two factors and their batch buffers
    and, on the layer's gradient workers, two eigenbases and an eigenvalue table, each about
    ``width²`` numbers: 28.8 MiB per worker under COMM-OPT, over twice the parameters,
    gradients and momentum together, and 21.7 MiB under MEM-OPT at 4 workers (``plan()``
    gives the figures per strategy).

    Args:
        in_features: Number of input features after flattening (784 for 28×28 images).
        width: Width of each hidden layer.
        depth: Number of hidden layers.
        num_classes: Number of output logits.
    """

    def __init__(
        self,
        in_features: Annotated[int, Field(ge=1, le=2**24)] = 784,
        width: Width = 512,
        depth: Annotated[int, Field(ge=1, le=64)] = 3,
        num_classes: Classes = 10,
    ) -> None:
        super().__init__(in_features=in_features, hidden=(width,) * depth, num_classes=num_classes)


class _BasicBlock(nn.Module):
    """Two 3×3 convolutions with BatchNorm; the shortcut subsamples and zero-pads channels
    (He et al. 2016, CIFAR option A: no parameters in the shortcut)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.stride = stride
        self.extra_channels = out_channels - in_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x[:, :, :: self.stride, :: self.stride] if self.stride > 1 else x
        if self.extra_channels:
            shortcut = nn.functional.pad(shortcut, (0, 0, 0, 0, 0, self.extra_channels))
        return torch.relu(out + shortcut)


class ResNet20(nn.Module):
    """ResNet-20 for small images (CIFAR-style: 3 stages of 3 blocks, 16/32/64 channels)."""

    def __init__(
        self, in_channels: Annotated[int, Field(ge=1, le=1024)] = 3, num_classes: Classes = 10
    ) -> None:
        super().__init__()
        self.stem = nn.Conv2d(in_channels, 16, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        blocks: list[nn.Module] = []
        channels = 16
        for stage, width in enumerate((16, 32, 64)):
            for index in range(3):
                stride = 2 if stage > 0 and index == 0 else 1
                blocks.append(_BasicBlock(channels, width, stride))
                channels = width
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.blocks(torch.relu(self.bn(self.stem(x))))
        logits: torch.Tensor = self.head(out.mean(dim=(-2, -1)))
        return logits
