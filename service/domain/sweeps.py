"""A sweep job's state (``service.model.sweep_state.SweepState``), built from the sweep's
progress-sink records (``SweepStartRecord``, ``TrialRecord`` and ``SweepRecord`` of
``kaisa_train.records``; ``kaisa_train.sweep`` pushes them under the job's id).

``plan`` is the state before any record, from the JobSpec's ``sweep`` section; ``merge`` is
pure: it returns a new state and never changes the one it is given (a ``Job`` from the store
is a snapshot).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

from kaisa_train.records import (
    TRIAL_METRICS,
    SweepMetric,
    SweepRecord,
    SweepStartRecord,
    TrialOutcome,
    TrialRecord,
    TrialState,
)
from service.model.sweep_state import SweepState, TrialEntry

SweepRecords = SweepStartRecord | TrialRecord | SweepRecord


def plan(section: Mapping[str, Any] | None) -> SweepState:
    """The state with no trials yet, from a JobSpec's ``sweep`` section (as JSON): what the
    sweep's ``sweep-start`` record will say (empty fields where there is no section)."""
    section = section or {}
    metric = SweepMetric(section.get("metric") or SweepMetric.TEST_ACCURACY)
    return SweepState(
        trials_planned=section.get("trials"),
        concurrent=section.get("concurrent"),
        metric=metric,
        mode=section.get("mode") or metric.direction,
        space={
            # As the sweep-start record has them: only the distribution given (the stored
            # spec has the others too, as null).
            str(path): {k: copy.deepcopy(v) for k, v in dict(d).items() if v is not None}
            for path, d in (section.get("space") or {}).items()
            if isinstance(d, Mapping)
        },
    )


def merge(view: SweepState | None, record: SweepRecords, *, spec: Mapping[str, Any]) -> SweepState:
    """``view`` with one sweep record merged in (a new state). A record that comes before
    any plan (``view`` None) starts from the plan in the job's ``spec``."""
    merged = view.model_copy(deep=True) if view is not None else plan(spec.get("sweep"))
    # The fields its producer set, with every NaN (a diverged trial's loss) as None.
    data = finite(record.wire())
    if isinstance(record, SweepStartRecord):
        _start(merged, record, data)
    elif isinstance(record, TrialRecord):
        _update(merged.trials.setdefault(record.trial, TrialEntry()), data, data, ())
    else:
        _result(merged, record, data)
    return merged


def finite(value: Any) -> Any:
    """``value`` with every NaN or infinity (a diverged trial's loss) replaced by None, inside
    lists and dicts too: JSON has no such numbers, and a browser's ``JSON.parse`` refuses
    Python's ``NaN``."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def ended(view: SweepState | None) -> int:
    """How many of the state's trials are over."""
    return 0 if view is None else view.trials_ended


def _start(view: SweepState, record: SweepStartRecord, data: Mapping[str, Any]) -> None:
    if record.trials is not None:
        view.trials_planned = record.trials
    if record.concurrent is not None:
        view.concurrent = record.concurrent
    if record.metric is not None:
        view.metric = record.metric
    if record.mode is not None:
        view.mode = record.mode
    if isinstance(data.get("space"), Mapping):
        view.space = copy.deepcopy(dict(data["space"]))


def _update(
    entry: TrialEntry,
    source: Mapping[str, Any],
    metrics: Mapping[str, Any],
    names: tuple[str, ...],
) -> None:
    """Merge what ``source`` (a trial record or a trial's outcome, as JSON) says into the
    trial's entry: the fields it has, and of ``names`` those it sets."""
    state = source.get("state")
    # A trial that is over stays over: a late RUNNING record (an evaluation pushed before the
    # end but read after it) does not bring it back.
    if state in set(TrialState) and not (entry.state.ended and state == TrialState.RUNNING):
        entry.state = TrialState(state)
    if isinstance(source.get("params"), Mapping):
        entry.params = dict(source["params"])
    if source.get("step") is not None:
        entry.step = int(source["step"])
    found = {name: metrics[name] for name in TRIAL_METRICS if name in metrics}
    if found:
        entry.metrics = {**entry.metrics, **found}
    if source.get("error") is not None:
        entry.error = str(source["error"])
    for name in names:
        if source.get(name) is not None:
            setattr(entry, name, source[name])


def _result(view: SweepState, record: SweepRecord, data: Mapping[str, Any]) -> None:
    if record.metric is not None:
        view.metric = record.metric
    if record.mode is not None:
        view.mode = record.mode
    if data.get("seconds") is not None:
        view.seconds = float(data["seconds"])
    for outcome in data.get("trials") or []:
        entry = view.trials.setdefault(str(outcome["trial_id"]), TrialEntry())
        _update(entry, outcome, outcome.get("metrics") or {}, ("value", "checkpoint", "run"))
    # The best trial as the JSON has it (its NaN as None), not as the record does.
    view.best = None if record.best is None else TrialOutcome.model_validate(data["best"])
    best_spec = data.get("best_spec")
    view.best_spec = copy.deepcopy(dict(best_spec)) if isinstance(best_spec, Mapping) else None
