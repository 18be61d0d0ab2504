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
from collections.abc import Callable
from typing import Any

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


class Decomposition(ABC):
    """The second-order state of one layer, computed from its factors on inverse-update steps.

    ``compute_a``/``compute_g`` are separate so that the distributed strategies can place the
    two factors of a layer on different ranks; ``finish`` runs where both are present.
    """

    def __init__(self, *, name: str, inv_dtype: torch.dtype) -> None:
        self.name = name
        self.inv_dtype = inv_dtype
        self.failures = 0
        # Where kept tensors live: a batched group's storage (``kaisa_ray.batching``), which
        # returns the view a value was copied into, or None for tensors of their own.
        self._slot: Callable[[str, torch.Tensor], torch.Tensor] | None = None

    def attach(self, slot: Callable[[str, torch.Tensor], torch.Tensor] | None) -> None:
        """Keep every tensor from now on in ``slot``'s storage (None: in tensors of their own).
        Tensors already kept move there."""
        self._slot = slot
        for part, value in self.tensors().items():
            self._keep(part, value)

    def _keep(self, part: str, value: torch.Tensor) -> None:
        """Hold ``value`` as ``part``: in the slot's storage, or as a contiguous tensor."""
        value = value.to(self.inv_dtype)
        if self._slot is not None:
            setattr(self, part, self._slot(part, value))
        else:
            setattr(self, part, value.contiguous())

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

    @staticmethod
    @abstractmethod
    def retry(factor: torch.Tensor, damping: float | torch.Tensor) -> Any:
        """A decomposition that failed in the working dtype, once more in float64 (None if it
        fails again, or if the working dtype was float64 already)."""

    @abstractmethod
    def accept(
        self, which: str, result: Any, like: torch.Tensor, damping: float | torch.Tensor
    ) -> None:
        """Keep a decomposition of ``which`` ('A' or 'G') computed elsewhere (``solve_many``),
        or, where it failed (None), warn and keep the previous one; ``like`` is the factor
        and ``damping`` what the inverse method added to it."""

    def leave_basis(self) -> None:  # noqa: B027 (optional hook)
        """Before new decompositions replace these (only state kept in a basis needs it)."""

    def finish(self, damping: float) -> None:  # noqa: B027 (optional hook)
        """Combine A and G results (the eigen method's outer product; state kept in the
        bases, rotated into the new ones)."""

    @abstractmethod
    def precondition(self, grad_out_by_in: torch.Tensor, damping: float) -> torch.Tensor: ...

    @abstractmethod
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor held, by name: for checkpoints and exact memory accounting."""

    def set_part(self, part: str, value: torch.Tensor) -> None:
        """Install one received tensor (``qa``, ``da``, ``a_inv``, ...) of this method."""
        if part not in self.saved_parts():
            raise KeyError(f"{type(self).__name__} has no part {part!r}")
        self._keep(part, value)

    def load(self, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
        """Install a checkpoint's tensors (parts missing there are cleared)."""
        for part in self.saved_parts():
            value = tensors.get(part)
            if value is None:
                setattr(self, part, None)
            else:
                self._keep(part, value.to(device))

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
    qa: torch.Tensor,
    qg: torch.Tensor,
    *,
    dgda: torch.Tensor | None = None,
    denominator: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``Q_G [(Q_Gᵀ ∇W Q_A) ⊙ dgda] Q_Aᵀ`` (or ``/ denominator``) for ``(k, g, a)`` gradients
    already in the decompositions' dtype: one layer's groups, or several layers' stacked
    (into ``out`` where given)."""
    rotated = _mm(_mm(qg.transpose(-1, -2), grad), qa)
    if dgda is not None:
        rotated = rotated * dgda
    elif denominator is not None:
        rotated = rotated / denominator
    else:
        raise ValueError("eigen_precondition needs dgda or denominator")
    return _mm(_mm(qg, rotated), qa.transpose(-1, -2), out=out)


def inverse_precondition(
    grad: torch.Tensor, a_inv: torch.Tensor, g_inv: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``(G + γI)⁻¹ ∇W (A + γI)⁻¹`` for ``(k, g, a)`` gradients in the inverses' dtype (into
    ``out`` where given)."""
    return _mm(_mm(g_inv, grad), a_inv, out=out)


