"""The example job sharded by FSDP2 against the same job under DDP, on Ray Train.

``examples/fashion_mnist.yaml`` (LeNet on Fashion-MNIST, AdamW + K-FAC, 2 workers, stop at
88% test accuracy) run four times on a local Ray, one after the other: ``scaling.parallel``
``ddp`` and ``fsdp``, each under COMM-OPT and MEM-OPT (``kfac.strategy``), everything else
as the file says. For each: the step and the seconds of training (``train_s`` of the
evaluation, this attempt's time in training steps) at which it first reached the target,
the final accuracy, and the time ratio to DDP's at the same strategy. Then the sharded
MEM-OPT job once more with a worker killed (SIGKILL) after its checkpoint at step 200: Ray
Train resumes it from that checkpoint, and its final parameters are compared with those of
the sharded MEM-OPT run that never stopped.

Run ``python benchmarks/fsdp_job.py`` (about 12 minutes on 2 cores; ``--quick``: 40 steps
each, no target); ``--write`` stores the table in ``benchmarks/README.md`` (block
``fsdp-job``) and the figures in ``benchmarks/results/fsdp_job.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from report import git_commit, machine, table, write_block

from kaisa_train.job import run_job
from kaisa_train.spec import parse_job_spec
from kaisa_train.state import load_checkpoint_file
from kaisa_train.trainer import unique_run_name

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parent / "examples" / "fashion_mnist.yaml"
RESULTS = HERE / "results" / "fsdp_job.json"
RUNS = [
    (parallel, strategy) for strategy in ("comm-opt", "mem-opt") for parallel in ("ddp", "fsdp")
]


def _kill_a_worker(run_name: str, after_step: int, said: dict[str, Any]) -> None:
    """SIGKILL rank 1's worker once the run has a checkpoint at ``after_step`` or later."""
    from kaisa_train.progress import read_progress

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            checkpoints = read_progress(run_name, kinds=["checkpoint"])["records"]
        except Exception:  # the progress sink is not up yet
            checkpoints = []
        if any(c["step"] >= after_step for c in checkpoints):
            workers = read_progress(run_name, kinds=["worker"])["records"]
            victim = next(w for w in workers if w["rank"] == 1)
            os.kill(victim["pid"], signal.SIGKILL)
            said["killed_after"] = max(c["step"] for c in checkpoints)
            return
        time.sleep(0.05)


def run(
    parallel: str, strategy: str, storage: str, quick: bool, *, kill_after: int | None = None
) -> dict[str, Any]:
    raw = yaml.safe_load(EXAMPLE.read_text())
    raw["name"] = f"fsdp-job-{parallel}-{strategy}" + ("-killed" if kill_after else "")
    raw["scaling"]["parallel"] = parallel
    raw["kfac"]["strategy"] = strategy
    if quick:
        raw["stop"] = {"max_steps": 40}
        raw["checkpoint"] = {"every_steps": 20, "keep": 2}
    name = unique_run_name(raw["name"])
    killed: dict[str, Any] = {}
    killer = None
    if kill_after is not None:
        killer = threading.Thread(target=_kill_a_worker, args=(name, kill_after, killed))
        killer.start()
    result = run_job(parse_job_spec(raw), storage_path=storage, run_name=name, progress=False)
    if killer is not None:
        killer.join()
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
    model = None if result.checkpoint is None else load_checkpoint_file(result.checkpoint)["model"]
    return {
        "parallel": parallel,
        "strategy": strategy,
        "step": None if reached is None else reached.step,
        "train_s": None if reached is None else reached.train_s,
        "final_accuracy": result.metrics.get("test_accuracy"),
        "steps": result.metrics.get("step"),
        "killed_after": killed.get("killed_after"),
        "model": model,
    }


def _cell(value: float | None, form: str) -> str:
    return "-" if value is None else format(value, form)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="40 steps each, no target")
    parser.add_argument("--write", action="store_true", help="store the table and figures")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as storage:
        for parallel, strategy in RUNS:
            found = run(parallel, strategy, storage, args.quick)
            print({k: v for k, v in found.items() if k != "model"}, flush=True)
            rows.append(found)
        # The sharded MEM-OPT job again, a worker killed once it has a checkpoint: Ray Train
        # restarts the workers from it; its end against the run that never stopped.
        again = run("fsdp", "mem-opt", storage, args.quick, kill_after=20 if args.quick else 200)
    whole = next(r for r in rows if (r["parallel"], r["strategy"]) == ("fsdp", "mem-opt"))
    same = (
        whole["model"] is not None
        and again["model"] is not None
        and all(torch.equal(whole["model"][k], again["model"][k]) for k in whole["model"])
    )
    resumed = (
        "The sharded MEM-OPT job again, rank 1's worker killed (SIGKILL) once it had its "
        f"checkpoint at step {again['killed_after']}: resumed by Ray Train from it, it ended at "
        f"step {again['steps']} (88% first at step {_cell(again['step'], 'd')}; final accuracy "
        f"{_cell(again['final_accuracy'], '.4f')}) with final parameters "
        f"{'identical to' if same else 'DIFFERENT from'} those of the run that never stopped."
    )
    print(resumed)
    for r in [*rows, again]:
        r.pop("model")
    again["identical_to_uninterrupted"] = same
    ddp = {r["strategy"]: r["train_s"] for r in rows if r["parallel"] == "ddp"}
    lines = []
    for r in rows:
        base = ddp[r["strategy"]]
        ratio = None if r["train_s"] is None or not base else r["train_s"] / base
        lines.append(
            [
                r["parallel"],
                r["strategy"],
                _cell(r["step"], "d"),
                _cell(r["train_s"], ".1f"),
                _cell(ratio, ".2f"),
                _cell(r["final_accuracy"], ".4f"),
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
        figures = {"date": stamp, "machine": machine(), "rows": rows, "killed": again}
        RESULTS.write_text(json.dumps(figures, indent=1))
        write_block("fsdp-job", text + "\n\n" + resumed)


if __name__ == "__main__":
    main()
