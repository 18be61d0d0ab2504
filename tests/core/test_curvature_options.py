"""The curvature options against their definitions, in float64.

- ``running_average='debiased'``: the factor used is the bias-corrected exponential average of
  the batch factors, ``Σ_i decay^(n-i) (1-decay) B_i / (1 - decayⁿ)``; the first is ``B_1``.
- ``factor_scale='fisher'``: the Kronecker factors of the Fisher, built here from per-example
  gradients, each from its own backward pass of that example's loss: for a Linear layer and one
  example, ``G ⊗ A`` is exactly the example's gradient outer product; for Conv2d the factors of
  Grosse & Martens (2016, 'expand') and Eschenhagen et al. (2023, 'reduce') from explicit
  ``F.unfold`` patches.
- ``pi_damping``: both methods equal the dense solve with
  ``(G + √γ/π I) ⊗ (A + π√γ I)``, ``π = sqrt((tr A / dim A) / (tr G / dim G))``.
- ``factor_samples``: the factors of the first n examples.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kaisa_ray import KFACPreconditioner
from kaisa_ray.errors import ConfigurationError


@pytest.fixture(autouse=True)
def _float64_default() -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def example_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A mean over examples of per-example losses (what the Fisher scaling assumes)."""
    return ((out - target) ** 2).flatten(1).sum(dim=1).mean()


def one_step(layer: nn.Module, x: torch.Tensor, **options: object) -> KFACPreconditioner:
    """One K-FAC step on ``x`` with decay 0, so the factors are this batch's."""
    preconditioner = KFACPreconditioner(
        layer, factor_decay=0.0, kl_clip=None, lr=0.0, loglevel=0, **options
    )
    out = layer(x)
    torch.manual_seed(7)
    example_loss(out, torch.randn_like(out)).backward()
    preconditioner.step()
    return preconditioner


def per_example_output_grads(layer: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """``∂ℓ_n/∂out_n`` for each example, each from its own forward and backward."""
    out = layer(x)
    torch.manual_seed(7)
    target = torch.randn_like(out)
    grads = []
    for n in range(x.shape[0]):
        single = layer(x[n : n + 1])
        single.retain_grad()
        example_loss(single, target[n : n + 1]).backward()
        assert single.grad is not None
        grads.append(single.grad[0].clone())
    layer.zero_grad()
    return grads


def with_ones(rows: torch.Tensor) -> torch.Tensor:
    return torch.cat([rows, torch.ones(rows.shape[0], 1)], dim=1)


def test_debiased_average_is_the_bias_corrected_mean_of_the_batches() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(5, 3)
    decay = 0.7
    preconditioner = KFACPreconditioner(
        layer,
        factor_decay=decay,
        running_average="debiased",
        kl_clip=None,
        loglevel=0,
    )
    batches_a, batches_g = [], []
    for step in range(3):
        x = torch.randn(6, 5)
        out = layer(x)
        out.retain_grad()
        torch.manual_seed(100 + step)
        example_loss(out, torch.randn_like(out)).backward()
        assert out.grad is not None
        batches_a.append(with_ones(x).T @ with_ones(x) / 6)
        batches_g.append(out.grad.T @ out.grad / 6)
        preconditioner.step()
        layer.zero_grad()
        a, g = preconditioner.layers[0].factors()
        n = step + 1
        weights = [decay ** (n - 1 - i) * (1 - decay) for i in range(n)]
        expected_a = sum(w * b for w, b in zip(weights, batches_a, strict=True)) / (1 - decay**n)
        expected_g = sum(w * b for w, b in zip(weights, batches_g, strict=True)) / (1 - decay**n)
        torch.testing.assert_close(a[0], expected_a, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(g[0], expected_g, rtol=1e-12, atol=1e-14)
        if step == 0:  # the first factor is exactly the first batch's, no identity in it
            torch.testing.assert_close(a[0], batches_a[0], rtol=1e-12, atol=1e-14)


def test_fisher_linear_one_example_is_the_exact_gradient_outer_product() -> None:
    torch.manual_seed(1)
    layer = nn.Linear(4, 3)
    x = torch.randn(1, 4)
    preconditioner = one_step(layer, x, factor_scale="fisher")
    a, g = preconditioner.layers[0].factors()
    layer.zero_grad()  # step() replaced .grad: recompute the raw gradient
    out = layer(x)
    torch.manual_seed(7)
    example_loss(out, torch.randn_like(out)).backward()
    grad = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], dim=1)
    vec = grad.reshape(-1)  # row-major: vec(d aᵀ) = d ⊗ a
    torch.testing.assert_close(torch.kron(g[0], a[0]), torch.outer(vec, vec), rtol=1e-12, atol=0)


