"""The batch-size study: steps and wall-clock to 88% test accuracy on Fashion-MNIST against the
global batch size, for SGD with Nesterov momentum, AdamW and K-FAC, on 2 Ray Train workers.

Every run is a real kaisa-ray job (``run_job``: TorchTrainer, DDP over gloo, one CPU per worker)
of the LeNet-style CNN, the global batch split over the 2 workers, test accuracy on the full 10k
test set every ``eval_every`` steps, stopped at 88%.

The same tuning effort for every optimizer, at every batch size (seed 0):

- a grid of 5 step sizes with a linear warm-up of 20 steps and a constant rate after it
  (extended by up to 2 points, at the grid's spacing, while the best is at an end of it):
  SGD (Nesterov 0.9) lr 0.0125-0.2 and AdamW (no weight decay) lr 5e-4-8e-3, each a factor 2
  apart; for K-FAC the step size is the KL clip κ (the natural-gradient step's length, since the
  clip binds: the lr of the SGD under it, 1, is only an upper bound), κ 3e-4-3e-2 a factor of
  about 3 apart. No "scaling rule" guess is needed: each grid spans 16-100x and is the same at
  every batch size, so the optimum a scaling rule would predict lies inside it (the chosen
  points are in the table; an optimum on a grid's edge is flagged);
- "AdamW + K-FAC (damping)": a second stage for AdamW + K-FAC, its damping over 0.01-0.3
  (4 points, about 3 apart; extended the same way) at the lr AdamW + K-FAC tuned to, on
  seed 0: its row is AdamW + K-FAC with both tuned, at more tuning runs than the first-order
  optimizers had (run it with ``--optimizers 'AdamW + K-FAC (damping)'`` after the lr stage);
- "K-FAC (quadratic model)": ``kfac.update: quadratic-model``, K-FAC's own step (the quadratic
  model's α and μ, one damping adapted by Levenberg-Marquardt), with no lr, momentum or warm-up:
  its one setting, the starting damping, runs untuned at 0.1, so it has no tuning runs, only
  finals (less tuning than any other row);
- the best grid point is the one with the fewest steps to the target (ties: fewer training
  seconds); the grid is visited from its middle outwards (``targets.middle_out``: the same
  points, likeliest best first), a grid point stops as soon as it has taken as many steps as
  the best one so far needed (it cannot beat it), and a diverging one stops at once;
- then the best point of each optimizer runs with seeds 0, 1 and 2, interleaved seed by seed,
  and the table reports medians.

The peers a user would try instead, from heavyball 3.2.1 (the ``peers`` extra), at its
defaults but the lr and no weight decay, eager (heavyball's ``torch.compile`` of the step
off), tuned exactly as AdamW (5 lrs a factor 2 apart, heavyball's default in the middle):
"SOAP", "Muon" (heavyball's ``MuonAdamW``: Muon for the weights of 2 or more dimensions, the
convolutions' and the classifier's included, AdamW for the biases) and "PSGD Kron".

K-FAC is the project's default curvature (Fisher-scale factors, debiased running averages,
π-damping, damping 0.1, K-FAC-reduce, COMM-OPT) on SGD with Nesterov momentum 0.9, factors
every 5 steps and eigendecompositions every 50 at global batches 128 and 512, every step and
every 10 at 2048 and 8192 (``INTERVALS``); at batches above 256 per worker its factors come
from 256 examples of each worker's batch (``factor_samples``: an unbiased estimate at a fraction
of the cost; the ablation in ``optimizers_fashion_mnist.py --ablation`` shows its effect).

Training seconds exclude evaluation and worker start-up (what the train loop's step timer
counts). Runs write ``results/batch_size_study.json`` as they finish; ``--resume`` skips the runs
already there, so a long study survives an interruption.

Run ``python benchmarks/batch_size_study.py`` (hours on 2 cores; ``--batches 128 512`` for some
sizes; ``--quick`` for a smoke run); ``--write`` stores the table and the plots.
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")

import argparse
import datetime
import statistics
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import ray
from report import git_commit, machine, table, write_block
from targets import Entry, Study, best_tuned, median_or_none

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
TARGET = 0.88
WORKERS = 2
WARMUP = 20
SEEDS = (0, 1, 2)
# Per global batch: at most this many steps, an evaluation every so many.
LIMITS = {128: (1500, 10), 512: (1000, 10), 2048: (600, 10), 8192: (400, 5)}
FACTOR_SAMPLES = 256  # per worker, from batches larger than this
# K-FAC's factor and eigendecomposition intervals per global batch: where a plain step costs
# more (larger batches) and the factors come from FACTOR_SAMPLES examples, more frequent updates
# cost the same share of a step, and a run of a few hundred steps needs fresh curvature.
INTERVALS = {128: (5, 50), 512: (5, 50), 2048: (1, 10), 8192: (1, 10)}

DAMPED = "AdamW + K-FAC (damping)"
QM = "K-FAC (quadratic model)"
# The same with its adapted damping floored (kfac.min_damping, added 2026-11-26): at small
# batches the Levenberg-Marquardt rule otherwise lowers λ until the step fits its sample.
QM_FLOOR = "K-FAC (quadratic model, λ ≥ 1e-3)"
MIN_DAMPING = 1e-3
# The peers a user would try instead (heavyball, the ``peers`` extra; kfac: off), each on a
# grid of 5 lrs a factor 2 apart around heavyball's default, as AdamW's.
PEERS = {"SOAP": "soap", "Muon": "muon", "PSGD Kron": "psgd-kron"}
# SOAP with its eigenbases refreshed every step (heavyball's precondition_frequency 1, against
# its default 2; added 2026-12-06): the cadence "K-FAC (Adam eigenbasis, 1/1)" runs at, so
# that the two compare at the same freshness of their bases.
SOAP_1 = "SOAP (bases every step)"
PEER_OPTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    **{name: (optimizer, {}) for name, optimizer in PEERS.items()},
    SOAP_1: ("soap", {"precondition_frequency": 1}),
}
# kfac.scaling: adam-eigenbasis (SOAP's recipe on K-FAC's factors): Adam's moments in the eigen
# method's bases, on SGD without momentum, whose lr is the step size.
ADAM_EIGENBASIS = "K-FAC (Adam eigenbasis)"
# Its bases refreshed twice as often at the large batches (SOAP refreshes every 2 steps): one
# process at 2048, seed 0, lr 0.02, reached 88% in 40 steps at 1/5 and 1/2 against 50 at 1/10.
ADAM_INTERVALS = {**INTERVALS, 2048: (1, 5), 8192: (1, 5)}
# The same with the bases refreshed every 2 steps (added 2026-11-28): SOAP's own default cadence
# (heavyball's precondition_frequency 2), at 8192 where the row above is level with SOAP.
ADAM_EIGENBASIS_2 = "K-FAC (Adam eigenbasis, 1/2)"
ADAM_INTERVALS_2 = {batch: (1, 2) for batch in INTERVALS}
# ... and every step (added 2026-12-06): at 8192 a step is over a second on this CPU and the
# eigendecompositions of LeNet's factors a few tens of ms, so fresh bases cost little there.
ADAM_EIGENBASIS_1 = "K-FAC (Adam eigenbasis, 1/1)"
ADAM_INTERVALS_1 = {batch: (1, 1) for batch in INTERVALS}
ADAM_ROWS = {
    ADAM_EIGENBASIS: ADAM_INTERVALS,
    ADAM_EIGENBASIS_2: ADAM_INTERVALS_2,
    ADAM_EIGENBASIS_1: ADAM_INTERVALS_1,
}
# kfac.scaling: ekfac (EKFAC, George et al. 2018): the "K-FAC" form (the KL clip κ its step
# size, on SGD lr 1 with Nesterov momentum, the eigen method) with the per-example second
# moments in the eigenbasis in place of the eigenvalue products (no π-damping: the damping is
# added to the fitted diagonal), refitted on every factor update.
EKFAC = "K-FAC (EKFAC)"
# ... and in the "AdamW + K-FAC" form (AdamW's lr, no KL clip): the same tuning as that row.
ADAMW_EKFAC = "AdamW + K-FAC (EKFAC)"
OPTIMIZERS = (
    "SGD",
    "AdamW",
    "K-FAC",
    "K-FAC (lr)",
    "AdamW + K-FAC",
    DAMPED,
    QM,
    QM_FLOOR,
    ADAM_EIGENBASIS,
    ADAM_EIGENBASIS_2,
    ADAM_EIGENBASIS_1,
    EKFAC,
    ADAMW_EKFAC,
    *PEERS,
    SOAP_1,
)
GRIDS: dict[str, list[float]] = {
    "SGD": [0.0125, 0.025, 0.05, 0.1, 0.2],
    "AdamW": [5e-4, 1e-3, 2e-3, 4e-3, 8e-3],
    "K-FAC": [3e-4, 1e-3, 3e-3, 1e-2, 3e-2],  # the KL clip, on SGD lr 1
    "K-FAC (lr)": [0.0125, 0.025, 0.05, 0.1, 0.2],  # SGD's lr under the KL clip KL_CLIP
    "AdamW + K-FAC": [5e-4, 1e-3, 2e-3, 4e-3, 8e-3],  # AdamW's lr, no KL clip
    # A second stage for AdamW + K-FAC: its damping, at the lr it tuned to in the same group.
    DAMPED: [0.01, 0.03, 0.1, 0.3],
    # kfac.update: quadratic-model: no lr, no momentum; its one setting, the starting damping
    # λ₀, adapts by the Levenberg-Marquardt rule, so it runs at the JobSpec's 0.1, untuned.
    QM: [0.1],
    QM_FLOOR: [0.1],
    ADAM_EIGENBASIS: [2.5e-3, 5e-3, 1e-2, 2e-2, 4e-2],
    ADAM_EIGENBASIS_2: [2.5e-3, 5e-3, 1e-2, 2e-2, 4e-2],
    ADAM_EIGENBASIS_1: [2.5e-3, 5e-3, 1e-2, 2e-2, 4e-2],
    EKFAC: [3e-4, 1e-3, 3e-3, 1e-2, 3e-2],  # the KL clip, on SGD lr 1, as "K-FAC"
    ADAMW_EKFAC: [5e-4, 1e-3, 2e-3, 4e-3, 8e-3],  # AdamW's lr, as "AdamW + K-FAC"
    "SOAP": [7.5e-4, 1.5e-3, 3e-3, 6e-3, 1.2e-2],  # heavyball's default 3e-3 in the middle
    "Muon": [6.25e-4, 1.25e-3, 2.5e-3, 5e-3, 1e-2],  # 2.5e-3
    "PSGD Kron": [2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3],  # 1e-3
    SOAP_1: [7.5e-4, 1.5e-3, 3e-3, 6e-3, 1.2e-2],  # SOAP's
}
# "K-FAC (lr)": the same curvature on SGD's own lr grid with the JobSpec's KL clip, as the
# one-process ablation (optimizers_fashion_mnist.py --ablation) ran it, and the inverse method:
# under π-damping the damped inverses are exactly the eigen method's preconditioner
# (tests/core/test_curvature_options.py) at two matmuls a step instead of four.
KL_CLIP = 1e-3
KFAC: dict[str, Any] = {
    "strategy": "comm-opt",
    "factor_update_steps": 5,
    "inv_update_steps": 50,
    "damping": 0.1,
    "kfac_approx": "reduce",
    "running_average": "debiased",
    "factor_scale": "fisher",
    "pi_damping": True,
}


def tuned_lr(entries: list[Entry], batch: int) -> float:
    """AdamW + K-FAC's tuned lr at ``batch`` (its best tuning run), where its damping is tuned."""
    best = best_tuned(entries, str(batch), "AdamW + K-FAC")
    if best is None:
        raise SystemExit(
            f"{DAMPED!r} at batch {batch} tunes the damping at AdamW + K-FAC's tuned lr: tune "
            f"AdamW + K-FAC at batch {batch} first (--optimizers 'AdamW + K-FAC')"
        )
    return best.step_size


