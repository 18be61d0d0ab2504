"""Records as text for people: the tuner's decision in a line and its candidate table, each
layer's adapted K-FAC intervals over time and why they changed, and a sweep's trials as a
table (``kaisa-ray tune``, ``train`` and ``sweep`` print them).

Torch-free: the service's client commands print them too.
"""

from __future__ import annotations

from typing import Any

from kaisa_ray.enums import EvalMetric
from kaisa_train.records import (
    AdaptiveChoice,
    CandidateRow,
    IntervalChangeRow,
    IntervalsRecord,
    TrialRecord,
    TrialState,
    TunerRecord,
)

__all__ = [
    "TrialTable",
    "adaptive_plan_table",
    "change_line",
    "decision_line",
    "intervals_timeline",
    "tuning_table",
]


def decision_line(record: TunerRecord) -> str:
    """One line saying what ``kfac: auto`` chose and how."""
    chosen = record.chosen
    how = (
        "profile from the tuner's cache"
        if record.cache == "hit"
        else f"{record.profile_s:.1f} s of profiling"
    )
    if record.verify_s is not None:
        how += f", {record.verify_s:.0f} s of verification trials"
    intervals = f"intervals {chosen.factor_update_steps}/{chosen.inv_update_steps}"
    if chosen.adaptive is not None:
        ladder = ", ".join(f"{f}/{d}" for f, d in chosen.adaptive.rungs)
        intervals = (
            f"intervals adapted per layer from {chosen.factor_update_steps}/"
            f"{chosen.inv_update_steps} over {ladder} (staleness target "
            f"{chosen.adaptive.target_angle:g}°)"
        )
    return (
        f"kfac: auto chose grad_worker_fraction={chosen.grad_worker_fraction:g}, {intervals} "
        f"({record.how}: {how}; {len(record.candidates)} candidates)"
    )


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def _verdict(row: CandidateRow, chosen: CandidateRow | None) -> str:
    """``CHOSEN``, why the candidate was ruled out, or by how much it was slower than the
    choice: measured where both were measured (a verified choice compares unrounded
    trial times, so rows printed alike show +0.0%), predicted otherwise."""
    if chosen is not None and row.key() == chosen.key():
        return "CHOSEN"
    if row.rejected:
        return row.rejected
    if chosen is None:
        return "slower"
    if row.measured and chosen.measured:
        mine, theirs, how = row.measured_ms_per_step, chosen.measured_ms_per_step, "measured"
    else:
        mine, theirs, how = row.ms_per_step, chosen.ms_per_step, "predicted"
    if not mine or not theirs:
        return "slower"
    return f"slower: {mine / theirs - 1:+.1%} {how}"


def tuning_table(record: TunerRecord) -> str:
    """The candidate table: predicted (and, when verified, measured) memory per worker and
    time per step, and why each candidate lost."""
    chosen = record.chosen.key()
    chosen_row = next((row for row in record.candidates if row.key() == chosen), None)
    measured = any(row.measured for row in record.candidates)
    header = ["f", "intervals", "MiB/worker", "K-FAC MiB", "ms/step"]
    if measured:
        header += ["measured MiB", "measured ms"]
    header.append("verdict")
    lines = [header]
    for row in record.candidates:
        cells = [
            f"{row.grad_worker_fraction:g}",
            f"{row.factor_update_steps}/{row.inv_update_steps}",
            _mib(row.memory_bytes),
            _mib(row.kfac_state_bytes),
            f"{row.ms_per_step:.1f}",
        ]
        if measured:
            ms = row.measured_ms_per_step
            cells += [_mib(row.measured_memory_bytes), "-" if ms is None else f"{ms:.1f}"]
        cells.append(_verdict(row, chosen_row))
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    text = [
        "  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=False))
        + "  "
        + line[-1]
        for line in lines
    ]
    budget = record.budget_bytes
    text.append(
        f"budget {'none' if budget is None else _mib(budget) + ' MiB'} per worker; base "
        f"{_mib(record.base_memory_bytes)} MiB + K-FAC temporaries "
        f"{_mib(record.kfac_transient_bytes)} MiB + K-FAC state; plain step "
        f"{record.plain_ms_per_step:.1f} ms"
    )
    if record.data_window_bytes is not None:
        wait = record.data_ms_per_batch
        text.append(
            f"streamed data: a worker holds about {_mib(record.data_window_bytes)} MiB of rows"
            + ("" if wait is None else f"; waited {wait:.1f} ms a batch while profiling")
        )
    if record.data_note is not None:
        text.append(record.data_note)
    if record.chosen.adaptive is not None:
        text.append(adaptive_plan_table(record.chosen.adaptive))
    text.append(decision_line(record))
    return "\n".join(text)