def test_fisher_linear_factors_are_means_over_per_example_gradients() -> None:
    torch.manual_seed(2)
    layer = nn.Linear(4, 3)
    x = torch.randn(5, 4)
    grads = per_example_output_grads(layer, x)
    a, g = one_step(layer, x, factor_scale="fisher").layers[0].factors()
    expected_g = sum(torch.outer(d, d) for d in grads) / len(grads)
    torch.testing.assert_close(g[0], expected_g, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(a[0], with_ones(x).T @ with_ones(x) / 5, rtol=1e-12, atol=0)
    # The reference scaling is the mean loss's: smaller by the batch size squared.
    _, g_reference = one_step(layer, x).layers[0].factors()
    torch.testing.assert_close(g_reference[0] * 25, expected_g, rtol=1e-12, atol=1e-15)


def test_fisher_linear_on_sequences_treats_each_row_as_an_example() -> None:
    """A sequence model's mean loss over (sample, token) rows: each row is an example."""
    torch.manual_seed(3)
    layer = nn.Linear(4, 3)
    x = torch.randn(2, 3, 4)
    out = layer(x)
    out.retain_grad()
    torch.manual_seed(7)
    target = torch.randn_like(out)
    ((out - target) ** 2).sum(dim=-1).mean().backward()  # mean over the 6 rows
    assert out.grad is not None
    rows = out.grad.reshape(6, 3) * 6  # per-row gradients
    layer.zero_grad()
    preconditioner = KFACPreconditioner(
        layer, factor_decay=0.0, kl_clip=None, factor_scale="fisher", loglevel=0
    )
    out = layer(x)
    ((out - target) ** 2).sum(dim=-1).mean().backward()
    preconditioner.step()
    _, g = preconditioner.layers[0].factors()
    torch.testing.assert_close(g[0], rows.T @ rows / 6, rtol=1e-12, atol=1e-15)


def _patches(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """``(batch, positions, in*kh*kw + 1)``: explicit unfold, with the bias column."""
    ph, pw = conv.padding  # type: ignore[misc]
    cols = F.unfold(F.pad(x, (pw, pw, ph, ph)), conv.kernel_size, stride=conv.stride)
    cols = cols.transpose(1, 2)
    return torch.cat([cols, torch.ones(*cols.shape[:2], 1)], dim=-1)


def test_fisher_conv_expand_are_grosse_and_martens_kfc_factors() -> None:
    torch.manual_seed(4)
    conv = nn.Conv2d(2, 3, 3, stride=2, padding=1)
    x = torch.randn(4, 2, 7, 7)
    grads = per_example_output_grads(conv, x)  # each (3, 4, 4)
    a, g = one_step(conv, x, factor_scale="fisher").layers[0].factors()
    patches = _patches(conv, x)  # (4, 16, 19)
    batch, positions, _ = patches.shape
    rows = patches.reshape(-1, patches.shape[-1])
    expected_a = rows.T @ rows / (batch * positions)  # E_{n,p}[a aᵀ]
    d = torch.stack([gr.reshape(3, -1).T for gr in grads])  # (batch, positions, 3)
    d_rows = d.reshape(-1, 3)
    expected_g = positions * (d_rows.T @ d_rows) / (batch * positions)  # P · E_{n,p}[d dᵀ]
    torch.testing.assert_close(a[0], expected_a, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(g[0], expected_g, rtol=1e-12, atol=1e-15)


def test_fisher_conv_reduce_are_eschenhagen_factors() -> None:
    torch.manual_seed(5)
    conv = nn.Conv2d(2, 3, 3, padding=1)
    x = torch.randn(4, 2, 5, 5)
    grads = per_example_output_grads(conv, x)
    a, g = one_step(conv, x, factor_scale="fisher", kfac_approx="reduce").layers[0].factors()
    mean_patch = _patches(conv, x).mean(dim=1)  # ā_n with the bias 1
    expected_a = mean_patch.T @ mean_patch / 4  # E_n[ā āᵀ]
    summed = torch.stack([gr.reshape(3, -1).sum(dim=1) for gr in grads])  # Σ_p d_{n,p}
    expected_g = summed.T @ summed / 4
    torch.testing.assert_close(a[0], expected_a, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(g[0], expected_g, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_fisher_factors_do_not_depend_on_the_batch_size(approx: str) -> None:
    """The same examples twice over: the Fisher's factors are unchanged, the reference G
    shrinks four-fold (the reason a damping value means different things at each batch)."""
    torch.manual_seed(6)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(2 * 4 * 4, 3))
    x = torch.randn(3, 1, 6, 6)
    factors = {}
    for scale in ("fisher", "reference"):
        for repeat in (1, 2):
            preconditioner = KFACPreconditioner(
                model,
                factor_decay=0.0,
                kl_clip=None,
                factor_scale=scale,
                kfac_approx=approx,
                loglevel=0,
            )
            out = model(x.repeat(repeat, 1, 1, 1))
            torch.manual_seed(7)
            target = torch.randn(3, 3).repeat(repeat, 1)
            example_loss(out, target).backward()
            preconditioner.step()
            factors[scale, repeat] = [f for layer in preconditioner.layers for f in layer.factors()]
            preconditioner.remove_hooks()
            model.zero_grad()
    for once, twice in zip(factors["fisher", 1], factors["fisher", 2], strict=True):
        torch.testing.assert_close(once, twice, rtol=1e-10, atol=1e-14)
    for index in (1, 3):  # the G factors
        torch.testing.assert_close(
            factors["reference", 2][index] * 4, factors["reference", 1][index], rtol=1e-10, atol=0
        )


@pytest.mark.parametrize("in_hook", [True, False])
def test_fisher_accumulation_equals_one_combined_batch(in_hook: bool) -> None:
    torch.manual_seed(8)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(2 * 4 * 4, 3))
    x, target = torch.randn(6, 1, 6, 6), torch.randn(6, 3)
    results = []
    for micro in (1, 2):
        preconditioner = KFACPreconditioner(
            model,
            factor_decay=0.0,
            kl_clip=None,
            factor_scale="fisher",
            accumulation_steps=micro,
            update_factors_in_hook=in_hook,
            loglevel=0,
        )
        for xs, ts in zip(x.chunk(micro), target.chunk(micro), strict=True):
            (example_loss(model(xs), ts) / micro).backward()
        preconditioner.step()
        results.append([f for layer in preconditioner.layers for f in layer.factors()])
        preconditioner.remove_hooks()
        model.zero_grad()
    for one, two in zip(*results, strict=True):
        torch.testing.assert_close(one, two, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("method", ["eigen", "inverse"])
@pytest.mark.parametrize("outer_product", [True, False])
def test_pi_damping_equals_the_dense_split_damped_solve(method: str, outer_product: bool) -> None:
    torch.manual_seed(9)
    layer = nn.Linear(5, 4)
    x = torch.randn(3, 5)  # rank-deficient factors: damping matters
    damping = 0.05
    preconditioner = one_step(
        layer,
        x,
        pi_damping=True,
        damping=damping,
        compute_method=method,
        compute_eigenvalue_outer_product=outer_product,
        factor_scale="fisher",
    )
    a, g = preconditioner.layers[0].factors()
    a, g = a[0], g[0]
    pi = math.sqrt((a.trace() / a.shape[0]) / (g.trace() / g.shape[0]))
    root = math.sqrt(damping)
    dense = torch.kron(g + root / pi * torch.eye(4), a + pi * root * torch.eye(6))
    layer.zero_grad()
    out = layer(x)
    torch.manual_seed(7)
    example_loss(out, torch.randn_like(out)).backward()
    raw = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], dim=1)
    expected = torch.linalg.solve(dense, raw.reshape(-1)).reshape(4, 6)
    got = preconditioner.layers[0].precondition(raw[None], damping)[0]
    tolerance = 1e-7 if method == "eigen" else 1e-10  # eigenvalues clamped at 0 (rank 3)
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=1e-12)


def test_factor_samples_build_the_factors_of_the_first_examples() -> None:
    torch.manual_seed(10)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(2 * 4 * 4, 3))
    x, target = torch.randn(8, 1, 6, 6), torch.randn(8, 3)
    sampled = KFACPreconditioner(
        model, factor_decay=0.0, kl_clip=None, factor_scale="fisher", factor_samples=3, loglevel=0
    )
    example_loss(model(x), target).backward()
    sampled.step()
    got = [f for layer in sampled.layers for f in layer.factors()]
    sampled.remove_hooks()
    model.zero_grad()
    full = KFACPreconditioner(model, factor_decay=0.0, kl_clip=None, factor_scale="fisher")
    # the first 3 examples' per-example gradients are those of the 8-example mean loss times 8;
    # as a 3-example mean loss they are the same gradients times 3: scale the loss to match
    (example_loss(model(x[:3]), target[:3])).backward()
    full.step()
    expected = [f for layer in full.layers for f in layer.factors()]
    for one, two in zip(got, expected, strict=True):
        torch.testing.assert_close(one, two, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"running_average": "zero"}, "running_average='zero' is not valid; choose one of"),
        ({"factor_scale": "natural"}, "factor_scale='natural' is not valid"),
        ({"factor_samples": 0}, "factor_samples=0 must be a positive integer"),
        ({"pi_damping": "yes"}, "pi_damping='yes' must be True or False"),
    ],
)
def test_bad_curvature_options_are_refused_naming_them(
    kwargs: dict[str, object], match: str
) -> None:
    with pytest.raises(ConfigurationError, match=match):
        KFACPreconditioner(nn.Linear(2, 2), **kwargs)  # type: ignore[arg-type]


