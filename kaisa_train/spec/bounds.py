"""DOC_base"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

from pydantic import (
    ConfigDict,
    Field,
)

from kaisa_train.strict_numbers import NoBooleanNumbers

PositiveInt = Annotated[int, Field(gt=0)]


PositiveFloat = Annotated[float, Field(gt=0)]


# Upper bounds. Every number a job may hold is bounded, so that no value can overflow the
# job store's 64-bit integers, ask Ray for the impossible, or make validation itself slow
# (a check never does work that grows with a number a user sent). Each bound's reason is in
# ``LIMITS`` and goes into the error message (and docs/jobspec.md).
MAX_STEPS = 10**9


MAX_WORKERS = 4096


MAX_GPUS_PER_WORKER = 16


MAX_SEED = 2**32 - 1


STEPS_REASON = (
    "a billion steps is years of training at any speed; larger counts would overflow the "
    "service's step counters"
)


LIMITS: dict[str, str] = {
    "dataset.batch_size": "a worker's batch beyond 65536 samples does not fit a worker's memory",
    "dataset.limit": "no dataset here has more than a billion samples",
    "dataset.data_dir": "a path longer than the system's 4096-byte limit cannot exist",
    "optimizer.lr": "a learning rate above 10000 only diverges",
    "optimizer.weight_decay": "a weight decay above 10 erases the weights",
    "optimizer.precondition_frequency": "an interval above a million steps never refreshes",
    "optimizer.schedule.warmup_steps": STEPS_REASON,
    "optimizer.schedule.step_every": STEPS_REASON,
    "kfac.factor_update_steps": "an interval above a million steps never updates the factors",
    "kfac.inv_update_steps": "an interval above a million steps never updates the inverses",
    "kfac.damping": "a damping above 1e6 turns K-FAC off (use kfac: off instead)",
    "kfac.kl_clip": "a KL clip above 1e6 never clips (use kl_clip: null instead)",
    "kfac.max_overhead": "K-FAC's time over the plain step's; 1000 already allows anything",
    "kfac.intervals": "the tuner tries every pair: at most 16 pairs, each interval at most a "
    "million steps",
    "scaling.workers": f"no job may ask for more than {MAX_WORKERS} workers; the service allows "
    "at most its own maximum (kaisa-ray serve --max-workers)",
    "scaling.gpus_per_worker": f"no node has more than {MAX_GPUS_PER_WORKER} GPUs for one "
    "worker; the service allows at most its own maximum (--max-gpus-per-worker)",
    "scaling.cpus_per_worker": "no node has more than 1024 CPUs for one worker",
    "scaling.resource_timeout_s": "at most a week (604800 s); leave it out to wait as long as "
    "it takes",
    "stop.max_steps": STEPS_REASON,
    "stop.max_epochs": "a million epochs is years of training; the steps they make must fit "
    "the service's step counters",
    "stop.target.value": "an accuracy is between 0 and 1 and a loss at most 1e6",
    "checkpoint.every_steps": STEPS_REASON,
    "checkpoint.keep": "each checkpoint is a full copy of the model and optimizer state: keep "
    "at most 100",
    "eval_every": STEPS_REASON,
    "max_failures": "each failure restarts the whole worker group: more than 100 means the "
    "job cannot run",
    "seed": f"seeds are 32-bit (0 to {MAX_SEED}), as numpy's are",
    "memory_budget": "at most 1 PiB per worker",
    "sweep.space": "a sweep searches at most 32 fields",
    "sweep.trials": "a sweep runs at most 1024 trials",
    "sweep.concurrent": "at most 64 trials at once (each takes the job's workers)",
    "sweep.seed": f"seeds are 32-bit (0 to {MAX_SEED})",
    "sweep.asha.grace_steps": STEPS_REASON,
    "sweep.asha.reduction_factor": "a reduction factor above 100 stops every trial at once",
    "sweep.space.*.choice": "a choice among at most 64 values",
    "sweep.space.*.randint": "randint draws 32-bit integers",
    "sweep.space.*.loguniform": "the range's ends are at most 1e12 in size",
    "sweep.space.*.uniform": "the range's ends are at most 1e12 in size",
    "model.params": "a model's parameters are checked against its constructor",
    "name": "a job's name is at most 64 letters, digits and '_.-', starting with one of the "
    "first two",
}


AUTO = "auto"


"""``kfac.strategy: auto``: the tuner chooses the strategy and the intervals."""


# kfac.min_damping's default: the quadratic-model step's damping floor. kfac-jax's (and the
# library's) 1e-8 lets the damping collapse at small batches (benchmarks/batch_size_study.py at
# 128, benchmarks/transformer_fortunes.py); 1e-3 trains there and changes no step count at 2048
# and 8192.
JOBSPEC_MIN_DAMPING = 1e-3


Steps = Annotated[int, Field(gt=0, le=MAX_STEPS)]


Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]


Big = 1e12


class StrictModel(NoBooleanNumbers):
    # Numbers are numbers (``true`` is refused where a number belongs). Floats must be
    # finite: JSON's Infinity and NaN, and 1e309 (which parses as infinity), are refused
    # rather than stored and shown back as null.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


REFERENCE = "docs/jobspec.md"


def limit_reason(path: Sequence[str]) -> str | None:
    """Why the field at ``path`` (dotted parts; list indexes and sweep-space names included)
    is bounded, from ``LIMITS``: its own entry, else its nearest parent's."""
    parts = list(path)
    if parts[:2] == ["sweep", "space"] and len(parts) >= 4:
        parts = ["sweep", "space", "*", *parts[3:]]
    while parts:
        key = ".".join(p for p in parts if not p.isdigit())
        if key in LIMITS:
            return LIMITS[key]
        parts.pop()
    return None
