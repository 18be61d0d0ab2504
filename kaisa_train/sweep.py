"""Hyperparameter sweeps on Ray Tune: a job's ``sweep`` section, run as trials of the job.

Each trial is a Tune function trainable that fits the job's ``TorchTrainer`` with the trial's
draw of the swept fields (the pattern that works in Ray 2.60; ``Tuner(TorchTrainer)`` does
not). The train loop reports every evaluation through ``ray.train.report``, and Ray's
``TuneReportCallback`` passes each report on to Tune, so ASHA can stop weak trials at its
rungs. Every trial runs with ``kfac: auto``: the tuner picks its strategy under the job's
memory budget (and, with its profile cached after the first trial, at no further cost).
A trial that fails (a diverging loss, say) is recorded with its reason; the sweep goes on.
When ASHA stops a trial, Ray Tune ends the trial's actor, and Ray Train's placement-group
cleaner frees its workers' resources once Ray's State API says the trial's controller is gone.
The cleaner (an actor in a worker of the cluster) needs the cluster's dashboard and
``RAY_ADDRESS`` in its environment: without it, it looks for "the cluster" among every Ray on
the machine, dies with "Found multiple active Ray instances" when there are several, and the
stopped trial's workers hold their CPUs for good (the next trial then waits forever). The
heads ``kaisa-ray`` starts (``kaisa_train.head``, the service's) have both. A trial whose
workers are not placed within ``scaling.resource_timeout_s`` (in a sweep 120 s unless the job
says) fails saying so, and an interrupted sweep (Ctrl-C) says which trials it cut short.

Progress goes to the progress sink under the sweep's run name, as the service and the CLI
read it (``kaisa_train.records``): ``sweep-start`` (the plan), one ``trial`` record per trial event
(state, params, step, metrics, error) and ``sweep`` at the end (every trial, and the best
one's spec and checkpoint).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import ray.tune
from ray.tune.integration.ray_train import TuneReportCallback
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

from kaisa_ray.errors import ConfigurationError, KaisaRayError
from kaisa_train.connection import seed_tuner
from kaisa_train.progress import progress_sink
from kaisa_train.records import (
    TRIAL_METRICS,
    Direction,
    SweepMetric,
    SweepRecord,
    SweepStartRecord,
    TrialOutcome,
    TrialRecord,
    TrialState,
)
from kaisa_train.spec import Distribution, JobSpec, SweepSpec, trial_spec
from kaisa_train.state import CHECKPOINT_FILE
from kaisa_train.storage import latest_checkpoint, resolve_storage
from kaisa_train.trainer import (
    build_trainer,
    ensure_ray,
    refuse_without_spare_cpus,
    resource_timeout,
    unique_run_name,
    unplaced_message,
    waited_too_long,
)
from kaisa_train.worker_config import TrainConfig

__all__ = ["SweepResult", "run_sweep", "search_space"]

logger = logging.getLogger(__name__)


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
class SweepResult:
    run_name: str
    metric: SweepMetric
    mode: Direction
    trials: list[TrialOutcome]
    best: TrialOutcome | None
    best_spec: JobSpec | None
    seconds: float
    planned: int = 0  # the trials the sweep was to run
    interrupted: bool = False  # stopped (Ctrl-C) before every planned trial ended

    def record(self) -> SweepRecord:
        """The ``sweep`` progress record: every trial, and the best one with its spec."""
        return SweepRecord(
            metric=self.metric,
            mode=self.mode,
            seconds=self.seconds,
            trials=self.trials,
            best=self.best,
            best_spec=None
            if self.best_spec is None
            else self.best_spec.model_dump(mode="json", exclude={"sweep"}),
        )


TRIAL_RESOURCE_TIMEOUT_S = 120.0
"""How long a trial's workers may wait for their resources when the job does not say
(``scaling.resource_timeout_s``): a worker group starts in 10-30 s here, so a trial still
unplaced after two minutes is failed with the reason rather than left waiting forever."""


CUT_SHORT = "did not end: the sweep was interrupted"


class WorkersNotPlacedError(KaisaRayError):
    """A trial's workers did not get their resources in time (the message says what to do)."""


