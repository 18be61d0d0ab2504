"""The REST API's response bodies (request bodies are the ``JobSpec`` itself)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from service.lifecycle import JobState
from service.store import Job, Metric, Transition


def _when(seconds: float | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, UTC)


class ProgressView(BaseModel):
    step: int = Field(description="the last step the workers reported")
    total: int | None = Field(description="the job's steps in all, once training started")
    percent: float | None


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
    progress: ProgressView
    metrics: dict[str, float | int | None] = Field(
        description="the latest step and evaluation metrics (loss, accuracy, samples_per_s, "
        "ms_per_step, test_loss, test_accuracy, ...)"
    )
    decision: dict[str, Any] | None = Field(
        description="kfac: auto: what the tuner chose (strategy and intervals)"
    )
    tuner: dict[str, Any] | None = Field(
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


class JobDetail(JobView):
    transitions: list[TransitionView]


class JobList(BaseModel):
    jobs: list[JobView]
    total: int
    limit: int
    offset: int
    next_offset: int | None


class MetricPoint(BaseModel):
    seq: int
    kind: Literal["step", "eval"]
    step: int | None
    at: datetime
    values: dict[str, Any]


class MetricHistory(BaseModel):
    job_id: str
    points: list[MetricPoint]
    next_since: int = Field(description="pass as since to read only newer points")


class Registry(BaseModel):
    models: list[str] = Field(description="what a JobSpec's model.name may be")
    datasets: list[str] = Field(description="what a JobSpec's dataset.name may be")


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


def job_view(job: Job) -> JobView:
    total = job.total_steps
    percent = round(100 * job.step / total, 2) if total else None
    tuner = job.tuner
    return JobView(
        id=job.id,
        name=job.name,
        state=job.state,
        progress=ProgressView(step=job.step, total=total, percent=percent),
        metrics={k: v for k, v in job.latest.items() if isinstance(v, int | float) or v is None},
        decision=tuner.get("chosen") if tuner else None,
        tuner=tuner,
        failure_reason=job.failure_reason,
        submission_id=job.submission_id,
        created_at=_when(job.created_at) or datetime.now(UTC),
        updated_at=_when(job.updated_at) or datetime.now(UTC),
        started_at=_when(job.started_at),
        finished_at=_when(job.finished_at),
        spec=job.spec,
    )


def job_detail(job: Job, transitions: list[Transition]) -> JobDetail:
    return JobDetail(
        **job_view(job).model_dump(),
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
