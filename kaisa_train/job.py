"""The job driver: turns a ``JobSpec`` into a ``TorchTrainer`` run and follows its progress.

This is what ``kaisa-ray train --config job.yaml`` runs, locally or as the entrypoint of a Ray
Job (``ray job submit``), and what the service submits. It connects to Ray (the cluster in
``RAY_ADDRESS``, or a local one), gives the run a unique name, fits the trainer, and, while
it runs, follows its records from the progress sink (``follow.Follower``: a progress bar and
a line per evaluation).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kaisa_ray.errors import ConfigurationError
from kaisa_train.connection import cluster_address, seed_tuner
from kaisa_train.follow import Follower
from kaisa_train.progress import SinkReader
from kaisa_train.records import EvalRecord
from kaisa_train.spec import JobSpec, KFACSpec
from kaisa_train.state import CHECKPOINT_FILE
from kaisa_train.storage import (
    checkpoint_file_exists,
    checkpoint_location,
    resolve_storage,
)
from kaisa_train.trainer import (
    build_trainer,
    ensure_ray,
    resource_timeout,
    sigint_kept,
    stream_ended,
    unique_run_name,
    unplaced_message,
    waited_too_long,
)
from kaisa_train.tuning import tune_job
from kaisa_train.worker_config import TrainConfig

__all__ = ["JobResult", "describe_run", "run_job"]

logger = logging.getLogger(__name__)


@dataclass
class JobResult:
    """How a run ended."""

    run_name: str
    succeeded: bool
    metrics: dict[str, Any]  # the last report's metrics (step, test_accuracy, ...)
    checkpoint: str | None  # directory of the latest checkpoint, if any
    evals: list[EvalRecord] = field(default_factory=list)
    error: str | None = None


def _failure(spec: JobSpec, error: Exception, storage: str, run: str) -> str:
    """Why a run failed, in words a user can act on; Ray's own message otherwise."""
    if not waited_too_long(error):
        return f"{type(error).__name__}: {error}"
    return unplaced_message(spec, storage, run)


def describe_run(
    spec: JobSpec, *, storage_path: str | Path | None = None, run_name: str | None = None
) -> dict[str, Any]:
    """How ``run_job`` would run ``spec``, without starting anything (``--dry-run``): the
    cluster it would connect to, its workers and their resources and placement, and its
    storage (checked, not created)."""
    scaling = spec.scaling
    resources: dict[str, float] = {"CPU": scaling.cpus_per_worker}
    if scaling.gpus_per_worker > 0:
        resources["GPU"] = scaling.gpus_per_worker
    kfac = spec.kfac
    return {
        "job": spec.name,
        "run_name": run_name or f"{spec.name}-<UTC time>-<8 hex>",
        "ray_address": cluster_address() or "local (a Ray head of its own for this command)",
        "workers": scaling.workers,
        "resources_per_worker": resources,
        "placement_strategy": scaling.placement_strategy,
        "backend": "nccl" if scaling.gpus_per_worker > 0 else "gloo",
        "precision": str(spec.precision),
        "kfac": kfac if isinstance(kfac, str) else str(kfac.strategy),
        "storage": resolve_storage(storage_path, create=False),
        "max_failures": spec.max_failures,
    }


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def run_job(
    spec: JobSpec,
    *,
    storage_path: str | Path | None = None,
    run_name: str | None = None,
    resume_from: str | Path | None = None,
    progress: bool = True,
    progress_every: int = 10,
) -> JobResult:
    """Train a job on Ray Train and wait for it.

    Args:
        spec: The validated job.
        storage_path: Where the run's checkpoints go: a local directory or a URI that every
            node can reach (``kaisa_train.storage``; default ``$KAISA_RAY_STORAGE`` or
            ``~/kaisa-ray/runs``).
        run_name: The run's name; default ``unique_run_name(spec.name)``. An existing run's name
            resumes that run (Ray Train's behaviour), so pass one only to do that on purpose.
        resume_from: A checkpoint directory (``.../checkpoint_*``, a path or a URI) of an
            earlier run to start from: weights, optimizer, K-FAC state, step, sampler
            position and RNG.
        progress: Draw a progress bar on stderr (when it is a terminal) and print evaluations.
        progress_every: Steps between the step records rank 0 sends to the progress sink.

    Returns:
        A ``JobResult``; ``succeeded`` is False when the workers failed more than
        ``spec.max_failures`` times, with the error in ``error``.
    """
    if spec.sweep is not None:
        raise ConfigurationError(
            f"job {spec.name!r} has a sweep section: run it with `kaisa-ray sweep`, or remove "
            "the section to train one run"
        )
    name = run_name or unique_run_name(spec.name)
    if not _NAME.match(name):
        raise ConfigurationError(
            f"run name {name!r} must be 1-128 letters, digits, '_', '.', '-', starting with a "
            "letter or digit"
        )
    if progress_every < 1:
        raise ConfigurationError(f"progress_every must be at least 1, got {progress_every}")
    if resume_from is not None and not checkpoint_file_exists(resume_from, CHECKPOINT_FILE):
        raise ConfigurationError(
            f"resume_from={resume_from} is not a kaisa-ray checkpoint (no {CHECKPOINT_FILE} "
            "in it); pass a run's checkpoint_* directory"
        )
    storage = resolve_storage(storage_path)
    ensure_ray()

    config = TrainConfig(
        spec=spec,
        run=name,
        resume_from=str(resume_from) if resume_from is not None else None,
        progress_every=progress_every,
    )
    kfac = spec.kfac
    if isinstance(kfac, KFACSpec) and kfac.auto:
        seed_tuner()
    if isinstance(kfac, KFACSpec) and kfac.auto and kfac.verify > 0 and resume_from is None:
        outcome = tune_job(spec, storage_path=storage, run_name=name)
        config = TrainConfig(
            spec=spec,
            run=name,
            progress_every=progress_every,
            decided=outcome.decided,
            tuning=outcome.record,
        )
    trainer = build_trainer(spec, config, storage=storage)
    logger.info("run %s: %d worker(s), checkpoints in %s", name, spec.scaling.workers, storage)
    follower = Follower(name, show=progress)
    reader = SinkReader(name, follower.take)
    reader.start()
    try:
        with resource_timeout(spec), sigint_kept(), stream_ended(trainer):
            result = trainer.fit()
    except Exception as err:  # Ray raises when the workers failed beyond max_failures
        return JobResult(
            run_name=name,
            succeeded=False,
            metrics={},
            checkpoint=None,
            evals=follower.evals,
            error=_failure(spec, err, storage, name),
        )
    finally:
        reader.stop()  # before the result is read: its final read has every evaluation
        follower.close()
    checkpoint = (
        checkpoint_location(result.checkpoint.path, storage)
        if result.checkpoint is not None
        else None
    )
    return JobResult(
        run_name=name,
        succeeded=result.error is None,
        metrics=dict(result.metrics or {}),
        checkpoint=checkpoint,
        evals=follower.evals,
        error=None if result.error is None else str(result.error),
    )
