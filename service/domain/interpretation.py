"""What a job's progress records and its Ray Job's status mean for the job: pure functions
(``interpret``, ``ray_outcome``), tested on their own, that ``follower.RayJobFollower`` applies; and
the event each record kind is streamed as.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kaisa_train.records import (
    CheckpointRecord,
    EvalRecord,
    IntervalsRecord,
    LatestMetrics,
    ProfilingRecord,
    RecordKind,
    StartRecord,
    StepRecord,
    SweepRecord,
    SweepStartRecord,
    TrialRecord,
    TunerRecord,
    WorkerRecord,
    try_record,
)
from service.domain.sweeps import ended as trials_ended
from service.domain.sweeps import finite
from service.domain.sweeps import merge as merge_sweep
from service.model.cleaning import clean
from service.model.job_data import Job, Metric, Progress
from service.model.lifecycle import IllegalTransitionError, JobEvent, JobState, transition
from service.runner import RayJobInfo, RayJobStatus

EVENT_OF = {
    RecordKind.STEP: "progress",
    RecordKind.EVAL: "eval",
    RecordKind.TUNER: "tuner",
    RecordKind.INTERVALS: "intervals",
    RecordKind.TRIAL: "trial",
    RecordKind.SWEEP: "sweep",
}
"""The event a record is sent as on the event streams (its data: the record)."""


@dataclass
class Reading:
    """What a batch of progress records means for a job."""

    events: list[JobEvent] = field(default_factory=list)
    progress: Progress = field(default_factory=lambda: Progress(cursor=0))
    updates: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # what ``cleaning.clean`` changed


def interpret(job: Job, records: list[dict[str, Any]], cursor: int) -> Reading:
    """The events and progress in a job's new progress-sink records (pure).

    ``profiling`` (the tuner started) → PROFILE; ``start`` (a worker group begins training)
    → RUN; a ``worker`` record of rank 0 after the first worker group → RECOVER (Ray Train
    restarted the group). Events that do not apply in the state reached are skipped (a
    ``start`` while RUNNING changes nothing).

    A sweep job's records (``service.domain.sweeps``): ``sweep-start`` → RUN, with the trials
    planned as its total; each ``trial`` record and the final ``sweep`` record merge into
    the job's sweep state (the one stored, ``job.sweep``: records come in batches), and its
    step is the number of trials that are over.
    """
    reading = Reading(progress=Progress(cursor=cursor))
    state, attempts = job.state, job.attempts
    progress = reading.progress
    sweep = job.sweep
    latest = LatestMetrics()  # what this batch sets

    def fire(event: JobEvent) -> None:
        nonlocal state
        try:
            state = transition(state, event)
        except IllegalTransitionError:
            return
        reading.events.append(event)

    for raw in records:
        cleaned = clean(raw)
        reading.problems += cleaned.problems
        if cleaned.record is None:
            continue
        record, problem = try_record(cleaned.record)
        if record is None:
            reading.problems.append(str(problem))
            continue
        values = finite(record.values())
        at = record.time if record.time is not None else time.time()
        # What the event streams send: the record, with its kind and when the sink took it.
        data = {"kind": record.kind.value, **values, "time": at}
        if isinstance(record, WorkerRecord):
            if record.rank == 0:
                attempts += 1
                progress.attempts = attempts
                if attempts > 1:
                    fire(JobEvent.RECOVER)
        elif isinstance(record, ProfilingRecord):
            fire(JobEvent.PROFILE)
        elif isinstance(record, StartRecord):
            fire(JobEvent.RUN)
            if record.total_steps is not None:
                progress.total_steps = record.total_steps
            # A worker group starts at its checkpoint's step: what earlier attempts recorded
            # past it is training done again (no step twice in the history, no gap).
            progress.restarts.append((record.from_step, job.seq_base + (record.seq or 0)))
            progress.metrics = [
                m for m in progress.metrics if m.step is None or m.step <= record.from_step
            ]
        elif isinstance(record, TunerRecord):
            progress.tuner = record
            reading.updates.append((EVENT_OF[record.kind], data))
        elif isinstance(record, StepRecord | EvalRecord):
            metric = Metric(
                seq=job.seq_base + (record.seq or 0),
                kind=record.kind.value,
                step=record.step,
                at=at,
                values=values,
            )
            progress.metrics.append(metric)
            data["seq"] = metric.seq  # the page knows by it which streamed points it has read
            progress.step = max(progress.step or 0, record.step)
            latest = latest.taking(record).model_copy(update={"step": progress.step})
            progress.latest = latest
            reading.updates.append((EVENT_OF[record.kind], data))
        elif isinstance(record, IntervalsRecord):
            # Each layer's K-FAC intervals over time: kept as metrics, read back by kind.
            progress.metrics.append(
                Metric(
                    seq=job.seq_base + (record.seq or 0),
                    kind=record.kind.value,
                    step=record.step,
                    at=at,
                    values=values,
                )
            )
            reading.updates.append((EVENT_OF[record.kind], data))
        elif isinstance(record, CheckpointRecord):
            latest = latest.model_copy(update={"checkpoint_step": record.step})
            progress.latest = latest
        elif isinstance(record, SweepStartRecord | TrialRecord | SweepRecord):
            sweep = merge_sweep(sweep, record, spec=job.spec)
            progress.sweep = sweep
            progress.step = trials_ended(sweep)
            if isinstance(record, SweepStartRecord):
                fire(JobEvent.RUN)
                planned = sweep.trials_planned
                if planned is not None and 0 <= planned <= 2**53:
                    progress.total_steps = planned
            else:
                reading.updates.append((EVENT_OF[record.kind], data))
    progress.events = list(reading.events)  # stored with the records, in one transaction
    return reading


def ray_outcome(state: JobState, info: RayJobInfo) -> tuple[JobEvent, str | None] | None:
    """The event a Ray Job's status means for a job in ``state`` (pure); None: nothing yet."""
    status = info.status
    if status in (RayJobStatus.PENDING, RayJobStatus.RUNNING):
        return None
    if status is RayJobStatus.SUCCEEDED:
        return JobEvent.SUCCEED, None
    if status is RayJobStatus.STOPPED:
        if state is JobState.CANCELLING:
            return JobEvent.CANCELLED, None
        return JobEvent.FAIL, "the Ray Job was stopped outside the service (ray job stop?)"
    if status is RayJobStatus.MISSING:
        if state is JobState.CANCELLING:  # nothing left to stop
            return JobEvent.CANCELLED, None
        return JobEvent.FAIL, (
            "Ray has no record of this job's Ray Job (was the cluster restarted?); "
            "submit the job again"
        )
    message = info.message.strip() or "the Ray Job failed without a message; see its logs"
    return JobEvent.FAIL, f"the Ray Job failed: {message[-4000:]}"
