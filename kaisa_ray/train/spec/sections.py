"""The job's small sections: ``dataset``, ``optimizer`` (and its ``schedule``), ``scaling``,
``stop`` (and its ``target``) and ``checkpoint``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    Field,
    field_validator,
    model_validator,
)

from kaisa_ray.enums import (
    EvalMetric,
    OptimizerName,
    Parallel,
)
from kaisa_ray.train.data_roots import check_root
from kaisa_ray.train.registry import dataset_entry, dataset_names
from kaisa_ray.train.spec.bounds import (
    LIMITS,
    MAX_GPUS_PER_WORKER,
    MAX_STEPS,
    MAX_WORKERS,
    Steps,
    StrictModel,
)


class DatasetSpec(StrictModel):
    name: Annotated[str, Field(max_length=64)]
    data_dir: Path | None = None
    batch_size: Annotated[int, Field(gt=0, le=65536)] = 128
    limit: Annotated[int, Field(gt=0, le=10**9)] | None = None

    @field_validator("data_dir")
    @classmethod
    def _short_path(cls, path: Path | None) -> Path | None:
        if path is not None and len(str(path)) > 4096:
            raise ValueError(f"a path of {len(str(path))} characters: {LIMITS['dataset.data_dir']}")
        return path

    @model_validator(mode="after")
    def _available(self) -> DatasetSpec:
        try:
            entry = dataset_entry(self.name)
        except KeyError:
            raise ValueError(
                f"unknown dataset {self.name!r}; choose one of {', '.join(dataset_names())}, "
                "or register your own under the 'kaisa_ray.datasets' entry point"
            ) from None
        directory = self.data_dir or entry.default_dir
        if directory is not None and (self.data_dir is not None or entry.needs_files):
            # A service's data roots, before anything looks at the folder: a refusal must not
            # tell whether it exists (kaisa_ray.train.data_roots).
            check_root(directory)
        if entry.needs_files:
            if directory is None:
                raise ValueError(f"dataset {self.name!r} needs data_dir: {entry.install_hint}")
            if not directory.is_dir():
                raise ValueError(
                    f"data directory {directory} of dataset {self.name!r} does not exist: "
                    f"{entry.install_hint}"
                )
        return self


class ScheduleSpec(StrictModel):
    kind: Literal["constant", "cosine", "step"] = "constant"
    warmup_steps: Annotated[int, Field(ge=0, le=MAX_STEPS)] = 0
    step_every: Steps | None = None
    gamma: Annotated[float, Field(gt=0, le=1)] = 0.1


PEER_OPTIMIZERS = tuple(name for name in OptimizerName if name.peer)


"""Optimizers that precondition the gradient themselves, from heavyball (the ``peers``
extra), for comparing K-FAC with what a user would try instead: SOAP, Muon (with AdamW for
the parameters of fewer than 2 dimensions) and PSGD Kron, at heavyball's defaults but
``lr`` and ``weight_decay``. They run with ``kfac: off``."""


def _trained_here(name: OptimizerName) -> OptimizerName:
    if not name.trainable:
        trainable = ", ".join(n for n in OptimizerName if n.trainable)
        raise ValueError(
            f"optimizer {name} is priced by kaisa-ray plan but no job here trains with it: "
            f"name one of {trainable} (adamw is the closest)"
        )
    return name


class OptimizerSpec(StrictModel):
    name: Annotated[
        OptimizerName,
        AfterValidator(_trained_here),
        Field(
            description=(
                "``sgd``, ``adam`` or ``adamw``, from torch, preconditioned by K-FAC; "
                "``soap``, ``muon`` or ``psgd-kron``, the peers, with ``kfac: off`` (the "
                "``peers`` extra); ``lamb`` is for ``kaisa-ray plan`` only (no job trains with it)."
            )
        ),
    ] = OptimizerName.SGD
    lr: Annotated[float, Field(gt=0, le=1e4)] = 0.05
    momentum: Annotated[float, Field(ge=0, lt=1)] = 0.9
    nesterov: bool = True
    weight_decay: Annotated[float, Field(ge=0, le=10)] = 0.0
    schedule: ScheduleSpec = ScheduleSpec()


class ScalingSpec(StrictModel):
    """The job's workers. ``placement`` spreads them over Ray's nodes: ``pack`` (fill a node
    first, the default), ``spread`` (one per node where possible), ``strict-pack`` (all on
    one node) or ``strict-spread`` (one per node, or wait for enough nodes).
    ``resource_timeout_s``: how long the worker group may wait for its resources, at the start
    and after losing a node, before the job fails saying so; unset, it waits as long as it
    takes (an autoscaling cluster adds nodes), except in a sweep's trials (120 s).
    ``parallel``: ``ddp`` (every worker holds the whole model) or ``fsdp`` (FSDP2 shards the
    parameters, gradients and optimizer state by rows over the workers; docs/fsdp.md)."""

    workers: Annotated[int, Field(gt=0, le=MAX_WORKERS)] = 1
    gpus_per_worker: Annotated[float, Field(ge=0, le=MAX_GPUS_PER_WORKER)] = 0
    cpus_per_worker: Annotated[float, Field(gt=0, le=1024)] = 1
    placement: Literal["pack", "spread", "strict-pack", "strict-spread"] = "pack"
    resource_timeout_s: Annotated[float, Field(gt=0, le=7 * 24 * 3600)] | None = None
    parallel: Parallel = Parallel.DDP

    @property
    def placement_strategy(self) -> str:
        """Ray's name for ``placement`` (``STRICT_SPREAD``...)."""
        return self.placement.upper().replace("-", "_")


class TargetSpec(StrictModel):
    metric: EvalMetric = EvalMetric.TEST_ACCURACY
    value: Annotated[float, Field(ge=0, le=1e6)]

    @model_validator(mode="after")
    def _in_range(self) -> TargetSpec:
        if self.metric is EvalMetric.TEST_ACCURACY and self.value > 1:
            raise ValueError(
                f"a test_accuracy target of {self.value:g} is never met: accuracy is between 0 "
                "and 1 (write 0.88 for 88%)"
            )
        return self


class StopSpec(StrictModel):
    max_steps: Steps | None = None
    max_epochs: Annotated[int, Field(gt=0, le=10**6)] | None = None
    target: TargetSpec | None = None

    @model_validator(mode="after")
    def _one_limit(self) -> StopSpec:
        if (self.max_steps is None) == (self.max_epochs is None):
            raise ValueError("give exactly one of max_steps and max_epochs")
        return self


class CheckpointSpec(StrictModel):
    every_steps: Steps = 200
    keep: Annotated[int, Field(gt=0, le=100)] = 2
