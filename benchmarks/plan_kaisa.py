"""KAISA's jobs priced before renting the GPUs: ResNet-50 and BERT-Large on 8 to 1024 GPUs of the
A100 preset, by ``kaisa-ray plan`` (shapes + hardware profile, nothing trained).

Three outputs, all predictions of the cost model (no GPU was used; the preset's compute rates
are estimates, its network figures cited benchmarks, see kaisa_train/hardware/):

1. memory: fp32 K-FAC factors per rank and the worst rank's decompositions at f = 1, 1/2,
   1/8 and 1/W for W = 8, 64, 256 (exact: ``kaisa_ray.plan``);
2. the tuner's choice next to KAISA's authors' for ResNet-50 (batch 32 per GPU) and BERT-Large
   phase 1 (the authors' phase-1 config: global batch 65,536, micro-batches of 96 per GPU,
   fp16, LAMB) at 8, 64 and 128 GPUs under a 40 GB budget (the A100-40GB the authors ran on),
   with the predicted step of both where they differ;
3. the figure: predicted K-FAC time per step and K-FAC memory per GPU against the world size
   for COMM-OPT, HYBRID-OPT (f = 1/2, and f = 1/8, one node's share) and MEM-OPT, with the
   crossovers printed.

``python benchmarks/plan_kaisa.py --write`` (a few minutes) writes results/plan_kaisa.json,
results/plan_kaisa.png and the tables in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from report import git_commit, machine, table, write_block

from kaisa_ray.plan import plan
from kaisa_train.planning import PlanRequest, load_hardware, plan_job
from kaisa_train.shapes import workload
from tuner.cost import price
from tuner.forecast import Workload, forecast_profile
from tuner.hardware import Hardware, SizeTable, Sourced

RESULTS = Path(__file__).resolve().parent / "results"
HARDWARE = "a100-80gb-hdr"
BUDGET = 40 * 10**9  # the A100-40GB of ThetaGPU, where the authors ran (BERT-PyTorch README)
WORLDS = (8, 16, 32, 64, 128, 256, 512, 1024)
GLOBAL_BATCH = 65536  # BERT phase 1, config/bert_pretraining_phase1_config.json
MICRO_BATCH = 96  # its local_batch_size

PAPER: dict[str, dict[str, Any]] = {
    "resnet50": {
        "strategy": "COMM-OPT",
        "fraction": 1.0,
        "intervals": (10, 100),
        "source": "gpauloski/kfac-pytorch examples/torch_imagenet_resnet.py (v0.3.2, 2021): "
        "--kfac-comm-method comm-opt, --kfac-cov-update-freq 10, --kfac-update-freq 100, "
        "--batch-size 32",
    },
    "bert-large": {
        "strategy": "MEM-OPT",
        "fraction": None,  # 1/W
        "intervals": (1, 10),
        "source": "gpauloski/BERT-PyTorch run_pretraining.py at 2818441..8356d56 (Jan-Feb 2021): "
        "comm_method=MEM_OPT, kfac_factor_interval 1, kfac_inv_interval 10; HYBRID_OPT with "
        "grad_worker_fraction=0.5 and fp16 inverses from fe2fb92 (June 2021) on",
    },
}


def bert_batch(world: int) -> tuple[int, int]:
    """(micro-batch, accumulation steps) of phase 1 on ``world`` GPUs, as run_pretraining.py
    computes them: micro-batches of 96, ceil(global / world / 96) of them (at 512 GPUs that is
    2 x 96 for a share of 128, at 1024 one of 96 for 64: the script rounds up)."""
    local = GLOBAL_BATCH // world
    return MICRO_BATCH, math.ceil(local / MICRO_BATCH)


def job(model: str, world: int) -> dict[str, Any]:
    if model == "resnet50":
        return {"model": "resnet50", "batch_size": 32, "precision": "fp32", "optimizer": "sgd"}
    micro, accumulation = bert_batch(world)
    return {
        "model": "bert-large",
        "params": {"seq_len": 128},
        "batch_size": micro,
        "accumulation_steps": accumulation,
        "precision": "fp16",
        "optimizer": "lamb",
    }


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def memory_table() -> tuple[list[dict[str, Any]], str]:
    rows, cells = [], []
    for model in ("resnet50", "bert-large"):
        layers = list(workload(model, batch_size=1, **_params(model)).layers)
        for world in (8, 64, 256):
            entry: dict[str, Any] = {"model": model, "world": world}
            decomp = []
            for label, fraction in (("1", 1.0), ("1/2", 0.5), ("1/8", 0.125), ("1/W", 1 / world)):
                ranks = plan(layers, world, fraction).ranks
                worst = max(r.memory["decompositions"] for r in ranks)
                entry[f"decompositions_f={label}"] = worst
                decomp.append(gib(worst))
            entry["factors"] = ranks[0].memory["factors"]
            rows.append(entry)
            cells.append([model, str(world), gib(entry["factors"]), *decomp])
    text = table(
        "K-FAC state per GPU in GiB (fp32, eigen with the eigenvalue table; the worst rank's "
        "decompositions; buffers for the factor all-reduce equal the factors and are not "
        "repeated here):",
        ["model", "W", "factors", "decomp. f=1", "f=1/2", "f=1/8", "f=1/W"],
        cells,
    )
    return rows, text


def _params(model: str) -> dict[str, Any]:
    return {"params": {"seq_len": 128}} if model == "bert-large" else {}


def choices() -> tuple[list[dict[str, Any]], str]:
    rows, cells = [], []
    for model in ("resnet50", "bert-large"):
        paper = PAPER[model]
        for world in (8, 64, 128):
            settings = job(model, world)
            fus, ius = paper["intervals"]
            base = PlanRequest(hardware=HARDWARE, workers=world, budgets=(BUDGET,), **settings)
            ladder = plan_job(base).to_json()
            at_theirs = dataclasses.replace(base, intervals=((fus, ius),))
            fixed = plan_job(at_theirs).to_json()
            tf32 = plan_job(at_theirs, tf32_products(load_hardware(HARDWARE))).to_json()
            fraction = paper["fraction"] or 1 / world
            theirs = next(
                c
                for s in fixed["strategies"]
                if s["grad_worker_fraction"] == fraction
                for c in s["candidates"]
            )
            tuned, same_intervals = ladder["choices"][0]["chosen"], fixed["choices"][0]["chosen"]
            faster = tf32["choices"][0]["chosen"]
            theirs_tf32 = next(
                c
                for s in tf32["strategies"]
                if s["grad_worker_fraction"] == fraction
                for c in s["candidates"]
            )
            row = {
                "model": model,
                "world": world,
                "settings": settings,
                "paper": {
                    **paper,
                    "fraction": fraction,
                    "step_s": theirs["step_s"],
                    "memory_bytes": theirs["memory_bytes"],
                },
                "tuner": tuned,
                "tuner_at_paper_intervals": same_intervals,
                "tf32": {"tuner": faster, "paper_step_s": theirs_tf32["step_s"]},
            }
            rows.append(row)

            def name(c: dict[str, Any]) -> str:
                return f"{c['strategy']} {c['factor_update_steps']}/{c['inv_update_steps']}"

            cells.append(
                [
                    model,
                    str(world),
                    f"{paper['strategy']} {fus}/{ius}",
                    f"{theirs['step_s'] * 1e3:,.0f}",
                    name(tuned),
                    f"{tuned['step_s'] * 1e3:,.0f}",
                    name(same_intervals),
                    f"{same_intervals['step_s'] * 1e3:,.0f}",
                    f"{name(faster)} ({faster['step_s'] * 1e3:,.0f} ms; "
                    f"authors' {theirs_tf32['step_s'] * 1e3:,.0f} ms)",
                ]
            )
    text = table(
        f"The tuner (tuner.choice.choose on the {HARDWARE} forecast, budget 40 GB per GPU) next to "
        "KAISA's authors' choice; predicted ms per optimizer step:",
        [
            "model",
            "GPUs",
            "authors",
            "ms",
            "tuner (ladder 1/10, 5/50, 10/100)",
            "ms",
            "tuner at the authors' intervals",
            "ms",
            "the same with TF32 K-FAC products (estimate)",
        ],
        cells,
    )
    return rows, text


def tf32_products(hardware: Hardware) -> Hardware:
    """The preset with K-FAC's float32 products at TF32 rates: what PyTorch 1.7-1.11 ran them
    at on an A100 (``allow_tf32`` defaulted to True until 1.12), when KAISA was measured.
    An estimate: each fp32 rate x 8, the datasheets' TF32 tensor peak over the FP32 peak
    (156 / 19.5 Tflop/s); the eigendecompositions are unchanged."""
    table = hardware.matmul["fp32"]
    faster = SizeTable(
        points=tuple(
            (n, Sourced(value=v.value * 8, kind="estimate", source="fp32 rate x 8 (TF32)"))
            for n, v in table.points
        )
    )
    return dataclasses.replace(hardware, matmul={**hardware.matmul, "fp32": faster})


def curves() -> dict[str, Any]:
    """K-FAC seconds per step and K-FAC memory per GPU, per strategy and world size."""
    hardware = load_hardware(HARDWARE)
    out: dict[str, Any] = {}
    for model in ("resnet50", "bert-large"):
        fus, ius = PAPER[model]["intervals"]
        series: dict[str, dict[str, list[Any]]] = {}
        for world in WORLDS:
            settings = job(model, world)
            work: Workload = workload(
                settings["model"],
                batch_size=settings["batch_size"],
                params=settings.get("params"),
                precision=settings["precision"],
                optimizer=settings["optimizer"],
            )
            work = dataclasses.replace(
                work, accumulation_steps=settings.get("accumulation_steps", 1)
            )
            profile, _ = forecast_profile(work, hardware, world)
            for label, fraction in (
                ("COMM-OPT", 1.0),
                ("HYBRID-OPT f=1/2", 0.5),
                ("HYBRID-OPT f=1/8", 0.125),
                ("MEM-OPT", 1 / world),
            ):
                strategy = plan(list(work.layers), world, fraction)
                candidate = price(profile, strategy, fus, ius)
                entry = series.setdefault(
                    label, {"world": [], "kfac_s": [], "memory": [], "parts": [], "plain_s": []}
                )
                entry["world"].append(world)
                entry["kfac_s"].append(sum(candidate.breakdown.values()))
                entry["memory"].append(candidate.kfac_state_bytes)
                entry["parts"].append(dict(candidate.breakdown))
                entry["plain_s"].append(profile.step_s)
        out[model] = {"intervals": [fus, ius], "series": series}
    return out


def crossovers(data: dict[str, Any]) -> list[str]:
    """Where the order of two strategies' predicted K-FAC time (or K-FAC memory) changes as
    W grows, ties included (at 8 GPUs HYBRID-OPT 1/8 is MEM-OPT: the same grid)."""

    def sign(x: float, scale: float) -> int:
        return 0 if abs(x) <= 1e-6 * scale else (1 if x > 0 else -1)

    lines = []
    for model, found in data.items():
        series = found["series"]
        names = list(series)
        for key, what in (("kfac_s", "K-FAC time"), ("memory", "K-FAC memory")):
            for i, a in enumerate(names):
                for b in names[i + 1 :]:
                    ta = dict(zip(series[a]["world"], series[a][key], strict=True))
                    tb = dict(zip(series[b]["world"], series[b][key], strict=True))
                    worlds = sorted(set(ta) & set(tb))
                    for w0, w1 in itertools.pairwise(worlds):
                        s0 = sign(ta[w0] - tb[w0], abs(ta[w0]) + abs(tb[w0]))
                        s1 = sign(ta[w1] - tb[w1], abs(ta[w1]) + abs(tb[w1]))
                        if s1 == 0 or s0 == s1:
                            continue
                        ahead, behind = (b, a) if s1 > 0 else (a, b)
                        unit = 1e3 if key == "kfac_s" else 2**-20
                        fmt = "{:,.1f} ms" if key == "kfac_s" else "{:,.1f} MiB"
                        was = "equal to" if s0 == 0 else "behind"
                        lines.append(
                            f"{model}, {what}: {ahead} goes below {behind} between {w0} and "
                            f"{w1} GPUs (it was {was} it at {w0}; at {w1}: "
                            + fmt.format(min(ta[w1], tb[w1]) * unit)
                            + " against "
                            + fmt.format(max(ta[w1], tb[w1]) * unit)
                            + ")"
                        )
    return lines


def figure(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 2, figsize=(12, 12), sharex=True)
    styles = {
        "COMM-OPT": ("tab:blue", "o"),
        "HYBRID-OPT f=1/2": ("tab:orange", "s"),
        "HYBRID-OPT f=1/8": ("tab:green", "^"),
        "MEM-OPT": ("tab:red", "v"),
    }
    titles = {"resnet50": "ResNet-50, batch 32/GPU", "bert-large": "BERT-Large phase 1"}
    for col, model in enumerate(("resnet50", "bert-large")):
        found = data[model]
        fus, ius = found["intervals"]
        for label, series in found["series"].items():
            color, marker = styles[label]
            kw = {"color": color, "marker": marker, "label": label}
            worlds = series["world"]
            axes[0][col].plot(worlds, [t * 1e3 for t in series["kfac_s"]], **kw)
            varying = [
                (t - p["factors"]) * 1e3
                for t, p in zip(series["kfac_s"], series["parts"], strict=True)
            ]
            axes[1][col].plot(worlds, varying, **kw)
            axes[2][col].plot(worlds, [m / 2**30 for m in series["memory"]], **kw)
        axes[0][col].set_title(f"{titles[model]}: K-FAC time per step ({fus}/{ius})")
        axes[0][col].set_ylabel("predicted K-FAC ms per step")
        axes[1][col].set_title("its strategy-dependent part (decomp. + precond. + comm.)")
        axes[1][col].set_ylabel("ms per step")
        axes[2][col].set_title(f"{titles[model]}: K-FAC state per GPU (worst rank)")
        axes[2][col].set_ylabel("GiB")
        axes[2][col].set_xlabel("GPUs (A100-80GB, 8 per node, HDR InfiniBand)")
        for row in (0, 1, 2):
            axes[row][col].set_xscale("log", base=2)
            axes[row][col].grid(True, alpha=0.3)
        axes[0][col].set_yscale("log")
        axes[1][col].set_yscale("log")
    axes[0][0].legend(loc="center right")
    fig.suptitle(
        "kaisa-ray plan: predicted, not measured (preset a100-80gb-hdr; compute rates estimated)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="write results and README blocks")
    args = parser.parse_args()
    torch.set_num_threads(1)
    began = time.perf_counter()
    memory_rows, memory_text = memory_table()
    print(memory_text, "\n")
    choice_rows, choice_text = choices()
    print(choice_text, "\n")
    data = curves()
    crossings = crossovers(data)
    print("\n".join(crossings))
    stamp = (
        f"Computed {datetime.date.today().isoformat()} at commit {git_commit()} on {machine()} "
        f"in {time.perf_counter() - began:.0f} s (pure computation: shapes on the meta device, "
        "the plan, the cost model)."
    )
    print(stamp)
    if args.write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "plan_kaisa.json").write_text(
            json.dumps(
                {
                    "stamp": stamp,
                    "hardware": HARDWARE,
                    "budget_bytes": BUDGET,
                    "memory": memory_rows,
                    "choices": choice_rows,
                    "curves": data,
                    "crossovers": crossings,
                },
                indent=1,
            )
        )
        figure(data, RESULTS / "plan_kaisa.png")
        write_block("plan-kaisa-memory", memory_text)
        write_block("plan-kaisa-choices", choice_text)
        write_block(
            "plan-kaisa-crossovers",
            stamp + "\n\nWhere the order of two strategies changes as the world grows (predicted "
            "K-FAC time per step; K-FAC memory per GPU):\n\n"
            + "\n".join(f"- {line}" for line in crossings),
        )


if __name__ == "__main__":
    main()
