"""Run a real kaisa-ray job to its target and measure it (shared by the time-to-target benchmarks).

A run is a real job (``run_job``: a TorchTrainer, DDP over gloo): steps and training seconds to
the spec's ``stop.target`` come from its evaluation records, the mean ms per step and K-FAC's
phases from its step records. A run that diverges (``TrainingDivergedError``) or stops before
its target is a run that did not reach it, not an error.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from kaisa_ray.timing import PHASES
from kaisa_ray.train.job import run_job
from kaisa_ray.train.progress import read_progress
from kaisa_ray.train.spec import parse_job_spec


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
    )
