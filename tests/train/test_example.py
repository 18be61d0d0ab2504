"""Tests for kaisa_train.example.run_example on a tiny IDX data set."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch

from kaisa_train.example import evaluate, run_example
from kaisa_train.models import LeNetCNN


def write_idx(path: Path, tensor: torch.Tensor) -> None:
    dims = tuple(tensor.shape)
    header = struct.pack(f">HBB{len(dims)}I", 0, 0x08, len(dims), *dims)
    path.write_bytes(header + bytes(tensor.reshape(-1).tolist()))


@pytest.fixture
def tiny_data(tmp_path: Path) -> Path:
    gen = torch.Generator().manual_seed(0)
    for prefix, n in (("train", 64), ("t10k", 32)):
        images = torch.randint(0, 256, (n, 28, 28), generator=gen, dtype=torch.uint8)
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte", images)
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte", torch.arange(n) % 10)
    return tmp_path


@pytest.mark.parametrize("kfac", [False, True], ids=["sgd", "kfac"])
def test_history_records(tiny_data: Path, kfac: bool) -> None:
    history = run_example(
        steps=5,
        batch_size=16,
        kfac=kfac,
        factor_update_steps=1,
        inv_update_steps=5,  # one round of decompositions (eigh is most of K-FAC's time here)
        eval_every=2,
        data_dir=tiny_data,
        progress=False,
    )
    assert [record["step"] for record in history] == [2, 4, 5]
    for record in history:
        assert set(record) == {"step", "loss", "test_accuracy", "elapsed_s"}
        assert 0.0 <= record["test_accuracy"] <= 1.0
        assert torch.isfinite(torch.tensor(record["loss"]))
    assert [r["elapsed_s"] for r in history] == sorted(r["elapsed_s"] for r in history)


def test_same_seed_same_history(tiny_data: Path) -> None:
    def losses() -> list[float]:
        history = run_example(
            steps=3, batch_size=16, kfac=False, eval_every=3, data_dir=tiny_data, progress=False
        )
        return [record["loss"] for record in history]

    assert losses() == losses()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps": 0}, "steps must be positive"),
        ({"steps": 1, "damping": 0.0}, "damping must be positive"),
        ({"steps": 1, "kl_clip": -1.0}, "kl_clip must be positive"),
        ({"steps": 1, "momentum": -0.1}, "momentum must be non-negative"),
        ({"steps": 1, "threads": 0}, "threads must be positive"),
    ],
)
def test_invalid_arguments(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        run_example(**kwargs)  # type: ignore[arg-type]


def test_evaluate_counts_matches() -> None:
    model = LeNetCNN()
    images = torch.randn(7, 1, 28, 28)
    predictions = model(images).argmax(dim=1)
    assert evaluate(model, images, predictions, batch_size=3) == 1.0
    assert evaluate(model, images, (predictions + 1) % 10) == 0.0
    assert model.training
