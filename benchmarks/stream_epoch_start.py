"""How long each epoch of a streamed training split waits for its first batch: the example
job's Parquet pipeline (``open_stream``, Fashion-MNIST's PNG bytes) through Ray Train's
equal ``streaming_split`` over 2 consumers, each taking batches of 64 with a 4096-row shuffle
window and sleeping 20 ms a batch (a step's worth), 3 epochs, once with the training
pipeline's blocks as ``open_stream`` sets them (``block_bytes``) and once with Ray Data's
default block size, alternating for ``--rounds`` rounds.

    .venv/bin/python benchmarks/stream_epoch_start.py --write

The files come from ``scripts/fashion_mnist_files.py`` (written under ``--root`` when
missing, as ``streamed_data.py`` writes them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from report import git_commit, machine, table, write_block

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("block_bytes", "ray default")


def one_run(root: Path, variant: str) -> list[tuple[float, float]]:
    """(seconds to the first batch, seconds for the epoch) of each epoch, the slower of the
    two consumers; in a Ray of its own."""
    import ray
    from ray.data import DataContext

    from kaisa_train.spec import DatasetSpec
    from kaisa_train.streaming import open_stream

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        spec = DatasetSpec(
            name="parquet",
            train=str(root / "parquet" / "train"),
            validation=str(root / "parquet" / "test"),
            columns={"input": "image", "label": "label"},
            image={"size": [28, 28], "mean": [0.286], "std": [0.353]},
            batch_size=64,
        )
        train = open_stream(spec)[0]["train"]
        if variant == "ray default":
            train.context.target_max_block_size = DataContext().target_max_block_size
        splits = train.streaming_split(2, equal=True)
        epochs: dict[int, list[tuple[float, float]]] = {}

        def consume(index: int) -> None:
            rows = []
            for _ in range(3):
                started, first = time.perf_counter(), None
                for _ in splits[index].iter_torch_batches(
                    batch_size=64, local_shuffle_buffer_size=4096
                ):
                    first = first or time.perf_counter() - started
                    time.sleep(0.02)
                rows.append((first or 0.0, time.perf_counter() - started))
            epochs[index] = rows

        threads = [threading.Thread(target=consume, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return [max(pair) for pair in zip(epochs[0], epochs[1], strict=True)]
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("/tmp/kaisa-streamed/x1"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="store the table")
    parser.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(args.root, args.one)))
        return
    if not (args.root / "parquet").exists():
        script = ROOT / "scripts" / "fashion_mnist_files.py"
        subprocess.run(
            [sys.executable, str(script), "--out", str(args.root), "--format", "parquet"],
            check=True,
        )
    runs: dict[str, list[list[list[float]]]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for variant in VARIANTS:
            done = subprocess.run(
                [sys.executable, __file__, "--root", str(args.root), "--one", variant],
                capture_output=True,
                text=True,
                check=True,
            )
            runs[variant].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(variant, runs[variant][-1], flush=True)
    rows = []
    for variant, results in runs.items():
        first = [r[0][0] for r in results]
        later = [e[0] for r in results for e in r[1:]]
        epoch = [e[1] for r in results for e in r[1:]]
        rows.append(
            [
                variant,
                " / ".join(f"{s:.1f}" for s in first),
                " / ".join(f"{s:.1f}" for s in later),
                f"{statistics.median(later):.1f}",
                f"{statistics.median(epoch):.1f}",
            ]
        )
    text = table(
        f"Measured {time.strftime('%Y-%m-%d')} at commit {git_commit()} on {machine()}; "
        f"{args.rounds} rounds, the variants alternating; each figure the slower consumer's.",
        [
            "training blocks",
            "first epoch: s to first batch",
            "epochs 2-3: s to first batch",
            "median",
            "epochs 2-3: s an epoch (median; 9.4 s of it the consumers' sleep)",
        ],
        rows,
    )
    print(text)
    if args.write:
        write_block("stream-epoch-start", text)


if __name__ == "__main__":
    main()
