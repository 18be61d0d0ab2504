"""Streamed data against data in memory: the example job from Fashion-MNIST's IDX files (in
each worker's memory) and from the same images as Parquet files and as a PNG folder (streamed
by Ray Data), to 88%; then a training worker's peak memory as the Parquet dataset grows.

    .venv/bin/python benchmarks/streamed_data.py --write

Part one runs ``examples/fashion_mnist.yaml`` (2 Ray Train workers, global batch 128) with its
dataset swapped, the sources interleaved seed by seed (Parquet read from its PNG bytes and
from its raw pixels): steps to 88% test accuracy (on the
whole test split), the mean step (``ms_per_step``, the batch's wait included) and the wait for
the batch (``data_wait_ms``). Part two runs the same job on the Parquet files and on the PNG
folder, each written 1, 4 and 16 times over (``scripts/fashion_mnist_files.py --copies``), for
``--memory-steps`` steps, without a target. Every run samples its training workers' peak
resident memory (``VmHWM`` of each ``RayTrainWorker`` process, read from /proc twice a second)
and reports the larger.

Every job here gives each worker 0.5 CPU (as the streamed examples do), so that Ray Data has
CPUs to read with; the in-memory job gets the same, so the two differ only in their data. The
files are written under ``--root`` (default /tmp/kaisa-streamed) when missing.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import ray
import yaml
from report import git_commit, machine, table, write_block
from targets import run_to_target

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
EXAMPLE = ROOT / "examples" / "fashion_mnist.yaml"
# Part two's runs go on for their steps: a target no run meets within them.
UNREACHED = {"metric": "test_accuracy", "value": 0.999}
STATS = {"mean": [0.2860], "std": [0.3530]}  # Fashion-MNIST's training pixels (the IDX loader's)


def write_files(root: Path, copies: int, formats: list[str]) -> Path:
    out = root / f"x{copies}"
    missing = [f for f in formats if not (out / ("png" if f == "png" else "parquet")).exists()]
    if missing:
        script = ROOT / "scripts" / "fashion_mnist_files.py"
        command = [sys.executable, str(script), "--out", str(out), "--copies", str(copies)]
        subprocess.run([*command, "--format", *missing], check=True)
    return out


# Each source of part one: its dataset name and the Parquet column read (None: not Parquet).
SOURCES = {
    "in memory (IDX)": (None, None),
    "parquet": ("parquet", "image"),  # PNG bytes, decoded by Ray Data's tasks
    "parquet (pixels)": ("parquet", "pixels"),  # the 784 raw bytes, a list column
    "image folder": ("image-folder", None),
}


def job(source: str, files: Path | None, seed: int) -> dict[str, Any]:
    spec = yaml.safe_load(EXAMPLE.read_text())
    spec["seed"] = seed
    spec["scaling"]["cpus_per_worker"] = 0.5
    spec["checkpoint"] = {"every_steps": 100_000, "keep": 1}
    batch = spec["dataset"]["batch_size"]
    name, column = SOURCES[source]
    if name is not None:
        assert files is not None
        folder = files / ("parquet" if name == "parquet" else "png")
        spec["dataset"] = {
            "name": name,
            "train": str(folder / "train"),
            "validation": str(folder / "test"),
            "image": STATS,
            "batch_size": batch,
        }
        if column is not None:
            spec["dataset"]["columns"] = {"input": column, "label": "label"}
        if column == "pixels":  # a flat list of numbers: the image's shape is the spec's
            spec["dataset"]["image"] = {**STATS, "size": [28, 28]}
    return spec


class PeakMemory:
    """The largest ``VmHWM`` of any ``RayTrainWorker`` process while it runs (bytes)."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._stop.is_set():
            for pid in os.listdir("/proc"):
                if not pid.isdigit():
                    continue
                try:
                    if b"RayTrainWorker" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                        continue
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                        if line.startswith("VmHWM:"):
                            self.peak = max(self.peak, int(line.split()[1]) * 1024)
                except OSError:
                    continue  # gone meanwhile
            self._stop.wait(0.5)


