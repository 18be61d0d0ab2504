"""K-FAC on one GPU: milliseconds per training step and peak memory against SGD, measured
in one run.

Two models on random inputs of their datasets' shapes (batch 128): the LeNet-style CNN
(1×28×28, Fashion-MNIST's shape) and ResNet-20 (3×32×32, CIFAR's). For each model and
precision (fp32; bf16 autocast), SGD with Nesterov momentum is the baseline, and K-FAC runs
on that SGD with the eigen method at factor/inverse intervals 1/10 and 10/100 (KAISA's
CIFAR-10 and ResNet-50 settings) and the inverse method at 10/100. Configurations are
interleaved in rounds; each round times ``--steps`` steps with CUDA events after warm-up, and
the table gives the median over rounds of the mean step (the mean includes the periodic
factor and decomposition work), the ratio to SGD's median from the same rounds, and the
CUDA allocator's peak over the run.

Run on a machine with CUDA: ``python benchmarks/gpu_step.py`` (``--json PATH`` keeps the
results); ``--from-json PATH --write`` renders saved results into ``benchmarks/README.md``
and ``benchmarks/results/gpu_step.json`` (the GPU machine's checkout is a copy).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from report import git_commit, machine, table, write_block
from torch import nn

from kaisa_ray import KFACPreconditioner
from kaisa_ray.train.models import LeNetCNN, ResNet20

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_step.json"
MODELS: dict[str, tuple[type[nn.Module], tuple[int, ...]]] = {
    "LeNet CNN": (LeNetCNN, (1, 28, 28)),
    "ResNet-20": (ResNet20, (3, 32, 32)),
}
# (label, K-FAC options or None for plain SGD)
CONFIGS: list[tuple[str, dict[str, Any] | None]] = [
    ("SGD", None),
    ("K-FAC eigen 1/10", {"factor_update_steps": 1, "inv_update_steps": 10}),
    ("K-FAC eigen 10/100", {"factor_update_steps": 10, "inv_update_steps": 100}),
    (
        "K-FAC inverse 10/100",
        {"factor_update_steps": 10, "inv_update_steps": 100, "compute_method": "inverse"},
    ),
]
BATCH = 128


class Trainee:
    """One model, optimizer and (maybe) preconditioner, stepping on fixed random batches."""

    def __init__(
        self, model_name: str, precision: str, kfac: dict[str, Any] | None, device: torch.device
    ) -> None:
        torch.manual_seed(0)
        cls, shape = MODELS[model_name]
        self.model = cls().to(device)
        self.optimizer = torch.optim.SGD(
            self.model.parameters(), lr=0.05, momentum=0.9, nesterov=True
        )
        self.preconditioner = (
            None
            if kfac is None
            else KFACPreconditioner(self.model, damping=0.01, kl_clip=0.001, lr=0.05, **kfac)
        )
        self.dtype = torch.bfloat16 if precision == "bf16" else None
        generator = torch.Generator(device=device).manual_seed(1)
        self.x = torch.randn(BATCH, *shape, device=device, generator=generator)
        self.y = torch.randint(0, 10, (BATCH,), device=device, generator=generator)

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=self.dtype or torch.float32, enabled=bool(self.dtype)):
            loss = F.cross_entropy(self.model(self.x), self.y)
        loss.backward()
        if self.preconditioner is not None:
            self.preconditioner.step()
        self.optimizer.step()


def time_steps(trainee: Trainee, steps: int) -> float:
    """Mean milliseconds per step over ``steps`` steps, by CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        trainee.step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps


def measure(rounds: int, steps: int, warmup: int) -> list[dict[str, Any]]:
    device = torch.device("cuda")
    rows: list[dict[str, Any]] = []
    for model_name in MODELS:
        for precision in ("fp32", "bf16"):
            # One unmeasured run first: cuBLAS's workspace and the allocator's first blocks are
            # not charged to whichever configuration happens to come first.
            for _, kfac in CONFIGS:
                scratch = Trainee(model_name, precision, kfac, device)
                scratch.step()
                del scratch
            gc.collect()  # a preconditioner and its model's hooks form a cycle
            trainees: dict[str, Trainee] = {}
            peaks: dict[str, int] = {}
            for label, kfac in CONFIGS:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                trainee = Trainee(model_name, precision, kfac, device)
                for _ in range(warmup):  # past the first decomposition at every interval
                    trainee.step()
                torch.cuda.synchronize()
                peaks[label] = torch.cuda.max_memory_allocated() - base
                trainees[label] = trainee
            times: dict[str, list[float]] = {label: [] for label, _ in CONFIGS}
            for _ in range(rounds):
                for label, _ in CONFIGS:
                    times[label].append(time_steps(trainees[label], steps))
            sgd = statistics.median(times["SGD"])
            for label, _ in CONFIGS:
                ms = statistics.median(times[label])
                rows.append(
                    {
                        "model": model_name,
                        "precision": precision,
                        "optimizer": label,
                        "ms_per_step": ms,
                        "vs_sgd": ms / sgd,
                        "peak_mib": peaks[label] / 2**20,
                        "rounds": times[label],
                    }
                )
                print(
                    f"{model_name:10s} {precision:5s} {label:22s} {ms:8.2f} ms "
                    f"{ms / sgd:5.2f}x  peak {peaks[label] / 2**20:7.1f} MiB",
                    flush=True,
                )
            del trainees
            gc.collect()
            torch.cuda.empty_cache()
    return rows


def render(result: dict[str, Any]) -> str:
    header = (
        f"K-FAC on one GPU, batch {BATCH}, random inputs "
        f"({result['date']}, {result['gpu']}; {result['machine']}; commit {result['commit']}; "
        f"median of {result['rounds']} rounds of {result['steps']} steps):"
    )
    rows = [
        [
            r["model"],
            r["precision"],
            r["optimizer"],
            f"{r['ms_per_step']:.2f}",
            f"{r['vs_sgd']:.2f}",
            f"{r['peak_mib']:.1f}",
        ]
        for r in result["rows"]
    ]
    columns = ["model", "precision", "optimizer", "ms per step", "vs SGD", "peak MiB"]
    return table(header, columns, rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=110)
    parser.add_argument("--json", type=Path, help="also save the results here")
    parser.add_argument("--from-json", type=Path, help="render saved results; measure nothing")
    parser.add_argument("--write", action="store_true", help="update benchmarks/README.md")
    parser.add_argument("--commit", help="the commit measured, where the checkout has no .git")
    args = parser.parse_args()
    if args.from_json is not None:
        result = json.loads(args.from_json.read_text())
    else:
        if not torch.cuda.is_available():
            print("gpu_step: needs CUDA; none on this machine", file=sys.stderr)
            return 2
        rows = measure(args.rounds, args.steps, args.warmup)
        result = {
            "date": datetime.date.today().isoformat(),
            "gpu": torch.cuda.get_device_name(),
            "machine": machine(),
            "commit": args.commit or git_commit() or "unknown",
            "rounds": args.rounds,
            "steps": args.steps,
            "rows": rows,
        }
        if args.json is not None:
            args.json.write_text(json.dumps(result, indent=1))
    text = render(result)
    print(text)
    if args.write:
        RESULTS.write_text(json.dumps(result, indent=1))
        write_block("gpu-step", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
