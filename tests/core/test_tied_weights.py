"""Tied weights: a layer that shares its weight with another module (a language model's head
tied to its embedding) is left to the optimizer, says so in the log, and its gradient (the
sum over every use of the shared parameter) reaches the optimizer untouched."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from kaisa_ray import KFACPreconditioner
from kaisa_ray.plan import plan

VOCAB, WIDTH = 12, 6


class TiedLM(nn.Module):
    """Embedding -> Linear -> head, the head's weight the embedding's (as GPT-2 ties them)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.hidden = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.tanh(self.hidden(self.embed(tokens))))
        return out


class TiedLinears(nn.Module):
    """Two square Linear layers that share one weight (each with its own bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(WIDTH, WIDTH)
        self.second = nn.Linear(WIDTH, WIDTH)
        self.second.weight = self.first.weight
        self.out = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(torch.tanh(self.second(torch.tanh(self.first(x)))))
        return out


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_head_tied_to_its_embedding_is_left_to_the_optimizer_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(0)
    model = TiedLM()
    assert model.head.weight is model.embed.weight
    with caplog.at_level(logging.INFO, logger="kaisa_ray.preconditioner"):
        preconditioner = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=1)
    assert [layer.name for layer in preconditioner.layers] == ["hidden"]
    assert "head (Linear: weight tied with embed (Embedding)" in caplog.text
    assert "leaves to the optimizer" in caplog.text

    tokens = torch.randint(0, VOCAB, (16,))
    targets = torch.randint(0, VOCAB, (16,))
    nn.functional.cross_entropy(model(tokens), targets).backward()
    plain = _grads(model)
    preconditioner.step()
    after = _grads(model)
    # The shared parameter's gradient (the head's share and the embedding's) is untouched...
    assert torch.equal(after["embed.weight"], plain["embed.weight"])
    # ... and both uses are in it: it differs from the head's share alone.
    head_only = TiedLM()
    head_only.load_state_dict(model.state_dict())
    hidden = torch.tanh(head_only.hidden(head_only.embed(tokens))).detach()
    head_share = torch.autograd.grad(
        nn.functional.cross_entropy(hidden @ head_only.embed.weight.T, targets),
        head_only.embed.weight,
    )[0]
    assert not torch.allclose(plain["embed.weight"], head_share)
    # The untied layer is preconditioned as usual.
    assert not torch.allclose(after["hidden.weight"], plain["hidden.weight"])


def test_two_linear_layers_sharing_a_weight_are_both_left_alone() -> None:
    model = TiedLinears()
    preconditioner = KFACPreconditioner(model)
    assert [layer.name for layer in preconditioner.layers] == ["out"]


def test_a_plan_prices_the_layers_the_preconditioner_registers() -> None:
    assert [layer.name for layer in plan(TiedLM(), world_size=2).layers] == ["hidden"]


def test_without_ties_the_head_is_preconditioned() -> None:
    model = TiedLM()
    model.head.weight = nn.Parameter(model.embed.weight.detach().clone())
    preconditioner = KFACPreconditioner(model)
    assert [layer.name for layer in preconditioner.layers] == ["hidden", "head"]
