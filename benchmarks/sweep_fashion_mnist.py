"""A K-FAC sweep against the best hand-tuned K-FAC: time to 88% on Fashion-MNIST, 2 workers.

1. The sweep: at most 16 trials of the LeNet-style CNN with K-FAC (``kfac: auto`` under a 2 GiB
   budget, K-FAC-reduce) on 2 Ray Train workers, over the learning rate, the damping and the
   KL clip (log-uniform), minimising the training seconds to 88% test accuracy (evaluated every
   25 steps, at most 1000 steps), with ASHA judging trials on test accuracy from step 100.
   This is ``kaisa-ray sweep`` (``run_sweep``), with the job's seed 0. Its own cost, the
   sweep's wall-clock time, is reported with it.
2. The comparison, on seeds the sweep never saw (1, 2, 3), interleaved: the sweep's best spec
   against the best hand-tuned K-FAC configuration of the Ray Train benchmark
   (``ray_time_to_accuracy.py``: COMM-OPT, factors every 5 steps, decompositions every 50,
   damping 0.1, KL clip 0.001, lr 0.05), and SGD as the first-order reference.

Run ``python benchmarks/sweep_fashion_mnist.py`` (``--trials 4 --quick`` for a smoke run);
``--write`` stores the table in ``benchmarks/README.md`` and the runs in
``benchmarks/results/sweep_fashion_mnist.json``.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")

import argparse
import dataclasses
import datetime
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import ray
from ray_time_to_accuracy import CONFIGS, TARGET, Run, job, median_or_none, run_to_target
from report import git_commit, machine, table, write_block

from kaisa_train.spec import parse_job_spec
from kaisa_train.sweep import run_sweep

HERE = Path(__file__).resolve().parent
if not {"SGD (Nesterov 0.9, lr 0.05)", "SGD + K-FAC, COMM-OPT (f=1)"} <= set(CONFIGS):
    raise SystemExit("ray_time_to_accuracy.py renamed its configurations; update this script")
RESULTS = HERE / "results"
HAND_TUNED = "SGD + K-FAC, COMM-OPT (f=1)"
SGD = "SGD (Nesterov 0.9, lr 0.05)"
SWEPT = "SGD + K-FAC, the sweep's best (kfac: auto)"


def sweep_job(args: argparse.Namespace) -> dict[str, Any]:
    base = job(HAND_TUNED, 0, args.max_steps, args.limit)
    base.update(
        name="bench-sweep",
        kfac={"strategy": "auto", "kfac_approx": "reduce", "damping": 0.1, "kl_clip": 0.001},
        memory_budget="2GiB",
        sweep={
            "space": {
                "optimizer.lr": {"loguniform": [0.01, 0.2]},
                "kfac.damping": {"loguniform": [0.01, 0.3]},
                "kfac.kl_clip": {"loguniform": [0.0003, 0.01]},
            },
            "metric": "time_to_target",
            "trials": args.trials,
            "concurrent": 1,
            "asha": {"grace_steps": 100, "reduction_factor": 2},
            "seed": 0,
        },
    )
    return base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--seeds", type=int, default=3, help="evaluation seeds (1, 2, ...)")
    parser.add_argument("--max-steps", type=int, default=1000)
    parser.add_argument("--limit", type=int, default=None, help="samples per split (smoke)")
    parser.add_argument("--quick", action="store_true", help="4k samples, 200 steps, 1 seed")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.limit, args.max_steps, args.seeds = 4096, 200, 1
    # With the dashboard: Ray Train's placement-group cleaner asks its State API whether a trial
    # stopped by ASHA still runs, and frees the trial's CPUs when it does not.
    ray.init(address="local", num_cpus=4, include_dashboard=True, log_to_driver=False)
    commit = git_commit()
    started = datetime.datetime.now(datetime.UTC)
    load_before = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="kaisa-sweep-bench-") as storage:
        swept = run_sweep(parse_job_spec(sweep_job(args)), storage_path=storage)
        for trial in swept.trials:
            print(
                f"trial {trial.trial_id} {trial.state} {trial.params} step {trial.step} "
                f"value {trial.value} {trial.error or ''}",
                flush=True,
            )
        if swept.best_spec is None:
            raise SystemExit(f"no trial reached {TARGET:.0%}: {swept.trials}")
        best = swept.best_spec.model_dump(mode="json")
        candidates = {
            SGD: lambda seed: job(SGD, seed, args.max_steps, args.limit),
            HAND_TUNED: lambda seed: job(HAND_TUNED, seed, args.max_steps, args.limit),
            SWEPT: lambda seed: {**best, "name": "bench", "seed": seed},
        }
        for seed in range(1, args.seeds + 1):
            for label, spec_of in candidates.items():
                run = run_to_target(label, spec_of(seed), Path(storage))
                runs.append(run)
                print(f"seed {seed} {label}: steps {run.steps}, train s {run.train_s}", flush=True)
    ray.shutdown()
    print(summarize(swept, runs, args, commit, started, load_before))
    if args.write:
        text = summarize(swept, runs, args, commit, started, load_before)
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "sweep_fashion_mnist.json").write_text(
            json.dumps(
                {
                    "sweep": swept.record(),
                    "runs": [dataclasses.asdict(r) for r in runs],
                },
                indent=1,
            )
        )
        write_block("sweep-fashion-mnist", text)


def summarize(
    swept: Any,
    runs: list[Run],
    args: argparse.Namespace,
    commit: str,
    started: datetime.datetime,
    load_before: str,
) -> str:
    states = [t.state for t in swept.trials]
    best = swept.best
    params = ", ".join(f"{k} {v:.3g}" for k, v in best.params.items())
    header = (
        f"Measured {started:%Y-%m-%d} at commit {commit} on {machine()} (before the run: "
        f"{load_before}); 2 Ray Train workers, one CPU each; the sweep: {len(states)} trials "
        f"({states.count('SUCCEEDED')} trained to their stop, {states.count('STOPPED')} stopped "
        f"early by ASHA, {states.count('FAILED')} failed) in {swept.seconds / 60:.1f} min of "
        f"wall-clock; its best trial ({params}) reached {TARGET:.0%} in {best.value:.1f} "
        f"training s on seed 0. Below, {args.seeds} fresh seed(s), max {args.max_steps} steps"
        + (f", {args.limit} samples per split" if args.limit else "")
        + "."
    )
    by = {label: [r for r in runs if r.config == label] for label in (SGD, HAND_TUNED, SWEPT)}
    train = {label: median_or_none([r.train_s for r in rs]) for label, rs in by.items()}
    reference = train[HAND_TUNED]
    rows = []
    for label, rs in by.items():
        t = train[label]
        steps = median_or_none([r.steps for r in rs])
        per_seed = ", ".join("-" if r.train_s is None else f"{r.train_s:.1f}" for r in rs)
        rows.append(
            [
                label,
                f"{sum(r.steps is not None for r in rs)}/{len(rs)}",
                "-" if steps is None else f"{steps:.0f}",
                "-" if t is None else f"{t:.1f}",
                per_seed,
                f"{t / reference:.2f}" if t is not None and reference else "-",
                f"{statistics.mean(r.ms_per_step for r in rs):.1f}",
            ]
        )
    return table(
        header,
        [
            "configuration",
            "seeds at 88%",
            "steps (median)",
            "train s to 88% (median)",
            "train s per seed",
            "÷ hand-tuned K-FAC",
            "ms/step",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
