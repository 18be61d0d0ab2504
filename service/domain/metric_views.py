"""What the dashboard shows of a job's records: each metric's field, the record kind it comes
in, its label and unit, the chart that draws it, the job list's column and the job page's
facts; and a sweep's trial columns. Defined here against the record classes (a test checks
every field exists on its class), served in ``GET /v1/registry``, so that the page's scripts
name no field of a record.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from kaisa_ray.enums import EvalMetric
from kaisa_train.records import EvalRecord, RecordKind, StepRecord, TrialRecord, Unit

__all__ = ["CHARTS", "COLUMNS", "METRICS", "ChartView", "ColumnView", "MetricView"]


class MetricView(BaseModel):
    """One field of a record as the page shows it."""

    kind: RecordKind = Field(description="the record kind that carries it")
    field: str = Field(description="its name in the record (and in a job's latest metrics)")
    label: str
    unit: Unit
    chart: str | None = Field(default=None, description="the chart that draws it, if any")
    column: str | None = Field(
        default=None,
        description="the job list's column it fills (the first one a job has, in order)",
    )
    fact: bool = Field(default=False, description="shown among a running job's facts")


class ChartView(BaseModel):
    id: str
    title: str
    y: str = Field(description="the y axis's title")
    unit: Unit


class ColumnView(BaseModel):
    id: str
    label: str


CHARTS = [
    ChartView(id="loss", title="Loss", y="loss", unit=Unit.VALUE),
    ChartView(id="accuracy", title="Accuracy", y="accuracy", unit=Unit.FRACTION),
    ChartView(id="throughput", title="Throughput", y="samples / s", unit=Unit.PER_SECOND),
]
COLUMNS = [ColumnView(id="loss", label="loss"), ColumnView(id="accuracy", label="accuracy")]

_STEP, _EVAL, _TRIAL = RecordKind.STEP, RecordKind.EVAL, RecordKind.TRIAL
METRICS = [
    MetricView(
        kind=_STEP,
        field="loss",
        label="training loss",
        unit=Unit.VALUE,
        chart="loss",
        column="loss",
        fact=True,
    ),
    MetricView(
        kind=_EVAL,
        field=EvalMetric.TEST_LOSS.value,
        label="test loss",
        unit=Unit.VALUE,
        chart="loss",
    ),
    MetricView(
        kind=_EVAL,
        field=EvalMetric.TEST_ACCURACY.value,
        label="test accuracy",
        unit=Unit.FRACTION,
        chart="accuracy",
        column="accuracy",
        fact=True,
    ),
    MetricView(
        kind=_STEP,
        field="accuracy",
        label="training accuracy",
        unit=Unit.FRACTION,
        chart="accuracy",
        column="accuracy",
    ),
    MetricView(
        kind=_STEP,
        field="samples_per_s",
        label="samples / s",
        unit=Unit.PER_SECOND,
        chart="throughput",
        fact=True,
    ),
    MetricView(kind=_STEP, field="ms_per_step", label="ms / step", unit=Unit.MS, fact=True),
    MetricView(
        kind=_STEP, field="kfac_ms_per_step", label="K-FAC ms / step", unit=Unit.MS, fact=True
    ),
    MetricView(
        kind=_STEP,
        field="data_wait_ms",
        label="waiting for data, ms / step",
        unit=Unit.MS,
        fact=True,
    ),
    MetricView(
        kind=_STEP, field="skipped_rows", label="records skipped", unit=Unit.VALUE, fact=True
    ),
    MetricView(
        kind=_TRIAL, field=EvalMetric.TEST_ACCURACY.value, label="test accuracy", unit=Unit.FRACTION
    ),
    MetricView(kind=_TRIAL, field=EvalMetric.TEST_LOSS.value, label="test loss", unit=Unit.VALUE),
    MetricView(kind=_TRIAL, field="train_s", label="training time", unit=Unit.SECONDS),
]

RECORD_CLASSES = {_STEP: StepRecord, _EVAL: EvalRecord, _TRIAL: TrialRecord}
