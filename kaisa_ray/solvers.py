"""K-FAC's robust solvers of one factor or a stack of factors: ``eigh`` and the damped
inverse through Cholesky, each retried in float64 when float32 fails (``None`` when both do,
and the caller keeps the previous decomposition), a basis refreshed by one power iteration
and QR, π-damping's ratio, and the finiteness checks that decide it without an element-wise
temporary.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least float32: half-precision factors are decomposed in float32."""
    return torch.promote_types(dtype, torch.float32)


def attempt_dtypes(dtype: torch.dtype) -> list[torch.dtype]:
    first = working_dtype(dtype)
    return [first] if first == torch.float64 else [first, torch.float64]


def robust_eigh(factor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Eigenvalues (clamped at 0) and eigenvectors of symmetric ``factor``, or ``None``."""
    for dtype in attempt_dtypes(factor.dtype):
        try:
            eigenvalues, eigenvectors = torch.linalg.eigh(factor.to(dtype))
        except RuntimeError:  # torch.linalg.LinAlgError
            logger.debug("eigh failed in %s; retrying in higher precision", dtype)
            continue
        if all_finite(eigenvalues) and all_finite(eigenvectors):
            return eigenvalues.clamp(min=0.0), eigenvectors
    return None


def power_qr(factors: torch.Tensor, bases: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of subspace iteration from ``bases`` (SOAP's refresh, Vyas et al. 2024): the
    columns of ``Q`` sorted by their Rayleigh quotients ``qᵀFq`` (largest first), then
    ``Q' = qr(F Q)`` with each column's sign that of ``F q`` (R's diagonal made positive),
    so that a basis that is already ``F``'s comes back as itself, reordered. Returns
    ``(quotients, Q')``: the sorted quotients, clamped at 0, stand in for the eigenvalues.
    ``factors`` and ``bases`` are ``(..., d, d)`` stacks, computed in the working dtype."""
    dtype = working_dtype(factors.dtype)
    bases = bases.to(dtype)
    product = factors.to(dtype) @ bases
    quotients = (bases * product).sum(dim=-2)
    order = quotients.argsort(dim=-1, descending=True)
    product = product.gather(-1, order.unsqueeze(-2).expand_as(product))
    q, r = torch.linalg.qr(product)
    signs = torch.where(r.diagonal(dim1=-2, dim2=-1) < 0, -1.0, 1.0).to(dtype)
    return quotients.gather(-1, order).clamp(min=0.0), q * signs.unsqueeze(-2)


def pi_ratio(a_diagonal: torch.Tensor, g_diagonal: torch.Tensor) -> torch.Tensor:
    """π per group, ``(k, 1, 1)``, from the diagonals (or eigenvalues) ``(k, n)`` of A and G:
    ``sqrt(mean(A) / mean(G))``, 1 where either factor has no positive trace."""
    mean_a = a_diagonal.to(torch.float64).mean(dim=-1)
    mean_g = g_diagonal.to(torch.float64).mean(dim=-1)
    valid = (mean_a > 0) & (mean_g > 0)
    ratio = torch.where(valid, mean_a / torch.where(valid, mean_g, 1.0), 1.0).sqrt()
    return ratio.to(a_diagonal.dtype).reshape(-1, 1, 1)


def per_group(damping: float | torch.Tensor, like: torch.Tensor) -> float | torch.Tensor:
    """A scalar damping, or per-group values ``(k, 1, 1)`` cast to ``like``'s dtype."""
    return damping if isinstance(damping, float) else damping.to(like.dtype)


def robust_damped_inverse(
    factor: torch.Tensor, damping: float | torch.Tensor
) -> torch.Tensor | None:
    """``(factor + damping·I)⁻¹`` through Cholesky (the matrix is SPD), or ``None``; a tensor
    damping is per group, ``(k, 1, 1)``."""
    # Written for its transient memory (at most two n×n temporaries beside the factor, as the
    # eigen method): the damping goes onto a copy's diagonal in place, each temporary is let go
    # of as soon as the next exists, the symmetrisation halves in place.
    damp = per_group(damping, factor)
    on_diagonal = damp if isinstance(damp, float) else damp.reshape(-1, 1)
    for dtype in attempt_dtypes(factor.dtype):
        damped = factor.clone()
        damped.diagonal(dim1=-2, dim2=-1).add_(on_diagonal)
        damped = damped.to(dtype)
        chol, info = torch.linalg.cholesky_ex(damped)
        del damped
        if bool((info != 0).any()):
            logger.debug("Cholesky failed in %s; retrying in higher precision", dtype)
            continue
        holder = [chol]
        del chol
        inverse = inverse_from_cholesky(holder)
        inverse = (inverse + inverse.transpose(-1, -2)).div_(2)
        if all_finite(inverse):
            return inverse
    return None


def inverse_from_cholesky(holder: list[torch.Tensor]) -> torch.Tensor:
    """``(L Lᵀ)⁻¹`` from the lower Cholesky factors ``(..., n, n)`` that ``holder`` alone
    refers to (taken out of it, so that they are let go of as soon as they are used: two
    n×n temporaries at a time per matrix, as ``torch.cholesky_inverse``).

    On CUDA ``L⁻ᵀ L⁻¹``: one triangular solve against the identity, then one product. Not
    ``torch.cholesky_inverse`` there: its batched path launches thousands of small kernels (a
    decomposition step of ResNet-50's factors: 9,364 launches, host-bound). On CPU, where
    LAPACK's inverse is the faster, ``torch.cholesky_inverse``."""
    if holder[-1].device.type == "cuda":
        return inverse_by_solve(holder)
    return torch.cholesky_inverse(holder.pop())


def inverse_by_solve(holder: list[torch.Tensor]) -> torch.Tensor:
    """``L⁻ᵀ L⁻¹`` for the lower Cholesky factors ``holder`` alone refers to (taken out)."""
    chol = holder.pop()
    eye = torch.eye(chol.shape[-1], dtype=chol.dtype, device=chol.device)
    inverse_l = torch.linalg.solve_triangular(chol, eye.expand_as(chol), upper=False)
    del chol
    inverse: torch.Tensor = inverse_l.mT @ inverse_l
    return inverse


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether no element is NaN or infinite, without an n-element temporary: a NaN or an
    infinity makes the sum one; only a finite sum's overflow needs the element-wise check."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def stack_dampings(
    dampings: list[float | torch.Tensor], groups: int, like: torch.Tensor
) -> float | torch.Tensor:
    """One damping for every stacked matrix: a float if all are the same float, else
    ``(n·k, 1, 1)`` values."""
    if all(isinstance(d, float) for d in dampings) and len(set(dampings)) == 1:
        first = dampings[0]
        return float(first) if isinstance(first, float) else float(first.item())
    parts = [
        torch.full((groups, 1, 1), d, dtype=like.dtype, device=like.device)
        if isinstance(d, float)
        else d.to(like.dtype).reshape(groups, 1, 1)
        for d in dampings
    ]
    return torch.cat(parts)


def members_finite(stacked: torch.Tensor, members: int) -> list[bool]:
    """Per member of ``(members·k, ...)`` matrices, whether all of its values are finite: one
    sum per matrix (a NaN or an infinity makes it non-finite), exact check where it is not."""
    sums = stacked.reshape(members, -1).sum(dim=-1)
    finite = torch.isfinite(sums).tolist()
    return [bool(ok) or all_finite(stacked.reshape(members, -1)[i]) for i, ok in enumerate(finite)]
