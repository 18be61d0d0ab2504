"""The service's jobs: the store, the live updates and Ray, behind one object.

Every change of a job's state goes through ``Jobs.apply`` (which uses the store's transition
and publishes the new state to the event streams). What moves jobs along in the background is
``follower.RayJobFollower``; what their records mean, ``interpretation``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from service.domain.hub import Hub, Update
from service.domain.job_logs import LogArchive
from service.model.job_data import Job
from service.model.lifecycle import JobEvent
from service.runner import Runner
from service.store.repository import JobStore

logger = logging.getLogger(__name__)


class Jobs:
    def __init__(
        self,
        store: JobStore,
        runner: Runner,
        hub: Hub,
        *,
        idempotency_ttl_s: float = 86400,
        logs: LogArchive | None = None,
    ) -> None:
        self.store, self.runner, self.hub = store, runner, hub
        self.idempotency_ttl_s = idempotency_ttl_s
        self.logs = logs
        self.submitted = 0  # POSTs that created a job, since start (for /metrics)

    def create(
        self,
        spec: Mapping[str, Any],
        idempotency_key: str | None = None,
        resources: Mapping[str, Any] | None = None,
    ) -> tuple[Job, bool]:
        job, created = self.store.create(
            spec,
            idempotency_key=idempotency_key,
            idempotency_ttl_s=self.idempotency_ttl_s,
            resources=resources,
        )
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
        before = self.store.get(job_id)
        job = self.store.cancel(job_id)  # checked and applied in one transaction
        if job.state is not before.state:
            self.publish_state(job)
        return job

    def delete(self, job_id: str) -> None:
        self.store.delete(job_id)
        if self.logs is not None:
            self.logs.delete(job_id)
        self.hub.publish(Update(job_id, "deleted", {"id": job_id}))

    def keep_logs(self, job: Job) -> None:
        """Copy the log of the job's Ray Job (the life that just ended) from Ray to the
        service's own copy (``service.domain.job_logs``), which outlives Ray's. A log Ray cannot
        give now is left to Ray: ``/logs`` asks it again."""
        if self.logs is None or job.submission_id is None:
            return
        try:
            text = self.runner.logs(job.submission_id)
        except Exception as err:
            logger.warning("job %s: could not copy its log from Ray: %s", job.id, err)
            return
        try:
            self.logs.keep(job.id, job.submission_id, text)
        except OSError as err:
            logger.warning("job %s: could not keep its log: %s", job.id, err)

    def publish_state(self, job: Job) -> None:
        self.hub.publish(Update(job.id, "state", {"id": job.id, "state": job.state.value}))
