"""Fashion-MNIST from IDX files on disk, and a synthetic stand-in of the same shapes.

The loader never downloads anything. By default it reads the files that Debian's
``dataset-fashion-mnist`` package installs in :data:`DEFAULT_FASHION_MNIST_DIR`; any other
directory holding the four IDX files (gzipped or not) can be passed as ``data_dir``.
"""

from __future__ import annotations

import gzip
import logging
import math
import struct
import zlib
from pathlib import Path
from typing import Literal

import torch

from kaisa_ray.errors import KaisaRayError
from kaisa_train.data_dirs import DEFAULT_FASHION_MNIST_DIR

__all__ = [
    "DEFAULT_FASHION_MNIST_DIR",
    "DatasetNotFoundError",
    "IDXFormatError",
    "load_idx_dataset",
    "read_idx",
    "synthetic_dataset",
    "train_pixel_stats",
]

logger = logging.getLogger(__name__)

_FIX = (
    "apt-get install dataset-fashion-mnist, or pass data_dir= a directory holding the four "
    "IDX files"
)

# IDX type codes: code -> (torch dtype, bytes per element). Data is stored big-endian.
_IDX_DTYPES: dict[int, tuple[torch.dtype, int]] = {
    0x08: (torch.uint8, 1),
    0x09: (torch.int8, 1),
    0x0B: (torch.int16, 2),
    0x0C: (torch.int32, 4),
    0x0D: (torch.float32, 4),
    0x0E: (torch.float64, 8),
}

_PREFIXES: dict[str, str] = {"train": "train", "test": "t10k"}

Split = Literal["train", "test"]


class DatasetNotFoundError(KaisaRayError, FileNotFoundError):
    """The data directory, or one of the IDX files in it, does not exist."""


class IDXFormatError(KaisaRayError, ValueError):
    """An IDX file is corrupt, truncated, or does not hold what the loader expects."""


def _decode(path: Path, raw: bytes) -> torch.Tensor:
    """Parses the bytes of one (already decompressed) IDX file into a tensor."""
    if len(raw) < 4:
        raise IDXFormatError(f"{path}: file too short for an IDX header; {_FIX}")
    zero, code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or code not in _IDX_DTYPES or ndim == 0:
        raise IDXFormatError(
            f"{path}: bad IDX magic number 0x{raw[:4].hex()} (want 0x0000 then a type code "
            f"in {sorted(_IDX_DTYPES)} and at least one dimension); {_FIX}"
        )
    header_len = 4 + 4 * ndim
    if len(raw) < header_len:
        raise IDXFormatError(f"{path}: truncated IDX header ({ndim} dimensions); {_FIX}")
    dims = struct.unpack(f">{ndim}I", raw[4:header_len])
    dtype, itemsize = _IDX_DTYPES[code]
    expected = math.prod(dims) * itemsize
    payload = len(raw) - header_len
    if payload != expected:
        raise IDXFormatError(
            f"{path}: header declares dimensions {list(dims)} ({expected} bytes of data) "
            f"but the file holds {payload}; {_FIX}"
        )
    data = torch.frombuffer(bytearray(raw[header_len:]), dtype=torch.uint8)
    if itemsize > 1:
        # Big-endian on disk: reverse each element's bytes before reinterpreting them.
        data = data.view(-1, itemsize).flip(1).contiguous().view(dtype)
    elif dtype != torch.uint8:
        data = data.view(dtype)
    return data.reshape(dims)


