"""``JobSpec``: the one description of a training job shared by every front door.

Loaded from YAML or JSON (the job file of ``ray job submit``, the body of a REST request), and
validated before anything starts: every bad field is reported at once, each with what is
wrong and how to fix it. Pydantic stays at this boundary; the train loop gets plain values.

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
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from kaisa_ray.errors import ConfigurationError
from kaisa_ray.strategy import resolve_grad_worker_fraction
from kaisa_ray.train.registry import dataset_entry, dataset_names, model_factory, model_names

PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    name: str
    params: dict[str, Any] = Field(default_factory=dict)

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


class DatasetSpec(_Strict):
    name: str
    data_dir: Path | None = None
    batch_size: PositiveInt = 128
    limit: PositiveInt | None = None

    @model_validator(mode="after")
    def _available(self) -> DatasetSpec:
        try:
            entry = dataset_entry(self.name)
        except KeyError:
            raise ValueError(
                f"unknown dataset {self.name!r}; choose one of {', '.join(dataset_names())}, "
                "or register your own under the 'kaisa_ray.datasets' entry point"
            ) from None
        if entry.needs_files:
            directory = self.data_dir or entry.default_dir
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
    warmup_steps: Annotated[int, Field(ge=0)] = 0
    step_every: PositiveInt | None = None
    gamma: Annotated[float, Field(gt=0, le=1)] = 0.1


class OptimizerSpec(_Strict):
    name: Literal["sgd", "adam", "adamw"] = "sgd"
    lr: PositiveFloat = 0.05
    momentum: Annotated[float, Field(ge=0, lt=1)] = 0.9
    nesterov: bool = True
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    schedule: ScheduleSpec = ScheduleSpec()


class KFACSpec(_Strict):
    """K-FAC settings. ``strategy: auto`` (or ``kfac: auto``) lets the tuner choose the
    gradient worker fraction and the factor/inverse intervals on the job's own workers, under
    ``memory_budget`` (and ``max_overhead``, K-FAC's predicted time over the plain step's,
    if given). It chooses the intervals from ``intervals`` (pairs of factor and inverse
    intervals; ``[[5, 50]]`` fixes them), else from its own ladder; ``factor_update_steps``
    and ``inv_update_steps`` are then ignored. ``verify: K`` measures the K best predicted
    candidates in short trials and takes the fastest measured one that fits."""

    strategy: (
        Literal["auto", "comm-opt", "hybrid-opt", "mem-opt"] | Annotated[float, Field(gt=0, le=1)]
    ) = "comm-opt"
    factor_update_steps: PositiveInt = 5
    inv_update_steps: PositiveInt = 50
    damping: PositiveFloat = 0.1
    factor_decay: Annotated[float, Field(ge=0, lt=1)] = 0.95
    kl_clip: PositiveFloat | None = 0.001
    compute_method: Literal["eigen", "inverse"] = "eigen"
    kfac_approx: Literal["expand", "reduce"] = "reduce"
    max_overhead: PositiveFloat | None = None
    intervals: Annotated[list[tuple[PositiveInt, PositiveInt]], Field(min_length=1)] | None = None
    verify: Annotated[int, Field(ge=0, le=32)] = 0

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

    @model_validator(mode="after")
    def _auto_only(self) -> KFACSpec:
        if self.strategy != "auto":
            # By value, not by fields set: a spec dumped to JSON and read back (as the workers
            # do) has every field set.
            defaults = {"max_overhead": None, "intervals": None, "verify": 0}
            given = [name for name, empty in defaults.items() if getattr(self, name) != empty]
            if given:
                raise ValueError(
                    f"{', '.join(given)} only for strategy: auto (the tuner); remove "
                    f"{'it' if len(given) == 1 else 'them'} or set strategy: auto instead of "
                    f"{self.strategy!r}"
                )
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
    takes (an autoscaling cluster adds nodes)."""

    workers: PositiveInt = 1
    gpus_per_worker: Annotated[float, Field(ge=0)] = 0
    cpus_per_worker: PositiveFloat = 1
    placement: Literal["pack", "spread", "strict-pack", "strict-spread"] = "pack"
    resource_timeout_s: PositiveFloat | None = None

    @property
    def placement_strategy(self) -> str:
        """Ray's name for ``placement`` (``STRICT_SPREAD``...)."""
        return self.placement.upper().replace("-", "_")


class TargetSpec(_Strict):
    metric: Literal["test_accuracy", "test_loss"] = "test_accuracy"
    value: float


class StopSpec(_Strict):
    max_steps: PositiveInt | None = None
    max_epochs: PositiveInt | None = None
    target: TargetSpec | None = None

    @model_validator(mode="after")
    def _one_limit(self) -> StopSpec:
        if (self.max_steps is None) == (self.max_epochs is None):
            raise ValueError("give exactly one of max_steps and max_epochs")
        return self


class CheckpointSpec(_Strict):
    every_steps: PositiveInt = 200
    keep: PositiveInt = 2