def spec(
    batch: int,
    optimizer: str,
    step_size: float,
    seed: int,
    max_steps: int,
    lr: Callable[[], float] | None = None,
) -> dict[str, Any]:
    """The job of ``optimizer`` at ``step_size``; for ``DAMPED`` the step size is the damping
    and ``lr()`` gives AdamW's lr."""
    per_worker = batch // WORKERS
    schedule = {"kind": "constant", "warmup_steps": WARMUP}
    kfac: dict[str, Any] | str = "off"
    damping = KFAC["damping"]
    if optimizer == DAMPED:
        if lr is None:
            raise ValueError(f"{DAMPED!r} needs AdamW + K-FAC's tuned lr (lr=...)")
        damping, step_size = step_size, lr()
    if optimizer in (QM, QM_FLOOR):
        damping = step_size
        opt = {"name": "sgd"}  # unused: K-FAC takes the step
    elif optimizer in ("AdamW", "AdamW + K-FAC", DAMPED, ADAMW_EKFAC):
        opt = {"name": "adamw", "lr": step_size, "weight_decay": 0.0, "schedule": schedule}
    elif optimizer in ADAM_ROWS:
        opt = {"name": "sgd", "lr": step_size, "momentum": 0.0, "schedule": schedule}
    elif optimizer in PEER_OPTIONS:
        name, options = PEER_OPTIONS[optimizer]
        opt = {"name": name, "lr": step_size, "weight_decay": 0.0, "schedule": schedule, **options}
    else:  # SGD's lr; under the "K-FAC" form 1, the clip being the step size
        sgd_lr = 1.0 if optimizer in ("K-FAC", EKFAC) else step_size
        opt = {"name": "sgd", "lr": sgd_lr, "momentum": 0.9, "schedule": schedule}
    if "K-FAC" in optimizer:
        # "AdamW + K-FAC", the transformer benchmark's form: AdamW normalises the
        # preconditioned gradients' scale itself, so no KL clip.
        clip = {"K-FAC": step_size, EKFAC: step_size, "K-FAC (lr)": KL_CLIP}.get(optimizer)
        fus, ius = ADAM_ROWS.get(optimizer, INTERVALS)[batch]
        kfac = {
            **KFAC,
            "damping": damping,
            "kl_clip": clip,
            "factor_update_steps": fus,
            "inv_update_steps": ius,
        }
        # The κ form ran the eigen method (the JobSpec's default), the others the inverse
        # method.
        kfac["compute_method"] = "eigen" if optimizer == "K-FAC" else "inverse"
        if optimizer in ADAM_ROWS:
            kfac["compute_method"] = "eigen"
            kfac["scaling"] = "adam-eigenbasis"
        if optimizer in (EKFAC, ADAMW_EKFAC):
            kfac.update(compute_method="eigen", scaling="ekfac", pi_damping=False)
        if optimizer in (QM, QM_FLOOR):
            kfac["update"] = "quadratic-model"
        if optimizer in (QM, QM_FLOOR):
            # QM: the library's floor, 1e-8, unfloored as the row first ran (the JobSpec's
            # default has been 1e-3 since).
            kfac["min_damping"] = MIN_DAMPING if optimizer == QM_FLOOR else 1e-8
        if per_worker > FACTOR_SAMPLES:
            kfac["factor_samples"] = FACTOR_SAMPLES
    return {
        "name": f"bs{batch}-"
        + "".join(c for c in optimizer.lower() if (c.isascii() and c.isalnum()) or c == "-"),
        "model": {"name": "lenet"},
        "dataset": {"name": "fashion-mnist", "batch_size": per_worker},
        "optimizer": opt,
        "kfac": kfac,
        "scaling": {"workers": WORKERS, "cpus_per_worker": 1},
        "stop": {
            "max_steps": max_steps,
            "target": {"metric": "test_accuracy", "value": TARGET},
        },
        "eval_every": LIMITS[batch][1],
        "checkpoint": {"every_steps": 100_000, "keep": 1},
        "seed": seed,
    }


