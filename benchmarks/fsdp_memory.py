"""What a rank holds under DDP and under FSDP2, with K-FAC: ``wide-mlp`` at 1, 2 and 4 ranks.

For each world size, parallelism (DDP, FSDP2 through ``kaisa_ray.sharding.shard_layers``) and
KAISA strategy (COMM-OPT, HYBRID-OPT at 4, MEM-OPT), ``W`` gloo processes train the registry's
``wide-mlp`` (three hidden layers of 512, float32) with SGD and momentum and K-FAC (eigen,
factors every step, decompositions every 2) on random batches of 128 per rank for 4 steps,
then report the bytes each rank holds, counted from the live tensors (their local shards
under FSDP2): parameters, gradients, the optimizer's state, K-FAC's state
(``memory_usage()``) and what a step adds while it runs: the peak bytes of the tensors
``preconditioner.step()`` creates (``tuner.memory.TensorMemory``: every storage an operator
returns, until it is freed; the gathers' and scatters' buffers and the whole gradients under
FSDP2, the preconditioning's temporaries and DDP's broadcasts of preconditioned gradients
under both), on the steps after the first. The peak is their sum, without activations (the
same under both) and FSDP2's unsharded parameters during forward and backward (one layer at
a time here).

Run ``python benchmarks/fsdp_memory.py --write`` (about a minute): prints the table, stores
it in ``benchmarks/README.md`` (block ``fsdp-memory``) and the figures in
``benchmarks/results/fsdp_memory.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from kaisa_ray import KFACPreconditioner, sharding
from kaisa_train.models import WideMLP
from tuner.memory import TensorMemory

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "fsdp_memory.json"
STRATEGIES = {1: ["comm-opt"], 2: ["comm-opt", "mem-opt"], 4: ["comm-opt", "hybrid-opt", "mem-opt"]}
MIB = 2**20
STEPS = 4


def _local_bytes(tensor: torch.Tensor) -> int:
    to_local = getattr(tensor, "to_local", None)
    local = tensor if to_local is None else to_local()
    return local.numel() * local.element_size()


def _rank(rank: int, world: int, store: str, out: str, parallel: str, strategy: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = WideMLP()
    net: torch.nn.Module = model
    if parallel == "fsdp":
        sharding.shard_layers(model)
    elif world > 1:
        net = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    preconditioner = KFACPreconditioner(
        net, factor_update_steps=1, inv_update_steps=2, grad_worker_fraction=strategy
    )
    # What the step adds while it runs, measured: the peak bytes of the tensors the step
    # creates (``tuner.memory.TensorMemory`` counts every storage an operator returns until
    # it is freed), on the steps after the first (which makes K-FAC's state)
    most = 0
    generator = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        x = torch.randn(128, 1, 28, 28, generator=generator)
        y = torch.randint(0, 10, (128,), generator=generator)
        optimizer.zero_grad()
        F.cross_entropy(net(x), y).backward()
        with TensorMemory("cpu") as memory:
            preconditioner.step()
        if step > 0:
            most = max(most, memory.peak_bytes)
        optimizer.step()
    params = list(model.parameters())
    held = {
        "parameters": sum(_local_bytes(p) for p in params),
        "gradients": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(
            _local_bytes(v)
            for state in optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        ),
        "kfac": preconditioner.memory_usage()["total"],
        "step": most,
    }
    torch.save(held, out)
    dist.destroy_process_group()


def _child(
    rank: int, world: int, store: str, outs: list[str], parallel: str, strategy: str
) -> None:
    _rank(rank, world, store, outs[rank], parallel, strategy)


def run(world: int, parallel: str, strategy: str) -> list[dict[str, int]]:
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        outs = [str(Path(tmp) / f"rank{r}.pt") for r in range(world)]
        mp.start_processes(
            _child,
            args=(world, store, outs, parallel, strategy),
            nprocs=world,
            start_method="spawn",
        )
        return [torch.load(out) for out in outs]


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| ranks | parallel | strategy | parameters | gradients | optimizer | K-FAC | step adds "
        "| peak (MiB) | peak ÷ DDP's |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    ddp = {(r["world"], r["strategy"]): r["peak"] for r in rows if r["parallel"] == "ddp"}
    for r in rows:
        held = r["held"]
        ratio = r["peak"] / ddp[(r["world"], r["strategy"])]
        lines.append(
            f"| {r['world']} | {r['parallel']} | {r['strategy']} | "
            + " | ".join(
                f"{held[k] / MIB:.2f}"
                for k in ("parameters", "gradients", "optimizer", "kfac", "step")
            )
            + f" | {r['peak'] / MIB:.2f} | {ratio:.2f} |"
        )
    return "\n".join(lines)


def write_block(text: str) -> None:
    readme = HERE / "README.md"
    content = readme.read_text()
    begin, end = "<!-- fsdp-memory:begin -->", "<!-- fsdp-memory:end -->"
    block = f"{begin}\n{text}\n{end}"
    if begin in content:
        head, rest = content.split(begin, 1)
        content = head + block + rest.split(end, 1)[1]
    else:
        content = content.rstrip("\n") + "\n\n## K-FAC under FSDP2: what a rank holds\n\n" + block
        content += "\n"
    readme.write_text(content)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="store the table and the figures")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    for world in (1, 2, 4):
        for parallel in ("ddp", "fsdp"):
            for strategy in STRATEGIES[world]:
                per_rank = run(world, parallel, strategy)
                peaks = [sum(held.values()) for held in per_rank]
                most = max(range(world), key=lambda r: peaks[r])
                rows.append(
                    {
                        "world": world,
                        "parallel": parallel,
                        "strategy": strategy,
                        "held": per_rank[most],
                        "peak": peaks[most],
                    }
                )
                print(f"{world} {parallel} {strategy}: {peaks[most] / MIB:.2f} MiB", flush=True)
    text = table(rows)
    stamp = datetime.date.today().isoformat()
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    note = (
        f"`python benchmarks/fsdp_memory.py --write`, {stamp}, {machine}; the rank holding "
        "the most, in MiB."
    )
    print(text)
    if args.write:
        RESULTS.write_text(json.dumps({"date": stamp, "machine": machine, "rows": rows}, indent=1))
        write_block(note + "\n\n" + text)


if __name__ == "__main__":
    main()
