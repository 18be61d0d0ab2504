"""The service's one adapter to Ray: Ray Jobs (submit, status, stop, logs) through Ray's
official ``JobSubmissionClient``, and the jobs' progress from the progress sink actor.

``Runner`` is the seam: the API tests put a fake behind it; ``RayRunner`` is the real thing.
Each service job runs as a Ray Job with the same command a user passes to
``ray job submit``::

    kaisa-ray train --spec-key <key> --run-name <job id> --no-progress

or, for a spec with a ``sweep`` section, ``kaisa-ray sweep`` with the same flags. The stored
JobSpec travels in the cluster's own key-value store (the GCS, under ``spec/<job id>`` in
namespace ``kaisa-ray``), not on the command line: a command line has a size limit (one
argument at most 128 KiB on Linux), a spec only the service's body limit. Each Ray Job
reserves ``driver_cpus`` CPUs for its driver (``entrypoint_num_cpus``), so Ray itself never
starts more drivers than the cluster holds.

The submission id is derived from the job id, so a submission retried after a crash finds
the first one instead of starting the job twice.
"""

from __future__ import annotations

import json
import logging
import shlex
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from service.errors import RayJobMissingError, RayUnavailableError

logger = logging.getLogger(__name__)


class RayJobStatus(StrEnum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    MISSING = "MISSING"  # Ray has no job with this submission id (a new cluster?)


@dataclass(frozen=True)
class RayJobInfo:
    status: RayJobStatus
    message: str = ""


def submission_id(job_id: str, resume: int = 0) -> str:
    """The Ray Job of a job's first life, or of its ``resume``-th after graceful restarts."""
    return f"kaisa-ray-{job_id}" + (f"-r{resume}" if resume else "")


SPEC_NAMESPACE = "kaisa-ray"


def spec_key(job_id: str) -> str:
    """Where the job's spec waits for its driver in the cluster's key-value store."""
    return f"spec/{job_id}"


def entrypoint(job_id: str, spec: dict[str, Any], storage_path: str | None) -> str:
    """The Ray Job's shell command for a stored job: ``kaisa-ray train`` on its spec, or
    ``kaisa-ray sweep`` when the spec has a ``sweep`` section (its trials and their records
    go to the progress sink under the same run name, the job id). The spec itself is read
    from the cluster (``spec_key``): the command's length does not grow with it."""
    command = "train" if spec.get("sweep") is None else "sweep"
    words = ["kaisa-ray", command, "--spec-key", spec_key(job_id)]
    words += ["--run-name", job_id, "--no-progress"]
    if storage_path:
        words += ["--storage-path", storage_path]
    return shlex.join(words)


class Runner(Protocol):
    """What the service needs from Ray."""

    def submit(self, job_id: str, spec: dict[str, Any], *, resume: int = 0) -> str:
        """Start the job as a Ray Job; returns the submission id. Idempotent per job and
        ``resume`` (its count of resumes: a resumed job is a new Ray Job of the same run,
        which Ray Train continues from its latest checkpoint)."""
        ...

    def statuses(self, submission_ids: list[str]) -> dict[str, RayJobInfo]:
        """The status of each given submission (``MISSING`` when Ray does not know it)."""
        ...

    def stop(self, submission_id: str) -> None:
        """Ask Ray to stop it; ``RayJobMissingError`` when Ray has no such Ray Job."""
        ...

    def cpus(self) -> float | None:
        """The cluster's CPUs (None: unknown), for admission control."""
        ...

    def memory(self) -> float | None:
        """The cluster's memory for tasks and actors in bytes (Ray's ``memory`` resource;
        None: unknown), for admission control."""
        ...

    def logs(self, submission_id: str) -> str: ...

    def progress(self, run: str, since: int) -> tuple[list[dict[str, Any]], int]:
        """The progress sink's records of ``run`` from ``since``; and the next ``since``."""
        ...

    def reachable(self) -> bool: ...

    def close(self) -> None: ...


def _warm_train_coordinator() -> None:
    """Create Ray Train's AutoscalingCoordinator actor now (detached, one per cluster).

    Every Ray Train run asks it for resources first, with a 5 s timeout; created by that
    first request on a busy machine, it misses the timeout and the job's log gets a harmless
    but alarming traceback. Best effort (a private Ray API, which may move): a failure is
    logged and changes nothing else."""
    import ray

    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator,
        )

        ray.get(get_or_create_autoscaling_coordinator().__ray_ready__.remote(), timeout=120)  # type: ignore[no-untyped-call]
    except Exception as err:  # best effort: jobs run without it
        logger.warning("could not create Ray Train's autoscaling coordinator ahead: %s", err)


