"""Every progress record, defined once: what a job's workers and driver send to the progress
sink, and what the driver, the CLI, the service and the dashboard read back.

A record is a frozen pydantic model with a ``kind`` from ``RecordKind``, one class per kind.
Producers build the class and push ``record.wire()`` (a JSON-ready dict); consumers turn what
they read into the class again with ``parse_record``. The progress sink adds ``seq`` (the
record's number in its run) and ``time`` (when the sink took it). A field with a default is on
the wire only when its producer set it (``resumed_from`` on a resumed run's ``start``, the
measured columns of a verified candidate), so a reader can tell "not measured" from "zero".

The closed sets the records carry are here too: a trial's ``TrialState``, a sweep's
``SweepMetric`` (with the ``Direction`` that is better) and the metrics a trial reports
(``TRIAL_METRICS``). The dashboard receives all of them from ``GET /v1/registry``.

This module imports pydantic and the core's enums only (no torch, no Ray): the service's
client commands read records too.

A new kind: add a member to ``RecordKind``, a class here with ``kind: Literal[RecordKind.X]``,
and the class to ``Record``; ``tests/test_records.py`` checks the three agree.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from kaisa_ray.enums import EvalMetric

__all__ = [
    "PHASE_FIELDS",
    "TRIAL_METRICS",
    "AdaptiveChoice",
    "CandidateRow",
    "CheckpointRecord",
    "Direction",
    "EndRecord",
    "EvalRecord",
    "IntervalChangeRow",
    "IntervalsRecord",
    "KFACChoice",
    "LayerIntervals",
    "MeasuredRecord",
    "ProfilingRecord",
    "Record",
    "RecordKind",
    "StartRecord",
    "StepRecord",
    "SweepMetric",
    "SweepRecord",
    "SweepStartRecord",
    "TrialOutcome",
    "TrialRecord",
    "TrialState",
    "TunerErrorRecord",
    "TunerRecord",
    "Unit",
    "WorkerRecord",
    "parse_record",
    "try_record",
]


class RecordKind(enum.StrEnum):
    """What a progress record says; the class of each is below."""

    WORKER = "worker"  # a worker started (every attempt of the worker group)
    PROFILING = "profiling"  # kfac: auto is profiling on the workers
    START = "start"  # training begins (again, after a restart)
    STEP = "step"  # a window of training steps
    EVAL = "eval"  # an evaluation on the test split
    CHECKPOINT = "checkpoint"  # Ray Train holds a checkpoint of this step
    END = "end"  # training stopped
    TUNER = "tuner"  # kfac: auto's decision and its candidate table
    TUNER_ERROR = "tuner-error"  # kfac: auto found nothing that fits
    MEASURED = "measured"  # a candidate strategy measured on the workers
    INTERVALS = "intervals"  # each layer's K-FAC intervals, staleness and why they changed
    SWEEP_START = "sweep-start"  # a sweep's plan
    TRIAL = "trial"  # a sweep trial started, evaluated or ended
    SWEEP = "sweep"  # a sweep's result


class TrialState(enum.StrEnum):
    """A sweep trial: RUNNING, then SUCCEEDED (trained to the job's stop), STOPPED (early, by
    the ASHA scheduler) or FAILED."""

    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    STOPPED = "STOPPED"
    FAILED = "FAILED"

    @property
    def ended(self) -> bool:
        return self is not TrialState.RUNNING


class Direction(enum.StrEnum):
    """Whether a larger or a smaller value of a metric is better."""

    MAX = "max"
    MIN = "min"


class Unit(enum.StrEnum):
    """How a metric's values read."""

    VALUE = "value"  # a plain number (a loss)
    FRACTION = "fraction"  # a share, shown in percent
    SECONDS = "seconds"
    MS = "ms"  # milliseconds
    PER_SECOND = "per second"


class SweepMetric(enum.StrEnum):
    """What ranks a sweep's trials."""

    TEST_ACCURACY = EvalMetric.TEST_ACCURACY.value  # the final test accuracy
    TEST_LOSS = EvalMetric.TEST_LOSS.value  # the final test loss
    TIME_TO_TARGET = "time_to_target"  # training seconds until stop.target was met

    @property
    def direction(self) -> Direction:
        """The metric's own direction: accuracy up, loss and time down."""
        return Direction.MAX if self is SweepMetric.TEST_ACCURACY else Direction.MIN

    @property
    def unit(self) -> Unit:
        """How its values read: a share (accuracy), seconds, or a plain number (a loss)."""
        if self is SweepMetric.TEST_ACCURACY:
            return Unit.FRACTION
        return Unit.SECONDS if self is SweepMetric.TIME_TO_TARGET else Unit.VALUE

    @property
    def reported(self) -> str:
        """The field of a trial's reports that holds it."""
        return "time_to_target_s" if self is SweepMetric.TIME_TO_TARGET else self.value


