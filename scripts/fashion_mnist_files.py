"""Write Debian's Fashion-MNIST (the IDX files, no download) as the files a user streams:
an image folder of PNGs and Parquet files, each with a ``train`` and a ``test`` split.

    .venv/bin/python scripts/fashion_mnist_files.py --out /tmp/fashion-mnist-files

writes ``OUT/png/{train,test}/<class>/<index>.png`` (one folder per class, named
``0-t-shirt`` ... ``9-ankle-boot`` so that their sorted order is the label order) and
``OUT/parquet/{train,test}/part-NNNN.parquet`` (columns ``image``, the PNG's bytes; ``pixels``,
the 784 raw bytes; ``label``). ``--copies N`` writes the training split N times over (the
images renamed per copy), for measuring memory against dataset size. Existing files are
kept; a folder is written only when missing.
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from kaisa_train.datasets import DEFAULT_FASHION_MNIST_DIR, load_idx_dataset

CLASSES = (
    "0-t-shirt",
    "1-trouser",
    "2-pullover",
    "3-dress",
    "4-coat",
    "5-sandal",
    "6-shirt",
    "7-sneaker",
    "8-bag",
    "9-ankle-boot",
)
ROWS_PER_FILE = 10_000


def _png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels, mode="L").save(out, format="PNG")
    return out.getvalue()


def _split(data_dir: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """The split's raw uint8 images (n, 28, 28) and labels: the IDX loader's, unnormalised."""
    images, labels = load_idx_dataset(data_dir, split, standardize=False)  # k / 255, exactly
    return (images.squeeze(1) * 255).round().numpy().astype(np.uint8), labels.numpy()


def write_png(out: Path, split: str, images: np.ndarray, labels: np.ndarray, copies: int) -> None:
    root = out / "png" / split
    if root.exists():
        print(f"{root}: there already, kept")
        return
    for name in CLASSES:
        (root / name).mkdir(parents=True)
    for i, (pixels, label) in enumerate(zip(images, labels, strict=True)):
        encoded = _png(pixels)
        for copy in range(copies):
            (root / CLASSES[label] / f"{copy:02d}-{i:05d}.png").write_bytes(encoded)
    print(f"{root}: {copies * len(labels)} images")


def write_parquet(
    out: Path, split: str, images: np.ndarray, labels: np.ndarray, copies: int
) -> None:
    root = out / "parquet" / split
    if root.exists():
        print(f"{root}: there already, kept")
        return
    root.mkdir(parents=True)
    tables = []
    for start in range(0, len(labels), ROWS_PER_FILE):
        chunk = slice(start, start + ROWS_PER_FILE)
        tables.append(
            pa.table(
                {
                    "image": pa.array([_png(p) for p in images[chunk]], type=pa.binary()),
                    "pixels": pa.array(
                        [p.reshape(-1) for p in images[chunk]], type=pa.list_(pa.uint8())
                    ),
                    "label": pa.array(labels[chunk], type=pa.int64()),
                }
            )
        )
    part = 0
    for _ in range(copies):
        for table in tables:
            pq.write_table(table, root / f"part-{part:04d}.parquet")
            part += 1
    print(f"{root}: {copies * len(labels)} rows in {part} files")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_FASHION_MNIST_DIR)
    parser.add_argument(
        "--format", nargs="+", choices=["png", "parquet"], default=["png", "parquet"]
    )
    parser.add_argument("--copies", type=int, default=1, help="the training split, N times over")
    parser.add_argument("--limit", type=int, default=None, help="the first N images per split")
    args = parser.parse_args()
    for split in ("train", "test"):
        images, labels = _split(args.data_dir, split)
        if args.limit is not None:
            images, labels = images[: args.limit], labels[: args.limit]
        copies = args.copies if split == "train" else 1
        if "png" in args.format:
            write_png(args.out, split, images, labels, copies)
        if "parquet" in args.format:
            write_parquet(args.out, split, images, labels, copies)


if __name__ == "__main__":
    main()
