"""A graceful restart that resumes: what the service does with its jobs when it stops its
embedded Ray head, and when it starts again on the same database.

On a graceful stop (SIGTERM, Ctrl-C) with the embedded head, the head and every Ray Job on
it stop with the service. First the training stops (``stop_training``: the jobs' drivers,
Ray Train's controllers and workers on the head are killed; the progress sink and the job
server go on), so
that no checkpoint can be taken after the service's last read of the progress: the
checkpoint a job resumes from is one whose records the service has. Each job that was in
Ray is then INTERRUPTED, not FAILED: its last progress is read and its log copied
(``service.domain.job_logs``). A job being cancelled is CANCELLED (its Ray Job stops anyway); a job
still waiting for admission stays QUEUED.

On the next start with the same database, every INTERRUPTED job goes back to the head of the
queue (``JobStore.resume``) and, once admitted, is submitted again as a new Ray Job of the
same run: Ray Train finds the run's checkpoints in its storage under the run's name (the job
id) and ``ray.train.get_checkpoint()`` gives the worker group the latest one. The records of
the new life are numbered after the old ones, and its start record drops what the old life
recorded past the checkpoint's step (``service.domain.interpretation.interpret``): the history
goes on from the checkpoint with no step twice and none missing.

A resume does not count against the job's ``max_failures``: that is the job's tolerance for
its own workers failing (Ray Train counts it within one Ray Job), and a restart of the service
is the operator's doing, not the job's; counting it would fail every ``max_failures: 0`` job
(the default) on each upgrade of the service. A service on a cluster of its own
(``--ray-address``) stops nothing in Ray: its jobs run on and it follows them again.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from kaisa_train.head import descendants
from service.domain.follower import RayJobFollower
from service.domain.jobs import Jobs
from service.errors import TookTooLongError
from service.head import RayHead
from service.model.job_data import Job
from service.model.lifecycle import JobEvent, JobState

__all__ = ["interrupt", "resume", "stop_training", "within"]

T = TypeVar("T")

logger = logging.getLogger(__name__)

INTERRUPTED = (
    "the service stopped (a graceful stop: SIGTERM or Ctrl-C) and its embedded Ray head with "
    "it, at step {step}; the job resumes from its latest checkpoint when the service starts "
    "again on this database"
)
RESUMED = "the service started again: resumed from the run's latest checkpoint"


TRAINING = ("ray::TrainController", "ray::RayTrainWorker", "ray::ImplicitFunc")
"""Ray's titles of the processes that train (Ray Train's controller, which takes the
checkpoints, and workers; Ray Tune's trials). Not every ``ray::`` process: the dashboard's
and runtime-env agents are ``ray::`` too, and the raylet (and every actor with it, the
progress sink among them) dies with them."""
JOB_DRIVERS = ("kaisa-ray train", "kaisa-ray sweep")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def stop_training(head: RayHead) -> int:
    """Kill the jobs' drivers and the processes that train on the embedded head (``TRAINING``:
    Ray names each ``ray::<its actor>``): no training step, record or checkpoint after this,
    while the progress sink and the job server still answer. Returns how many were killed."""
    killed = 0
    for pid in descendants(head.pid):
        line = _cmdline(pid)
        if line.startswith(TRAINING) or any(driver in line for driver in JOB_DRIVERS):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed += 1
    if killed:
        time.sleep(SETTLE_S)  # what the killed sent before they died reaches the sink
    return killed


SETTLE_S = 0.5


def within(seconds: float, call: Callable[[], T]) -> T:
    """``call()`` on a thread of its own, waited for at most ``seconds``: what it returns or
    raises, or ``TookTooLongError`` (the call goes on, unwaited for, on a daemon thread). For
    a shutdown that must end in the time a service manager grants, whatever Ray answers."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as err:
            box["error"] = err

    thread = threading.Thread(target=run, name="bounded call", daemon=True)
    thread.start()
    thread.join(max(0.0, seconds))
    if thread.is_alive():
        raise TookTooLongError(f"no answer in {seconds:.1f} s")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


READS_S = 4.0
"""The time the last reads of the interrupted jobs' progress and logs may take together: Ray
under load answers late, and the whole stop must end in a service manager's grace period."""


def interrupt(
    jobs: Jobs,
    follower: RayJobFollower,
    stop: Callable[[], object] | None = None,
    reads_s: float = READS_S,
) -> list[Job]:
    """Before the embedded head stops: the training stopped (``stop``: ``stop_training``
    of the head), then every job in Ray INTERRUPTED (its progress read and its log kept
    first, within ``reads_s`` for all jobs together: what Ray has not answered by then is
    left, and the job resumes from its checkpoint all the same), every job being cancelled
    CANCELLED. Returns the interrupted jobs. The follower has stopped: nothing else moves the
    jobs meanwhile."""
    if stop is not None and any(j.submission_id for j in jobs.store.active()):
        stop()
    interrupted = []
    deadline = time.monotonic() + reads_s
    for job in jobs.store.active():
        if job.submission_id is None:
            continue  # never reached Ray: still in the queue next time
        try:
            read = functools.partial(follower.read_progress, job)
            job = within(deadline - time.monotonic(), read)
        except Exception as err:  # the last records are lost; the checkpoint is not
            logger.warning("job %s: its last progress could not be read: %s", job.id, err)
        try:
            within(deadline - time.monotonic(), functools.partial(jobs.keep_logs, job))
        except TookTooLongError as err:  # Ray's copy goes with the head
            logger.warning("job %s: its log could not be copied from Ray: %s", job.id, err)
        if job.state is JobState.CANCELLING:
            jobs.apply(job.id, JobEvent.CANCELLED)
            continue
        try:
            moved = jobs.apply(job.id, JobEvent.INTERRUPT, INTERRUPTED.format(step=job.step))
        except Exception as err:  # a database that cannot be written: the next start fails it
            logger.warning("job %s: could not record its interruption: %s", job.id, err)
            continue
        interrupted.append(moved)
    if interrupted:
        logger.info(
            "interrupted %d job(s); they resume when the service starts again: %s",
            len(interrupted),
            ", ".join(j.id for j in interrupted),
        )
    return interrupted


def resume(jobs: Jobs) -> list[Job]:
    """At start-up: every INTERRUPTED job back in the queue, oldest first, to go on from its
    latest checkpoint."""
    resumed = []
    for job in jobs.store.interrupted():
        moved = jobs.store.resume(job.id, RESUMED)
        jobs.publish_state(moved)
        resumed.append(moved)
    if resumed:
        logger.info("resuming %d interrupted job(s): %s", len(resumed), resumed[0].id)
    return resumed