TRIAL_METRICS = (
    EvalMetric.TEST_ACCURACY.value,
    EvalMetric.TEST_LOSS.value,
    "train_s",
    "time_to_target_s",
)
"""What a trial's evaluations report (``TrialRecord``'s metric fields)."""

PHASE_FIELDS = (
    "kfac_factors_ms",
    "kfac_decompositions_ms",
    "kfac_precondition_ms",
    "kfac_communication_ms",
    "kfac_staleness_ms",
)
"""A step record's K-FAC milliseconds per step by phase (``kaisa_ray.timing.PHASES``)."""


class _Record(BaseModel):
    """Fields every record has once the progress sink took it."""

    # Unknown fields are ignored: a newer worker may send more than this reader knows.
    model_config = ConfigDict(frozen=True, extra="ignore")

    kind: RecordKind
    seq: int | None = Field(default=None, description="the record's number in its run")
    time: float | None = Field(default=None, description="when the sink took it (Unix time)")

    def wire(self) -> dict[str, Any]:
        """The record as the progress sink holds it: JSON values, its kind, and the fields
        its producer set."""
        data = self.model_dump(mode="json", exclude_unset=True, exclude={"kind"})
        return {"kind": self.kind.value, **data}

    def values(self) -> dict[str, Any]:
        """The record's own fields (without ``kind``, ``seq`` and ``time``)."""
        data = self.wire()
        for name in ("kind", "seq", "time"):
            data.pop(name, None)
        return data


class AdaptiveChoice(BaseModel):
    """Intervals adapted per layer during training (``kaisa_ray.intervals``): the ladder,
    the rung every layer starts on, the staleness target, and each layer's seconds per update
    with the cap on their sum per step (from ``max_overhead``)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    rungs: list[tuple[int, int]] = Field(description="nested (factor, inverse) intervals")
    start: int = Field(description="the starting rung (0: the shortest)")
    target_angle: float = Field(description="degrees of staleness before a layer shortens")
    layer_costs: dict[str, tuple[float, float]] = Field(
        default_factory=dict, description="seconds per update of each layer: factors, inverse"
    )
    max_seconds: float | None = Field(
        default=None, description="cap on the interval-dependent K-FAC seconds per step"
    )

    def intervals(self) -> Any:
        """As the core's ``AdaptiveIntervals`` (typed Any: this module imports no core
        module beyond the enums, so that the client commands stay light)."""
        from kaisa_ray.intervals import AdaptiveIntervals, LayerCost

        costs = {
            name: LayerCost(factor_s=factor, decomposition_s=inverse)
            for name, (factor, inverse) in self.layer_costs.items()
        }
        return AdaptiveIntervals(
            rungs=tuple((int(f), int(d)) for f, d in self.rungs),
            start=self.start,
            target_angle=self.target_angle,
            costs=costs or None,
            max_seconds=self.max_seconds if costs else None,
        )


class KFACChoice(BaseModel):
    """A K-FAC strategy: the gradient worker fraction and the update intervals (with
    ``adaptive``: the intervals every layer starts on, adapted from there)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    # Jobs stored before this name was settled call it "strategy".
    grad_worker_fraction: float = Field(
        validation_alias=AliasChoices("grad_worker_fraction", "strategy"),
        description="KAISA's f: the share of ranks that precondition each layer",
    )
    factor_update_steps: int
    inv_update_steps: int
    adaptive: AdaptiveChoice | None = Field(
        default=None, description="intervals adapted per layer online; null: fixed"
    )

    def spec_fields(self) -> dict[str, Any]:
        """The KFACSpec fields this choice sets."""
        return {
            "strategy": self.grad_worker_fraction,
            "factor_update_steps": self.factor_update_steps,
            "inv_update_steps": self.inv_update_steps,
        }

    def key(self) -> tuple[float, int, int]:
        return (self.grad_worker_fraction, self.factor_update_steps, self.inv_update_steps)


class CandidateRow(KFACChoice):
    # A row is one fixed candidate (the decision's ``chosen`` says whether it adapts).
    """One row of the tuner's candidate table (predicted; measured when verified)."""

    memory_bytes: int = Field(description="predicted peak memory per worker")
    kfac_state_bytes: int = Field(description="K-FAC's state on the worst rank, exactly")
    ms_per_step: float = Field(description="predicted time per step on the slowest rank")
    rejected: str | None = Field(description="why it cannot be chosen; null if it fits")
    measured_memory_bytes: int | None = Field(default=None, description="its trial's peak")
    measured_ms_per_step: float | None = Field(default=None, description="its trial's time")

    def choice(self) -> KFACChoice:
        return KFACChoice(
            grad_worker_fraction=self.grad_worker_fraction,
            factor_update_steps=self.factor_update_steps,
            inv_update_steps=self.inv_update_steps,
        )

    @property
    def measured(self) -> bool:
        return "measured_ms_per_step" in self.model_fields_set


