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
is kept and a warning says which layer and factor. With ``basis_update='power-qr'`` a basis
already held is refreshed by one power iteration and QR instead of ``eigh``
(``kaisa_ray.solvers.power_qr``), its Rayleigh quotients standing in for the eigenvalues;
a refresh that is not finite falls back to ``eigh``.

A factor known to be diagonal (an embedding's A: ``LayerHelper.diagonal_a``) is held as its
diagonal ``(k, a)`` and decomposed without ``eigh`` or Cholesky: its eigenvalues are its
diagonal and its basis the identity, which is not stored (no ``qa``), its damped inverse the
reciprocals of the damped diagonal, held as a vector ``a_inv`` ``(k, a)``
(``solve_diagonal``): exact, in memory and time linear in the width (an embedding's is its
vocabulary) where the dense solvers are cubic and the matrices quadratic.
"""

from __future__ import annotations

import logging
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from kaisa_ray.enums import BasisUpdate
from kaisa_ray.errors import user_stacklevel
from kaisa_ray.products import eigen_denominator, eigen_precondition, inverse_precondition
from kaisa_ray.solvers import (
    inverse_from_cholesky,
    members_finite,
    per_group,
    power_qr,
    robust_damped_inverse,
    robust_eigh,
    stack_dampings,
    working_dtype,
)

logger = logging.getLogger(__name__)


class Decomposition(ABC):
    """The second-order state of one layer, computed from its factors on inverse-update steps.

    ``compute_a``/``compute_g`` are separate so that the distributed strategies can place the
    two factors of a layer on different ranks; ``finish`` runs where both are present.
    """

    def __init__(self, *, name: str, inv_dtype: torch.dtype) -> None:
        self.name = name
        self.inv_dtype = inv_dtype
        self.failures = 0
        # The A factor is diagonal (``LayerHelper.diagonal_a``; set by ``KFACLayer``): it is
        # decomposed by ``solve_diagonal``, not by the dense solvers.
        self.diagonal_a = False
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
    def solve_diagonal(factor: torch.Tensor, damping: float | torch.Tensor) -> Any:
        """The decomposition of a diagonal factor from its diagonal ``(k, d)``, in the
        working dtype (None where the diagonal is not finite)."""

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


class EigenDecomposition(Decomposition):
    """Eigendecompositions of A and G; optionally the damped eigenvalue outer product.

    With ``outer_product=True`` (the reference's ``compute_eigenvalue_outer_product``), the
    ``1 / (λ_G λ_Aᵀ + γ)`` table is built on inverse-update steps with that step's damping,
    so each step costs one multiply. The eigenvalue vectors are kept either way (they are
    tiny), so a failed decomposition of one factor can keep its previous value.
    """

    def __init__(
        self,
        *,
        name: str,
        inv_dtype: torch.dtype,
        outer_product: bool,
        pi: bool = False,
        basis_update: BasisUpdate = BasisUpdate.EIGH,
    ) -> None:
        super().__init__(name=name, inv_dtype=inv_dtype)
        self.outer_product = outer_product
        self.pi = pi
        self.basis_update = basis_update
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
        finite = zip(members_finite(values, n), members_finite(vectors, n), strict=True)
        return [
            (values[i].clamp(min=0.0), vectors[i]) if a and b else None
            for i, (a, b) in enumerate(finite)
        ]

    @staticmethod
    def refresh_many(
        factors: torch.Tensor, bases: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """``power_qr`` of ``n`` members' ``(n, k, d, d)`` factors from their bases (the same
        shape) in one batched call; None for a member whose result is not finite (to be
        decomposed by ``eigh`` instead: ``retry``)."""
        n, k, d, _ = factors.shape
        values, vectors = power_qr(factors.reshape(n * k, d, d), bases.reshape(n * k, d, d))
        values, vectors = values.reshape(n, k, d), vectors.reshape(n, k, d, d)
        finite = zip(members_finite(values, n), members_finite(vectors, n), strict=True)
        return [(values[i], vectors[i]) if a and b else None for i, (a, b) in enumerate(finite)]

    @staticmethod
    def solve_diagonal(
        factor: torch.Tensor, damping: float | torch.Tensor
    ) -> tuple[torch.Tensor, None] | None:
        """``(diagonal clamped at 0, None)``: the eigendecomposition of a diagonal factor, its
        basis the identity, not stored (damped later, as every eigendecomposition)."""
        values = factor.to(working_dtype(factor.dtype))
        if not bool(torch.isfinite(values).all()):
            return None
        return values.clamp(min=0.0), None

    def refreshes(self, which: str) -> bool:
        """Whether ``which`` ('A' or 'G') is refreshed by a power iteration from the basis
        held (``basis_update='power-qr'`` and a basis to start from) rather than by ``eigh``."""
        if self.basis_update is not BasisUpdate.POWER_QR:
            return False
        return (self.qa if which == "A" else self.qg) is not None

    def basis(self, which: str) -> torch.Tensor:
        """The basis held for ``which`` ('A' or 'G')."""
        held = self.qa if which == "A" else self.qg
        if held is None:
            raise RuntimeError(f"layer {self.name!r} holds no {which} basis")
        return held

    def _solve(self, which: str, factor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.refreshes(which):
            (result,) = self.refresh_many(factor.unsqueeze(0), self.basis(which).unsqueeze(0))
            if result is not None:
                return result
        return robust_eigh(factor)

    @staticmethod
    def retry(
        factor: torch.Tensor, damping: float | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if working_dtype(factor.dtype) == torch.float64:
            return None
        logger.debug("eigh failed in %s; retrying in float64", working_dtype(factor.dtype))
        return robust_eigh(factor.to(torch.float64))

    @staticmethod
    def _identity(
        factor: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The identity's decomposition (a diagonal factor's: its basis not stored)."""
        k, n = factor.shape[:2]
        values = torch.ones(k, n, dtype=dtype, device=factor.device)
        if factor.dim() == 2:
            return values, None
        return values, torch.eye(n, dtype=dtype, device=factor.device).expand(k, n, n).clone()

    def has_bases(self) -> bool:
        """Whether both bases are held (a diagonal A's is the identity, never stored)."""
        return self.qg is not None and (self.diagonal_a or self.qa is not None)

    def accept(
        self,
        which: str,
        result: tuple[torch.Tensor, torch.Tensor | None] | None,
        like: torch.Tensor,
        damping: float | torch.Tensor,
    ) -> None:
        """Keep a decomposition of ``which`` ('A' or 'G'; ``like`` its factor), or, where it
        failed (None), the previous one (the identity if there was none). A diagonal A's
        basis (None) is the identity, not stored."""
        values_part, vectors_part = ("da", "qa") if which == "A" else ("dg", "qg")
        identity_basis = which == "A" and self.diagonal_a
        if result is None:
            self._warn_kept(which)
            held = identity_basis or getattr(self, vectors_part) is not None
            if held and getattr(self, values_part) is not None:
                return
            result = self._identity(like, self.inv_dtype)
        # Contiguous (or copied into a group's storage), so the computing rank and ranks that
        # receive a copy use the same BLAS path and agree bit for bit.
        self._keep(values_part, result[0])
        if result[1] is not None:
            self._keep(vectors_part, result[1])

    def compute_a(self, a_factor: torch.Tensor, damping: float | torch.Tensor) -> None:
        result: tuple[torch.Tensor, torch.Tensor | None] | None
        if self.diagonal_a:
            result = self.solve_diagonal(a_factor, damping)
        else:
            result = self._solve("A", a_factor)
        self.accept("A", result, a_factor, damping)

    def compute_g(self, g_factor: torch.Tensor, damping: float | torch.Tensor) -> None:
        self.accept("G", self._solve("G", g_factor), g_factor, damping)

    def _denominator(self, da: torch.Tensor, dg: torch.Tensor, damping: float) -> torch.Tensor:
        return eigen_denominator(da, dg, damping, self.pi)

    def finish(self, damping: float) -> None:
        if not self.outer_product:
            return
        if self.da is None or self.dg is None:
            raise RuntimeError(f"layer {self.name!r}: finish() before both factors decomposed")
        self._keep("dgda", 1.0 / self._denominator(self.da, self.dg, damping))

    def precondition(self, grad_out_by_in: torch.Tensor, damping: float) -> torch.Tensor:
        if not self.has_bases():
            raise RuntimeError(f"layer {self.name!r} has no decomposition yet")
        assert self.qg is not None
        grad = grad_out_by_in.to(self.inv_dtype)
        qa = self.qa
        if self.outer_product and self.dgda is not None:
            out = eigen_precondition(grad, qa, self.qg, dgda=self.dgda)
        else:
            if self.da is None or self.dg is None:
                raise RuntimeError(f"layer {self.name!r} has no eigenvalues")
            denominator = self._denominator(self.da, self.dg, damping)
            out = eigen_precondition(grad, qa, self.qg, denominator=denominator)
        return out.to(grad_out_by_in.dtype)

    def load(self, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
        super().load(tensors, device)
        written_basis = tensors.get("qa") if self.diagonal_a else None
        if written_basis is not None:
            self._make_basis_a_identity(written_basis.to(device, self.inv_dtype))

    def _make_basis_a_identity(self, qa: torch.Tensor) -> None:
        """A diagonal A's basis is the identity (``solve_diagonal``), not stored; a checkpoint
        written before that holds a basis of it: the identity, or ``eigh``'s, the identity's
        columns reordered. Its eigenvalues, and any state kept in it, move to the identity's
        coordinates (each old coordinate's value to the new ones it is made of, as
        ``_StateInBasis`` rotates), and the basis is let go of."""
        eye = torch.eye(qa.shape[-1], dtype=qa.dtype, device=qa.device).expand_as(qa)
        if torch.equal(qa, eye):
            return
        weights = (qa * qa).transpose(-1, -2)  # (k, old coordinate, new coordinate)
        if self.da is not None:
            self._keep("da", (self.da.unsqueeze(-2) @ weights).squeeze(-2))
        if self.dgda is not None:
            self._keep("dgda", self.dgda @ weights)
        self._rotate_state_a(qa.transpose(-1, -2))

    def _rotate_state_a(self, rotate_a: torch.Tensor) -> None:
        """Rotate state kept in the bases by ``R_A`` on A's side (``_StateInBasis``)."""

    def parts(self) -> tuple[str, ...]:
        return ("da", "qg", "dg") if self.diagonal_a else ("qa", "da", "qg", "dg")

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
        damping = stack_dampings(dampings, k, stacked)
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
        finite = members_finite(inverse, n)
        return [inverse[i] if factored[i] and finite[i] else None for i in range(n)]

    @staticmethod
    def solve_diagonal(factor: torch.Tensor, damping: float | torch.Tensor) -> torch.Tensor | None:
        """``1 / (diagonal + damping)`` ``(k, d)``: the damped inverse of a diagonal factor,
        itself diagonal and held as its diagonal (``damping`` a float, or per group
        ``(k, 1, 1)``)."""
        values = factor.to(working_dtype(factor.dtype))
        shift = damping if isinstance(damping, float) else damping.to(values.dtype).reshape(-1, 1)
        inverse = (values + shift).reciprocal()
        return inverse if bool(torch.isfinite(inverse).all()) else None

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
            k, n = like.shape[:2]
            if like.dim() == 2:  # a diagonal A: the inverse's diagonal
                ones = torch.ones(k, n, dtype=self.inv_dtype, device=like.device)
                damp = per_group(damping, ones)
                result = ones / (1.0 + (damp if isinstance(damp, float) else damp.reshape(-1, 1)))
            else:
                eye = torch.eye(n, dtype=self.inv_dtype, device=like.device)
                result = (eye / (1.0 + per_group(damping, eye))).expand(k, n, n)
        self._keep(part, result)

    def compute_a(self, a_factor: torch.Tensor, damping: float | torch.Tensor) -> None:
        if self.diagonal_a:
            result = self.solve_diagonal(a_factor, damping)
        else:
            result = robust_damped_inverse(a_factor, damping)
        self.accept("A", result, a_factor, damping)

    def compute_g(self, g_factor: torch.Tensor, damping: float | torch.Tensor) -> None:
        self.accept("G", robust_damped_inverse(g_factor, damping), g_factor, damping)

    def precondition(self, grad_out_by_in: torch.Tensor, damping: float) -> torch.Tensor:
        if self.a_inv is None or self.g_inv is None:
            raise RuntimeError(f"layer {self.name!r} has no inverses yet")
        grad = grad_out_by_in.to(self.inv_dtype)
        out = inverse_precondition(grad, self.a_inv, self.g_inv, diagonal_a=self.diagonal_a)
        return out.to(grad_out_by_in.dtype)

    def parts(self) -> tuple[str, ...]:
        return ("a_inv", "g_inv")

    def load(self, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
        written = tensors.get("a_inv")
        if self.diagonal_a and written is not None and written.dim() == 3:
            # written whole, before a diagonal A's inverse was held as its diagonal
            tensors = {**tensors, "a_inv": written.diagonal(dim1=-2, dim2=-1)}
        super().load(tensors, device)

    def tensors(self) -> dict[str, torch.Tensor]:
        named = {"a_inv": self.a_inv, "g_inv": self.g_inv}
        return {key: value for key, value in named.items() if value is not None}
