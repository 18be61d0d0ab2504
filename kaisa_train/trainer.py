"""The Ray Train plumbing every driver shares: run names, the connection to Ray (``ensure_ray``,
from ``connection.py``), and the job's ``TorchTrainer`` (its workers, placement, storage,
failures and the records of the checkpoints Ray Train holds).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray
import ray.train
from ray.train.torch import TorchTrainer

from kaisa_ray.errors import ConfigurationError
from kaisa_train.connection import ensure_ray
from kaisa_train.progress import progress_sink
from kaisa_train.records import CheckpointRecord
from kaisa_train.spec import JobSpec
from kaisa_train.state import CHECKPOINT_FILE
from kaisa_train.storage import latest_checkpoint
from kaisa_train.stream_read import Horizon
from kaisa_train.streaming import StreamCounts, open_stream, spare_cpus_message
from kaisa_train.worker import train_worker
from kaisa_train.worker_config import WorkerConfig

__all__ = [
    "build_trainer",
    "ensure_ray",
    "refuse_without_spare_cpus",
    "resource_timeout",
    "sigint_kept",
    "stream_ended",
    "stream_for",
    "unique_run_name",
    "unplaced_message",
    "waited_too_long",
]

# Read by Ray Train's controller, which takes it from the driver's environment.
START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"


def unique_run_name(job_name: str) -> str:
    """``<job name>-<UTC time>-<8 hex>``: unique, so a run never resumes an older one."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return f"{job_name}-{stamp}-{uuid.uuid4().hex[:8]}"


class CheckpointRecorder(ray.train.UserCallback):
    """Sends a ``checkpoint`` record when Ray Train's controller has taken a checkpoint in
    (every worker reported it), so the record means what a restart would resume from. A
    worker's own report returning says less: it is queued, and a worker lost before the
    controller polls the others' reports leaves that checkpoint unregistered."""

    def __init__(self, run: str) -> None:
        self.run = run

    def after_report(
        self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any
    ) -> None:
        if checkpoint is None or not metrics or metrics[0].get("step") is None:
            return
        record = CheckpointRecord(step=int(metrics[0]["step"]), path=str(checkpoint.path))
        ray.get(progress_sink().push.remote(self.run, [record.wire()]))


def build_trainer(
    spec: JobSpec,
    config: WorkerConfig,
    *,
    storage: str,
    max_failures: int | None = None,
    callbacks: list[Any] | None = None,
) -> TorchTrainer:
    """The job's ``TorchTrainer``: ``train_worker`` with ``config`` on the job's workers,
    placed on Ray's nodes as ``scaling.placement`` says, checkpointing to ``storage`` (a local
    directory or a URI, from ``resolve_storage``) under the run's name."""
    scaling = spec.scaling
    resources: dict[str, float] = {"CPU": scaling.cpus_per_worker}
    if scaling.gpus_per_worker > 0:
        resources["GPU"] = scaling.gpus_per_worker
    failures = spec.max_failures if max_failures is None else max_failures
    datasets: dict[str, Any] = {}
    counts = None
    if spec.dataset.streamed:
        datasets, counts = stream_for(spec)
    return TorchTrainer(
        train_worker,
        train_loop_config={"worker": config, "stream": counts},
        datasets=datasets or None,
        scaling_config=ray.train.ScalingConfig(
            num_workers=scaling.workers,
            use_gpu=scaling.gpus_per_worker > 0,
            resources_per_worker=resources,
            placement_strategy=scaling.placement_strategy,
        ),
        run_config=ray.train.RunConfig(
            name=config.run,
            storage_path=storage,
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=spec.checkpoint.keep),
            # Ray Train's own INFO lines (resources requested, the worker group started, each
            # report and checkpoint) stay in its log files, out of the job's output.
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),  # type: ignore[call-arg]
            # A v2 UserCallback (mypy reads RunConfig's v1 signature).
            callbacks=[CheckpointRecorder(config.run), *(callbacks or [])],  # type: ignore[list-item]
            failure_config=ray.train.FailureConfig(  # type: ignore[call-arg]  # v2's (mypy: v1's)
                max_failures=failures,
                # Waiting for resources that do not come is a controller error, retried
                # without end by default; with a timeout the first one fails the job.
                controller_failure_limit=-1 if scaling.resource_timeout_s is None else 0,
            ),
        ),
    )


def refuse_without_spare_cpus(spec: JobSpec, trials: int = 1) -> None:
    """Raise where the job's workers (``trials`` trials of them at once) would take every CPU
    of the connected cluster and leave Ray Data none to read a streamed dataset with."""
    cpus = float(ray.cluster_resources().get("CPU", 0))  # type: ignore[no-untyped-call]
    scaling = spec.scaling
    refused = spare_cpus_message(cpus, scaling.workers, scaling.cpus_per_worker, trials)
    if refused is not None:
        raise ConfigurationError(refused)


