"""The preconditioning products of the two methods (``kaisa_ray.decomposition`` states
them): ``Q_G [(Q_Gᵀ ∇W Q_A) / (λ_G λ_Aᵀ + γ)] Q_Aᵀ`` and ``(G + γI)⁻¹ ∇W (A + γI)⁻¹`` for
``(k, g, a)`` gradients, one layer's groups or several layers' stacked.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

from kaisa_ray.solvers import pi_ratio

REDUCED_MIN_WORK = 2**21
"""Multiply-adds below which a float32 product on CPU runs at 'highest' even at matmul
precision 'medium': oneDNN's bfloat16 path has a fixed cost a call that a small product does
not earn back (``benchmarks/step_phases.py`` measures the products both ways)."""


@contextlib.contextmanager
def matmul_precision(precision: str) -> Iterator[None]:
    """Run the products inside at ``torch.set_float32_matmul_precision(precision)``."""
    before = torch.get_float32_matmul_precision()
    if before == precision:
        yield
        return
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def cpu_bfloat16(x: torch.Tensor) -> bool:
    """Whether a product of ``x`` on CPU runs in bfloat16: bfloat16 operands, or float32 ones
    at matmul precision 'medium'."""
    if x.device.type != "cpu":
        return False
    if x.dtype == torch.bfloat16:
        return True
    return x.dtype == torch.float32 and torch.get_float32_matmul_precision() == "medium"


def gram(rows: torch.Tensor, out: torch.Tensor, *, alpha: float, beta: float = 0.0) -> torch.Tensor:
    """``out = β·out + α·rows rowsᵀ`` in place for ``(k, d, n)`` rows (``β`` 0: ``out``'s
    contents are ignored). On CPU where the product runs in bfloat16 (``cpu_bfloat16``), one
    2-D product a group: oneDNN's batched kernel takes a slow path for the transposed view
    that features-first rows are, its 2-D kernel does not; a float32 product too small to
    gain from bfloat16 runs at 'highest'."""
    if not cpu_bfloat16(rows):
        return torch.baddbmm(out, rows, rows.transpose(-1, -2), beta=beta, alpha=alpha, out=out)
    k, d, n = rows.shape
    small = rows.dtype == torch.float32 and d * d * n < REDUCED_MIN_WORK
    with matmul_precision("highest") if small else contextlib.nullcontext():
        for i in range(k):
            torch.addmm(out[i], rows[i], rows[i].T, beta=beta, alpha=alpha, out=out[i])
    return out


def eigen_denominator(
    da: torch.Tensor, dg: torch.Tensor, damping: float | torch.Tensor, pi: bool
) -> torch.Tensor:
    """``λ_G λ_Aᵀ + γ``, or with π-damping ``(λ_G + √γ/π)(λ_A + π√γ)ᵀ``: ``(k, g, a)`` from
    eigenvalues ``da`` ``(k, a)`` and ``dg`` ``(k, g)`` (any number of stacked groups ``k``;
    ``damping`` a float or a scalar on the device)."""
    if not pi:
        return dg.unsqueeze(-1) * da.unsqueeze(-2) + damping
    ratio = pi_ratio(da, dg)  # (k, 1, 1)
    root = damping.sqrt() if isinstance(damping, torch.Tensor) else math.sqrt(damping)
    denominator: torch.Tensor = (dg.unsqueeze(-1) + root / ratio) * (
        da.unsqueeze(-2) + ratio * root
    )
    return denominator


def eigen_precondition(
    grad: torch.Tensor,
    qa: torch.Tensor | None,
    qg: torch.Tensor,
    *,
    dgda: torch.Tensor | None = None,
    denominator: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``Q_G [(Q_Gᵀ ∇W Q_A) ⊙ dgda] Q_Aᵀ`` (or ``/ denominator``) for ``(k, g, a)`` gradients
    already in the decompositions' dtype: one layer's groups, or several layers' stacked
    (into ``out`` where given). ``qa`` None: A's basis is the identity (a diagonal A), and
    its products are skipped."""
    rotated = _mm(qg.transpose(-1, -2), grad)
    if qa is not None:
        rotated = _mm(rotated, qa)
    if dgda is not None:
        rotated = rotated * dgda
    elif denominator is not None:
        rotated = rotated / denominator
    else:
        raise ValueError("eigen_precondition needs dgda or denominator")
    if qa is None:
        return _mm(qg, rotated, out=out)
    return _mm(_mm(qg, rotated), qa.transpose(-1, -2), out=out)


def inverse_precondition(
    grad: torch.Tensor,
    a_inv: torch.Tensor,
    g_inv: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    diagonal_a: bool = False,
) -> torch.Tensor:
    """``(G + γI)⁻¹ ∇W (A + γI)⁻¹`` for ``(k, g, a)`` gradients in the inverses' dtype (into
    ``out`` where given); ``diagonal_a``: ``(A + γI)⁻¹`` is diagonal, ``a_inv`` its diagonal
    ``(k, a)``, and it multiplies the columns instead of a product."""
    if not diagonal_a:
        return _mm(_mm(g_inv, grad), a_inv, out=out)
    columns = a_inv.unsqueeze(-2)
    left = _mm(g_inv, grad)
    return left.mul_(columns) if out is None else torch.mul(left, columns, out=out)


def _mm(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ y``: ``bmm`` where both are ``(b, ·, ·)`` stacks of one length, the kernel that
    ``matmul`` reaches there too (the same values) without the broadcasting views it launches
    first (a shape group's step is a handful of operations, and each costs the host time)."""
    small = x.shape[-2] * x.shape[-1] * y.shape[-1] < REDUCED_MIN_WORK
    if small and x.dtype == torch.float32 and cpu_bfloat16(x):
        with matmul_precision("highest"):  # too small to gain from bfloat16
            return _mm(x, y, out)
    if x.dim() == 3 and y.dim() == 3 and x.shape[0] == y.shape[0]:
        return torch.bmm(x, y) if out is None else torch.bmm(x, y, out=out)
    return x @ y if out is None else torch.matmul(x, y, out=out)