def _trial(config: dict[str, Any]) -> None:
    """A Tune function trainable: the job with this trial's params, on its own workers."""
    spec = trial_spec(config["base"], config["params"])
    if spec.scaling.resource_timeout_s is None:
        scaling = spec.scaling.model_copy(update={"resource_timeout_s": TRIAL_RESOURCE_TIMEOUT_S})
        spec = spec.model_copy(update={"scaling": scaling})
    run = f"{config['run']}.{ray.tune.get_context().get_trial_id()}"
    trainer = build_trainer(
        spec,
        TrainConfig(spec=spec, run=run, report_evals=True),
        storage=config["storage"],
        max_failures=0,  # a failing trial fails; the sweep goes on with the others
        callbacks=[TuneReportCallback()],  # type: ignore[no-untyped-call]
    )
    try:
        with resource_timeout(spec):
            trainer.fit()
    except Exception as error:
        if waited_too_long(error):
            raise WorkersNotPlacedError(unplaced_message(spec, config["storage"], run)) from None
        raise


class _Recorder(ray.tune.Callback):
    """Pushes each trial's events to the progress sink under the sweep's run name, and keeps
    which trials ended (a trial Tune left unended was cut short by an interrupted sweep)."""

    def __init__(self, run: str, sink: Any) -> None:
        self.run = run
        self.sink = sink  # the sweep's own handle: its records arrive in the order sent
        self.ended: set[str] = set()  # trial ids that completed or failed
        self.ids: dict[str, str] = {}  # a trial's path (a Result's) -> its id

    def _push(self, record: TrialRecord) -> None:
        self.sink.push.remote(self.run, [record.wire()])

    def on_trial_start(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self.ids[str(trial.path)] = trial.trial_id
        self._push(
            TrialRecord(
                trial=trial.trial_id, state=TrialState.RUNNING, params=trial.config["params"]
            )
        )

    def on_trial_result(
        self, iteration: int, trials: list[Any], trial: Any, result: dict[str, Any], **info: Any
    ) -> None:
        reported = {k: result[k] for k in ("step", *TRIAL_METRICS) if k in result}
        self._push(TrialRecord(trial=trial.trial_id, state=TrialState.RUNNING, **reported))

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        done = bool((trial.last_result or {}).get("finished"))
        state = TrialState.SUCCEEDED if done else TrialState.STOPPED
        self.ended.add(trial.trial_id)
        self._push(TrialRecord(trial=trial.trial_id, state=state))

    def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        error = trial.get_pickled_error()  # the trial's exception, as Tune kept it
        self.ended.add(trial.trial_id)
        self._push(TrialRecord(trial=trial.trial_id, state=TrialState.FAILED, error=_reason(error)))


def _causes(error: BaseException) -> Iterator[BaseException]:
    """``error`` and every exception it wraps, through Ray's and Ray Train's wrappers: a task's
    ``cause``, a worker group's ``worker_failures``, a controller's ``controller_failure``,
    the user exception Ray Train keeps with its traceback, and Python's own chaining."""
    pending, seen = [error], set()
    while pending:
        found = pending.pop(0)
        if id(found) in seen:
            continue
        seen.add(id(found))
        yield found
        links = [
            getattr(found, "cause", None),
            getattr(found, "controller_failure", None),
            getattr(found, "_base_exc", None),  # Ray Train's UserExceptionWithTraceback
            found.__cause__,
            found.__context__,
            *(getattr(found, "worker_failures", None) or {}).values(),
        ]
        pending += [link for link in links if isinstance(link, BaseException)]


def _reason(error: BaseException | None) -> str:
    """The part of a failed trial's error a user needs: the project's own exception (its
    type and the first line of its message: Ray wraps it in several layers), else the last
    line of what Ray says."""
    if error is None:
        return "failed without an error"
    for cause in _causes(error):
        if isinstance(cause, KaisaRayError):
            message = str(cause).strip().splitlines()
            return f"{type(cause).__name__}: {message[0] if message else ''}"
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1][:2000] if lines else type(error).__name__


