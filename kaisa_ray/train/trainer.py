"""The Ray Train plumbing every driver shares: the connection to Ray, run names, and the
job's ``TorchTrainer`` (its workers, placement, storage, failures and the records of the
checkpoints Ray Train holds).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray
import ray.train
from ray.train.torch import TorchTrainer

from kaisa_ray.errors import ConfigurationError
from kaisa_ray.train.progress import progress_sink
from kaisa_ray.train.records import CheckpointRecord
from kaisa_ray.train.spec import JobSpec
from kaisa_ray.train.worker import train_worker
from kaisa_ray.train.worker_config import WorkerConfig

__all__ = ["build_trainer", "ensure_ray", "resource_timeout", "unique_run_name"]

# Read by Ray Train's controller, which takes it from the driver's environment.
START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"


def unique_run_name(job_name: str) -> str:
    """``<job name>-<UTC time>-<8 hex>``: unique, so a run never resumes an older one."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return f"{job_name}-{stamp}-{uuid.uuid4().hex[:8]}"


def ensure_ray() -> None:
    """Connect to Ray once: the cluster in ``RAY_ADDRESS`` (set inside a Ray Job) or a local one."""
    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS") or None
    try:
        ray.init(address=address, log_to_driver=True)
    except ConnectionError as err:
        where = f"RAY_ADDRESS={address}" if address else "the address `ray start` left behind"
        raise ConfigurationError(
            f"cannot reach the Ray cluster at {where} ({err}). Start it, point RAY_ADDRESS at "
            "a running cluster, or set RAY_ADDRESS=local to start a local Ray for this job "
            "(`ray stop` also clears a stale address)"
        ) from err


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
    return TorchTrainer(
        train_worker,
        train_loop_config={"worker": config},
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
