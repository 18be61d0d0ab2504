"""The records of a sweep: its plan, each trial's events, and its result."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kaisa_train.records.base import BaseRecord, Direction, RecordKind, SweepMetric, TrialState


class SweepStartRecord(BaseRecord):
    kind: Literal[RecordKind.SWEEP_START] = RecordKind.SWEEP_START
    trials: int | None = None
    concurrent: int | None = None
    metric: SweepMetric | None = None
    mode: Direction | None = None
    space: dict[str, dict[str, Any]] | None = Field(
        default=None, description="each swept field and its distribution"
    )


class TrialRecord(BaseRecord):
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


class SweepRecord(BaseRecord):
    kind: Literal[RecordKind.SWEEP] = RecordKind.SWEEP
    metric: SweepMetric | None = None
    mode: Direction | None = None
    seconds: float | None = None
    trials: list[TrialOutcome] = Field(default_factory=list)
    best: TrialOutcome | None = None
    best_spec: dict[str, Any] | None = Field(
        default=None, description="the best trial's JobSpec, without its sweep"
    )
