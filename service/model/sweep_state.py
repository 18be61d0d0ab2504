"""A sweep job's state as the store keeps it (the ``jobs.sweep`` column): its plan, each
trial's latest word and, once it ended, the best trial. Typed from the sweep's records
(``service.domain.sweeps.merge``) to the API (``service.routes.schemas.sweep_view``); stored
as the JSON of these models.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kaisa_train.records import Direction, SweepMetric, TrialOutcome, TrialState


class TrialEntry(BaseModel):
    """One trial: its state, its draw, its latest evaluation and, once the sweep ended, its
    value of the sweep's metric, its checkpoint and its run."""

    model_config = ConfigDict(extra="ignore")

    state: TrialState = TrialState.RUNNING
    params: dict[str, Any] = Field(default_factory=dict)
    step: int | None = None
    metrics: dict[str, float | int | None] = Field(default_factory=dict)
    error: str | None = None
    value: float | None = None
    checkpoint: str | None = None
    run: str | None = None


class SweepState(BaseModel):
    """The sweep's plan (``trials_planned``, ``concurrent``, ``metric``, ``mode``, ``space``),
    its trials by Ray Tune's id, and its result (``best``, ``best_spec``, ``seconds``: set by
    the ``sweep`` record at the end)."""

    model_config = ConfigDict(extra="ignore")

    trials_planned: int | None = None
    concurrent: int | None = None
    metric: SweepMetric = SweepMetric.TEST_ACCURACY
    mode: Direction = Field(description="defaults to the metric's own direction")
    space: dict[str, dict[str, Any]] = Field(default_factory=dict)
    trials: dict[str, TrialEntry] = Field(default_factory=dict)
    best: TrialOutcome | None = None
    best_spec: dict[str, Any] | None = None
    seconds: float | None = None

    @model_validator(mode="before")
    @classmethod
    def _mode_of_the_metric(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("mode") is None:
            metric = SweepMetric(data.get("metric") or SweepMetric.TEST_ACCURACY)
            return {**data, "metric": metric, "mode": metric.direction}
        return data

    @property
    def trials_ended(self) -> int:
        """How many of its trials are over."""
        return sum(1 for trial in self.trials.values() if trial.state.ended)

    def stored(self) -> dict[str, Any]:
        """The JSON the store keeps."""
        return self.model_dump(mode="json")
