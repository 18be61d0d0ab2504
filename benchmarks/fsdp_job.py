"""The example job sharded by FSDP2 against the same job under DDP, on Ray Train.

``examples/fashion_mnist.yaml`` (LeNet on Fashion-MNIST, AdamW + K-FAC, 2 workers, stop at
88% test accuracy) run four times on a local Ray, one after the other: ``scaling.parallel``
``ddp`` and ``fsdp``, each under COMM-OPT and MEM-OPT (``kfac.strategy``), everything else
as the file says. For each: the step and the seconds of training (``train_s`` of the
evaluation, this attempt's time in training steps) at which it first reached the target,
the final accuracy, and the time ratio to DDP's at the same strategy.

Run ``python benchmarks/fsdp_job.py`` (about 10 minutes on 2 cores; ``--quick``: 40 steps
each, no target); ``--write`` stores the table in ``benchmarks/README.md`` (block
``fsdp-job``) and the figures in ``benchmarks/results/fsdp_job.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import tempfile
from pathlib import Path
from typing import Any

import yaml
from report import git_commit, machine, table, write_block

from kaisa_ray.train.job import run_job
from kaisa_ray.train.spec import parse_job_spec

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parent / "examples" / "fashion_mnist.yaml"
RESULTS = HERE / "results" / "fsdp_job.json"
RUNS = [
    (parallel, strategy) for strategy in ("comm-opt", "mem-opt") for parallel in ("ddp", "fsdp")
]


def run(parallel: str, strategy: str, storage: str, quick: bool) -> dict[str, Any]:
    raw = yaml.safe_load(EXAMPLE.read_text())
    raw["name"] = f"fsdp-job-{parallel}-{strategy}"
    raw["scaling"]["parallel"] = parallel
    raw["kfac"]["strategy"] = strategy
    if quick:
        raw["stop"] = {"max_steps": 40}
    result = run_job(parse_job_spec(raw), storage_path=storage, progress=False)
    if not result.succeeded:
        raise RuntimeError(f"{parallel} {strategy}: {result.error}")
    target = raw["stop"].get("target", {}).get("value")
    reached = next(
        (
            e
            for e in result.evals
            if target is not None and e.test_accuracy is not None and e.test_accuracy >= target
        ),
        None,
    )
    return {
        "parallel": parallel,
        "strategy": strategy,
        "step": None if reached is None else reached.step,
        "train_s": None if reached is None else reached.train_s,
        "final_accuracy": result.metrics.get("test_accuracy"),
        "steps": result.metrics.get("step"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="40 steps each, no target")
    parser.add_argument("--write", action="store_true", help="store the table and figures")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as storage:
        for parallel, strategy in RUNS:
            found = run(parallel, strategy, storage, args.quick)
            print(found, flush=True)
            rows.append(found)
    ddp = {r["strategy"]: r["train_s"] for r in rows if r["parallel"] == "ddp"}

    def cell(value: float | None, form: str) -> str:
        return "-" if value is None else format(value, form)

    lines = []
    for r in rows:
        base = ddp[r["strategy"]]
        ratio = None if r["train_s"] is None or not base else r["train_s"] / base
        lines.append(
            [
                r["parallel"],
                r["strategy"],
                cell(r["step"], "d"),
                cell(r["train_s"], ".1f"),
                cell(ratio, ".2f"),
                cell(r["final_accuracy"], ".4f"),
            ]
        )
    stamp = datetime.date.today().isoformat()
    header = (
        f"`python benchmarks/fsdp_job.py --write`, {stamp}, commit {git_commit()}, "
        f"{machine()}; `examples/fashion_mnist.yaml` on 2 Ray Train workers, to 88% test "
        "accuracy."
    )
    text = table(
        header,
        ["parallel", "strategy", "step at 88%", "train s at 88%", "÷ DDP's", "final accuracy"],
        lines,
    )
    print(text)
    if args.write and not args.quick:
        RESULTS.write_text(
            json.dumps({"date": stamp, "machine": machine(), "rows": rows}, indent=1)
        )
        write_block("fsdp-job", text)


if __name__ == "__main__":
    main()
