"""``PreconditionerOptions``: the keyword arguments of ``KFACPreconditioner``, checked and
normalised in one place (each argument's meaning: ``KFACPreconditioner``'s docstring).

``PreconditionerOptions.checked(...)`` refuses a bad argument with a ``ConfigurationError``
that names it and the fix, parses the enum arguments from their names, and warns where a
combination works but wastes work. The preconditioner then builds its engine from the result.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from kaisa_ray.enums import (
    AssignmentStrategy,
    BasisUpdate,
    ComputeMethod,
    DistributedStrategy,
    FactorReduction,
    FactorScale,
    KFACApprox,
    MatmulPrecision,
    RunningAverage,
    Scaling,
    parse_enum,
)
from kaisa_ray.errors import ConfigurationError, user_stacklevel
from kaisa_ray.hyperparams import Bounds, FloatParam, IntParam, check_param, resolve_int
from kaisa_ray.intervals import AdaptiveIntervals
from kaisa_ray.plan import Options, check_deferral

DAMPING = Bounds(
    low=0.0,
    low_inclusive=False,
    advice="Use a positive damping such as 0.003 (small steps damp less) to 0.1.",
)
FACTOR_DECAY = Bounds(
    low=0.0,
    high=1.0,
    high_inclusive=False,
    advice="Use a running-average decay in [0, 1), typically 0.95.",
)
KL_CLIP = Bounds(
    low=0.0, low_inclusive=False, advice="Use a positive kl_clip such as 0.001, or None to disable."
)
LR = Bounds(low=0.0, advice="Pass the optimizer's learning rate (a float >= 0 or a schedule).")


class _Scaler(Protocol):
    def get_scale(self) -> float: ...


GradScalerLike = _Scaler | Callable[[], float]


# Adam's moments in the eigenbasis (scaling='adam-eigenbasis'): SOAP's defaults.
ADAM_BETAS = (0.9, 0.95)
ADAM_EPS = 1e-8


@dataclass(frozen=True, kw_only=True)
class PreconditionerOptions:
    """Every keyword of ``KFACPreconditioner`` with its default; enums parsed, ``skip_layers``
    a tuple. Build it with ``checked``."""

    factor_update_steps: IntParam = 1
    inv_update_steps: IntParam = 1
    damping: FloatParam = 0.001
    factor_decay: FloatParam = 0.95
    kl_clip: FloatParam | None = 0.001
    lr: FloatParam = 0.1
    accumulation_steps: int = 1
    allreduce_bucket_cap_mb: float = 25.0
    assignment_strategy: AssignmentStrategy = AssignmentStrategy.COMPUTE
    colocate_factors: bool = True
    compute_method: ComputeMethod = ComputeMethod.EIGEN
    compute_eigenvalue_outer_product: bool = True
    grad_worker_fraction: DistributedStrategy | float | str = DistributedStrategy.COMM_OPT
    symmetry_aware: bool = False
    grad_scaler: GradScalerLike | None = None
    factor_dtype: torch.dtype | None = None
    inv_dtype: torch.dtype | None = None
    skip_layers: tuple[str, ...] = field(default_factory=tuple)
    update_factors_in_hook: bool = True
    loglevel: int = logging.INFO
    kfac_approx: KFACApprox = KFACApprox.EXPAND
    sequence_approx: KFACApprox = KFACApprox.EXPAND
    running_average: RunningAverage = RunningAverage.IDENTITY
    factor_scale: FactorScale = FactorScale.REFERENCE
    pi_damping: bool = False
    factor_samples: int | None = None
    intervals: AdaptiveIntervals | None = None
    measure_staleness: bool | None = None
    matmul_precision: MatmulPrecision = MatmulPrecision.HIGH
    scaling: Scaling = Scaling.KRONECKER
    adam_betas: tuple[float, float] = ADAM_BETAS
    adam_eps: float = ADAM_EPS
    basis_update: BasisUpdate = BasisUpdate.EIGH
    factor_reduction: FactorReduction = FactorReduction.EVERY_UPDATE
    cuda_graphs: bool = False
    embeddings: bool = False

    @property
    def measures_staleness(self) -> bool:
        """Staleness is measured: asked for, or adaptive intervals (which decide from it)."""
        return self.intervals is not None or bool(self.measure_staleness)

    @classmethod
    def checked(
        cls,
        *,
        skip_layers: Iterable[str] | str | None = None,
        assignment_strategy: AssignmentStrategy | str = AssignmentStrategy.COMPUTE,
        compute_method: ComputeMethod | str = ComputeMethod.EIGEN,
        kfac_approx: KFACApprox | str = KFACApprox.EXPAND,
        sequence_approx: KFACApprox | str = KFACApprox.EXPAND,
        running_average: RunningAverage | str = RunningAverage.IDENTITY,
        factor_scale: FactorScale | str = FactorScale.REFERENCE,
        matmul_precision: MatmulPrecision | str = MatmulPrecision.HIGH,
        scaling: Scaling | str = Scaling.KRONECKER,
        basis_update: BasisUpdate | str = BasisUpdate.EIGH,
        factor_reduction: FactorReduction | str = FactorReduction.EVERY_UPDATE,
        **rest: Any,
    ) -> PreconditionerOptions:
        """The options, every argument checked (``ConfigurationError`` naming a bad one and
        its fix) and the enums parsed from their names."""
        options = cls(
            skip_layers=(
                (skip_layers,) if isinstance(skip_layers, str) else tuple(skip_layers or ())
            ),
            assignment_strategy=parse_enum(
                AssignmentStrategy, assignment_strategy, "assignment_strategy"
            ),
            compute_method=parse_enum(ComputeMethod, compute_method, "compute_method"),
            kfac_approx=parse_enum(KFACApprox, kfac_approx, "kfac_approx"),
            sequence_approx=parse_enum(KFACApprox, sequence_approx, "sequence_approx"),
            running_average=parse_enum(RunningAverage, running_average, "running_average"),
            factor_scale=parse_enum(FactorScale, factor_scale, "factor_scale"),
            matmul_precision=parse_enum(MatmulPrecision, matmul_precision, "matmul_precision"),
            scaling=parse_enum(Scaling, scaling, "scaling"),
            basis_update=parse_enum(BasisUpdate, basis_update, "basis_update"),
            factor_reduction=parse_enum(FactorReduction, factor_reduction, "factor_reduction"),
            **rest,
        )
        options._check()
        return replace(
            options,
            adam_betas=(float(options.adam_betas[0]), float(options.adam_betas[1])),
            adam_eps=float(options.adam_eps),
            # Adam in the eigenbasis and EKFAC have no eigenvalue table to build.
            compute_eigenvalue_outer_product=options.compute_eigenvalue_outer_product
            and options.scaling is Scaling.KRONECKER,
        )

    def _check(self) -> None:
        for name, value in (
            ("factor_update_steps", self.factor_update_steps),
            ("inv_update_steps", self.inv_update_steps),
        ):
            if not callable(value):
                resolve_int(name, value, 0)
        check_param("damping", self.damping, DAMPING)
        check_param("factor_decay", self.factor_decay, FACTOR_DECAY)
        if self.kl_clip is not None:
            check_param("kl_clip", self.kl_clip, KL_CLIP)
        check_param("lr", self.lr, LR)
        accumulation = self.accumulation_steps
        if isinstance(accumulation, bool) or not isinstance(accumulation, int) or accumulation < 1:
            raise ConfigurationError(
                f"accumulation_steps={accumulation!r} must be a positive integer: the "
                "number of forward/backward passes per optimizer step (1 without accumulation)."
            )
        samples = self.factor_samples
        if samples is not None and (
            isinstance(samples, bool) or not isinstance(samples, int) or samples < 1
        ):
            raise ConfigurationError(
                f"factor_samples={samples!r} must be a positive integer (the examples "
                "of each batch the factors are built from), or None to use every example."
            )
        for name in ("pi_damping", "cuda_graphs", "embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigurationError(f"{name}={getattr(self, name)!r} must be True or False.")
        if not self.allreduce_bucket_cap_mb > 0:
            raise ConfigurationError(
                f"allreduce_bucket_cap_mb={self.allreduce_bucket_cap_mb!r} must be positive (25 "
                "is the usual value)."
            )
        intervals = self.intervals
        if intervals is not None and not isinstance(intervals, AdaptiveIntervals):
            raise ConfigurationError(
                f"intervals must be a kaisa_ray.intervals.AdaptiveIntervals; got "
                f"{type(intervals).__name__}"
            )
        fus, ius = self.factor_update_steps, self.inv_update_steps
        if intervals is not None and (fus != 1 or ius != 1):
            raise ConfigurationError(
                "pass either adaptive intervals or the fixed factor_update_steps and "
                "inv_update_steps, not both: the adaptive ones start on intervals.start's rung"
            )
        if intervals is not None and self.measure_staleness is False:
            raise ConfigurationError(
                "adaptive intervals decide from measured staleness: leave measure_staleness on"
            )
        if not callable(fus) and not callable(ius) and ius % fus != 0:
            suggested = fus * max(1, round(ius / fus))
            warnings.warn(
                f"inv_update_steps={ius} is not a multiple of "
                f"factor_update_steps={fus}: some decompositions will be "
                "recomputed from unchanged factors. Use a multiple, e.g. "
                f"inv_update_steps={suggested}.",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
        if self.scaling is not Scaling.KRONECKER and self.compute_method is not ComputeMethod.EIGEN:
            kept = "Adam's moments" if self.scaling is Scaling.ADAM_EIGENBASIS else "its diagonal"
            raise ConfigurationError(
                f"scaling={str(self.scaling)!r} keeps {kept} in the eigen method's bases; "
                f"compute_method={str(self.compute_method)!r} has none. Pass "
                "compute_method='eigen'."
            )
        if self.basis_update is BasisUpdate.POWER_QR and self.scaling is Scaling.KRONECKER:
            raise ConfigurationError(
                "basis_update='power-qr' refreshes the bases by one power iteration, which "
                "only estimates the eigenvalues that scaling='kronecker' divides by: pass "
                "scaling='adam-eigenbasis' or 'ekfac' (which keep their own scale in the "
                "bases), or basis_update='eigh'."
            )
        if self.factor_reduction is FactorReduction.DEFERRED:
            check_deferral(
                Options(
                    scaling=self.scaling,
                    staleness_probes=1 if self.measures_staleness else 0,
                    factor_reduction=self.factor_reduction,
                )
            )
        if self.scaling is Scaling.EKFAC and self.pi_damping:
            raise ConfigurationError(
                "pi_damping splits the damping between the factors' eigenvalues, but "
                "scaling='ekfac' divides by a fitted diagonal, not by their products: pass "
                "pi_damping=False (the damping is added to the diagonal)."
            )
        if self.scaling is Scaling.ADAM_EIGENBASIS:
            betas = tuple(self.adam_betas)
            if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
                raise ConfigurationError(
                    f"adam_betas={self.adam_betas!r} must be two decays in [0, 1), e.g. "
                    "(0.9, 0.95)."
                )
            if not self.adam_eps > 0:
                raise ConfigurationError(f"adam_eps={self.adam_eps!r} must be positive, e.g. 1e-8.")
