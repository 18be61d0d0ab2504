"""A K-FAC step by its parts on this CPU: forward and backward (with K-FAC's hooks), K-FAC's
``step()`` and the optimizer's, by kind of step, against the first-order step's parts.

One process, one thread: a workload's first-order trainee and its K-FAC trainee
(``phases.Trainee``: one fixed batch, the JobSpec's curvature, intervals 5/50) step turn about,
so both see the same load; each part is the median over the steps of its kind ('quiet': no
factor or decomposition update; 'factors'; 'decomposition'). ``--ops`` also profiles one quiet
and one factor step (``torch.profiler``) and prints the operations whose time differs most
between them: what a factor update adds, by operation and shape.

``python benchmarks/step_parts.py --workload char-transformer --batch 32 --ops``
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch
from phases import JOBSPEC_CURVATURE, WORKLOADS, Trainee

KINDS = ("plain", "quiet", "factors", "decomposition")
PARTS = ("forward+backward", "K-FAC step", "optimizer", "whole")


def parts(workload: str, batch: int, steps: int) -> dict[tuple[str, str], list[float]]:
    """Milliseconds of each part, by kind of step: ``steps`` steps of each trainee."""
    kfac = {**JOBSPEC_CURVATURE, "factor_update_steps": 5, "inv_update_steps": 50}
    with_kfac = Trainee(workload, batch, kfac, torch.device("cpu"))
    plain = Trainee(workload, batch, None, torch.device("cpu"))
    p = with_kfac.preconditioner
    assert p is not None
    for _ in range(55):  # past the first decomposition
        with_kfac.step()
        plain.step()
    times: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for _ in range(steps):
        for trainee in (plain, with_kfac):
            began = time.perf_counter()
            trainee.forward_backward()
            backward = time.perf_counter()
            kind = "plain"
            if trainee is with_kfac:
                p.step()
                factors, decompositions = p.last_updates
                kind = "decomposition" if decompositions else "factors" if factors else "quiet"
            stepped = time.perf_counter()
            trainee.optimizer.step()
            ended = time.perf_counter()
            for part, seconds in zip(
                PARTS,
                (backward - began, stepped - backward, ended - stepped, ended - began),
                strict=True,
            ):
                times[(kind, part)].append(seconds * 1e3)
    return times


def ops_added(workload: str, batch: int, rows: int) -> list[tuple[float, str, int, int]]:
    """(µs a factor step adds, operation and its first two input shapes, calls in the quiet
    step, calls in the factor step), largest first."""
    from torch.profiler import ProfilerActivity, profile

    kfac = {**JOBSPEC_CURVATURE, "factor_update_steps": 5, "inv_update_steps": 50}
    trainee = Trainee(workload, batch, kfac, torch.device("cpu"))
    p = trainee.preconditioner
    assert p is not None
    for _ in range(51):
        trainee.step()

    def one(factor_step: bool) -> tuple[collections.Counter[str], collections.Counter[str]]:
        while bool(p._factor_now) != factor_step or p.steps % 50 == 0:
            trainee.step()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            trainee.step()
        calls: collections.Counter[str] = collections.Counter()
        micros: collections.Counter[str] = collections.Counter()
        for event in prof.events():
            if event.name.startswith("aten::"):
                key = f"{event.name} {event.input_shapes[:2]}"
                calls[key] += 1
                micros[key] += event.self_cpu_time_total
        return calls, micros

    quiet_calls, quiet_us = one(False)
    factor_calls, factor_us = one(True)
    keys = set(quiet_us) | set(factor_us)
    added = [(factor_us[k] - quiet_us[k], k, quiet_calls[k], factor_calls[k]) for k in keys]
    return sorted(added, reverse=True)[:rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="char-transformer")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--ops", action="store_true", help="also what a factor step adds")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    times = parts(args.workload, args.batch, args.steps)
    print(f"{args.workload} at batch {args.batch}, one thread; medians in ms (steps of the kind)")
    print("| kind | " + " | ".join(PARTS) + " |")
    print("| --- " * (len(PARTS) + 1) + "|")
    for kind in KINDS:
        if (kind, "whole") not in times:
            continue
        count = len(times[(kind, "whole")])
        cells = [f"{statistics.median(times[(kind, part)]):.2f}" for part in PARTS]
        print(f"| {kind} ({count}) | " + " | ".join(cells) + " |")
    if args.ops:
        print("\nwhat one factor step adds to a quiet one (µs; calls quiet -> factor step):")
        for micros, key, quiet, factor in ops_added(args.workload, args.batch, 12):
            print(f"{micros:8.0f}  {key}  ({quiet} -> {factor})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
