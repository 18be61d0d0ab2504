"""Time to 88% test accuracy on Fashion-MNIST with 2 Ray Train workers: SGD, Adam, K-FAC.

Every run is a real ``kaisa-ray`` job (``run_job``: TorchTrainer, DDP over gloo, one CPU per
worker) of the LeNet-style CNN, 64 samples per worker per step (a global batch of 128, as in
``optimizers_fashion_mnist.py``, whose tuned learning rates are used: SGD with Nesterov momentum
0.9 at lr 0.05, Adam at 3e-3), test accuracy on the full 10k test set every 25 steps, stopped
at 88%. K-FAC runs with the reference implementation's settings (damping 0.1, KL clip 0.001),
K-FAC-reduce, factors every 5 steps and decompositions every 50, once per distinct
``grad_worker_fraction`` at 2 workers: COMM-OPT (f = 1) and MEM-OPT (f = 1/2; HYBRID-OPT is the
same fraction at 2 workers). Then ``kfac: auto`` with the example's 2 GiB budget and nothing
chosen by hand: the tuner profiles the job on its workers and picks the fraction and the
intervals (the first seed profiles; later ones reuse the tuner actor's cached profile).
Runs are interleaved seed by seed, so drift in the machine's load hits every configuration
alike.

Reported per configuration, median over seeds: steps to target; training seconds to target
(wall-clock inside the workers' step loop: evaluation, checkpointing and worker start-up
excluded); wall-clock seconds from the first step, evaluation included; the ratio of training
seconds to the best first-order baseline's; mean ms per step; and where K-FAC's share of a step
goes (host time per phase: factors, decompositions, preconditioning, communication).

Run ``python benchmarks/ray_time_to_accuracy.py`` (``--quick`` for a smoke run; ``--only
SGD COMM auto`` for some configurations); ``--write`` stores the table in
``benchmarks/README.md`` and the plot in ``benchmarks/results/`` (a subset in their own
``-subset`` block and files).
"""

from __future__ import annotations

import os

# ENVIRONMENT.md: a local Ray for one process, no token, no usage stats, fast controller polls.
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
from report import git_commit, machine, table, write_block

from kaisa_ray.timing import PHASES
from kaisa_train.job import run_job
from kaisa_train.progress import read_progress
from kaisa_train.spec import parse_job_spec

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
TARGET = 0.88
KFAC = {
    "factor_update_steps": 5,
    "inv_update_steps": 50,
    "damping": 0.1,
    "kl_clip": 0.001,
    "kfac_approx": "reduce",
    "compute_method": "eigen",  # what its table ran (the JobSpec's default)
}

CONFIGS: dict[str, dict[str, Any]] = {
    "SGD (Nesterov 0.9, lr 0.05)": {
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "kfac": "off",
    },
    "Adam (lr 3e-3)": {"optimizer": {"name": "adam", "lr": 3e-3}, "kfac": "off"},
    "SGD + K-FAC, COMM-OPT (f=1)": {
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "kfac": {**KFAC, "strategy": "comm-opt"},
    },
    "SGD + K-FAC, MEM-OPT = HYBRID-OPT (f=1/2)": {
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "kfac": {**KFAC, "strategy": "mem-opt"},
    },
    # Nothing chosen by hand: the tuner picks f and the intervals under the example's budget.
    "SGD + K-FAC, kfac: auto (2 GiB budget)": {
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "kfac": {
            "strategy": "auto",
            "damping": 0.1,
            "kl_clip": 0.001,
            "kfac_approx": "reduce",
            "compute_method": "eigen",
        },
        "memory_budget": "2GiB",
    },
}
FIRST_ORDER = list(CONFIGS)[:2]


@dataclasses.dataclass
class Run:
    config: str
    seed: int
    steps: int | None  # None: the target was not reached
    train_s: float | None  # training seconds to the target
    wall_s: float | None  # seconds from the first step to the target, evaluation included
    ms_per_step: float
    kfac_ms: dict[str, float]
    curve: list[tuple[float, float, int]]  # (train_s, test_accuracy, step) per evaluation
    tuning: dict[str, Any] | None = None  # kfac: auto's choice and profiling time