def measure(name: str, spec: dict[str, Any], storage: Path) -> dict[str, Any]:
    with PeakMemory() as memory:
        run = run_to_target(name, spec, storage)
    result = {
        "source": name,
        "seed": spec["seed"],
        "steps": run.steps,
        "ms_per_step": run.ms_per_step,
        "data_wait_ms": run.data_wait_ms,
        "steady_ms_per_step": run.steady_ms_per_step,
        "steady_data_wait_ms": run.steady_data_wait_ms,
        "train_s": run.train_s,
        "peak_rss_mib": memory.peak / 2**20,
        "failure": run.failure,
    }
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("/tmp/kaisa-streamed"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--copies", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--memory-steps", type=int, default=150)
    parser.add_argument(
        "--sources",
        nargs="+",
        choices=list(SOURCES),
        default=["in memory (IDX)", "parquet", "image folder"],
        help="part one's (parquet (pixels): the raw-pixel column, no decoding)",
    )
    parser.add_argument("--skip-target", action="store_true", help="part two only")
    parser.add_argument("--write", action="store_true", help="store the tables")
    parser.add_argument("--out", type=Path, default=RESULTS / "streamed_data.json")
    parser.add_argument("--report", action="store_true", help="run nothing: the tables from --out")
    args = parser.parse_args()
    if args.report:
        stored = json.loads(args.out.read_text())
        text = report(stored["results"], stored["meta"])
        print(text)
        if args.write:
            write_block("streamed-data", text)
        return
    started = datetime.datetime.now(datetime.UTC)
    files = {c: write_files(args.root, c, ["png", "parquet"]) for c in args.copies}
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kaisa-streamed-") as storage:
        if not args.skip_target:
            for seed in args.seeds:
                for source in args.sources:
                    spec = job(source, files.get(1), seed)
                    results.append({"part": "target", **measure(source, spec, Path(storage))})
        for source, copies in itertools.product(("parquet", "image folder"), args.copies):
            spec = job(source, files[copies], 0)
            spec["stop"] = {"max_steps": args.memory_steps, "target": UNREACHED}
            spec["eval_every"] = args.memory_steps
            entry = measure(f"{source} x{copies}", spec, Path(storage))
            results.append({"part": "memory", "copies": copies, **entry})
        spec = job("in memory (IDX)", None, 0)
        spec["stop"] = {"max_steps": args.memory_steps, "target": UNREACHED}
        spec["eval_every"] = args.memory_steps
        results.append(
            {"part": "memory", "copies": 1, **measure("in memory x1", spec, Path(storage))}
        )
    ray.shutdown()
    meta = {"commit": git_commit(), "machine": machine(), "started": started.isoformat()}
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    text = report(results, meta)
    print(text)
    if args.write:
        write_block("streamed-data", text)


def _mean(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.mean(values) if values else None


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def report(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    header = (
        f"Measured {meta['started'][:10]} at commit {meta['commit']} on {meta['machine']}; "
        "2 Ray Train workers x 0.5 CPU, global batch 128, the example job's K-FAC. ms/step "
        "(all): every step, the pipeline's start in the first; (steady): after the first 10 "
        "steps."
    )
    rows = []
    target = [r for r in results if r["part"] == "target"]
    base = _mean([r for r in target if r["source"].startswith("in memory")], "steady_ms_per_step")
    for source in dict.fromkeys(r["source"] for r in target):
        runs = [r for r in target if r["source"] == source]
        steps = [r["steps"] for r in runs]
        reached = [s for s in steps if s is not None]
        seconds = [r["train_s"] for r in runs if r.get("train_s") is not None]
        steady = _mean(runs, "steady_ms_per_step")
        rows.append(
            [
                source,
                " / ".join("-" if s is None else str(s) for s in steps),
                f"{statistics.median(reached):.0f}" if reached else "-",
                f"{statistics.median(seconds):.1f}" if seconds else "-",
                _fmt(_mean(runs, "ms_per_step")),
                _fmt(steady),
                f"{base / steady:.2f}x" if base and steady else "-",
                _fmt(_mean(runs, "steady_data_wait_ms"), 2),
                f"{max(r['peak_rss_mib'] for r in runs):.0f}",
            ]
        )
    first = table(
        header,
        [
            "source",
            "steps to 88% per seed",
            "median",
            "train s to 88% (median)",
            "ms/step (all)",
            "ms/step (steady)",
            "steady steps/s ÷ in memory's",
            "data wait ms/step (steady)",
            "worker peak RSS (MiB)",
        ],
        rows,
    )
    memory = [r for r in results if r["part"] == "memory"]
    rows = [
        [
            r["source"],
            str(r["copies"]),
            f"{r['peak_rss_mib']:.0f}",
            _fmt(r["ms_per_step"]),
            _fmt(r.get("steady_ms_per_step")),
        ]
        for r in memory
    ]
    second = table(
        "A training worker's peak resident memory against the dataset's size (the same job, "
        "a fixed number of steps).",
        [
            "source",
            "copies of the training split",
            "worker peak RSS (MiB)",
            "ms/step (all)",
            "ms/step (steady)",
        ],
        rows,
    )
    return first + "\n\n" + second


if __name__ == "__main__":
    main()