def _mm(x: torch.Tensor, y: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ y``: ``bmm`` where both are ``(b, ·, ·)`` stacks of one length, the kernel that
    ``matmul`` reaches there too (the same values) without the broadcasting views it launches
    first (a shape group's step is a handful of operations, and each costs the host time)."""
    if x.dim() == 3 and y.dim() == 3 and x.shape[0] == y.shape[0]:
        return torch.bmm(x, y) if out is None else torch.bmm(x, y, out=out)
    return x @ y if out is None else torch.matmul(x, y, out=out)


def _stack_dampings(
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


def _members_finite(stacked: torch.Tensor, members: int) -> list[bool]:
    """Per member of ``(members·k, ...)`` matrices, whether all of its values are finite: one
    sum per matrix (a NaN or an infinity makes it non-finite), exact check where it is not."""
    sums = stacked.reshape(members, -1).sum(dim=-1)
    finite = torch.isfinite(sums).tolist()
    return [bool(ok) or all_finite(stacked.reshape(members, -1)[i]) for i, ok in enumerate(finite)]


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
    def solve_many(
        factors: torch.Tensor, dampings: list[float | torch.Tensor], *, owned: bool = False
    ) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """``eigh`` of ``n`` members' ``(n, k, d, d)`` factors in one batched call in the
        working dtype (the eigen method damps later, so ``dampings`` and ``owned`` are
        unused); None for a member whose values are not finite, or for all if the batched
        call failed (to be tried again on its own: ``compute_a``/``compute_g``)."""
        n, k, d, _ = factors.shape
        batched = None
        try:
            stacked = factors.reshape(n * k, d, d).to(working_dtype(factors.dtype))
            values, vectors = torch.linalg.eigh(stacked)
            batched = (values.reshape(n, k, d), vectors.reshape(n, k, d, d))
        except RuntimeError:  # torch.linalg.LinAlgError: one member failed; retry each
            logger.debug("batched eigh failed; decomposing the %d members one by one", n)
        if batched is None:
            return [None] * n
        values, vectors = batched
        finite = zip(_members_finite(values, n), _members_finite(vectors, n), strict=True)
        return [
            (values[i].clamp(min=0.0), vectors[i]) if a and b else None
            for i, (a, b) in enumerate(finite)
        ]

    @staticmethod
    def retry(
        factor: torch.Tensor, damping: float | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if working_dtype(factor.dtype) == torch.float64:
            return None
        logger.debug("eigh failed in %s; retrying in float64", working_dtype(factor.dtype))
        return robust_eigh(factor.to(torch.float64))

    @staticmethod
    def _identity(factor: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        k, n, _ = factor.shape
        eye = torch.eye(n, dtype=dtype, device=factor.device).expand(k, n, n).clone()
        return torch.ones(k, n, dtype=dtype, device=factor.device), eye

    def accept(
        self,
        which: str,
        result: tuple[torch.Tensor, torch.Tensor] | None,
        like: torch.Tensor,
        damping: float | torch.Tensor,
    ) -> None:
        """Keep a decomposition of ``which`` ('A' or 'G'; ``like`` its factor), or, where it
        failed (None), the previous one (the identity if there was none)."""
        values_part, vectors_part = ("da", "qa") if which == "A" else ("dg", "qg")
        if result is None:
            self._warn_kept(which)
            if getattr(self, vectors_part) is not None and getattr(self, values_part) is not None:
                return
            result = self._identity(like, self.inv_dtype)
        # Contiguous (or copied into a group's storage), so the computing rank and ranks that
        # receive a copy use the same BLAS path and agree bit for bit.
        self._keep(values_part, result[0])
        self._keep(vectors_part, result[1])

    def compute_a(self, a_factor: torch.Tensor, damping: float | torch.Tensor) -> None:
        self.accept("A", robust_eigh(a_factor), a_factor, damping)

    def compute_g(self, g_factor: torch.Tensor, damping: float | torch.Tensor) -> None:
        self.accept("G", robust_eigh(g_factor), g_factor, damping)

    def _denominator(self, da: torch.Tensor, dg: torch.Tensor, damping: float) -> torch.Tensor:
        return eigen_denominator(da, dg, damping, self.pi)

    def finish(self, damping: float) -> None:
        if not self.outer_product:
            return
        if self.da is None or self.dg is None:
            raise RuntimeError(f"layer {self.name!r}: finish() before both factors decomposed")
        self._keep("dgda", 1.0 / self._denominator(self.da, self.dg, damping))

    def precondition(self, grad_out_by_in: torch.Tensor, damping: float) -> torch.Tensor:
        if self.qa is None or self.qg is None:
            raise RuntimeError(f"layer {self.name!r} has no decomposition yet")
        grad = grad_out_by_in.to(self.inv_dtype)
        if self.outer_product and self.dgda is not None:
            out = eigen_precondition(grad, self.qa, self.qg, dgda=self.dgda)
        else:
            if self.da is None or self.dg is None:
                raise RuntimeError(f"layer {self.name!r} has no eigenvalues")
            denominator = self._denominator(self.da, self.dg, damping)
            out = eigen_precondition(grad, self.qa, self.qg, denominator=denominator)
        return out.to(grad_out_by_in.dtype)

    def parts(self) -> tuple[str, ...]:
        return ("qa", "da", "qg", "dg")

    def saved_parts(self) -> tuple[str, ...]:
        return (*self.parts(), "dgda") if self.outer_product else self.parts()

    def tensors(self) -> dict[str, torch.Tensor]:
        named = {"qa": self.qa, "da": self.da, "qg": self.qg, "dg": self.dg, "dgda": self.dgda}
        return {key: value for key, value in named.items() if value is not None}


class InverseDecomposition(Decomposition):
    """Damped inverses ``(A + γI)⁻¹`` and ``(G + γI)⁻¹`` built on inverse-update steps."""

    def __init__(self, *, name: str, inv_dtype: torch.dtype) -> None:
        super().__init__(name=name, inv_dtype=inv_dtype)
        self.a_inv: torch.Tensor | None = None
        self.g_inv: torch.Tensor | None = None

    @staticmethod
    def solve_many(
        factors: torch.Tensor, dampings: list[float | torch.Tensor], *, owned: bool = False
    ) -> list[torch.Tensor | None]:
        """The damped inverses of ``n`` members' ``(n, k, d, d)`` factors in one batched
        Cholesky, in the working dtype; None for a member whose factorisation failed or whose
        inverse is not finite (to be tried again on its own: ``compute_a``/``compute_g``).
        ``owned``: ``factors`` is a copy the call may overwrite (else it copies them)."""
        n, k, d, _ = factors.shape
        stacked = factors.reshape(n * k, d, d)
        damping = _stack_dampings(dampings, k, stacked)
        # The transient memory of robust_damped_inverse for n members (the copy is the
        # caller's stacked factors where it owns them).
        damped = stacked if owned else stacked.clone()
        on_diagonal = damping if isinstance(damping, float) else damping.reshape(-1, 1)
        damped.diagonal(dim1=-2, dim2=-1).add_(on_diagonal)
        damped = damped.to(working_dtype(stacked.dtype))
        chol, info = torch.linalg.cholesky_ex(damped)
        del damped
        failed = info != 0
        factored = (~failed).reshape(n, k).all(dim=-1).tolist()
        if not all(factored):  # a failed factor is partial (its solve could raise on CPU)
            eye = torch.eye(d, dtype=chol.dtype, device=chol.device)
            chol[failed] = eye
        holder = [chol]
        del chol
        inverse = inverse_from_cholesky(holder)
        inverse = (inverse + inverse.transpose(-1, -2)).div_(2).reshape(n, k, d, d)
        finite = _members_finite(inverse, n)
        return [inverse[i] if factored[i] and finite[i] else None for i in range(n)]

    @staticmethod
    def retry(factor: torch.Tensor, damping: float | torch.Tensor) -> torch.Tensor | None:
        if working_dtype(factor.dtype) == torch.float64:
            return None
        logger.debug("Cholesky failed in %s; retrying in float64", working_dtype(factor.dtype))
        return robust_damped_inverse(factor.to(torch.float64), damping)

    def accept(
        self,
        which: str,
        result: torch.Tensor | None,
        like: torch.Tensor,
        damping: float | torch.Tensor,
    ) -> None:
        """Keep the inverse of ``which`` ('A' or 'G'; ``like`` its factor, ``damping`` what
        was added to it), or, where it failed (None), the previous one (the damped identity's
        inverse if there was none)."""
        part = "a_inv" if which == "A" else "g_inv"
        if result is None:
            self._warn_kept(which)
            if getattr(self, part) is not None:
                return
            k, n, _ = like.shape
            eye = torch.eye(n, dtype=self.inv_dtype, device=like.device)
            result = (eye / (1.0 + _per_group(damping, eye))).expand(k, n, n)
        self._keep(part, result)

    def compute_a(self, a_factor: torch.Tensor, damping: float | torch.Tensor) -> None:
        self.accept("A", robust_damped_inverse(a_factor, damping), a_factor, damping)

    def compute_g(self, g_factor: torch.Tensor, damping: float | torch.Tensor) -> None:
        self.accept("G", robust_damped_inverse(g_factor, damping), g_factor, damping)

    def precondition(self, grad_out_by_in: torch.Tensor, damping: float) -> torch.Tensor:
        if self.a_inv is None or self.g_inv is None:
            raise RuntimeError(f"layer {self.name!r} has no inverses yet")
        grad = grad_out_by_in.to(self.inv_dtype)
        return inverse_precondition(grad, self.a_inv, self.g_inv).to(grad_out_by_in.dtype)

    def parts(self) -> tuple[str, ...]:
        return ("a_inv", "g_inv")

    def tensors(self) -> dict[str, torch.Tensor]:
        named = {"a_inv": self.a_inv, "g_inv": self.g_inv}
        return {key: value for key, value in named.items() if value is not None}