class WorkerRecord(_Record):
    kind: Literal[RecordKind.WORKER] = RecordKind.WORKER
    rank: int
    world: int | None = None
    pid: int | None = None
    device: str | None = None
    node: str | None = Field(default=None, description="the Ray node the worker runs on")


class ProfilingRecord(_Record):
    kind: Literal[RecordKind.PROFILING] = RecordKind.PROFILING


class StartRecord(_Record):
    kind: Literal[RecordKind.START] = RecordKind.START
    total_steps: int | None = None
    from_step: int = 0
    resumed_from: str | None = Field(default=None, description="the checkpoint it resumed from")


class StepRecord(_Record):
    """The mean over the steps since the previous step record (rank 0's view)."""

    kind: Literal[RecordKind.STEP] = RecordKind.STEP
    step: int
    epoch: int | None = None
    loss: float | None = None
    accuracy: float | None = Field(default=None, description="training accuracy")
    lr: float | None = None
    samples_per_s: float | None = Field(default=None, description="over every worker")
    ms_per_step: float | None = None
    data_wait_ms: float | None = Field(
        default=None, description="per step, waiting for the batch (within ms_per_step)"
    )
    skipped_rows: int | None = Field(
        default=None, description="records skipped as unreadable so far (bad_records: skip)"
    )
    kfac_ms_per_step: float | None = None
    kfac_factors_ms: float | None = None
    kfac_decompositions_ms: float | None = None
    kfac_precondition_ms: float | None = None
    kfac_communication_ms: float | None = None
    kfac_staleness_ms: float | None = Field(
        default=None, description="measuring the curvature's staleness (its all-reduce aside)"
    )
    damping: float | None = Field(
        default=None,
        description="the quadratic model's damping after the window's last step "
        "(kfac.update: quadratic-model; lr is then its step size, alpha)",
    )
    momentum: float | None = Field(
        default=None, description="the quadratic model's momentum on the window's last step"
    )


class EvalRecord(_Record):
    kind: Literal[RecordKind.EVAL] = RecordKind.EVAL
    step: int
    test_loss: float | None = None
    test_accuracy: float | None = None
    elapsed_s: float | None = Field(default=None, description="since this attempt began")
    train_s: float | None = Field(default=None, description="in training steps, this attempt")


class CheckpointRecord(_Record):
    kind: Literal[RecordKind.CHECKPOINT] = RecordKind.CHECKPOINT
    step: int
    path: str | None = Field(default=None, description="where Ray Train keeps it")


class EndRecord(_Record):
    kind: Literal[RecordKind.END] = RecordKind.END
    step: int


class TunerRecord(_Record):
    """``kfac: auto``'s decision: how it was made, and every candidate it weighed."""

    kind: Literal[RecordKind.TUNER] = RecordKind.TUNER
    how: str = Field(
        default="predicted", description="predicted (by the cost model) or measured (by trials)"
    )
    cache: Literal["hit", "miss"] = Field(description="hit: the profile came from the cache")
    profile_s: float = Field(description="seconds of profiling in the workers (0 on a hit)")
    budget_bytes: int | None = Field(description="the memory budget per worker")
    base_memory_bytes: int = Field(description="model, optimizer and activations per worker")
    kfac_transient_bytes: int = Field(description="K-FAC's temporaries over its state")
    plain_ms_per_step: float = Field(description="the step without K-FAC")
    chosen: KFACChoice
    candidates: list[CandidateRow]
    profile_run_s: float | None = Field(default=None, description="the profiling run's wall")
    verify_s: float | None = Field(default=None, description="seconds of verification trials")
    predicted_choice: KFACChoice | None = Field(
        default=None, description="what the prediction alone chose (when verified)"
    )
    data_window_bytes: int | None = Field(
        default=None,
        description="a streamed dataset's rows a worker holds (estimated; in the memory "
        "weighed on a CPU worker)",
    )
    data_ms_per_batch: float | None = Field(
        default=None, description="waiting for a batch while profiling (median, after the first)"
    )
    data_note: str | None = Field(
        default=None, description="when the data pipeline did not keep up: what it cost, the fix"
    )


