"""A real Ray head for the tests (``service.head``), with ENVIRONMENT.md's fast test settings.

One head serves the whole pytest run (a session fixture in ``conftest.py``): the tests connect
with ``ray.init(address=...)``, submit Ray Jobs to its dashboard, and the teardown stops exactly
this head, not other Ray clusters on the machine.
"""

from __future__ import annotations

from pathlib import Path

from kaisa_train.head import free_port
from service.head import RAY, RayHead
from service.head import start_head as _start_head

__all__ = [
    "RAY",
    "TEST_ENV",
    "RayHead",
    "actors_alive",
    "free_port",
    "start_head",
    "stop_unfinished_jobs",
]

# ENVIRONMENT.md: fast, reliable Ray in tests.
TEST_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1",
    "RAY_memory_monitor_refresh_ms": "0",
}


def start_head(log_dir: Path, *, token: str | None = None, num_cpus: int = 4) -> RayHead:
    return _start_head(
        log_dir, token=token, num_cpus=num_cpus, object_store_bytes=100 * 2**20, env=TEST_ENV
    )


def stop_unfinished_jobs(head: RayHead) -> list[str]:
    """Stops every Ray Job on ``head`` that has not finished: what a failed test left behind
    (a job of 100,000 steps whose cancel never came) must not train on under the next
    modules that share the head. Returns their submission ids."""
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(head.dashboard_url)
    stopped = []
    for job in client.list_jobs():
        if job.submission_id is not None and not job.status.is_terminal():
            client.stop_job(job.submission_id)
            stopped.append(job.submission_id)
    return stopped


def actors_alive(head: RayHead, class_name: str, within_s: float = 30) -> int:
    """Actors of ``class_name`` alive on ``head``, once those of ended runs have had
    ``within_s`` to go (what a traceback or a cycle still holds is collected first). The head
    is named: left to find one, Ray's state API refuses when other heads run on the machine
    (the other pytest worker's), or waits on a stopped head's address file."""
    import gc
    import time

    from ray.util.state import list_actors

    deadline = time.monotonic() + within_s
    while True:
        gc.collect()
        alive = list_actors(
            address=head.dashboard_url,
            filters=[("class_name", "=", class_name), ("state", "=", "ALIVE")],
            timeout=10,
        )
        if not alive or time.monotonic() > deadline:
            return len(alive)
        time.sleep(1)
