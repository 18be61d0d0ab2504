"""K-FAC's products at matmul precision 'medium' against the default 'high' on this CPU: the
step's cost and the steps to 88%, for the batch-size study's winning K-FAC rows at batch 128.

'high' is float32 on a CPU; 'medium' runs the factor and preconditioning products in
bfloat16 with float32 accumulation where the CPU has fast bfloat16 products (AMX or
AVX-512 BF16), products too small to gain at float32 (``kaisa_ray.products``). For each row
(the study's tuned job, ``batch_size_study.spec``), both precisions:

- steps to 88% test accuracy: real Ray Train jobs (``targets.run_to_target``, 2 workers),
  seeds 0, 1, 2, interleaved seed by seed; stored in ``results/precision_cost.json`` as they
  finish (``--resume`` keeps those);
- the step's cost: every job built as a worker builds it and stepped in interleaved rounds on
  2 gloo processes beside AdamW (``step_cost.measure``, the method of ``step_cost.py``);
- time to target: median steps × ms a step, against AdamW's (its steps: the study's median).

``python benchmarks/precision_cost.py`` (about 15 minutes on 2 cores; ``--no-steps`` for the
step costs alone; ``--write`` stores the table in benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
from batch_size_study import RESULTS, spec
from report import git_commit, machine, table, write_block
from step_cost import chosen, measure
from targets import Study, median_or_none, run_to_target

BATCH = 128
ROWS = ("AdamW + K-FAC", "K-FAC (lr)")
PRECISIONS = ("high", "medium")
SEEDS = (0, 1, 2)
OUT = RESULTS / "precision_cost.json"


def job(row: str, step_size: float, precision: str, seed: int) -> dict[str, Any]:
    data = spec(BATCH, row, step_size, seed=seed, max_steps=1500)
    data["kfac"]["matmul_precision"] = precision
    return data


def steps_to_target(
    points: dict[str, tuple[float, float | None]], found: dict[str, Any], out: Path
) -> dict[str, Any]:
    """``{"row/precision/seed": steps or None}``: the runs not in ``found`` run as real jobs,
    each stored in ``out`` as it finishes."""
    found = dict(found)
    with tempfile.TemporaryDirectory(prefix="kaisa-precision-") as storage:
        for seed in SEEDS:
            for row in ROWS:
                for precision in PRECISIONS:
                    key = f"{row}/{precision}/{seed}"
                    if key in found:
                        continue
                    run = run_to_target(
                        key, job(row, points[row][0], precision, seed), Path(storage)
                    )
                    found[key] = run.steps
                    print(f"{key}: {run.steps} steps", flush=True)
                    out.write_text(json.dumps({"steps": found}, indent=1))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=50, help="steps of a job per round")
    parser.add_argument("--no-steps", dest="run_steps", action="store_false")
    parser.add_argument("--resume", action="store_true", help="keep the runs already stored")
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--block", default="precision-cost")
    args = parser.parse_args(argv)
    entries = Study(RESULTS / "batch_size_study.json", Path(), {}, resume=True).entries
    points = chosen(entries, BATCH)
    load_before = os.getloadavg()
    stored = json.loads(args.out.read_text()) if args.out.exists() else {}
    found: dict[str, Any] = stored.get("steps", {})
    steps_run = stored.get("steps_run", "")
    if args.run_steps:
        found = steps_to_target(points, found if args.resume else {}, args.out)
        steps_run = f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d} at commit {git_commit()}"
    names = ["AdamW"] + [f"{row}/{precision}" for row in ROWS for precision in PRECISIONS]
    jobs = [spec(BATCH, "AdamW", points["AdamW"][0], seed=0, max_steps=100_000)]
    for name in names[1:]:
        row, precision = name.split("/")
        jobs.append(job(row, points[row][0], precision, seed=0))
    times = measure(jobs, args.rounds, args.steps)
    ms = {name: statistics.mean(t) for name, t in zip(names, times, strict=True)}
    adamw_steps = points["AdamW"][1]
    rows: list[list[str]] = []
    results: list[dict[str, Any]] = []
    for name in names:
        row, _, precision = name.partition("/")
        if name == "AdamW":
            steps: list[int | None] = []
            med = adamw_steps
        else:
            steps = [found.get(f"{name}/{seed}") for seed in SEEDS]
            med = median_or_none(steps) if found else None
        seconds = None if med is None else med * ms[name] / 1000
        ratio = "-"
        if seconds is not None and adamw_steps is not None and name != "AdamW":
            ratio = f"{seconds / (adamw_steps * ms['AdamW'] / 1000):.2f}x"
        rows.append(
            [
                row,
                precision or "-",
                f"{ms[name]:.1f}",
                f"{ms[name] / ms['AdamW']:.2f}x",
                " / ".join("-" if s is None else str(s) for s in steps) or "(the study's)",
                "-" if med is None else f"{med:.0f}",
                ratio,
            ]
        )
        results.append(
            {"row": row, "precision": precision, "ms_per_step": ms[name], "steps": steps,
             "median_steps": med, "seconds": seconds}
        )  # fmt: skip
    bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    header = (
        f"Measured {datetime.datetime.now(datetime.UTC):%Y-%m-%d} at commit {git_commit()} on "
        f"{machine()} (load average before: {', '.join(f'{v:.2f}' for v in load_before)}); "
        f"oneDNN bfloat16 products on this CPU: {'yes' if bf16 else 'no'}; step costs: 2 gloo "
        f"processes, one thread each, {args.rounds} interleaved rounds of {args.steps} steps a "
        f"job; steps to 88%: real 2-worker jobs, seeds {', '.join(map(str, SEEDS))}, run "
        f"{steps_run} (AdamW's: the study's median)."
    )
    text = table(
        header,
        [
            "row (batch 128)",
            "matmul_precision",
            "ms/step (mean)",
            "step ÷ AdamW's",
            "steps to 88% (seeds)",
            "median",
            "time ÷ AdamW's",
        ],
        rows,
    )
    print(text)
    args.out.write_text(
        json.dumps(
            {"header": header, "steps_run": steps_run, "steps": found, "rows": results}, indent=1
        )
    )
    if args.write:
        write_block(args.block, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
