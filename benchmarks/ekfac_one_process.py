"""EKFAC against K-FAC's own scalings in one process: steps to 88% test accuracy on
Fashion-MNIST (LeNet, global batch 2048, seed 0), the batch-size study's jobs run by the
worker's own loop with one worker (the whole batch in one process, no Ray).

What it separates: the batch-size study's "AdamW + K-FAC" row runs the inverse method with
π-damping; EKFAC (``kfac.scaling: ekfac``) adds the damping to its fitted diagonal, without π.
So the rows are AdamW + K-FAC as the study runs it, the eigen method with the same damping and
no π (what EKFAC's diagonal replaces), and EKFAC at three dampings and two lrs. Steps only
(seconds here are one process's, on whatever else the machine runs).

Run ``python benchmarks/ekfac_one_process.py`` (about 5 minutes on 2 cores); ``--write``
stores the table in benchmarks/README.md and the JSON in results/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from typing import Any

from batch_size_study import ADAMW_EKFAC, RESULTS, spec
from report import git_commit, machine, table, write_block

from kaisa_train.records import Record
from kaisa_train.session import LocalSession
from kaisa_train.spec import parse_job_spec
from kaisa_train.worker import train
from kaisa_train.worker_config import TrainConfig

BATCH = 2048
MAX_STEPS = 200
TARGET = 0.88
# (label, the study's optimizer row, its step size, what changes in its kfac section)
ROWS: list[tuple[str, str, float, dict[str, Any]]] = [
    ("AdamW + K-FAC (inverse, π-damping 0.1)", "AdamW + K-FAC", 0.032, {}),
    (
        "AdamW + K-FAC (eigen, damping 0.1, no π)",
        "AdamW + K-FAC",
        0.032,
        {"compute_method": "eigen", "pi_damping": False},
    ),
    ("AdamW + EKFAC (damping 0.1)", ADAMW_EKFAC, 0.032, {}),
    ("AdamW + EKFAC (damping 0.03)", ADAMW_EKFAC, 0.032, {"damping": 0.03}),
    ("AdamW + EKFAC (damping 0.3)", ADAMW_EKFAC, 0.032, {"damping": 0.3}),
    ("AdamW + EKFAC (damping 0.1, lr 0.064)", ADAMW_EKFAC, 0.064, {}),
]


def steps_to_target(optimizer: str, lr: float, changes: dict[str, Any]) -> tuple[int | None, float]:
    data = spec(BATCH, optimizer, lr, 0, MAX_STEPS)
    data["scaling"] = {"workers": 1, "cpus_per_worker": 1}
    data["dataset"]["batch_size"] = BATCH
    kfac = data["kfac"]
    kfac.update(changes)
    if "factor_samples" in kfac:  # the study's 256 per worker, for its 2 workers
        kfac["factor_samples"] *= 2
    records: list[Record] = []
    started = time.perf_counter()
    train(TrainConfig(spec=parse_job_spec(data), run="ekfac"), LocalSession(records.append))
    hit = next(
        (
            r
            for r in records
            if r.kind == "eval" and (getattr(r, "test_accuracy", None) or 0.0) >= TARGET
        ),
        None,
    )
    return (getattr(hit, "step", None), time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    started = datetime.datetime.now(datetime.UTC)
    results = []
    for label, optimizer, lr, changes in ROWS:
        steps, seconds = steps_to_target(optimizer, lr, changes)
        results.append({"label": label, "lr": lr, "steps": steps, "seconds": seconds})
        print(f"{label}: {steps} steps ({seconds:.0f} s)", flush=True)
    rows = [[r["label"], f"{r['lr']:g}", str(r["steps"] or f"not in {MAX_STEPS}")] for r in results]
    header = (
        f"Measured {started.date()} at commit {git_commit()} on {machine()}; one process, "
        f"global batch {BATCH}, seed 0, steps to {TARGET:.0%} test accuracy."
    )
    text = table(header, ["form", "lr", "steps to 88%"], rows)
    print(text)
    if args.write:
        (RESULTS / "ekfac_one_process.json").write_text(
            json.dumps({"started": started.isoformat(), "results": results}, indent=1) + "\n"
        )
        write_block("ekfac-one-process", text)


if __name__ == "__main__":
    main()
