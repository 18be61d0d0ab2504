"""Per-coordinate scaling in K-FAC's eigenbasis (``kfac.scaling``): EKFAC's fitted diagonal
(George et al. 2018; its batch second moments: ``kaisa_ray.ekfac``) and Adam's moments run in
the eigenbasis (SOAP's recipe with K-FAC's factors), each kept in the basis as it changes.
The bases are the eigen method's (``kaisa_ray.decomposition.EigenDecomposition``); what
replaces the eigenvalue products is held here.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence

import torch

from kaisa_ray.decomposition import EigenDecomposition
from kaisa_ray.enums import BasisUpdate
from kaisa_ray.products import eigen_precondition

__all__ = [
    "AdamEigenbasis",
    "EKFACEigenbasis",
    "Moments",
    "adam_eigenbasis_precondition",
    "adam_eigenbasis_precondition_many",
]

Moments = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def adam_eigenbasis_precondition(
    grad: torch.Tensor,
    qa: torch.Tensor | None,
    qg: torch.Tensor,
    moments: Moments,
    betas: tuple[float, float],
    eps: float,
) -> torch.Tensor:
    """``Q_G [m̂ / (√v̂ + ε)] Q_Aᵀ`` for ``(k, g, a)`` gradients (or several layers' stacked),
    after Adam's update of the moments ``(m, v, steps)`` (``(k, g, a)``, ``(k, g, a)``,
    ``(k,)``) with the rotated gradient ``Q_Gᵀ ∇W Q_A``, in place. A rotated gradient that is
    not finite (anywhere in the batch of layers) leaves their moments as they were and makes
    the result not finite, so that the step keeps the raw gradients."""
    (out,) = adam_eigenbasis_precondition_many([grad], [(qa, qg)], [moments], betas, eps)
    return out


def adam_eigenbasis_precondition_many(
    grads: Sequence[torch.Tensor],
    bases: Sequence[tuple[torch.Tensor | None, torch.Tensor]],
    moments: Sequence[Moments],
    betas: tuple[float, float],
    eps: float,
) -> list[torch.Tensor]:
    """``adam_eigenbasis_precondition`` of several batches of layers at once (each its own
    shapes: ``grads[i]`` ``(k, g, a)``, ``bases[i]`` its ``(Q_A, Q_G)``, ``moments[i]`` its
    ``(m, v, steps)``): the rotations one batch at a time, every update of the moments in
    multi-tensor operations over all of them (a few kernels for the lot, where one batch at a
    time took some twenty each). Not finite anywhere: no moment changes, every result is not
    finite."""
    beta1, beta2 = betas
    rotated = [_into(g, qa, qg) for g, (qa, qg) in zip(grads, bases, strict=True)]
    # One norm per batch in one operation: not finite where any element is not (or where the
    # squares overflow, as v's update would).
    finite = torch.isfinite(torch.stack(torch._foreach_norm(rotated)).sum())
    keep = finite.to(rotated[0].dtype)
    # Zero where not finite, so that the updates below, weighted by keep = 0, leave the
    # moments exactly as they were (0·NaN would not).
    safe = [torch.where(finite, r, 0.0) for r in rotated]
    ms = [m for m, _, _ in moments]
    vs = [v for _, v, _ in moments]
    # m += (1 - β₁)·keep·(r - m); v += (1 - β₂)·keep·(r² - v)
    step_m = torch._foreach_sub(safe, ms)
    torch._foreach_mul_(step_m, keep * (1.0 - beta1))
    torch._foreach_add_(ms, step_m)
    step_v = torch._foreach_mul(safe, safe)
    torch._foreach_sub_(step_v, vs)
    torch._foreach_mul_(step_v, keep * (1.0 - beta2))
    torch._foreach_add_(vs, step_v)
    del step_m, step_v, safe, rotated
    steps = [count for _, _, count in moments]
    # (a list of the flag: a tensor scalar would be read back on the CPU)
    torch._foreach_add_(steps, [keep] * len(steps))
    # Bias corrections for every layer at once: m̂ = m / (1 - β₁ᵗ), √v̂ = √v / √(1 - β₂ᵗ);
    # m̂'s not finite where the gradient was not, so that the step keeps the raw gradients.
    counts = torch.cat(steps).clamp(min=1.0)
    first = (1.0 - torch.pow(beta1, counts)).reciprocal_()
    first.mul_(torch.where(finite, 1.0, float("nan")))
    second = (1.0 - torch.pow(beta2, counts)).rsqrt_()
    sizes = [len(count) for count in steps]
    firsts = [c.reshape(-1, 1, 1) for c in torch.split(first, sizes)]
    seconds = [c.reshape(-1, 1, 1) for c in torch.split(second, sizes)]
    denominator = torch._foreach_sqrt(vs)
    torch._foreach_mul_(denominator, seconds)
    torch._foreach_add_(denominator, eps)
    direction = torch._foreach_mul(ms, firsts)
    torch._foreach_div_(direction, denominator)
    return [_out_of(d, qa, qg) for d, (qa, qg) in zip(direction, bases, strict=True)]


def _into(grad: torch.Tensor, qa: torch.Tensor | None, qg: torch.Tensor) -> torch.Tensor:
    """``Q_Gᵀ ∇W Q_A`` (``qa`` None: A's basis is the identity)."""
    rotated = qg.transpose(-1, -2) @ grad
    return rotated if qa is None else rotated @ qa


def _out_of(direction: torch.Tensor, qa: torch.Tensor | None, qg: torch.Tensor) -> torch.Tensor:
    """``Q_G D Q_Aᵀ`` (``qa`` None: A's basis is the identity)."""
    back = qg @ direction
    return back if qa is None else back @ qa.transpose(-1, -2)


class _StateInBasis(EigenDecomposition):
    """The eigen method's bases with per-coordinate state ``(k, g, a)`` kept in them, which
    follows the bases when they change (``leave_basis`` before, ``finish`` after) through
    ``R_A = Q_Aᵀ Q_A'`` and ``R_G = Q_Gᵀ Q_G'``: a first moment as ``R_Gᵀ m R_A`` exactly, a
    second moment (or a diagonal of variances) as ``(R_G∘R_G)ᵀ v (R_A∘R_A)``, each new
    coordinate's value as the old coordinates it mixes (independent ones) give it. A new basis
    vector is then scaled by the state of the old vectors it is made of, whatever order
    ``eigh`` returns them in: SOAP reorders its second moments by its eigenvalue estimates for
    the same reason. The state never travels in a decomposition broadcast: every rank that
    holds the bases updates it alike."""

    def __init__(
        self, *, name: str, inv_dtype: torch.dtype, basis_update: BasisUpdate = BasisUpdate.EIGH
    ) -> None:
        super().__init__(
            name=name, inv_dtype=inv_dtype, outer_product=False, basis_update=basis_update
        )
        self._old_bases: tuple[torch.Tensor | None, torch.Tensor] | None = None

    @abstractmethod
    def _has_state(self) -> bool:
        """Whether there is state to rotate into new bases."""

    def leave_basis(self) -> None:
        """Before new bases arrive: keep the current ones to rotate the state from."""
        if self._has_state() and self.has_bases():
            assert self.qg is not None
            # a diagonal A's basis is the identity before and after: nothing to keep (None)
            old_qa = None if self.qa is None else self.qa.clone()
            self._old_bases = (old_qa, self.qg.clone())

    def _rotations(self) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """``(R_A, R_G)`` from the bases left to the new ones (None if there were none; R_A
        None where A's basis is the identity before and after)."""
        if self._old_bases is None or not self.has_bases():
            return None
        assert self.qg is not None
        old_qa, old_qg = self._old_bases
        self._old_bases = None
        rotate_a = None if old_qa is None or self.qa is None else old_qa.mT @ self.qa
        return rotate_a, old_qg.transpose(-1, -2) @ self.qg

    @staticmethod
    def _spread(
        value: torch.Tensor, rotate_a: torch.Tensor | None, rotate_g: torch.Tensor
    ) -> torch.Tensor:
        """A second moment's (or variances') ``(R_G∘R_G)ᵀ v (R_A∘R_A)`` (R_A None: I)."""
        spread = (rotate_g * rotate_g).transpose(-1, -2) @ value
        return spread if rotate_a is None else spread @ (rotate_a * rotate_a)

    def clear(self) -> None:
        super().clear()
        self._old_bases = None


class AdamEigenbasis(_StateInBasis):
    """The eigen method's bases with Adam's moments in them instead of the eigenvalue
    products (``Scaling.ADAM_EIGENBASIS``): ``m`` and ``v`` ``(k, g, a)`` and the count of
    their updates ``steps`` ``(k,)``, held where the layer is preconditioned and saved in
    checkpoints; they follow each new basis as ``_StateInBasis`` says (m exactly, v spread)."""

    def __init__(
        self,
        *,
        name: str,
        inv_dtype: torch.dtype,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        basis_update: BasisUpdate = BasisUpdate.EIGH,
    ) -> None:
        super().__init__(name=name, inv_dtype=inv_dtype, basis_update=basis_update)
        self.betas = betas
        self.eps = eps
        self.m: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.steps: torch.Tensor | None = None

    def _has_state(self) -> bool:
        return self.m is not None

    def _start(self, like: torch.Tensor) -> None:
        """Zero moments of ``like``'s ``(k, g, a)`` shape (no step taken yet)."""
        k = like.shape[0]
        self._keep("m", torch.zeros_like(like, dtype=self.inv_dtype))
        self._keep("v", torch.zeros_like(like, dtype=self.inv_dtype))
        self._keep("steps", torch.zeros(k, dtype=self.inv_dtype, device=like.device))

    def finish(self, damping: float) -> None:
        if not self.has_bases():
            raise RuntimeError(f"layer {self.name!r}: finish() before both factors decomposed")
        rotations = self._rotations()
        if rotations is not None and self.m is not None and self.v is not None:
            rotate_a, rotate_g = rotations
            m = rotate_g.transpose(-1, -2) @ self.m
            self._keep("m", m if rotate_a is None else m @ rotate_a)
            self._keep("v", self._spread(self.v, rotate_a, rotate_g))

    def _rotate_state_a(self, rotate_a: torch.Tensor) -> None:
        if self.m is not None and self.v is not None:
            self._keep("m", self.m @ rotate_a)
            self._keep("v", self.v @ (rotate_a * rotate_a))

    def moments(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(m, v, steps)``, zero where never started (``like``: a ``(k, g, a)`` gradient)."""
        if self.m is None or self.v is None or self.steps is None:
            self._start(like)
        assert self.m is not None
        assert self.v is not None
        assert self.steps is not None
        return self.m, self.v, self.steps

    def precondition(self, grad_out_by_in: torch.Tensor, damping: float) -> torch.Tensor:
        if not self.has_bases():
            raise RuntimeError(f"layer {self.name!r} has no decomposition yet")
        assert self.qg is not None
        grad = grad_out_by_in.to(self.inv_dtype)
        out = adam_eigenbasis_precondition(
            grad, self.qa, self.qg, self.moments(grad), self.betas, self.eps
        )
        return out.to(grad_out_by_in.dtype)

    def saved_parts(self) -> tuple[str, ...]:
        return (*self.parts(), "m", "v", "steps")

    def tensors(self) -> dict[str, torch.Tensor]:
        named = {"m": self.m, "v": self.v, "steps": self.steps}
        return {**super().tensors(), **{k: v for k, v in named.items() if v is not None}}


class EKFACEigenbasis(_StateInBasis):
    """The eigen method's bases with EKFAC's fitted diagonal ``s`` ``(k, g, a)`` in place of
    the eigenvalue products (``Scaling.EKFAC``; George et al. 2018): the preconditioned
    gradient is ``Q_G [(Q_Gᵀ ∇W Q_A) / (s + γ)] Q_Aᵀ``.

    ``s`` starts, at the first decomposition, as ``λ_G λ_Aᵀ`` (what the Kronecker
    approximation says the second moments in the eigenbasis are) and on each factor update
    takes the batch's second moments of the projected per-example gradients with the
    factors' running-average decay (``fold``); a new basis takes it as a second moment
    (``_StateInBasis``). Held where the layer is preconditioned and saved in checkpoints."""

    def __init__(
        self, *, name: str, inv_dtype: torch.dtype, basis_update: BasisUpdate = BasisUpdate.EIGH
    ) -> None:
        super().__init__(name=name, inv_dtype=inv_dtype, basis_update=basis_update)
        self.s: torch.Tensor | None = None

    def _has_state(self) -> bool:
        return self.s is not None

    def finish(self, damping: float) -> None:
        if not self.has_bases() or self.da is None or self.dg is None:
            raise RuntimeError(f"layer {self.name!r}: finish() before both factors decomposed")
        rotations = self._rotations()
        if self.s is None:
            self._keep("s", self.dg.unsqueeze(-1) * self.da.unsqueeze(-2))
        elif rotations is not None:
            self._keep("s", self._spread(self.s, *rotations))

    def _rotate_state_a(self, rotate_a: torch.Tensor) -> None:
        if self.s is not None:
            self._keep("s", self.s @ (rotate_a * rotate_a))

    def fold(self, batch: torch.Tensor, decay: float) -> None:
        """``s ← decay·s + (1 − decay)·batch`` in place (a batch's fitted diagonal, computed in
        the current bases: ``kaisa_ray.ekfac``)."""
        if self.s is None:
            raise RuntimeError(f"layer {self.name!r}: a fitted diagonal before any basis")
        self.s.mul_(decay).add_(batch.to(self.s.dtype), alpha=1.0 - decay)

    def precondition(self, grad_out_by_in: torch.Tensor, damping: float) -> torch.Tensor:
        if not self.has_bases() or self.s is None:
            raise RuntimeError(f"layer {self.name!r} has no decomposition yet")
        assert self.qg is not None
        grad = grad_out_by_in.to(self.inv_dtype)
        out = eigen_precondition(grad, self.qa, self.qg, denominator=self.s + damping)
        return out.to(grad_out_by_in.dtype)

    def saved_parts(self) -> tuple[str, ...]:
        return (*self.parts(), "s")

    def tensors(self) -> dict[str, torch.Tensor]:
        return {**super().tensors(), **({"s": self.s} if self.s is not None else {})}
