"""``kfac``: K-FAC's settings, their rules, and the one mapping from them to the
preconditioner's keyword arguments (``preconditioner_options``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from kaisa_ray.enums import (
    BasisUpdate,
    ComputeMethod,
    DistributedStrategy,
    FactorReduction,
    FactorScale,
    KFACApprox,
    MatmulPrecision,
    RunningAverage,
    Scaling,
    UpdateMode,
)
from kaisa_ray.errors import ConfigurationError
from kaisa_ray.intervals import DEFAULT_TARGET_ANGLE, check_rungs
from kaisa_train.spec.bounds import AUTO, JOBSPEC_MIN_DAMPING, StrictModel


class KFACSpec(StrictModel):
    """K-FAC settings. ``strategy: auto`` (or ``kfac: auto``) lets the tuner choose the
    gradient worker fraction on the job's own workers, under ``memory_budget`` (and
    ``max_overhead``, K-FAC's predicted time over the plain step's, if given), and picks one
    pair of factor and inverse intervals from the ladder ``intervals`` (else its own) for the
    whole run, the fastest per step. With ``adapt: true`` (opt-in; what it costs, and what it
    saved where it was measured: docs/adaptive-intervals.md) each layer's intervals instead
    adapt during training to how stale its curvature is: they move along the ladder (nested
    pairs) shorter when the angle between its gradient preconditioned with the stale and the
    fresh curvature exceeds ``staleness_target`` degrees, longer when it is well within it.
    ``factor_update_steps`` and ``inv_update_steps`` are ignored either way.
    ``verify: K`` measures the K best predicted candidates in short trials and takes the
    fastest measured one that fits (fixed intervals only). ``measure_staleness`` measures and
    reports the staleness with fixed intervals too."""

    strategy: Literal["auto"] | DistributedStrategy | Annotated[float, Field(gt=0, le=1)] = (
        DistributedStrategy.COMM_OPT
    )
    factor_update_steps: Annotated[int, Field(gt=0, le=10**6)] = 5
    inv_update_steps: Annotated[int, Field(gt=0, le=10**6)] = 50
    damping: Annotated[float, Field(gt=0, le=1e6)] = 0.1
    factor_decay: Annotated[float, Field(ge=0, lt=1)] = 0.95
    kl_clip: Annotated[float, Field(gt=0, le=1e6)] | None = 0.001
    # Under pi_damping the damped inverses are exactly the eigen method's preconditioner
    # (tests/core/test_curvature_options.py) at two matmuls a step instead of four, and every
    # winning row of the batch-size study and the transformer ran it. Its temporaries are
    # two factor-sized tensors, fewer than the eigen method's (docs/curvature.md).
    compute_method: ComputeMethod = ComputeMethod.INVERSE
    kfac_approx: KFACApprox = KFACApprox.REDUCE
    sequence_approx: Annotated[
        KFACApprox,
        Field(
            description=(
                "How Linear layers on sequences (an input of more than two dimensions, a "
                "transformer's tokens) form their factors. ``expand``: every token is a row, "
                "as the reference does. ``reduce`` (K-FAC-reduce, Eschenhagen et al. 2023): "
                "one row per sequence, its mean input and its summed output gradients over "
                "the tokens, so the factors' products run over the sequences instead of the "
                "tokens. No effect on two-dimensional inputs."
            )
        ),
    ] = KFACApprox.EXPAND
    # The curvature that does real work (benchmarks/batch_size_study.py): the Fisher's own
    # factors, averages that start from the first batch, damping split by pi. The reference's
    # conventions: running_average identity, factor_scale reference, pi_damping false and
    # compute_method eigen (the library's KFACPreconditioner defaults, unchanged).
    running_average: RunningAverage = RunningAverage.DEBIASED
    factor_scale: FactorScale = FactorScale.FISHER
    pi_damping: bool = True
    factor_samples: Annotated[int, Field(gt=0, le=65536)] | None = None
    matmul_precision: Annotated[
        MatmulPrecision,
        Field(
            description=(
                "The float32 precision of K-FAC's factor and preconditioning products, in "
                "torch.set_float32_matmul_precision's terms: ``highest`` (IEEE float32), "
                "``high`` (TF32 on CUDA GPUs; float32 on CPUs) or ``medium`` (also bfloat16 "
                "products with float32 accumulation on CPUs that have them). Decompositions "
                "always run at ``highest``."
            )
        ),
    ] = MatmulPrecision.HIGH
    cuda_graphs: Annotated[
        bool,
        Field(
            description=(
                "Replay each step's preconditioning of the layers batched by shape from one "
                "CUDA graph: one launch where Python launches each product, at the cost of "
                "keeping two copies of those layers' gradients between steps. GPU workers "
                "only (``scaling.gpus_per_worker`` of at least 1); steps that receive "
                "preconditioned gradients from other workers run without it."
            )
        ),
    ] = False
    scaling: Annotated[
        Scaling,
        Field(
            description=(
                "What divides the gradient in the factors' eigenbasis: ``kronecker``, K-FAC's "
                "damped eigenvalue products; ``ekfac``, the per-example gradients' second "
                "moments in the eigenbasis plus the damping, fitted on factor updates (EKFAC; "
                "needs ``compute_method: eigen``; ``pi_damping`` defaults to false; with "
                "several workers ``strategy: comm-opt``, since every worker projects its "
                "examples onto the bases); ``adam-eigenbasis``, Adam's moments of the "
                "rotated gradient kept per layer where it is preconditioned (SOAP's recipe "
                "on K-FAC's factors). ``adam-eigenbasis`` needs ``compute_method: eigen``, "
                "``update: optimizer`` and an optimizer without moments of its own (``sgd`` "
                "with ``momentum: 0``: its lr is the step size, and the parameters K-FAC leaves "
                "alone, such as embeddings and norms, take Adam's step at it); ``kl_clip`` "
                "defaults to null "
                "and ``damping`` is unused."
            )
        ),
    ] = Scaling.KRONECKER
    basis_update: Annotated[
        BasisUpdate,
        Field(
            description=(
                "How a decomposition step after the first refreshes the factors' eigenbases "
                "under ``scaling: adam-eigenbasis`` or ``ekfac``: ``eigh``, an "
                "eigendecomposition of each factor; ``power-qr``, one power iteration from "
                "the basis held and a QR factorisation, as SOAP refreshes its bases (about "
                "half the cost of ``eigh``). ``scaling: kronecker`` divides by the "
                "eigenvalues and needs ``eigh``."
            )
        ),
    ] = BasisUpdate.EIGH
    embeddings: Annotated[
        bool,
        Field(
            description=(
                "Also precondition the model's ``nn.Embedding`` layers, as Linear layers of "
                "one-hot inputs (A the diagonal of the indices' frequencies, held and "
                "decomposed as its diagonal: memory linear in ``num_embeddings``; G is "
                "``embedding_dim`` wide). An embedding's input must have the examples as its "
                "first dimension."
            )
        ),
    ] = False
    factor_reduction: Annotated[
        FactorReduction,
        Field(
            description=(
                "When the workers' factors are averaged: ``every-update``, each factor "
                "update's batch factors (KAISA's); ``deferred``, each worker's running "
                "average of its own, on decomposition steps only: the same factors at every "
                "decomposition, up to rounding, for inv_update_steps / factor_update_steps "
                "times fewer factor all-reduces (and one number a factor update). Not with "
                "``scaling: ekfac``, ``adapt``, ``measure_staleness`` or "
                "``scaling.parallel: fsdp``."
            )
        ),
    ] = FactorReduction.EVERY_UPDATE
    # K-FAC's own step: kaisa_ray.quadratic.QuadraticModelStep.
    update: Annotated[
        UpdateMode,
        Field(
            description=(
                "What moves the parameters. ``optimizer``: the optimizer, from the "
                "preconditioned gradients. ``quadratic-model``: K-FAC itself (Martens & "
                "Grosse 2015, section 7): each step is a multiple of the preconditioned "
                "gradient plus a multiple of the previous step, the two minimising the damped "
                "Gauss-Newton quadratic model on the factors' examples (``factor_samples``), "
                "with one damping, started at ``damping`` and adapted every 5 steps by the "
                "Levenberg-Marquardt rule (never below ``min_damping``), for the model and "
                "the preconditioner. There is no "
                "lr to tune: the optimizer's lr, momentum and schedule are unused; "
                "``kl_clip`` defaults to null; fp32 only."
            )
        ),
    ] = UpdateMode.OPTIMIZER
    min_damping: Annotated[
        float,
        Field(
            gt=0,
            le=1e6,
            description=(
                "With ``update: quadratic-model``: the floor of its adapted damping "
                "(kfac-jax's ``min_damping``; the default is lowered to ``damping`` where that "
                "is lower). The Levenberg-Marquardt rule judges each step on the sample it "
                "was fitted to, so on small, noisy batches it can lower the damping until the "
                "step fits that sample and not the data; the floor bounds it (what it changes, "
                "measured: docs/curvature.md). The library's ``QuadraticModelStep`` keeps "
                "kfac-jax's 1e-8."
            ),
        ),
    ] = JOBSPEC_MIN_DAMPING
    max_overhead: Annotated[float, Field(gt=0, le=1000)] | None = None
    intervals: (
        Annotated[
            list[
                tuple[Annotated[int, Field(gt=0, le=10**6)], Annotated[int, Field(gt=0, le=10**6)]]
            ],
            Field(min_length=1, max_length=16),
        ]
        | None
    ) = None
    verify: Annotated[int, Field(ge=0, le=32)] = 0
    adapt: bool | None = None
    staleness_target: Annotated[float, Field(gt=0, lt=90)] = DEFAULT_TARGET_ANGLE
    measure_staleness: bool = False

    @field_validator("strategy", mode="before")
    @classmethod
    def _known_strategy(cls, value: Any) -> Any:
        if isinstance(value, str) and value not in (AUTO, *DistributedStrategy):
            try:
                float(value)
            except ValueError:
                names = ", ".join((AUTO, *DistributedStrategy))
                raise ValueError(
                    f"{value!r} is not a strategy: use one of {names}, or a gradient worker "
                    "fraction f in (0, 1]"
                ) from None
        return value

    @field_validator("intervals")
    @classmethod
    def _multiples(cls, pairs: list[tuple[int, int]] | None) -> list[tuple[int, int]] | None:
        for fus, ius in pairs or []:
            if ius % fus:
                raise ValueError(
                    f"the pair [{fus}, {ius}] has an inverse interval that is not a multiple of "
                    f"its factor interval; use e.g. [{fus}, {fus * max(1, round(ius / fus))}]"
                )
        return pairs

    @property
    def auto(self) -> bool:
        """The tuner chooses (``strategy: auto``)."""
        return self.strategy == AUTO

    def preconditioner_options(self) -> dict[str, Any]:
        """The ``KFACPreconditioner`` keyword arguments this spec fixes: the curvature, the
        damping, the factors' decay, the KL clip, whether staleness is measured (adaptive
        intervals measure it) and whether the preconditioning runs in a CUDA graph. The one
        mapping from a spec to the preconditioner, for the job, the tuner's profile and its
        measured candidates; the strategy and the intervals come from the tuner's choice or
        the spec, the lr from the optimizer."""
        return {
            **self.curvature(),
            "damping": self.damping,
            "factor_decay": self.factor_decay,
            "kl_clip": self.kl_clip,
            "measure_staleness": self.adaptive or self.measure_staleness,
            "cuda_graphs": self.cuda_graphs,
        }

    def curvature(self) -> dict[str, Any]:
        """The curvature this spec asks for (the method, the factors' form and the products'
        precision), as preconditioner keyword arguments."""
        return {
            "compute_method": self.compute_method,
            "kfac_approx": self.kfac_approx,
            "sequence_approx": self.sequence_approx,
            "running_average": self.running_average,
            "factor_scale": self.factor_scale,
            "pi_damping": self.pi_damping,
            "factor_samples": self.factor_samples,
            "matmul_precision": self.matmul_precision,
            "scaling": self.scaling,
            "basis_update": self.basis_update,
            "factor_reduction": self.factor_reduction,
            "embeddings": self.embeddings,
        }

    @property
    def damping_floor(self) -> float:
        """The quadratic-model step's floor on its adapted damping: ``min_damping``, the
        default lowered to ``damping`` where that is lower (a floor given above ``damping``
        is refused)."""
        return min(self.min_damping, self.damping)

    @property
    def adaptive(self) -> bool:
        """``kfac: auto`` with intervals adapted online (``adapt: true``)."""
        return self.auto and bool(self.adapt)

    @property
    def quadratic_model(self) -> bool:
        """K-FAC takes the step itself (``update: quadratic-model``)."""
        return self.update is UpdateMode.QUADRATIC_MODEL

    @model_validator(mode="before")
    @classmethod
    def _quadratic_model_default_clip(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("update") == UpdateMode.QUADRATIC_MODEL:
            return {"kl_clip": None, **data}  # the model chooses the step's length
        if isinstance(data, dict) and data.get("scaling") == Scaling.ADAM_EIGENBASIS:
            return {"kl_clip": None, **data}  # Adam's direction has its own scale
        if isinstance(data, dict) and data.get("scaling") == Scaling.EKFAC:
            return {"pi_damping": False, **data}  # the damping is added to the diagonal
        return data

    @model_validator(mode="after")
    def _adam_eigenbasis_needs_the_bases(self) -> KFACSpec:
        if self.scaling is Scaling.KRONECKER:
            if self.basis_update is BasisUpdate.POWER_QR:
                raise ValueError(
                    "basis_update: power-qr only estimates the eigenvalues that scaling: "
                    "kronecker divides by: set scaling: adam-eigenbasis (or ekfac), or "
                    "basis_update: eigh"
                )
            return self
        if self.compute_method is not ComputeMethod.EIGEN:
            kept = "Adam's moments" if self.scaling is Scaling.ADAM_EIGENBASIS else "its diagonal"
            raise ValueError(
                f"scaling: {self.scaling} keeps {kept} in the eigen method's bases; "
                f"compute_method: {self.compute_method} has none: set compute_method: eigen"
            )
        if self.scaling is Scaling.EKFAC:
            if self.pi_damping:
                raise ValueError(
                    "scaling: ekfac divides by a fitted diagonal, not by the eigenvalues' "
                    "products that pi_damping splits the damping between: set pi_damping: false"
                )
            return self
        if self.quadratic_model:
            raise ValueError(
                "scaling: adam-eigenbasis gives Adam's direction, not the quadratic model's: "
                "set update: optimizer, or scaling: kronecker for the quadratic-model step"
            )
        return self

    @model_validator(mode="after")
    def _deferral_needs_factors_read_only_when_decomposed(self) -> KFACSpec:
        if self.factor_reduction is not FactorReduction.DEFERRED:
            return self
        reads = (
            "scaling: ekfac (its diagonal is reduced every factor update)"
            if self.scaling is Scaling.EKFAC
            else "adapt or measure_staleness (they compare the factors between decompositions)"
            if self.adaptive or self.measure_staleness
            else None
        )
        if reads is not None:
            raise ValueError(
                f"factor_reduction: deferred averages the factors only when they are "
                f"decomposed, which {reads} cannot use: set factor_reduction: every-update"
            )
        return self

    @model_validator(mode="after")
    def _min_damping_floors_the_quadratic_model(self) -> KFACSpec:
        # By value, not by whether it was given: a stored spec's dump carries every field.
        if self.min_damping == JOBSPEC_MIN_DAMPING:
            return self
        if not self.quadratic_model:
            raise ValueError(
                f"min_damping: {self.min_damping:g} applies to update: quadratic-model only "
                "(with update: optimizer the damping is kfac.damping and does not adapt); "
                "remove it, or set update: quadratic-model"
            )
        if self.min_damping > self.damping:
            raise ValueError(
                f"min_damping: {self.min_damping:g} is above the starting damping "
                f"{self.damping:g}; lower min_damping or raise damping"
            )
        return self

    @model_validator(mode="after")
    def _quadratic_model_unclipped(self) -> KFACSpec:
        if self.quadratic_model and self.kl_clip is not None:
            raise ValueError(
                f"kl_clip: {self.kl_clip} with update: quadratic-model: the quadratic model "
                "chooses each step's length itself; set kl_clip: null (or leave it out), or "
                "update: optimizer to keep the clip"
            )
        return self

    @model_validator(mode="after")
    def _auto_only(self) -> KFACSpec:
        if not self.auto:
            # By value, not by fields set: a spec dumped to JSON and read back (as the workers
            # do) has every field set.
            defaults = {
                "max_overhead": None,
                "intervals": None,
                "verify": 0,
                "adapt": None,
                "staleness_target": DEFAULT_TARGET_ANGLE,
            }
            given = [name for name, empty in defaults.items() if getattr(self, name) != empty]
            if given:
                raise ValueError(
                    f"{', '.join(given)} only for strategy: auto (the tuner); remove "
                    f"{'it' if len(given) == 1 else 'them'} or set strategy: auto instead of "
                    f"{str(self.strategy)!r}"
                )
        if self.adapt and self.verify:
            raise ValueError(
                "verify measures candidates with fixed intervals; adapted intervals cannot be "
                "verified that way: set adapt: false, or verify: 0"
            )
        if self.adaptive and self.intervals is not None:
            try:
                check_rungs(self.intervals)
            except ConfigurationError as error:
                raise ValueError(f"intervals: {error} (or set adapt: false)") from None
        return self

    def ladder(self) -> list[tuple[int, int]] | None:
        """The interval pairs the tuner may choose from (None: its default ladder)."""
        return list(self.intervals) if self.intervals is not None else None
