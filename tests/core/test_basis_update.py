"""``basis_update='power-qr'``: the bases of 'adam-eigenbasis' and 'ekfac' refreshed by one
power iteration from the basis held and a QR factorisation (SOAP's refresh) instead of
``eigh``: the operation as defined, computed densely in float64; what it gives on a basis
that is already the factor's and after many refreshes; the first decomposition an ``eigh``
and later ones refreshes, in the preconditioner; batched equal to one layer at a time; the
fallback when a refresh is not finite; and the options that refuse it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kaisa_ray import KFACPreconditioner
from kaisa_ray.batching import decompose
from kaisa_ray.decomposition import EigenDecomposition
from kaisa_ray.errors import ConfigurationError
from kaisa_ray.solvers import power_qr
from kaisa_train.spec import KFACSpec


def spd(d: int, seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(3 * d, d, generator=generator, dtype=dtype)
    return x.T @ x / (3 * d)


def orthogonal(d: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=torch.float64))
    return q


def gram_schmidt(columns: torch.Tensor) -> torch.Tensor:
    """Classical Gram-Schmidt, column by column (the definition of QR's Q with R's diagonal
    positive)."""
    out = torch.zeros_like(columns)
    for j in range(columns.shape[1]):
        v = columns[:, j].clone()
        for i in range(j):
            v -= (out[:, i] @ columns[:, j]) * out[:, i]
        out[:, j] = v / v.norm()
    return out


def test_a_refresh_is_one_step_of_subspace_iteration_as_defined_in_float64() -> None:
    factor, basis = spd(7, 0), orthogonal(7, 1)
    quotients = torch.stack([basis[:, j] @ factor @ basis[:, j] for j in range(7)])
    order = quotients.argsort(descending=True)
    expected = gram_schmidt(factor @ basis[:, order])

    values, vectors = power_qr(factor, basis)

    torch.testing.assert_close(vectors, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(values, quotients[order].clamp(min=0), rtol=0, atol=1e-12)
    assert bool((values[:-1] >= values[1:]).all())  # largest first


def test_a_basis_of_the_factors_eigenvectors_comes_back_as_itself_largest_first() -> None:
    factor = spd(6, 2)
    eigenvalues, eigenvectors = torch.linalg.eigh(factor)  # ascending

    values, vectors = power_qr(factor, eigenvectors)

    torch.testing.assert_close(vectors, eigenvectors.flip(-1), rtol=0, atol=1e-10)
    torch.testing.assert_close(values, eigenvalues.flip(-1), rtol=0, atol=1e-12)


def test_repeated_refreshes_converge_to_the_eigenbasis() -> None:
    """Distinct eigenvalues (a factor of 2 apart): from a random basis, the refreshed bases
    converge to the eigenvectors (up to sign), their quotients to the eigenvalues."""
    eigenvalues = 2.0 ** -torch.arange(6, dtype=torch.float64)
    eigenvectors = orthogonal(6, 3)
    factor = eigenvectors @ torch.diag(eigenvalues) @ eigenvectors.T
    basis = orthogonal(6, 4)
    for _ in range(80):
        values, basis = power_qr(factor, basis)
    torch.testing.assert_close(values, eigenvalues, rtol=1e-9, atol=0)
    overlap = (basis.T @ eigenvectors).abs()
    torch.testing.assert_close(overlap, torch.eye(6, dtype=torch.float64), rtol=0, atol=1e-9)


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))


def trained(basis_update: str, steps: int, scaling: str = "adam-eigenbasis") -> nn.Module:
    """A model after ``steps`` steps of K-FAC with the factors and the bases every step."""
    model = small_model().double()
    preconditioner = KFACPreconditioner(
        model,
        factor_update_steps=1,
        inv_update_steps=1,
        kl_clip=None,
        lr=0.1,
        compute_method="eigen",
        scaling=scaling,
        basis_update=basis_update,
        running_average="debiased",
        factor_scale="fisher",
        loglevel=0,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(5)
    for _ in range(steps):
        x = torch.randn(32, 5, generator=generator, dtype=torch.float64)
        y = torch.randint(0, 3, (32,), generator=generator)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        preconditioner.step()
        optimizer.step()
    model.preconditioner = preconditioner  # type: ignore[assignment]
    return model


def test_the_first_decomposition_is_eigh_and_each_later_one_a_refresh_of_the_last() -> None:
    first = trained("power-qr", 1).preconditioner  # type: ignore[union-attr]
    with_eigh = trained("eigh", 1).preconditioner  # type: ignore[union-attr]
    for ours, theirs in zip(first.layers, with_eigh.layers, strict=True):
        assert torch.equal(ours.decomposition.qa, theirs.decomposition.qa)
        assert torch.equal(ours.decomposition.qg, theirs.decomposition.qg)

    two = trained("power-qr", 2).preconditioner  # type: ignore[union-attr]
    for before, after in zip(first.layers, two.layers, strict=True):
        a, g = after.factors()  # the factors step 2 decomposed (no factor update since)
        _, qa = power_qr(a, before.decomposition.qa)
        _, qg = power_qr(g, before.decomposition.qg)
        torch.testing.assert_close(after.decomposition.qa, qa, rtol=0, atol=1e-12)
        torch.testing.assert_close(after.decomposition.qg, qg, rtol=0, atol=1e-12)
        # ... and not what eigh gives (the refreshed basis is a different basis)
        eigh_qa = torch.linalg.eigh(a)[1]
        assert not torch.allclose(after.decomposition.qa.abs(), eigh_qa.abs(), atol=1e-6)


def off_diagonal(factor: torch.Tensor, basis: torch.Tensor) -> float:
    """``‖QᵀFQ - diag(QᵀFQ)‖ / ‖F‖``: how far ``basis`` is from diagonalising ``factor``."""
    rotated = basis.transpose(-1, -2) @ factor @ basis
    diagonal = torch.diag_embed(torch.diagonal(rotated, dim1=-2, dim2=-1))
    return float((rotated - diagonal).norm() / factor.norm())


@pytest.mark.parametrize("scaling", ["adam-eigenbasis", "ekfac"])
def test_refreshed_bases_keep_diagonalising_the_changing_factors(scaling: str) -> None:
    """After 30 steps of changing factors, each refreshed every step, no basis leaves more
    than 15% of its factor off the diagonal, and on average a tenth of what a random basis
    leaves."""
    preconditioner = trained("power-qr", 30, scaling).preconditioner  # type: ignore[union-attr]
    refreshed, random = [], []
    for layer in preconditioner.layers:
        a, g = layer.factors()
        for factor, basis in ((a, layer.decomposition.qa), (g, layer.decomposition.qg)):
            refreshed.append(off_diagonal(factor, basis))
            d = factor.shape[-1]
            random.append(off_diagonal(factor, orthogonal(d, d).unsqueeze(0)))
    assert max(refreshed) <= 0.15, refreshed
    assert sum(refreshed) <= 0.1 * sum(random), (refreshed, random)


def test_batched_refreshes_equal_one_layer_at_a_time() -> None:
    """Two layers of one shape refreshed in one batched call (``batching.decompose``) and each
    on its own (``compute_a``/``compute_g``) agree to 1e-6 in float32."""
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
    batched = KFACPreconditioner(
        model,
        inv_update_steps=1,
        kl_clip=None,
        compute_method="eigen",
        scaling="adam-eigenbasis",
        basis_update="power-qr",
        loglevel=0,
    )
    x = torch.randn(16, 6)
    model(x).square().mean().backward()
    batched.step()  # the first decomposition: eigh
    layers = batched.layers
    for layer, seed in zip(layers, (10, 11), strict=True):
        layer.a_factor = spd(7, seed, torch.float32).unsqueeze(0)
        layer.g_factor = spd(6, seed + 5, torch.float32).unsqueeze(0)
    bases = [(layer.decomposition.qa.clone(), layer.decomposition.qg.clone()) for layer in layers]
    work = []
    for layer in layers:
        a, g = layer.factors()
        work += [(layer, "A", a, 0.1), (layer, "G", g, 0.1)]
    decompose(work)
    for layer, (qa, qg) in zip(layers, bases, strict=True):
        alone = EigenDecomposition(name="alone", inv_dtype=torch.float32, outer_product=False)
        alone.basis_update = layer.decomposition.basis_update
        alone.qa, alone.qg = qa, qg
        a, g = layer.factors()
        alone.compute_a(a, 0.1)
        alone.compute_g(g, 0.1)
        torch.testing.assert_close(layer.decomposition.qa, alone.qa, rtol=0, atol=1e-6)
        torch.testing.assert_close(layer.decomposition.qg, alone.qg, rtol=0, atol=1e-6)
        torch.testing.assert_close(layer.decomposition.da, alone.da, rtol=1e-6, atol=1e-7)


def test_a_refresh_that_is_not_finite_falls_back_to_eigh() -> None:
    decomposition = EigenDecomposition(name="l", inv_dtype=torch.float64, outer_product=False)
    decomposition.basis_update = decomposition.basis_update.__class__("power-qr")
    factor = spd(5, 7).unsqueeze(0)
    decomposition.qa = torch.full((1, 5, 5), float("nan"), dtype=torch.float64)
    assert decomposition.refreshes("A")
    decomposition.compute_a(factor, 0.1)
    values, vectors = torch.linalg.eigh(factor)
    torch.testing.assert_close(decomposition.da, values, rtol=0, atol=1e-12)
    torch.testing.assert_close(decomposition.qa.abs(), vectors.abs(), rtol=0, atol=1e-10)


def test_the_kronecker_scaling_refuses_it_naming_the_fix() -> None:
    with pytest.raises(ConfigurationError, match="scaling='adam-eigenbasis' or 'ekfac'"):
        KFACPreconditioner(small_model(), compute_method="eigen", basis_update="power-qr")
    refused = "basis_update='lanczos' is not valid; choose one of 'eigh', 'power-qr'"
    with pytest.raises(ConfigurationError, match=refused):
        KFACPreconditioner(small_model(), basis_update="lanczos")
    with pytest.raises(ValueError, match=r"set scaling: adam-eigenbasis \(or ekfac\), or"):
        KFACSpec(basis_update="power-qr")
    spec = KFACSpec(compute_method="eigen", scaling="adam-eigenbasis", basis_update="power-qr")
    assert spec.preconditioner_options()["basis_update"] == "power-qr"
    assert KFACSpec().preconditioner_options()["basis_update"] == "eigh"
