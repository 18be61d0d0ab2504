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
        {"compute_method": "eigen", "scaling": "adam-eigenbasis", "basis_update": "power-qr"},
        {"compute_method": "eigen", "factor_samples": 3, "update_factors_in_hook": False},
    ],
    ids=["eigen", "inverse", "ekfac", "adam-eigenbasis", "power-qr", "sampled-saved"],
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
    # held as its diagonal: (groups, vocabulary), not the (groups, vocabulary, vocabulary) matrix
    assert layer.a_factor is not None
    assert layer.a_factor.shape == (1, VOCAB)
    torch.testing.assert_close(layer.a_factor[0], counts / ids.numel(), rtol=0, atol=1e-15)


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


@pytest.mark.parametrize(
    "options",
    [
        {"compute_method": "eigen"},
        {"compute_method": "inverse"},
        {"compute_method": "eigen", "scaling": "adam-eigenbasis"},
        {"compute_method": "eigen", "scaling": "ekfac"},
    ],
    ids=["eigen", "inverse", "adam-eigenbasis", "ekfac"],
)
def test_a_vocabulary_of_fifty_thousand_costs_k_fac_memory_linear_in_it(
    options: dict[str, Any],
) -> None:
    """GPT-2's vocabulary (50,257): the embedding's A held whole would be 10 GB in float32,
    its basis or inverse as much again. Held as its diagonal, the layer's whole K-FAC state is
    the vocabulary's width times a few numbers, as ``plan()`` prices it, and a step takes it."""
    vocab, width = 50_257, 4
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(vocab, width), nn.Flatten(), nn.Linear(3 * width, 2))
    preconditioner = KFACPreconditioner(model, embeddings=True, factor_update_steps=1, **options)
    for _ in range(2):  # the second with bases (EKFAC fits its diagonal in them)
        model.zero_grad()
        ids = torch.randint(0, vocab, (16, 3))
        F.cross_entropy(model(ids), torch.randint(0, 2, (16,))).backward()
        preconditioner.step()
    embed = next(layer for layer in preconditioner.layers if layer.name == "0")
    used = embed.memory_usage()
    held = sum(used.values())
    # the factors, the decompositions and the buffers: a few vectors of the vocabulary and the
    # gradient-sized state of the per-coordinate scalings, never a vocabulary squared
    per_entry = 4 * (3 + 2 * width) + (8 * width if "scaling" in options else 0)
    assert held <= per_entry * vocab + 4 * 4 * width**2, used
    assert (
        preconditioner.memory_usage()
        == plan(model, world_size=1, embeddings=True, **options).ranks[0].memory
    )


