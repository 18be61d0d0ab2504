"""``RayJobFollower``: the background thread that submits queued jobs to Ray as admission control
allows, reads their progress, and moves them by what Ray and the progress sink say (through
``interpretation``), containing every error to its job.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from service.domain.admission import Capacity, admit
from service.domain.hub import Update
from service.domain.interpretation import interpret, ray_outcome
from service.domain.jobs import Jobs
from service.errors import RayJobMissingError
from service.model.job_data import Job
from service.model.lifecycle import IllegalTransitionError, JobEvent, JobState
from service.runner import RayJobInfo, RayJobStatus

logger = logging.getLogger(__name__)


@dataclass
class _Trouble:
    """A repeated error of one job (or of Ray, ``job_id`` None) in one step of the pass."""

    message: str
    count: int = 1
    since: float = field(default_factory=time.monotonic)


class RayJobFollower(threading.Thread):
    """Submits queued jobs as admission control allows, follows running ones to the end,
    stops cancelled ones.

    One pass (``tick``) every ``interval_s``. Errors are contained per job: a bad record, a
    Ray error, a Ray Job that is gone, a database error on one job never delays the others.
    A repeated error is logged once, when it starts, and once more with its count when it
    ends (or the job does). A job whose progress cannot be stored for ``store_tries`` passes
    in a row is FAILED with the reason; a cancelled job whose Ray Job is gone is CANCELLED;
    an active one whose Ray Job has been missing from Ray for ``lost_grace_s`` is FAILED,
    naming the lost cluster. Progress is read on every pass (it drives the event streams);
    Ray's job statuses, a request to Ray's dashboard, at most every ``status_interval_s``.
    """

    def __init__(
        self,
        jobs: Jobs,
        *,
        interval_s: float = 0.25,
        status_interval_s: float = 1.0,
        submit_tries: int = 3,
        store_tries: int = 20,
        max_running: int | None = None,
        driver_cpus: float = 0.25,
        lost_grace_s: float = 30,
    ) -> None:
        super().__init__(name="kaisa-ray-follower", daemon=True)
        self.jobs = jobs
        self.interval_s = interval_s
        self.status_interval_s = status_interval_s
        self.max_running = max_running
        self.driver_cpus = driver_cpus
        self.lost_grace_s = lost_grace_s
        self._status_read_at = -float("inf")
        self._active_jobs: list[Job] = []
        self._active_version = -1
        self.submit_tries = submit_tries
        self.store_tries = store_tries
        self._stop_event = threading.Event()
        self._stopped: set[str] = set()  # submissions this process asked Ray to stop
        self._submit_failures: dict[str, int] = {}
        self._missing_since: dict[str, float] = {}  # job id -> first seen missing from Ray
        self._troubles: dict[tuple[str | None, str], _Trouble] = {}
        self._capacity: Capacity | None = None
        self.passes = 0

    def stop(self, timeout: float = 10) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout)

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                self.tick()
            except Exception:  # what no job's guard caught (reading the store itself)
                self._trouble(None, "pass", "follower pass failed; retrying", exc_info=True)
            else:
                self._resolved(None, "pass")
            self.passes += 1
            self._stop_event.wait(self.interval_s)

    # -- errors, contained and logged once -------------------------------------------------

    def _trouble(self, job_id: str | None, step: str, message: str, exc_info: bool = False) -> int:
        key = (job_id, step)
        found = self._troubles.get(key)
        if found is None:
            self._troubles[key] = _Trouble(message)
            who = f"job {job_id}" if job_id else "follower"
            logger.warning("%s: %s: %s", who, step, message, exc_info=exc_info)
            return 1
        found.count += 1
        found.message = message
        return found.count

    def _resolved(self, job_id: str | None, step: str) -> None:
        found = self._troubles.pop((job_id, step), None)
        if found is not None and found.count > 1:
            who = f"job {job_id}" if job_id else "follower"
            logger.warning(
                "%s: %s: the error repeated %d times over %.1f s (last: %s); it has stopped",
                who,
                step,
                found.count,
                time.monotonic() - found.since,
                found.message,
            )

    def _forget(self, job_id: str) -> None:
        """The job is no longer followed: close its open troubles (logging their counts)."""
        for key in [k for k in self._troubles if k[0] == job_id]:
            self._resolved(*key)
        self._missing_since.pop(job_id, None)

    def _guard(self, job: Job, step: str, action: Callable[[], Job | None]) -> Job | None:
        """Run one job's ``action``; an exception is this job's trouble, not the pass's."""
        try:
            result = action()
        except Exception as err:
            self._trouble(job.id, step, f"{type(err).__name__}: {err}")
            return None
        self._resolved(job.id, step)
        return result

    # -- the pass ------------------------------------------------------------------------

    def _active(self) -> list[Job]:
        """``store.following()``: the jobs in Ray and the head of the queue (as many as
        admission could take), read again only after a write to the store (most passes find
        nothing new: the query would hold the GIL the requests need)."""
        version = self.jobs.store.version_now()
        if version != self._active_version:
            self._active_jobs = self.jobs.store.following(queued=self.capacity().limit)
            self._active_version = version
        return self._active_jobs

    def capacity(self) -> Capacity:
        """Admission's limits (the cluster's CPUs are read once, when first needed)."""
        if self._capacity is None:
            try:
                cpus, memory = self.jobs.runner.cpus(), self.jobs.runner.memory()
            except Exception as err:
                self._trouble(None, "capacity", f"cannot read the cluster's resources: {err}")
                return Capacity(cpus=None, max_running=self.max_running or 1)
            self._capacity = Capacity(
                cpus=cpus,
                memory_bytes=memory,
                max_running=self.max_running,
                driver_cpus=self.driver_cpus,
            )
            logger.info(
                "admission: at most %d job(s) in Ray at once (cluster CPUs: %s, memory: %s "
                "bytes; each job's driver reserves %g CPU)",
                self._capacity.limit,
                cpus,
                memory,
                self.driver_cpus,
            )
        return self._capacity

    def tick(self) -> None:
        runner = self.jobs.runner
        active = self._active()
        waiting = [j for j in active if j.submission_id is None]
        if waiting:
            in_ray = [j for j in active if j.submission_id is not None]
            cancelled = [j for j in waiting if j.state is JobState.CANCELLING]
            queue = [j for j in waiting if j.state is JobState.QUEUED]
            for job in [*cancelled, *admit(queue, in_ray, self.capacity())]:
                self._guard(job, "submit", functools.partial(self._start, job))
        active = self._active()
        submitted = [j for j in active if j.submission_id is not None]
        for job in submitted:
            sid = job.submission_id or ""
            if job.state is JobState.CANCELLING and sid not in self._stopped:
                self._guard(job, "stop", functools.partial(self._stop_ray_job, job))
        if not submitted:
            return
        statuses: dict[str, RayJobInfo] = {}
        now = time.monotonic()
        if now - self._status_read_at >= self.status_interval_s:
            self._status_read_at = now
            try:
                statuses = runner.statuses([j.submission_id for j in submitted if j.submission_id])
            except Exception as err:
                self._trouble(None, "status", f"cannot read the Ray Jobs' status: {err}")
            else:
                self._resolved(None, "status")
        for job in submitted:
            self._guard(job, "follow", functools.partial(self._follow, job, statuses))

    def _follow(self, job: Job, statuses: dict[str, RayJobInfo]) -> Job:
        sid = job.submission_id or ""
        job = self.read_progress(job)
        info = statuses.get(sid)
        if info is None:
            return job
        if info.status is RayJobStatus.MISSING and job.state is not JobState.CANCELLING:
            first = self._missing_since.setdefault(job.id, time.monotonic())
            missing_s = time.monotonic() - first
            if missing_s < self.lost_grace_s:
                return job
            where = getattr(self.jobs.runner, "address", None) or "the service's cluster"
            return self._apply(
                job,
                JobEvent.FAIL,
                f"lost with its cluster: the Ray cluster at {where} has had no record of its "
                f"Ray Job {sid} for {missing_s:.0f} s (the cluster or its head was restarted?); "
                "submit the job again",
            )
        self._missing_since.pop(job.id, None)
        outcome = ray_outcome(job.state, info)
        if outcome is None:
            return job
        event, reason = outcome
        return self._apply(job, event, reason)

    def _stop_ray_job(self, job: Job) -> Job:
        sid = job.submission_id or ""
        try:
            self.jobs.runner.stop(sid)
        except RayJobMissingError:  # gone with its cluster: nothing is left to stop
            self._stopped.add(sid)
            return self._apply(job, JobEvent.CANCELLED, None)
        self._stopped.add(sid)
        return job

    def _start(self, job: Job) -> Job:
        job = self.jobs.store.get(job.id)  # fresh: a cancel may have come since the pass began
        if job.state is JobState.CANCELLING:  # cancelled before it reached Ray
            return self._apply(job, JobEvent.CANCELLED, None)
        if job.state is not JobState.QUEUED or job.submission_id is not None:
            return job
        try:
            sid = self.jobs.runner.submit(job.id, job.spec, resume=job.resumes)
        except Exception as err:
            tries = self._submit_failures.get(job.id, 0) + 1
            self._submit_failures[job.id] = tries
            if tries >= self.submit_tries:
                self._submit_failures.pop(job.id, None)
                return self._apply(job, JobEvent.FAIL, f"could not submit the job to Ray: {err}")
            raise
        self._submit_failures.pop(job.id, None)
        job = self.jobs.store.set_submission(job.id, sid)
        self.jobs.publish_state(job)  # its queue position is gone, the others' moved
        return job

    def read_progress(self, job: Job) -> Job:
        """Read and store the job's new progress records (and the state changes they mean)."""
        records, cursor = self.jobs.runner.progress(job.id, job.cursor)
        if not records and cursor == job.cursor:
            return job
        reading = interpret(job, records, cursor)
        if reading.problems:  # logged once per job, with the count at its end
            self._trouble(job.id, "records", f"cleaned: {'; '.join(reading.problems)}")
        try:
            stored = self.jobs.store.add_progress(job.id, reading.progress)
        except Exception as err:
            count = self._trouble(job.id, "store", f"{type(err).__name__}: {err}")
            if count >= self.store_tries:
                return self._apply(
                    job,
                    JobEvent.FAIL,
                    f"the service could not store this job's progress ({count} tries): {err}",
                )
            return job
        self._resolved(job.id, "store")
        for kind, data in reading.updates:
            self.jobs.hub.publish(Update(stored.id, kind, data))
        if reading.events:
            self.jobs.publish_state(stored)
        return stored

    def _apply(self, job: Job, event: JobEvent, reason: str | None) -> Job:
        try:
            moved = self.jobs.apply(job.id, event, reason)
        except IllegalTransitionError as err:  # the state moved on under us (a cancel): re-read
            logger.info("job %s: %s", job.id, err)
            return self.jobs.store.get(job.id)
        if moved.state.finished:
            self._forget(job.id)
            self.jobs.keep_logs(moved)
        return moved
