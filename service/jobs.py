"""The service's jobs: the store, the live updates and Ray, behind one object.

Every change of a job's state goes through ``Jobs.apply`` (which uses the store's transition
and publishes the new state to the event streams). ``Follower`` is the background thread that
submits queued jobs to Ray, reads their progress, and moves them by what Ray and the progress
sink say; what it reads is turned into events by ``interpret`` and ``ray_outcome``, pure
functions tested on their own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from service.errors import JobConflictError
from service.hub import Hub, Update
from service.lifecycle import FINISHED, IllegalTransitionError, JobEvent, JobState, transition
from service.runner import RayJobInfo, RayJobStatus, Runner
from service.store import Job, JobStore, Metric, Progress
from service.sweeps import SWEEP_KINDS, finite
from service.sweeps import ended as trials_ended
from service.sweeps import merge as merge_sweep

logger = logging.getLogger(__name__)

STEP_FIELDS = ("loss", "accuracy", "lr", "samples_per_s", "ms_per_step", "kfac_ms_per_step")
EVAL_FIELDS = ("test_loss", "test_accuracy")


class Jobs:
    def __init__(self, store: JobStore, runner: Runner, hub: Hub) -> None:
        self.store, self.runner, self.hub = store, runner, hub
        self.submitted = 0  # POSTs that created a job, since start (for /metrics)

    def create(
        self, spec: Mapping[str, Any], idempotency_key: str | None = None
    ) -> tuple[Job, bool]:
        job, created = self.store.create(spec, idempotency_key=idempotency_key)
        if created:
            self.submitted += 1
            self.publish_state(job)
        return job, created

    def apply(self, job_id: str, event: JobEvent, reason: str | None = None) -> Job:
        job = self.store.apply(job_id, event, reason)
        self.publish_state(job)
        return job

    def cancel(self, job_id: str) -> Job:
        """Ask for a job to stop: CANCELLING now, CANCELLED once Ray has stopped it.
        Idempotent for a job already cancelling or cancelled; a conflict for one that
        finished otherwise."""
        job = self.store.get(job_id)
        if job.state in (JobState.CANCELLING, JobState.CANCELLED):
            return job
        if job.state in FINISHED:
            raise JobConflictError(
                f"job {job_id} already finished as {job.state}; nothing to cancel"
            )
        return self.apply(job_id, JobEvent.CANCEL, "cancelled by a user")

    def delete(self, job_id: str) -> None:
        self.store.delete(job_id)
        self.hub.publish(Update(job_id, "deleted", {"id": job_id}))

    def publish_state(self, job: Job) -> None:
        self.hub.publish(Update(job.id, "state", {"id": job.id, "state": job.state.value}))


@dataclass
class Reading:
    """What a batch of progress records means for a job."""

    events: list[JobEvent] = field(default_factory=list)
    progress: Progress = field(default_factory=lambda: Progress(cursor=0))
    updates: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


def interpret(job: Job, records: list[dict[str, Any]], cursor: int) -> Reading:
    """The events and progress in a job's new progress-sink records (pure).

    ``profiling`` (the tuner started) → PROFILE; ``start`` (a worker group begins training)
    → RUN; a ``worker`` record of rank 0 after the first worker group → RECOVER (Ray Train
    restarted the group). Events that do not apply in the state reached are skipped (a
    ``start`` while RUNNING changes nothing).

    A sweep job's records (``service.sweeps``): ``sweep-start`` → RUN, with the trials
    planned as its total; each ``trial`` record and the final ``sweep`` record merge into
    the job's sweep view (the one stored, ``job.sweep``: records come in batches), and its
    step is the number of trials that are over.
    """
    reading = Reading(progress=Progress(cursor=cursor))
    state, attempts = job.state, job.attempts
    progress = reading.progress
    sweep = job.sweep

    def fire(event: JobEvent) -> None:
        nonlocal state
        try:
            state = transition(state, event)
        except IllegalTransitionError:
            return
        reading.events.append(event)

    for record in records:
        kind = record.get("kind")
        values = {k: v for k, v in record.items() if k not in ("kind", "seq", "time")}
        at = float(record.get("time", time.time()))
        seq = int(record.get("seq", 0))
        if kind == "worker" and record.get("rank") == 0:
            attempts += 1
            progress.attempts = attempts
            if attempts > 1:
                fire(JobEvent.RECOVER)
        elif kind == "profiling":
            fire(JobEvent.PROFILE)
        elif kind == "start":
            fire(JobEvent.RUN)
            if record.get("total_steps") is not None:
                progress.total_steps = int(record["total_steps"])
        elif kind == "tuner":
            progress.tuner = values
            reading.updates.append(("tuner", values))
        elif kind in ("step", "eval"):
            step = int(record["step"]) if record.get("step") is not None else None
            progress.metrics.append(Metric(seq=seq, kind=kind, step=step, at=at, values=values))
            names = STEP_FIELDS if kind == "step" else EVAL_FIELDS
            progress.latest.update({k: values[k] for k in names if k in values})
            if step is not None:
                progress.step = max(progress.step or 0, step)
                progress.latest["step"] = progress.step
            reading.updates.append(
                ("progress" if kind == "step" else "eval", {**values, "time": at})
            )
        elif kind == "checkpoint":
            progress.latest["checkpoint_step"] = record.get("step")
        elif kind in SWEEP_KINDS:
            record, values = finite(record), finite(values)
            sweep = merge_sweep(sweep, record, spec=job.spec)
            progress.sweep = sweep
            progress.step = trials_ended(sweep)
            if kind == "sweep-start":
                fire(JobEvent.RUN)
                if sweep.get("trials_planned") is not None:
                    progress.total_steps = int(sweep["trials_planned"])
            else:
                reading.updates.append((str(kind), {**values, "time": at}))
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
        return JobEvent.FAIL, (
            "Ray has no record of this job's Ray Job (was the cluster restarted?); "
            "submit the job again"
        )
    message = info.message.strip() or "the Ray Job failed without a message; see its logs"
    return JobEvent.FAIL, f"the Ray Job failed: {message[-4000:]}"


class Follower(threading.Thread):
    """Submits queued jobs, follows running ones to the end, stops cancelled ones.

    One pass (``tick``) every ``interval_s``; a pass that fails is logged and retried, and
    a failure that concerns one job (its submission) lands on that job as FAILED. Progress
    is read on every pass (it drives the event streams); Ray's job statuses, a request to
    Ray's dashboard, at most every ``status_interval_s``.
    """

    def __init__(
        self,
        jobs: Jobs,
        *,
        interval_s: float = 0.25,
        status_interval_s: float = 1.0,
        submit_tries: int = 3,
    ) -> None:
        super().__init__(name="kaisa-ray-follower", daemon=True)
        self.jobs = jobs
        self.interval_s = interval_s
        self.status_interval_s = status_interval_s
        self._status_read_at = -float("inf")
        self._active_jobs: list[Job] = []
        self._active_version = -1
        self.submit_tries = submit_tries
        self._stop_event = threading.Event()
        self._stopped: set[str] = set()  # submissions this process asked Ray to stop
        self._submit_failures: dict[str, int] = {}
        self.passes = 0

    def stop(self, timeout: float = 10) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout)

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                self.tick()
            except Exception:
                logger.exception("follower pass failed; retrying")
            self.passes += 1
            self._stop_event.wait(self.interval_s)

    def _active(self) -> list[Job]:
        """``store.active()``, read again only after a write to the store (most passes
        find nothing new: the query would hold the GIL the requests need)."""
        version = self.jobs.store.version_now()
        if version != self._active_version:
            self._active_jobs = self.jobs.store.active()
            self._active_version = version
        return self._active_jobs

    def tick(self) -> None:
        runner = self.jobs.runner
        for job in self._active():
            if job.submission_id is None:
                self._start(job)
        active = self._active()
        submitted = [j for j in active if j.submission_id is not None]
        for job in submitted:
            sid = job.submission_id or ""
            if job.state is JobState.CANCELLING and sid not in self._stopped:
                runner.stop(sid)
                self._stopped.add(sid)
        if not submitted:
            return
        statuses: dict[str, RayJobInfo] = {}
        now = time.monotonic()
        if now - self._status_read_at >= self.status_interval_s:
            statuses = runner.statuses([j.submission_id for j in submitted if j.submission_id])
            self._status_read_at = now
        for job in submitted:
            sid = job.submission_id or ""
            job = self._read_progress(job)
            if sid not in statuses:
                continue
            outcome = ray_outcome(job.state, statuses[sid])
            if outcome is not None:
                event, reason = outcome
                self._apply(job, event, reason)

    def _start(self, job: Job) -> None:
        job = self.jobs.store.get(job.id)  # fresh: a cancel may have come since the pass began
        if job.state is JobState.CANCELLING:  # cancelled before it reached Ray
            self._apply(job, JobEvent.CANCELLED, None)
            return
        try:
            sid = self.jobs.runner.submit(job.id, job.spec)
        except Exception as err:
            tries = self._submit_failures.get(job.id, 0) + 1
            self._submit_failures[job.id] = tries
            logger.warning("submitting job %s failed (try %d): %s", job.id, tries, err)
            if tries >= self.submit_tries:
                self._apply(job, JobEvent.FAIL, f"could not submit the job to Ray: {err}")
            return
        self._submit_failures.pop(job.id, None)
        self.jobs.store.set_submission(job.id, sid)

    def _read_progress(self, job: Job) -> Job:
        records, cursor = self.jobs.runner.progress(job.id, job.cursor)
        if not records and cursor == job.cursor:
            return job
        reading = interpret(job, records, cursor)
        job = self.jobs.store.add_progress(job.id, reading.progress)
        for kind, data in reading.updates:
            self.jobs.hub.publish(Update(job.id, kind, data))
        if reading.events:
            self.jobs.publish_state(job)
        return job

    def _apply(self, job: Job, event: JobEvent, reason: str | None) -> Job:
        try:
            return self.jobs.apply(job.id, event, reason)
        except IllegalTransitionError as err:  # the state moved on under us (a cancel): re-read
            logger.info("job %s: %s", job.id, err)
            return self.jobs.store.get(job.id)
