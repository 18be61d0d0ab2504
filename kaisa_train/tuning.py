"""``kfac: auto`` from the driver: tuning without training (``kaisa-ray tune``), measuring
candidates, and the verification trials of ``kfac.verify``. The decision in the workers is
``kaisa_train.auto_choice``.

``tune_job`` runs the job's workers in ``profile`` mode (they profile, decide and stop); with
``kfac.verify: K`` it measures the K best predicted candidates in Ray Tune trials (each a
function trainable that fits a ``TorchTrainer`` in ``measure`` mode) and lets
``tuner.verify`` pick the winner.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import ray
import ray.tune

from kaisa_ray.errors import ConfigurationError
from kaisa_train.auto_choice import kfac_choice
from kaisa_train.connection import seed_tuner
from kaisa_train.progress import read_progress
from kaisa_train.records import (
    CandidateRow,
    KFACChoice,
    MeasuredRecord,
    RecordKind,
    TunerErrorRecord,
    TunerRecord,
    parse_record,
)
from kaisa_train.spec import JobSpec, KFACSpec
from kaisa_train.storage import resolve_storage
from kaisa_train.trainer import (
    build_trainer,
    ensure_ray,
    sigint_kept,
    stream_ended,
    unique_run_name,
)
from kaisa_train.worker_config import MeasureConfig, ProfileConfig
from tuner.choice import NoFeasibleCandidateError
from tuner.cost import Candidate
from tuner.verify import Measurement, shortlist, verified

__all__ = ["TuningOutcome", "measure_candidates", "tune_job"]


class TuningOutcome:
    """What ``kfac: auto`` chose before a job starts, and the tuner's record of it: the
    candidate table, measured columns when verified, timings."""

    def __init__(self, record: TunerRecord) -> None:
        self.record = record

    @property
    def decided(self) -> KFACChoice:
        return self.record.chosen


def _profile_failure(run: str, error: Exception) -> ConfigurationError:
    """The tuner's own error when the profiling run failed because nothing fits."""
    for data in reversed(read_progress(run, kinds=[RecordKind.TUNER_ERROR])["records"]):
        record = parse_record(data)
        if isinstance(record, TunerErrorRecord):
            return NoFeasibleCandidateError(record.error)
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
    the fastest measured one that fits the budget (``tuner.verify``).

    Raises:
        NoFeasibleCandidateError: nothing fits the memory budget (the message says what would).
        ConfigurationError: the job does not ask for ``kfac: auto``, or profiling failed.
    """
    kfac = spec.kfac
    if not isinstance(kfac, KFACSpec) or not kfac.auto:
        raise ConfigurationError(
            "tuning needs a job with kfac: auto (or kfac.strategy: auto); this one fixes "
            f"kfac to {kfac if isinstance(kfac, str) else str(kfac.strategy)!r}"
        )
    name = run_name or unique_run_name(spec.name)
    storage = resolve_storage(storage_path)
    ensure_ray()
    seed_tuner()
    profile_run = f"{name}.profile"
    began = time.perf_counter()
    trainer = build_trainer(
        spec, ProfileConfig(spec=spec, run=profile_run), storage=storage, max_failures=0
    )
    try:
        with sigint_kept(), stream_ended(trainer):
            trainer.fit()
    except Exception as error:  # Ray raises when the workers failed
        raise _profile_failure(profile_run, error) from None
    found = [
        parse_record(r) for r in read_progress(profile_run, kinds=[RecordKind.TUNER])["records"]
    ]
    records = [r for r in found if isinstance(r, TunerRecord)]
    if not records:
        raise ConfigurationError(f"the profiling run {profile_run} reported no decision")
    record = records[-1].model_copy(update={"profile_run_s": time.perf_counter() - began})
    if kfac.verify > 0:
        record = _verify(spec, record, name=name, storage=storage, min_steps=min_steps)
    return TuningOutcome(record)


def measure_candidates(
    spec: JobSpec,
    candidates: list[KFACChoice],
    *,
    run_name: str,
    storage_path: str | Path | None = None,
    min_steps: int = 50,
    rounds: int = 1,
) -> list[MeasuredRecord]:
    """Measure K-FAC strategies on the job's workers (one ``TorchTrainer`` run): for each
    candidate, the peak memory per worker and the time per step over whole inverse-update
    periods (about ``min_steps`` steps; the median of ``rounds`` interleaved rounds), from the
    same starting weights. Returns one record per candidate."""
    storage = resolve_storage(storage_path)
    ensure_ray()
    config = MeasureConfig(
        spec=spec,
        run=run_name,
        candidates=tuple(candidates),
        min_steps=min_steps,
        rounds=rounds,
    )
    with sigint_kept():
        build_trainer(spec, config, storage=storage, max_failures=0).fit()
    found = [
        parse_record(r) for r in read_progress(run_name, kinds=[RecordKind.MEASURED])["records"]
    ]
    return [r for r in found if isinstance(r, MeasuredRecord)]


def _measure_trial(config: dict[str, Any]) -> None:
    """A Ray Tune function trainable: fit a ``TorchTrainer`` that measures one candidate."""
    candidate: KFACChoice = config["candidate"]
    f, fus, ius = candidate.key()
    (measured,) = measure_candidates(
        config["spec"],
        [candidate],
        run_name=f"{config['run']}.f{f:g}-{fus}-{ius}",
        storage_path=config["storage"],
        min_steps=config["min_steps"],
    )
    ray.tune.report({"memory_bytes": measured.memory_bytes, "ms_per_step": measured.ms_per_step})


def _candidate(row: CandidateRow) -> Candidate:
    return Candidate(
        grad_worker_fraction=row.grad_worker_fraction,
        factor_update_steps=row.factor_update_steps,
        inv_update_steps=row.inv_update_steps,
        memory_bytes=row.memory_bytes,
        kfac_state_bytes=row.kfac_state_bytes,
        step_s=row.ms_per_step / 1000,
        rejected=row.rejected,
    )


def _verify(
    spec: JobSpec, record: TunerRecord, *, name: str, storage: str, min_steps: int
) -> TunerRecord:
    """Measure the ``verify`` best predicted candidates in Ray Tune trials, one at a time (so
    that they do not slow each other down), and let ``tuner.verify`` choose."""
    kfac = spec.kfac
    if not isinstance(kfac, KFACSpec):
        raise ConfigurationError("verifying a K-FAC strategy needs a job with kfac on")
    began = time.perf_counter()
    predicted = [_candidate(row) for row in record.candidates]
    chosen = [kfac_choice(c) for c in shortlist(predicted, kfac.verify)]
    tuner = ray.tune.Tuner(
        # The trial only waits on its TorchTrainer, whose workers hold the CPUs: it takes none
        # (Tune refuses an empty bundle; a MiB of logical memory makes it non-empty).
        ray.tune.with_resources(_measure_trial, {"CPU": 0, "memory": 2**20}),
        param_space={
            "spec": spec,
            "run": f"{name}.verify",
            "storage": storage,
            "min_steps": min_steps,
            "candidate": ray.tune.grid_search(chosen),
        },
        tune_config=ray.tune.TuneConfig(max_concurrent_trials=1),
        run_config=ray.tune.RunConfig(name=f"{name}.verify", storage_path=storage, verbose=0),
    )
    results = tuner.fit()
    measured: dict[tuple[float, int, int], Measurement] = {}
    ms: dict[tuple[float, int, int], float] = {}  # as the trials reported it
    for index in range(len(results)):
        result = results[index]
        candidate: KFACChoice = (result.config or {})["candidate"]
        if result.error is not None:
            found = Measurement(error=f"{type(result.error).__name__}: {result.error}")
        else:
            metrics = result.metrics or {}
            ms[candidate.key()] = float(metrics["ms_per_step"])
            found = Measurement(
                memory_bytes=int(metrics["memory_bytes"]),
                step_s=float(metrics["ms_per_step"]) / 1000,
            )
        measured[candidate.key()] = found
    decision = verified(predicted, measured, record.budget_bytes)
    rows = []
    for row in record.candidates:
        found_ = measured.get(row.key())
        if found_ is None:
            rows.append(row)
            continue
        after = next(c for c in decision.candidates if c.key == row.key())
        rows.append(
            row.model_copy(
                update={
                    "measured_memory_bytes": found_.memory_bytes,
                    "measured_ms_per_step": ms.get(row.key()),
                    "rejected": after.rejected,
                }
            )
        )
    return record.model_copy(
        update={
            "how": decision.how,
            "verify_s": time.perf_counter() - began,
            "predicted_choice": record.chosen,
            "chosen": kfac_choice(decision.chosen),
            "candidates": rows,
        }
    )
