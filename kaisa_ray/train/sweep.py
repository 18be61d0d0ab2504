"""Hyperparameter sweeps on Ray Tune: a job's ``sweep`` section, run as trials of the job.

Each trial is a Tune function trainable that fits the job's ``TorchTrainer`` with the trial's
draw of the swept fields (the pattern that works in Ray 2.60; ``Tuner(TorchTrainer)`` does
not). The train loop reports every evaluation through ``ray.train.report``, and Ray's
``TuneReportCallback`` passes each report on to Tune, so ASHA can stop weak trials at its
rungs. Every trial runs with ``kfac: auto``: the tuner picks its strategy under the job's
memory budget (and, with its profile cached after the first trial, at no further cost).
A trial that fails (a diverging loss, say) is recorded with its reason; the sweep goes on.
When ASHA stops a trial, Ray Tune ends the trial's actor, and Ray Train's placement-group
cleaner frees its workers' resources once Ray's State API says the trial's controller is gone:
a cluster needs its dashboard for that (a local Ray started by ``kaisa-ray`` has it).

Progress goes to the progress sink under the sweep's run name, as the service and the CLI
read it: ``sweep-start`` (the plan), one ``trial`` record per trial event (state, params,
step, metrics, error) and ``sweep`` at the end (every trial, and the best one's spec and
checkpoint).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray
import ray.tune
from ray.tune.integration.ray_train import TuneReportCallback
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

from kaisa_ray.errors import ConfigurationError
from kaisa_ray.train.job import build_trainer, ensure_ray, unique_run_name
from kaisa_ray.train.loop import CHECKPOINT_FILE
from kaisa_ray.train.progress import progress_sink
from kaisa_ray.train.spec import Distribution, JobSpec, SweepSpec, trial_spec
from kaisa_ray.train.storage import latest_checkpoint, resolve_storage

__all__ = ["SweepResult", "TrialOutcome", "run_sweep", "search_space"]

logger = logging.getLogger(__name__)

# The metric each trial reports for the sweep's ``metric`` (time: training seconds until the
# stop target was met, reported from then on).
REPORTED = {
    "test_accuracy": "test_accuracy",
    "test_loss": "test_loss",
    "time_to_target": "time_to_target_s",
}
# What a trial's reports say of it, as its records and its outcome keep them.
_TRIAL_METRICS = ("step", "test_accuracy", "test_loss", "train_s", "time_to_target_s")


def tune_distribution(distribution: Distribution) -> Any:
    """The Ray Tune search domain of one field."""
    if distribution.choice is not None:
        return ray.tune.choice(list(distribution.choice))
    low, high = distribution.ends
    if distribution.kind == "loguniform":
        return ray.tune.loguniform(low, high)
    if distribution.kind == "uniform":
        return ray.tune.uniform(low, high)
    return ray.tune.randint(int(low), int(high) + 1)  # Tune's upper end is exclusive


def search_space(sweep: SweepSpec) -> dict[str, Any]:
    return {path: tune_distribution(d) for path, d in sweep.space.items()}


@dataclass
class TrialOutcome:
    """How one trial ended: ``SUCCEEDED`` (trained to the job's stop), ``STOPPED`` (by the
    scheduler, early) or ``FAILED`` (with ``error``)."""

    trial_id: str
    run: str  # the trial's training run (its checkpoints are in <storage>/<run>)
    params: dict[str, Any]
    state: str
    step: int | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    value: float | None = None  # the sweep's metric, None if the trial has none
    error: str | None = None
    checkpoint: str | None = None


@dataclass
class SweepResult:
    run_name: str
    metric: str
    mode: str
    trials: list[TrialOutcome]
    best: TrialOutcome | None
    best_spec: JobSpec | None
    seconds: float

    def record(self) -> dict[str, Any]:
        """The ``sweep`` progress record: every trial, and the best one with its spec."""
        return {
            "kind": "sweep",
            "metric": self.metric,
            "mode": self.mode,
            "seconds": self.seconds,
            "trials": [asdict(t) for t in self.trials],
            "best": None if self.best is None else asdict(self.best),
            "best_spec": None
            if self.best_spec is None
            else self.best_spec.model_dump(mode="json", exclude={"sweep"}),
        }


def _trial(config: dict[str, Any]) -> None:
    """A Tune function trainable: the job with this trial's params, on its own workers."""
    spec = trial_spec(config["base"], config["params"])
    run = f"{config['run']}.{ray.tune.get_context().get_trial_id()}"
    trainer = build_trainer(
        spec,
        {"spec": spec.model_dump(mode="json"), "run": run, "report_evals": True},
        name=run,
        storage=config["storage"],
        max_failures=0,  # a failing trial fails; the sweep goes on with the others
        callbacks=[TuneReportCallback()],  # type: ignore[no-untyped-call]
    )
    trainer.fit()


