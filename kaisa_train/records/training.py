"""The records of a training run: a worker started, training began, a window of steps, an
evaluation, a checkpoint, the end."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kaisa_train.records.base import BaseRecord, RecordKind


class WorkerRecord(BaseRecord):
    kind: Literal[RecordKind.WORKER] = RecordKind.WORKER
    rank: int
    world: int | None = None
    pid: int | None = None
    device: str | None = None
    node: str | None = Field(default=None, description="the Ray node the worker runs on")


class ProfilingRecord(BaseRecord):
    kind: Literal[RecordKind.PROFILING] = RecordKind.PROFILING


class StartRecord(BaseRecord):
    kind: Literal[RecordKind.START] = RecordKind.START
    total_steps: int | None = None
    from_step: int = 0
    resumed_from: str | None = Field(default=None, description="the checkpoint it resumed from")


class StepRecord(BaseRecord):
    """The mean over the steps since the previous step record (rank 0's view)."""

    kind: Literal[RecordKind.STEP] = RecordKind.STEP
    step: int
    epoch: int | None = None
    loss: float | None = None
    accuracy: float | None = Field(default=None, description="training accuracy")
    lr: float | None = None
    samples_per_s: float | None = Field(default=None, description="over every worker")
    ms_per_step: float | None = None
    data_wait_ms: float | None = Field(
        default=None, description="per step, waiting for the batch (within ms_per_step)"
    )
    skipped_rows: int | None = Field(
        default=None, description="records skipped as unreadable so far (bad_records: skip)"
    )
    kfac_ms_per_step: float | None = None
    kfac_factors_ms: float | None = None
    kfac_decompositions_ms: float | None = None
    kfac_precondition_ms: float | None = None
    kfac_communication_ms: float | None = None
    kfac_staleness_ms: float | None = Field(
        default=None, description="measuring the curvature's staleness (its all-reduce aside)"
    )
    damping: float | None = Field(
        default=None,
        description="the quadratic model's damping after the window's last step "
        "(kfac.update: quadratic-model; lr is then its step size, alpha)",
    )
    momentum: float | None = Field(
        default=None, description="the quadratic model's momentum on the window's last step"
    )


class EvalRecord(BaseRecord):
    kind: Literal[RecordKind.EVAL] = RecordKind.EVAL
    step: int
    test_loss: float | None = None
    test_accuracy: float | None = None
    elapsed_s: float | None = Field(default=None, description="since this attempt began")
    train_s: float | None = Field(default=None, description="in training steps, this attempt")


class CheckpointRecord(BaseRecord):
    kind: Literal[RecordKind.CHECKPOINT] = RecordKind.CHECKPOINT
    step: int
    path: str | None = Field(default=None, description="where Ray Train keeps it")


class EndRecord(BaseRecord):
    kind: Literal[RecordKind.END] = RecordKind.END
    step: int
