"""``JobSpec``: the one description of a training job shared by every front door.

Loaded from YAML or JSON (the job file of ``ray job submit``, the body of a REST request), and
validated before anything starts: every bad field is reported at once, each with what is
wrong and how to fix it. Pydantic stays at this boundary: the workers get the validated, frozen
``JobSpec`` itself (``worker_config.py``) and never validate it again.

Example (YAML)::

    name: fashion-kfac
    model: {name: lenet}
    dataset: {name: fashion-mnist, batch_size: 128}
    optimizer: {name: sgd, lr: 0.05, momentum: 0.9, nesterov: true}
    kfac: {strategy: comm-opt, factor_update_steps: 5, inv_update_steps: 50, damping: 0.1}
    memory_budget: 2GiB
    scaling: {workers: 2}
    stop: {max_steps: 1000, target: {metric: test_accuracy, value: 0.88}}

A module per concern: ``bounds`` (the bounds and their reasons), ``model_params`` (a model and
its constructor's parameters), ``sections`` (dataset, optimizer, scaling, stop, checkpoint),
``kfac``, ``sweep_section`` and ``job_spec`` (the job as a whole, parsing, errors).
"""

from __future__ import annotations

from kaisa_train.spec.bounds import (
    AUTO,
    JOBSPEC_MIN_DAMPING,
    LIMITS,
    MAX_GPUS_PER_WORKER,
    MAX_SEED,
    MAX_STEPS,
    MAX_WORKERS,
    REFERENCE,
    limit_reason,
)
from kaisa_train.spec.job_spec import (
    JobSpec,
    JobSpecError,
    field_problems,
    load_job_spec,
    parse_job_spec,
    sweep_problems,
    trial_spec,
)
from kaisa_train.spec.kfac import KFACSpec
from kaisa_train.spec.model_params import ModelSpec, constructor_params
from kaisa_train.spec.sections import (
    PEER_OPTIMIZERS,
    CheckpointSpec,
    DatasetSpec,
    OptimizerSpec,
    ScalingSpec,
    ScheduleSpec,
    StopSpec,
    TargetSpec,
)
from kaisa_train.spec.sweep_section import DISTRIBUTIONS, AshaSpec, Distribution, SweepSpec

__all__ = [
    "AUTO",
    "DISTRIBUTIONS",
    "JOBSPEC_MIN_DAMPING",
    "LIMITS",
    "MAX_GPUS_PER_WORKER",
    "MAX_SEED",
    "MAX_STEPS",
    "MAX_WORKERS",
    "PEER_OPTIMIZERS",
    "REFERENCE",
    "AshaSpec",
    "CheckpointSpec",
    "DatasetSpec",
    "Distribution",
    "JobSpec",
    "JobSpecError",
    "KFACSpec",
    "ModelSpec",
    "OptimizerSpec",
    "ScalingSpec",
    "ScheduleSpec",
    "StopSpec",
    "SweepSpec",
    "TargetSpec",
    "constructor_params",
    "field_problems",
    "limit_reason",
    "load_job_spec",
    "parse_job_spec",
    "sweep_problems",
    "trial_spec",
]