def test_a_resumed_debiased_run_continues_bit_for_bit() -> None:
    options = {
        "running_average": "debiased",
        "factor_scale": "fisher",
        "pi_damping": True,
        "factor_update_steps": 2,
        "inv_update_steps": 4,
        "damping": 0.01,
        "kl_clip": 0.01,
        "loglevel": 0,
    }

    def build() -> tuple[nn.Module, KFACPreconditioner, torch.optim.Optimizer]:
        torch.manual_seed(11)
        model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(2 * 4 * 4, 3))
        return model, KFACPreconditioner(model, **options), torch.optim.SGD(model.parameters(), 0.1)

    def train(
        model: nn.Module, pre: KFACPreconditioner, opt: torch.optim.Optimizer, steps: range
    ) -> None:
        for step in steps:
            generator = torch.Generator().manual_seed(step)
            x = torch.randn(4, 1, 6, 6, generator=generator)
            y = torch.randint(0, 3, (4,), generator=generator)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            pre.step()
            opt.step()

    model, pre, opt = build()
    train(model, pre, opt, range(10))
    straight = [p.detach().clone() for p in model.parameters()]
    model, pre, opt = build()
    train(model, pre, opt, range(5))
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "kfac": pre.state_dict()}
    assert pre.layers[0].average_weight not in (0.0, 1.0)
    model, pre, opt = build()
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    pre.load_state_dict(state["kfac"])
    train(model, pre, opt, range(5, 10))
    for a, b in zip(straight, model.parameters(), strict=True):
        assert torch.equal(a, b.detach())
