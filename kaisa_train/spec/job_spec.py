"""DOC_job"""

from __future__ import annotations

import copy
import difflib
import importlib.util
import json
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ByteSize,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from kaisa_ray.enums import (
    FactorReduction,
    OptimizerName,
    Parallel,
    Precision,
    Scaling,
)
from kaisa_ray.errors import ConfigurationError
from kaisa_ray.strategy import placeable, resolve_grad_worker_fraction
from kaisa_train.records import SweepMetric
from kaisa_train.spec.bounds import AUTO, REFERENCE, Seed, Steps, StrictModel, limit_reason
from kaisa_train.spec.kfac import KFACSpec
from kaisa_train.spec.model_params import ModelSpec
from kaisa_train.spec.sections import (
    PEER_OPTIMIZERS,
    CheckpointSpec,
    DatasetSpec,
    OptimizerSpec,
    ScalingSpec,
    StopSpec,
)
from kaisa_train.spec.sweep_section import Distribution, SweepSpec


class JobSpec(StrictModel):
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

    @model_validator(mode="before")
    @classmethod
    def _kfac_off_in_yaml(cls, data: Any) -> Any:
        """``kfac: off`` as typed in YAML: PyYAML (YAML 1.1) reads ``off`` and ``no`` as false,
        which here means what the user wrote."""
        if isinstance(data, dict) and data.get("kfac") is False:
            return {**data, "kfac": "off"}
        if isinstance(data, dict) and data.get("kfac") is True:
            raise ValueError(
                "kfac: true (YAML reads on and yes as true) is not a setting: leave kfac out for "
                "K-FAC with its defaults, or write kfac: auto, a kfac section, or kfac: off"
            )
        return data

    @field_validator("kfac", mode="before")
    @classmethod
    def _auto_shorthand(cls, value: Any) -> Any:
        return {"strategy": AUTO} if value == AUTO else value

    @model_validator(mode="after")
    def _strategy_fits_workers(self) -> JobSpec:
        if isinstance(self.kfac, KFACSpec) and not self.kfac.auto:
            workers = self.scaling.workers
            try:
                fraction = resolve_grad_worker_fraction(self.kfac.strategy, workers)
            except ConfigurationError as exc:
                raise ValueError(f"kfac.strategy does not fit scaling.workers: {exc}") from None
            if not placeable(self.kfac.scaling, workers, fraction):
                raise ValueError(
                    f"kfac.scaling: ekfac fits its diagonal from every worker's examples "
                    f"projected onto the layers' eigenbases, so every worker must hold them; "
                    f"kfac.strategy {self.kfac.strategy} keeps them on "
                    f"{round(fraction * workers)} of {workers}: set kfac.strategy: comm-opt, or "
                    "kfac.scaling: adam-eigenbasis"
                )
        return self

    @model_validator(mode="after")
    def _cuda_graphs_on_gpus(self) -> JobSpec:
        graphs = isinstance(self.kfac, KFACSpec) and self.kfac.cuda_graphs
        if graphs and self.scaling.gpus_per_worker < 1:
            raise ValueError(
                "kfac.cuda_graphs replays the preconditioning from a CUDA graph, but "
                f"scaling.gpus_per_worker is {self.scaling.gpus_per_worker:g}: give each "
                "worker a GPU (gpus_per_worker: 1) or set kfac.cuda_graphs: false"
            )
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
    def _fsdp_fits(self) -> JobSpec:
        """What FSDP2 jobs do not run yet (docs/fsdp.md), each with the fix."""
        if self.scaling.parallel is not Parallel.FSDP:
            return self
        kfac = self.kfac if isinstance(self.kfac, KFACSpec) else None
        problems = [
            (kfac is not None and kfac.quadratic_model, "kfac.update: quadratic-model",
             "kfac.update: optimizer"),
            (self.optimizer.name not in (OptimizerName.SGD, OptimizerName.ADAM,
                                         OptimizerName.ADAMW),
             f"optimizer {self.optimizer.name}", "optimizer.name: sgd, adam or adamw"),
            (self.precision is Precision.FP16, "precision: fp16 (its GradScaler)",
             "precision: bf16 or fp32"),
            (kfac is not None and kfac.factor_reduction is FactorReduction.DEFERRED,
             "kfac.factor_reduction: deferred", "kfac.factor_reduction: every-update"),
        ]  # fmt: skip
        for refused, what, fix in problems:
            if refused:
                raise ValueError(
                    f"scaling.parallel: fsdp does not run with {what} yet: set {fix}, or "
                    "scaling.parallel: ddp"
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
