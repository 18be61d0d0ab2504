"""What a job's ``optimizer`` and ``kfac`` sections build in each worker: the optimizer, its
learning-rate schedule, and the K-FAC preconditioner.

A new optimizer option is a field of ``spec/sections.py``'s ``OptimizerSpec`` and a line here;
a new K-FAC option a field of ``spec/kfac.py``'s ``KFACSpec`` and of its
``preconditioner_options``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from kaisa_ray.enums import OptimizerName, Scaling
from kaisa_ray.errors import ConfigurationError
from kaisa_ray.intervals import AdaptiveIntervals
from kaisa_ray.options import ADAM_BETAS, ADAM_EPS
from kaisa_ray.preconditioner import KFACPreconditioner
from kaisa_ray.registration import discover
from kaisa_train.spec import KFACSpec, OptimizerSpec, ScheduleSpec

__all__ = ["EigenbasisAdam", "build_optimizer", "build_preconditioner", "lr_factor"]


class EigenbasisAdam(torch.optim.Adam):
    """The optimizer of ``kfac.scaling: adam-eigenbasis``. The layers K-FAC preconditions
    arrive with Adam's direction in K-FAC's eigenbasis as their gradient and take it as the
    step, ``p ← p − lr·d`` (SGD without momentum); every other parameter (embeddings, norms:
    what K-FAC leaves alone) takes torch's Adam step with the same betas, ε and lr, as SOAP
    gives Adam to the parameters it does not rotate. One lr, so one schedule moves both;
    ``weight_decay`` is added to the gradients as torch's SGD and Adam add it."""

    def __init__(
        self,
        directed: list[nn.Parameter],
        others: list[nn.Parameter],
        *,
        lr: float,
        betas: tuple[float, float] = ADAM_BETAS,
        eps: float = ADAM_EPS,
        weight_decay: float = 0.0,
    ) -> None:
        groups: list[dict[str, Any]] = [{"params": directed, "preconditioned": True}]
        if others:
            groups.append({"params": others, "preconditioned": False})
        super().__init__(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        everything = self.param_groups
        for group in everything:
            if group["preconditioned"]:
                for param in group["params"]:
                    if param.grad is not None:
                        grad = param.grad
                        if group["weight_decay"]:  # L2, as torch's SGD adds it
                            grad = grad.add(param, alpha=group["weight_decay"])
                        param.add_(grad, alpha=-group["lr"])
        # Adam's own step over the other groups only (its state is theirs alone)
        self.param_groups = [group for group in everything if not group["preconditioned"]]
        try:
            if self.param_groups:
                super().step()
        finally:
            self.param_groups = everything
        return loss


def build_optimizer(
    spec: OptimizerSpec,
    params: Iterable[nn.Parameter],
    model: nn.Module | None = None,
    kfac: KFACSpec | None = None,
) -> torch.optim.Optimizer:
    """The optimizer a job asks for; with ``kfac.scaling: adam-eigenbasis`` (``model`` given)
    ``EigenbasisAdam`` over ``params``, split by which of them K-FAC preconditions."""
    if kfac is not None and kfac.scaling is Scaling.ADAM_EIGENBASIS:
        if model is None:
            raise ValueError("adam-eigenbasis's optimizer needs the model to split its parameters")
        found, _ = discover(model, kfac_approx=kfac.kfac_approx, embeddings=kfac.embeddings)
        preconditioned = {id(p) for reg in found for p in reg.module.parameters(recurse=False)}
        listed = list(params)
        return EigenbasisAdam(
            [p for p in listed if id(p) in preconditioned],
            [p for p in listed if id(p) not in preconditioned],
            lr=spec.lr,
            weight_decay=spec.weight_decay,
        )
    if spec.name is OptimizerName.SGD:
        return torch.optim.SGD(
            params,
            lr=spec.lr,
            momentum=spec.momentum,
            nesterov=spec.nesterov and spec.momentum > 0,
            weight_decay=spec.weight_decay,
        )
    if spec.name is OptimizerName.ADAM:
        return torch.optim.Adam(params, lr=spec.lr, weight_decay=spec.weight_decay)
    if spec.name in PEERS:
        return _peer(spec, params)
    return torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay)


PEERS = {
    OptimizerName.SOAP: "SOAP",
    OptimizerName.MUON: "MuonAdamW",
    OptimizerName.PSGD_KRON: "PSGDKron",
}
"""heavyball's class for each peer optimizer name (``spec.PEER_OPTIMIZERS``)."""


def _peer(spec: OptimizerSpec, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """A peer from heavyball, eager: heavyball compiles its step with ``torch.compile`` by
    default, which on CPU costs seconds per worker before the first step and fails for PSGD
    Kron with torch's inductor (``benchmarks/step_cost.py`` measures both where it works)."""
    try:
        import heavyball
        import heavyball.utils
    except ImportError as err:
        raise ConfigurationError(
            f"optimizer {spec.name} comes from heavyball, which is not installed: pip install "
            "'kaisa-ray[peers]'"
        ) from err
    heavyball.utils.compile_mode = None
    options: dict[str, Any] = {}
    if spec.precondition_frequency is not None:
        options["precondition_frequency"] = spec.precondition_frequency
    optimizer: torch.optim.Optimizer = getattr(heavyball, PEERS[spec.name])(
        list(params), lr=spec.lr, weight_decay=spec.weight_decay, **options
    )
    return optimizer


def lr_factor(schedule: ScheduleSpec, total_steps: int) -> Callable[[int], float]:
    """The lr multiplier after ``s`` completed steps: linear warm-up, then the schedule.

    Warm-up rises linearly from ``1/(warmup_steps+1)`` to 1 over ``warmup_steps`` steps;
    ``cosine`` then decays to 0 at ``total_steps``; ``step`` multiplies by ``gamma`` every
    ``step_every`` steps after warm-up; ``constant`` stays at 1.
    """
    warmup = schedule.warmup_steps

    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / (warmup + 1)
        after = s - warmup
        if schedule.kind == "cosine":
            span = max(total_steps - warmup, 1)
            return 0.5 * (1.0 + math.cos(math.pi * min(after, span) / span))
        if schedule.kind == "step" and schedule.step_every:
            return float(schedule.gamma ** (after // schedule.step_every))
        return 1.0

    return factor


def build_preconditioner(
    spec: KFACSpec,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None = None,
    intervals: AdaptiveIntervals | None = None,
    damping: Callable[[int], float] | None = None,
) -> KFACPreconditioner:
    """K-FAC as the job asks for it (a fixed strategy: ``kfac: auto`` is decided before, and
    with adaptive intervals the tuner's ``intervals`` replace the fixed ones); KL clipping
    follows the lr schedule; with fp16, the GradScaler's scale is taken out of the output
    gradients. ``damping``, when given, replaces the spec's (the quadratic-model step's λ)."""
    group = optimizer.param_groups[0]
    options = spec.preconditioner_options()
    if intervals is not None:  # adaptive intervals measure the staleness themselves
        del options["measure_staleness"]
        options["intervals"] = intervals
    else:
        options["factor_update_steps"] = spec.factor_update_steps
        options["inv_update_steps"] = spec.inv_update_steps
    if damping is not None:
        options["damping"] = damping
    return KFACPreconditioner(
        model,
        grad_scaler=scaler,
        lr=lambda _step: float(group["lr"]),
        grad_worker_fraction=spec.strategy,
        **options,
    )
