"""What the job store holds and hands out: ``Job`` (an immutable snapshot of a job),
``Transition`` (one change of its state), ``Metric`` (one point of its history) and
``Progress`` (what one batch of progress records changes), plain dataclasses with no tie to
the database.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kaisa_train.records import LatestMetrics, TunerRecord
from service.model.lifecycle import JobEvent, JobState
from service.model.sweep_state import SweepState


@dataclass(frozen=True)
class Job:
    """A job as stored (an immutable snapshot)."""

    id: str
    name: str
    state: JobState
    spec: dict[str, Any]
    idempotency_key: str | None
    submission_id: str | None
    created_at: float
    updated_at: float
    started_at: float | None
    finished_at: float | None
    failure_reason: str | None
    step: int
    total_steps: int | None
    latest: LatestMetrics
    tuner: TunerRecord | None  # kfac: auto's decision
    sweep: SweepState | None  # a sweep job's plan, trials and best
    cursor: int
    attempts: int
    resumes: int = 0  # graceful restarts it was resumed after
    seq_base: int = 0  # what its records' numbers in this life start at
    resources: dict[str, Any] | None = None  # what admission counts (service.domain.admission)


@dataclass(frozen=True)
class Transition:
    job_id: str
    from_state: JobState | None  # None for the first, "submit"
    to_state: JobState
    event: str  # a JobEvent's value, or "submit"
    reason: str | None
    at: float


@dataclass(frozen=True)
class Metric:
    seq: int
    kind: str
    step: int | None
    at: float
    values: dict[str, Any]


@dataclass
class Progress:
    """What one batch of progress records changes on a job (see ``JobStore.add_progress``)."""

    cursor: int
    metrics: list[Metric] = field(default_factory=list)
    step: int | None = None
    total_steps: int | None = None
    latest: LatestMetrics | None = None  # merged into the stored metrics
    tuner: TunerRecord | None = None
    sweep: SweepState | None = None  # the whole sweep state, merged (replaces the stored one)
    attempts: int | None = None
    events: list[JobEvent] = field(default_factory=list)  # state changes, in order
    # Worker groups that started from a checkpoint at step ``from_step``, the start record
    # numbered ``seq``: the records of earlier attempts past that step were of training it
    # does again, and are dropped (the history goes on from the checkpoint, no step twice).
    restarts: list[tuple[int, int]] = field(default_factory=list)  # (from_step, seq)
