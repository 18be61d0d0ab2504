"""The REST API's response bodies (request bodies are the ``JobSpec`` itself)."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field

from kaisa_ray.enums import ComputeMethod, KFACApprox, Precision
from kaisa_train.records import (
    TRIAL_METRICS,
    Direction,
    KFACChoice,
    RecordKind,
    SweepMetric,
    TrialState,
    TunerRecord,
    Unit,
)
from service.domain.metric_views import ChartView, ColumnView, MetricView
from service.domain.sweeps import plan
from service.model.job_data import Job, Metric, Transition
from service.model.lifecycle import JobState

logger = logging.getLogger(__name__)


def _when(seconds: float | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, UTC)


class ProgressView(BaseModel):
    step: int = Field(
        description="the last step the workers reported (a sweep: the trials that are over)"
    )
    total: int | None = Field(
        description="the job's steps in all, once training started (a sweep: the trials planned)"
    )
    percent: float | None = Field(
        description="step over total in percent; 100 once the job SUCCEEDED (also when it "
        "stopped early at its target)"
    )
    target_met: bool = Field(
        default=False,
        description="the job SUCCEEDED by meeting stop.target before its step limit: it is "
        "done, not stuck at percent",
    )


class TransitionView(BaseModel):
    from_state: JobState | None
    to_state: JobState
    event: str
    reason: str | None
    at: datetime


class JobView(BaseModel):
    id: str
    name: str
    state: JobState
    queue_position: int | None = Field(
        default=None,
        description="while the job waits for admission (QUEUED, not yet in Ray): 1 if it is "
        "next, and so on; null otherwise",
    )
    progress: ProgressView
    metrics: dict[str, float | int | None] = Field(
        description="the latest step and evaluation metrics (loss, accuracy, samples_per_s, "
        "ms_per_step, test_loss, test_accuracy, ...)"
    )
    decision: KFACChoice | None = Field(
        description="kfac: auto: what the tuner chose (the gradient worker fraction and the "
        "intervals)"
    )
    tuner: TunerRecord | None = Field(
        description="kfac: auto: the tuner's record: how it chose, the budget, and every "
        "candidate with its predicted memory and time (and why it was ruled out)"
    )
    failure_reason: str | None
    submission_id: str | None = Field(description="the Ray Job running this job")
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    spec: dict[str, Any]


class TrialView(BaseModel):
    trial_id: str = Field(description="Ray Tune's id of the trial")
    state: TrialState = Field(
        description="RUNNING; SUCCEEDED (trained to the job's stop), STOPPED (stopped early by "
        "the ASHA scheduler) or FAILED (see error)"
    )
    params: dict[str, float | int] = Field(
        description="the trial's draw of each swept field, by its dotted name (optimizer.lr)"
    )
    step: int | None = Field(description="the step of the trial's latest evaluation")
    metrics: dict[str, float | int | None] = Field(
        description="the trial's latest evaluation: test_accuracy, test_loss, train_s (training "
        "seconds so far) and time_to_target_s (once it met stop.target)"
    )
    value: float | None = Field(
        default=None,
        description="the sweep's metric for this trial, once the sweep ended (null: it has none)",
    )
    error: str | None = Field(description="why the trial failed (FAILED), e.g. a diverging loss")
    checkpoint: str | None = Field(
        default=None, description="the trial's latest checkpoint, once the sweep ended"
    )


class BestTrialView(BaseModel):
    trial_id: str
    params: dict[str, float | int] = Field(description="its draw of each swept field")
    value: float | None = Field(description="its value of the sweep's metric")
    step: int | None
    metrics: dict[str, float | int | None]
    checkpoint: str | None = Field(
        description="its latest checkpoint (a path or URI in the job's storage)"
    )
    run: str | None = Field(description="its training run (its files are under this name)")


class SweepView(BaseModel):
    metric: SweepMetric = Field(
        description="what ranks the trials: the final test_accuracy or test_loss, or the "
        "training seconds until stop.target was met"
    )
    mode: Direction = Field(description="whether a larger or smaller metric is better")
    trials_planned: int | None = Field(description="how many trials the sweep runs")
    concurrent: int | None = Field(description="how many trials run at once")
    space: dict[str, dict[str, Any]] = Field(
        description="each swept field (dotted) and its distribution: {loguniform: [low, high]}, "
        "{uniform: [low, high]}, {randint: [low, high]} or {choice: [v1, v2, ...]}"
    )
    trials_ended: int = Field(description="how many trials are over (SUCCEEDED, STOPPED, FAILED)")
    trials: list[TrialView] = Field(description="every trial started so far, by trial id")
    best: BestTrialView | None = Field(
        description="the best trial, once the sweep ended (null: no trial has the metric)"
    )
    best_spec: dict[str, Any] | None = Field(
        description="the best trial's JobSpec (without a sweep), ready to submit as a job"
    )
    best_spec_yaml: str | None = Field(
        default=None,
        description="the best spec as a job file (kaisa-ray train --config), as the CLI prints it",
    )
    seconds: float | None = Field(description="the sweep's duration, once it ended")


class JobDetail(JobView):
    sweep: SweepView | None = Field(
        default=None,
        description="a sweep job (a spec with a sweep section): its plan, every trial and, once "
        "it ended, the best trial and its spec; null for other jobs",
    )
    transitions: list[TransitionView]


class JobList(BaseModel):
    jobs: list[JobView]
    total: int
    limit: int
    offset: int
    next_offset: int | None


class MetricPoint(BaseModel):
    seq: int
    kind: Literal["step", "eval", "intervals"]
    step: int | None
    at: datetime
    values: dict[str, Any]


class MetricHistory(BaseModel):
    job_id: str
    points: list[MetricPoint]
    next_since: int = Field(description="pass as since to read only newer points")


class NamedMetric(BaseModel):
    name: SweepMetric
    direction: Direction = Field(description="whether a larger or smaller value is better")
    unit: Unit = Field(description="how its values read")


class Registry(BaseModel):
    """What a JobSpec may name, and every closed set the API's answers use (defined once, in
    the project's enums: a client such as the dashboard reads them here)."""

    models: list[str] = Field(description="what a JobSpec's model.name may be")
    datasets: list[str] = Field(description="what a JobSpec's dataset.name may be")
    optimizers: list[str] = Field(description="what optimizer.name may be")
    strategies: list[str] = Field(
        description="what kfac.strategy may name, the JobSpec's default first (it may also be "
        "a fraction in (0, 1])"
    )
    compute_methods: list[ComputeMethod] = Field(description="kfac.compute_method")
    kfac_approximations: list[KFACApprox] = Field(description="kfac.kfac_approx")
    precisions: list[Precision] = Field(description="precision")
    job_states: list[JobState] = Field(description="a job's states, in lifecycle order")
    finished_states: list[JobState] = Field(description="the states a job ends in")
    trial_states: list[TrialState] = Field(description="a sweep trial's states")
    ended_trial_states: list[TrialState] = Field(description="those of a trial that is over")
    sweep_metrics: list[NamedMetric] = Field(description="what ranks a sweep's trials")
    trial_metrics: list[str] = Field(description="what a trial's evaluations report")
    record_kinds: list[RecordKind] = Field(description="the kinds of progress records")
    events: dict[str, str] = Field(
        description="the server-sent event each record kind is streamed as (others are not)"
    )
    defaults: dict[str, Any] = Field(
        description="the JobSpec's default of every field that has one, by dotted name "
        "(optimizer.lr): what a form starts from"
    )
    units: list[Unit] = Field(description="how a metric's values read")
    metrics: list[MetricView] = Field(
        description="the fields of the step, eval and trial records a client shows: their "
        "labels, units, charts and columns"
    )
    charts: list[ChartView] = Field(description="the charts of a job's metrics")
    columns: list[ColumnView] = Field(description="the job list's metric columns")
    starter: dict[str, Any] = Field(
        description="a value for each field a new job must give that has no default (its "
        "name, its steps): an example for a form, never applied to a spec"
    )


