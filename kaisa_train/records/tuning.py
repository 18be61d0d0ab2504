"""The records of ``kfac: auto`` and of adaptive intervals: the strategy chosen and every
candidate weighed, a candidate measured, each layer's intervals and staleness."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from kaisa_train.records.base import BaseRecord, RecordKind


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


class TunerRecord(BaseRecord):
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


class IntervalsRecord(BaseRecord):
    """Each layer's K-FAC intervals and staleness now, and the changes since the last one
    (rank 0, with the step records; only while staleness is measured)."""

    kind: Literal[RecordKind.INTERVALS] = RecordKind.INTERVALS
    step: int
    adaptive: bool = Field(description="whether the intervals adapt (else only measured)")
    layers: list[LayerIntervals]
    changes: list[IntervalChangeRow] = Field(default_factory=list)


class TunerErrorRecord(BaseRecord):
    kind: Literal[RecordKind.TUNER_ERROR] = RecordKind.TUNER_ERROR
    error: str


class MeasuredRecord(BaseRecord):
    """A candidate strategy measured on the job's workers."""

    kind: Literal[RecordKind.MEASURED] = RecordKind.MEASURED
    candidate: KFACChoice
    memory_bytes: int = Field(description="peak memory per worker (first round)")
    ms_per_step: float = Field(description="median over the rounds")
    ms_per_step_rounds: list[float]
    steps: int
