"""Time to 88% with intervals adapted online (``kfac: auto``) against every fixed point of its
ladder and against the tuner's fixed-interval pick, at global batch 512 on 2 Ray workers.

Every run is a real kaisa-ray job (``targets.run_to_target``: TorchTrainer, DDP over gloo, one
CPU per worker) of the LeNet-style CNN on Fashion-MNIST, 256 samples per worker per step, test
accuracy on the full 10k test set every 10 steps, stopped at 88%. The optimizer is the K-FAC of
``batch_size_study.py`` at batch 512: SGD (momentum 0.9) at lr 1 with a 20-step linear warm-up,
the JobSpec's curvature defaults (Fisher-scale factors, debiased averages, π-damping, damping
0.1, K-FAC-reduce) and the KL clip κ = 3e-3 as the step size. Configurations:

- ``adaptive``: ``kfac: auto`` as it is by default: the tuner picks the fraction and the
  starting rung of the ladder 1/10, 5/50, 10/100, and each layer's intervals move along the
  ladder with the staleness measured during training;
- ``fixed F/I``: ``kfac: auto`` with ``adapt: false`` and the one-pair ladder F/I (the tuner
  still picks the fraction), for each rung of the ladder;
- ``auto, fixed``: ``kfac: auto`` with ``adapt: false`` and the whole ladder: the tuner's pick
  by time per step, which is always the longest intervals (what ``kfac: auto`` did before
  intervals adapted).

Seeds 0, 1, 2, interleaved seed by seed (every configuration of a seed before the next seed).
Training seconds exclude evaluation and worker start-up. Runs are appended to
``results/adaptive_intervals.json`` as they end; ``--resume`` skips those already there.

Run ``python benchmarks/adaptive_intervals.py --write`` (about 40 minutes on a loaded 2-core
machine; ``--quick`` for a smoke run).
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
import torch
from report import git_commit, machine, table, write_block
from targets import Run, median_or_none, run_to_target

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
TARGET = 0.88
WORKERS = 2
BATCH = 512
KL_CLIP = 3e-3
LADDER = [[1, 10], [5, 50], [10, 100]]
CONFIGS: dict[str, dict[str, Any]] = {
    "adaptive": {},
    **{f"fixed {f}/{i}": {"adapt": False, "intervals": [[f, i]]} for f, i in LADDER},
    "auto, fixed": {"adapt": False},
}


def spec(config: str, seed: int, max_steps: int, eval_every: int) -> dict[str, Any]:
    kfac = {
        "strategy": "auto",
        "kl_clip": KL_CLIP,
        "kfac_approx": "reduce",
        "intervals": LADDER,
        **CONFIGS[config],
    }
    return {
        "name": "adaptive-" + config.replace(" ", "").replace(",", "-").replace("/", "-"),
        "model": {"name": "lenet"},
        "dataset": {"name": "fashion-mnist", "batch_size": BATCH // WORKERS},
        "optimizer": {
            "name": "sgd",
            "lr": 1.0,
            "momentum": 0.9,
            "schedule": {"kind": "constant", "warmup_steps": 20},
        },
        "kfac": kfac,
        "memory_budget": "2GiB",
        "scaling": {"workers": WORKERS, "cpus_per_worker": 1},
        "stop": {"max_steps": max_steps, "target": {"metric": "test_accuracy", "value": TARGET}},
        "eval_every": eval_every,
        "checkpoint": {"every_steps": 100_000, "keep": 1},
        "seed": seed,
    }


def chosen(run: Run) -> str:
    """The intervals the job started from, as the tuner record says."""
    if not run.tuning:
        return "-"
    c = run.tuning["chosen"]
    start = f"f={c['grad_worker_fraction']:g}, {c['factor_update_steps']}/{c['inv_update_steps']}"
    adaptive = c.get("adaptive")
    if adaptive:
        rung = adaptive["rungs"][adaptive["start"]]
        return f"f={c['grad_worker_fraction']:g}, starts at {rung[0]}/{rung[1]}, adapts"
    return start


def summarize(runs: list[Run], header: str) -> str:
    by: dict[str, list[Run]] = {}
    for run in runs:
        by.setdefault(run.config, []).append(run)
    train = {c: median_or_none([r.train_s for r in rs]) for c, rs in by.items()}
    fixed = {c: t for c, t in train.items() if c.startswith("fixed") and t is not None}
    best = min(fixed, key=lambda c: fixed[c]) if fixed else None
    rows = []
    for config, rs in by.items():
        t = train[config]
        steps = median_or_none([r.steps for r in rs])
        ratio_best = ratio_auto = "-"
        if t is not None and best is not None:
            ratio_best = f"{t / fixed[best]:.2f}"
        if t is not None and train.get("auto, fixed"):
            ratio_auto = f"{t / train['auto, fixed']:.2f}"  # type: ignore[operator]
        rows.append(
            [
                config,
                chosen(rs[0]),
                f"{sum(r.steps is not None for r in rs)}/{len(rs)}",
                " / ".join("-" if r.steps is None else str(r.steps) for r in rs),
                "-" if steps is None else f"{steps:.0f}",
                " / ".join("-" if r.train_s is None else f"{r.train_s:.1f}" for r in rs),
                "-" if t is None else f"{t:.1f}",
                f"{statistics.mean(r.ms_per_step for r in rs):.1f}",
                ratio_best,
                ratio_auto,
            ]
        )
    return table(
        header,
        [
            "configuration",
            "tuner's start (seed 0)",
            "seeds at 88%",
            "steps per seed",
            "steps (median)",
            "train s per seed",
            "train s (median)",
            "ms/step (mean)",
            f"train s ÷ best fixed ({best})",
            "train s ÷ auto, fixed",
        ],
        rows,
    )


def load(path: Path) -> tuple[dict[str, Any], list[Run]]:
    if not path.exists():
        return {}, []
    data = json.loads(path.read_text())
    return data["meta"], [Run(**r) for r in data["runs"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-steps", type=int, default=1000)
    parser.add_argument("--resume", action="store_true", help="skip runs already in the JSON")
    parser.add_argument("--quick", action="store_true", help="1 seed, 30 steps, no target")
    parser.add_argument("--write", action="store_true", help="store the table")
    parser.add_argument("--json", type=Path, default=RESULTS / "adaptive_intervals.json")
    parser.add_argument("--from-json", action="store_true", help="re-print the stored run")
    args = parser.parse_args()
    eval_every = 10
    if args.quick:
        args.seeds, args.max_steps, eval_every = [0], 30, 10
        args.json = Path(tempfile.mkdtemp()) / "quick.json"
    if args.from_json:
        meta, runs = load(args.json)
        text = summarize(runs, meta["header"])
        print(text)
        if args.write:
            write_block("adaptive-intervals", text)
        return
    torch.set_num_threads(1)
    meta, runs = load(args.json) if args.resume else ({}, [])
    started = datetime.datetime.now(datetime.UTC)
    meta = meta or {
        "header": (
            f"Measured {started:%Y-%m-%d} at commit {git_commit()} on {machine()} (at the start; "
            "the machine was shared with other work); LeNet, global batch 512 on 2 Ray Train "
            f"workers, SGD lr 1 + K-FAC κ={KL_CLIP:g}, seeds "
            f"{', '.join(map(str, args.seeds))} interleaved; medians of training seconds to "
            f"{TARGET:.0%}."
        )
    }
    done = {(r.config, r.seed) for r in runs}
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory(prefix="kaisa-adaptive-") as storage:
        for seed in args.seeds:
            for config in CONFIGS:
                if (config, seed) in done:
                    continue
                run = run_to_target(
                    config, spec(config, seed, args.max_steps, eval_every), Path(storage)
                )
                runs.append(run)
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(
                    json.dumps(
                        {"meta": meta, "runs": [dataclasses.asdict(r) for r in runs]}, indent=1
                    )
                )
                print(
                    f"{config} seed {seed}: steps {run.steps}, train s {run.train_s}, "
                    f"{run.ms_per_step:.1f} ms/step, {chosen(run)}"
                    + (f", {run.failure}" if run.failure else ""),
                    flush=True,
                )
    ray.shutdown()
    text = summarize(runs, meta["header"])
    print(text)
    if args.write:
        write_block("adaptive-intervals", text)


if __name__ == "__main__":
    main()
