"""The tuner against an oracle: the example job at 2 and 4 Ray workers, three memory budgets.

For each worker count, the example job (``examples/fashion_mnist_auto.yaml`` with its sections as
measured, SGD under the KL clip and the eigen method: LeNet CNN,
Fashion-MNIST, ``kfac: auto``) is profiled on its own Ray Train workers (``tune_job``; the
tuner actor's cache is emptied first, so the profiling is real and its time is reported).
Then every candidate of the tuner's table (every valid ``grad_worker_fraction`` x the interval
ladder) is measured on the same workers (``measure_candidates``: peak tensor memory per
worker, and time per step over whole inverse-update periods of at least 100 steps). For
three budgets (the example's 2 GiB; one byte below COMM-OPT's predicted memory; one byte
below the smallest prediction) the tuner chooses again (from its cached profile) and the
oracle takes the fastest measured candidate whose measured memory fits. Reported: predicted
against measured memory and ms per step for every candidate, the tuner's and the oracle's
picks, the ratio of their measured times (goal: at most 1.10), and the profiling time.

Run ``python benchmarks/tuner_oracle.py`` (about 10 minutes; ``--quick`` for a smoke run);
``--write`` stores the tables in ``benchmarks/README.md`` and the raw figures in
``benchmarks/results/tuner_oracle.json`` (``--from-json`` re-prints a stored run).

``tuner_oracle_wide.py`` runs the same oracle on ``wide-mlp`` with this script's helpers (the
measured rows, the oracle's pick, the candidate table's cells, the command line and the run).
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
import yaml
from report import git_commit, machine, table, write_block

from kaisa_train.spec import parse_job_spec
from kaisa_train.tuning import measure_candidates, tune_job
from tuner.actor import tuner_actor
from tuner.choice import NoFeasibleCandidateError

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parent / "examples" / "fashion_mnist_auto.yaml"
RESULTS = HERE / "results"
MIB = 2**20
VERIFY = 3


# -- what tuner_oracle_wide.py shares: measuring, the oracle, the tables, the command line -----


def key(row: dict[str, Any]) -> tuple[float, int, int]:
    return (row["grad_worker_fraction"], row["factor_update_steps"], row["inv_update_steps"])


def name(k: tuple[float, int, int]) -> str:
    return f"f={k[0]:g}, {k[1]}/{k[2]}"


def measure_rows(
    record: Any,
    spec: Any,
    run_name: str,
    args: argparse.Namespace,
    storage: Path,
    *,
    per_round: bool = False,
) -> list[dict[str, Any]]:
    """Every candidate of the tuner's ``record`` measured on the job's workers (one run named
    ``run_name`` and the time), each row its predicted beside its measured memory and time
    (with ``per_round``, also the time of each round)."""
    candidates = [row.choice() for row in record.candidates]
    measured = {
        m.candidate.key(): m.wire()
        for m in measure_candidates(
            spec,
            candidates,
            run_name=f"{run_name}-{datetime.datetime.now(datetime.UTC):%H%M%S}",
            storage_path=storage,
            min_steps=args.min_steps,
            rounds=args.rounds,
        )
    }
    rows = []
    for row in record.wire()["candidates"]:
        m = measured[key(row)]
        rows.append(
            {
                "candidate": key(row),
                "predicted_bytes": row["memory_bytes"],
                "measured_bytes": m["memory_bytes"],
                "predicted_ms": row["ms_per_step"],
                "measured_ms": m["ms_per_step"],
                **({"measured_ms_rounds": m["ms_per_step_rounds"]} if per_round else {}),
                "steps_timed": m["steps"],
            }
        )
    return rows


def oracle_pick(rows: list[dict[str, Any]], budget: int) -> dict[str, Any] | None:
    """The oracle: the fastest measured of ``rows`` whose measured peak fits ``budget``."""
    fitting = [r for r in rows if r["measured_bytes"] <= budget]
    return min(fitting, key=lambda r: r["measured_ms"]) if fitting else None


def world_result(
    workers: int,
    record: dict[str, Any],
    rows: list[dict[str, Any]],
    picks: list[dict[str, Any]],
    **extra: Any,
) -> dict[str, Any]:
    """One worker count's stored figures: the profile's from the tuner's ``record``, then
    ``extra``, the candidate rows and the picks."""
    return {
        "workers": workers,
        "profile_s": record["profile_s"],
        "profile_run_s": record["profile_run_s"],
        "base_bytes": record["base_memory_bytes"],
        "transient_bytes": record["kfac_transient_bytes"],
        "plain_ms": record["plain_ms_per_step"],
        **extra,
        "rows": rows,
        "picks": picks,
    }


CANDIDATE_COLUMNS = [
    "W",
    "candidate",
    "MiB/worker predicted",
    "MiB/worker measured",
    "error",
    "ms/step predicted",
    "ms/step measured",
    "error",
]


def candidate_cells(workers: int, label: str, r: dict[str, Any]) -> list[str]:
    """The cells of ``CANDIDATE_COLUMNS`` for one measured row."""
    return [
        str(workers),
        label,
        f"{r['predicted_bytes'] / MIB:.2f}",
        f"{r['measured_bytes'] / MIB:.2f}",
        f"{(r['predicted_bytes'] / r['measured_bytes'] - 1) * 100:+.1f}%",
        f"{r['predicted_ms']:.1f}",
        f"{r['measured_ms']:.1f}",
        f"{(r['predicted_ms'] / r['measured_ms'] - 1) * 100:+.0f}%",
    ]


def oracle_cell(p: dict[str, Any]) -> str:
    return "none fits" if p["oracle"] is None else f"{name(p['oracle'])} ({p['oracle_ms']:.1f} ms)"


def ratio_cell(p: dict[str, Any]) -> str:
    """The tuner's pick's measured time over the oracle's (the tuner picked)."""
    return f"{p['tuner_ms'] / p['oracle_ms']:.2f}" if p["oracle"] else "-"