class RayRunner:
    """``Runner`` on a real Ray cluster (this process is connected to it as a driver)."""

    def __init__(
        self,
        address: str,
        *,
        dashboard_url: str | None = None,
        storage_path: str | None = None,
        driver_cpus: float = 0.25,
    ) -> None:
        import ray
        from ray.job_submission import JobSubmissionClient

        context = ray.init(
            address=address, namespace="kaisa-ray", log_to_driver=False, include_dashboard=False
        )
        if dashboard_url is None:
            found = context.dashboard_url
            if not found:
                raise RayUnavailableError(
                    f"the Ray cluster at {address} has no dashboard, so no job server: start it "
                    "with --include-dashboard=true (needs ray[default]) or pass --dashboard-url"
                )
            dashboard_url = found if "://" in found else f"http://{found}"
        self.address = address
        self.dashboard_url = dashboard_url
        self.storage_path = storage_path
        self.driver_cpus = driver_cpus
        self._client = JobSubmissionClient(dashboard_url)
        self._sink: Any = None
        _warm_train_coordinator()

    def submit(self, job_id: str, spec: dict[str, Any], *, resume: int = 0) -> str:
        sid = submission_id(job_id, resume)
        if self._known(sid):
            return sid  # submitted before (by an earlier life of this service)
        from ray.experimental.internal_kv import _internal_kv_put

        if resume:
            # The run's records start from 0 again: what a sink that outlived the stop holds
            # of its earlier life must not be read as this one's.
            import ray

            ray.get(self._progress_sink().forget.remote(job_id), timeout=30)

        _internal_kv_put(
            spec_key(job_id),
            json.dumps(spec, separators=(",", ":")).encode(),
            overwrite=True,
            namespace=SPEC_NAMESPACE,
        )
        self._client.submit_job(
            entrypoint=entrypoint(job_id, spec, self.storage_path),
            submission_id=sid,
            metadata={"kaisa_ray_job": job_id},
            entrypoint_num_cpus=self.driver_cpus or None,
        )
        return sid

    def statuses(self, submission_ids: list[str]) -> dict[str, RayJobInfo]:
        wanted = set(submission_ids)
        found = {
            details.submission_id: RayJobInfo(
                RayJobStatus(str(details.status.value)), details.message or ""
            )
            for details in self._client.list_jobs()
            if details.submission_id in wanted
        }
        return {sid: found.get(sid, RayJobInfo(RayJobStatus.MISSING)) for sid in submission_ids}

    def _known(self, submission_id: str) -> bool:
        """Whether Ray's job server has this Ray Job. Read from its list: for a job it does
        not have, Ray's client raises a bare ``RuntimeError`` with only a message to tell it
        from any other failure."""
        return any(d.submission_id == submission_id for d in self._client.list_jobs())

    def stop(self, submission_id: str) -> None:
        if not self._known(submission_id):
            raise RayJobMissingError(f"Ray has no Ray Job {submission_id}")
        self._client.stop_job(submission_id)

    def cpus(self) -> float | None:
        import ray

        found = ray.cluster_resources().get("CPU")  # type: ignore[no-untyped-call]
        return float(found) if found is not None else None

    def memory(self) -> float | None:
        import ray

        found = ray.cluster_resources().get("memory")  # type: ignore[no-untyped-call]
        return float(found) if found is not None else None

    def logs(self, submission_id: str) -> str:
        return str(self._client.get_job_logs(submission_id))

    def progress(self, run: str, since: int) -> tuple[list[dict[str, Any]], int]:
        import ray

        page: dict[str, Any] = ray.get(self._progress_sink().read.remote(run, since), timeout=30)
        return list(page["records"]), int(page["next"])

    def _progress_sink(self) -> Any:
        from kaisa_train.progress import progress_sink

        if self._sink is None:
            self._sink = progress_sink()
        return self._sink

    def reachable(self) -> bool:
        try:
            self._client.list_jobs()
        except Exception:  # any failure to reach the job server means "not ready"
            return False
        return True

    def close(self) -> None:
        import ray

        ray.shutdown()