class _Recorder(ray.tune.Callback):
    """Pushes each trial's events to the progress sink under the sweep's run name."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.sink = progress_sink()

    def _push(self, trial: Any, **values: Any) -> None:
        record = {"kind": "trial", "trial": trial.trial_id, **values}
        self.sink.push.remote(self.run, [record])

    def on_trial_start(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._push(trial, state="RUNNING", params=trial.config["params"])

    def on_trial_result(
        self, iteration: int, trials: list[Any], trial: Any, result: dict[str, Any], **info: Any
    ) -> None:
        self._push(trial, state="RUNNING", **{k: result[k] for k in _TRIAL_METRICS if k in result})

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        done = bool((trial.last_result or {}).get("finished"))
        self._push(trial, state="SUCCEEDED" if done else "STOPPED")

    def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        # The trial's error file on this machine (its copy in storage comes later).
        path = trial.error_file
        text = Path(path).read_text() if path and Path(path).is_file() else None
        self._push(trial, state="FAILED", error=_reason(text))


def _reason(error: BaseException | str | None) -> str:
    """The part of a failed trial's error a user needs: the train loop's own message (Ray
    wraps it in several layers of tracebacks), else the last line."""
    if error is None:
        return "failed without an error"
    text = str(error)
    for marker in ("TrainingDivergedError: ", "ConfigurationError: ", "NoFeasibleCandidateError: "):
        if marker in text:
            return marker.rstrip(": ") + ": " + text.split(marker)[-1].strip().splitlines()[0]
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:2000] if lines else type(error).__name__


def _scheduler(spec: JobSpec, sweep: SweepSpec) -> Any:
    if sweep.scheduler == "none":
        return FIFOScheduler()  # type: ignore[no-untyped-call]
    target = spec.stop.target
    # ASHA compares trials at each rung on the test metric (for time to target, on the
    # target's own metric: who gets there first is who is ahead at the rungs).
    rung_metric = target.metric if sweep.metric == "time_to_target" and target else sweep.metric
    if sweep.metric == "time_to_target":
        rung_mode = "max" if rung_metric == "test_accuracy" else "min"
    else:
        rung_mode = sweep.direction
    horizon = spec.stop.max_steps or 10**9
    grace = sweep.asha.grace_steps or max(spec.eval_every, horizon // 8)
    return ASHAScheduler(
        time_attr="step",
        metric=rung_metric,
        mode=rung_mode,
        max_t=horizon,
        grace_period=grace,
        reduction_factor=sweep.asha.reduction_factor,
    )


def _value(metrics: dict[str, Any], metric: str) -> float | None:
    value = metrics.get(REPORTED[metric])
    if value is None or not math.isfinite(float(value)):
        return None
    return float(value)


def run_sweep(
    spec: JobSpec,
    *,
    storage_path: str | Path | None = None,
    run_name: str | None = None,
) -> SweepResult:
    """Run the job's sweep on Ray Tune and return every trial and the best one.

    Raises:
        ConfigurationError: the job has no ``sweep`` section.
    """
    sweep = spec.sweep
    if sweep is None:
        raise ConfigurationError(
            f"job {spec.name!r} has no sweep section; add one (see the JobSpec's sweep) or "
            "train it with `kaisa-ray train`"
        )
    name = run_name or unique_run_name(spec.name)
    storage = resolve_storage(storage_path)
    ensure_ray()
    began = time.perf_counter()
    sink = progress_sink()
    sink.push.remote(
        name,
        [
            {
                "kind": "sweep-start",
                "trials": sweep.trials,
                "concurrent": sweep.concurrent,
                "metric": sweep.metric,
                "mode": sweep.direction,
                "space": {path: d.model_dump(exclude_none=True) for path, d in sweep.space.items()},
            }
        ],
    )
    base = spec.without_sweep().model_dump(mode="json")
    tuner = ray.tune.Tuner(
        # A trial only waits on its TorchTrainer, whose workers hold the CPUs: it takes none
        # (Tune refuses an empty bundle; a MiB of logical memory makes it non-empty).
        ray.tune.with_resources(_trial, {"CPU": 0, "memory": 2**20}),
        param_space={
            "base": base,
            "run": name,
            "storage": storage,
            "params": search_space(sweep),
        },
        tune_config=ray.tune.TuneConfig(
            num_samples=sweep.trials,
            scheduler=_scheduler(spec, sweep),
            search_alg=ray.tune.search.BasicVariantGenerator(
                random_state=sweep.seed, max_concurrent=sweep.concurrent
            ),
        ),
        run_config=ray.tune.RunConfig(
            name=name,
            storage_path=storage,
            verbose=0,
            callbacks=[_Recorder(name)],
        ),
    )
    grid = tuner.fit()
    trials = []
    for index in range(len(grid)):
        result = grid[index]
        metrics = dict(result.metrics or {})
        config = result.config or {}
        trial_id = str(metrics.get("trial_id") or Path(result.path).name)
        run = f"{name}.{trial_id}"
        outcome = TrialOutcome(
            trial_id=trial_id,
            run=run,
            params=dict(config.get("params", {})),
            state="FAILED"
            if result.error
            else "SUCCEEDED"
            if metrics.get("finished")
            else "STOPPED",
            step=metrics.get("step"),
            metrics={k: v for k, v in metrics.items() if k in _KEPT},
            value=None if result.error else _value(metrics, sweep.metric),
            error=_reason(result.error) if result.error else None,
            checkpoint=latest_checkpoint(storage, run, CHECKPOINT_FILE),
        )
        trials.append(outcome)
    best = _best(trials, sweep.direction)
    outcome_spec = trial_spec(base, best.params) if best is not None else None
    result_ = SweepResult(
        run_name=name,
        metric=sweep.metric,
        mode=sweep.direction,
        trials=trials,
        best=best,
        best_spec=outcome_spec,
        seconds=time.perf_counter() - began,
    )
    ray.get(sink.push.remote(name, [result_.record()]))
    return result_


_KEPT = (*_TRIAL_METRICS, "finished")


def _best(trials: list[TrialOutcome], mode: str) -> TrialOutcome | None:
    """The best trial by the sweep's metric among those that trained to the job's stop (a
    trial stopped early did not run the whole job); among all with the metric if none did."""
    scored = [t for t in trials if t.value is not None]
    finished = [t for t in scored if t.state == "SUCCEEDED"] or scored
    if not finished:
        return None
    sign = -1.0 if mode == "max" else 1.0
    return min(finished, key=lambda t: sign * (t.value or 0.0))


class TrialTable:
    """The sweep's trials as a text table, built from its ``trial`` progress records."""

    COLUMNS = ("step", "test_accuracy", "test_loss", "train_s")

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths
        self.trials: dict[str, dict[str, Any]] = {}

    def update(self, record: dict[str, Any]) -> str | None:
        """Take a ``trial`` record; return a line when the trial's state changed."""
        trial = self.trials.setdefault(record["trial"], {"state": None})
        before = trial["state"]
        trial.update({k: v for k, v in record.items() if k not in ("kind", "seq", "time")})
        if trial["state"] == before:
            return None
        params = ", ".join(
            f"{_short(p)}={_fmt(trial.get('params', {}).get(p))}" for p in self.paths
        )
        line = f"trial {record['trial']} {trial['state']} ({params})"
        if trial["state"] == "STOPPED":
            line += f" at step {trial.get('step')}: stopped early by the scheduler"
        elif trial.get("error"):
            line += f": {trial['error']}"
        return line

    def render(self) -> str:
        header = ["trial", "state", *(_short(p) for p in self.paths), *self.COLUMNS]
        rows = [header]
        for trial_id, trial in self.trials.items():
            params = trial.get("params", {})
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