def arguments(doc: str, *, rounds: int, quick: str, from_json: str) -> argparse.Namespace:
    """The oracle scripts' command line (``doc``'s first line describes it)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--min-steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=rounds, help="interleaved timing rounds")
    parser.add_argument("--limit", type=int, default=None, help="samples per split (smoke runs)")
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--write", action="store_true", help="store the tables and the JSON")
    parser.add_argument("--from-json", type=Path, default=None, help=from_json)
    return parser.parse_args()


def run_oracle(
    args: argparse.Namespace,
    *,
    one_world: Callable[[int, argparse.Namespace, Path], dict[str, Any]],
    summarize: Callable[[list[dict[str, Any]], str], str],
    describe: Callable[[str], str],
    stem: str,
) -> None:
    """Measure ``one_world`` at each of ``args.workers`` on one local Ray and print the tables
    (``args.from_json``: those of a stored run; measures nothing). The header says what ran:
    ``describe`` is given the load average at the start. ``--write`` stores the tables in the
    README block ``stem`` (dashed) and a measured run's figures in ``results/<stem>.json``."""
    block = stem.replace("_", "-")
    if args.from_json is not None:
        saved = json.loads(args.from_json.read_text())
        text = summarize(saved["results"], saved["header"])
        print(text)
        if args.write:
            write_block(block, text)
        return
    ray.init(
        address="local", num_cpus=max(args.workers), include_dashboard=False, log_to_driver=False
    )
    commit = git_commit()
    started = datetime.datetime.now(datetime.UTC)
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    results = []
    with tempfile.TemporaryDirectory(prefix=f"kaisa-{block}-") as storage:
        for workers in args.workers:
            results.append(one_world(workers, args, Path(storage)))
            print(json.dumps(results[-1]["picks"]), flush=True)
    ray.shutdown()
    header = (
        f"Measured {started:%Y-%m-%d} at commit {commit} on {machine()}{describe(load)}"
        f"time per step: the median of {args.rounds} interleaved rounds of at least "
        f"{args.min_steps} steps per candidate"
        + (f", {args.limit} samples per split" if args.limit else "")
        + "."
    )
    text = summarize(results, header)
    print(text)
    if args.write:
        RESULTS.mkdir(exist_ok=True)
        saved = {"header": header, "results": results}
        (RESULTS / f"{stem}.json").write_text(json.dumps(saved, indent=1))
        write_block(block, text)


# -- the example job ---------------------------------------------------------------------------


def spec_for(workers: int, budget: int | str, limit: int | None) -> Any:
    data = yaml.safe_load(EXAMPLE.read_text())
    # The example's sections when the committed table was measured (2026-11-22): SGD under the
    # KL clip, the eigen method.
    data["optimizer"] = {"name": "sgd", "lr": 0.05, "momentum": 0.9, "nesterov": True}
    data["kfac"] = {**data["kfac"], "kl_clip": 0.001, "compute_method": "eigen"}
    data["scaling"] = {"workers": workers, "cpus_per_worker": 1}
    data["memory_budget"] = budget
    if limit is not None:
        data["dataset"]["limit"] = limit
    return parse_job_spec(data, source=str(EXAMPLE))


