"""A fake ``Runner`` for the API tests (the seam between the service and Ray): the test
scripts what Ray and the progress sink say."""

from __future__ import annotations

import threading
import time
from typing import Any

from service.errors import RayJobMissingError
from service.runner import RayJobInfo, RayJobStatus, entrypoint, submission_id


class FakeRunner:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.submitted: dict[str, dict[str, Any]] = {}  # submission id -> spec
        self.entrypoints: dict[str, str] = {}  # submission id -> what RayRunner would run
        self.status: dict[str, RayJobInfo] = {}
        self.records: dict[str, list[dict[str, Any]]] = {}
        self.stopped: list[str] = []
        self.fail_submit: Exception | None = None
        self.fail_logs: Exception | None = None  # raised by logs()
        self.stop_takes_effect = True  # False: stop() is recorded, the Ray Job runs on
        self.up = True
        self.cluster_cpus: float | None = None  # None: admission counts jobs only
        self.cluster_memory: float | None = None  # None: admission does not count memory
        self.fail_progress: dict[str, Exception] = {}  # job id -> raised by progress()
        self.address = "fake-cluster:6379"
        self.latest: dict[str, str] = {}  # job id -> its last submission id (a resume's)
        self.answer_after_s = 0.0  # progress(), logs() and close() answer this late (a busy Ray)
        self.closed = False  # close() was called (the service's stop closes its Ray client)

    # -- what the test does ----------------------------------------------------------------

    def push(self, job_id: str, *records: dict[str, Any]) -> None:
        with self.lock:
            log = self.records.setdefault(job_id, [])
            for record in records:
                log.append({"time": 1.8e9, **record, "seq": len(log)})

    def sid(self, job_id: str) -> str:
        """The job's Ray Job here: of its first life, or of its latest resume."""
        return self.latest.get(job_id, submission_id(job_id))

    def finish(self, job_id: str, status: RayJobStatus, message: str = "") -> None:
        with self.lock:
            self.status[self.sid(job_id)] = RayJobInfo(status, message)

    # -- Runner ----------------------------------------------------------------------------

    def submit(self, job_id: str, spec: dict[str, Any], *, resume: int = 0) -> str:
        if self.fail_submit is not None:
            raise self.fail_submit
        sid = submission_id(job_id, resume)
        if resume:  # the run's records start again from 0, as in a new cluster's sink
            with self.lock:
                self.records.pop(job_id, None)
        with self.lock:
            self.latest[job_id] = sid
            self.submitted[sid] = spec
            self.entrypoints[sid] = entrypoint(job_id, spec, None)
            self.status.setdefault(sid, RayJobInfo(RayJobStatus.RUNNING))
        return sid

    def statuses(self, submission_ids: list[str]) -> dict[str, RayJobInfo]:
        with self.lock:
            return {s: self.status.get(s, RayJobInfo(RayJobStatus.MISSING)) for s in submission_ids}

    def vanish(self, job_id: str) -> None:
        """Ray forgets the job's Ray Job (its cluster was restarted)."""
        with self.lock:
            self.status[self.sid(job_id)] = RayJobInfo(RayJobStatus.MISSING)

    def stop(self, sid: str) -> None:
        with self.lock:
            if self.status.get(sid, RayJobInfo(RayJobStatus.MISSING)).status is (
                RayJobStatus.MISSING
            ):
                raise RayJobMissingError(sid)
            self.stopped.append(sid)
            if self.stop_takes_effect:
                self.status[sid] = RayJobInfo(RayJobStatus.STOPPED, "stopped")

    def logs(self, sid: str) -> str:
        time.sleep(self.answer_after_s)
        if self.fail_logs is not None:
            raise self.fail_logs
        return f"log of {sid}\n"

    def cpus(self) -> float | None:
        return self.cluster_cpus

    def memory(self) -> float | None:
        return self.cluster_memory

    def progress(self, run: str, since: int) -> tuple[list[dict[str, Any]], int]:
        time.sleep(self.answer_after_s)
        if run in self.fail_progress:
            raise self.fail_progress[run]
        with self.lock:
            log = self.records.get(run, [])
            return [r for r in log if r["seq"] >= since], len(log)

    def reachable(self) -> bool:
        return self.up

    def close(self) -> None:
        time.sleep(self.answer_after_s)
        self.closed = True
