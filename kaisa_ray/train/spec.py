"""``JobSpec``: the one description of a training job shared by every front door.

Loaded from YAML or JSON (the job file of ``ray job submit``, the body of a REST request), and
validated before anything starts: every bad field is reported at once, each with what is
wrong and how to fix it. Pydantic stays at this boundary: the workers get the validated, frozen
``JobSpec`` itself (``worker_config.py``) and never validate it again.

Example (YAML)::

    name: fashion-kfac
    model: {name: lenet}
    dataset: {name: fashion-mnist, batch_size: 128}
    optimizer: {name: sgd, lr: 0.05, momentum: 0.9, nesterov: true}
    kfac: {strategy: comm-opt, factor_update_steps: 5, inv_update_steps: 50, damping: 0.1}
    memory_budget: 2GiB
    scaling: {workers: 2}
    stop: {max_steps: 1000, target: {metric: test_accuracy, value: 0.88}}
"""

from __future__ import annotations

import copy
import difflib
import functools
import importlib.util
import inspect
import json
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from kaisa_ray.enums import (
    ComputeMethod,
    DistributedStrategy,
    EvalMetric,
    FactorScale,
    KFACApprox,
    MatmulPrecision,
    OptimizerName,
    Precision,
    RunningAverage,
    Scaling,
    UpdateMode,
)
from kaisa_ray.errors import ConfigurationError
from kaisa_ray.intervals import DEFAULT_TARGET_ANGLE, check_rungs
from kaisa_ray.strategy import resolve_grad_worker_fraction
from kaisa_ray.train.data_roots import check_root
from kaisa_ray.train.records import Direction, SweepMetric
from kaisa_ray.train.registry import dataset_entry, dataset_names, model_factory, model_names
from kaisa_ray.train.strict_numbers import NoBooleanNumbers

PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]

# Upper bounds. Every number a job may hold is bounded, so that no value can overflow the
# job store's 64-bit integers, ask Ray for the impossible, or make validation itself slow
# (a check never does work that grows with a number a user sent). Each bound's reason is in
# ``LIMITS`` and goes into the error message (and docs/jobspec.md).
MAX_STEPS = 10**9
MAX_WORKERS = 4096
MAX_GPUS_PER_WORKER = 16
MAX_SEED = 2**32 - 1
STEPS_REASON = (
    "a billion steps is years of training at any speed; larger counts would overflow the "
    "service's step counters"
)
LIMITS: dict[str, str] = {
    "dataset.batch_size": "a worker's batch beyond 65536 samples does not fit a worker's memory",
    "dataset.limit": "no dataset here has more than a billion samples",
    "dataset.data_dir": "a path longer than the system's 4096-byte limit cannot exist",
    "optimizer.lr": "a learning rate above 10000 only diverges",
    "optimizer.weight_decay": "a weight decay above 10 erases the weights",
    "optimizer.schedule.warmup_steps": STEPS_REASON,
    "optimizer.schedule.step_every": STEPS_REASON,
    "kfac.factor_update_steps": "an interval above a million steps never updates the factors",
    "kfac.inv_update_steps": "an interval above a million steps never updates the inverses",
    "kfac.damping": "a damping above 1e6 turns K-FAC off (use kfac: off instead)",
    "kfac.kl_clip": "a KL clip above 1e6 never clips (use kl_clip: null instead)",
    "kfac.max_overhead": "K-FAC's time over the plain step's; 1000 already allows anything",
    "kfac.intervals": "the tuner tries every pair: at most 16 pairs, each interval at most a "
    "million steps",
    "scaling.workers": f"no job may ask for more than {MAX_WORKERS} workers; the service allows "
    "at most its own maximum (kaisa-ray serve --max-workers)",
    "scaling.gpus_per_worker": f"no node has more than {MAX_GPUS_PER_WORKER} GPUs for one "
    "worker; the service allows at most its own maximum (--max-gpus-per-worker)",
    "scaling.cpus_per_worker": "no node has more than 1024 CPUs for one worker",
    "scaling.resource_timeout_s": "at most a week (604800 s); leave it out to wait as long as "
    "it takes",
    "stop.max_steps": STEPS_REASON,
    "stop.max_epochs": "a million epochs is years of training; the steps they make must fit "
    "the service's step counters",
    "stop.target.value": "an accuracy is between 0 and 1 and a loss at most 1e6",
    "checkpoint.every_steps": STEPS_REASON,
    "checkpoint.keep": "each checkpoint is a full copy of the model and optimizer state: keep "
    "at most 100",
    "eval_every": STEPS_REASON,
    "max_failures": "each failure restarts the whole worker group: more than 100 means the "
    "job cannot run",
    "seed": f"seeds are 32-bit (0 to {MAX_SEED}), as numpy's are",
    "memory_budget": "at most 1 PiB per worker",
    "sweep.space": "a sweep searches at most 32 fields",
    "sweep.trials": "a sweep runs at most 1024 trials",
    "sweep.concurrent": "at most 64 trials at once (each takes the job's workers)",
    "sweep.seed": f"seeds are 32-bit (0 to {MAX_SEED})",
    "sweep.asha.grace_steps": STEPS_REASON,
    "sweep.asha.reduction_factor": "a reduction factor above 100 stops every trial at once",
    "sweep.space.*.choice": "a choice among at most 64 values",
    "sweep.space.*.randint": "randint draws 32-bit integers",
    "sweep.space.*.loguniform": "the range's ends are at most 1e12 in size",
    "sweep.space.*.uniform": "the range's ends are at most 1e12 in size",
    "model.params": "a model's parameters are checked against its constructor",
    "name": "a job's name is at most 64 letters, digits and '_.-', starting with one of the "
    "first two",
}


