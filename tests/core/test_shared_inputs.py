"""Linear layers called on one input tensor (attention's query, key and value) share its A
factor: it is computed once a micro-batch and copied to the others
(``kaisa_ray.factor_hooks.FactorHooks._shared_a``), with the same values as computing each."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kaisa_ray import KFACPreconditioner
from kaisa_ray.factor_hooks import FactorHooks
from kaisa_ray.kfac_layer import KFACLayer


class Attention(nn.Module):
    """Query, key and value of one input (``separate``: the value's input is a copy)."""

    def __init__(self, separate: bool = False) -> None:
        super().__init__()
        self.query, self.key, self.value = (nn.Linear(6, 5) for _ in range(3))
        self.out = nn.Linear(5, 3)
        self.separate = separate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.query(x), self.key(x)
        v = self.value(x * 1.0 if self.separate else x)
        weights = torch.softmax(q @ k.transpose(-1, -2) / 5**0.5, dim=-1)
        out: torch.Tensor = self.out(torch.tanh(weights @ v)).mean(dim=1)
        return out


def _train(
    model: nn.Module, options: dict[str, Any], accumulation: int = 1
) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    preconditioner = KFACPreconditioner(
        model, factor_update_steps=1, inv_update_steps=2, accumulation_steps=accumulation, **options
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(0)
    grads = []
    for _ in range(4):
        optimizer.zero_grad()
        for _ in range(accumulation):
            x = torch.randn(8, 4, 6, generator=generator, dtype=torch.float64)
            y = torch.randint(0, 3, (8,), generator=generator)
            (F.cross_entropy(model(x), y) / accumulation).backward()
        preconditioner.step()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        optimizer.step()
    factors = {layer.name: layer.a_factor.clone() for layer in preconditioner.layers}
    return factors, grads


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the layers whose A a hook computes, in order."""
    computed: list[str] = []
    add_input = KFACLayer.add_input

    def counting(self: KFACLayer, inputs: torch.Tensor) -> None:
        computed.append(self.name)
        add_input(self, inputs)

    monkeypatch.setattr(KFACLayer, "add_input", counting)
    return computed


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize(
    "options",
    [{}, {"factor_samples": 5}, {"compute_method": "inverse", "factor_scale": "fisher"}],
    ids=["eigen", "sampled", "inverse-fisher"],
)
def test_a_shared_inputs_a_is_computed_once_with_the_values_of_computing_each(
    options: dict[str, Any],
    accumulation: int,
    calls: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    model = Attention().double()
    copy = Attention().double()
    copy.load_state_dict(model.state_dict())
    shared, grads = _train(model, options, accumulation)
    # the first micro-batch of each of the 4 steps: the query's A for all three, and out's
    first = ["query", "out"]
    later = ["query", "key", "value", "out"]
    assert calls == (first + later * (accumulation - 1)) * 4
    calls.clear()
    with monkeypatch.context() as patched:
        patched.setattr(FactorHooks, "_shared_a", lambda self, layer, inputs: None)
        each, each_grads = _train(copy, options, accumulation)
    assert calls == later * accumulation * 4
    for name, factor in each.items():
        assert torch.equal(shared[name], factor), name
    for step, (a, b) in enumerate(zip(grads, each_grads, strict=True)):
        assert torch.equal(a, b), f"step {step}"


def test_a_copy_of_the_input_is_another_input(calls: list[str]) -> None:
    """The value's input is ``x * 1.0``, a tensor of its own: its A is computed."""
    torch.manual_seed(0)
    model = Attention(separate=True).double()
    preconditioner = KFACPreconditioner(model, factor_update_steps=1)
    x = torch.randn(8, 4, 6, dtype=torch.float64)
    F.cross_entropy(model(x), torch.zeros(8, dtype=torch.long)).backward()
    preconditioner.step()
    assert calls == ["query", "value", "out"]
