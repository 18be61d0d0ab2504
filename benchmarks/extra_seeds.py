"""More seeds for the batch-size study's chosen points at one batch: how robust its 3-seed
medians are.

The study (``batch_size_study.py``) tunes on seed 0 and reports medians over seeds 0-2. Where a
goal is met or missed by less than one seed's spread, more seeds say which way it really falls.
This runs each named optimizer at the step size the study's finals used (read from its JSON) on
further seeds, each a real Ray Train job built by the study's own ``spec``, interleaved seed by
seed, and prints steps to 88% per seed with the medians over the study's seeds and these.
It does not change the study's JSON; its runs go to ``results/extra_seeds.json``.

Run ``python benchmarks/extra_seeds.py --batch 8192 --seeds 3 4`` (about 12 minutes at 8192 on
2 cores; ``--optimizers`` names the study's rows, AdamW and AdamW + K-FAC by default, the first
being the ratios' baseline; ``--resume`` keeps the runs already in the JSON and adds the
missing ones; ``--write`` stores the table in benchmarks/README.md; ``--report`` re-prints it
from the JSON).
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")

import argparse
import datetime
import json
import tempfile
from functools import partial
from pathlib import Path

import ray
from batch_size_study import LIMITS, RESULTS, spec, tuned_lr
from report import git_commit, machine, table, write_block
from targets import Study, median_or_none, run_to_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8192, choices=sorted(LIMITS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[3, 4])
    parser.add_argument("--optimizers", nargs="+", default=["AdamW", "AdamW + K-FAC"])
    parser.add_argument("--study", type=Path, default=RESULTS / "batch_size_study.json")
    parser.add_argument("--json", type=Path, default=RESULTS / "extra_seeds.json")
    parser.add_argument("--report", action="store_true", help="run nothing: the table from JSON")
    parser.add_argument(
        "--resume", action="store_true", help="keep the JSON's runs; run only the missing ones"
    )
    parser.add_argument("--write", action="store_true", help="store the table")
    args = parser.parse_args()
    entries = Study(args.study, Path(), {}, resume=True).entries
    group = str(args.batch)
    finals = {
        o: [e for e in entries if (e.group, e.optimizer, e.phase) == (group, o, "final")]
        for o in args.optimizers
    }
    missing = [o for o, es in finals.items() if not es]
    if missing:
        raise SystemExit(f"no finals at batch {args.batch} for {missing} in {args.study}")
    if args.report:
        stored = json.loads(args.json.read_text())
        header, runs = stored["header"], stored["runs"]
    else:
        now = f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d} at commit {git_commit()}"
        header = (
            f"Measured {now} on {machine()}; global batch {args.batch}, 2 Ray Train workers, "
            f"the study's chosen step sizes; seeds {', '.join(map(str, args.seeds))} "
            "interleaved."
        )
        runs = []
        if args.resume and args.json.exists():
            stored = json.loads(args.json.read_text())
            runs = stored["runs"]
            header = f"{stored['header']} Runs added {now} on {machine()}."
        done = {(r["optimizer"], r["step_size"], r["seed"]) for r in runs}
        lr = partial(tuned_lr, entries, args.batch)
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
        with tempfile.TemporaryDirectory(prefix="kaisa-seeds-") as storage:
            for seed in args.seeds:
                for optimizer, es in finals.items():
                    step_size = es[0].step_size
                    if (optimizer, step_size, seed) in done:
                        continue
                    job = spec(args.batch, optimizer, step_size, seed, LIMITS[args.batch][0], lr=lr)
                    run = run_to_target(f"{optimizer} {step_size:g}", job, Path(storage))
                    runs.append(
                        {"optimizer": optimizer, "step_size": step_size, "seed": seed,
                         "steps": run.steps, "train_s": run.train_s,
                         "ms_per_step": run.ms_per_step}
                    )  # fmt: skip
                    print(f"{optimizer} seed {seed}: steps {run.steps}", flush=True)
                    args.json.write_text(json.dumps({"header": header, "runs": runs}, indent=1))
        ray.shutdown()

    def ratio(a: float | None, b: float | None) -> str:
        return "-" if a is None or b is None else f"{a / b:.2f}x"

    first = next(iter(finals))  # the ratios' baseline
    study = {
        o: [e.run.steps for e in sorted(es, key=lambda e: e.run.seed)] for o, es in finals.items()
    }
    extra = {o: [r["steps"] for r in runs if r["optimizer"] == o] for o in finals}
    study_medians = {o: median_or_none(study[o]) for o in finals}
    medians = {o: median_or_none([*study[o], *extra[o]]) for o in finals}
    rows = [
        [
            optimizer,
            f"{es[0].step_size:g}",
            " / ".join("-" if s is None else str(s) for s in study[optimizer]),
            " / ".join("-" if s is None else str(s) for s in extra[optimizer]),
            "-" if study_medians[optimizer] is None else f"{study_medians[optimizer]:.0f}",
            "-" if medians[optimizer] is None else f"{medians[optimizer]:.1f}",
            f"{ratio(study_medians[optimizer], study_medians[first])} / "
            f"{ratio(medians[optimizer], medians[first])}",
        ]
        for optimizer, es in finals.items()
    ]
    text = table(
        header,
        [
            "optimizer",
            "step size",
            "steps, the study's seeds",
            "steps, these seeds",
            "median (study)",
            "median (all)",
            f"÷ {first}'s (study / all)",
        ],
        rows,
    )
    print(text)
    if args.write:
        write_block("extra-seeds", text)


if __name__ == "__main__":
    main()
