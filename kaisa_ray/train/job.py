"""The job driver: turns a ``JobSpec`` into a ``TorchTrainer`` run and follows its progress.

This is what ``kaisa-ray train --config job.yaml`` runs, locally or as the entrypoint of a Ray
Job (``ray job submit``), and what the service submits. It connects to Ray (the cluster in
``RAY_ADDRESS``, or a local one), gives the run a unique name, fits the trainer, and, while
it runs, reads the progress sink to draw a progress bar and log each evaluation.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import ray.train
from ray.train.torch import TorchTrainer
from tqdm.auto import tqdm

from kaisa_ray.errors import ConfigurationError
from kaisa_ray.train.loop import CHECKPOINT_FILE, train_worker
from kaisa_ray.train.progress import progress_sink
from kaisa_ray.train.spec import JobSpec

__all__ = ["JobResult", "default_storage_path", "ensure_ray", "run_job", "unique_run_name"]

logger = logging.getLogger(__name__)

STORAGE_ENV = "KAISA_RAY_STORAGE"


def default_storage_path() -> Path:
    """Where runs keep their checkpoints: ``$KAISA_RAY_STORAGE`` or ``~/kaisa-ray/runs``.

    On a multi-node cluster this must be storage every node can reach (NFS, or a URI such as
    ``s3://bucket/prefix``), so that a restarted worker group finds the checkpoints.
    """
    return Path(os.environ.get(STORAGE_ENV) or Path.home() / "kaisa-ray" / "runs")


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


@dataclass
class JobResult:
    """How a run ended."""

    run_name: str
    succeeded: bool
    metrics: dict[str, Any]  # the last report's metrics (step, test_accuracy, ...)
    checkpoint: str | None  # directory of the latest checkpoint, if any
    evals: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None


class _Follower(threading.Thread):
    """Reads the progress sink while the trainer runs: a tqdm bar, and a log line per eval."""

    def __init__(self, run: str, show_bar: bool, interval_s: float = 0.5) -> None:
        super().__init__(name=f"progress-{run}", daemon=True)
        self.run_name = run
        self.show_bar = show_bar
        self.interval_s = interval_s
        self.evals: list[dict[str, Any]] = []
        self._stop_event = threading.Event()
        self._since = 0
        self._sink: Any = None

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)

    def run(self) -> None:
        # disable=None: no bar when stderr is not a terminal (e.g. the log of a Ray Job).
        bar = tqdm(desc=self.run_name, unit="step", disable=None if self.show_bar else True)
        try:
            while True:
                stopping = self._stop_event.wait(self.interval_s)
                try:
                    self._poll(bar)
                except Exception as err:  # the sink is best effort: never fail the job
                    logger.debug("reading progress failed: %s", err)
                if stopping:
                    break
        finally:
            bar.close()

    def _poll(self, bar: Any) -> None:
        if self._sink is None:  # looked up once, on the first poll
            self._sink = progress_sink()
        page: dict[str, Any] = ray.get(self._sink.read.remote(self.run_name, self._since))
        self._since = page["next"]
        for record in page["records"]:
            kind = record["kind"]
            if kind == "start":
                bar.total = record["total_steps"]
                bar.n = record["from_step"]
                if record.get("resumed_from") and self.show_bar:
                    tqdm.write(
                        f"resumed at step {record['from_step']} from {record['resumed_from']}"
                    )
            elif kind == "step":
                bar.n = record["step"]
                bar.set_postfix(
                    loss=f"{record['loss']:.4f}",
                    acc=f"{record['accuracy']:.3f}",
                    samples_s=f"{record['samples_per_s']:.0f}",
                    refresh=False,
                )
            elif kind == "tuner" and self.show_bar:
                chosen = record["chosen"]
                tqdm.write(
                    f"kfac: auto chose grad_worker_fraction={chosen['strategy']:g}, intervals "
                    f"{chosen['factor_update_steps']}/{chosen['inv_update_steps']} "
                    f"({record['profile_s']:.1f} s of profiling, {len(record['candidates'])} "
                    "candidates)"
                )
            elif kind == "eval":
                self.evals.append(record)
                if not self.show_bar:
                    continue
                tqdm.write(
                    f"step {record['step']}: test accuracy {record['test_accuracy']:.4f}, "
                    f"test loss {record['test_loss']:.4f}, {record['elapsed_s']:.1f} s"
                )
        bar.refresh()


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
        storage_path: Where the run's checkpoints go (default ``default_storage_path()``).
        run_name: The run's name; default ``unique_run_name(spec.name)``. An existing run's name
            resumes that run (Ray Train's behaviour), so pass one only to do that on purpose.
        resume_from: A checkpoint directory (``.../checkpoint_*``) of an earlier run to start
            from: weights, optimizer, K-FAC state, step, sampler position and RNG.
        progress: Draw a progress bar on stderr (when it is a terminal) and log evaluations.
        progress_every: Steps between the step records rank 0 sends to the progress sink.

    Returns:
        A ``JobResult``; ``succeeded`` is False when the workers failed more than
        ``spec.max_failures`` times, with the error in ``error``.
    """
    name = run_name or unique_run_name(spec.name)
    if not _NAME.match(name):
        raise ConfigurationError(
            f"run name {name!r} must be 1-128 letters, digits, '_', '.', '-', starting with a "
            "letter or digit"
        )
    if progress_every < 1:
        raise ConfigurationError(f"progress_every must be at least 1, got {progress_every}")
    if resume_from is not None and not (Path(resume_from) / CHECKPOINT_FILE).is_file():
        raise ConfigurationError(
            f"resume_from={resume_from} is not a kaisa-ray checkpoint (no {CHECKPOINT_FILE} "
            "in it); pass a run's checkpoint_* directory"
        )
    storage = Path(storage_path) if storage_path is not None else default_storage_path()
    storage.mkdir(parents=True, exist_ok=True)
    ensure_ray()

    scaling = spec.scaling
    resources: dict[str, float] = {"CPU": scaling.cpus_per_worker}
    if scaling.gpus_per_worker > 0:
        resources["GPU"] = scaling.gpus_per_worker
    trainer = TorchTrainer(
        train_worker,
        train_loop_config={
            "spec": spec.model_dump(mode="json"),
            "run": name,
            "resume_from": str(resume_from) if resume_from is not None else None,
            "progress_every": progress_every,
        },
        scaling_config=ray.train.ScalingConfig(
            num_workers=scaling.workers,
            use_gpu=scaling.gpus_per_worker > 0,
            resources_per_worker=resources,
        ),
        run_config=ray.train.RunConfig(
            name=name,
            storage_path=str(storage.resolve()),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=spec.checkpoint.keep),
            failure_config=ray.train.FailureConfig(max_failures=spec.max_failures),
        ),
    )
    logger.info("run %s: %d worker(s), checkpoints in %s", name, scaling.workers, storage)
    follower = _Follower(name, show_bar=progress)
    follower.start()
    try:
        result = trainer.fit()
    except Exception as err:  # Ray raises when the workers failed beyond max_failures
        return JobResult(
            run_name=name,
            succeeded=False,
            metrics={},
            checkpoint=None,
            evals=follower.evals,
            error=f"{type(err).__name__}: {err}",
        )
    finally:
        follower.stop()  # before the result is read: its final poll has every evaluation
    checkpoint = result.checkpoint.path if result.checkpoint is not None else None
    return JobResult(
        run_name=name,
        succeeded=result.error is None,
        metrics=dict(result.metrics or {}),
        checkpoint=checkpoint,
        evals=follower.evals,
        error=None if result.error is None else str(result.error),
    )
