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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import ray.train
import ray.tune
from ray.train.torch import TorchTrainer
from tqdm.auto import tqdm

from kaisa_ray.errors import ConfigurationError
from kaisa_ray.train.loop import CHECKPOINT_FILE, train_worker
from kaisa_ray.train.progress import progress_sink, read_progress
from kaisa_ray.train.spec import JobSpec, KFACSpec
from kaisa_ray.train.storage import (
    checkpoint_file_exists,
    checkpoint_location,
    latest_checkpoint,
    resolve_storage,
)
from tuner.cost import NoFeasibleCandidateError

__all__ = [
    "JobResult",
    "TuningOutcome",
    "build_trainer",
    "decision_line",
    "describe_run",
    "ensure_ray",
    "measure_candidates",
    "run_job",
    "tune_job",
    "tuning_table",
    "unique_run_name",
]

logger = logging.getLogger(__name__)

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
                tqdm.write(decision_line(record))
            elif kind == "eval":
                self.evals.append(record)
                if not self.show_bar:
                    continue
                tqdm.write(
                    f"step {record['step']}: test accuracy {record['test_accuracy']:.4f}, "
                    f"test loss {record['test_loss']:.4f}, {record['elapsed_s']:.1f} s"
                )
        bar.refresh()


def build_trainer(
    spec: JobSpec,
    config: dict[str, Any],
    *,
    name: str,
    storage: str,
    max_failures: int | None = None,
    callbacks: list[Any] | None = None,
) -> TorchTrainer:
    """The job's ``TorchTrainer``: ``train_worker`` with ``config`` on the job's workers,
    placed on Ray's nodes as ``scaling.placement`` says, checkpointing to ``storage`` (a local
    directory or a URI, from ``resolve_storage``)."""
    scaling = spec.scaling
    resources: dict[str, float] = {"CPU": scaling.cpus_per_worker}
    if scaling.gpus_per_worker > 0:
        resources["GPU"] = scaling.gpus_per_worker
    failures = spec.max_failures if max_failures is None else max_failures
    return TorchTrainer(
        train_worker,
        train_loop_config=config,
        scaling_config=ray.train.ScalingConfig(
            num_workers=scaling.workers,
            use_gpu=scaling.gpus_per_worker > 0,
            resources_per_worker=resources,
            placement_strategy=scaling.placement_strategy,
        ),
        run_config=ray.train.RunConfig(
            name=name,
            storage_path=storage,
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=spec.checkpoint.keep),
            callbacks=callbacks,
            failure_config=ray.train.FailureConfig(  # type: ignore[call-arg]  # v2's (mypy: v1's)
                max_failures=failures,
                # Waiting for resources that do not come is a controller error, retried
                # without end by default; with a timeout the first one fails the job.
                controller_failure_limit=-1 if scaling.resource_timeout_s is None else 0,
            ),
        ),
    )


@contextmanager
def _resource_timeout(spec: JobSpec) -> Iterator[None]:
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


def _failure(spec: JobSpec, error: Exception, storage: str, run: str) -> str:
    """Why a run failed, in words a user can act on; Ray's own message otherwise."""
    text = f"{type(error).__name__}: {error}"
    if "worker group startup timed out" not in text:
        return text
    scaling = spec.scaling
    per_worker = f"{scaling.cpus_per_worker:g} CPU" + (
        f", {scaling.gpus_per_worker:g} GPU" if scaling.gpus_per_worker else ""
    )
    latest = latest_checkpoint(storage, run, CHECKPOINT_FILE)
    return (
        f"the job's {scaling.workers} workers ({per_worker} each, placement "
        f"{scaling.placement}) did not get their resources within "
        f"scaling.resource_timeout_s={scaling.resource_timeout_s:g} s: the cluster is too small "
        "for them, or a node left and none came back. Add nodes, lower scaling.workers or "
        "relax scaling.placement, or raise scaling.resource_timeout_s (unset: wait as long as "
        "it takes). "
        + (
            f"The latest checkpoint is {latest}: continue from it with "
            f"`kaisa-ray train --resume-from {latest}`."
            if latest
            else "No checkpoint was written."
        )
    )


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
        "ray_address": os.environ.get("RAY_ADDRESS") or "local (a Ray started for this job)",
        "workers": scaling.workers,
        "resources_per_worker": resources,
        "placement_strategy": scaling.placement_strategy,
        "backend": "nccl" if scaling.gpus_per_worker > 0 else "gloo",
        "precision": spec.precision,
        "kfac": kfac if isinstance(kfac, str) else kfac.strategy,
        "storage": resolve_storage(storage_path, create=False),
        "max_failures": spec.max_failures,
    }


