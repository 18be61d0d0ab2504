"""``kfac: auto`` in the workers: every rank profiles the job (collectives), rank 0 asks the
tuner actor to choose (``tuner.choice.choose``) and shares the answer, so every rank makes the
same choice. The tuner caches profiles by ``profile_key``: when it has this job's, nobody
profiles. What the driver does with the tuner (``kaisa-ray tune``, verification) is
``kaisa_train.tuning``; this module is what a worker needs, and nothing of the driver's.
"""

from __future__ import annotations

import statistics
from typing import Any

import ray
import ray.exceptions
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from kaisa_ray.amp import MixedPrecision
from kaisa_ray.errors import ConfigurationError
from kaisa_train.records import AdaptiveChoice, CandidateRow, KFACChoice, TunerRecord
from kaisa_train.shard import AnyShard, distributed
from kaisa_train.spec import JobSpec, KFACSpec
from kaisa_train.stream_shard import StreamShard
from tuner.actor import tuner_actor
from tuner.choice import DEFAULT_INTERVALS, Decision
from tuner.cost import Candidate, Profile
from tuner.keys import profile_key
from tuner.profile import profile_job

__all__ = ["adaptive_choice", "candidate_rows", "choose_in_workers", "kfac_choice"]


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


def kfac_choice(candidate: Candidate, adaptive: AdaptiveChoice | None = None) -> KFACChoice:
    """A tuner candidate as the records carry a choice."""
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
    shard: AnyShard,
    device: torch.device,
    precision: MixedPrecision,
) -> tuple[KFACChoice, TunerRecord]:
    """``kfac: auto`` on the job's workers (collective): profile unless the tuner has this
    job's profile, then the tuner's choice, the same on every rank, and its record.

    Raises:
        NoFeasibleCandidateError: nothing fits the budget (on every rank).
    """
    # The job's own preconditioner options (measuring staleness, for one, holds sketches and
    # temporaries: profiled).
    curvature = kfac.preconditioner_options()
    compute_method = curvature.pop("compute_method")
    options = {"compute_method": compute_method, **curvature, "precision": spec.precision}
    model = net.module if isinstance(net, DistributedDataParallel) else net
    first_x, first_y = shard.batch(1)
    key = profile_key(model, first_x, device, options)
    rank = dist.get_rank() if distributed() else 0
    tuner = tuner_actor() if rank == 0 else None
    cached: Profile | None = _share(ray.get(tuner.lookup.remote(key)) if tuner else None)
    seconds = 0.0
    profile = cached
    waits: list[float] = []  # each profiled batch's wait for its data

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        before = shard.waited_s
        pair = shard.batch(i + 1)
        waits.append(shard.waited_s - before)
        return pair

    window = None
    if isinstance(shard, StreamShard):
        row = (
            first_x[0].numel() * first_x.element_size()
            + first_y[0].numel() * first_y.element_size()
        )
        window = shard.window_bytes(row)
    if profile is None:
        result = profile_job(
            net,
            optimizer,
            batch,
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
            window if window is not None and device.type == "cpu" else 0,
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
    chosen = kfac_choice(outcome.chosen, adaptive_choice(outcome, kfac.staleness_target))
    wait_ms = None
    if isinstance(shard, StreamShard) and len(waits) > 2:
        wait_ms = 1000 * statistics.median(waits[2:])  # the first ones start the pipeline
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
        data_window_bytes=window,
        data_ms_per_batch=wait_ms,
        data_note=None if wait_ms is None else data_note(wait_ms, 1000 * profile.step_s),
    )
    return chosen, record


DATA_BOUND_SHARE = 0.1
"""A step that waits longer than this share of itself for its batch is the data's to speed."""


def data_note(wait_ms: float, step_ms: float) -> str | None:
    """What a streamed job's profile says of its data pipeline, when it did not keep up."""
    if wait_ms <= DATA_BOUND_SHARE * step_ms:
        return None
    return (
        f"the data pipeline did not keep up: each step waited {wait_ms:.0f} ms of its "
        f"{step_ms:.0f} ms for its batch while profiling. Give Ray Data more CPUs (a cluster "
        "with CPUs the workers do not hold, or a lower scaling.cpus_per_worker), store the "
        "data pre-decoded (Parquet of pixels rather than PNGs), or lower dataset.image.size"
    )