AUTO = "auto"
"""``kfac.strategy: auto``: the tuner chooses the strategy and the intervals."""

# kfac.min_damping's default: the quadratic-model step's damping floor. kfac-jax's (and the
# library's) 1e-8 lets the damping collapse at small batches (benchmarks/batch_size_study.py at
# 128, benchmarks/transformer_fortunes.py); 1e-3 trains there and changes no step count at 2048
# and 8192.
JOBSPEC_MIN_DAMPING = 1e-3

Steps = Annotated[int, Field(gt=0, le=MAX_STEPS)]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
Big = 1e12


class _Strict(NoBooleanNumbers):
    # Numbers are numbers (``true`` is refused where a number belongs). Floats must be
    # finite: JSON's Infinity and NaN, and 1e309 (which parses as infinity), are refused
    # rather than stored and shown back as null.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ModelSpec(_Strict):
    name: Annotated[str, Field(max_length=64)]
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="keyword arguments of the model's constructor, checked against it: "
        "unknown names, types and ranges are refused",
    )

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        try:
            model_factory(name)
        except KeyError:
            raise ValueError(
                f"unknown model {name!r}; choose one of {', '.join(model_names())}, or register "
                "your own under the 'kaisa_ray.models' entry point"
            ) from None
        return name

    @model_validator(mode="after")
    def _params_fit_the_constructor(self) -> ModelSpec:
        checker = constructor_params(self.name)
        try:
            checker.model_validate(self.params)
        except ValidationError as err:
            raise ValidationError.from_exception_data(
                "ModelSpec",
                [
                    InitErrorDetails(
                        type=PydanticCustomError("model_params", message),
                        loc=("params", *where),
                        input=None,
                    )
                    for where, message in _param_problems(self.name, checker, err)
                ],
            ) from None
        return self


