"""Second-order information of one layer: eigendecompositions or damped inverses.

Shapes as in ``layers.py``: factors are ``(k, n, n)``, gradients ``grad_out_by_in``
``(k, g_dim, a_dim)``.

Eigen method (KAISA, eq. 9; George et al. 2018): with ``A = Q_A diag(λ_A) Q_Aᵀ`` and
``G = Q_G diag(λ_G) Q_Gᵀ`` the preconditioned gradient is

    Q_G [(Q_Gᵀ ∇W Q_A) / (λ_G λ_Aᵀ + γ)] Q_Aᵀ  =  (G ⊗ A + γI)⁻¹ vec(∇W)

with row-major ``vec``. Inverse method (Martens & Grosse 2015, factored Tikhonov damping):
``(G + γI)⁻¹ ∇W (A + γI)⁻¹``.

With π-damping (Martens & Grosse 2015, §6.3) the damping is split between the factors,
``π√γ`` on A and ``√γ/π`` on G with ``π = sqrt((tr A / dim A) / (tr G / dim G))``, and both
methods compute the same thing: ``(G + √γ/π I)⁻¹ ∇W (A + π√γ I)⁻¹``; the eigen method as
``Q_G [(Q_Gᵀ ∇W Q_A) / ((λ_G + √γ/π)(λ_A + π√γ)ᵀ)] Q_Aᵀ`` (traces from the eigenvalues).

Decompositions run in float32 at least. If ``eigh`` (or the Cholesky factorisation behind
the inverse) fails, it is retried in float64; if that fails too, the previous decomposition
is kept and a warning says which layer and factor.
"""

from __future__ import annotations

import logging
import math
import warnings
from abc import ABC, abstractmethod

import torch

from kaisa_ray.errors import user_stacklevel

logger = logging.getLogger(__name__)


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least float32: half-precision factors are decomposed in float32."""
    return torch.promote_types(dtype, torch.float32)


def _attempt_dtypes(dtype: torch.dtype) -> list[torch.dtype]:
    first = working_dtype(dtype)
    return [first] if first == torch.float64 else [first, torch.float64]


def robust_eigh(factor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Eigenvalues (clamped at 0) and eigenvectors of symmetric ``factor``, or ``None``."""
    for dtype in _attempt_dtypes(factor.dtype):
        try:
            eigenvalues, eigenvectors = torch.linalg.eigh(factor.to(dtype))
        except RuntimeError:  # torch.linalg.LinAlgError
            logger.debug("eigh failed in %s; retrying in higher precision", dtype)
            continue
        if all_finite(eigenvalues) and all_finite(eigenvectors):
            return eigenvalues.clamp(min=0.0), eigenvectors
    return None


def pi_ratio(a_diagonal: torch.Tensor, g_diagonal: torch.Tensor) -> torch.Tensor:
    """π per group, ``(k, 1, 1)``, from the diagonals (or eigenvalues) ``(k, n)`` of A and G:
    ``sqrt(mean(A) / mean(G))``, 1 where either factor has no positive trace."""
    mean_a = a_diagonal.to(torch.float64).mean(dim=-1)
    mean_g = g_diagonal.to(torch.float64).mean(dim=-1)
    valid = (mean_a > 0) & (mean_g > 0)
    ratio = torch.where(valid, mean_a / torch.where(valid, mean_g, 1.0), 1.0).sqrt()
    return ratio.to(a_diagonal.dtype).reshape(-1, 1, 1)


def _per_group(damping: float | torch.Tensor, like: torch.Tensor) -> float | torch.Tensor:
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
    per_group = _per_group(damping, factor)
    on_diagonal = per_group if isinstance(per_group, float) else per_group.reshape(-1, 1)
    for dtype in _attempt_dtypes(factor.dtype):
        damped = factor.clone()
        damped.diagonal(dim1=-2, dim2=-1).add_(on_diagonal)
        damped = damped.to(dtype)
        chol, info = torch.linalg.cholesky_ex(damped)
        del damped
        if bool((info != 0).any()):
            logger.debug("Cholesky failed in %s; retrying in higher precision", dtype)
            continue
        inverse = torch.cholesky_inverse(chol)
        del chol
        inverse = (inverse + inverse.transpose(-1, -2)).div_(2)
        if all_finite(inverse):
            return inverse
    return None


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether no element is NaN or infinite, without an n-element temporary: a NaN or an
    infinity makes the sum one; only a finite sum's overflow needs the element-wise check."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


