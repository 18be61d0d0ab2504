"""Tests for kaisa_train.datasets: IDX parsing, standardisation, limits and errors."""

from __future__ import annotations

import gzip
import re
import struct
from pathlib import Path

import pytest
import torch

from kaisa_train.datasets import (
    DEFAULT_FASHION_MNIST_DIR,
    DatasetNotFoundError,
    IDXFormatError,
    load_idx_dataset,
    read_idx,
    synthetic_dataset,
)

FIX = "apt-get install dataset-fashion-mnist, or pass data_dir="
NAMES = {
    ("train", "images"): "train-images-idx3-ubyte",
    ("train", "labels"): "train-labels-idx1-ubyte",
    ("test", "images"): "t10k-images-idx3-ubyte",
    ("test", "labels"): "t10k-labels-idx1-ubyte",
}


def idx_bytes(data: bytes, dims: tuple[int, ...], code: int = 0x08) -> bytes:
    """An IDX file: magic (0, 0, type code, ndim), big-endian dims, then the data."""
    return struct.pack(f">HBB{len(dims)}I", 0, code, len(dims), *dims) + data


def write(path: Path, content: bytes) -> Path:
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(content))
    else:
        path.write_bytes(content)
    return path


def tensor_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.reshape(-1).tolist())


def images_of(n: int, offset: int = 0) -> torch.Tensor:
    return ((torch.arange(n * 28 * 28) * 7 + offset) % 256).to(torch.uint8).reshape(n, 28, 28)


def make_dataset(root: Path, *, gz: bool, n_train: int = 6, n_test: int = 4) -> Path:
    ext = ".gz" if gz else ""
    for split, n, offset in (("train", n_train, 0), ("test", n_test, 3)):
        imgs = images_of(n, offset)
        labels = bytes(i % 10 for i in range(n))
        write(root / f"{NAMES[split, 'images']}{ext}", idx_bytes(tensor_bytes(imgs), (n, 28, 28)))
        write(root / f"{NAMES[split, 'labels']}{ext}", idx_bytes(labels, (n,)))
    return root


@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gzip"])
def test_parses_images_and_labels(tmp_path: Path, gz: bool) -> None:
    make_dataset(tmp_path, gz=gz)
    images, labels = load_idx_dataset(tmp_path, "test", standardize=False)
    assert images.shape == (4, 1, 28, 28)
    assert images.dtype == torch.float32
    assert labels.dtype == torch.int64
    assert labels.tolist() == [0, 1, 2, 3]
    torch.testing.assert_close(images[:, 0], images_of(4, 3).float() / 255.0)


def test_accepts_dotted_mnist_names(tmp_path: Path) -> None:
    make_dataset(tmp_path, gz=False)
    for path in tmp_path.iterdir():
        path.rename(path.with_name(path.name.replace("-idx", ".idx")))
    images, labels = load_idx_dataset(tmp_path, "test")
    assert images.shape == (4, 1, 28, 28)
    assert labels.shape == (4,)


def test_standardises_both_splits_with_train_stats(tmp_path: Path) -> None:
    make_dataset(tmp_path, gz=True)
    train_raw = images_of(6).double() / 255.0
    mean, std = train_raw.mean(), train_raw.std(correction=0)
    train, _ = load_idx_dataset(tmp_path, "train")
    test, _ = load_idx_dataset(tmp_path, "test")
    assert abs(float(train.mean())) < 1e-5
    assert abs(float(train.std(correction=0)) - 1.0) < 1e-5
    expected = ((images_of(4, 3).double() / 255.0 - mean) / std).float()
    torch.testing.assert_close(test[:, 0], expected)


def test_limit_keeps_the_first_samples(tmp_path: Path) -> None:
    make_dataset(tmp_path, gz=False)
    images, labels = load_idx_dataset(tmp_path, "train", limit=3, standardize=False)
    assert images.shape == (3, 1, 28, 28)
    assert labels.tolist() == [0, 1, 2]
    torch.testing.assert_close(images[:, 0], images_of(6)[:3].float() / 255.0)
    assert load_idx_dataset(tmp_path, "train", limit=100)[0].shape[0] == 6
    with pytest.raises(ValueError, match="limit must be non-negative"):
        load_idx_dataset(tmp_path, "train", limit=-1)


@pytest.mark.parametrize(
    ("code", "dtype", "fmt"),
    [(0x0B, torch.int16, ">3h"), (0x0C, torch.int32, ">3i"), (0x0D, torch.float32, ">3f")],
)
def test_read_idx_multibyte_big_endian(
    tmp_path: Path, code: int, dtype: torch.dtype, fmt: str
) -> None:
    values = [1, -2, 300]
    path = write(tmp_path / "x.idx", idx_bytes(struct.pack(fmt, *values), (3,), code))
    out = read_idx(path)
    assert out.dtype == dtype
    assert out.tolist() == values


