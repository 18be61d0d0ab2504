"""``embeddings=True``: an ``nn.Embedding`` is preconditioned as the Linear layer of one-hot
inputs it is (``kaisa_ray.layers.EmbeddingHelper``), under every scaling; without the option
it is left to the optimizer, as before."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kaisa_ray import KFACPreconditioner
from kaisa_ray.plan import plan
from kaisa_ray.registration import registered_layers

VOCAB, WIDTH, TOKENS, BATCH = 7, 5, 6, 8


class Embedded(nn.Module):
    """Token ids -> embedding -> tanh -> mean over the tokens -> head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.tanh(self.embed(ids)).mean(dim=1))
        return out


class OneHot(nn.Module):
    """The same function with the embedding as a Linear layer of one-hot inputs."""

    def __init__(self, embedded: Embedded) -> None:
        super().__init__()
        self.embed = nn.Linear(VOCAB, WIDTH, bias=False)
        self.head = nn.Linear(WIDTH, 3)
        with torch.no_grad():
            self.embed.weight.copy_(embedded.embed.weight.t())
            self.head.load_state_dict(embedded.head.state_dict())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        one_hot = F.one_hot(ids, VOCAB).to(self.embed.weight.dtype)
        out: torch.Tensor = self.head(torch.tanh(self.embed(one_hot)).mean(dim=1))
        return out


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    # unequal frequencies, so that A's eigenvalues (the frequencies) are distinct
    weights = torch.tensor([8.0, 1, 5, 2, 7, 3, 4])
    ids = torch.multinomial(weights, BATCH * TOKENS, replacement=True, generator=generator)
    return ids.view(BATCH, TOKENS), torch.randint(0, 3, (BATCH,), generator=generator)


def _train(model: nn.Module, options: dict[str, Any]) -> list[torch.Tensor]:
    """Four steps of SGD on the preconditioned gradients; each step's embedding gradient as
    an ``(in, out)`` matrix (the Embedding's layout)."""
    preconditioner = KFACPreconditioner(model, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    seen = []
    for step in range(4):
        ids, labels = _batch(step)
        optimizer.zero_grad()
        F.cross_entropy(model(ids), labels).backward()
        preconditioner.step()
        grad = model.embed.weight.grad
        assert grad is not None
        seen.append(grad.clone() if isinstance(model, Embedded) else grad.t().clone())
        optimizer.step()
    return seen


CURVATURE = {
    "factor_update_steps": 1,
    "inv_update_steps": 2,
    "damping": 0.01,
    "kl_clip": None,
    "factor_scale": "fisher",
    "running_average": "debiased",
}


@pytest.mark.parametrize(
    "options",
    [
        {"compute_method": "eigen"},
        {"compute_method": "inverse", "pi_damping": True},
        {"compute_method": "eigen", "scaling": "ekfac"},
        {"compute_method": "eigen", "scaling": "adam-eigenbasis"},
        {"compute_method": "eigen", "factor_samples": 3, "update_factors_in_hook": False},
    ],
    ids=["eigen", "inverse", "ekfac", "adam-eigenbasis", "sampled-saved"],
)
def test_an_embedding_is_preconditioned_as_the_linear_layer_of_one_hot_inputs(
    options: dict[str, Any],
) -> None:
    torch.manual_seed(0)
    embedded = Embedded().double()
    one_hot = OneHot(embedded).double()
    ours = _train(embedded, {**CURVATURE, **options, "embeddings": True})
    theirs = _train(one_hot, {**CURVATURE, **options})
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=f"step {step}")


def test_the_a_factor_is_the_diagonal_of_the_indices_frequencies() -> None:
    torch.manual_seed(0)
    model = Embedded().double()
    preconditioner = KFACPreconditioner(
        model, embeddings=True, factor_scale="fisher", factor_decay=0.0
    )
    ids, labels = _batch(0)
    F.cross_entropy(model(ids), labels).backward()
    preconditioner.step()
    layer = next(layer for layer in preconditioner.layers if layer.name == "embed")
    counts = torch.bincount(ids.reshape(-1), minlength=VOCAB).double()
    expected = torch.diag(counts / ids.numel())
    torch.testing.assert_close(layer.a_factor[0], expected, rtol=0, atol=1e-15)


def test_embeddings_are_left_to_the_optimizer_unless_asked_and_a_sparse_one_always(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = Embedded()
    assert [layer.name for layer in registered_layers(model)] == ["head"]
    assert [layer.name for layer in registered_layers(model, embeddings=True)] == [
        "embed",
        "head",
    ]
    sparse = Embedded()
    sparse.embed = nn.Embedding(VOCAB, WIDTH, sparse=True)
    with caplog.at_level(logging.INFO, logger="kaisa_ray.preconditioner"):
        preconditioner = KFACPreconditioner(sparse, embeddings=True)
    assert [layer.name for layer in preconditioner.layers] == ["head"]
    assert "sparse=True" in caplog.text


def test_the_plan_prices_an_embeddings_state_as_the_preconditioner_holds_it() -> None:
    torch.manual_seed(0)
    model = Embedded()
    preconditioner = KFACPreconditioner(model, embeddings=True, factor_update_steps=1)
    ids, labels = _batch(0)
    F.cross_entropy(model(ids), labels).backward()
    preconditioner.step()
    priced = plan(model, world_size=1, embeddings=True)
    assert [layer.name for layer in priced.layers] == ["embed", "head"]
    assert preconditioner.memory_usage() == priced.ranks[0].memory
    assert priced.ranks[0].memory != plan(model, world_size=1).ranks[0].memory


def test_an_embeddings_option_that_is_not_a_bool_is_refused() -> None:
    from kaisa_ray.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="embeddings='yes' must be True or False"):
        KFACPreconditioner(Embedded(), embeddings="yes")  # type: ignore[arg-type]
