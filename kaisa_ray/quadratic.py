"""K-FAC's own step size: the quadratic model's learning rate and momentum, and one damping
adapted by the Levenberg-Marquardt rule (Martens & Grosse 2015, sections 6.5 and 7; kfac-jax's
``use_adaptive_learning_rate``, ``use_adaptive_momentum`` and ``use_adaptive_damping``).

Each step moves the parameters by ``δ = α Δ + μ δ₀``, where ``Δ`` is the negative of the
preconditioned gradient (what ``KFACPreconditioner.step()`` leaves in ``.grad``) and ``δ₀`` the
previous step, with ``α`` and ``μ`` the minimiser of the local quadratic model

    M(δ) = gᵀδ + ½ δᵀ (F + λ I) δ

over that two-dimensional subspace: ``g`` the raw gradient (captured before preconditioning),
``F`` the exact Gauss-Newton matrix of the softmax cross-entropy at the current parameters
(``Jᵀ H J``, its products with ``Δ`` and ``δ₀`` from Jacobian-vector products on a sample of the
batch) and ``λ`` the damping. Every ``adapt_every`` steps ``λ`` follows the reduction ratio ``ρ``
(the sample's loss change over the undamped model's prediction): ``λ ← ω λ`` when ``ρ > 3/4``,
``λ ← λ / ω`` when ``ρ < 1/4``, ``ω = decay^adapt_every``. Built with
``damping=step.current_damping``, the preconditioner's damping follows the same λ (kfac-jax's
single damping; a new λ takes effect at its next inverse update).

There is no learning rate, momentum or schedule to tune: the optimizer is not used.

Distributed: every rank holds the same (all-reduced) gradient and preconditioned gradient, so
the gradient and identity terms are the same everywhere; the curvature terms and the losses are
sums over each rank's sample, all-reduced with their example counts, so every rank solves the
same system and takes the same step.

Typical use (``model`` unwrapped from DDP), each step::

    step = QuadraticModelStep(model, damping=0.1, min_damping=1e-3)
    precond = KFACPreconditioner(model, damping=step.current_damping, kl_clip=None, ...)
    ...
    model.zero_grad(set_to_none=True)  # each step's gradient alone
    loss_fn(model(x), y).backward()
    step.capture()
    precond.step()
    step.step(x[:samples], y[:samples])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call, jvp, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from kaisa_ray.errors import ConfigurationError

__all__ = ["QuadraticModelStep", "StepInfo", "ggn_product"]

# Martens & Grosse's constants: the LM rule's thresholds and per-step decay.
RHO_RAISE = 0.25
RHO_LOWER = 0.75
MIN_DAMPING = 1e-8  # kfac-jax's min_damping by default; the JobSpec floors at 1e-3
MAX_DAMPING = 1e6


def ggn_product(logits: torch.Tensor, u: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``Σ_rows uᵀ H w``, ``H = diag(p) − p pᵀ`` the softmax cross-entropy's Hessian in one
    row's logits; ``u`` and ``w`` the logits' directional derivatives (rows × classes)."""
    p = torch.softmax(logits, dim=1)
    return ((p * u * w).sum(1) - (p * u).sum(1) * (p * w).sum(1)).sum()


