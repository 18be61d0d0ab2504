"""A model plugin whose constructor takes as long as it is told (as one that downloads its
weights would): what the service's worker pool bounds is any slow task, and kaisa-ray's own
planner is now fast at every world size (``benchmarks/plan_speed.py``). Installed for a test
by putting this folder on ``PYTHONPATH``: the ``.dist-info`` beside it declares the entry
point ``kaisa_ray.models: slow-mlp``."""

from __future__ import annotations

import time

import torch
from torch import nn

from kaisa_train.models import MLP


class SlowMLP(MLP):
    def example_input(self, batch_size: int) -> torch.Tensor:
        return torch.zeros(batch_size, 784, device=self.net[1].weight.device)


def slow_mlp(seconds: float = 600.0, hidden: int = 16) -> nn.Module:
    time.sleep(seconds)
    return SlowMLP(hidden=[hidden])
