"""Time to target with intervals adapted online (``kfac: auto``) against every fixed point of
its ladder and against the tuner's fixed-interval pick, on the two workloads where K-FAC won
(``batch_size_study.py``, ``transformer_fortunes.py``), with their winning curvature settings.

Every run is a real kaisa-ray job (``targets.run_to_target``: TorchTrainer, DDP over gloo, one
CPU per worker, 2 workers). Workloads (``--workload``):

- ``large-batch``: ``examples/fashion_mnist_large_batch.yaml`` as it stands (LeNet, global
  batch 2048, K-FAC's preconditioned gradients into AdamW at lr 0.032, no KL clip, the inverse
  method, factors from 256 examples per worker), to 88% test accuracy on the full test set,
  evaluated every 10 steps;
- ``transformer``: ``transformer_fortunes.py``'s AdamW + K-FAC at its tuned lr (4e-3), to a
  validation loss of 2.0, evaluated every 50 steps.

Only the ``kfac`` section's strategy and intervals change. Configurations:

- ``adaptive``: ``kfac: auto`` with ``adapt: true``: the tuner picks the fraction and the
  starting rung of the ladder 1/10, 5/50, 10/100, and each layer's intervals move along the
  ladder with the staleness measured during training;
- ``fixed F/I``: ``kfac: auto`` with ``adapt: false`` and the one-pair ladder F/I (the tuner
  still picks the fraction), for each rung of the ladder;
- ``auto, fixed``: ``kfac: auto`` with ``adapt: false`` and the whole ladder: the tuner's pick
  by time per step (the default ``kfac: auto``).

Seeds 0, 1, 2, interleaved seed by seed (every configuration of a seed before the next seed).
Training seconds exclude evaluation, profiling and worker start-up. Runs are appended to
``results/adaptive_intervals_<workload>.json`` as they end; ``--resume`` skips those already
there.

Run ``python benchmarks/adaptive_intervals.py --workload large-batch --write`` (about 15
minutes on a quiet 2-core machine; ``--quick`` for a smoke run), the same with
``--workload transformer``.
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
import transformer_fortunes
import yaml
from report import git_commit, machine, table, write_block
from targets import Run, Study, median_or_none, run_to_target

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
LADDER = [[1, 10], [5, 50], [10, 100]]
CONFIGS: dict[str, dict[str, Any]] = {
    "adaptive": {"adapt": True},
    **{f"fixed {f}/{i}": {"adapt": False, "intervals": [[f, i]]} for f, i in LADDER},
    "auto, fixed": {"adapt": False},
}
WORKLOADS = {
    "large-batch": "examples/fashion_mnist_large_batch.yaml (LeNet, global batch 2048 on 2 Ray "
    "Train workers, AdamW + K-FAC, inverse method, no KL clip)",
    "transformer": "char-transformer on fortunes (2 Ray Train workers x 32 sequences, AdamW + "
    "K-FAC on its Linear layers, inverse method, no KL clip)",
}
EXAMPLE = HERE.parent / "examples" / "fashion_mnist_large_batch.yaml"


def workload_spec(workload: str, seed: int) -> dict[str, Any]:
    """The workload's winning job, as committed, for ``seed``."""
    if workload == "large-batch":
        data: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    else:
        study = Study.stored(RESULTS / "transformer_fortunes.json")
        lr = study.finals("lm", "AdamW + K-FAC")[0].step_size  # the study's tuned lr
        data = transformer_fortunes.spec("AdamW + K-FAC", lr, seed, transformer_fortunes.MAX_STEPS)
    data["seed"] = seed
    return data


def spec(workload: str, config: str, seed: int, max_steps: int | None) -> dict[str, Any]:
    data = workload_spec(workload, seed)
    kfac = {
        k: v
        for k, v in data["kfac"].items()
        if k not in ("strategy", "factor_update_steps", "inv_update_steps")
    }
    data["kfac"] = {"strategy": "auto", **kfac, "intervals": LADDER, **CONFIGS[config]}
    data["name"] = "adaptive-" + config.replace(" ", "").replace(",", "-").replace("/", "-")
    data["memory_budget"] = "4GiB"
    data["checkpoint"] = {"every_steps": 100_000, "keep": 1}
    data["max_failures"] = 0
    if max_steps is not None:  # --quick: a few steps
        data["stop"]["max_steps"] = max_steps
    return data


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
            "seeds at the target",
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
    parser.add_argument("--workload", choices=WORKLOADS, default="large-batch")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--resume", action="store_true", help="skip runs already in the JSON")
    parser.add_argument("--quick", action="store_true", help="1 seed, 20 steps")
    parser.add_argument("--write", action="store_true", help="store the table")
    parser.add_argument("--json", type=Path, help="default: results/adaptive_intervals_<workload>")
    parser.add_argument("--from-json", action="store_true", help="re-print the stored run")
    args = parser.parse_args()
    block = f"adaptive-intervals-{args.workload}"
    json_path: Path = args.json or RESULTS / f"adaptive_intervals_{args.workload}.json"
    max_steps = None
    if args.quick:
        args.seeds, max_steps = [0], 20
        json_path = Path(tempfile.mkdtemp()) / "quick.json"
    if args.from_json:
        meta, runs = load(json_path)
        text = summarize(runs, meta["header"])
        print(text)
        if args.write:
            write_block(block, text)
        return
    torch.set_num_threads(1)
    meta, runs = load(json_path) if args.resume else ({}, [])
    started = datetime.datetime.now(datetime.UTC)
    example = spec(args.workload, "adaptive", 0, None)
    target = example["stop"]["target"]
    meta = meta or {
        "header": (
            f"Measured {started:%Y-%m-%d} at commit {git_commit()} on {machine()} (at the "
            f"start); {WORKLOADS[args.workload]}, lr {example['optimizer']['lr']:g}; ladder "
            f"{', '.join(f'{f}/{i}' for f, i in LADDER)}; seeds "
            f"{', '.join(map(str, args.seeds))} interleaved; medians of training seconds to "
            f"{target['metric']} {target['value']:g}."
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
                    config, spec(args.workload, config, seed, max_steps), Path(storage)
                )
                runs.append(run)
                json_path.parent.mkdir(parents=True, exist_ok=True)
                json_path.write_text(
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
        write_block(block, text)


if __name__ == "__main__":
    main()
