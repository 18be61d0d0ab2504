"""``interpret`` reads a batch of progress records as their classes: a job's latest metrics
and its tuner record come out typed (``LatestMetrics``, ``TunerRecord``), not as dicts."""

from __future__ import annotations

from kaisa_train.records import (
    CheckpointRecord,
    EvalRecord,
    LatestMetrics,
    StartRecord,
    StepRecord,
)
from service.domain.interpretation import interpret
from tests.support.service_app import TUNER
from tests.support.sweep_data import numbered, queued


def test_latest_metrics_take_the_newest_step_and_evaluation_fields() -> None:
    records = [
        StartRecord(total_steps=100).wire(),
        StepRecord(step=10, loss=2.0, accuracy=0.3, ms_per_step=5.0).wire(),
        EvalRecord(step=10, test_accuracy=0.5, test_loss=1.2, train_s=3.0).wire(),
        StepRecord(step=20, loss=1.5).wire(),  # no accuracy: the earlier one stays
        CheckpointRecord(step=20, path="/tmp/ckpt").wire(),
    ]
    reading = interpret(queued(), numbered(records, 0), len(records))
    latest = reading.progress.latest
    assert isinstance(latest, LatestMetrics)
    assert latest.numbers() == {
        "step": 20,
        "checkpoint_step": 20,
        "loss": 1.5,
        "accuracy": 0.3,
        "ms_per_step": 5.0,
        "test_accuracy": 0.5,
        "test_loss": 1.2,
    }  # train_s is an evaluation's field the latest metrics do not keep


def test_a_batch_without_step_or_evaluation_records_leaves_the_latest_metrics_alone() -> None:
    reading = interpret(queued(), numbered([StartRecord().wire()], 0), 1)
    assert reading.progress.latest is None


def test_the_tuner_record_comes_out_as_its_class() -> None:
    reading = interpret(queued(), numbered([TUNER.wire()], 0), 1)
    assert reading.progress.tuner is not None
    assert reading.progress.tuner.values() == TUNER.values()
    assert reading.progress.tuner.chosen == TUNER.chosen
