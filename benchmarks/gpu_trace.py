"""Where a K-FAC step's time goes on a GPU, from the profiler's trace: for each kind of step
(the first-order step alone; K-FAC's quiet, factor-update and decomposition steps), the
host's milliseconds in each K-FAC phase and in the rest (forward, backward, optimizer), the
kernels each launched, the device time of those kernels, the host's time blocked on the
device (synchronisations, device-to-host copies), and how long the device sat idle between
the step's first and last kernel.

It answers the question ``gpu_step.py``'s whole-step phases cannot: whether a phase costs
its kernels' time (the device is the bottleneck) or its launches' (the host is: eager
PyTorch spends microseconds of Python and dispatch per operation, and a step whose kernels
are short waits for the host).

Run on a machine with CUDA: ``python benchmarks/gpu_trace.py --json PATH`` (``--traces DIR``
also keeps each profiled step's Chrome trace, gzipped); ``--device cpu`` runs the same on the
CPU (host phases and operation counts only). ``--from-json PATH --write`` renders saved
results into ``benchmarks/README.md`` and ``results/gpu_trace.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gzip
import json
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from phases import JOBSPEC_CURVATURE, Trainee
from report import git_commit, machine, table, write_block

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "gpu_trace.json"

# Runtime calls that launch work, and those during which the host waits for the device.
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
COPIES = ("cudaMemcpyAsync", "cudaMemsetAsync", "cudaMemcpy")
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
PHASE_PREFIX = "kfac:"
STEP_PREFIX = "step:"

CONFIGS: dict[str, tuple[str, int, dict[str, Any] | None]] = {
    "resnet50 b32 SGD": ("resnet50", 32, None),
    "resnet50 b32 K-FAC inverse 10/100": (
        "resnet50",
        32,
        {**JOBSPEC_CURVATURE, "factor_update_steps": 10, "inv_update_steps": 100},
    ),
    "resnet50 b32 K-FAC eigen 10/100": (
        "resnet50",
        32,
        {
            **JOBSPEC_CURVATURE,
            "compute_method": "eigen",
            "factor_update_steps": 10,
            "inv_update_steps": 100,
        },
    ),
    "resnet50 b32 K-FAC inverse 10/100, CUDA graphs": (
        "resnet50",
        32,
        {
            **JOBSPEC_CURVATURE,
            "factor_update_steps": 10,
            "inv_update_steps": 100,
            "cuda_graphs": True,
        },
    ),
    "resnet50 b32 K-FAC eigen 10/100, CUDA graphs": (
        "resnet50",
        32,
        {
            **JOBSPEC_CURVATURE,
            "compute_method": "eigen",
            "factor_update_steps": 10,
            "inv_update_steps": 100,
            "cuda_graphs": True,
        },
    ),
    "resnet50 b32 bf16 SGD": ("resnet50", 32, None),
    "resnet50 b32 bf16 K-FAC inverse 10/100": (
        "resnet50",
        32,
        {**JOBSPEC_CURVATURE, "factor_update_steps": 10, "inv_update_steps": 100},
    ),
    "lenet b64 SGD": ("lenet", 64, None),
    "lenet b64 K-FAC inverse 10/100": (
        "lenet",
        64,
        {**JOBSPEC_CURVATURE, "factor_update_steps": 10, "inv_update_steps": 100},
    ),
}


@contextlib.contextmanager
def annotated_phases() -> Iterator[None]:
    """K-FAC's phase timer also marks each phase in the profiler's trace (for this run only:
    the library's timer stays a plain clock)."""
    from kaisa_ray import timing

    original = timing.PhaseTimes.phase

    @contextlib.contextmanager
    def phase(self: timing.PhaseTimes, name: str) -> Iterator[None]:
        with torch.profiler.record_function(PHASE_PREFIX + name), original(self, name):
            yield

    timing.PhaseTimes.phase = phase  # type: ignore[method-assign]
    try:
        yield
    finally:
        timing.PhaseTimes.phase = original  # type: ignore[method-assign]


def _within(event: dict[str, Any], outer: dict[str, Any]) -> bool:
    start, end = event["ts"], event["ts"] + event.get("dur", 0)
    return bool(outer["ts"] <= start and end <= outer["ts"] + outer["dur"])


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        busy += end - max(start, reach)
        reach = end
    return busy / 1000


def analyse(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per profiled step (its ``step:`` annotation): host ms per phase ('other' is
    the step outside K-FAC's phases), and per phase the launches, the device ms of the
    kernels launched there, the host ms spent waiting; the step's device busy and idle ms."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    annotations = [e for e in events if e.get("cat") == "user_annotation"]
    steps = [e for e in annotations if e["name"].startswith(STEP_PREFIX)]
    phases = [e for e in annotations if e["name"].startswith(PHASE_PREFIX)]
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES]
    cpu_ops = [e for e in events if e.get("cat") == "cpu_op"]
    by_correlation = {e.get("args", {}).get("correlation"): e for e in device}
    rows = []
    for step in steps:
        inside = [p for p in phases if _within(p, step)]
        buckets: dict[str, dict[str, float]] = {}

        def bucket_of(event: dict[str, Any], inside: list[dict[str, Any]] = inside) -> str:
            for p in inside:
                if _within(event, p):
                    return str(p["name"][len(PHASE_PREFIX) :])
            return "other"

        for p in inside:
            name = p["name"][len(PHASE_PREFIX) :]
            buckets.setdefault(name, _empty())["host_ms"] += p["dur"] / 1000
        other = buckets.setdefault("other", _empty())
        other["host_ms"] += step["dur"] / 1000 - sum(
            b["host_ms"] for n, b in buckets.items() if n != "other"
        )
        kernels = []
        for e in runtime:
            if not _within(e, step):
                continue
            b = buckets.setdefault(bucket_of(e), _empty())
            name = e["name"]
            if name.startswith(LAUNCHES) or name.startswith(COPIES):
                b["launches"] += 1
                done = by_correlation.get(e.get("args", {}).get("correlation"))
                if done is not None:
                    b["device_ms"] += done.get("dur", 0) / 1000
                    kernels.append((done["ts"], done["ts"] + done.get("dur", 0)))
            if name.startswith(WAITS) or (name == "cudaMemcpyAsync" and e.get("dur", 0) > 50):
                b["wait_ms"] += e.get("dur", 0) / 1000
        reach = float("-inf")  # operations called from Python: those inside no other
        for e in sorted(
            (e for e in cpu_ops if _within(e, step)), key=lambda e: (e["ts"], -e["dur"])
        ):
            if e["ts"] >= reach:
                buckets.setdefault(bucket_of(e), _empty())["ops"] += 1
                reach = e["ts"] + e["dur"]
        busy = _union_ms(kernels)
        span = (max(k[1] for k in kernels) - min(k[0] for k in kernels)) / 1000 if kernels else 0
        rows.append(
            {
                "step": step["name"][len(STEP_PREFIX) :],
                "host_ms": step["dur"] / 1000,
                "device_busy_ms": busy,
                "device_span_ms": span,
                "device_idle_ms": span - busy,
                "phases": buckets,
            }
        )
    return rows


def _empty() -> dict[str, float]:
    return {"host_ms": 0.0, "launches": 0, "ops": 0, "device_ms": 0.0, "wait_ms": 0.0}


def profile(
    label: str, device: torch.device, period: int, traces: Path | None, repeats: int
) -> list[dict[str, Any]]:
    """Warm ``label`` up past its first decomposition period, then profile ``repeats`` steps
    of each kind (quiet, factors; one decomposition step; 'plain' without K-FAC), each in its
    own trace; one row per kind, the medians of its samples (the first sample's trace kept)."""
    workload, batch, kfac = CONFIGS[label]
    trainee = Trainee(workload, batch, kfac, device, "bf16" if " bf16 " in label else "fp32")
    wanted = {"plain": repeats} if kfac is None else {"quiet": repeats, "factors": repeats}
    if kfac is not None:
        wanted["decomposition"] = 1
    samples: dict[str, list[dict[str, Any]]] = {kind: [] for kind in wanted}
    for number in range((repeats + 2) * period):
        # the kind of the next step, known before it runs only from the preconditioner
        p = trainee.preconditioner
        if p is None:
            kind = "plain"
        else:
            decompose = bool(p.schedule.decomposition_layers(p.steps))
            kind = "decomposition" if decompose else "factors" if p._factor_now else "quiet"
        if number < period + 2 or len(samples.get(kind, [None] * repeats)) >= wanted.get(kind, 0):
            trainee.step()
            continue
        if device.type == "cuda":
            torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            with torch.profiler.record_function(STEP_PREFIX + kind):
                got = trainee.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
        assert got == kind, (got, kind)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(path))
            text = path.read_text()
        if traces is not None and not samples[kind]:
            traces.mkdir(parents=True, exist_ok=True)
            name = f"{label.replace(' ', '_').replace('/', '-')}_{kind}.json.gz"
            with gzip.open(traces / name, "wt") as f:
                f.write(text)
        samples[kind] += analyse(json.loads(text))
        if all(len(samples[k]) >= n for k, n in wanted.items()):
            break
    return [{"config": label, **median_row(found)} for found in samples.values() if found]


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each figure over samples of one kind of step (a phase a sample lacks
    counts as zero there)."""
    out: dict[str, Any] = {"step": rows[0]["step"], "samples": len(rows)}
    for key in ("host_ms", "device_busy_ms", "device_span_ms", "device_idle_ms"):
        out[key] = statistics.median(row[key] for row in rows)
    names = {name for row in rows for name in row["phases"]}
    out["phases"] = {
        name: {
            field: statistics.median(row["phases"].get(name, _empty())[field] for row in rows)
            for field in _empty()
        }
        for name in names
    }
    return out


COLUMNS = [
    "configuration",
    "step",
    "host ms",
    "device busy ms",
    "device idle ms",
    "phase",
    "phase host ms",
    "ops",
    "launches",
    "kernels ms",
    "waits ms",
]


def render(rows: list[dict[str, Any]]) -> list[list[str]]:
    out = []
    for row in rows:
        first = True
        for name, b in sorted(row["phases"].items(), key=lambda kv: -kv[1]["host_ms"]):
            lead = (
                [
                    row["config"],
                    row["step"],
                    f"{row['host_ms']:.2f}",
                    f"{row['device_busy_ms']:.2f}",
                    f"{row['device_idle_ms']:.2f}",
                ]
                if first
                else ["", "", "", "", ""]
            )
            first = False
            out.append(
                [
                    *lead,
                    name,
                    f"{b['host_ms']:.2f}",
                    str(int(b["ops"])),
                    str(int(b["launches"])),
                    f"{b['device_ms']:.2f}",
                    f"{b['wait_ms']:.2f}",
                ]
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--only", nargs="*", default=None, help="configurations (substrings)")
    parser.add_argument("--period", type=int, default=100, help="the decomposition interval")
    parser.add_argument("--repeats", type=int, default=5, help="samples of each kind of step")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--traces", type=Path, default=None)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--from-json", type=Path, default=None)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    if args.from_json is not None:
        result = json.loads(args.from_json.read_text())
    else:
        device = torch.device(args.device)
        labels = [
            label
            for label in CONFIGS
            if args.only is None or any(part in label for part in args.only)
        ]
        rows: list[dict[str, Any]] = []
        with annotated_phases():
            for label in labels:
                rows += profile(label, device, args.period, args.traces, args.repeats)
                print(table(label, COLUMNS, render(rows[-3:])), flush=True)
        result = {
            "date": datetime.date.today().isoformat(),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "CPU",
            "machine": machine(),
            "commit": args.commit or git_commit(),
            "torch": torch.__version__,
            "rows": rows,
        }
        if args.json is not None:
            args.json.write_text(json.dumps(result, indent=1))
    header = (
        f"{result['date']}, {result['device']}, {result['machine']}, torch "
        f"{result['torch']}, commit {result['commit']}; medians of profiled steps of each "
        f"kind (samples: {', '.join(sorted({str(r.get('samples', 1)) for r in result['rows']}))})."
    )
    text = table(header, COLUMNS, render(result["rows"]))
    print(text)
    if args.write:
        RESULTS.write_text(json.dumps(result, indent=1) + "\n")
        write_block("gpu-trace", text)


if __name__ == "__main__":
    main()