def read_idx(path: str | Path) -> torch.Tensor:
    """Reads one IDX file, gzipped (``.gz``) or not.

    Args:
        path: The file to read.

    Returns:
        A tensor with the file's dtype and dimensions.

    Raises:
        DatasetNotFoundError: If the file does not exist.
        IDXFormatError: If the file is not a valid IDX file.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetNotFoundError(f"IDX file {path} not found; {_FIX}")
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as fh:
                raw = fh.read()
        else:
            raw = path.read_bytes()
    except (gzip.BadGzipFile, EOFError, zlib.error) as err:
        raise IDXFormatError(f"{path}: corrupt gzip stream ({err}); {_FIX}") from err
    return _decode(path, raw)


def _find_file(data_dir: Path, split: Split, kind: Literal["images", "labels"]) -> Path:
    """Returns the path of the images or labels file of a split, gzipped or not."""
    ndim = 3 if kind == "images" else 1
    stem = f"{_PREFIXES[split]}-{kind}"
    names = [f"{stem}-idx{ndim}-ubyte", f"{stem}.idx{ndim}-ubyte"]
    candidates = [data_dir / f"{name}{ext}" for name in names for ext in (".gz", "")]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise DatasetNotFoundError(
        f"no {split} {kind} file in {data_dir} (looked for {candidates[0].name} or "
        f"{candidates[1].name}); {_FIX}"
    )


def _check_images(path: Path, images: torch.Tensor) -> None:
    if images.dtype != torch.uint8 or images.dim() != 3:
        raise IDXFormatError(
            f"{path}: expected unsigned-byte images of shape (N, rows, cols), got "
            f"{images.dtype} with shape {tuple(images.shape)}; {_FIX}"
        )


def _read_pair(data_dir: Path, split: Split) -> tuple[torch.Tensor, torch.Tensor]:
    """Reads and cross-checks the raw uint8 images and integer labels of one split."""
    image_path = _find_file(data_dir, split, "images")
    label_path = _find_file(data_dir, split, "labels")
    images = read_idx(image_path)
    _check_images(image_path, images)
    labels = read_idx(label_path)
    if labels.dim() != 1 or labels.is_floating_point():
        raise IDXFormatError(
            f"{label_path}: expected a 1-d integer label vector, got {labels.dtype} with "
            f"shape {tuple(labels.shape)}; {_FIX}"
        )
    if labels.shape[0] != images.shape[0]:
        raise IDXFormatError(
            f"{label_path} holds {labels.shape[0]} labels but {image_path} holds "
            f"{images.shape[0]} images; {_FIX}"
        )
    return images, labels.to(torch.int64)


# The training split's pixel statistics by (path, modification time, size): loading the test
# split after the training split (or again) does not read the training images again.
_PIXEL_STATS: dict[tuple[Path, int, int], tuple[float, float]] = {}


def _stats_key(image_path: Path) -> tuple[Path, int, int]:
    stat = image_path.stat()
    return image_path.resolve(), stat.st_mtime_ns, stat.st_size


def _pixel_stats(images: torch.Tensor) -> tuple[float, float]:
    """Mean and standard deviation of uint8 pixels scaled to [0, 1]: exact in float64 from a
    256-bin histogram, without a float copy of every pixel."""
    counts = torch.bincount(images.reshape(-1), minlength=256).to(torch.float64)
    values = torch.arange(256, dtype=torch.float64) / 255.0
    total = counts.sum()
    mean = (counts * values).sum() / total
    var = (counts * (values - mean) ** 2).sum() / total
    return float(mean), float(var.sqrt())


def train_pixel_stats(data_dir: str | Path | None = None) -> tuple[float, float]:
    """Mean and standard deviation of the training split's pixels, scaled to [0, 1].

    Args:
        data_dir: Directory holding the IDX files; defaults to
            :data:`DEFAULT_FASHION_MNIST_DIR`.

    Returns:
        ``(mean, std)``; about ``(0.2860, 0.3530)`` for Fashion-MNIST.
    """
    return _train_stats(_resolve_dir(data_dir))


def _train_stats(directory: Path, train_images: torch.Tensor | None = None) -> tuple[float, float]:
    """``train_pixel_stats`` of ``directory``, from ``train_images`` (the training split just
    read) where they are given and nothing is cached yet, else read from the file once."""
    path = _find_file(directory, "train", "images")
    key = _stats_key(path)
    if key not in _PIXEL_STATS:
        if train_images is None:
            train_images = read_idx(path)
            _check_images(path, train_images)
        _PIXEL_STATS[key] = _pixel_stats(train_images)
    return _PIXEL_STATS[key]


def _resolve_dir(data_dir: str | Path | None) -> Path:
    directory = DEFAULT_FASHION_MNIST_DIR if data_dir is None else Path(data_dir)
    if not directory.is_dir():
        raise DatasetNotFoundError(f"data directory {directory} not found; {_FIX}")
    return directory


def load_idx_dataset(
    data_dir: str | Path | None = None,
    split: Split = "train",
    *,
    limit: int | None = None,
    standardize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loads one split of an MNIST-style IDX dataset (Fashion-MNIST by default).

    Accepts ``train-images-idx3-ubyte`` / ``train-labels-idx1-ubyte`` and the ``t10k-*``
    names for the test split, each either gzipped (``.gz``) or not. Nothing is downloaded.

    Args:
        data_dir: Directory holding the four IDX files; defaults to
            :data:`DEFAULT_FASHION_MNIST_DIR`, where ``apt-get install
            dataset-fashion-mnist`` puts them.
        split: ``"train"`` or ``"test"``.
        limit: If given, keep only the first ``limit`` samples.
        standardize: Scale pixels to [0, 1], then standardise them with the mean and
            standard deviation of the whole *training* split (also for the test split). If
            False, pixels are only scaled to [0, 1].

    Returns:
        ``(images, labels)``: float32 images of shape ``(N, 1, rows, cols)`` and int64
        labels of shape ``(N,)``.

    Raises:
        DatasetNotFoundError: If the directory or one of the needed files is missing.
        IDXFormatError: If a file is corrupt, or the images and labels do not match.
        ValueError: If ``split`` or ``limit`` is invalid.
    """
    if split not in _PREFIXES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be non-negative, got {limit}")
    directory = _resolve_dir(data_dir)
    images, labels = _read_pair(directory, split)
    # the training split's statistics: of the images just read, where they are that split
    stats = _train_stats(directory, images if split == "train" else None) if standardize else None
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    out = images.unsqueeze(1).to(torch.float32).div_(255.0)
    if stats is not None:
        mean, std = stats
        out.sub_(mean).div_(std)
    logger.debug("loaded %s split from %s: %d samples", split, directory, out.shape[0])
    return out, labels


def synthetic_dataset(
    n: int, seed: int = 0, *, num_classes: int = 10
) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable stand-in for Fashion-MNIST with the same shapes and dtypes, for smoke tests.

    Each class has a fixed random 28×28 template; a sample is its class's template plus
    Gaussian noise, standardised to roughly zero mean and unit variance.

    Args:
        n: Number of samples.
        seed: Seed of the generator; the same seed gives the same data.
        num_classes: Number of classes.

    Returns:
        ``(images, labels)``: float32 ``(n, 1, 28, 28)`` and int64 ``(n,)`` in
        ``[0, num_classes)``.
    """
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be positive, got {num_classes}")
    gen = torch.Generator().manual_seed(seed)
    templates = torch.randn(num_classes, 1, 28, 28, generator=gen)
    labels = torch.randint(0, num_classes, (n,), generator=gen, dtype=torch.int64)
    noise = torch.randn(n, 1, 28, 28, generator=gen)
    images = (templates[labels] + noise) / math.sqrt(2.0)
    return images, labels
