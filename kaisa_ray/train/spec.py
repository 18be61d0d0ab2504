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

import json
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