def test_an_embeddings_option_that_is_not_a_bool_is_refused() -> None:
    from kaisa_ray.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="embeddings='yes' must be True or False"):
        KFACPreconditioner(Embedded(), embeddings="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "options",
    [
        {"compute_method": "eigen"},
        {"compute_method": "inverse", "pi_damping": True},
        {"compute_method": "eigen", "scaling": "adam-eigenbasis", "basis_update": "power-qr"},
    ],
    ids=["eigen", "inverse", "power-qr"],
)
def test_an_embeddings_a_is_decomposed_from_its_diagonal_without_a_dense_solver(
    options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No ``eigh``, Cholesky or QR of the vocabulary-wide A (its cost is cubic in the
    vocabulary): its eigenvalues are its diagonal and its basis the identity, or its damped
    inverse the reciprocals of its damped diagonal. (The preconditioned gradients equal the
    one-hot Linear layer's, whose A goes through the dense solvers: the test above.)"""
    widths: list[int] = []
    for name in ("eigh", "cholesky_ex", "qr"):
        solver = getattr(torch.linalg, name)

        def recording(matrix: torch.Tensor, *args: Any, _solver: Any = solver, **kw: Any) -> Any:
            widths.append(matrix.shape[-1])
            return _solver(matrix, *args, **kw)

        monkeypatch.setattr(torch.linalg, name, recording)
    torch.manual_seed(0)
    model = Embedded().double()
    preconditioner = KFACPreconditioner(model, **{**CURVATURE, **options, "embeddings": True})
    for step in range(4):
        ids, labels = _batch(step)
        model.zero_grad()
        F.cross_entropy(model(ids), labels).backward()
        preconditioner.step()
    assert widths  # the head's factors (6 and 3 wide) went through them
    assert VOCAB not in widths
    layer = next(layer for layer in preconditioner.layers if layer.name == "embed")
    assert layer.a_factor is not None
    assert layer.a_factor.shape == (1, VOCAB)  # its diagonal
    assert layer.a_factor.gt(0).all()
    held = layer.decomposition.tensors()
    # Nothing vocabulary-by-vocabulary is held: the basis is the identity, not stored, and the
    # inverse is diagonal, held as its diagonal.
    assert "qa" not in held
    assert all(list(tensor.shape).count(VOCAB) < 2 for tensor in held.values())
    if options["compute_method"] == "eigen":
        # decomposed at step 2 (every 2), from the factor of that step; A has changed since
        assert held["da"].shape == (1, VOCAB)
        assert held["da"].gt(0).all()
    else:
        assert held["a_inv"].shape == (1, VOCAB)
        assert held["a_inv"].gt(0).all()


@pytest.mark.parametrize(
    "options",
    [
        {"compute_method": "eigen", "compute_eigenvalue_outer_product": True},
        {"compute_method": "eigen"},
        {"compute_method": "eigen", "scaling": "adam-eigenbasis"},
        {"compute_method": "eigen", "scaling": "ekfac"},
        {"compute_method": "inverse"},
    ],
    ids=["outer-product", "eigen", "adam-eigenbasis", "ekfac", "inverse"],
)
def test_a_checkpoint_with_the_embeddings_a_whole_resumes_as_if_it_held_its_diagonal(
    options: dict[str, Any],
) -> None:
    """A checkpoint written before an embedding's A was held as its diagonal holds the whole
    ``(1, V, V)`` factor, and its inverse whole or ``eigh``'s basis of it: the identity's
    columns reordered (and signs flipped), the eigenvalues and any state kept in the basis
    with them. Loaded, the factor and inverse become their diagonals, the eigenvalues and
    state move to the identity's coordinates and the basis is let go of, and training goes on
    exactly as from the checkpoint this version writes."""
    options = {**CURVATURE, **options, "embeddings": True}
    torch.manual_seed(0)
    model = Embedded().double()
    preconditioner = KFACPreconditioner(model, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(3):
        ids, labels = _batch(step)
        optimizer.zero_grad()
        F.cross_entropy(model(ids), labels).backward()
        preconditioner.step()
        optimizer.step()
    state = preconditioner.state_dict()
    entry = state["layers"]["embed"]
    held = entry["decomposition"]
    assert "qa" not in held
    assert entry["a_factor"].shape == (1, VOCAB)
    old = dict(held)
    if "a_inv" in held:
        old["a_inv"] = torch.diag_embed(held["a_inv"])
    else:
        # what eigh would have returned: the columns by ascending eigenvalue, one sign flipped
        order = held["da"][0].argsort()
        basis = torch.eye(VOCAB, dtype=torch.float64)[:, order]
        basis[:, 2] *= -1
        spread = basis * basis
        old["qa"] = basis[None]
        old["da"] = held["da"] @ spread
        for part in ("dgda", "v", "s"):
            if part in held:
                old[part] = held[part] @ spread
        if "m" in held:
            old["m"] = held["m"] @ basis
    whole = {**entry, "a_factor": torch.diag_embed(entry["a_factor"]), "decomposition": old}
    written_before = {**state, "layers": {**state["layers"], "embed": whole}}

    def resume(checkpoint: dict[str, Any]) -> list[torch.Tensor]:
        copy = Embedded().double()
        copy.load_state_dict(model.state_dict())
        resumed = KFACPreconditioner(copy, **options)
        resumed.load_state_dict(checkpoint)
        embed = next(layer for layer in resumed.layers if layer.name == "embed")
        assert embed.a_factor is not None
        assert embed.a_factor.shape == (1, VOCAB)
        tensors = embed.decomposition.tensors()
        assert "qa" not in tensors
        assert all(list(tensor.shape).count(VOCAB) < 2 for tensor in tensors.values())
        sgd = torch.optim.SGD(copy.parameters(), lr=0.05)
        grads = []
        for step in range(3, 7):
            ids, labels = _batch(step)
            sgd.zero_grad()
            F.cross_entropy(copy(ids), labels).backward()
            resumed.step()
            grads.append(torch.cat([p.grad.reshape(-1) for p in copy.parameters()]))
            sgd.step()
        return grads

    for step, (a, b) in enumerate(zip(resume(written_before), resume(state), strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=f"step {step}")
