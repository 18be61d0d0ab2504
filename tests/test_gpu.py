"""The CUDA path of the core: state on the device, fp16 autocast with a GradScaler."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kaisa_ray import KFACPreconditioner

pytestmark = pytest.mark.gpu


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * 14 * 14, 10),
    ).cuda()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_amp_training_on_cuda_stays_finite_with_state_on_device(dtype: torch.dtype) -> None:
    model = cnn()
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
    preconditioner = KFACPreconditioner(model, grad_scaler=scaler, inv_update_steps=5, damping=0.01)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(12):
        x = torch.randn(32, 1, 28, 28, device="cuda")
        y = torch.randint(0, 10, (32,), device="cuda")
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=dtype):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        preconditioner.step()
        scaler.step(optimizer)
        scaler.update()
    for layer in preconditioner.layers:
        assert layer.a_factor is not None
        assert layer.a_factor.device.type == "cuda"
        assert layer.a_factor.dtype == torch.float32
        assert all(t.device.type == "cuda" for t in layer.decomposition.tensors().values())
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_cuda_matches_cpu_in_float64() -> None:
    torch.manual_seed(1)
    x = torch.randn(16, 1, 28, 28, dtype=torch.float64)
    y = torch.randint(0, 10, (16,))
    grads = []
    for device in ("cpu", "cuda"):
        model = cnn().to(device=device, dtype=torch.float64)
        preconditioner = KFACPreconditioner(model, damping=0.01, kl_clip=None)
        F.cross_entropy(model(x.to(device)), y.to(device)).backward()
        preconditioner.step()
        grads.append([p.grad.cpu() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-12)
