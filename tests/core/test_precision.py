"""Mixed precision without a GPU: autocast to bf16/fp16 on the CPU, the GradScaler's scale
kept out of K-FAC's factors, and the train loop's precision setting (Ray Train's in-process
local mode, so no workers start)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import ray.train
import torch
import torch.nn.functional as F
from ray.train.torch import TorchTrainer
from support.ray_head import RayHead
from torch import nn

from kaisa_ray import KFACPreconditioner
from kaisa_ray.amp import MixedPrecision, Precision, optimizer_step
from kaisa_ray.errors import ConfigurationError
from kaisa_train.datasets import DEFAULT_FASHION_MNIST_DIR
from kaisa_train.progress import read_progress
from kaisa_train.spec import parse_job_spec
from kaisa_train.worker import train_worker
from kaisa_train.worker_config import TrainConfig


def test_modes_and_their_scalers() -> None:
    fp32 = MixedPrecision()
    assert fp32.precision is Precision.FP32
    assert not fp32.enabled
    assert not fp32.grad_scaler().is_enabled()
    bf16 = MixedPrecision(mode="bf16", device_type="cpu")
    assert bf16.dtype is torch.bfloat16
    assert not bf16.grad_scaler().is_enabled()  # bf16 has float32's range: no scaling
    fp16 = MixedPrecision(mode=Precision.FP16, device_type="cpu")
    assert fp16.grad_scaler().is_enabled()
    with fp16.autocast():
        out = nn.Linear(4, 2)(torch.randn(3, 4))
    assert out.dtype is torch.float16


def test_an_unknown_mode_is_refused_with_the_choices() -> None:
    with pytest.raises(ConfigurationError, match=r"precision='fp8'.*'fp32', 'bf16', 'fp16'"):
        MixedPrecision(mode="fp8")
    with pytest.raises(ConfigurationError, match="autocast"):
        MixedPrecision(mode="bf16", device_type="no-such-device")


def _factors(mode: str, scale: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A and G after one K-FAC step in ``mode`` with a GradScaler starting at ``scale``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    precision = MixedPrecision(mode=mode)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale, enabled=mode == "fp16")
    preconditioner = KFACPreconditioner(model, grad_scaler=scaler, damping=0.1, kl_clip=None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    with precision.autocast():
        loss = F.cross_entropy(model(x), y)
    optimizer_step(loss, optimizer, preconditioner, scaler)
    a = [layer.a_factor.clone() for layer in preconditioner.layers if layer.a_factor is not None]
    g = [layer.g_factor.clone() for layer in preconditioner.layers if layer.g_factor is not None]
    return a, g


def test_fp16_factors_are_unscaled_and_match_fp32() -> None:
    a32, g32 = _factors("fp32", 1.0)
    a16, g16 = _factors("fp16", 2.0**12)
    assert len(g16) == len(g32) == 2
    for ours, reference in zip(a16 + g16, a32 + g32, strict=True):
        assert ours.dtype == torch.float32  # factors are kept in at least float32
        # Without unscaling G would be 2^24 times larger; fp16 rounding stays within 2%.
        torch.testing.assert_close(ours, reference, rtol=2e-2, atol=1e-4)


def test_an_overflowing_fp16_step_is_skipped_by_the_scaler_and_k_fac_alike() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    before = model.weight.detach().clone()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    preconditioner = KFACPreconditioner(model, grad_scaler=scaler, kl_clip=None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with MixedPrecision(mode="fp16").autocast():
        loss = model(torch.ones(4, 8)).float().sum() * 1e4  # its fp16 gradients overflow
    optimizer_step(loss, optimizer, preconditioner, scaler)
    assert torch.equal(model.weight, before)  # the step was skipped
    assert scaler.get_scale() < 2.0**16  # and the scale lowered
    assert preconditioner.skipped_steps == 1


# -- the train loop, in Ray Train's local mode -------------------------------------------


def _fit(ray_head: RayHead, tmp_path: Any, **overrides: Any) -> tuple[list[dict[str, Any]], Any]:
    spec: dict[str, Any] = {
        "name": "amp",
        "model": {"name": "mlp"},
        "dataset": {"name": "fashion-mnist", "batch_size": 64, "limit": 2048},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "kfac": {"strategy": "comm-opt", "factor_update_steps": 1, "inv_update_steps": 10},
        "stop": {"max_steps": 40},
        "eval_every": 40,
        "seed": 1,
    }
    spec.update(overrides)
    run = f"amp-{time.time_ns()}"
    trainer = TorchTrainer(
        train_worker,
        train_loop_config={"worker": TrainConfig(spec=parse_job_spec(spec), run=run)},
        scaling_config=ray.train.ScalingConfig(num_workers=0),  # in this process
        run_config=ray.train.RunConfig(name=run, storage_path=str(tmp_path)),
    )
    result = trainer.fit()
    # Rank 0 waits for its end record to reach the sink: the run's records are all there.
    records: list[dict[str, Any]] = read_progress(run)["records"]
    assert records[-1]["kind"] == "end", records
    return records, result


needs_data = pytest.mark.skipif(
    not DEFAULT_FASHION_MNIST_DIR.is_dir(), reason="needs Debian's dataset-fashion-mnist"
)


@pytest.fixture(scope="module")
def fp32_losses(ray_head: RayHead, tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    records, _ = _fit(ray_head, tmp_path_factory.mktemp("fp32"))
    return [r["loss"] for r in records if r["kind"] == "step"]


@needs_data
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_mixed_precision_job_trains_like_fp32(
    ray_head: RayHead, tmp_path: Any, precision: str, fp32_losses: list[float]
) -> None:
    records, result = _fit(ray_head, tmp_path, precision=precision)
    losses = [r["loss"] for r in records if r["kind"] == "step"]
    expected = fp32_losses
    assert len(losses) == len(expected) == 4
    assert losses[-1] < 0.6 * losses[0]
    assert losses == pytest.approx(expected, rel=0.1)  # the same run up to rounding
    assert result.metrics["test_accuracy"] > 0.6
    assert all(r["kfac_ms_per_step"] > 0 for r in records if r["kind"] == "step")


@needs_data
def test_a_diverging_job_fails_naming_the_step_and_the_fix(
    ray_head: RayHead, tmp_path: Any
) -> None:
    with pytest.raises(
        Exception, match=r"training loss is nan at step \d+.*diverged.*optimizer\.lr"
    ):
        _fit(ray_head, tmp_path, optimizer={"name": "sgd", "lr": 1e4}, kfac="off")