def _scheduler(spec: JobSpec, sweep: SweepSpec) -> Any:
    if sweep.scheduler == "none":
        return FIFOScheduler()  # type: ignore[no-untyped-call]
    target = spec.stop.target
    # ASHA compares trials at each rung on the test metric (for time to target, on the
    # target's own metric: who gets there first is who is ahead at the rungs).
    rung_metric = str(sweep.metric)
    rung_mode = sweep.direction
    if sweep.metric is SweepMetric.TIME_TO_TARGET and target is not None:
        rung = SweepMetric(target.metric)
        rung_metric, rung_mode = rung.reported, rung.direction
    horizon = spec.stop.max_steps or 10**9
    grace = sweep.asha.grace_steps or max(spec.eval_every, horizon // 8)
    return ASHAScheduler(
        time_attr="step",
        metric=rung_metric,
        mode=str(rung_mode),
        max_t=horizon,
        grace_period=grace,
        reduction_factor=sweep.asha.reduction_factor,
    )


def _value(metrics: dict[str, Any], metric: SweepMetric) -> float | None:
    value = metrics.get(metric.reported)
    if value is None or not math.isfinite(float(value)):
        return None
    return float(value)


def _tuner(
    spec: JobSpec,
    sweep: SweepSpec,
    *,
    base: dict[str, Any],
    name: str,
    storage: str,
    recorder: _Recorder,
) -> ray.tune.Tuner:
    """The sweep as a Ray Tune experiment: ``sweep.trials`` draws of the space, each a trial
    of ``_trial``, under the sweep's scheduler, ``recorder`` told of every trial event."""
    return ray.tune.Tuner(
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
            callbacks=[recorder],
        ),
    )


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
    if spec.dataset.streamed:  # each trial checks itself, but not the trials at once
        refuse_without_spare_cpus(spec, trials=min(sweep.concurrent, sweep.trials))
    seed_tuner()  # every trial runs kfac: auto
    began = time.perf_counter()
    sink = progress_sink()
    start = SweepStartRecord(
        trials=sweep.trials,
        concurrent=sweep.concurrent,
        metric=sweep.metric,
        mode=sweep.direction,
        space={path: d.model_dump(exclude_none=True) for path, d in sweep.space.items()},
    )
    sink.push.remote(name, [start.wire()])
    base = spec.without_sweep().model_dump(mode="json")
    recorder = _Recorder(name, sink)
    tuner = _tuner(spec, sweep, base=base, name=name, storage=storage, recorder=recorder)
    # Ray Tune ends the sweep on Ctrl-C (SIGINT) as if it were done: what it left unended
    # tells an interrupted sweep from a finished one.
    grid = tuner.fit()
    trials, cut = [], 0
    for index in range(len(grid)):
        result = grid[index]
        metrics = dict(result.metrics or {})
        config = result.config or {}
        trial_id = str(
            metrics.get("trial_id") or recorder.ids.get(str(result.path)) or Path(result.path).name
        )
        run = f"{name}.{trial_id}"
        cut_short = not result.error and trial_id not in recorder.ended
        state = (
            TrialState.FAILED
            if result.error or cut_short
            else TrialState.SUCCEEDED
            if metrics.get("finished")
            else TrialState.STOPPED
        )
        error = _reason(result.error) if result.error else None
        if cut_short:
            error, cut = CUT_SHORT, cut + 1
        outcome = TrialOutcome(
            trial_id=trial_id,
            run=run,
            params=dict(config.get("params", {})),
            state=state,
            step=metrics.get("step"),
            metrics={k: v for k, v in metrics.items() if k in _KEPT},
            value=None if state is TrialState.FAILED else _value(metrics, sweep.metric),
            error=error,
            checkpoint=latest_checkpoint(storage, run, CHECKPOINT_FILE),
        )
        trials.append(outcome)
    interrupted = cut > 0 or len(trials) < sweep.trials
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
        planned=sweep.trials,
        interrupted=interrupted,
    )
    # Waited for, and from the handle the trials' records went through: once it returns, the
    # sink has every record of the sweep.
    ray.get(sink.push.remote(name, [result_.record().wire()]))
    return result_


_KEPT = ("step", *TRIAL_METRICS, "finished")


def _best(trials: list[TrialOutcome], mode: Direction) -> TrialOutcome | None:
    """The best trial by the sweep's metric among those that trained to the job's stop (a
    trial stopped early did not run the whole job); among all with the metric if none did."""
    scored = [t for t in trials if t.value is not None]
    finished = [t for t in scored if t.state is TrialState.SUCCEEDED] or scored
    if not finished:
        return None
    sign = -1.0 if mode is Direction.MAX else 1.0
    return min(finished, key=lambda t: sign * (t.value or 0.0))