class LayerIntervals(BaseModel):
    """One layer's intervals now and how stale its curvature was (``kaisa_ray.staleness``;
    -1: not measured yet)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    layer: str
    factor_update_steps: int
    inv_update_steps: int
    change_a: float = Field(description="relative change of A since its last decomposition")
    change_g: float = Field(description="relative change of G since its last decomposition")
    measured_step: int | None = Field(description="its last decomposition step (measured)")
    interval_change_a: float = Field(description="A's change over the interval it ended")
    interval_change_g: float = Field(description="G's change over the interval it ended")
    angle: float = Field(description="there, degrees between stale and fresh preconditioning")
    reason: str = Field(description="why the layer is on these intervals")


class IntervalChangeRow(BaseModel):
    """A layer's intervals changed, and why."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    step: int
    layer: str
    before: tuple[int, int]
    after: tuple[int, int]
    angle: float
    gap: int = Field(description="steps since the layer's previous decomposition")
    reason: str


class IntervalsRecord(_Record):
    """Each layer's K-FAC intervals and staleness now, and the changes since the last one
    (rank 0, with the step records; only while staleness is measured)."""

    kind: Literal[RecordKind.INTERVALS] = RecordKind.INTERVALS
    step: int
    adaptive: bool = Field(description="whether the intervals adapt (else only measured)")
    layers: list[LayerIntervals]
    changes: list[IntervalChangeRow] = Field(default_factory=list)


class TunerErrorRecord(_Record):
    kind: Literal[RecordKind.TUNER_ERROR] = RecordKind.TUNER_ERROR
    error: str


class MeasuredRecord(_Record):
    """A candidate strategy measured on the job's workers."""

    kind: Literal[RecordKind.MEASURED] = RecordKind.MEASURED
    candidate: KFACChoice
    memory_bytes: int = Field(description="peak memory per worker (first round)")
    ms_per_step: float = Field(description="median over the rounds")
    ms_per_step_rounds: list[float]
    steps: int


class SweepStartRecord(_Record):
    kind: Literal[RecordKind.SWEEP_START] = RecordKind.SWEEP_START
    trials: int | None = None
    concurrent: int | None = None
    metric: SweepMetric | None = None
    mode: Direction | None = None
    space: dict[str, dict[str, Any]] | None = Field(
        default=None, description="each swept field and its distribution"
    )


class TrialRecord(_Record):
    """A trial's event: it started (with its params), evaluated (its metrics) or ended."""

    kind: Literal[RecordKind.TRIAL] = RecordKind.TRIAL
    trial: str = Field(description="Ray Tune's id of the trial")
    state: TrialState = TrialState.RUNNING
    params: dict[str, Any] | None = None
    step: int | None = None
    test_accuracy: float | None = None
    test_loss: float | None = None
    train_s: float | None = None
    time_to_target_s: float | None = None
    error: str | None = None


class TrialOutcome(BaseModel):
    """How one trial ended (a ``sweep`` record lists every one)."""

    model_config = ConfigDict(extra="ignore")

    trial_id: str
    run: str | None = Field(default=None, description="its training run (checkpoints' name)")
    params: dict[str, Any] = Field(default_factory=dict)
    state: TrialState
    step: int | None = None
    metrics: dict[str, Any] = Field(default_factory=dict)
    value: float | None = Field(default=None, description="the sweep's metric; null: none")
    error: str | None = None
    checkpoint: str | None = None


class SweepRecord(_Record):
    kind: Literal[RecordKind.SWEEP] = RecordKind.SWEEP
    metric: SweepMetric | None = None
    mode: Direction | None = None
    seconds: float | None = None
    trials: list[TrialOutcome] = Field(default_factory=list)
    best: TrialOutcome | None = None
    best_spec: dict[str, Any] | None = Field(
        default=None, description="the best trial's JobSpec, without its sweep"
    )


Record = Annotated[
    WorkerRecord
    | ProfilingRecord
    | StartRecord
    | StepRecord
    | EvalRecord
    | CheckpointRecord
    | EndRecord
    | TunerRecord
    | TunerErrorRecord
    | MeasuredRecord
    | IntervalsRecord
    | SweepStartRecord
    | TrialRecord
    | SweepRecord,
    Field(discriminator="kind"),
]
"""Any record, told apart by its ``kind``."""

RECORD: TypeAdapter[Record] = TypeAdapter(Record)


def parse_record(data: Mapping[str, Any]) -> Record:
    """The record ``data`` holds (a dict from the sink or an event stream).

    Raises:
        pydantic.ValidationError: not a record of a known kind, or a field of the wrong type.
    """
    return RECORD.validate_python(data)


def try_record(data: Any) -> tuple[Record | None, str | None]:
    """``parse_record`` that says what was wrong instead of raising: (record, None) or
    (None, the problem)."""
    try:
        return parse_record(data), None
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors()
        )
        kind = data.get("kind") if isinstance(data, Mapping) else None
        return None, f"a {kind!r} record that does not read ({problems}): dropped"
