"""A small CNN, its batches, and a few K-FAC training steps: what the core's tests share."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kaisa_ray import KFACPreconditioner


def small_cnn(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(4, 6, 3, padding="same"),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(6 * 4 * 4, 12),
        nn.ReLU(),
        nn.Linear(12, 3),
    ).to(dtype)


def batches(
    n: int, size: int = 16, seed: int = 1, dtype: torch.dtype = torch.float32
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(size, 1, 8, 8, generator=generator, dtype=dtype),
            torch.randint(0, 3, (size,), generator=generator),
        )
        for _ in range(n)
    ]


def train(
    model: nn.Module,
    preconditioner: KFACPreconditioner,
    optimizer: torch.optim.Optimizer,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    on_step: Callable[[int], None] | None = None,
) -> None:
    for i, (x, y) in enumerate(data):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        preconditioner.step()
        optimizer.step()
        if on_step is not None:
            on_step(i)