def test_missing_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(DatasetNotFoundError, match=re.escape(str(missing))) as info:
        load_idx_dataset(missing, "train")
    assert FIX in str(info.value)
    assert isinstance(info.value, FileNotFoundError)


def test_missing_file(tmp_path: Path) -> None:
    make_dataset(tmp_path, gz=True)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DatasetNotFoundError, match=r"t10k-labels-idx1-ubyte\.gz") as info:
        load_idx_dataset(tmp_path, "test")
    assert str(tmp_path) in str(info.value)
    assert FIX in str(info.value)


def test_test_split_needs_train_images_for_stats(tmp_path: Path) -> None:
    make_dataset(tmp_path, gz=False)
    (tmp_path / "train-images-idx3-ubyte").unlink()
    with pytest.raises(DatasetNotFoundError, match="train images"):
        load_idx_dataset(tmp_path, "test")
    assert load_idx_dataset(tmp_path, "test", standardize=False)[0].shape[0] == 4


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x00\x00", "too short"),
        (struct.pack(">HBBI", 0x1234, 0x08, 1, 3) + b"abc", "bad IDX magic number"),
        (struct.pack(">HBBI", 0, 0x42, 1, 3) + b"abc", "bad IDX magic number"),
        (struct.pack(">HBB", 0, 0x08, 3) + b"\x00\x00\x00\x02", "truncated IDX header"),
        (idx_bytes(b"ab", (3,)), r"dimensions \[3\] \(3 bytes of data\) but the file holds 2"),
        (idx_bytes(b"abcd", (3,)), "but the file holds 4"),
    ],
    ids=["short", "magic", "dtype", "header", "truncated", "trailing"],
)
def test_corrupt_idx(tmp_path: Path, content: bytes, message: str) -> None:
    make_dataset(tmp_path, gz=False)
    path = write(tmp_path / "train-labels-idx1-ubyte", content)
    with pytest.raises(IDXFormatError, match=message) as info:
        load_idx_dataset(tmp_path, "train")
    assert str(path) in str(info.value)
    assert FIX in str(info.value)
    assert isinstance(info.value, ValueError)


def test_corrupt_gzip(tmp_path: Path) -> None:
    make_dataset(tmp_path, gz=True)
    path = tmp_path / "train-labels-idx1-ubyte.gz"
    path.write_bytes(path.read_bytes()[:-12])
    with pytest.raises(IDXFormatError, match="corrupt gzip stream") as info:
        load_idx_dataset(tmp_path, "train")
    assert str(path) in str(info.value)
    path.write_bytes(b"not gzip at all")
    with pytest.raises(IDXFormatError, match=re.escape(str(path))):
        load_idx_dataset(tmp_path, "train")


def test_label_image_count_mismatch(tmp_path: Path) -> None:
    make_dataset(tmp_path, gz=False)
    write(tmp_path / "train-labels-idx1-ubyte", idx_bytes(bytes(5), (5,)))
    with pytest.raises(IDXFormatError, match=r"holds 5 labels but .* holds 6 images") as info:
        load_idx_dataset(tmp_path, "train")
    assert FIX in str(info.value)


def test_images_must_be_three_dimensional_bytes(tmp_path: Path) -> None:
    make_dataset(tmp_path, gz=False)
    write(tmp_path / "train-images-idx3-ubyte", idx_bytes(bytes(6 * 784), (6, 784)))
    with pytest.raises(IDXFormatError, match=r"shape \(N, rows, cols\)"):
        load_idx_dataset(tmp_path, "train")


def test_bad_split(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="split must be"):
        load_idx_dataset(tmp_path, "valid")  # type: ignore[arg-type]


def test_synthetic_dataset() -> None:
    images, labels = synthetic_dataset(32, seed=1)
    assert images.shape == (32, 1, 28, 28)
    assert images.dtype == torch.float32
    assert labels.dtype == torch.int64
    assert int(labels.min()) >= 0
    assert int(labels.max()) < 10
    again = synthetic_dataset(32, seed=1)
    torch.testing.assert_close(images, again[0])
    assert torch.equal(labels, again[1])
    assert not torch.equal(images, synthetic_dataset(32, seed=2)[0])


@pytest.mark.slow
@pytest.mark.skipif(
    not DEFAULT_FASHION_MNIST_DIR.is_dir(), reason="apt-get install dataset-fashion-mnist"
)
def test_real_fashion_mnist_test_split() -> None:
    images, labels = load_idx_dataset(split="test")
    assert images.shape == (10000, 1, 28, 28)
    assert labels.shape == (10000,)
    assert sorted(set(labels.tolist())) == list(range(10))
    assert torch.bincount(labels).tolist() == [1000] * 10
    # Standardised with the training split's statistics: close to, not exactly, N(0, 1).
    assert abs(float(images.mean())) < 0.05
    assert abs(float(images.std()) - 1.0) < 0.05
