"""What every record shares: its ``RecordKind``, the fields the progress sink adds, and the
closed sets the records carry (a trial's state, a sweep's metric and its direction, units)."""

from __future__ import annotations

import enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kaisa_ray.enums import EvalMetric


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


class BaseRecord(BaseModel):
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
