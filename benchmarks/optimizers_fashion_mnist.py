"""Time to 88% test accuracy on Fashion-MNIST: SGD, Adam and SGD + K-FAC (one process).

The LeNet-style CNN of ``../shared/BENCHMARKS.md``, batch 128, inputs standardised, test
accuracy on the full 10k test set every 25 steps. For each optimizer: steps and training
seconds to the target (median over seeds; evaluation time excluded), and each optimizer's mean
time per step divided by SGD's, measured in the same run with the runs interleaved seed by
seed. The mean (not the median) is the honest per-step cost: it includes the periodic factor
and decomposition updates.

Run ``python benchmarks/optimizers_fashion_mnist.py`` (add ``--quick`` for a smoke run);
``--write`` stores the table in ``benchmarks/README.md``. ``--device cuda`` runs it on a GPU
(the data on the device, each timed step synchronised) into its own block there.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from report import machine, table, write_block
from torch import nn

from kaisa_ray import KFACPreconditioner
from kaisa_train.datasets import load_idx_dataset
from kaisa_train.models import LeNetCNN


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    optimizer: str  # "sgd" | "adam"
    lr: float
    kfac: dict[str, Any] | None = None


SGD_LR, ADAM_LR = 0.05, 3e-3
# The reference implementation's settings from ../shared/BENCHMARKS.md (kfac-pytorch needed 900
# steps at intervals 1/10 and 625 at 5/50 with them): the same damping must mean the same here.
KFAC_COMMON: dict[str, Any] = {"damping": 0.1, "kl_clip": 0.001, "factor_decay": 0.95}
KFAC_LR = 0.05


def configs(kfac_common: dict[str, Any], kfac_lr: float) -> list[Config]:
    out = [
        Config("SGD (Nesterov 0.9, lr 0.05)", "sgd", SGD_LR),
        Config("Adam (lr 3e-3)", "adam", ADAM_LR),
    ]
    for approx in ("expand", "reduce"):
        for fus, ius in ((1, 10), (5, 50)):
            kfac = dict(
                kfac_common,
                factor_update_steps=fus,
                inv_update_steps=ius,
                kfac_approx=approx,
                lr=kfac_lr,
            )
            out.append(Config(f"SGD + K-FAC {approx} {fus}/{ius}", "sgd", kfac_lr, kfac))
    return out


NATURAL: dict[str, Any] = {
    "factor_scale": "fisher",
    "running_average": "debiased",
    "pi_damping": True,
}
# Each curvature option of issue 19 on its own, then together (the JobSpec's default), on the
# reference's damping 0.1 and KL clip 1e-3 with K-FAC-reduce at 5/50.
ABLATION: list[tuple[str, dict[str, Any]]] = [
    ("reference conventions (identity start, mean-loss G, damping added to the product)", {}),
    ("+ Fisher-scale factors only", {"factor_scale": "fisher"}),
    ("+ debiased running averages only", {"running_average": "debiased"}),
    ("+ π-damping only", {"pi_damping": True}),
    ("Fisher-scale + debiased", {"factor_scale": "fisher", "running_average": "debiased"}),
    ("Fisher-scale + debiased + π-damping (the default)", NATURAL),
    ("the default without the KL clip", {**NATURAL, "kl_clip": None}),
    ("the default, KL clip 3e-4", {**NATURAL, "kl_clip": 3e-4}),
]


def ablation_configs() -> list[Config]:
    out = [Config("SGD (Nesterov 0.9, lr 0.05)", "sgd", SGD_LR)]
    for name, options in ABLATION:
        kfac = {
            **KFAC_COMMON,
            "factor_update_steps": 5,
            "inv_update_steps": 50,
            "kfac_approx": "reduce",
            "lr": KFAC_LR,
            **options,
        }
        out.append(Config(f"K-FAC: {name}", "sgd", KFAC_LR, kfac))
    return out


@dataclasses.dataclass
class Run:
    config: str
    seed: int
    steps: int | None  # None: target not reached within max_steps
    train_seconds: float
    ms_per_step: float
    final_accuracy: float


def make_optimizer(config: Config, model: nn.Module) -> torch.optim.Optimizer:
    if config.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=config.lr)
    return torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9, nesterov=True)


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    correct = sum(
        int((model(xb).argmax(1) == yb).sum())
        for xb, yb in zip(x.split(2000), y.split(2000), strict=True)
    )
    model.train()
    return correct / len(y)


def train_to_target(
    config: Config,
    seed: int,
    data: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    target: float,
    max_steps: int,
    eval_every: int,
    batch_size: int = 128,
    device: torch.device | None = None,
) -> Run:
    x_train, y_train, x_test, y_test = data
    device = device or torch.device("cpu")
    cuda = device.type == "cuda"
    torch.manual_seed(seed)
    model = LeNetCNN().to(device)
    optimizer = make_optimizer(config, model)
    preconditioner = KFACPreconditioner(model, **config.kfac) if config.kfac else None
    order = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(y_train), generator=order)
    cursor, step, train_seconds, acc = 0, 0, 0.0, 0.0
    reached: int | None = None
    while step < max_steps:
        if cursor + batch_size > len(perm):
            perm, cursor = torch.randperm(len(y_train), generator=order), 0
        index = perm[cursor : cursor + batch_size].to(device)
        cursor += batch_size
        xb, yb = x_train[index], y_train[index]
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(xb), yb).backward()
        if preconditioner is not None:
            preconditioner.step()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        train_seconds += time.perf_counter() - start
        step += 1
        if step % eval_every == 0:
            acc = accuracy(model, x_test, y_test)
            if acc >= target:
                reached = step
                break
    return Run(config.name, seed, reached, train_seconds, 1000 * train_seconds / step, acc)


def summarise(runs: list[Run], names: list[str], target: float) -> list[dict[str, Any]]:
    sgd_ms = {r.seed: r.ms_per_step for r in runs if r.config == names[0]}
    rows = []
    for name in names:
        mine = [r for r in runs if r.config == name]
        reached = [r for r in mine if r.steps is not None]
        ratios = [r.ms_per_step / sgd_ms[r.seed] for r in mine if r.seed in sgd_ms]
        rows.append(
            {
                "optimizer": name,
                "reached": f"{len(reached)}/{len(mine)}",
                "steps": statistics.median(r.steps for r in reached) if reached else None,  # type: ignore[misc]
                "seconds": statistics.median(r.train_seconds for r in reached) if reached else None,
                "ms_per_step": statistics.median(r.ms_per_step for r in mine),
                "step_vs_sgd": statistics.median(ratios) if ratios else None,
                "wall_vs_sgd": None,
            }
        )
    base = rows[0]["seconds"]
    for row in rows:
        if base and row["seconds"]:
            row["wall_vs_sgd"] = row["seconds"] / base
    return rows


def markdown(rows: list[dict[str, Any]], target: float, header: str) -> str:
    def fmt(value: Any, spec: str, suffix: str = "") -> str:
        return "—" if value is None else format(value, spec) + suffix

    columns = [
        "optimizer",
        f"reached {target:.0%}",
        "steps (median)",
        "training s (median)",
        "ms per step",
        "step time vs SGD",
        "wall vs SGD",
    ]
    cells = [
        [
            r["optimizer"],
            r["reached"],
            fmt(r["steps"], ".0f"),
            fmt(r["seconds"], ".1f"),
            fmt(r["ms_per_step"], ".1f"),
            fmt(r["step_vs_sgd"], ".2f", "x"),
            fmt(r["wall_vs_sgd"], ".2f", "x"),
        ]
        for r in rows
    ]
    return table(header, columns, cells)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--target", type=float, default=0.88)
    parser.add_argument("--max-steps", type=int, default=1500)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--damping", type=float, default=KFAC_COMMON["damping"])
    parser.add_argument(
        "--kl-clip", type=float, default=KFAC_COMMON["kl_clip"], help="0 disables clipping"
    )
    parser.add_argument("--kfac-lr", type=float, default=KFAC_LR)
    parser.add_argument("--only", default=None, help="substring filter on optimizer names")
    parser.add_argument("--quick", action="store_true", help="1 seed, 100 steps: smoke run")
    parser.add_argument("--write", action="store_true", help="store the table in README.md")
    parser.add_argument("--json", type=Path, default=None, help="write raw runs here")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for a GPU")
    parser.add_argument(
        "--ablation",
        action="store_true",
        help="each curvature option on its own and together, into its own README block",
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.quick:
        args.seeds, args.max_steps = 1, 100
    torch.set_num_threads(args.threads)
    header_machine = machine()
    if device.type == "cuda":
        header_machine = f"{torch.cuda.get_device_name(device)} ({header_machine})"

    x_train, y_train = load_idx_dataset(args.data_dir, split="train")
    x_test, y_test = load_idx_dataset(args.data_dir, split="test")
    data = (x_train.to(device), y_train.to(device), x_test.to(device), y_test.to(device))
    common = dict(KFAC_COMMON, damping=args.damping, kl_clip=args.kl_clip or None)
    candidates = ablation_configs() if args.ablation else configs(common, args.kfac_lr)
    selected = [
        c
        for c in candidates
        if args.only is None or args.only in c.name or (c.optimizer == "sgd" and not c.kfac)
    ]
    names = [c.name for c in selected]
    if device.type == "cuda":  # CUDA's and cuBLAS's start-up is charged to no run
        for config in selected:
            train_to_target(config, 0, data, target=2.0, max_steps=20, eval_every=20, device=device)
    runs: list[Run] = []
    for seed in range(args.seeds):
        for config in selected:
            run = train_to_target(
                config,
                seed,
                data,
                target=args.target,
                max_steps=args.max_steps,
                eval_every=args.eval_every,
                device=device,
            )
            runs.append(run)
            print(
                f"seed {seed} {config.name}: steps {run.steps} "
                f"({run.train_seconds:.1f} s, {run.ms_per_step:.1f} ms/step, "
                f"final acc {run.final_accuracy:.4f})",
                flush=True,
            )
    rows = summarise(runs, names, args.target)
    today = datetime.date.today().isoformat()
    kfac_desc = ", ".join(f"{k}={v}" for k, v in sorted(common.items()))
    header = (
        f"Measured {today} on {header_machine}; {args.seeds} seed(s), at most "
        f"{args.max_steps} steps; K-FAC rows on SGD (Nesterov 0.9, lr {args.kfac_lr}) with "
        f"{kfac_desc} unless the row says otherwise."
    )
    text = markdown(rows, args.target, header)
    print()
    print(text)
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in runs], indent=1))
    if args.write:
        block = "optimizers" if device.type == "cpu" else f"optimizers-{device.type}"
        write_block(f"{block}-ablation" if args.ablation else block, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