def _param_problems(
    model: str, checker: type[BaseModel], err: ValidationError
) -> list[tuple[tuple[str, ...], str]]:
    takes = ", ".join(checker.model_fields) or "no parameters"
    problems = []
    for item in err.errors():
        where = tuple(str(part) for part in item["loc"])
        message = str(item["msg"]).removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            close = difflib.get_close_matches(where[0], list(checker.model_fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            message = f"model {model!r} takes no parameter {where[0]!r}{hint} (it takes: {takes})"
        else:
            message = f"{message} (checked against model {model!r}'s constructor)"
        problems.append((where or ("params",), message))
    return problems


# What a parameter without a type annotation may be: a JSON scalar of bounded size, or a short
# list of them. Nothing nested, nothing large, so that any constructor gets plain values.
_Scalar = (
    Annotated[int, Field(ge=-(2**31), le=2**31)]
    | Annotated[float, Field(ge=-Big, le=Big)]
    | Annotated[str, Field(max_length=256)]
    | bool
    | None
)
_UNTYPED = _Scalar | Annotated[list[_Scalar], Field(max_length=64)]


@functools.cache
def constructor_params(name: str) -> type[BaseModel]:
    """A pydantic model of the model ``name``'s constructor keywords (its signature and type
    annotations, ``Annotated`` bounds included; unannotated ones take bounded JSON scalars)."""
    factory: Callable[..., Any] = model_factory(name)
    target = factory.__init__ if isinstance(factory, type) else factory  # type: ignore[misc]
    try:
        hints = typing.get_type_hints(target, include_extras=True)
    except Exception:  # a plugin's annotations that do not resolve: check names only
        hints = {}
    fields: dict[str, Any] = {}
    for parameter in list(inspect.signature(target).parameters.values()):
        if parameter.name == "self" or parameter.kind in (
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
            inspect.Parameter.POSITIONAL_ONLY,
        ):
            continue
        kind = hints.get(parameter.name, _UNTYPED)
        default = ... if parameter.default is inspect.Parameter.empty else parameter.default
        fields[parameter.name] = (kind, default)
    return create_model(f"{name}_params", __base__=_Params, **fields)


class _Params(NoBooleanNumbers):
    """The base of a model's constructor check: its keywords only, finite, no boolean
    where a number belongs."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=False)


class DatasetSpec(_Strict):
    name: Annotated[str, Field(max_length=64)]
    data_dir: Path | None = None
    batch_size: Annotated[int, Field(gt=0, le=65536)] = 128
    limit: Annotated[int, Field(gt=0, le=10**9)] | None = None

    @field_validator("data_dir")
    @classmethod
    def _short_path(cls, path: Path | None) -> Path | None:
        if path is not None and len(str(path)) > 4096:
            raise ValueError(f"a path of {len(str(path))} characters: {LIMITS['dataset.data_dir']}")
        return path

    @model_validator(mode="after")
    def _available(self) -> DatasetSpec:
        try:
            entry = dataset_entry(self.name)
        except KeyError:
            raise ValueError(
                f"unknown dataset {self.name!r}; choose one of {', '.join(dataset_names())}, "
                "or register your own under the 'kaisa_ray.datasets' entry point"
            ) from None
        directory = self.data_dir or entry.default_dir
        if directory is not None and (self.data_dir is not None or entry.needs_files):
            # A service's data roots, before anything looks at the folder: a refusal must not
            # tell whether it exists (kaisa_ray.train.data_roots).
            check_root(directory)
        if entry.needs_files:
            if directory is None:
                raise ValueError(f"dataset {self.name!r} needs data_dir: {entry.install_hint}")
            if not directory.is_dir():
                raise ValueError(
                    f"data directory {directory} of dataset {self.name!r} does not exist: "
                    f"{entry.install_hint}"
                )
        return self


class ScheduleSpec(_Strict):
    kind: Literal["constant", "cosine", "step"] = "constant"
    warmup_steps: Annotated[int, Field(ge=0, le=MAX_STEPS)] = 0
    step_every: Steps | None = None
    gamma: Annotated[float, Field(gt=0, le=1)] = 0.1


PEER_OPTIMIZERS = tuple(name for name in OptimizerName if name.peer)
"""Optimizers that precondition the gradient themselves, from heavyball (the ``peers``
extra), for comparing K-FAC with what a user would try instead: SOAP, Muon (with AdamW for
the parameters of fewer than 2 dimensions) and PSGD Kron, at heavyball's defaults but
``lr`` and ``weight_decay``. They run with ``kfac: off``."""


def _trained_here(name: OptimizerName) -> OptimizerName:
    if not name.trainable:
        trainable = ", ".join(n for n in OptimizerName if n.trainable)
        raise ValueError(
            f"optimizer {name} is priced by kaisa-ray plan but no job here trains with it: "
            f"name one of {trainable} (adamw is the closest)"
        )
    return name


class OptimizerSpec(_Strict):
    name: Annotated[
        OptimizerName,
        AfterValidator(_trained_here),
        Field(
            description=(
                "``sgd``, ``adam`` or ``adamw``, from torch, preconditioned by K-FAC; "
                "``soap``, ``muon`` or ``psgd-kron``, the peers, with ``kfac: off`` (the "
                "``peers`` extra); ``lamb`` is for ``kaisa-ray plan`` only (no job trains with it)."
            )
        ),
    ] = OptimizerName.SGD
    lr: Annotated[float, Field(gt=0, le=1e4)] = 0.05
    momentum: Annotated[float, Field(ge=0, lt=1)] = 0.9
    nesterov: bool = True
    weight_decay: Annotated[float, Field(ge=0, le=10)] = 0.0
    schedule: ScheduleSpec = ScheduleSpec()


class KFACSpec(_Strict):
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
    # (tests/test_curvature_options.py) at two matmuls a step instead of four, and every
    # winning row of the batch-size study and the transformer ran it. Its temporaries are
    # two factor-sized tensors, fewer than the eigen method's (docs/curvature.md).
    compute_method: ComputeMethod = ComputeMethod.INVERSE
    kfac_approx: KFACApprox = KFACApprox.REDUCE
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
    scaling: Annotated[
        Scaling,
        Field(
            description=(
                "What divides the gradient in the factors' eigenbasis: ``kronecker``, K-FAC's "
                "damped eigenvalue products; ``adam-eigenbasis``, Adam's moments of the "
                "rotated gradient kept per layer where it is preconditioned (SOAP's recipe "
                "on K-FAC's factors). ``adam-eigenbasis`` needs ``compute_method: eigen``, "
                "``update: optimizer`` and an optimizer without moments of its own (``sgd`` "
                "with ``momentum: 0``: its lr is the step size); ``kl_clip`` defaults to null "
                "and ``damping`` is unused."
            )
        ),
    ] = Scaling.KRONECKER
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
        damping, the factors' decay, the KL clip and whether staleness is measured (adaptive
        intervals measure it). The one mapping from a spec to the preconditioner, for the
        job, the tuner's profile and its measured candidates; the strategy and the intervals
        come from the tuner's choice or the spec, the lr from the optimizer."""
        return {
            **self.curvature(),
            "damping": self.damping,
            "factor_decay": self.factor_decay,
            "kl_clip": self.kl_clip,
            "measure_staleness": self.adaptive or self.measure_staleness,
        }

    def curvature(self) -> dict[str, Any]:
        """The curvature this spec asks for (the method, the factors' form and the products'
        precision), as preconditioner keyword arguments."""
        return {
            "compute_method": self.compute_method,
            "kfac_approx": self.kfac_approx,
            "running_average": self.running_average,
            "factor_scale": self.factor_scale,
            "pi_damping": self.pi_damping,
            "factor_samples": self.factor_samples,
            "matmul_precision": self.matmul_precision,
            "scaling": self.scaling,
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
        return data

    @model_validator(mode="after")
    def _adam_eigenbasis_needs_the_bases(self) -> KFACSpec:
        if self.scaling is not Scaling.ADAM_EIGENBASIS:
            return self
        if self.compute_method is not ComputeMethod.EIGEN:
            raise ValueError(
                "scaling: adam-eigenbasis keeps Adam's moments in the eigen method's bases; "
                f"compute_method: {self.compute_method} has none: set compute_method: eigen"
            )
        if self.quadratic_model:
            raise ValueError(
                "scaling: adam-eigenbasis gives Adam's direction, not the quadratic model's: "
                "set update: optimizer, or scaling: kronecker for the quadratic-model step"
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


class ScalingSpec(_Strict):
    """The job's workers. ``placement`` spreads them over Ray's nodes: ``pack`` (fill a node
    first, the default), ``spread`` (one per node where possible), ``strict-pack`` (all on
    one node) or ``strict-spread`` (one per node, or wait for enough nodes).
    ``resource_timeout_s``: how long the worker group may wait for its resources, at the start
    and after losing a node, before the job fails saying so; unset, it waits as long as it
    takes (an autoscaling cluster adds nodes), except in a sweep's trials (120 s)."""

    workers: Annotated[int, Field(gt=0, le=MAX_WORKERS)] = 1
    gpus_per_worker: Annotated[float, Field(ge=0, le=MAX_GPUS_PER_WORKER)] = 0
    cpus_per_worker: Annotated[float, Field(gt=0, le=1024)] = 1
    placement: Literal["pack", "spread", "strict-pack", "strict-spread"] = "pack"
    resource_timeout_s: Annotated[float, Field(gt=0, le=7 * 24 * 3600)] | None = None

    @property
    def placement_strategy(self) -> str:
        """Ray's name for ``placement`` (``STRICT_SPREAD``...)."""
        return self.placement.upper().replace("-", "_")


class TargetSpec(_Strict):
    metric: EvalMetric = EvalMetric.TEST_ACCURACY
    value: Annotated[float, Field(ge=0, le=1e6)]

    @model_validator(mode="after")
    def _in_range(self) -> TargetSpec:
        if self.metric is EvalMetric.TEST_ACCURACY and self.value > 1:
            raise ValueError(
                f"a test_accuracy target of {self.value:g} is never met: accuracy is between 0 "
                "and 1 (write 0.88 for 88%)"
            )
        return self


class StopSpec(_Strict):
    max_steps: Steps | None = None
    max_epochs: Annotated[int, Field(gt=0, le=10**6)] | None = None
    target: TargetSpec | None = None

    @model_validator(mode="after")
    def _one_limit(self) -> StopSpec:
        if (self.max_steps is None) == (self.max_epochs is None):
            raise ValueError("give exactly one of max_steps and max_epochs")
        return self


class CheckpointSpec(_Strict):
    every_steps: Steps = 200
    keep: Annotated[int, Field(gt=0, le=100)] = 2


_End = Annotated[float, Field(ge=-Big, le=Big)]
_IntEnd = Annotated[int, Field(ge=-(2**31), le=2**31)]


class Distribution(_Strict):
    """Where a sweep draws one field from: exactly one of ``loguniform: [low, high]``,
    ``uniform: [low, high]``, ``randint: [low, high]`` (integers, both ends included) or
    ``choice: [v1, v2, ...]``."""

    loguniform: tuple[_End, _End] | None = None
    uniform: tuple[_End, _End] | None = None
    randint: tuple[_IntEnd, _IntEnd] | None = None
    choice: Annotated[list[_IntEnd | _End], Field(min_length=1, max_length=64)] | None = None

    @model_validator(mode="after")
    def _one_nonempty_range(self) -> Distribution:
        given = [name for name in DISTRIBUTIONS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of {', '.join(DISTRIBUTIONS)} (got "
                f"{', '.join(given) or 'none'}), e.g. {{loguniform: [0.001, 0.1]}}"
            )
        if self.kind != "choice":
            low, high = getattr(self, self.kind)  # as written: [low, high]
            if low > high:
                raise ValueError(
                    f"the range [{low:g}, {high:g}] of {self.kind} is reversed: write it as "
                    f"[low, high], [{high:g}, {low:g}]"
                )
            if not low < high:
                raise ValueError(
                    f"the range [{low:g}, {high:g}] of {self.kind} is empty: its low end must be "
                    "below its high end (for one value, leave the field out of the sweep)"
                )
            if self.kind == "loguniform" and low <= 0:
                raise ValueError(f"loguniform needs a positive low end, got {low:g}")
        return self

    @property
    def kind(self) -> str:
        return next(name for name in DISTRIBUTIONS if getattr(self, name) is not None)

    @property
    def ends(self) -> tuple[float, float]:
        """The range's low and high end (a choice's smallest and largest value)."""
        values = getattr(self, self.kind)
        return (min(values), max(values))

    def extremes(self) -> list[int | float]:
        """The values a trial can take at the edges: every choice, or the two ends."""
        return list(self.choice) if self.choice is not None else list(self.ends)


DISTRIBUTIONS = ("loguniform", "uniform", "randint", "choice")


class AshaSpec(_Strict):
    """ASHA's rungs: the first at ``grace_steps`` (default: an eighth of the stop's steps, at
    least ``eval_every``), each next one ``reduction_factor`` times further; at each rung a trial
    continues only if it is in the best 1/``reduction_factor`` of the trials that reached it."""

    grace_steps: Steps | None = None
    reduction_factor: Annotated[float, Field(gt=1, le=100)] = 2


class SweepSpec(_Strict):
    """A hyperparameter sweep over the job's own fields, run on Ray Tune.

    ``space`` maps dotted fields of the job (``optimizer.lr``, ``kfac.damping``,
    ``kfac.kl_clip``, ``kfac.factor_decay``, any numeric field) to a ``Distribution``. Each of
    ``trials`` trials trains the job with one draw (``concurrent`` at once). ``metric``: the
    final ``test_accuracy`` (max), ``test_loss`` (min) or ``time_to_target`` (min: training
    seconds until ``stop.target`` is met; a trial that never meets it ranks last). With
    ``scheduler: asha`` weak trials stop early, judged at each evaluation on the test metric.
    """

    space: Annotated[
        dict[Annotated[str, Field(max_length=128)], Distribution],
        Field(min_length=1, max_length=32),
    ]
    metric: SweepMetric = SweepMetric.TEST_ACCURACY
    mode: Direction | None = None
    trials: Annotated[int, Field(gt=0, le=1024)] = 8
    concurrent: Annotated[int, Field(gt=0, le=64)] = 1
    scheduler: Literal["asha", "none"] = "asha"
    asha: AshaSpec = AshaSpec()
    seed: Seed = 0

    @property
    def direction(self) -> Direction:
        """``mode``, or the metric's own (``SweepMetric.direction``)."""
        return self.mode or self.metric.direction


class JobSpec(_Strict):
    """A training job, validated as a whole before anything starts."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]
    model: ModelSpec
    dataset: DatasetSpec
    optimizer: OptimizerSpec = OptimizerSpec()
    kfac: KFACSpec | Literal["off"] = KFACSpec()
    precision: Precision = Precision.FP32
    memory_budget: Annotated[ByteSize, Field(gt=0, le=2**50)] | None = None
    scaling: ScalingSpec = ScalingSpec()
    stop: StopSpec
    eval_every: Steps = 25
    checkpoint: CheckpointSpec = CheckpointSpec()
    max_failures: Annotated[int, Field(ge=0, le=100)] = 0
    seed: Seed = 0
    sweep: SweepSpec | None = None

    @field_validator("kfac", mode="before")
    @classmethod
    def _auto_shorthand(cls, value: Any) -> Any:
        return {"strategy": AUTO} if value == AUTO else value

    @model_validator(mode="after")
    def _strategy_fits_workers(self) -> JobSpec:
        if isinstance(self.kfac, KFACSpec) and not self.kfac.auto:
            try:
                resolve_grad_worker_fraction(self.kfac.strategy, self.scaling.workers)
            except ConfigurationError as exc:
                raise ValueError(f"kfac.strategy does not fit scaling.workers: {exc}") from None
        return self

    @model_validator(mode="after")
    def _peer_optimizer_fits(self) -> JobSpec:
        name = self.optimizer.name
        if name not in PEER_OPTIMIZERS:
            return self
        if self.kfac != "off":
            raise ValueError(
                f"optimizer {name} preconditions the gradient itself: set kfac: off (K-FAC "
                "runs on sgd, adam or adamw)"
            )
        if importlib.util.find_spec("heavyball") is None:
            raise ValueError(
                f"optimizer {name} comes from heavyball, which is not installed: pip install "
                "'kaisa-ray[peers]' where the job's workers run"
            )
        return self

    @model_validator(mode="after")
    def _adam_eigenbasis_on_plain_sgd(self) -> JobSpec:
        if not (isinstance(self.kfac, KFACSpec) and self.kfac.scaling is Scaling.ADAM_EIGENBASIS):
            return self
        name, momentum = self.optimizer.name, self.optimizer.momentum
        if name is not OptimizerName.SGD or momentum:
            what = f"{name} with momentum {momentum:g}" if name is OptimizerName.SGD else name
            raise ValueError(
                "kfac.scaling: adam-eigenbasis makes the preconditioned gradient Adam's "
                f"direction, with its own moments; {what} would add moments of its own: set "
                "optimizer.name: sgd and optimizer.momentum: 0 (the lr is the step size)"
            )
        return self

    @model_validator(mode="after")
    def _quadratic_model_fits(self) -> JobSpec:
        if not (isinstance(self.kfac, KFACSpec) and self.kfac.quadratic_model):
            return self
        if self.precision != Precision.FP32:
            raise ValueError(
                f"kfac.update: quadratic-model runs in fp32 only (its Jacobian-vector products "
                f"and 2x2 system); set precision: fp32, or kfac.update: optimizer for "
                f"{self.precision}"
            )
        if self.optimizer.weight_decay:
            raise ValueError(
                "kfac.update: quadratic-model does not use the optimizer, so "
                f"optimizer.weight_decay {self.optimizer.weight_decay} would not be applied; "
                "set optimizer.weight_decay: 0, or kfac.update: optimizer"
            )
        return self

    @model_validator(mode="after")
    def _sweep_fits_the_job(self) -> JobSpec:
        if self.sweep is None:
            return self
        problems = sweep_problems(self)
        if problems:
            raise ValidationError.from_exception_data(
                "JobSpec",
                [
                    InitErrorDetails(
                        type=PydanticCustomError("sweep", message),
                        loc=where,
                        input=None,
                    )
                    for where, message in problems
                ],
            )
        return self

    def without_sweep(self) -> JobSpec:
        """This job as one run (what each trial, and the best trial's spec, is)."""
        return self.model_copy(update={"sweep": None})


# Fields a sweep may not draw: the tuner decides them under kfac: auto, or they are not
# numbers that change training.
_NOT_SWEPT = {
    "kfac.factor_update_steps": "the tuner chooses the intervals under kfac: auto",
    "kfac.inv_update_steps": "the tuner chooses the intervals under kfac: auto",
    "kfac.verify": "verification trials cannot run inside sweep trials",
    "kfac.max_overhead": "it is the tuner's limit, not a hyperparameter",
    "max_failures": "it is a retry policy, not a hyperparameter",
}


def _numeric_kind(path: str) -> type | str:
    """``int`` or ``float`` for a dotted numeric field of JobSpec; else why it is not one."""
    model: Any = JobSpec
    parts = path.split(".")
    for depth, part in enumerate(parts):
        fields = getattr(model, "model_fields", None)
        if fields is None or part not in fields:
            where = ".".join(parts[:depth]) or "the job"
            known = ", ".join(sorted(fields)) if fields else "none"
            return f"{where} has no field {part!r} (its fields: {known})"
        annotation = fields[part].annotation
        options = typing.get_args(annotation) if typing.get_origin(annotation) in _UNIONS else ()
        found = [
            typing.get_args(a)[0] if typing.get_origin(a) is Annotated else a
            for a in (options or (annotation,))
            if a is not type(None)
        ]
        models = [a for a in found if isinstance(a, type) and issubclass(a, BaseModel)]
        if depth < len(parts) - 1:
            if not models:
                return f"{'.'.join(parts[: depth + 1])} has no fields"
            model = models[0]
            continue
        numbers = [a for a in found if a in (int, float)]
        if not numbers or models or any(a is bool for a in found):
            return f"{path} is not a number (a sweep draws numbers)"
        return float if float in numbers else int
    raise AssertionError("unreachable")


_UNIONS = (typing.Union, types.UnionType)


def sweep_problems(spec: JobSpec) -> list[tuple[tuple[str, ...], str]]:
    """Where (the field's path) and why the sweep does not fit ``spec``; empty if it does."""
    sweep = spec.sweep
    assert sweep is not None
    problems: list[tuple[tuple[str, ...], str]] = []
    if isinstance(spec.kfac, KFACSpec) and not spec.kfac.auto:
        problems.append(
            (
                ("kfac", "strategy"),
                "a sweep runs every trial with kfac.strategy: auto, so that each trial's K-FAC "
                "strategy is chosen under memory_budget; set it instead of "
                f"{str(spec.kfac.strategy)!r}",
            )
        )
    if isinstance(spec.kfac, KFACSpec) and spec.kfac.verify:
        problems.append((("kfac", "verify"), "verification cannot run inside sweep trials"))
    if sweep.metric is SweepMetric.TIME_TO_TARGET and spec.stop.target is None:
        problems.append(
            (
                ("sweep", "metric"),
                "time_to_target needs stop.target (the accuracy or loss to reach)",
            )
        )
    base = spec.without_sweep().model_dump(mode="json")
    for path, distribution in sweep.space.items():
        where = ("sweep", "space", path)
        if path in _NOT_SWEPT:
            problems.append((where, f"{path} cannot be swept: {_NOT_SWEPT[path]}"))
            continue
        kind = _numeric_kind(path)
        if isinstance(kind, str):
            problems.append((where, f"unknown or unusable field: {kind}"))
            continue
        if path.startswith("kfac.") and not isinstance(spec.kfac, KFACSpec):
            problems.append((where, f"{path}: kfac is off in this job"))
            continue
        values = distribution.extremes()
        if kind is int and (
            distribution.kind in ("loguniform", "uniform")
            or any(not float(v).is_integer() for v in values)
        ):
            problems.append(
                (where, f"{path} is an integer: draw it with randint or a choice of integers")
            )
            continue
        for value in values:
            try:
                trial_spec(base, {path: value})
            except JobSpecError as err:
                reasons = "; ".join(err.problems)
                problems.append((where, f"{value:g} is not a valid {path}: {reasons}"))
                break
    return problems


def trial_spec(base: dict[str, Any], values: dict[str, Any]) -> JobSpec:
    """The job ``base`` (a JobSpec as JSON, without its sweep) with the dotted fields in
    ``values`` set: one trial's spec. Raises ``JobSpecError`` if the result is invalid."""
    data = copy.deepcopy(base)
    data.pop("sweep", None)
    for path, value in values.items():
        *parents, leaf = path.split(".")
        node = data
        for part in parents:
            node = node[part]
        node[leaf] = value
    return parse_job_spec(data, "trial spec")


class JobSpecError(ConfigurationError):
    """A job file or request that does not describe a valid job; lists every bad field."""

    def __init__(self, problems: list[str], source: str = "job spec") -> None:
        self.problems = problems
        self.source = source
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source} is invalid ({len(problems)} problem(s)):\n{lines}")

    def __reduce__(self) -> tuple[type[JobSpecError], tuple[list[str], str]]:
        return (type(self), (self.problems, self.source))


def _field_path(loc: tuple[int | str, ...]) -> tuple[str, ...]:
    """The field names in an error location, without pydantic's union-branch and validator
    tags (``KFACSpec``, ``literal['off']``, ``function-after[...]``, ``constrained-float``)."""
    return tuple(
        str(part)
        for part in loc
        if not (
            isinstance(part, str)
            and ("[" in part or part[:1].isupper() or part.startswith("constrained-"))
        )
    )


def _describe(error: ValidationError) -> list[str]:
    return [f"{where}: {message}" for where, message in field_problems(error.errors())]


def field_problems(items: Sequence[Any]) -> list[tuple[str, str]]:
    """``(field, message)`` for each of pydantic's error dicts (``loc``, ``msg``, ``type``):
    the dotted field (``kfac.damping``) and a message that says how to fix it."""

    # ``kfac`` is a model or the literal 'off': when the model branch has errors, the
    # literal branch's "Input should be 'off'" only adds noise.
    def literal_branch(item: Any) -> bool:
        return any(str(part).startswith("literal[") for part in item["loc"])

    structural = {_field_path(item["loc"])[:1] for item in items if not literal_branch(item)}
    problems = []
    for item in items:
        path = _field_path(item["loc"])
        if literal_branch(item) and path[:1] in structural:
            continue
        number = isinstance(item.get("input"), int | float) and not isinstance(item["input"], bool)
        if item["type"] == "enum" and number:
            continue  # a number given to a name-or-number field: its number branch says why
        where = ".".join(path) or "(top level)"
        message = item["msg"].removeprefix("Value error, ")
        kind = item["type"]
        if kind == "extra_forbidden":
            message = _unknown_field(path)
        elif kind == "byte_size":
            message = f"{message}; write a size such as '2GiB' or '512MB'"
        elif kind == "finite_number":
            message = (
                "must be a finite number: Infinity, NaN and numbers beyond 1.8e308 (which "
                "parse as infinity) are refused"
            )
        elif kind in _BOUND_ERRORS:
            reason = limit_reason(path)
            if reason:
                message = f"{message}: {reason}"
        problems.append((where, message))
    return problems


_BOUND_ERRORS = frozenset(
    {
        "less_than",  # upper bounds only: they are what LIMITS explains
        "less_than_equal",
        "too_long",
        "string_too_long",
        "string_pattern_mismatch",
    }
)
REFERENCE = "docs/jobspec.md"


def limit_reason(path: Sequence[str]) -> str | None:
    """Why the field at ``path`` (dotted parts; list indexes and sweep-space names included)
    is bounded, from ``LIMITS``: its own entry, else its nearest parent's."""
    parts = list(path)
    if parts[:2] == ["sweep", "space"] and len(parts) >= 4:
        parts = ["sweep", "space", "*", *parts[3:]]
    while parts:
        key = ".".join(p for p in parts if not p.isdigit())
        if key in LIMITS:
            return LIMITS[key]
        parts.pop()
    return None


def _model_at(parts: Sequence[str]) -> type[BaseModel] | None:
    """The model that holds the fields of the section ``parts`` (``("kfac",)``: KFACSpec)."""
    model: type[BaseModel] = JobSpec
    index = 0
    while index < len(parts):
        field = model.model_fields.get(parts[index])
        if field is None:
            return None
        found = _models_in(field.annotation)
        if not found:
            return None
        model = found[0]
        index += 1
        if model is Distribution and parts[index - 1] == "space":
            index += 1  # the swept field's name, a key of the space
    return model


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models in an annotation (through unions, Annotated, dict values)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        found += _models_in(arg)
    return found


def _unknown_field(path: Sequence[str]) -> str:
    """The message for an unknown field: the closest known name, and the section's fields."""
    *section, name = path or ("",)
    model = _model_at(section)
    where = ".".join(section) or "the job"
    if model is None:
        return f"unknown field {name!r}; see {REFERENCE} for every field"
    known = list(model.model_fields)
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return (
        f"unknown field {name!r} in {where}; {hint}{where}'s fields are "
        f"{', '.join(known)} (every field: {REFERENCE})"
    )


def parse_job_spec(data: dict[str, Any], source: str = "job spec") -> JobSpec:
    """Validate a parsed job description; raise ``JobSpecError`` naming every bad field."""
    if not isinstance(data, dict):
        raise JobSpecError([f"expected a mapping of fields, got {type(data).__name__}"], source)
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise JobSpecError(_describe(exc), source) from None


def load_job_spec(path: str | Path) -> JobSpec:
    """Load a JobSpec from a ``.yaml``/``.yml`` or ``.json`` file."""
    file = Path(path)
    if not file.is_file():
        raise JobSpecError([f"file {file} does not exist"], str(file))
    text = file.read_text()
    try:
        data = json.loads(text) if file.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise JobSpecError(
            [f"not valid {'JSON' if file.suffix == '.json' else 'YAML'}: {exc}"], str(file)
        ) from None
    return parse_job_spec(data, str(file))
