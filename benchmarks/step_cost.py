"""The batch-size study's optimizers, step cost measured interleaved: time to target as
steps × the cost of a step, on a machine whose load changes during a long study.

The batch-size study (``batch_size_study.py``) runs each job to 88% as a real Ray Train job;
its steps to target do not depend on the machine's load, but its seconds do, and over a study of
hours on a shared 2-core machine the load moves (its table gives the load average). Here each
global batch's tuned jobs (the study's chosen step sizes, read from its JSON) are built
exactly as a Ray Train worker builds them (``Training.build`` from the same JobSpec) on 2 gloo
processes, one thread each, and stepped in interleaved rounds (``--steps`` steps of each job in
turn, ``--rounds`` times): every job sees the same load. A step is what the worker's loop does
(the batch, forward, loss, K-FAC, and the optimizer step with the lr schedule, or K-FAC's own
quadratic-model step: ``Training.update``), timed on rank 0 from a barrier to the end of the
step; the mean over steps includes K-FAC's periodic factor and
decomposition work (``--steps`` is a multiple of every interval used).

The table: ms per step (mean) and its ratio to SGD's in the same rounds, the study's median
steps to target (its finals), and their product, the time to target at this step cost, as a
ratio to the best first-order optimizer's. Run ``python benchmarks/step_cost.py`` after the
study (``--json`` names its results); ``--quick`` for a smoke run; ``--write`` stores the table
in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from batch_size_study import OPTIMIZERS, RESULTS, SOAP_1, spec, tuned_lr
from report import git_commit, machine, table, write_block
from targets import Entry, Study, median_or_none
from torch import nn

from kaisa_train.spec import parse_job_spec
from kaisa_train.training import Training

WORKERS = 2


def chosen(entries: list[Entry], batch: int) -> dict[str, tuple[float, float | None]]:
    """Each optimizer's step size in the study's finals at ``batch``, and its median steps."""
    out: dict[str, tuple[float, float | None]] = {}
    for optimizer in OPTIMIZERS:
        finals = [
            e
            for e in entries
            if (e.group, e.optimizer, e.phase) == (str(batch), optimizer, "final")
        ]
        if finals:
            out[optimizer] = (finals[0].step_size, median_or_none([e.run.steps for e in finals]))
    return out


COMPILED = " (compiled)"
"""A peer's row with heavyball's ``torch.compile`` of its step on (its default; the jobs run
it eager): compiled before the rounds (``WARMUP_STEPS``), so its rows time the compiled step
alone, not the seconds of compiling that a job would also pay."""
COMPILE_MODE = "max-autotune-no-cudagraphs"  # heavyball 3.2.1's default
WARMUP_STEPS = 3


def worker(
    rank: int, store: str, out: str, jobs: list[dict[str, Any]], rounds: int, steps: int
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORKERS)
    compiled = [bool(job.pop("compiled", False)) for job in jobs]
    built = [
        Training.build(parse_job_spec(job), rank=rank, world=WORKERS, device=torch.device("cpu"))
        for job in jobs
    ]
    criterion = nn.CrossEntropyLoss()
    times: list[list[float]] = [[] for _ in jobs]

    def step_once(index: int, training: Training) -> float:
        if any(compiled):
            import heavyball.utils

            heavyball.utils.compile_mode = COMPILE_MODE if compiled[index] else None
        step = training.step + 1
        x, y = training.shard.batch(step)
        dist.barrier()
        tick = time.perf_counter()
        training.optimizer.zero_grad(set_to_none=True)
        loss = criterion(training.net(x), y)
        training.update(loss, x, y)  # the optimizer's step, or K-FAC's own
        training.step = step
        return (time.perf_counter() - tick) * 1000

    for index, training in enumerate(built):
        if compiled[index]:
            training.net.train()
            for _ in range(WARMUP_STEPS):
                step_once(index, training)
    for _ in range(rounds):
        for index, training in enumerate(built):
            training.net.train()
            for _ in range(steps):
                times[index].append(step_once(index, training))
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        with open(out, "wb") as handle:
            pickle.dump(times, handle)


def measure(jobs: list[dict[str, Any]], rounds: int, steps: int) -> list[list[float]]:
    with tempfile.TemporaryDirectory(prefix="kaisa-step-cost-") as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "times.pkl")
        mp.spawn(  # type: ignore[attr-defined,no-untyped-call]
            worker, args=(store, out, jobs, rounds, steps), nprocs=WORKERS, join=True
        )
        with open(out, "rb") as handle:
            times: list[list[float]] = pickle.load(handle)
    return times


Points = dict[str, tuple[float, float | None]]  # optimizer: (step size, median steps)


def priced(
    points: Points, build: Callable[[str, float], dict[str, Any]], args: argparse.Namespace
) -> tuple[Points, dict[str, float], dict[str, float | None]]:
    """Each point's job (``build(optimizer, step size)``) stepped in the interleaved rounds,
    with compiled rows for SOAP and Muon (PSGD Kron's step does not compile on CPU) unless
    ``--no-compiled``: the rows' points, their mean ms a step, and median steps × that in s."""
    points = dict(points)
    for peer in ("SOAP", "Muon", SOAP_1):
        if peer in points and args.compiled:
            points[peer + COMPILED] = points[peer]
    names = list(points)
    jobs = [
        build(name.removesuffix(COMPILED), points[name][0])
        | ({"compiled": True} if name.endswith(COMPILED) else {})
        for name in names
    ]
    times = measure(jobs, args.rounds, args.steps)
    ms = {name: statistics.mean(t) for name, t in zip(names, times, strict=True)}
    wall = {n: None if points[n][1] is None else points[n][1] * ms[n] / 1000 for n in names}
    return points, ms, wall


def finish(
    args: argparse.Namespace,
    load_before: tuple[float, float, float],
    target: str,
    columns: list[str],
    rows: list[list[str]],
    results: list[dict[str, Any]],
) -> int:
    """The table under a header that says where and how it was measured; with ``--write``,
    the JSON and the README block."""
    started = datetime.datetime.now(datetime.UTC)
    header = (
        f"Measured {started:%Y-%m-%d} at commit {git_commit()} on {machine()} (load average "
        f"before: {', '.join(f'{v:.2f}' for v in load_before)}); {WORKERS} gloo processes, one "
        f"thread each, {args.rounds} interleaved rounds of {args.steps} steps per job; steps to "
        f"{target}."
    )
    text = table(header, columns, rows)
    print(text)
    if args.write:
        args.out.write_text(json.dumps({"header": header, "rows": results}, indent=1))
        write_block(args.block, text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=RESULTS / "batch_size_study.json")
    parser.add_argument("--batches", type=int, nargs="+", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=50, help="steps of a job per round")
    parser.add_argument("--quick", action="store_true", help="batch 128, 1 round of 10 steps")
    parser.add_argument(
        "--transformer",
        action="store_true",
        help="the transformer benchmark's finals instead of the study's",
    )
    parser.add_argument(
        "--fine",
        action="store_true",
        help="with --transformer: the finals evaluated every 10 steps (transformer_fortunes.py "
        "--fine) and their rows only",
    )
    parser.add_argument(
        "--no-compiled", dest="compiled", action="store_false", help="no compiled peer rows"
    )
    parser.add_argument("--write", action="store_true", help="store the table")
    parser.add_argument("--out", type=Path, default=RESULTS / "step_cost.json")
    parser.add_argument(
        "--block", default="step-cost", help="the benchmarks/README.md block --write replaces"
    )
    args = parser.parse_args(argv)
    if not args.json.exists():
        parser.error(f"{args.json} does not exist: run batch_size_study.py first (or give --json)")
    if args.transformer:
        return transformer(args)
    entries = Study(args.json, Path(), {}, resume=True).entries
    batches = args.batches or sorted({int(e.group) for e in entries if e.phase == "final"})
    if args.quick:
        batches, args.rounds, args.steps = [128], 1, 10
    load_before = os.getloadavg()
    rows: list[list[str]] = []
    results: list[dict[str, Any]] = []
    for batch in batches:
        points = chosen(entries, batch)
        if not points:
            print(f"batch {batch}: no finals in {args.json}; skipped", file=sys.stderr)
            continue
        lr = partial(tuned_lr, entries, batch)
        build = partial(spec, batch, seed=0, max_steps=100_000, lr=lr)
        points, ms, wall = priced(points, build, args)
        names = list(points)
        first_order = [n for n in ("SGD", "AdamW") if wall.get(n) is not None]
        best = min(first_order, key=lambda n: wall[n] or 0.0) if first_order else None
        for name in names:
            med = points[name][1]
            w = wall[name]
            ratio = "-"
            if best is not None and w is not None and name not in first_order:
                ratio = f"{w / (wall[best] or 1):.2f}x {best}"
            rows.append(
                [
                    str(batch),
                    name,
                    f"{points[name][0]:g}",
                    f"{ms[name]:.1f}",
                    f"{ms[name] / ms['SGD']:.2f}x" if "SGD" in ms else "-",
                    "-" if med is None else f"{med:.0f}",
                    "-" if w is None else f"{w:.1f}",
                    ratio,
                ]
            )
            results.append(
                {"batch": batch, "optimizer": name, "step_size": points[name][0],
                 "ms_per_step": ms[name], "median_steps": med, "seconds": w}
            )  # fmt: skip
    return finish(
        args,
        load_before,
        f"88% from the study's finals ({args.json.name})",
        [
            "global batch",
            "optimizer",
            "step size",
            "ms/step (mean)",
            "step ÷ SGD's",
            "steps to 88% (median)",
            "steps x ms/step (s)",
            "time ÷ best first-order's",
        ],
        rows,
        results,
    )


def transformer(args: argparse.Namespace) -> int:
    """The transformer benchmark's tuned jobs (its finals), stepped as the study's are:
    validation loss 2.0 in its median steps × the mean step in the same rounds."""
    import transformer_fortunes as lm

    # --fine: the rows of the finals evaluated every 10 steps, their steps at that grain
    path = lm.FINE_JSON if args.fine else lm.RESULTS / "transformer_fortunes.json"
    study = Study(path, Path(), {}, resume=True)
    points: Points = {}
    for name in lm.GRIDS:
        finals = study.finals("lm", name)
        if finals:
            points[name] = (finals[0].step_size, median_or_none([e.run.steps for e in finals]))
    load_before = os.getloadavg()
    points, ms, wall = priced(points, partial(lm.spec, seed=0, max_steps=100_000), args)
    names = list(points)
    rows, results = [], []
    for name in names:
        med, w = points[name][1], wall[name]
        rows.append(
            [
                name,
                f"{points[name][0]:g}",
                f"{ms[name]:.1f}",
                f"{ms[name] / ms['AdamW']:.2f}x",
                "-" if med is None else f"{med:.0f}",
                "-" if w is None else f"{w:.1f}",
                "-" if w is None or wall["AdamW"] is None else f"{w / wall['AdamW']:.2f}x",
            ]
        )
        results.append(
            {"optimizer": name, "step_size": points[name][0], "ms_per_step": ms[name],
             "median_steps": med, "seconds": w}
        )  # fmt: skip
    return finish(
        args,
        load_before,
        f"validation loss {lm.TARGET} from the transformer benchmark's finals ({path.name})",
        [
            "optimizer",
            "lr",
            "ms/step (mean)",
            "step ÷ AdamW's",
            f"steps to {lm.TARGET} (median)",
            "steps x ms/step (s)",
            "time ÷ AdamW's",
        ],
        rows,
        results,
    )


if __name__ == "__main__":
    raise SystemExit(main())
