"""Time to a validation loss with a small decoder-only transformer: AdamW against K-FAC.

The workload of another family than the CNN: ``char-transformer`` (2 blocks, width 64, 4 heads,
context 64: a byte-level language model of about 137k parameters) on Debian's ``fortunes``
(about 2.4 MB of English text; the last tenth is the validation split), on 2 Ray Train workers
with 32 sequences each (a global batch of 64 sequences, 4096 tokens), evaluated every 50 steps
on the whole validation split (4026 windows), stopped at a validation loss of ``TARGET`` nats
per byte.

The same tuning effort for both (``targets.Study``): 4 learning rates with a 50-step warm-up on
seed 0 (extended by up to 2 points while the best is at an end of the grid), then the best of
each with seeds 0, 1 and 2 interleaved. K-FAC preconditions every Linear layer (attention's
query, key, value and output projections, the MLP, the head) with the project's default
curvature (Fisher-scale factors, debiased averages, π-damping, damping 0.1, factors every 5
steps, damped inverses every 50 (under π-damping the eigen method's preconditioner at half the
matmuls a step), no KL clip) and hands the preconditioned gradients to the
same AdamW, which also updates the embeddings and LayerNorms it leaves alone. "K-FAC (quadratic
model)" is ``kfac.update: quadratic-model`` with the same curvature: K-FAC's own step (its α
and μ from the quadratic model, one damping from 0.1 adapted), no optimizer and no lr to tune
(the embeddings' and LayerNorms' raw gradients join the preconditioned ones in its direction);
it runs untuned, its finals only. "K-FAC (quadratic model, λ ≥ 1e-3)" is the same with the
adapted damping floored at 1e-3 (``kfac.min_damping``), also finals only.

The peers a user would try instead, from heavyball 3.2.1 (the ``peers`` extra), at its
defaults but the lr (tuned as AdamW's, 4 points a factor 2 apart around heavyball's default)
and no weight decay, eager (heavyball's ``torch.compile`` of the step off): SOAP, Muon (its
``MuonAdamW``: Muon for every parameter of 2 or more dimensions, the embeddings and the head
included, AdamW for the rest) and PSGD Kron.

Run ``python benchmarks/transformer_fortunes.py`` (``--quick`` for a smoke run); ``--write``
stores the table.
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
from pathlib import Path
from typing import Any

import ray
from report import git_commit, machine, table, write_block
from targets import Study, median_or_none

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
TARGET = 2.0  # validation loss, nats per byte
WORKERS = 2
PER_WORKER = 32
MAX_STEPS = 1500
SEEDS: tuple[int, ...] = (0, 1, 2)
QM = "K-FAC (quadratic model)"
# The same, its adapted damping floored (kfac.min_damping; added 2026-11-26): without the floor
# the Levenberg-Marquardt rule takes λ from 0.1 to 1e-8 here and the run diverges.
QM_FLOOR = "K-FAC (quadratic model, λ ≥ 1e-3)"
MIN_DAMPING = 1e-3
# kfac.scaling: adam-eigenbasis (added 2026-11-27): Adam's moments in K-FAC's eigenbasis for
# every Linear layer, on SGD without momentum (its lr the step size), and Adam's own step for
# the embeddings and LayerNorms K-FAC leaves alone (``EigenbasisAdam``); the eigen method at
# the AdamW + K-FAC row's intervals, on AdamW's lr grid.
ADAM_EIGENBASIS = "K-FAC (Adam eigenbasis)"
# The same with SOAP's cadence (added 2026-11-28): the factors every step and the bases every
# 10 (heavyball's SOAP updates its factors every step and its bases every 2 to 10 steps), where
# the row above refreshes them every 5 and 50.
ADAM_EIGENBASIS_FRESH = "K-FAC (Adam eigenbasis, 1/10)"
ADAM_EIGENBASIS_FRESHER = "K-FAC (Adam eigenbasis, 1/5)"
# ... and its factors from 8 of a worker's 32 sequences (kfac.factor_samples): the factors'
# products over 512 tokens instead of 2048, a quarter of their cost every step.
ADAM_EIGENBASIS_SAMPLED = "K-FAC (Adam eigenbasis, 1/5, 8 sequences)"
# K-FAC-reduce over the tokens (kfac.sequence_approx: reduce; added 2026-11-28): each
# sequence's mean input and summed output gradient are its factors' one row, so the factors'
# products run over a worker's 32 sequences instead of its 2048 tokens.
REDUCED = "AdamW + K-FAC (tokens reduced)"
ADAM_EIGENBASIS_REDUCED = "K-FAC (Adam eigenbasis, 1/5, tokens reduced)"
# Cheaper factors still (added 2026-12-06, where the row above was 0.48x AdamW's time against
# compiled Muon's 0.45x): from 4 sequences at the same cadence, or from 8 every second step
# with the bases every 10.
ADAM_EIGENBASIS_4 = "K-FAC (Adam eigenbasis, 1/5, 4 sequences)"
ADAM_EIGENBASIS_2_10 = "K-FAC (Adam eigenbasis, 2/10, 8 sequences)"
# The 4-sequence row with its bases refreshed as SOAP refreshes its own (added 2026-12-07:
# kfac.basis_update: power-qr, one power iteration from the basis held and a QR instead of
# an eigh after the first), about half the decompositions' cost.
ADAM_EIGENBASIS_4_QR = "K-FAC (Adam eigenbasis, 1/5, 4 sequences, power-QR)"
# The 8- and 4-sequence rows with the token and position embeddings preconditioned too
# (added 2026-12-07: kfac.embeddings), as SOAP preconditions them, where the rows above leave
# them to Adam: SOAP with its embeddings left to Adam took 300 steps where it takes 270-280.
ADAM_EIGENBASIS_8_EMB = "K-FAC (Adam eigenbasis, 1/5, 8 sequences, embeddings)"
ADAM_EIGENBASIS_4_EMB = "K-FAC (Adam eigenbasis, 1/5, 4 sequences, embeddings)"
# ... and its bases every 3 steps (added 2026-12-07; heavyball's SOAP refreshes its own every
# 2 at its default): a one-process probe took 270 steps on seed 0 against 280 at every 5.
ADAM_EIGENBASIS_8_EMB_3 = "K-FAC (Adam eigenbasis, 1/3, 8 sequences, embeddings)"
FRESH_INTERVALS: dict[str, dict[str, Any]] = {
    ADAM_EIGENBASIS_FRESH: {"factor_update_steps": 1, "inv_update_steps": 10},
    ADAM_EIGENBASIS_FRESHER: {"factor_update_steps": 1, "inv_update_steps": 5},
    ADAM_EIGENBASIS_SAMPLED: {"factor_update_steps": 1, "inv_update_steps": 5, "factor_samples": 8},
    ADAM_EIGENBASIS_4: {"factor_update_steps": 1, "inv_update_steps": 5, "factor_samples": 4},
    ADAM_EIGENBASIS_2_10: {"factor_update_steps": 2, "inv_update_steps": 10, "factor_samples": 8},
    ADAM_EIGENBASIS_4_QR: {
        "factor_update_steps": 1,
        "inv_update_steps": 5,
        "factor_samples": 4,
        "basis_update": "power-qr",
    },
    ADAM_EIGENBASIS_REDUCED: {
        "factor_update_steps": 1,
        "inv_update_steps": 5,
        "sequence_approx": "reduce",
    },
    ADAM_EIGENBASIS_8_EMB: {
        "factor_update_steps": 1,
        "inv_update_steps": 5,
        "factor_samples": 8,
        "embeddings": True,
    },
    ADAM_EIGENBASIS_4_EMB: {
        "factor_update_steps": 1,
        "inv_update_steps": 5,
        "factor_samples": 4,
        "embeddings": True,
    },
    ADAM_EIGENBASIS_8_EMB_3: {
        "factor_update_steps": 1,
        "inv_update_steps": 3,
        "factor_samples": 8,
        "embeddings": True,
    },
}
GRIDS = {
    "AdamW": [1e-3, 2e-3, 4e-3, 8e-3],
    "AdamW + K-FAC": [1e-3, 2e-3, 4e-3, 8e-3],
    REDUCED: [1e-3, 2e-3, 4e-3, 8e-3],
    ADAM_EIGENBASIS: [1e-3, 2e-3, 4e-3, 8e-3],
    ADAM_EIGENBASIS_FRESH: [1e-3, 2e-3, 4e-3, 8e-3],
    ADAM_EIGENBASIS_FRESHER: [1e-3, 2e-3, 4e-3, 8e-3],
    ADAM_EIGENBASIS_SAMPLED: [1e-3, 2e-3, 4e-3, 8e-3],
    ADAM_EIGENBASIS_4: [1e-3, 2e-3, 4e-3, 8e-3],
    ADAM_EIGENBASIS_2_10: [1e-3, 2e-3, 4e-3, 8e-3],
    ADAM_EIGENBASIS_4_QR: [1e-3, 2e-3, 4e-3, 8e-3],
    ADAM_EIGENBASIS_REDUCED: [1e-3, 2e-3, 4e-3, 8e-3],
    # the Adam-eigenbasis rows' grid as their tuning extended it (their best: 1.6e-2)
    ADAM_EIGENBASIS_8_EMB: [4e-3, 8e-3, 1.6e-2, 3.2e-2],
    ADAM_EIGENBASIS_4_EMB: [4e-3, 8e-3, 1.6e-2, 3.2e-2],
    ADAM_EIGENBASIS_8_EMB_3: [4e-3, 8e-3, 1.6e-2, 3.2e-2],
    # kfac.update: quadratic-model: no lr to tune; its one setting, the starting damping,
    # adapts, so it runs untuned at the JobSpec's 0.1 (the step sizes here are that damping).
    QM: [0.1],
    QM_FLOOR: [0.1],
    # The peers a user would try instead (heavyball, the ``peers`` extra; kfac: off): 4 lrs a
    # factor 2 apart around heavyball's default, as AdamW's.
    "SOAP": [1.5e-3, 3e-3, 6e-3, 1.2e-2],
    "Muon": [1.25e-3, 2.5e-3, 5e-3, 1e-2],
    "PSGD Kron": [5e-4, 1e-3, 2e-3, 4e-3],
}
PEERS = {"SOAP": "soap", "Muon": "muon", "PSGD Kron": "psgd-kron"}
KFAC: dict[str, Any] = {
    "strategy": "comm-opt",
    "compute_method": "inverse",  # under π-damping: the eigen method's preconditioner, cheaper
    "factor_update_steps": 5,
    "inv_update_steps": 50,
    "damping": 0.1,
    "kl_clip": None,
    "running_average": "debiased",
    "factor_scale": "fisher",
    "pi_damping": True,
}


def spec(optimizer: str, lr: float, seed: int, max_steps: int) -> dict[str, Any]:
    return {
        "name": "lm-"
        + (
            "kfac-qm"
            if optimizer in (QM, QM_FLOOR)
            else "kfac-adam-eigenbasis"
            if optimizer == ADAM_EIGENBASIS or optimizer in FRESH_INTERVALS
            else "kfac"
            if "K-FAC" in optimizer
            else PEERS.get(optimizer, "adamw")
        ),
        "model": {"name": "char-transformer"},
        "dataset": {"name": "fortunes", "batch_size": PER_WORKER},
        "optimizer": (
            {
                "name": "sgd",
                "lr": lr,
                "momentum": 0.0,
                "schedule": {"kind": "constant", "warmup_steps": 50},
            }
            if optimizer == ADAM_EIGENBASIS or optimizer in FRESH_INTERVALS
            else {
                "name": PEERS.get(optimizer, "adamw"),
                "lr": lr,
                "weight_decay": 0.0,
                "schedule": {"kind": "constant", "warmup_steps": 50},
            }
        ),
        "kfac": (
            {**KFAC, "update": "quadratic-model", "damping": lr, "min_damping": MIN_DAMPING}
            if optimizer == QM_FLOOR
            # The library's floor, 1e-8: unfloored, as this row first ran (the JobSpec's
            # default floor has been 1e-3 since).
            else {**KFAC, "update": "quadratic-model", "damping": lr, "min_damping": 1e-8}
            if optimizer == QM
            else {**KFAC, "compute_method": "eigen", "scaling": "adam-eigenbasis"}
            if optimizer == ADAM_EIGENBASIS
            else {
                **KFAC,
                **FRESH_INTERVALS[optimizer],
                "compute_method": "eigen",
                "scaling": "adam-eigenbasis",
            }
            if optimizer in FRESH_INTERVALS
            else {**KFAC, "sequence_approx": "reduce"}
            if optimizer == REDUCED
            else KFAC
            if "K-FAC" in optimizer
            else "off"
        ),
        "scaling": {"workers": WORKERS, "cpus_per_worker": 1},
        "stop": {"max_steps": max_steps, "target": {"metric": "test_loss", "value": TARGET}},
        "eval_every": 50,
        "checkpoint": {"every_steps": 100_000, "keep": 1},
        "seed": seed,
    }


def summarize(study: Study, header: str) -> str:
    rows = []
    train = {o: median_or_none([e.run.train_s for e in study.finals("lm", o)]) for o in GRIDS}
    for optimizer in GRIDS:
        finals = study.finals("lm", optimizer)
        if not finals:
            continue
        steps = median_or_none([e.run.steps for e in finals])
        t = train[optimizer]
        base = train["AdamW"]
        ratio = f"{t / base:.2f}" if t is not None and base else "-"
        rows.append(
            [
                optimizer,
                f"λ₀ {finals[0].step_size:g} (untuned)"
                if optimizer in (QM, QM_FLOOR)
                else f"lr {finals[0].step_size:g}",
                f"{sum(e.run.steps is not None for e in finals)}/{len(finals)}",
                "-" if steps is None else f"{steps:.0f}",
                "-" if t is None else f"{t:.1f}",
                f"{statistics.mean(e.run.ms_per_step for e in finals):.1f}",
                ratio,
            ]
        )
    return table(
        header,
        [
            "optimizer",
            "tuned lr",
            f"seeds at loss {TARGET}",
            "steps (median)",
            "train s (median)",
            "ms/step",
            "train s ÷ AdamW's",
        ],
        rows,
    )


FINE_EVERY = 10
FINE_JSON = RESULTS / "transformer_fortunes_fine.json"
FINE_ROWS = (
    "AdamW",
    "AdamW + K-FAC",
    ADAM_EIGENBASIS_SAMPLED,
    ADAM_EIGENBASIS_4,
    ADAM_EIGENBASIS_8_EMB,
    ADAM_EIGENBASIS_4_EMB,
    ADAM_EIGENBASIS_8_EMB_3,
    "SOAP",
    "Muon",
    "PSGD Kron",
)


def crossing(run: Any, target: float = TARGET) -> float | None:
    """Where a run's validation loss crossed ``target``, interpolated linearly in steps
    between the two evaluations around it (None if it never did)."""
    for (_, before, s0), (_, after, s1) in zip(run.curve, run.curve[1:], strict=False):
        if before > target >= after:
            return float(s0 + (before - target) / (before - after) * (s1 - s0))
    return None


def fine(args: argparse.Namespace) -> None:
    """Steps to the target at a finer grain: every ``FINE_EVERY`` steps instead of 50 (where
    one evaluation's step is a sixth of a 300-step run), the finals of ``FINE_ROWS`` (or
    ``--optimizers``) at the lrs the main study tuned, 3 seeds; beside them, the main study's
    steps and their crossings interpolated between its evaluations."""
    coarse = Study.stored(args.json)
    rows = (
        [o for o in args.optimizers if o in FINE_ROWS]
        if args.optimizers != list(GRIDS)
        else list(FINE_ROWS)
    )
    lrs = {}
    for optimizer in rows:
        best = coarse.best("lm", optimizer)
        if best is None:
            raise SystemExit(f"{optimizer!r} has no tuned lr in {args.json}: tune it first")
        lrs[optimizer] = best.step_size
    if args.report:
        study = Study.stored(FINE_JSON)
    else:
        started = datetime.datetime.now(datetime.UTC)
        meta = {"commit": git_commit(), "machine": machine(), "started": started.isoformat()}

        def fine_spec(optimizer: str, lr: float, seed: int, max_steps: int) -> dict[str, Any]:
            return {**spec(optimizer, lr, seed, max_steps), "eval_every": FINE_EVERY}

        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
        with tempfile.TemporaryDirectory(prefix="kaisa-lm-") as storage:
            study = Study(FINE_JSON, Path(storage), meta, resume=True)
            for seed in SEEDS:
                for optimizer in rows:
                    study.measure(
                        "lm", optimizer, lrs[optimizer], "final", seed, fine_spec, MAX_STEPS
                    )
        ray.shutdown()
    table_rows = []
    for optimizer in rows:
        finals = study.finals("lm", optimizer)
        wide = coarse.finals("lm", optimizer)
        steps = [e.run.steps for e in finals]
        crossed = [crossing(e.run) for e in wide]
        table_rows.append(
            [
                optimizer,
                f"lr {lrs[optimizer]:g}",
                " / ".join("-" if s is None else str(s) for s in steps),
                _median(steps),
                " / ".join("-" if e.run.steps is None else str(e.run.steps) for e in wide),
                " / ".join("-" if c is None else f"{c:.0f}" for c in crossed),
            ]
        )
    meta = study.meta
    header = (
        f"Measured {meta['started'][:10]} at commit {meta['commit']} on {meta['machine']}; "
        f"{WORKERS} Ray Train workers x {PER_WORKER} sequences, validation loss {TARGET} on the "
        f"whole validation split evaluated every {FINE_EVERY} steps, each row at the lr the "
        f"main study tuned, seeds {', '.join(map(str, SEEDS))}; beside it the main study's "
        "finals (evaluated every 50 steps) and where their loss crossed the target, "
        "interpolated between evaluations."
    )
    columns = [
        "optimizer",
        "lr",
        f"steps, every {FINE_EVERY} (seeds)",
        "median",
        "steps, every 50 (seeds)",
        "interpolated crossings (seeds)",
    ]
    text = table(header, columns, table_rows)
    print(text)
    if args.write:
        write_block("transformer-fortunes-fine", text)


def _median(values: list[int | None]) -> str:
    found = median_or_none([float(v) for v in values if v is not None])
    return (
        "-"
        if found is None or len(values) != sum(v is not None for v in values)
        else f"{found:.0f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resume", action="store_true", help="skip runs already in the JSON")
    parser.add_argument(
        "--phase",
        choices=["tune", "final", "both"],
        default="both",
        help="only the tuning grid (steps: any machine) or only the finals (seconds: a quiet one)",
    )
    parser.add_argument(
        "--optimizers", nargs="+", choices=list(GRIDS), default=list(GRIDS), metavar="NAME"
    )
    parser.add_argument("--quick", action="store_true", help="1 seed, 2 lrs, 40 steps")
    parser.add_argument("--write", action="store_true", help="store the table")
    parser.add_argument(
        "--report", action="store_true", help="run nothing: the table (and --write) from the JSON"
    )
    parser.add_argument("--json", type=Path, default=RESULTS / "transformer_fortunes.json")
    parser.add_argument(
        "--fine",
        action="store_true",
        help=f"the finals again, evaluated every {FINE_EVERY} steps, at the lrs --json tuned "
        f"(into {FINE_JSON.name}; with --report, its table)",
    )
    args = parser.parse_args()
    if args.fine:
        fine(args)
        return
    grids = {o: GRIDS[o] for o in args.optimizers}
    seeds, max_steps = SEEDS, MAX_STEPS
    if args.quick:
        grids = {o: g[1:3] or g for o, g in grids.items()}
        seeds, max_steps = (0,), 40
        args.json = Path(tempfile.mkdtemp()) / "quick.json"
    phases = ("tune", "final") if args.phase == "both" else (args.phase,)
    started = datetime.datetime.now(datetime.UTC)
    meta = {"commit": git_commit(), "machine": machine(), "started": started.isoformat()}
    if args.report:  # the stored runs, under the machine and commit they were measured on
        study = Study.stored(args.json)
        meta = study.meta
        started = datetime.datetime.fromisoformat(meta["started"])
    else:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
        with tempfile.TemporaryDirectory(prefix="kaisa-lm-") as storage:
            study = Study(args.json, Path(storage), meta, resume=args.resume)
            study.run("lm", grids, seeds, spec, max_steps, phases)
        ray.shutdown()
    header = (
        f"The last run measured {started:%Y-%m-%d} at commit {meta['commit']} on "
        f"{meta['machine']} (rows run on other days: the text above says which); "
        f"{WORKERS} Ray Train workers x {PER_WORKER} sequences of 64 bytes, validation loss "
        f"{TARGET} on the whole validation split; tuned on seed 0 over "
        f"{len(next(iter(grids.values())))} learning rates each, then seeds "
        f"{', '.join(map(str, seeds))} interleaved; medians."
    )
    text = summarize(study, header)
    print(text)
    if args.write:
        write_block("transformer-fortunes", text)


if __name__ == "__main__":
    main()