def _rung(pair: tuple[int, int]) -> str:
    return f"{pair[0]}/{pair[1]}"


def adaptive_plan_table(plan: AdaptiveChoice) -> str:
    """What adaptive intervals start from: each layer's predicted K-FAC ms per step on every
    rung (its factor and decomposition costs over the intervals), and the overhead cap."""
    rungs = [(int(f), int(d)) for f, d in plan.rungs]
    header = ["layer", "ms/update (factors, inverse)", *(f"ms/step at {_rung(r)}" for r in rungs)]
    lines = [header]
    totals = [0.0] * len(rungs)
    for name, (factor_s, inverse_s) in plan.layer_costs.items():
        per_step = [1000 * (factor_s / f + inverse_s / d) for f, d in rungs]
        totals = [t + p for t, p in zip(totals, per_step, strict=True)]
        lines.append(
            [
                name,
                f"{1000 * factor_s:.2f}, {1000 * inverse_s:.2f}",
                *(f"{p:.2f}" for p in per_step),
            ]
        )
    lines.append(["every layer", "", *(f"{t:.2f}" for t in totals)])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in lines]
    cap = (
        "no overhead cap"
        if plan.max_seconds is None
        else f"the overhead cap leaves {1000 * plan.max_seconds:.2f} ms per step to them"
    )
    text.append(
        f"every layer starts on {_rung(rungs[plan.start])}; a layer moves one rung shorter "
        f"when its staleness exceeds {plan.target_angle:g}° and one longer when it is within "
        f"half of it; {cap}"
    )
    return "\n".join(text)


def change_line(change: IntervalChangeRow) -> str:
    """``step 120: fc1 intervals 1/10 -> 5/50 (6.72° of staleness after 10 steps, ...)``."""
    return (
        f"step {change.step}: {change.layer} intervals {_rung(change.before)} -> "
        f"{_rung(change.after)} ({change.reason})"
    )


def intervals_timeline(records: list[IntervalsRecord]) -> str:
    """Each layer's intervals over a run and why they changed, from its ``intervals``
    records: a line per layer (its rungs and the steps it moved), then every change."""
    if not records:
        return "no intervals records: the run measured no staleness (kfac: auto adapts them)"
    changes = [c for r in records for c in r.changes]
    first: dict[str, tuple[int, int]] = {}
    for change in changes:
        first.setdefault(change.layer, change.before)
    last = records[-1]
    lines = []
    for layer in last.layers:
        start = first.get(layer.layer, (layer.factor_update_steps, layer.inv_update_steps))
        path = [_rung(start)]
        path += [f"{_rung(c.after)} at step {c.step}" for c in changes if c.layer == layer.layer]
        angle = "-" if layer.angle < 0 else f"{layer.angle:.2f}°"
        lines.append(f"{layer.layer}: {' -> '.join(path)}; last staleness {angle}")
    mode = "adapted" if last.adaptive else "fixed (staleness measured)"
    head = f"K-FAC intervals per layer ({mode}), to step {last.step}:"
    return "\n".join([head, *lines, *(change_line(c) for c in changes)])


class TrialTable:
    """A sweep's trials as a text table, built from its ``trial`` records."""

    COLUMNS = ("step", EvalMetric.TEST_ACCURACY.value, EvalMetric.TEST_LOSS.value, "train_s")

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths
        self.trials: dict[str, dict[str, Any]] = {}

    def update(self, record: TrialRecord) -> str | None:
        """Take a trial's record; return a line when the trial's state changed."""
        trial = self.trials.setdefault(record.trial, {"state": None})
        before = trial["state"]
        trial.update(record.values())
        if trial["state"] == before:
            return None
        params = ", ".join(
            f"{_short(p)}={_fmt((trial.get('params') or {}).get(p))}" for p in self.paths
        )
        line = f"trial {record.trial} {trial['state']} ({params})"
        if trial["state"] == TrialState.STOPPED:
            line += f" at step {trial.get('step')}: stopped early by the scheduler"
        elif trial.get("error"):
            line += f": {trial['error']}"
        return line

    def render(self) -> str:
        header = ["trial", "state", *(_short(p) for p in self.paths), *self.COLUMNS]
        rows = [header]
        for trial_id, trial in self.trials.items():
            params = trial.get("params") or {}
            rows.append(
                [
                    trial_id,
                    str(trial["state"]),
                    *(_fmt(params.get(p)) for p in self.paths),
                    *(_fmt(trial.get(c)) for c in self.COLUMNS),
                ]
            )
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        return "\n".join(
            "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows
        )


def _short(path: str) -> str:
    return path.rsplit(".", 1)[-1]


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
