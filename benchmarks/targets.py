"""Run a real kaisa-ray job to its target and measure it (shared by the time-to-target benchmarks).

A run is a real job (``run_job``: a TorchTrainer, DDP over gloo): steps and training seconds to
the spec's ``stop.target`` come from its evaluation records, the mean ms per step and K-FAC's
phases from its step records. A run that diverges (``TrainingDivergedError``) or stops before
its target is a run that did not reach it, not an error.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from kaisa_ray.timing import PHASES
from kaisa_train.job import run_job
from kaisa_train.progress import read_progress
from kaisa_train.spec import parse_job_spec


@dataclasses.dataclass
class Run:
    config: str
    seed: int
    steps: int | None  # None: the target was not reached
    train_s: float | None  # training seconds to the target
    wall_s: float | None  # seconds from the first step to the target, evaluation included
    ms_per_step: float
    kfac_ms: dict[str, float]
    curve: list[tuple[float, float, int]]  # (train_s, the target's metric, step) per evaluation
    tuning: dict[str, Any] | None = None  # kfac: auto's choice and profiling time
    failure: str | None = None  # why the job ended without its target (divergence, ...)
    data_wait_ms: float | None = None  # per step, waiting for the batch (where recorded)
    # ms per step and the data wait after the first step record's window (its steps carry the
    # start of a streamed dataset's pipeline): the steady state
    steady_ms_per_step: float | None = None
    steady_data_wait_ms: float | None = None


def run_to_target(config: str, spec_data: dict[str, Any], storage: Path) -> Run:
    """Train ``spec_data`` as a real job and measure it against its ``stop.target``."""
    spec = parse_job_spec(spec_data)
    if spec.stop.target is None:
        raise ValueError(f"{config}: the job has no stop.target to measure the time to")
    metric, value = spec.stop.target.metric, spec.stop.target.value

    def met(record: dict[str, Any]) -> bool:
        got = record.get(metric)
        if got is None:
            return False
        return bool(got >= value) if metric == "test_accuracy" else bool(got <= value)

    result = run_job(spec, storage_path=storage, progress=False)
    steps = read_progress(result.run_name, kinds=["step"])["records"]
    evals = read_progress(result.run_name, kinds=["eval"])["records"]
    failure = None if result.succeeded else (result.error or "failed").splitlines()[-1][:300]
    if not steps:
        return Run(config, spec.seed, None, None, None, 0.0, {}, [], failure=failure)
    total_steps = steps[-1]["step"]
    # Step records average over windows of steps (the last may be shorter): weight them.
    ends = [s["step"] for s in steps]
    weights = [b - a for a, b in zip([0, *ends[:-1]], ends, strict=True)]
    ms = sum(w * s["ms_per_step"] for w, s in zip(weights, steps, strict=True)) / total_steps
    kfac_ms = {
        p: sum(w * s.get(f"kfac_{p}_ms", 0.0) for w, s in zip(weights, steps, strict=True))
        / total_steps
        for p in PHASES
    }
    waits = [s.get("data_wait_ms") for s in steps]
    data_wait_ms = (
        sum(w * v for w, v in zip(weights, waits, strict=True)) / total_steps
        if all(v is not None for v in waits)
        else None
    )
    steady_ms = steady_wait = None
    if len(steps) > 1:
        later = sum(weights[1:])
        steady_ms = sum(w * s["ms_per_step"] for w, s in zip(weights[1:], steps[1:], strict=True))
        steady_ms /= later
        if data_wait_ms is not None:
            pairs = zip(weights[1:], waits[1:], strict=True)
            steady_wait = sum(w * v for w, v in pairs if v is not None) / later
    hit = next((e for e in evals if met(e)), None)
    tuner = read_progress(result.run_name, kinds=["tuner"])["records"]
    tuning = None
    if tuner:
        tuning = {k: tuner[-1][k] for k in ("chosen", "cache", "profile_s", "how")}
    return Run(
        config=config,
        seed=spec.seed,
        steps=hit["step"] if hit else None,
        train_s=hit["train_s"] if hit else None,
        wall_s=hit["elapsed_s"] if hit else None,
        ms_per_step=ms,
        kfac_ms=kfac_ms if spec.kfac != "off" else {},
        curve=[(e["train_s"], e[metric], e["step"]) for e in evals if e.get(metric) is not None],
        tuning=tuning,
        failure=failure if hit is None else None,
        data_wait_ms=data_wait_ms,
        steady_ms_per_step=steady_ms,
        steady_data_wait_ms=steady_wait,
    )


EXTEND = 2  # grid points a study may add beyond an end of a grid whose best point is there
SpecFn = Callable[[str, float, int, int], dict[str, Any]]
"""``(optimizer, step size, seed, max steps) -> job spec``."""


@dataclasses.dataclass
class Entry:
    """One measured run of a study: which setting (``group``: e.g. the batch size), which
    optimizer at which step size, tuning or final, and the run."""

    group: str
    optimizer: str
    step_size: float
    phase: str  # "tune" or "final"
    run: Run

    @property
    def key(self) -> str:
        return f"{self.group}/{self.optimizer}/{self.step_size:g}/{self.phase}/{self.run.seed}"


def better(a: Run, b: Run | None) -> bool:
    """Whether ``a`` reached the target in fewer steps than ``b`` (ties: fewer seconds)."""
    if a.steps is None:
        return False
    if b is None or b.steps is None:
        return True
    return (a.steps, a.train_s or 0.0) < (b.steps, b.train_s or 0.0)


def middle_out(points: Sequence[float]) -> list[float]:
    """``points`` (sorted) from the middle outwards, alternating above and below it: the same
    points in an order whose first runs are the likeliest best, so the later ones stop early at
    the best's steps (``Study.measure``) instead of running to the limit."""
    centre = len(points) // 2
    order = [points[centre]]
    for offset in range(1, len(points)):
        for index in (centre + offset, centre - offset):
            if 0 <= index < len(points):
                order.append(points[index])
    return order