class Distribution(_Strict):
    """Where a sweep draws one field from: exactly one of ``loguniform: [low, high]``,
    ``uniform: [low, high]``, ``randint: [low, high]`` (integers, both ends included) or
    ``choice: [v1, v2, ...]``."""

    loguniform: tuple[float, float] | None = None
    uniform: tuple[float, float] | None = None
    randint: tuple[int, int] | None = None
    choice: Annotated[list[int | float], Field(min_length=1)] | None = None

    @model_validator(mode="after")
    def _one_nonempty_range(self) -> Distribution:
        given = [name for name in DISTRIBUTIONS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of {', '.join(DISTRIBUTIONS)} (got "
                f"{', '.join(given) or 'none'}), e.g. {{loguniform: [0.001, 0.1]}}"
            )
        if self.kind != "choice":
            low, high = self.ends
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

    grace_steps: PositiveInt | None = None
    reduction_factor: Annotated[float, Field(gt=1)] = 2


class SweepSpec(_Strict):
    """A hyperparameter sweep over the job's own fields, run on Ray Tune.

    ``space`` maps dotted fields of the job (``optimizer.lr``, ``kfac.damping``,
    ``kfac.kl_clip``, ``kfac.factor_decay``, any numeric field) to a ``Distribution``. Each of
    ``trials`` trials trains the job with one draw (``concurrent`` at once). ``metric``: the
    final ``test_accuracy`` (max), ``test_loss`` (min) or ``time_to_target`` (min: training
    seconds until ``stop.target`` is met; a trial that never meets it ranks last). With
    ``scheduler: asha`` weak trials stop early, judged at each evaluation on the test metric.
    """

    space: Annotated[dict[str, Distribution], Field(min_length=1)]
    metric: Literal["test_accuracy", "test_loss", "time_to_target"] = "test_accuracy"
    mode: Literal["max", "min"] | None = None
    trials: Annotated[int, Field(gt=0, le=1024)] = 8
    concurrent: PositiveInt = 1
    scheduler: Literal["asha", "none"] = "asha"
    asha: AshaSpec = AshaSpec()
    seed: int = 0

    @property
    def direction(self) -> Literal["max", "min"]:
        """``mode``, or the metric's own: max for accuracy, min for loss and time."""
        if self.mode is not None:
            return self.mode
        return "max" if self.metric == "test_accuracy" else "min"


class JobSpec(_Strict):
    """A training job, validated as a whole before anything starts."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]
    model: ModelSpec
    dataset: DatasetSpec
    optimizer: OptimizerSpec = OptimizerSpec()
    kfac: KFACSpec | Literal["off"] = KFACSpec()
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    memory_budget: ByteSize | None = None
    scaling: ScalingSpec = ScalingSpec()
    stop: StopSpec
    eval_every: PositiveInt = 25
    checkpoint: CheckpointSpec = CheckpointSpec()
    max_failures: Annotated[int, Field(ge=0)] = 0
    seed: int = 0
    sweep: SweepSpec | None = None

    @field_validator("kfac", mode="before")
    @classmethod
    def _auto_shorthand(cls, value: Any) -> Any:
        return {"strategy": "auto"} if value == "auto" else value

    @model_validator(mode="after")
    def _strategy_fits_workers(self) -> JobSpec:
        if isinstance(self.kfac, KFACSpec) and self.kfac.strategy != "auto":
            try:
                resolve_grad_worker_fraction(self.kfac.strategy, self.scaling.workers)
            except ConfigurationError as exc:
                raise ValueError(f"kfac.strategy does not fit scaling.workers: {exc}") from None
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
    if isinstance(spec.kfac, KFACSpec) and spec.kfac.strategy != "auto":
        problems.append(
            (
                ("kfac", "strategy"),
                "a sweep runs every trial with kfac.strategy: auto, so that each trial's K-FAC "
                f"strategy is chosen under memory_budget; set it instead of {spec.kfac.strategy!r}",
            )
        )
    if isinstance(spec.kfac, KFACSpec) and spec.kfac.verify:
        problems.append((("kfac", "verify"), "verification cannot run inside sweep trials"))
    if sweep.metric == "time_to_target" and spec.stop.target is None:
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
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source} is invalid ({len(problems)} problem(s)):\n{lines}")


def _field_path(loc: tuple[int | str, ...]) -> tuple[str, ...]:
    """The field names in an error location, without pydantic's union-branch and validator
    tags (``KFACSpec``, ``literal['off']``, ``function-after[...]``)."""
    return tuple(
        str(part)
        for part in loc
        if not (isinstance(part, str) and ("[" in part or part[:1].isupper()))
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
        where = ".".join(path) or "(top level)"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown field; check its spelling against the JobSpec reference"
        elif item["type"] == "byte_size":
            message = f"{message}; write a size such as '2GiB' or '512MB'"
        problems.append((where, message))
    return problems


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