def _dot(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    """``aᵀb`` over the named tensors, in float64."""
    return torch.stack([(a[n].double() * b[n].double()).sum() for n in names]).sum()


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """Logits as (rows, classes), in the order of the targets flattened: the classes on dim 1,
    as ``nn.CrossEntropyLoss`` takes them ((batch, classes) or (batch, classes, d1, ...), e.g.
    a sequence model's (batch, vocabulary, positions))."""
    if tensor.dim() == 2:
        return tensor
    return tensor.movedim(1, -1).reshape(-1, tensor.shape[1])


@dataclass(frozen=True)
class StepInfo:
    """What one step chose: ``alpha`` (on the preconditioned gradient's negative), ``mu`` (on
    the previous step; 0 on the first), the model's predicted loss change, and ``rho`` (the
    observed over the predicted change) on the steps that adapt λ, else None."""

    alpha: float
    mu: float
    predicted: float
    rho: float | None
    damping: float


class QuadraticModelStep:
    """Applies K-FAC's quadratic-model step to ``model``'s parameters (see the module's text).

    Args:
        model: the network (not its DDP wrapper); its output is the logits of a softmax
            cross-entropy as ``nn.CrossEntropyLoss`` takes them: (batch, classes) or
            (batch, classes, d1, ...), with targets (batch) or (batch, d1, ...).
        damping: λ's starting value (> 0).
        min_damping: the floor the rule never takes λ below (0 < min_damping <= damping;
            kfac-jax's ``min_damping``; None: 1e-8, or ``damping`` if that is lower). The
            rule measures the loss change on the sample the step was fitted to, so on small,
            noisy batches it can keep lowering λ until the step fits its sample and not the
            data (the char-transformer at 64 sequences a step fell from 0.1 to 1e-8 by step
            540 and diverged at step 790; floored at 1e-3 it trained to the target); a floor
            is then the remedy, and the JobSpec's default (``kfac.min_damping``, 1e-3).
        adapt_every: steps between Levenberg-Marquardt adjustments of λ; 0 keeps λ fixed.
        decay: λ's per-step factor ω^(1/adapt_every) (0 < decay < 1).
        group: the process group whose ranks step together (None: the default group when
            torch.distributed is initialised with more than one rank, else this process).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        damping: float = 0.1,
        min_damping: float | None = None,
        adapt_every: int = 5,
        decay: float = 19 / 20,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if not (isinstance(damping, int | float) and 0 < damping <= MAX_DAMPING):
            raise ConfigurationError(
                f"damping={damping!r}: the quadratic model's starting damping must be in "
                f"(0, {MAX_DAMPING:g}]; 0.1 is a safe start (it adapts)"
            )
        if min_damping is None:
            min_damping = min(MIN_DAMPING, damping)
        if not (isinstance(min_damping, int | float) and 0 < min_damping <= damping):
            raise ConfigurationError(
                f"min_damping={min_damping!r}: the damping's floor must be in (0, damping="
                f"{damping!r}]; {MIN_DAMPING:g} (the default) floors nothing in practice, "
                "1e-3 keeps a small, noisy batch's λ from collapsing"
            )
        if not (isinstance(adapt_every, int) and adapt_every >= 0):
            raise ConfigurationError(
                f"adapt_every={adapt_every!r} must be a whole number of steps >= 0 (5 as "
                "Martens & Grosse; 0 keeps the damping fixed)"
            )
        if not 0 < decay < 1:
            raise ConfigurationError(f"decay={decay!r} must be in (0, 1), e.g. 19/20")
        self.model = model
        self.damping = float(damping)
        self.min_damping = float(min_damping)
        self.adapt_every = adapt_every
        self.omega = decay**adapt_every if adapt_every else 1.0
        self.group = group
        self.steps = 0
        self.previous: dict[str, torch.Tensor] | None = None
        self.last: StepInfo | None = None
        self._raw: dict[str, torch.Tensor] | None = None

    def current_damping(self, _step: int = 0) -> float:
        """λ now: the preconditioner's ``damping`` callable for one damping."""
        return self.damping

    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1

    def _trained(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.model.named_parameters() if p.grad is not None}

    def capture(self) -> None:
        """Keep the raw gradient ``g`` (call after backward, before the preconditioner)."""
        self._raw = {n: p.grad.detach().clone() for n, p in self._trained().items()}  # type: ignore[union-attr]

    def _logits(self, params: dict[str, torch.Tensor], inputs: torch.Tensor) -> torch.Tensor:
        # Attention's fused kernels have no forward-mode derivative; its math kernel, the same
        # function from primitive ops, has.
        with sdpa_kernel([SDPBackend.MATH]):
            out = functional_call(self.model, params, (inputs,))
        if not isinstance(out, torch.Tensor):
            raise ConfigurationError(
                "the quadratic-model step needs a model that returns one logits tensor; "
                f"{type(self.model).__name__} returned {type(out).__name__}"
            )
        return _rows(out)

    def _jacobian_products(
        self,
        values: dict[str, torch.Tensor],
        directions: list[dict[str, torch.Tensor]],
        inputs: torch.Tensor,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The logits and ``J d`` for every direction ``d``: one forward pass for the logits
        and the directions' tangents together (``vmap`` over the tangents of one ``jvp``),
        rather than a forward pass per direction."""

        def forward(p: dict[str, torch.Tensor]) -> torch.Tensor:
            return self._logits(p, inputs)

        def products(d: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            out = jvp(forward, (values,), (d,))
            return out[0], out[1]

        if len(directions) == 1:
            logits, product = products(directions[0])
            return logits, [product]
        stacked = {n: torch.stack([d[n] for d in directions]) for n in values}
        # The logits do not depend on the tangent: returned once (out_dims None).
        out_dims: Any = (None, 0)
        logits, batched = vmap(products, out_dims=out_dims)(stacked)
        return logits, list(batched.unbind(0))

    def _loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits, targets.reshape(-1), reduction="sum")

    @torch.no_grad()
    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> StepInfo:
        """Choose ``α`` and ``μ`` on ``(inputs, targets)`` (this rank's sample), move the
        parameters by ``δ = α Δ + μ δ₀``, and adapt λ when due. Collective when distributed.
        Run without gradient recording, so K-FAC's hooks record nothing here."""
        if self._raw is None:
            raise RuntimeError("capture() the raw gradient after backward, before step()")
        raw, self._raw = self._raw, None
        params = self._trained()
        names = [n for n in params if n in raw]
        values = {n: params[n].detach() for n in names}
        directions = [{n: -params[n].grad.detach() for n in names}]  # type: ignore[union-attr]
        if self.previous is not None and set(self.previous) == set(names):
            directions.append(self.previous)
        k = len(directions)

        logits, jacobians = self._jacobian_products(values, directions, inputs)
        logits = logits.double()
        jacobians = [j.double() for j in jacobians]
        # One all-reduce: the curvature's sums, the sample's loss before the step, its rows.
        local = torch.zeros(k * k + 2, dtype=torch.float64, device=logits.device)
        for i in range(k):
            for j in range(i, k):
                local[i * k + j] = local[j * k + i] = ggn_product(
                    logits, jacobians[i], jacobians[j]
                )
        local[k * k] = self._loss_sum(logits, targets)
        local[k * k + 1] = logits.shape[0]
        if self._distributed():
            dist.all_reduce(local, group=self.group)
        local = local.cpu()
        rows = float(local[k * k + 1])
        curvature = (local[: k * k] / rows).reshape(k, k)
        before = float(local[k * k]) / rows
        grad = torch.stack([_dot(raw, d, names) for d in directions]).cpu()
        gram = torch.stack(
            [torch.stack([_dot(a, b, names) for b in directions]) for a in directions]
        ).cpu()
        coefficients = self._solve(curvature + self.damping * gram, grad)
        predicted = float(grad @ coefficients + 0.5 * coefficients @ curvature @ coefficients)
        step: dict[str, torch.Tensor] = {}
        for n in names:
            step[n] = float(coefficients[0]) * directions[0][n]
            for c, d in zip(coefficients[1:], directions[1:], strict=True):
                step[n] = step[n] + float(c) * d[n]
            params[n].add_(step[n])
        self.previous = step
        self.steps += 1
        rho = None
        if self.adapt_every and self.steps % self.adapt_every == 0:
            rho = self._adapt(inputs, targets, before, predicted)
        self.last = StepInfo(
            alpha=float(coefficients[0]),
            mu=float(coefficients[1]) if k > 1 else 0.0,
            predicted=predicted,
            rho=rho,
            damping=self.damping,
        )
        return self.last

    @staticmethod
    def _solve(matrix: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """``-matrix⁻¹ grad``; where the directions are (numerically) dependent, the previous
        step is dropped, and a zero gradient takes no step."""
        try:
            solution: torch.Tensor = -torch.linalg.solve(matrix, grad)
            if bool(torch.isfinite(solution).all()):
                return solution
        except RuntimeError:
            pass
        out = torch.zeros_like(grad)
        if float(matrix[0, 0]) > 0:
            out[0] = -grad[0] / matrix[0, 0]
        return out

    def _adapt(
        self, inputs: torch.Tensor, targets: torch.Tensor, before: float, predicted: float
    ) -> float:
        """The Levenberg-Marquardt rule on the sample's loss after the step."""
        values = {n: p.detach() for n, p in self._trained().items()}
        logits = self._logits(values, inputs)
        after = self._loss_sum(logits, targets).double().reshape(1)
        rows = torch.tensor([float(logits.shape[0])], dtype=torch.float64, device=logits.device)
        both = torch.cat([after, rows])
        if self._distributed():
            dist.all_reduce(both, group=self.group)
        change = float(both[0]) / float(both[1]) - before
        rho = change / predicted if predicted < 0 else 0.0
        if rho > RHO_LOWER:
            self.damping = max(self.damping * self.omega, self.min_damping)
        elif rho < RHO_RAISE:
            self.damping = min(self.damping / self.omega, MAX_DAMPING)
        return rho

    def state_dict(self) -> dict[str, Any]:
        """λ, the step count (the LM rule's phase) and the previous step ``δ₀``."""
        return {
            "damping": self.damping,
            "steps": self.steps,
            "previous": None
            if self.previous is None
            else {n: t.clone() for n, t in self.previous.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict()``."""
        self.damping = float(state["damping"])
        self.steps = int(state["steps"])
        previous = state.get("previous")
        self.previous = None if previous is None else {n: t.clone() for n, t in previous.items()}