def job(config: str, seed: int, max_steps: int, limit: int | None) -> dict[str, Any]:
    dataset: dict[str, Any] = {"name": "fashion-mnist", "batch_size": 64}
    if limit is not None:
        dataset["limit"] = limit
    return {
        "name": "bench",
        "model": {"name": "lenet"},
        "dataset": dataset,
        **CONFIGS[config],
        "scaling": {"workers": 2, "cpus_per_worker": 1},
        "stop": {"max_steps": max_steps, "target": {"metric": "test_accuracy", "value": TARGET}},
        "eval_every": 25,
        "checkpoint": {"every_steps": 100_000, "keep": 1},
        "seed": seed,
    }


def one_run(config: str, seed: int, args: argparse.Namespace, storage: Path) -> Run:
    return run_to_target(config, job(config, seed, args.max_steps, args.limit), storage)


def run_to_target(config: str, spec_data: dict[str, Any], storage: Path) -> Run:
    """Train ``spec_data`` as a real job and measure it: steps and training seconds to the
    target (from its evaluations), ms per step and K-FAC's phases (from its step records)."""
    spec = parse_job_spec(spec_data)
    seed = spec.seed
    result = run_job(spec, storage_path=storage, progress=False)
    if not result.succeeded:
        raise RuntimeError(f"{config}, seed {seed}: {result.error}")
    steps = read_progress(result.run_name, kinds=["step"])["records"]
    evals = read_progress(result.run_name, kinds=["eval"])["records"]
    total_steps = steps[-1]["step"]
    # Step records average over windows of 10 steps (the last may be shorter): weight them.
    ends = [s["step"] for s in steps]
    weights = [b - a for a, b in zip([0, *ends[:-1]], ends, strict=True)]
    ms = sum(w * s["ms_per_step"] for w, s in zip(weights, steps, strict=True)) / total_steps
    kfac_ms = {
        p: sum(w * s[f"kfac_{p}_ms"] for w, s in zip(weights, steps, strict=True)) / total_steps
        for p in PHASES
    }
    hit = next((e for e in evals if e["test_accuracy"] >= TARGET), None)
    tuner = read_progress(result.run_name, kinds=["tuner"])["records"]
    tuning = None
    if tuner:
        tuning = {k: tuner[-1][k] for k in ("chosen", "cache", "profile_s", "how")}
    return Run(
        config=config,
        seed=seed,
        steps=hit["step"] if hit else None,
        train_s=hit["train_s"] if hit else None,
        wall_s=hit["elapsed_s"] if hit else None,
        ms_per_step=ms,
        kfac_ms=kfac_ms if "K-FAC" in config else {},
        curve=[(e["train_s"], e["test_accuracy"], e["step"]) for e in evals],
        tuning=tuning,
    )


def median_or_none(values: list[float | None]) -> float | None:
    """Median over seeds; None if any seed missed the target (its time is unbounded)."""
    if any(v is None for v in values):
        return None
    return statistics.median(v for v in values if v is not None)


def summarize(runs: list[Run], header: str) -> str:
    by = {c: [r for r in runs if r.config == c] for c in CONFIGS}
    train = {c: median_or_none([r.train_s for r in rs]) for c, rs in by.items() if rs}
    baselines = [train[c] for c in FIRST_ORDER if c in train and train[c] is not None]
    best = min(baselines) if baselines else None
    rows = []
    for config, rs in by.items():
        if not rs:
            continue
        steps = median_or_none([r.steps for r in rs])
        wall = median_or_none([r.wall_s for r in rs])
        t = train[config]
        ratio = f"{t / best:.2f}" if t is not None and best else "-"
        phases = "-"
        if rs[0].kfac_ms:
            mean = {p: statistics.mean(r.kfac_ms[p] for r in rs) for p in PHASES}
            phases = " / ".join(f"{mean[p]:.1f}" for p in PHASES)
        reached = sum(r.steps is not None for r in rs)
        rows.append(
            [
                config,
                f"{reached}/{len(rs)}",
                "-" if steps is None else f"{steps:.0f}",
                "-" if t is None else f"{t:.1f}",
                "-" if wall is None else f"{wall:.1f}",
                ratio,
                f"{statistics.mean(r.ms_per_step for r in rs):.1f}",
                phases,
            ]
        )
    return table(
        header,
        [
            "configuration",
            "seeds at 88%",
            "steps (median)",
            "train s (median)",
            "wall s incl. eval",
            "train s ÷ best first-order",
            "ms/step",
            "K-FAC ms/step: factors / decomp. / precond. / comm.",
        ],
        rows,
    )