def summarize(entries: list[Entry], header: str) -> str:
    rows = []
    for batch in sorted({int(e.group) for e in entries}):
        finals = {
            o: [e for e in entries if e.group == str(batch) and e.optimizer == o]
            for o in OPTIMIZERS
        }
        finals = {o: [e for e in es if e.phase == "final"] for o, es in finals.items()}
        train = {o: median_or_none([e.run.train_s for e in es]) for o, es in finals.items()}
        steps = {o: median_or_none([e.run.steps for e in es]) for o, es in finals.items()}
        first_order = [o for o in ("SGD", "AdamW") if train[o] is not None]
        best = min(first_order, key=lambda o: train[o] or 0.0) if first_order else None
        for optimizer, es in finals.items():
            if not es:
                continue
            point = es[0].step_size
            tried = sorted(
                {
                    e.step_size
                    for e in entries
                    if (e.group, e.optimizer, e.phase) == (str(batch), optimizer, "tune")
                }
            )
            at_edge = len(tried) > 1 and point in (tried[0], tried[-1])
            edge = " (edge of the grid)" if at_edge else ""
            name = {
                "K-FAC": "κ",
                DAMPED: "damping",
                QM: "λ₀ (untuned)",
                QM_FLOOR: "λ₀ (untuned)",
            }.get(optimizer, "lr")
            kfac = "K-FAC" in optimizer
            t, s = train[optimizer], steps[optimizer]
            ratio_t = ratio_s = ratio_sgd = "-"
            if kfac and best is not None and t is not None and s is not None:
                ratio_t = f"{t / (train[best] or 1):.2f}x {best}"
                ratio_s = f"{s / (steps[best] or 1):.2f}x {best}"
            if kfac and s is not None and steps["SGD"] is not None:
                ratio_sgd = f"{s / steps['SGD']:.2f}x"
            reached = sum(e.run.steps is not None for e in es)
            rows.append(
                [
                    str(batch),
                    optimizer,
                    f"{name} {point:g}{edge}"
                    + (f" (lr {tuned_lr(entries, batch):g})" if optimizer == DAMPED else ""),
                    f"{reached}/{len(es)}",
                    "-" if s is None else f"{s:.0f}",
                    "-" if t is None else f"{t:.1f}",
                    f"{statistics.mean(e.run.ms_per_step for e in es):.1f}",
                    ratio_s,
                    ratio_sgd,
                    ratio_t,
                ]
            )
    return table(
        header,
        [
            "global batch",
            "optimizer",
            "tuned step size",
            "seeds at 88%",
            "steps (median)",
            "train s (median)",
            "ms/step",
            "K-FAC steps ÷ best first-order",
            "K-FAC steps ÷ SGD",
            "K-FAC train s ÷ best first-order",
        ],
        rows,
    )


