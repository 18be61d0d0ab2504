"""K-FAC's products at matmul precision 'medium' on CPU (``kaisa_ray.products``): bfloat16
products with float32 accumulation where the CPU has them, one 2-D product a group for the
factors' Gram products, 'highest' below ``REDUCED_MIN_WORK``; each against float64."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kaisa_ray import KFACPreconditioner
from kaisa_ray.products import REDUCED_MIN_WORK, _mm, cpu_bfloat16, gram

BFLOAT16_CPU = torch.ops.mkldnn._is_mkldnn_bf16_supported()


@contextlib.contextmanager
def precision(name: str) -> Iterator[None]:
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(name)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def relative(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.double() - exact).norm() / exact.norm())


def features_first(k: int, d: int, n: int) -> torch.Tensor:
    """``(k, d, n)`` rows as the hooks hand them over: the transposed view of ``(k, n, d)``."""
    g = torch.Generator().manual_seed(k * d + n)
    return torch.randn(k, n, d, generator=g).transpose(-1, -2)


@pytest.mark.parametrize("k", [1, 3])
def test_a_gram_product_at_medium_is_the_float64_one_within_bfloat16s_rounding(k: int) -> None:
    rows = features_first(k, 256, 2048)
    exact = 0.5 * rows.double() @ rows.double().transpose(-1, -2)
    with precision("medium"):
        got = gram(rows, torch.full((k, 256, 256), float("nan")), alpha=0.5)
        assert torch.get_float32_matmul_precision() == "medium"
    error = relative(got, exact)
    assert error < 4e-3, error  # bfloat16's 8 bits: about 2e-3 on these products
    if BFLOAT16_CPU:
        assert error > 1e-5  # it did run in bfloat16 (float32 is about 1e-7 here)
    with precision("highest"):  # float32: the batched kernel, as before 'medium' had a path
        assert torch.equal(
            gram(rows, torch.empty(k, 256, 256), alpha=0.5),
            torch.baddbmm(
                torch.empty(k, 256, 256), rows, rows.transpose(-1, -2), beta=0, alpha=0.5
            ),
        )


def test_a_gram_product_adds_into_its_buffer() -> None:
    rows = features_first(1, 300, 4096)
    start = torch.eye(300)
    exact = 2.0 * start.double() + 0.25 * rows.double() @ rows.double().transpose(-1, -2)
    with precision("medium"):
        got = gram(rows, start.clone().unsqueeze(0), alpha=0.25, beta=2.0)
    assert relative(got, exact) < 4e-3


def test_a_product_too_small_for_bfloat16_runs_at_highest_and_leaves_medium_set() -> None:
    x, y = torch.randn(1, 64, 64), torch.randn(1, 64, 65)
    assert REDUCED_MIN_WORK > 64 * 64 * 65
    with precision("highest"):
        exact = torch.bmm(x, y)
    with precision("medium"):
        assert cpu_bfloat16(x)
        got = _mm(x, y)
        assert torch.get_float32_matmul_precision() == "medium"
    assert torch.equal(got, exact)
    rows = features_first(1, 26, 64)  # a small factor: its Gram product at 'highest' too
    with precision("medium"):
        small = gram(rows, torch.empty(1, 26, 26), alpha=1.0)
    with precision("highest"):
        assert torch.equal(small, gram(rows, torch.empty(1, 26, 26), alpha=1.0))


def test_a_large_product_at_medium_is_within_bfloat16s_rounding() -> None:
    x, y = torch.randn(1, 128, 785), torch.randn(1, 785, 785)
    exact = x.double() @ y.double()
    with precision("medium"):
        error = relative(_mm(x, y), exact)
    assert error < 4e-3, error
    if BFLOAT16_CPU:
        assert error > 1e-5


def wide() -> nn.Sequential:
    """A 784-input layer like LeNet's first Linear: products above ``REDUCED_MIN_WORK``."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))


@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_preconditioning_a_wide_layer_at_medium_stays_within_its_bound_of_float64(
    method: str,
) -> None:
    """The preconditioned gradients after factor, decomposition and quiet steps at 'medium'
    against the same preconditioner in float64, relative to their norm."""

    def preconditioned(name: str, dtype: torch.dtype) -> torch.Tensor:
        model = wide().to(dtype)
        pre = KFACPreconditioner(
            model,
            compute_method=method,
            damping=0.01,
            kl_clip=None,
            factor_update_steps=2,
            inv_update_steps=4,
            matmul_precision=name,
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(7):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(64, 784, generator=g), torch.randint(0, 10, (64,), generator=g)
            optimizer.zero_grad()
            F.cross_entropy(model(x.to(dtype)), y).backward()
            pre.step()
            if step < 6:
                optimizer.step()
        return torch.cat([p.grad.double().reshape(-1) for p in model.parameters()])  # type: ignore[union-attr]

    exact = preconditioned("highest", torch.float64)
    error = relative(preconditioned("medium", torch.float32), exact)
    assert error < 2e-2, error
    if BFLOAT16_CPU:
        assert error > 1e-5