def plot(runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    palette = ["tab:gray", "tab:orange", "tab:blue", "tab:green", "tab:red"]
    colors = dict(zip(CONFIGS, palette, strict=True))
    for config in sorted({r.config for r in runs}, key=list(CONFIGS).index):
        for i, run in enumerate(r for r in runs if r.config == config):
            xs = [c[0] for c in run.curve]
            ys = [c[1] for c in run.curve]
            ax.plot(xs, ys, color=colors[config], alpha=0.8, label=config if i == 0 else None)
    ax.axhline(TARGET, color="black", linestyle="--", linewidth=0.8)
    ax.set_xlabel("training wall-clock seconds (2 Ray workers, evaluation excluded)")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0.6, 0.92)
    ax.set_title("Fashion-MNIST, LeNet CNN, 2 Ray Train workers: every seed")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=2000)
    parser.add_argument("--limit", type=int, default=None, help="samples per split (smoke runs)")
    parser.add_argument("--quick", action="store_true", help="1 seed, 60 steps, 4k samples")
    parser.add_argument("--write", action="store_true", help="store the table and the plot")
    parser.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="run only the configurations whose names contain one of these words; the table "
        "then goes to its own README block and files (suffix -subset)",
    )
    args = parser.parse_args()
    configs = [c for c in CONFIGS if args.only is None or any(w in c for w in args.only)]
    if args.quick:
        args.seeds, args.max_steps, args.limit = 1, 60, 4096

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    commit = git_commit()
    started = datetime.datetime.now(datetime.UTC)
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="kaisa-bench-") as storage:
        for seed in range(args.seeds):
            for config in configs:
                run = one_run(config, seed, args, Path(storage))
                runs.append(run)
                print(
                    f"seed {seed} {config}: steps {run.steps}, train s {run.train_s}, "
                    f"{run.ms_per_step:.1f} ms/step, K-FAC {run.kfac_ms}, tuner {run.tuning}",
                    flush=True,
                )
    ray.shutdown()
    header = (
        f"Measured {started:%Y-%m-%d} at commit {commit} on {machine()}; "
        f"{args.seeds} seed(s), max {args.max_steps} steps"
        + (f", {args.limit} samples per split" if args.limit else "")
        + "."
    )
    text = summarize(runs, header)
    choices = [
        f"seed {r.seed}: f={r.tuning['chosen']['grad_worker_fraction']:g}, intervals "
        f"{r.tuning['chosen']['factor_update_steps']}/{r.tuning['chosen']['inv_update_steps']}, "
        + (
            "profile from the tuner's cache"
            if r.tuning["cache"] == "hit"
            else f"{r.tuning['profile_s']:.1f} s of profiling"
        )
        for r in runs
        if r.tuning is not None
    ]
    if choices:
        text += "\n\n`kfac: auto` chose (profiling is outside the train seconds): " + "; ".join(
            choices
        )
    print(text)
    if args.write:
        suffix = "" if args.only is None else "-subset"
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"ray_time_to_accuracy{suffix}.json").write_text(
            json.dumps([dataclasses.asdict(r) for r in runs], indent=1)
        )
        plot(runs, RESULTS / f"ray_time_to_accuracy{suffix}.png")
        write_block(f"ray-time-to-accuracy{suffix}", text)


if __name__ == "__main__":
    main()