def plot(entries: list[Entry], steps_path: Path, curve_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "SGD": "tab:gray",
        "AdamW": "tab:orange",
        "K-FAC": "tab:blue",
        "K-FAC (lr)": "tab:green",
        "AdamW + K-FAC": "tab:purple",
        DAMPED: "tab:red",
        QM: "tab:brown",
        QM_FLOOR: "tab:pink",
        "SOAP": "tab:olive",
        "Muon": "tab:cyan",
        "PSGD Kron": "black",
        SOAP_1: "olive",
        ADAM_EIGENBASIS: "gold",
        ADAM_EIGENBASIS_2: "goldenrod",
        ADAM_EIGENBASIS_1: "darkgoldenrod",
        EKFAC: "darkblue",
        ADAMW_EKFAC: "magenta",
    }
    finals = [e for e in entries if e.phase == "final"]
    fig, ax = plt.subplots(figsize=(7, 5))
    for optimizer in OPTIMIZERS:
        points = []
        for batch in sorted({int(e.group) for e in finals}):
            values = [
                e.run.steps for e in finals if e.group == str(batch) and e.optimizer == optimizer
            ]
            med = median_or_none(values)
            if med is not None:
                points.append((batch, med))
        if points:
            ax.plot(*zip(*points, strict=True), "o-", color=colors[optimizer], label=optimizer)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("global batch size (2 Ray Train workers)")
    ax.set_ylabel("steps to 88% test accuracy (median of 3 seeds)")
    ax.set_title("Fashion-MNIST, LeNet: steps to target against batch size")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(steps_path, dpi=110)
    plt.close(fig)

    largest = max(int(e.group) for e in finals)
    fig, ax = plt.subplots(figsize=(8, 5))
    for optimizer in OPTIMIZERS:
        runs = [e.run for e in finals if e.group == str(largest) and e.optimizer == optimizer]
        for i, run in enumerate(runs):
            xs = [c[0] for c in run.curve]
            ys = [c[1] for c in run.curve]
            label = optimizer if i == 0 else None
            ax.plot(xs, ys, color=colors[optimizer], alpha=0.8, label=label)
    ax.axhline(TARGET, color="black", linestyle="--", linewidth=0.8)
    ax.set_xlabel("training wall-clock seconds (2 Ray workers, evaluation excluded)")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0.5, 0.92)
    ax.set_title(f"Global batch {largest}: every seed")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(curve_path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=sorted(LIMITS))
    parser.add_argument("--resume", action="store_true", help="skip runs already in the JSON")
    parser.add_argument(
        "--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS), metavar="NAME"
    )
    parser.add_argument(
        "--phase",
        choices=["tune", "final", "both"],
        default="both",
        help="only the tuning grid (steps: any machine) or only the finals (seconds: a quiet one)",
    )
    parser.add_argument("--quick", action="store_true", help="batch 128, 2 grid points, 1 seed")
    parser.add_argument("--write", action="store_true", help="store the table and the plots")
    parser.add_argument(
        "--report", action="store_true", help="run nothing: the table (and --write) from the JSON"
    )
    parser.add_argument("--json", type=Path, default=RESULTS / "batch_size_study.json")
    args = parser.parse_args()
    unknown = set(args.batches) - set(LIMITS)
    if unknown:
        parser.error(f"batches {sorted(unknown)} have no step limits; choose from {sorted(LIMITS)}")
    grids: dict[str, list[float]] = {o: GRIDS[o] for o in args.optimizers}
    seeds: tuple[int, ...] = SEEDS
    if args.quick:
        args.batches = [128]
        grids = {o: g[2:4] for o, g in grids.items()}
        seeds = (0,)
        LIMITS[128] = (60, 20)
        args.json = Path(tempfile.mkdtemp()) / "quick.json"

    phases = ("tune", "final") if args.phase == "both" else (args.phase,)
    started = datetime.datetime.now(datetime.UTC)
    meta = {"commit": git_commit(), "machine": machine(), "started": started.isoformat()}
    if args.report:
        stored = Study.stored(args.json)
        meta, entries = stored.meta, stored.entries
        started = datetime.datetime.fromisoformat(meta["started"])
    else:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
        with tempfile.TemporaryDirectory(prefix="kaisa-bs-") as storage:
            study = Study(args.json, Path(storage), meta, resume=args.resume)
            for batch in sorted(args.batches):
                lr = partial(tuned_lr, study.entries, batch)
                study.run(
                    str(batch), grids, seeds, partial(spec, batch, lr=lr), LIMITS[batch][0], phases
                )
        ray.shutdown()
        entries = study.entries
    header = (
        f"The last run measured {started:%Y-%m-%d} at commit {meta['commit']} on "
        f"{meta['machine']} (rows run on other days and machines: the text above says which); "
        f"{WORKERS} Ray Train workers, tuned on seed 0 over 5 step sizes per optimizer, then "
        f"seeds {', '.join(map(str, seeds))} interleaved; medians."
    )
    text = summarize(entries, header)
    print(text)
    if args.write:
        RESULTS.mkdir(exist_ok=True)
        plot(
            entries,
            RESULTS / "batch_size_study_steps.png",
            RESULTS / "batch_size_study_curves.png",
        )
        write_block("batch-size-study", text)


if __name__ == "__main__":
    main()
