"""``kfac: auto`` in a job: the tuner's decision made on the job's own workers, and, from the
driver, tuning without training (``kaisa-ray tune``), measuring candidates, and the
verification trials of ``kfac.verify``.

In the workers (``choose_in_workers``): every rank profiles the job (collectives), rank 0 asks
the tuner actor to choose (``tuner.cost.choose``) and shares the answer, so every rank makes
the same choice. The tuner caches profiles by ``profile_key``: when it has this job's, nobody
profiles.

From the driver: ``tune_job`` runs the job's workers in ``profile`` mode (they profile,
decide and stop); with ``kfac.verify: K`` it measures the K best predicted candidates in Ray
Tune trials (each a function trainable that fits a ``TorchTrainer`` in ``measure`` mode) and
lets ``tuner.verify`` pick the winner.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import ray
import ray.exceptions
import ray.tune
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from kaisa_ray.amp import MixedPrecision
from kaisa_ray.errors import ConfigurationError
from kaisa_ray.train.connection import seed_tuner
from kaisa_ray.train.progress import read_progress
from kaisa_ray.train.records import (
    AdaptiveChoice,
    CandidateRow,
    KFACChoice,
    MeasuredRecord,
    RecordKind,
    TunerErrorRecord,
    TunerRecord,
    parse_record,
)
from kaisa_ray.train.shard import Shard, distributed
from kaisa_ray.train.spec import JobSpec, KFACSpec
from kaisa_ray.train.storage import resolve_storage
from kaisa_ray.train.trainer import build_trainer, ensure_ray, unique_run_name
from kaisa_ray.train.worker_config import MeasureConfig, ProfileConfig
from tuner.actor import profile_key, tuner_actor
from tuner.cost import DEFAULT_INTERVALS, Candidate, Decision, NoFeasibleCandidateError, Profile
from tuner.profile import profile_job
from tuner.verify import Measurement, shortlist, verified

__all__ = [
    "TuningOutcome",
    "candidate_rows",
    "choose_in_workers",
    "measure_candidates",
    "tune_job",
]


def _share(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (itself when not distributed)."""
    if not distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def candidate_rows(candidates: Any) -> list[CandidateRow]:
    """The tuner's candidates as the ``tuner`` record's table (plain numbers, ms per step)."""
    rows = []
    for c in candidates:
        row = CandidateRow(
            grad_worker_fraction=c.grad_worker_fraction,
            factor_update_steps=c.factor_update_steps,
            inv_update_steps=c.inv_update_steps,
            memory_bytes=c.memory_bytes,
            kfac_state_bytes=c.kfac_state_bytes,
            ms_per_step=1000 * c.step_s,
            rejected=c.rejected,
        )
        rows.append(row)
    return rows


def _choice(candidate: Candidate, adaptive: AdaptiveChoice | None = None) -> KFACChoice:
    return KFACChoice(
        grad_worker_fraction=candidate.grad_worker_fraction,
        factor_update_steps=candidate.factor_update_steps,
        inv_update_steps=candidate.inv_update_steps,
        adaptive=adaptive,
    )


def adaptive_choice(decision: Decision, target_angle: float) -> AdaptiveChoice | None:
    """The decision's adaptive intervals as the tuner record carries them."""
    plan = decision.adaptive
    if plan is None:
        return None
    return AdaptiveChoice(
        rungs=[tuple(rung) for rung in plan.rungs],  # type: ignore[misc]
        start=plan.start,
        target_angle=target_angle,
        layer_costs={
            name: (cost.factor_s, cost.decomposition_s) for name, cost in plan.layer_costs.items()
        },
        max_seconds=plan.max_seconds,
    )


def choose_in_workers(
    spec: JobSpec,
    kfac: KFACSpec,
    net: nn.Module,
    optimizer: torch.optim.Optimizer,
    shard: Shard,
    device: torch.device,
    precision: MixedPrecision,
) -> tuple[KFACChoice, TunerRecord]:
    """``kfac: auto`` on the job's workers (collective): profile unless the tuner has this
    job's profile, then the tuner's choice, the same on every rank, and its record.

    Raises:
        NoFeasibleCandidateError: nothing fits the budget (on every rank).
    """
    curvature = {
        **kfac.curvature(),
        # Measuring staleness (adaptive intervals) holds sketches and temporaries: profiled.
        "measure_staleness": kfac.adaptive or kfac.measure_staleness,
    }
    compute_method = curvature.pop("compute_method")
    options = {"compute_method": compute_method, **curvature, "precision": spec.precision}
    model = net.module if isinstance(net, DistributedDataParallel) else net
    key = profile_key(model, shard.batch(1)[0], device, options)
    rank = dist.get_rank() if distributed() else 0
    tuner = tuner_actor() if rank == 0 else None
    cached: Profile | None = _share(ray.get(tuner.lookup.remote(key)) if tuner else None)
    seconds = 0.0
    profile = cached
    if profile is None:
        result = profile_job(
            net,
            optimizer,
            lambda i: shard.batch(i + 1),
            nn.functional.cross_entropy,
            device,
            compute_method=compute_method,
            kfac_options=curvature,
            precision=precision,
        )
        profile, seconds = result.profile, result.seconds
    budget = int(spec.memory_budget) if spec.memory_budget is not None else None
    outcome: Decision | ConfigurationError | None = None
    if tuner is not None:
        call = tuner.decide.remote(
            key,
            None if cached is not None else profile,
            budget,
            kfac.max_overhead,
            kfac.ladder() or DEFAULT_INTERVALS,
            kfac.adaptive,
        )
        try:
            outcome = ray.get(call)
        except ray.exceptions.RayTaskError as error:
            if not isinstance(error.cause, ConfigurationError):
                raise
            outcome = error.cause  # the tuner's own error (it pickles): shared, then raised
    outcome = _share(outcome)
    if isinstance(outcome, ConfigurationError):
        raise outcome
    if not isinstance(outcome, Decision):
        raise TypeError(f"the tuner answered {type(outcome).__name__}, not a Decision")
    chosen = _choice(outcome.chosen, adaptive_choice(outcome, kfac.staleness_target))
    record = TunerRecord(
        how=outcome.how,
        cache="hit" if cached is not None else "miss",
        profile_s=seconds,
        budget_bytes=budget,
        base_memory_bytes=profile.base_memory_bytes,
        kfac_transient_bytes=profile.kfac_transient_bytes,
        plain_ms_per_step=1000 * profile.step_s,
        chosen=chosen,
        candidates=candidate_rows(outcome.candidates),
    )
    return chosen, record


# -- from the driver ------------------------------------------------------------------------


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
    chosen = [_choice(c) for c in shortlist(predicted, kfac.verify)]
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
            "chosen": _choice(decision.chosen),
            "candidates": rows,
        }
    )
