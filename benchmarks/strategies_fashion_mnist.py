"""KAISA strategies on W gloo processes (one thread each): time per step and bytes per step.

The LeNet-style CNN on Fashion-MNIST, 128 samples per rank per step, DDP. For W in (2, 4) and
each strategy (COMM-OPT, HYBRID-OPT, MEM-OPT) at factor/inverse intervals 1/10 and 5/50, and
plain DDP + SGD as the baseline, all measured in one run with the configurations interleaved
in rounds: ms per step (median and mean; the mean includes the periodic factor and
decomposition work), the K-FAC overhead (mean over DDP + SGD's mean), and the payload bytes
rank 0 passes to collectives per step, measured by wrapping torch.distributed's all_reduce
and broadcast, next to what ``plan()`` predicts for the same steps.

Run ``python benchmarks/strategies_fashion_mnist.py`` (``--quick`` for a smoke run);
``--write`` stores the table in ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pickle
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from report import machine, table, write_block
from torch.nn.parallel import DistributedDataParallel

from kaisa_ray import KFACPreconditioner
from kaisa_ray.plan import StepType
from kaisa_train.datasets import load_idx_dataset
from kaisa_train.models import LeNetCNN

STRATEGIES = ("comm-opt", "hybrid-opt", "mem-opt")
INTERVALS = ((1, 10), (5, 50))
# The settings of the one-process benchmark (the reference implementation's); lr is SGD's.
KFAC: dict[str, Any] = {"damping": 0.1, "kl_clip": 0.001, "lr": 0.05}


def configs() -> list[tuple[str, dict[str, Any] | None]]:
    out: list[tuple[str, dict[str, Any] | None]] = [("DDP + SGD", None)]
    for fus, ius in INTERVALS:
        for strategy in STRATEGIES:
            out.append(
                (
                    f"K-FAC {strategy} {fus}/{ius}",
                    dict(
                        KFAC,
                        grad_worker_fraction=strategy,
                        factor_update_steps=fus,
                        inv_update_steps=ius,
                    ),
                )
            )
    return out


class ByteCounter:
    """Payload bytes this rank passes to all_reduce/broadcast (K-FAC's own collectives)."""

    def __init__(self) -> None:
        self.bytes = 0
        self._real = (dist.all_reduce, dist.broadcast)

    def install(self) -> None:
        real_all_reduce, real_broadcast = self._real

        def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.bytes += tensor.numel() * tensor.element_size()
            return real_all_reduce(tensor, *args, **kwargs)

        def broadcast(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.bytes += tensor.numel() * tensor.element_size()
            return real_broadcast(tensor, *args, **kwargs)

        dist.all_reduce, dist.broadcast = all_reduce, broadcast  # type: ignore[assignment]

    def uninstall(self) -> None:
        dist.all_reduce, dist.broadcast = self._real


def step_kind(step: int, fus: int, ius: int) -> StepType:
    if step % ius == 0:
        return StepType.INVERSE_UPDATE
    return StepType.FACTOR_UPDATE if step % fus == 0 else StepType.PLAIN


def worker(rank: int, world_size: int, store: str, out: str, rounds: int, steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    x, y = load_idx_dataset(split="train")
    generator = torch.Generator().manual_seed(rank)
    state: dict[str, dict[str, Any]] = {}
    for _ in range(rounds):
        for name, options in configs():
            torch.manual_seed(0)
            model = LeNetCNN()
            ddp = DistributedDataParallel(model)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
            preconditioner = KFACPreconditioner(ddp, **options) if options else None
            counter = ByteCounter()
            entry = state.setdefault(name, {"times": [], "bytes": 0, "planned": 0, "steps": 0})
            warmup = 2
            for step in range(steps + warmup):
                index = torch.randint(0, len(y), (128,), generator=generator)
                dist.barrier()
                if step >= warmup:
                    counter.install()
                start = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                F.cross_entropy(ddp(x[index]), y[index]).backward()
                if preconditioner is not None:
                    preconditioner.step()
                optimizer.step()
                elapsed = time.perf_counter() - start
                counter.uninstall()
                if step >= warmup:
                    entry["times"].append(elapsed * 1000)
                    entry["steps"] += 1
                    if preconditioner is not None and options is not None:
                        kind = step_kind(
                            step, options["factor_update_steps"], options["inv_update_steps"]
                        )
                        entry["planned"] += preconditioner.plan.ranks[rank].bytes(kind)
            entry["bytes"] += counter.bytes
            if preconditioner is not None:
                preconditioner.remove_hooks()
    dist.barrier()
    dist.destroy_process_group()
    with open(out, "wb") as handle:
        pickle.dump(state, handle)


def run(world_size: int, rounds: int, steps: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        outs = [str(Path(tmp) / f"rank{r}.pkl") for r in range(world_size)]
        context = mp.get_context("spawn")
        procs = [
            context.Process(target=worker, args=(r, world_size, store, outs[r], rounds, steps))
            for r in range(world_size)
        ]
        try:
            for proc in procs:
                proc.start()
            for proc in procs:
                proc.join(1800)
        finally:  # never leave workers behind: they would skew whatever runs next
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                    proc.join()
        codes = [proc.exitcode for proc in procs]
        if any(code != 0 for code in codes):
            raise SystemExit(f"a worker failed: exit codes {codes}")
        states = []
        for out in outs:
            with open(out, "rb") as handle:
                states.append(pickle.load(handle))
    rows = []
    base_mean = statistics.mean(states[0]["DDP + SGD"]["times"])
    for name, _ in configs():
        times = states[0][name]["times"]  # rank 0's clock; ranks move in lock step
        mean = statistics.mean(times)
        steps_measured = states[0][name]["steps"]
        rows.append(
            {
                "world_size": world_size,
                "config": name,
                "median_ms": statistics.median(times),
                "mean_ms": mean,
                "overhead": mean / base_mean,
                "bytes": states[0][name]["bytes"] / steps_measured,
                "planned": states[0][name]["planned"] / steps_measured,
                "max_rank_bytes": max(s[name]["bytes"] for s in states) / steps_measured,
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    columns = [
        "W",
        "configuration",
        "ms/step median",
        "ms/step mean",
        "mean vs DDP + SGD",
        "bytes/step rank 0 (measured)",
        "bytes/step rank 0 (plan)",
        "bytes/step busiest rank",
    ]
    cells = [
        [
            str(r["world_size"]),
            r["config"],
            f"{r['median_ms']:.1f}",
            f"{r['mean_ms']:.1f}",
            f"{r['overhead']:.2f}x",
            f"{r['bytes']:,.0f}",
            f"{r['planned']:,.0f}",
            f"{r['max_rank_bytes']:,.0f}",
        ]
        for r in rows
    ]
    return table(header, columns, cells)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", default="2,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=50, help="measured steps per round")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 1, 10
    # SIGTERM (e.g. from pkill) raises SystemExit, so the workers are killed on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    rows = []
    for world_size in (int(w) for w in args.world_sizes.split(",")):
        rows += run(world_size, args.rounds, args.steps)
    header = (
        f"Measured {datetime.date.today().isoformat()} on {machine()} (the W processes share "
        f"the cores; load average before the run {load}), gloo, one thread per process; "
        f"{args.rounds} rounds x {args.steps} steps per configuration, interleaved; "
        f"K-FAC {KFAC}."
    )
    text = markdown(rows, header)
    print(text)
    if args.write:
        write_block("strategies", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