class Decomposition(ABC):
    """The second-order state of one layer, computed from its factors on inverse-update steps.

    ``compute_a``/``compute_g`` are separate so that the distributed strategies can place the
    two factors of a layer on different ranks; ``finish`` runs where both are present.
    """

    def __init__(self, *, name: str, inv_dtype: torch.dtype) -> None:
        self.name = name
        self.inv_dtype = inv_dtype
        self.failures = 0

    def _warn_kept(self, factor: str) -> None:
        self.failures += 1
        warnings.warn(
            f"K-FAC could not decompose the {factor} factor of layer {self.name!r} even in "
            "float64; keeping its previous decomposition (the identity if there was none). "
            "Raise damping or factor_decay if this repeats.",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )

    @abstractmethod
    def compute_a(self, a_factor: torch.Tensor, damping: float | torch.Tensor) -> None:
        """Decompose A; ``damping`` is what the inverse method adds to A (a float, or per
        group ``(k, 1, 1)``); the eigen method applies damping later."""

    @abstractmethod
    def compute_g(self, g_factor: torch.Tensor, damping: float | torch.Tensor) -> None: ...

    def finish(self, damping: float) -> None:  # noqa: B027 (optional hook)
        """Combine A and G results (only the eigen method's outer product needs it)."""

    @abstractmethod
    def precondition(self, grad_out_by_in: torch.Tensor, damping: float) -> torch.Tensor: ...

    @abstractmethod
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor held, by name: for checkpoints and exact memory accounting."""

    @abstractmethod
    def load(self, tensors: dict[str, torch.Tensor], device: torch.device) -> None: ...

    def set_part(self, part: str, value: torch.Tensor) -> None:
        """Install one received tensor (``qa``, ``da``, ``a_inv``, ...) of this method."""
        if part not in self.saved_parts():
            raise KeyError(f"{type(self).__name__} has no part {part!r}")
        setattr(self, part, value.to(self.inv_dtype))

    @abstractmethod
    def parts(self) -> tuple[str, ...]:
        """Names of the tensors that travel in a decomposition broadcast."""

    def saved_parts(self) -> tuple[str, ...]:
        """Names of every tensor a complete checkpoint holds for this method."""
        return self.parts()

    def clear(self) -> None:
        for part in self.saved_parts():
            setattr(self, part, None)

    @property
    def ready(self) -> bool:
        return bool(self.tensors())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


class EigenDecomposition(Decomposition):
    """Eigendecompositions of A and G; optionally the damped eigenvalue outer product.

    With ``outer_product=True`` (the reference's ``compute_eigenvalue_outer_product``), the
    ``1 / (λ_G λ_Aᵀ + γ)`` table is built on inverse-update steps with that step's damping,
    so each step costs one multiply. The eigenvalue vectors are kept either way (they are
    tiny), so a failed decomposition of one factor can keep its previous value.
    """

    def __init__(
        self, *, name: str, inv_dtype: torch.dtype, outer_product: bool, pi: bool = False
    ) -> None:
        super().__init__(name=name, inv_dtype=inv_dtype)
        self.outer_product = outer_product
        self.pi = pi
        self.qa: torch.Tensor | None = None
        self.da: torch.Tensor | None = None
        self.qg: torch.Tensor | None = None
        self.dg: torch.Tensor | None = None
        self.dgda: torch.Tensor | None = None

    @staticmethod
    def _identity(factor: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        k, n, _ = factor.shape
        eye = torch.eye(n, dtype=dtype, device=factor.device).expand(k, n, n).clone()
        return torch.ones(k, n, dtype=dtype, device=factor.device), eye

    def _decompose(
        self, factor: torch.Tensor, old: tuple[torch.Tensor | None, torch.Tensor | None], which: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        result = robust_eigh(factor)
        if result is None:
            self._warn_kept(which)
            if old[0] is not None and old[1] is not None:
                return old[0], old[1]
            return self._identity(factor, self.inv_dtype)
        eigenvalues, eigenvectors = result
        # Contiguous, so the computing rank and ranks that receive a copy use the same BLAS
        # path (eigh returns column-major eigenvectors) and agree bit for bit.
        return (
            eigenvalues.to(self.inv_dtype).contiguous(),
            eigenvectors.to(self.inv_dtype).contiguous(),
        )

    def compute_a(self, a_factor: torch.Tensor, damping: float | torch.Tensor) -> None:
        self.da, self.qa = self._decompose(a_factor, (self.da, self.qa), "A")

    def compute_g(self, g_factor: torch.Tensor, damping: float | torch.Tensor) -> None:
        self.dg, self.qg = self._decompose(g_factor, (self.dg, self.qg), "G")

    def _denominator(self, da: torch.Tensor, dg: torch.Tensor, damping: float) -> torch.Tensor:
        """``λ_G λ_Aᵀ + γ``, or with π-damping ``(λ_G + √γ/π)(λ_A + π√γ)ᵀ``: ``(k, g, a)``."""
        if not self.pi:
            return dg.unsqueeze(-1) * da.unsqueeze(-2) + damping
        pi = pi_ratio(da, dg)  # (k, 1, 1)
        root = math.sqrt(damping)
        denominator: torch.Tensor = (dg.unsqueeze(-1) + root / pi) * (da.unsqueeze(-2) + pi * root)
        return denominator

    def finish(self, damping: float) -> None:
        if not self.outer_product:
            return
        if self.da is None or self.dg is None:
            raise RuntimeError(f"layer {self.name!r}: finish() before both factors decomposed")
        self.dgda = 1.0 / self._denominator(self.da, self.dg, damping)

    def precondition(self, grad_out_by_in: torch.Tensor, damping: float) -> torch.Tensor:
        if self.qa is None or self.qg is None:
            raise RuntimeError(f"layer {self.name!r} has no decomposition yet")
        grad = grad_out_by_in.to(self.inv_dtype)
        rotated = self.qg.transpose(-1, -2) @ grad @ self.qa
        if self.outer_product and self.dgda is not None:
            rotated = rotated * self.dgda
        else:
            if self.da is None or self.dg is None:
                raise RuntimeError(f"layer {self.name!r} has no eigenvalues")
            rotated = rotated / self._denominator(self.da, self.dg, damping)
        return (self.qg @ rotated @ self.qa.transpose(-1, -2)).to(grad_out_by_in.dtype)

    def parts(self) -> tuple[str, ...]:
        return ("qa", "da", "qg", "dg")

    def saved_parts(self) -> tuple[str, ...]:
        return (*self.parts(), "dgda") if self.outer_product else self.parts()

    def tensors(self) -> dict[str, torch.Tensor]:
        named = {"qa": self.qa, "da": self.da, "qg": self.qg, "dg": self.dg, "dgda": self.dgda}
        return {key: value for key, value in named.items() if value is not None}

    def load(self, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
        for key in ("qa", "da", "qg", "dg", "dgda"):
            value = tensors.get(key)
            setattr(
                self,
                key,
                None if value is None else value.to(device, self.inv_dtype).contiguous(),
            )


class InverseDecomposition(Decomposition):
    """Damped inverses ``(A + γI)⁻¹`` and ``(G + γI)⁻¹`` built on inverse-update steps."""

    def __init__(self, *, name: str, inv_dtype: torch.dtype) -> None:
        super().__init__(name=name, inv_dtype=inv_dtype)
        self.a_inv: torch.Tensor | None = None
        self.g_inv: torch.Tensor | None = None

    def _invert(
        self,
        factor: torch.Tensor,
        damping: float | torch.Tensor,
        old: torch.Tensor | None,
        which: str,
    ) -> torch.Tensor:
        inverse = robust_damped_inverse(factor, damping)
        if inverse is None:
            self._warn_kept(which)
            if old is not None:
                return old
            k, n, _ = factor.shape
            eye = torch.eye(n, dtype=self.inv_dtype, device=factor.device)
            return (eye / (1.0 + _per_group(damping, eye))).expand(k, n, n).clone()
        return inverse.to(self.inv_dtype).contiguous()

    def compute_a(self, a_factor: torch.Tensor, damping: float | torch.Tensor) -> None:
        self.a_inv = self._invert(a_factor, damping, self.a_inv, "A")

    def compute_g(self, g_factor: torch.Tensor, damping: float | torch.Tensor) -> None:
        self.g_inv = self._invert(g_factor, damping, self.g_inv, "G")

    def precondition(self, grad_out_by_in: torch.Tensor, damping: float) -> torch.Tensor:
        if self.a_inv is None or self.g_inv is None:
            raise RuntimeError(f"layer {self.name!r} has no inverses yet")
        grad = grad_out_by_in.to(self.inv_dtype)
        return (self.g_inv @ grad @ self.a_inv).to(grad_out_by_in.dtype)

    def parts(self) -> tuple[str, ...]:
        return ("a_inv", "g_inv")

    def tensors(self) -> dict[str, torch.Tensor]:
        named = {"a_inv": self.a_inv, "g_inv": self.g_inv}
        return {key: value for key, value in named.items() if value is not None}

    def load(self, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
        for key in ("a_inv", "g_inv"):
            value = tensors.get(key)
            setattr(
                self,
                key,
                None if value is None else value.to(device, self.inv_dtype).contiguous(),
            )