def one_world(workers: int, args: argparse.Namespace, storage: Path) -> dict[str, Any]:
    ray.get(tuner_actor().forget.remote())
    first = tune_job(spec_for(workers, "2GiB", args.limit), storage_path=storage)
    record = first.record.wire()
    rows = measure_rows(
        first.record, spec_for(workers, "2GiB", args.limit), f"oracle-w{workers}", args, storage
    )
    comm = max(r["predicted_bytes"] for r in rows if r["candidate"][0] == 1.0)
    smallest = min(r["predicted_bytes"] for r in rows)
    budgets = [
        ("2 GiB", 2**30 * 2),
        ("COMM-OPT's - 1 B", comm - 1),
        ("smallest - 1 B", smallest - 1),
    ]
    picks = []
    for label, budget in budgets:
        oracle = oracle_pick(rows, budget)
        try:
            chosen = tune_job(spec_for(workers, budget, args.limit), storage_path=storage)
        except NoFeasibleCandidateError as error:
            picks.append(
                {
                    "budget": label,
                    "budget_bytes": budget,
                    "tuner": None,
                    "error": str(error).splitlines()[0],
                    "oracle": None if oracle is None else oracle["candidate"],
                }
            )
            continue
        pick = next(r for r in rows if r["candidate"] == chosen.decided.key())
        picks.append(
            {
                "budget": label,
                "budget_bytes": budget,
                "tuner": pick["candidate"],
                "tuner_ms": pick["measured_ms"],
                "tuner_bytes": pick["measured_bytes"],
                "cache": chosen.record.cache,
                "oracle": None if oracle is None else oracle["candidate"],
                "oracle_ms": None if oracle is None else oracle["measured_ms"],
            }
        )
    return world_result(workers, record, rows, picks)


def verify_pick(rows: list[dict[str, Any]], budget: int) -> dict[str, Any] | None:
    """What ``kfac.verify: VERIFY`` takes: of the VERIFY fastest predicted candidates that
    fit the budget (as predicted), the fastest measured one that fits (as measured)."""
    predicted = sorted(
        (r for r in rows if r["predicted_bytes"] <= budget), key=lambda r: r["predicted_ms"]
    )[:VERIFY]
    return oracle_pick(predicted, budget)


def summarize(results: list[dict[str, Any]], header: str) -> str:
    rows = [
        candidate_cells(result["workers"], name(r["candidate"]), r)
        for result in results
        for r in result["rows"]
    ]
    candidates = table(header, CANDIDATE_COLUMNS, rows)
    rows = []
    for result in results:
        for p in result["picks"]:
            if p["tuner"] is None:
                tuner, ratio = f"none fits: {p['error']}", "-"
            else:
                tuner = (
                    f"{name(p['tuner'])} ({p['tuner_ms']:.1f} ms, {p['tuner_bytes'] / MIB:.2f} MiB)"
                )
                ratio = ratio_cell(p)
            verified = verify_pick(result["rows"], p["budget_bytes"])
            verify_ratio = "-"
            if verified is not None and p["oracle"] is not None:
                verify_ratio = f"{verified['measured_ms'] / p['oracle_ms']:.2f}"
            rows.append(
                [
                    str(result["workers"]),
                    f"{p['budget']} ({p['budget_bytes'] / MIB:.2f} MiB)",
                    tuner,
                    oracle_cell(p),
                    ratio,
                    verify_ratio,
                    f"{result['profile_s']:.1f} s in the workers "
                    f"({result['profile_run_s']:.0f} s with worker start-up)",
                ]
            )
    picks = table(
        "Picks under three budgets (measured ms/step and peak MiB per worker in brackets); "
        f"the verify column is what `kfac.verify: {VERIFY}` picks from these measurements: the "
        f"fastest measured of the {VERIFY} best predicted candidates that fits:",
        [
            "W",
            "budget",
            "tuner's pick (predicted)",
            "oracle's pick",
            "tuner ÷ oracle",
            f"verify: {VERIFY} ÷ oracle",
            "profiling",
        ],
        rows,
    )
    return candidates + "\n\n" + picks


def main() -> None:
    args = arguments(
        __doc__,
        rounds=3,
        quick="2 workers, 20 steps, 4k samples",
        from_json="print (with --write: store) the tables of an earlier run's JSON; measures "
        "nothing",
    )
    if args.quick:
        args.workers, args.min_steps, args.limit, args.rounds = [2], 20, 4096, 1
    run_oracle(
        args,
        one_world=one_world,
        summarize=summarize,
        describe=lambda _load: (
            "; the example job (`examples/fashion_mnist_auto.yaml`), W Ray "
            "Train workers with one logical CPU each; "
        ),
        stem="tuner_oracle",
    )


if __name__ == "__main__":
    main()