def decision_line(record: dict[str, Any]) -> str:
    """One line saying what ``kfac: auto`` chose and how (from a ``tuner`` record)."""
    chosen = record["chosen"]
    how = (
        "profile from the tuner's cache"
        if record.get("cache") == "hit"
        else f"{record['profile_s']:.1f} s of profiling"
    )
    if record.get("how") == "measured":
        how += f", {record.get('verify_s', 0.0):.0f} s of verification trials"
    return (
        f"kfac: auto chose grad_worker_fraction={chosen['strategy']:g}, intervals "
        f"{chosen['factor_update_steps']}/{chosen['inv_update_steps']} "
        f"({record.get('how', 'predicted')}: {how}; {len(record['candidates'])} candidates)"
    )


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def tuning_table(record: dict[str, Any]) -> str:
    """The candidate table of a ``tuner`` record, as text: predicted (and, when verified,
    measured) memory per worker and time per step, and why each candidate lost."""
    chosen = record["chosen"]
    measured = any("measured_ms_per_step" in row for row in record["candidates"])
    header = ["f", "intervals", "MiB/worker", "K-FAC MiB", "ms/step"]
    if measured:
        header += ["measured MiB", "measured ms"]
    header.append("verdict")
    lines = [header]
    for row in record["candidates"]:
        picked = _decided(row) == chosen
        cells = [
            f"{row['grad_worker_fraction']:g}",
            f"{row['factor_update_steps']}/{row['inv_update_steps']}",
            _mib(row["memory_bytes"]),
            _mib(row["kfac_state_bytes"]),
            f"{row['ms_per_step']:.1f}",
        ]
        if measured:
            ms = row.get("measured_ms_per_step")
            cells += [_mib(row.get("measured_memory_bytes")), "-" if ms is None else f"{ms:.1f}"]
        cells.append("CHOSEN" if picked else row["rejected"] or "slower")
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    text = [
        "  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=False))
        + "  "
        + line[-1]
        for line in lines
    ]
    budget = record.get("budget_bytes")
    text.append(
        f"budget {'none' if budget is None else _mib(budget) + ' MiB'} per worker; base "
        f"{_mib(record.get('base_memory_bytes'))} MiB + K-FAC temporaries "
        f"{_mib(record.get('kfac_transient_bytes'))} MiB + K-FAC state; plain step "
        f"{record.get('plain_ms_per_step', 0.0):.1f} ms"
    )
    text.append(decision_line(record))
    return "\n".join(text)


@dataclass(frozen=True)
class TuningOutcome:
    """What ``kfac: auto`` chose before a job starts (``decided``: KFACSpec fields), and the
    tuner's record of it: the candidate table, measured columns when verified, timings."""

    decided: dict[str, Any]
    record: dict[str, Any]


def _profile_failure(run: str, error: Exception) -> ConfigurationError:
    """The tuner's own error when the profiling run failed because nothing fits."""
    failures = read_progress(run, kinds=["tuner-error"])["records"]
    if failures:
        return NoFeasibleCandidateError(failures[-1]["error"])
    return ConfigurationError(f"profiling the job failed: {type(error).__name__}: {error}")