def stream_for(spec: JobSpec) -> tuple[dict[str, Any], StreamCounts]:
    """A streamed job's Ray Data pipelines and counts, on a cluster with CPUs to read with."""
    refuse_without_spare_cpus(spec)
    scaling = spec.scaling
    horizon = Horizon(
        workers=scaling.workers,
        max_steps=spec.stop.max_steps,
        max_epochs=spec.stop.max_epochs,
        seed=spec.seed,
    )
    return open_stream(spec.dataset, horizon)


@contextmanager
def resource_timeout(spec: JobSpec) -> Iterator[None]:
    """Ray Train's worker-group start timeout set to ``scaling.resource_timeout_s`` while a
    trainer of this job starts (its controller reads it from the driver's environment)."""
    timeout = spec.scaling.resource_timeout_s
    if timeout is None:
        yield
        return
    old = os.environ.get(START_TIMEOUT_ENV)
    os.environ[START_TIMEOUT_ENV] = str(timeout)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(START_TIMEOUT_ENV, None)
        else:
            os.environ[START_TIMEOUT_ENV] = old


@contextmanager
def stream_ended(trainer: TorchTrainer) -> Iterator[None]:
    """A streamed fit's skipped-records ledger (``streaming.SkipLedger``, an actor this process
    owns) ended with the fit inside, whether it returned or raised: otherwise it lives on while
    anything, Ray Data's plans included, still holds its handle (in a process that runs several
    jobs, one ledger a job)."""
    try:
        yield
    finally:
        # v2's attribute (mypy reads the v1 TorchTrainer)
        counts = (getattr(trainer, "train_loop_config", None) or {}).get("stream")
        if isinstance(counts, StreamCounts) and counts.ledger is not None:
            ray.kill(counts.ledger)


@contextmanager
def sigint_kept() -> Iterator[None]:
    """The SIGINT handler this process had, put back when a fit inside ends. Ray Train's
    ``fit()`` in the main thread installs one that aborts its run and holds the run's controller
    actor: left there, Ctrl-C after the fit would abort a run that has ended (and exit the
    process with status 0), and the controller, with its polling, would outlive its run until
    the next fit (in a notebook, or a process that runs several jobs)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.getsignal(signal.SIGINT)
    try:
        yield
    finally:
        if before is not None:  # None: a handler not installed from Python, left as it is
            signal.signal(signal.SIGINT, before)


def waited_too_long(error: BaseException) -> bool:
    """Whether Ray Train gave up waiting for the workers' resources: a controller error whose
    cause is its worker-group start timeout (an internal class of Ray Train's, so matched by
    its name, not imported)."""
    failure = getattr(error, "controller_failure", None)
    return (
        isinstance(error, ray.train.ControllerError)
        and failure is not None
        and type(failure).__name__ == "WorkerGroupStartupTimeoutError"
    )


def _cluster_cpus() -> str:
    """The cluster's CPUs in words (``4 CPU in all, 0 free now``), or "" if Ray cannot say."""
    try:
        total = ray.cluster_resources().get("CPU", 0.0)  # type: ignore[no-untyped-call]
        free = ray.available_resources().get("CPU", 0.0)  # type: ignore[no-untyped-call]
    except Exception:  # only words for a message: never fail the message
        return ""
    return f" (the cluster has {total:g} CPU in all, {free:g} free now)"


def unplaced_message(spec: JobSpec, storage: str, run: str) -> str:
    """Why a run whose workers were not placed within ``scaling.resource_timeout_s`` failed,
    and what to do: the workers' resources, the cluster's, and the latest checkpoint."""
    scaling = spec.scaling
    per_worker = f"{scaling.cpus_per_worker:g} CPU" + (
        f", {scaling.gpus_per_worker:g} GPU" if scaling.gpus_per_worker else ""
    )
    latest = latest_checkpoint(storage, run, CHECKPOINT_FILE)
    timeout = scaling.resource_timeout_s or 0.0
    return (
        f"the job's {scaling.workers} workers ({per_worker} each, placement "
        f"{scaling.placement}) did not get their resources within "
        f"scaling.resource_timeout_s={timeout:g} s{_cluster_cpus()}: the cluster is too small "
        "for them, other work holds them, or a node left and none came back. Add nodes, lower "
        "scaling.workers or relax scaling.placement, or raise scaling.resource_timeout_s "
        "(unset in a job: wait as long as it takes). "
        + (
            f"The latest checkpoint is {latest}: continue from it with "
            f"`kaisa-ray train --resume-from {latest}`."
            if latest
            else "No checkpoint was written."
        )
    )
