"""The records of a training run: a worker started, training began, a window of steps, an
evaluation, a checkpoint, the end; and what a job keeps of them as its latest metrics."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kaisa_ray.enums import EvalMetric
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


class LatestMetrics(BaseModel):
    """A job's latest metrics: the newest step record's window, the newest evaluation, the
    step reached and the step of the newest checkpoint. Fields no record has set yet are
    unset (``numbers`` leaves them out); each field means what the record's field means."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    step: int | None = Field(default=None, description="the step reached")
    checkpoint_step: int | None = Field(default=None, description="the newest checkpoint's step")
    loss: float | None = None
    accuracy: float | None = Field(default=None, description="training accuracy")
    lr: float | None = None
    samples_per_s: float | None = Field(default=None, description="over every worker")
    ms_per_step: float | None = None
    kfac_ms_per_step: float | None = None
    data_wait_ms: float | None = Field(default=None, description="per step, waiting for data")
    skipped_rows: int | None = Field(default=None, description="records skipped so far")
    test_loss: float | None = None
    test_accuracy: float | None = None

    def taking(self, record: StepRecord | EvalRecord) -> LatestMetrics:
        """These metrics with what ``record`` set of them (its step aside)."""
        names = (STEP_LATEST if isinstance(record, StepRecord) else EVAL_LATEST) & (
            record.model_fields_set
        )
        return self.model_copy(update={name: getattr(record, name) for name in names})

    def numbers(self) -> dict[str, float | int | None]:
        """The fields set, by name (what the API shows and the store keeps)."""
        return self.model_dump(exclude_unset=True)


STEP_LATEST = frozenset(
    {
        "loss",
        "accuracy",
        "lr",
        "samples_per_s",
        "ms_per_step",
        "kfac_ms_per_step",
        "data_wait_ms",
        "skipped_rows",
    }
)
"""The fields of a step record a job's latest metrics keep."""
EVAL_LATEST = frozenset({EvalMetric.TEST_LOSS.value, EvalMetric.TEST_ACCURACY.value})
"""The fields of an evaluation record a job's latest metrics keep."""