def median_or_none(values: Sequence[float | None]) -> float | None:
    """Median over seeds; None if any seed missed the target (its time is unbounded)."""
    if not values or any(v is None for v in values):
        return None
    return statistics.median(v for v in values if v is not None)


def best_tuned(entries: Sequence[Entry], group: str, optimizer: str) -> Entry | None:
    """The best tuning run of ``optimizer`` in ``group`` among ``entries``."""
    best: Entry | None = None
    for e in entries:
        if (e.group, e.optimizer, e.phase) == (group, optimizer, "tune") and better(
            e.run, best.run if best else None
        ):
            best = e
    return best


class Study:
    """The same tuning effort for every optimizer, then seeds interleaved.

    For one ``group``: every step size of each optimizer's grid on seed 0 (a grid point stops
    once it has taken as many steps as the best point so far needed: it cannot beat it); the
    best point (fewest steps to the target, then fewest seconds) of each optimizer then runs
    with every seed, interleaved seed by seed. Every run is appended to ``path`` (JSON) as it
    ends; runs already there are not run again (``resume``).
    """

    def __init__(self, path: Path, storage: Path, meta: dict[str, Any], resume: bool) -> None:
        self.path = path
        self.storage = storage
        self.meta = meta
        self.entries: list[Entry] = self._load() if resume else []

    @classmethod
    def stored(cls, path: Path) -> Study:
        """The runs stored at ``path``, with the commit, machine and start they were measured
        under (for re-printing a table; it runs nothing)."""
        saved = json.loads(path.read_text())
        meta = {key: saved[key] for key in ("commit", "machine", "started")}
        return cls(path, Path(), meta, resume=True)

    def _load(self) -> list[Entry]:
        if not self.path.exists():
            return []
        return [
            Entry(e["group"], e["optimizer"], e["step_size"], e["phase"], Run(**e["run"]))
            for e in json.loads(self.path.read_text())["runs"]
        ]

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        runs = [dataclasses.asdict(e) for e in self.entries]
        self.path.write_text(json.dumps({**self.meta, "runs": runs}, indent=1))

    def best(self, group: str, optimizer: str) -> Entry | None:
        """The best tuning run of ``optimizer`` in ``group``."""
        return best_tuned(self.entries, group, optimizer)

    def measure(
        self,
        group: str,
        optimizer: str,
        step_size: float,
        phase: str,
        seed: int,
        spec: SpecFn,
        max_steps: int,
    ) -> Run:
        key = f"{group}/{optimizer}/{step_size:g}/{phase}/{seed}"
        for e in self.entries:
            if e.key == key:
                return e.run
        if phase == "tune":
            best = self.best(group, optimizer)
            if best is not None and best.run.steps is not None:
                max_steps = min(max_steps, best.run.steps)
        run = run_to_target(
            f"{optimizer} {step_size:g}", spec(optimizer, step_size, seed, max_steps), self.storage
        )
        self.entries.append(Entry(group, optimizer, step_size, phase, run))
        self._save()
        print(
            f"[{phase}] {group} {optimizer} {step_size:g} seed {seed}: steps {run.steps}, "
            f"train s {run.train_s}, {run.ms_per_step:.1f} ms/step"
            + (f", {run.failure}" if run.failure else ""),
            flush=True,
        )
        return run

    def run(
        self,
        group: str,
        grids: dict[str, list[float]],
        seeds: Sequence[int],
        spec: SpecFn,
        max_steps: int,
        phases: Sequence[str] = ("tune", "final"),
    ) -> None:
        """Tune, then the finals; ``phases`` runs only some (tuning compares steps, which a busy
        machine does not change; the finals' seconds want a quiet one, so they can run later)."""
        if "tune" in phases:
            for optimizer, grid in grids.items():
                if len(grid) < 2:
                    continue  # one setting: nothing to choose, its finals are its runs
                for step_size in self._extended(grid, group, optimizer):
                    self.measure(group, optimizer, step_size, "tune", seeds[0], spec, max_steps)
        if "final" not in phases:
            return
        chosen = {}
        for optimizer, grid in grids.items():
            best = self.best(group, optimizer)
            chosen[optimizer] = best.step_size if best else grid[len(grid) // 2]
        for seed in seeds:
            for optimizer in grids:
                self.measure(group, optimizer, chosen[optimizer], "final", seed, spec, max_steps)

    def _extended(self, grid: list[float], group: str, optimizer: str) -> Iterator[float]:
        """The grid's points, then, while the best so far is at an end of what was tried, one
        more point beyond that end (the grid's own spacing), at most ``EXTEND`` times: every
        optimizer's optimum ends up inside what it tried, or the table says it is not."""
        tried = sorted(grid)
        yield from middle_out(tried)
        for _ in range(EXTEND):
            best = self.best(group, optimizer)
            if best is None or best.step_size not in (tried[0], tried[-1]):
                return
            if best.step_size == tried[-1]:
                point = float(f"{tried[-1] * tried[-1] / tried[-2]:.3g}")
                tried.append(point)
            else:
                point = float(f"{tried[0] * tried[0] / tried[1]:.3g}")
                tried.insert(0, point)
            yield point

    def tried(self, group: str, optimizer: str) -> list[float]:
        """The step sizes tuned, in order."""
        return sorted(
            {
                e.step_size
                for e in self.entries
                if (e.group, e.optimizer, e.phase) == (group, optimizer, "tune")
            }
        )

    def finals(self, group: str, optimizer: str) -> list[Entry]:
        return [
            e
            for e in self.entries
            if (e.group, e.optimizer, e.phase) == (group, optimizer, "final")
        ]
