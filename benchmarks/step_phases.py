"""Where K-FAC's step time goes on this CPU, before and after a change, in interleaved rounds.

For each workload (a worker's share of the benchmarks' jobs: LeNet at 64 examples, a worker
of the batch-size study's 128; the character transformer at 32 sequences, a worker of the
transformer benchmark's 64; ResNet-20 at 128) the first-order step and K-FAC's step run in one
process per code version, one thread each, round by round: each round times one whole
inverse period of every configuration in turn, in both versions (``--before PATH``: another
checkout, e.g. a ``git worktree`` of the commit before the change), so every number sees the
same load. ``phases.py`` says how the phases come from whole-step medians.

The table: the first-order step, K-FAC's mean step over its periods and their ratio; the
phases (preconditioning per step, the bare products within it, factors and decompositions
per update). Run ``python benchmarks/step_phases.py --before /tmp/kaisa-before``
(``--quick`` for a smoke run, ``--write`` to store the table in benchmarks/README.md and
``results/step_phases.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path
from typing import Any

import torch
from phases import COLUMNS, JOBSPEC_CURVATURE, Config, row_of, run_rounds, tabulate
from report import git_commit, machine, table, write_block

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"


def _kfac(fus: int, ius: int, **more: Any) -> dict[str, Any]:
    return {**JOBSPEC_CURVATURE, "factor_update_steps": fus, "inv_update_steps": ius, **more}


CONFIGS = [
    Config("LeNet, 64 a worker: AdamW", "lenet", 64, None),
    Config("LeNet: AdamW + K-FAC 5/50", "lenet", 64, _kfac(5, 50)),
    Config(
        "LeNet: AdamW + K-FAC 5/50, medium",
        "lenet",
        64,
        _kfac(5, 50, matmul_precision="medium"),
        versions=("after",),
    ),
    Config("char-transformer, 32 a worker: AdamW", "char-transformer", 32, None),
    Config("char-transformer: AdamW + K-FAC 5/50", "char-transformer", 32, _kfac(5, 50)),
    Config(
        "char-transformer: AdamW + K-FAC 5/50, medium",
        "char-transformer",
        32,
        _kfac(5, 50, matmul_precision="medium"),
        versions=("after",),
    ),
    Config(
        "char-transformer: AdamW + K-FAC 5/50, tokens reduced",
        "char-transformer",
        32,
        _kfac(5, 50, sequence_approx="reduce"),
        versions=("after",),
    ),
    Config("ResNet-20, 128: SGD", "resnet20", 128, None, steps=100),
    Config("ResNet-20: K-FAC 10/100", "resnet20", 128, _kfac(10, 100), steps=100),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="another checkout to time interleaved")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one round of 10 steps, LeNet")
    parser.add_argument("--write", action="store_true")
    parser.add_argument(
        "--workloads",
        nargs="+",
        choices=sorted({c.workload for c in CONFIGS}),
        help="only these workloads (default: all)",
    )
    parser.add_argument(
        "--report", action="store_true", help="run nothing: the table from results/step_phases.json"
    )
    args = parser.parse_args(argv)
    if args.report:
        stored = json.loads((RESULTS / "step_phases.json").read_text())
        text = table(stored["header"], COLUMNS, [row_of(r) for r in stored["rows"]])
        print(text)
        if args.write:
            write_block("step-phases", text)
        return 0
    configs = [c for c in CONFIGS if args.workloads is None or c.workload in args.workloads]
    if args.quick:
        args.rounds = 1
        configs = [
            Config(c.label, c.workload, c.batch, c.kfac, c.versions, steps=10)
            for c in CONFIGS
            if c.workload == "lenet"
        ]
    trees = {"after": ROOT}
    if args.before is not None:
        trees["before"] = args.before.resolve()
    load_before = os.getloadavg()
    measured = run_rounds(configs, trees, args.rounds, torch.device("cpu"))
    rows, results = tabulate(configs, measured, list(trees))
    started = datetime.datetime.now(datetime.UTC)
    versions = "this checkout (after)" + (
        f" and {args.before} (before)" if args.before is not None else ""
    )
    header = (
        f"Measured {started:%Y-%m-%d} at commit {git_commit()} on {machine()} (load average "
        f"before: {', '.join(f'{v:.2f}' for v in load_before)}); {versions}; one process per "
        f"version, one thread, {args.rounds} interleaved rounds of one inverse period per "
        "configuration; medians of whole steps by kind (benchmarks/phases.py); ms."
    )
    text = table(header, COLUMNS, rows)
    print(text)
    if args.write:
        RESULTS.mkdir(exist_ok=True)
        out = {"header": header, "rows": results}
        (RESULTS / "step_phases.json").write_text(json.dumps(out, indent=1))
        write_block("step-phases", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