def tune_job(
    spec: JobSpec,
    *,
    storage_path: str | Path | None = None,
    run_name: str | None = None,
    min_steps: int = 50,
) -> TuningOutcome:
    """``kfac: auto`` without training: profile on the job's workers and choose; with
    ``kfac.verify: K``, also measure the K best predicted candidates as Ray Tune trials (each
    a function trainable that fits a ``TorchTrainer`` for about ``min_steps`` steps) and take
    the fastest measured one that fits the budget.

    Raises:
        NoFeasibleCandidateError: nothing fits the memory budget (the message says what would).
        ConfigurationError: the job does not ask for ``kfac: auto``, or profiling failed.
    """
    kfac = spec.kfac
    if not isinstance(kfac, KFACSpec) or kfac.strategy != "auto":
        raise ConfigurationError(
            "tuning needs a job with kfac: auto (or kfac.strategy: auto); this one fixes "
            f"kfac to {kfac if isinstance(kfac, str) else kfac.strategy!r}"
        )
    name = run_name or unique_run_name(spec.name)
    storage = resolve_storage(storage_path)
    ensure_ray()
    profile_run = f"{name}.profile"
    began = time.perf_counter()
    trainer = build_trainer(
        spec,
        {"spec": spec.model_dump(mode="json"), "run": profile_run, "mode": "profile"},
        name=profile_run,
        storage=storage,
        max_failures=0,
    )
    try:
        trainer.fit()
    except Exception as error:  # Ray raises when the workers failed
        raise _profile_failure(profile_run, error) from None
    records = read_progress(profile_run, kinds=["tuner"])["records"]
    if not records:
        raise ConfigurationError(f"the profiling run {profile_run} reported no decision")
    record = dict(records[-1])
    record["profile_run_s"] = time.perf_counter() - began
    if kfac.verify > 0:
        record = _verify(spec, record, name=name, storage=storage, min_steps=min_steps)
    return TuningOutcome(decided=dict(record["chosen"]), record=record)


def _decided(row: dict[str, Any]) -> dict[str, Any]:
    """A candidate-table row as the KFACSpec fields it would set (a ``chosen`` dict)."""
    return {
        "strategy": row["grad_worker_fraction"],
        "factor_update_steps": row["factor_update_steps"],
        "inv_update_steps": row["inv_update_steps"],
    }


def measure_candidates(
    spec: JobSpec,
    candidates: list[dict[str, Any]],
    *,
    run_name: str,
    storage_path: str | Path | None = None,
    min_steps: int = 50,
    rounds: int = 1,
) -> list[dict[str, Any]]:
    """Measure K-FAC strategies on the job's workers (one ``TorchTrainer`` run): for each
    candidate (``strategy``, ``factor_update_steps``, ``inv_update_steps``), the peak memory
    per worker and the time per step over whole inverse-update periods (about
    ``min_steps`` steps; the median of ``rounds`` interleaved rounds), from the same starting
    weights. Returns one record per candidate."""
    storage = resolve_storage(storage_path)
    ensure_ray()
    config = {
        "spec": spec.model_dump(mode="json"),
        "run": run_name,
        "mode": "measure",
        "candidates": candidates,
        "min_steps": min_steps,
        "rounds": rounds,
    }
    build_trainer(spec, config, name=run_name, storage=storage, max_failures=0).fit()
    measured: list[dict[str, Any]] = read_progress(run_name, kinds=["measured"])["records"]
    return measured


def _measure_trial(config: dict[str, Any]) -> None:
    """A Ray Tune function trainable: fit a ``TorchTrainer`` that measures one candidate."""
    candidate = config["candidate"]
    run = f"{config['run']}.f{candidate['strategy']:g}-{candidate['factor_update_steps']}-" + str(
        candidate["inv_update_steps"]
    )
    (measured,) = measure_candidates(
        JobSpec.model_validate(config["spec"]),
        [candidate],
        run_name=run,
        storage_path=config["storage"],
        min_steps=config["min_steps"],
    )
    ray.tune.report({k: measured[k] for k in ("memory_bytes", "ms_per_step", "steps")})


