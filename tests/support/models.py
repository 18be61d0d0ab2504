"""Small models the core's tests share."""

from __future__ import annotations

import torch
from torch import nn


def repeated_shapes(device: str = "cpu") -> nn.Sequential:
    """Layers of repeated shapes, for the batched paths: three Linear(12, 12) layers, two
    bias-free 4-channel convolutions, and odd ones (input 2×6×6, five classes)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1, bias=False),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1, bias=False),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 12),
        nn.Tanh(),
        nn.Linear(12, 12),
        nn.Tanh(),
        nn.Linear(12, 12),
        nn.Tanh(),
        nn.Linear(12, 12),
        nn.Tanh(),
        nn.Linear(12, 5),
    ).to(device)


def grouped_and_odd() -> nn.Sequential:
    """Grouped convolutions with biases (two of one shape), a channels-last one, and layers
    whose gradients are no multiple of the flat buffers' alignment (input 2×6×6, five
    classes, as ``repeated_shapes``)."""
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.Conv2d(4, 6, 3, padding=1, groups=2),
        nn.ReLU(),
        nn.Conv2d(6, 6, 3, padding=1, groups=2),
        nn.ReLU(),
        nn.Conv2d(6, 6, 1, groups=3, bias=False).to(memory_format=torch.channels_last),
        nn.Flatten(),
        nn.Linear(6 * 6 * 6, 7),
        nn.Tanh(),
        nn.Linear(7, 7),
        nn.Tanh(),
        nn.Linear(7, 5),
    )


def small_cnn(classes: int) -> nn.Sequential:
    """A convolution, pooling and two Linear layers in float64 (input 1×8×8), seed 0."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(3 * 4 * 4, 8),
        nn.Tanh(),
        nn.Linear(8, classes),
    ).double()
