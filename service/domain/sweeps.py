"""A sweep job's view: its plan, its trials and the best one, built from the sweep's
progress-sink records (``SweepStartRecord``, ``TrialRecord`` and ``SweepRecord`` of
``kaisa_train.records``; ``kaisa_train.sweep`` pushes them under the job's id).

The store keeps the view as one JSON value on the job (``jobs.sweep``)::

    {"trials_planned": 8, "concurrent": 2, "metric": "test_accuracy", "mode": "max",
     "space": {"optimizer.lr": {"loguniform": [0.001, 0.1]}},
     "trials": {"<trial id>": {"state": "RUNNING", "params": {"optimizer.lr": 0.05},
                               "step": 20, "metrics": {"test_accuracy": 0.81, ...},
                               "error": None, ...}},
     "best": None, "best_spec": None, "seconds": None}

``best`` (a trial as the ``sweep`` record has it: trial_id, run, params, state, step, metrics,
value, error, checkpoint), ``best_spec`` (the best trial's JobSpec as JSON, without a sweep)
and ``seconds`` are set by the ``sweep`` record at the end. ``merge`` is pure: it returns a
new view and never changes the one it is given (a ``Job`` from the store is a snapshot).
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
    TrialRecord,
    TrialState,
)

SweepRecords = SweepStartRecord | TrialRecord | SweepRecord


def plan(section: Mapping[str, Any] | None) -> dict[str, Any]:
    """A view with no trials yet, from a JobSpec's ``sweep`` section (as JSON): what the
    sweep's ``sweep-start`` record will say (empty fields where there is no section)."""
    section = section or {}
    metric = SweepMetric(section.get("metric") or SweepMetric.TEST_ACCURACY)
    mode = section.get("mode") or metric.direction
    return {
        "trials_planned": section.get("trials"),
        "concurrent": section.get("concurrent"),
        "metric": str(metric),
        "mode": str(mode),
        "space": {
            # As the sweep-start record has them: only the distribution given (the stored
            # spec has the others too, as null).
            str(path): {k: copy.deepcopy(v) for k, v in dict(d).items() if v is not None}
            for path, d in (section.get("space") or {}).items()
            if isinstance(d, Mapping)
        },
        "trials": {},
        "best": None,
        "best_spec": None,
        "seconds": None,
    }


def merge(
    view: Mapping[str, Any] | None, record: SweepRecords, *, spec: Mapping[str, Any]
) -> dict[str, Any]:
    """``view`` with one sweep record merged in (a new value). A record that comes before
    any plan (``view`` None) starts from the plan in the job's ``spec``."""
    merged = copy.deepcopy(dict(view)) if view is not None else plan(spec.get("sweep"))
    data = finite(record.wire())  # the fields the record has, as JSON
    if isinstance(record, SweepStartRecord):
        _start(merged, data)
    elif isinstance(record, TrialRecord):
        _trial(merged, data)
    else:
        _result(merged, data)
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


def ended(view: Mapping[str, Any] | None) -> int:
    """How many of the view's trials are over."""
    trials = (view or {}).get("trials") or {}
    return sum(1 for trial in trials.values() if _ended(trial.get("state")))


def _ended(state: Any) -> bool:
    return state in set(TrialState) and TrialState(state).ended


def _start(view: dict[str, Any], record: Mapping[str, Any]) -> None:
    if record.get("trials") is not None:
        view["trials_planned"] = int(record["trials"])
    for name in ("concurrent", "metric", "mode"):
        if record.get(name) is not None:
            view[name] = record[name]
    if isinstance(record.get("space"), Mapping):
        view["space"] = copy.deepcopy(dict(record["space"]))


def _entry(view: dict[str, Any], trial_id: str) -> dict[str, Any]:
    trials: dict[str, Any] = view.setdefault("trials", {})
    entry: dict[str, Any] = trials.setdefault(
        trial_id,
        {
            "state": TrialState.RUNNING.value,
            "params": {},
            "step": None,
            "metrics": {},
            "error": None,
        },
    )
    return entry


def _set_state(entry: dict[str, Any], state: Any) -> None:
    # A trial that is over stays over: a late RUNNING record (an evaluation pushed before the
    # end but read after it) does not bring it back.
    if state in set(TrialState) and not (
        _ended(entry.get("state")) and state == TrialState.RUNNING
    ):
        entry["state"] = str(state)


def _update(
    entry: dict[str, Any],
    source: Mapping[str, Any],
    metrics: Mapping[str, Any],
    names: tuple[str, ...],
) -> None:
    """Merge what ``source`` (a trial record or a trial's outcome) says into the trial's entry."""
    _set_state(entry, source.get("state"))
    if isinstance(source.get("params"), Mapping):
        entry["params"] = dict(source["params"])
    if source.get("step") is not None:
        entry["step"] = int(source["step"])
    found = {name: metrics[name] for name in TRIAL_METRICS if name in metrics}
    if found:
        entry["metrics"] = {**(entry.get("metrics") or {}), **found}
    for name in names:
        if source.get(name) is not None:
            entry[name] = str(source[name]) if name == "error" else source[name]


def _trial(view: dict[str, Any], record: Mapping[str, Any]) -> None:
    if record.get("trial") is None:
        return
    _update(_entry(view, str(record["trial"])), record, record, ("error",))


def _result(view: dict[str, Any], record: Mapping[str, Any]) -> None:
    for name in ("metric", "mode", "seconds"):
        if record.get(name) is not None:
            view[name] = record[name]
    for outcome in record.get("trials") or []:
        if not isinstance(outcome, Mapping) or outcome.get("trial_id") is None:
            continue
        entry = _entry(view, str(outcome["trial_id"]))
        metrics = outcome.get("metrics") or {}
        _update(entry, outcome, metrics, ("value", "error", "checkpoint", "run"))
    best = record.get("best")
    view["best"] = copy.deepcopy(dict(best)) if isinstance(best, Mapping) else None
    best_spec = record.get("best_spec")
    view["best_spec"] = copy.deepcopy(dict(best_spec)) if isinstance(best_spec, Mapping) else None
