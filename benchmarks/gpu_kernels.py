"""ResNet-50's own K-FAC operations timed at their shapes on one GPU (``tuner.kernels``):
each layer's factor products, each shape group's preconditioning, the decompositions by
size, a quiet step, a plain step and the kernel latency, for the configurations the plan is
checked against (``plan_vs_gpu.py``): batch 32 and 64, the reference's ``expand`` factors
with the eigen method and the JobSpec's curvature with the inverse method, at
``matmul_precision`` 'highest' and 'high'.

Run on a machine with CUDA: ``python benchmarks/gpu_kernels.py --out results/gpu_kernels.json``
(``--device cpu --batch 2 --quick`` tries it out here).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

import torch
from phases import JOBSPEC_CURVATURE, WORKLOADS

from tuner.kernels import measure_kernels

CONFIGS: dict[str, dict[str, Any]] = {
    "eigen-expand-highest": {
        "compute_method": "eigen",
        "kfac_approx": "expand",
        "matmul_precision": "highest",
    },
    "eigen-expand-high": {"compute_method": "eigen", "kfac_approx": "expand"},
    "inverse-expand-highest": {
        "compute_method": "inverse",
        "kfac_approx": "expand",
        "matmul_precision": "highest",
    },
    "jobspec-inverse-highest": {**JOBSPEC_CURVATURE, "matmul_precision": "highest"},
    "jobspec-inverse-high": dict(JOBSPEC_CURVATURE),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="two configurations, 2 repeats")
    parser.add_argument("--workload", default="resnet50")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_kernels: needs CUDA; none on this machine", file=sys.stderr)
        return 2
    names = list(CONFIGS)[:2] if args.quick else list(CONFIGS)
    repeats = 2 if args.quick else args.repeats
    results = []
    workload = WORKLOADS[args.workload]
    for batch in args.batch:
        for name in names:
            if batch != args.batch[0] and "highest" in name and "eigen" not in name:
                continue  # the other batch: the eigen check and the default precision
            torch.manual_seed(0)
            model = workload.model().to(device)
            x, y = workload.batch(batch, device)
            profile = measure_kernels(model, x, y, repeats=repeats, **CONFIGS[name])
            results.append({"config": name, "batch": batch, **profile.to_dict()})
            print(
                f"{name} b{batch}: step {profile.step_s * 1e3:.1f} ms, quiet K-FAC "
                f"{profile.quiet_kfac_s * 1e3:.1f} ms, factors "
                f"{sum(k.a_factor_s + k.g_factor_s for k in profile.layers) * 1e3:.1f} ms, "
                f"products {sum(g.precondition_s for g in profile.groups) * 1e3:.2f} ms, "
                f"decompositions {sum(d.seconds for d in profile.decompositions) * 1e3:.1f} ms",
                flush=True,
            )
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    stamp = datetime.date.today().isoformat()
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    args.out.write_text(json.dumps({"date": stamp, "gpu": gpu, "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
