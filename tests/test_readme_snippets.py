"""The Python examples of the README and docs/, run as written on a small model (no Ray, no
data files)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

import kaisa_ray
from kaisa_ray import KFACPreconditioner, QuadraticModelStep

ROOT = Path(__file__).resolve().parents[1]


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_block(containing: str) -> str:
    """The one Python block of the README and docs/ that contains ``containing``."""
    blocks: list[str] = [
        block
        for page in PAGES
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    ]
    (found,) = [b for b in blocks if containing in b]
    return found


def batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(count, 64, 8, generator=generator)
    y = torch.randint(0, 3, (count, 64), generator=generator)
    return list(zip(x, y, strict=True))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def test_the_quadratic_model_loop_takes_each_steps_own_gradient() -> None:
    """docs/curvature.md's ``QuadraticModelStep`` loop, run as written, ends where a loop that
    clears the gradients before every backward ends: each step sees its own gradient (a
    loop without ``zero_grad`` adds every earlier step's into it)."""
    block = python_block("QuadraticModelStep(model")
    library = {name: getattr(kaisa_ray, name) for name in kaisa_ray.__all__}
    readme: dict[str, Any] = {**library, "model": model(), "loader": batches(4)}
    readme["loss_fn"] = nn.functional.cross_entropy
    exec(block, readme)

    net = model()
    step = QuadraticModelStep(net, damping=0.1, min_damping=1e-3)
    preconditioner = KFACPreconditioner(
        net, damping=step.current_damping, kl_clip=None, running_average="debiased",
        factor_scale="fisher", pi_damping=True, compute_method="inverse",
        factor_update_steps=1, inv_update_steps=10, factor_samples=256,
    )  # fmt: skip
    for x, y in batches(4):
        net.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(net(x), y).backward()  # type: ignore[no-untyped-call]
        step.capture()
        preconditioner.step()
        step.step(x[:256], y[:256])
    for theirs, ours in zip(readme["model"].parameters(), net.parameters(), strict=True):
        torch.testing.assert_close(theirs, ours, rtol=0, atol=0)
    moved = [p.detach().clone() for p in model().parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(moved, net.parameters(), strict=True))
