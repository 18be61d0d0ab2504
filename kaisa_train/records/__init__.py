"""Every progress record, defined once: what a job's workers and driver send to the progress
sink, and what the driver, the CLI, the service and the dashboard read back.

A record is a frozen pydantic model with a ``kind`` from ``RecordKind``, one class per kind.
Producers build the class and push ``record.wire()`` (a JSON-ready dict); consumers turn what
they read into the class again with ``parse_record``. The progress sink adds ``seq`` (the
record's number in its run) and ``time`` (when the sink took it). A field with a default is on
the wire only when its producer set it (``resumed_from`` on a resumed run's ``start``, the
measured columns of a verified candidate), so a reader can tell "not measured" from "zero".

The closed sets the records carry are here too: a trial's ``TrialState``, a sweep's
``SweepMetric`` (with the ``Direction`` that is better) and the metrics a trial reports
(``TRIAL_METRICS``). The dashboard receives all of them from ``GET /v1/registry``.

This module imports pydantic and the core's enums only (no torch, no Ray): the service's
client commands read records too.

The package holds one module per family (``base``: the kind, the shared fields and the closed
sets; ``training``; ``tuning``: ``kfac: auto`` and the intervals; ``sweeps``); import from the
package. A new kind: add a member to ``RecordKind``, a class in its family's module with
``kind: Literal[RecordKind.X]``, and the class to ``Record`` here;
``tests/test_definitions.py`` checks the three agree.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import Field, TypeAdapter, ValidationError

from kaisa_train.records.base import (
    PHASE_FIELDS,
    TRIAL_METRICS,
    Direction,
    RecordKind,
    SweepMetric,
    TrialState,
    Unit,
)
from kaisa_train.records.sweeps import SweepRecord, SweepStartRecord, TrialOutcome, TrialRecord
from kaisa_train.records.training import (
    EVAL_LATEST,
    STEP_LATEST,
    CheckpointRecord,
    EndRecord,
    EvalRecord,
    LatestMetrics,
    ProfilingRecord,
    StartRecord,
    StepRecord,
    WorkerRecord,
)
from kaisa_train.records.tuning import (
    AdaptiveChoice,
    CandidateRow,
    IntervalChangeRow,
    IntervalsRecord,
    KFACChoice,
    LayerIntervals,
    MeasuredRecord,
    TunerErrorRecord,
    TunerRecord,
)

__all__ = [
    "EVAL_LATEST",
    "PHASE_FIELDS",
    "STEP_LATEST",
    "TRIAL_METRICS",
    "AdaptiveChoice",
    "CandidateRow",
    "CheckpointRecord",
    "Direction",
    "EndRecord",
    "EvalRecord",
    "IntervalChangeRow",
    "IntervalsRecord",
    "KFACChoice",
    "LatestMetrics",
    "LayerIntervals",
    "MeasuredRecord",
    "ProfilingRecord",
    "Record",
    "RecordKind",
    "StartRecord",
    "StepRecord",
    "SweepMetric",
    "SweepRecord",
    "SweepStartRecord",
    "TrialOutcome",
    "TrialRecord",
    "TrialState",
    "TunerErrorRecord",
    "TunerRecord",
    "Unit",
    "WorkerRecord",
    "parse_record",
    "try_record",
]


Record = Annotated[
    WorkerRecord
    | ProfilingRecord
    | StartRecord
    | StepRecord
    | EvalRecord
    | CheckpointRecord
    | EndRecord
    | TunerRecord
    | TunerErrorRecord
    | MeasuredRecord
    | IntervalsRecord
    | SweepStartRecord
    | TrialRecord
    | SweepRecord,
    Field(discriminator="kind"),
]
"""Any record, told apart by its ``kind``."""

RECORD: TypeAdapter[Record] = TypeAdapter(Record)


def parse_record(data: Mapping[str, Any]) -> Record:
    """The record ``data`` holds (a dict from the sink or an event stream).

    Raises:
        pydantic.ValidationError: not a record of a known kind, or a field of the wrong type.
    """
    return RECORD.validate_python(data)


def try_record(data: Any) -> tuple[Record | None, str | None]:
    """``parse_record`` that says what was wrong instead of raising: (record, None) or
    (None, the problem)."""
    try:
        return parse_record(data), None
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors()
        )
        kind = data.get("kind") if isinstance(data, Mapping) else None
        return None, f"a {kind!r} record that does not read ({problems}): dropped"