class ErrorBody(BaseModel):
    detail: str


class FieldProblem(BaseModel):
    field: str = Field(description="the bad field, dotted: kfac.damping, body, query.limit")
    message: str


class ValidationErrorBody(BaseModel):
    detail: str
    problems: list[FieldProblem]


class Health(BaseModel):
    status: str
    checks: dict[str, str] = Field(default_factory=dict)


def job_view(job: Job, queue_position: int | None = None) -> JobView:
    total = job.total_steps
    percent = round(100 * job.step / total, 2) if total else None
    succeeded = job.state is JobState.SUCCEEDED
    target_met = bool(
        succeeded
        and total
        and job.step < total
        and (job.spec.get("stop") or {}).get("target") is not None
        and job.spec.get("sweep") is None
    )
    if succeeded:
        percent = 100.0
    tuner = job.tuner
    return JobView(
        id=job.id,
        name=job.name,
        state=job.state,
        queue_position=queue_position,
        progress=ProgressView(step=job.step, total=total, percent=percent, target_met=target_met),
        metrics=job.latest.numbers(),
        decision=tuner.chosen if tuner else None,
        tuner=tuner,
        failure_reason=job.failure_reason,
        submission_id=job.submission_id,
        created_at=_when(job.created_at) or datetime.now(UTC),
        updated_at=_when(job.updated_at) or datetime.now(UTC),
        started_at=_when(job.started_at),
        finished_at=_when(job.finished_at),
        spec=job.spec,
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _numbers(values: Any) -> dict[str, float | int]:
    return {str(k): v for k, v in (values or {}).items() if _is_number(v)}


def _metrics(values: Any) -> dict[str, float | int | None]:
    """The trial metrics the API shows (the ``sweep`` record's also hold step and finished)."""
    found = values or {}
    return {
        name: found[name]
        for name in TRIAL_METRICS
        if name in found and (found[name] is None or _is_number(found[name]))
    }


def sweep_view(job: Job) -> SweepView | None:
    """The job's sweep as the API shows it; before its first record, the plan in its spec."""
    state = job.sweep
    if state is None:
        if job.spec.get("sweep") is None:
            return None
        state = plan(job.spec["sweep"])
    trials = [
        TrialView(
            trial_id=trial_id,
            state=trial.state,
            params=_numbers(trial.params),
            step=trial.step,
            metrics=_metrics(trial.metrics),
            value=trial.value,
            error=trial.error,
            checkpoint=trial.checkpoint,
        )
        for trial_id, trial in sorted(state.trials.items())
    ]
    best = state.best
    return SweepView(
        metric=state.metric,
        mode=state.mode,
        trials_planned=state.trials_planned,
        concurrent=state.concurrent,
        space=state.space,
        trials_ended=state.trials_ended,
        trials=trials,
        best=None
        if best is None
        else BestTrialView(
            trial_id=best.trial_id,
            params=_numbers(best.params),
            value=best.value,
            step=best.step,
            metrics=_metrics(best.metrics),
            checkpoint=best.checkpoint,
            run=best.run,
        ),
        best_spec=state.best_spec,
        best_spec_yaml=None
        if state.best_spec is None
        else yaml.safe_dump(state.best_spec, sort_keys=False),
        seconds=state.seconds,
    )


def job_detail(
    job: Job, transitions: list[Transition], queue_position: int | None = None
) -> JobDetail:
    return JobDetail(
        **job_view(job, queue_position).model_dump(),
        sweep=sweep_view(job),
        transitions=[
            TransitionView(
                from_state=t.from_state,
                to_state=t.to_state,
                event=t.event,
                reason=t.reason,
                at=_when(t.at) or datetime.now(UTC),
            )
            for t in transitions
        ],
    )


def metric_point(metric: Metric) -> MetricPoint:
    return MetricPoint(
        seq=metric.seq,
        kind=metric.kind,  # type: ignore[arg-type]  # the store holds only these (validated)
        step=metric.step,
        at=_when(metric.at) or datetime.now(UTC),
        values=metric.values,
    )
