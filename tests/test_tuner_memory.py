"""Measured tensor memory (CPU: counted through a dispatch mode) against known allocations
and against the plan's exact K-FAC state."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kaisa_ray import KFACPreconditioner
from kaisa_ray.plan import plan
from kaisa_ray.train.models import LeNetCNN
from tuner.memory import TensorMemory, tensor_bytes


def test_counts_allocations_once_and_frees() -> None:
    with TensorMemory() as memory:
        big = torch.empty(2**20, dtype=torch.uint8)
        kept = torch.zeros(1000)
        view = kept.view(10, 100)  # same storage: not counted again
        del big
    assert memory.peak_bytes == 2**20 + 4000
    assert memory.live_bytes == 4000
    assert view.shape == (10, 100)


def test_tensor_bytes_counts_shared_storage_once() -> None:
    x = torch.zeros(256)
    assert tensor_bytes([x, x.view(16, 16), x[:10]]) == 1024


def train(model: torch.nn.Module, steps: int, kfac: bool) -> int:
    """Live bytes a short run leaves behind (grads, optimizer and K-FAC state)."""
    torch.manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    with TensorMemory() as memory:
        preconditioner = (
            KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1) if kfac else None
        )
        for _ in range(steps):
            x, y = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            if preconditioner is not None:
                preconditioner.step()
            optimizer.step()
            del x, y
        memory.update()
        live = memory.live_bytes
    return live


def test_measured_kfac_state_is_exactly_the_plans() -> None:
    torch.manual_seed(0)
    plain = train(LeNetCNN(), 3, kfac=False)
    torch.manual_seed(0)
    model = LeNetCNN()
    with_kfac = train(model, 3, kfac=True)
    predicted = plan(model, 1).ranks[0].memory["total"]
    # Counted independently (every storage the run left alive), it matches to the byte.
    assert with_kfac - plain == predicted
