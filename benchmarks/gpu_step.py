"""K-FAC on one GPU: a step's milliseconds against the first-order step's, where the time
goes (phases), and peak memory, before and after a change, in one run.

ResNet-50 (224×224, random inputs, SGD with momentum) at batch 32 and 64, fp32 and bf16
autocast, with this project's K-FAC at KAISA's ResNet-50 intervals 10/100 and at 1/10, the
inverse and the eigen method, the JobSpec's curvature (Fisher-scale factors, debiased
averages, π-damping, K-FAC-reduce, damping 0.1, no KL clip), its products at
``matmul_precision`` 'highest' (IEEE float32) and 'high' (TF32), and the same with the
preconditioning replayed from a CUDA graph (``cuda_graphs=True``); the reference's settings
(eigen, ``expand``, damping 1e-3, KL clip 1e-3) for comparison with the figures of
``shared/gpu``; and the 10.7M-parameter byte-level transformer (context 256, width 384,
depth 6, 64 sequences) with AdamW, against AdamW + K-FAC at the transformer benchmark's
settings (5/50). ``--before PATH`` also times another checkout's code (e.g. a ``git
worktree`` of the commit before the change) in interleaved rounds, for the configurations it
can run.

Every configuration runs in one process per code version, in rounds of one whole inverse
period each (after a warm-up round), steps timed with CUDA events; ``phases.py`` says how the
phases come from whole-step medians. Peak: the allocator's peak over a configuration's first
period, over what was allocated before it.

Run on a machine with CUDA: ``python benchmarks/gpu_step.py --json PATH`` (``--quick``: one
round, ResNet-50 fp32 at batch 32 only); ``--from-json PATH --write`` renders saved results
into ``benchmarks/README.md`` and ``results/gpu_step.json`` (the GPU machine's checkout is a
copy).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path
from typing import Any

import torch
from phases import COLUMNS, JOBSPEC_CURVATURE, Config, run_rounds, tabulate
from report import git_commit, machine, table, write_block

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "gpu_step.json"

REFERENCE: dict[str, Any] = {  # kfac-pytorch's settings for ResNet-50
    "compute_method": "eigen",
    "kfac_approx": "expand",
    "damping": 0.001,
    "kl_clip": 0.001,
    "lr": 0.05,
}


def _kfac(fus: int, ius: int, **more: Any) -> dict[str, Any]:
    return {**JOBSPEC_CURVATURE, "factor_update_steps": fus, "inv_update_steps": ius, **more}


def configs(quick: bool) -> list[Config]:
    both, after = ("before", "after"), ("after",)
    out = [
        Config("ResNet-50 b32 fp32: SGD", "resnet50", 32, None, both, 100),
        Config(
            "ResNet-50 b32 fp32: K-FAC inverse 10/100, highest",
            "resnet50",
            32,
            _kfac(10, 100, matmul_precision="highest"),
            after,
            100,
        ),
        Config(
            "ResNet-50 b32 fp32: K-FAC inverse 10/100",  # 'highest' before, 'high' after
            "resnet50",
            32,
            _kfac(10, 100),
            both,
            100,
        ),
    ]
    if quick:
        return out
    graphs = {"cuda_graphs": True}
    out += [
        Config(
            "ResNet-50 b32 fp32: K-FAC inverse 10/100, CUDA graphs",
            "resnet50",
            32,
            _kfac(10, 100, **graphs),
            after,
            100,
        ),
        Config(
            "ResNet-50 b32 fp32: K-FAC eigen 10/100, CUDA graphs",
            "resnet50",
            32,
            _kfac(10, 100, compute_method="eigen", **graphs),
            after,
            100,
        ),
        Config(
            "ResNet-50 b32 bf16: K-FAC inverse 10/100, CUDA graphs",
            "resnet50",
            32,
            _kfac(10, 100, **graphs),
            after,
            100,
            "bf16",
        ),
        Config(
            "ResNet-50 b64 fp32: K-FAC inverse 10/100, CUDA graphs",
            "resnet50",
            64,
            _kfac(10, 100, **graphs),
            after,
            100,
        ),
        Config(
            "ResNet-50 b32 fp32: K-FAC eigen 10/100",
            "resnet50",
            32,
            _kfac(10, 100, compute_method="eigen"),
            both,
            100,
        ),
        Config(
            "ResNet-50 b32 fp32: K-FAC Adam eigenbasis 10/100",
            "resnet50",
            32,
            _kfac(10, 100, compute_method="eigen", scaling="adam-eigenbasis"),
            both,
            100,
        ),
        Config(
            "ResNet-50 b32 fp32: K-FAC EKFAC 10/100",
            "resnet50",
            32,
            _kfac(10, 100, compute_method="eigen", scaling="ekfac", pi_damping=False),
            both,
            100,
        ),
        Config("ResNet-50 b32 fp32: K-FAC inverse 1/10", "resnet50", 32, _kfac(1, 10), after, 100),
        Config(
            "ResNet-50 b32 fp32: K-FAC eigen 1/10",
            "resnet50",
            32,
            _kfac(1, 10, compute_method="eigen"),
            after,
            100,
        ),
        Config(
            "ResNet-50 b32 fp32: K-FAC reference eigen expand 10/100",
            "resnet50",
            32,
            {**REFERENCE, "factor_update_steps": 10, "inv_update_steps": 100},
            both,
            100,
        ),
        Config("ResNet-50 b64 fp32: SGD", "resnet50", 64, None, after, 100),
        Config(
            "ResNet-50 b64 fp32: K-FAC inverse 10/100", "resnet50", 64, _kfac(10, 100), after, 100
        ),
    ]
    for batch in (32, 64):
        out += [
            Config(f"ResNet-50 b{batch} bf16: SGD", "resnet50", batch, None, after, 100, "bf16"),
            Config(
                f"ResNet-50 b{batch} bf16: K-FAC inverse 10/100",
                "resnet50",
                batch,
                _kfac(10, 100),
                after,
                100,
                "bf16",
            ),
        ]
    transformer = {"factor_update_steps": 5, "inv_update_steps": 50, **JOBSPEC_CURVATURE}
    transformer["kfac_approx"] = "expand"  # Linear layers only: the same factors
    out += [
        Config("transformer 10.7M b64 fp32: AdamW", "char-transformer-10m", 64, None, both, 50),
        Config(
            "transformer 10.7M b64 fp32: AdamW + K-FAC 5/50",
            "char-transformer-10m",
            64,
            transformer,
            both,
            50,
        ),
        Config(
            "transformer 10.7M b64 fp32: AdamW + K-FAC 5/50, CUDA graphs",
            "char-transformer-10m",
            64,
            {**transformer, "cuda_graphs": True},
            after,
            50,
        ),
        Config(
            "transformer 10.7M b64 fp32: AdamW + K-FAC Adam eigenbasis 5/50",
            "char-transformer-10m",
            64,
            {**transformer, "compute_method": "eigen", "scaling": "adam-eigenbasis"},
            both,
            50,
        ),
    ]
    return out


def render(result: dict[str, Any]) -> str:
    header = (
        f"K-FAC on one GPU ({result['date']}, {result['gpu']}; {result['machine']}; commit "
        f"{result['commit']}; {result['versions']}; {result['rounds']} interleaved rounds of "
        "one inverse period per configuration after a warm-up round; medians of whole steps "
        "by kind, benchmarks/phases.py; ms; peak: the allocator's over the first period):"
    )
    return table(header, [*COLUMNS, "peak MiB"], result["table"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, help="another checkout to time interleaved")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one round, ResNet-50 b32 fp32")
    parser.add_argument("--json", type=Path, help="also save the results here")
    parser.add_argument(
        "--from-json", type=Path, nargs="+", help="render saved results; measure nothing"
    )
    parser.add_argument("--write", action="store_true", help="update benchmarks/README.md")
    parser.add_argument("--commit", help="the commit measured, where the checkout has no .git")
    parser.add_argument("--device", default="cuda", help="cpu: try the script out")
    parser.add_argument("--steps", type=int, help="steps per round, every configuration")
    parser.add_argument(
        "--only", nargs="+", help="the configurations whose label contains one of these"
    )
    parser.add_argument(
        "--skip", nargs="+", help="leave out the configurations whose label contains one of these"
    )
    args = parser.parse_args()
    if args.from_json is not None:
        results = [json.loads(path.read_text()) for path in args.from_json]
        text = "\n\n".join(render(result) for result in results)
        print(text)
        if args.write:
            RESULTS.write_text(json.dumps(results, indent=1))
            write_block("gpu-step", text)
        return 0
    else:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            print("gpu_step: needs CUDA; none on this machine", file=sys.stderr)
            return 2
        trees = {"after": ROOT}
        if args.before is not None:
            trees["before"] = args.before.resolve()
        chosen = [
            dataclasses.replace(c, steps=args.steps or c.steps)
            for c in configs(args.quick)
            if (args.only is None or any(part in c.label for part in args.only))
            and not any(part in c.label for part in args.skip or ())
        ]
        rounds = 1 if args.quick else args.rounds
        measured = run_rounds(chosen, trees, rounds, device)
        rows, results = tabulate(chosen, measured, list(trees), memory=True)
        result = {
            "date": datetime.date.today().isoformat(),
            "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "machine": machine(),
            "commit": args.commit or git_commit() or "unknown",
            "versions": "this checkout (after)"
            + (f" and {args.before} (before)" if args.before else ""),
            "rounds": rounds,
            "table": rows,
            "rows": results,
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