def _verify(
    spec: JobSpec, record: dict[str, Any], *, name: str, storage: str, min_steps: int
) -> dict[str, Any]:
    """Measure the ``verify`` best predicted candidates; the fastest measured one that fits
    the budget wins. Trials run one at a time, so they do not slow each other down."""
    kfac = spec.kfac
    assert isinstance(kfac, KFACSpec)
    began = time.perf_counter()
    feasible = [row for row in record["candidates"] if row["rejected"] is None]
    best = sorted(feasible, key=lambda row: row["ms_per_step"])[: kfac.verify]
    candidates = [_decided(row) for row in best]
    tuner = ray.tune.Tuner(
        # The trial only waits on its TorchTrainer, whose workers hold the CPUs: it takes none
        # (Tune refuses an empty bundle; a MiB of logical memory makes it non-empty).
        ray.tune.with_resources(_measure_trial, {"CPU": 0, "memory": 2**20}),
        param_space={
            "spec": spec.model_dump(mode="json"),
            "run": f"{name}.verify",
            "storage": storage,
            "min_steps": min_steps,
            "candidate": ray.tune.grid_search(candidates),
        },
        tune_config=ray.tune.TuneConfig(max_concurrent_trials=1),
        run_config=ray.tune.RunConfig(name=f"{name}.verify", storage_path=storage, verbose=0),
    )
    results = tuner.fit()
    measured: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for index in range(len(results)):
        result = results[index]
        outcome: dict[str, Any] = dict(result.metrics or {})
        if result.error is not None:
            outcome = {"error": f"{type(result.error).__name__}: {result.error}"}
        measured.append(((result.config or {})["candidate"], outcome))
    budget = record["budget_bytes"]
    rows = []
    for row in record["candidates"]:
        row = dict(row)
        found = next((m for c, m in measured if c == _decided(row)), None)
        if found is not None:
            row["measured_memory_bytes"] = found.get("memory_bytes")
            row["measured_ms_per_step"] = found.get("ms_per_step")
            if "error" in found:
                row["rejected"] = f"its trial failed: {found['error']}"
            elif budget is not None and found["memory_bytes"] > budget:
                row["rejected"] = (
                    f"measured {found['memory_bytes']} bytes, over the budget of {budget}"
                )
        rows.append(row)
    verified = [
        row for row in rows if row.get("measured_ms_per_step") is not None and not row["rejected"]
    ]
    if not verified:
        reasons = "; ".join(
            f"f={row['grad_worker_fraction']:g} {row['factor_update_steps']}/"
            f"{row['inv_update_steps']}: {row['rejected']}"
            for row in rows
            if "measured_ms_per_step" in row
        )
        raise NoFeasibleCandidateError(
            f"none of the {len(candidates)} verified candidates fits when measured ({reasons}); "
            "raise memory_budget, or verify more candidates"
        )
    winner = min(
        verified, key=lambda row: (row["measured_ms_per_step"], -row["grad_worker_fraction"])
    )
    return {
        **record,
        "how": "measured",
        "verify_s": time.perf_counter() - began,
        "predicted_choice": record["chosen"],
        "chosen": _decided(winner),
        "candidates": rows,
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
            node can reach (``kaisa_ray.train.storage``; default ``$KAISA_RAY_STORAGE`` or
            ``~/kaisa-ray/runs``).
        run_name: The run's name; default ``unique_run_name(spec.name)``. An existing run's name
            resumes that run (Ray Train's behaviour), so pass one only to do that on purpose.
        resume_from: A checkpoint directory (``.../checkpoint_*``, a path or a URI) of an
            earlier run to start from: weights, optimizer, K-FAC state, step, sampler
            position and RNG.
        progress: Draw a progress bar on stderr (when it is a terminal) and log evaluations.
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

    config: dict[str, Any] = {
        "spec": spec.model_dump(mode="json"),
        "run": name,
        "resume_from": str(resume_from) if resume_from is not None else None,
        "progress_every": progress_every,
    }
    kfac = spec.kfac
    if (
        isinstance(kfac, KFACSpec)
        and kfac.strategy == "auto"
        and kfac.verify > 0
        and resume_from is None
    ):
        outcome = tune_job(spec, storage_path=storage, run_name=name)
        config["decided"], config["tuning"] = outcome.decided, outcome.record
    trainer = build_trainer(spec, config, name=name, storage=storage)
    logger.info("run %s: %d worker(s), checkpoints in %s", name, spec.scaling.workers, storage)
    follower = _Follower(name, show_bar=progress)
    follower.start()
    try:
        with _resource_timeout(spec):
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
        follower.stop()  # before the result is read: its final poll has every evaluation
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
