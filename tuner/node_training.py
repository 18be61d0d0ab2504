"""What ``tuner.node.measure`` times of a model's training on this node: a model's plain
training step (samples per second, and on a GPU the host's time to issue one step) and the
factor work of one K-FAC factor update of its layers; and the measured number's format that
every entry of the profile uses.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kaisa_ray.enums import KFACApprox, Precision
from tuner.measure import median_seconds, steady_seconds


def measured(value: float, what: str, where: str) -> dict[str, Any]:
    """A measured number in the profile's format: its value, kind and source."""
    return {"value": float(value), "kind": "measured", "source": f"{what}; {where}"}


def model_and_batch(
    build: Callable[[], torch.nn.Module],
    device: torch.device,
    example: Callable[[int], torch.Tensor] | None,
    batch: int,
) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """``build()``'s model on ``device``, a random batch of ``example(batch)``'s shape
    (default: ResNet-50's 224×224 images) and class targets over its last output dimension."""
    torch.manual_seed(0)
    model = build().to(device)
    shape = example(batch) if example is not None else torch.empty(batch, 3, 224, 224)
    if shape.dtype.is_floating_point:
        x = torch.randn(shape.shape, device=device)
    else:  # token ids
        x = torch.randint(0, 2, shape.shape, device=device)
    with torch.no_grad():
        out = model(x)
    y = torch.randint(0, out.shape[-1], out.shape[:-1], device=device)
    return model, x, y


def model_factor_work(
    timed: ModelToTime, device: torch.device, repeats: int, where: str
) -> list[dict[str, Any]]:
    """``kernels`` entries of the profile: the factor work of one factor update of every K-FAC
    layer of ``timed``'s model at its batch (each layer's extraction and covariance products,
    ``tuner.kernels``), for the ``reduce`` and ``expand`` approximations, at the products'
    default precision."""
    from tuner.kernels import measure_kernels

    found = []
    for approx in (KFACApprox.REDUCE.value, KFACApprox.EXPAND.value):
        model, x, y = model_and_batch(timed.build, device, timed.example, timed.batch)
        kernels = measure_kernels(model, x, y, repeats=repeats, kfac_approx=approx)
        work = sum(layer.a_factor_s + layer.g_factor_s for layer in kernels.layers)
        what = f"{timed.name} at batch {timed.batch}: every K-FAC layer's {approx} factor work"
        found.append(
            {
                "model": timed.name,
                "batch": timed.batch,
                "kfac_approx": approx,
                "factor_work_s": measured(work, what, where),
            }
        )
    return found


def training_rate(
    build: Callable[[], torch.nn.Module],
    device: torch.device,
    precision: str,
    repeats: int,
    example: Callable[[int], torch.Tensor] | None = None,
    batch: int = 32,
    steady: bool = False,
) -> tuple[float, float | None]:
    """Samples per second of training ``build()``'s model at ``batch`` (SGD with momentum,
    random data of ``example(batch)``'s shape; default: ResNet-50's 224×224 images), with a
    cross-entropy loss over the model's last output dimension; on a GPU also the seconds the
    host takes to issue one step (its Python and launches: a step takes the longer of that and
    the device's time)."""
    model, x, y = model_and_batch(build, device, example, batch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    autocast = torch.autocast(
        device.type, dtype=torch.bfloat16, enabled=precision == Precision.BF16
    )

    def step(x: torch.Tensor = x, y: torch.Tensor = y) -> None:
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1)
            )
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()

    for _ in range(3):
        step()
    rate = batch / median_seconds(step, device, repeats)
    if device.type != "cuda":
        return rate, None
    # The host's time per step: a step of one sample, whose kernels the device finishes
    # before the host has launched them all, so that the host's Python and launches decide
    # it (the same operations as at any batch). A single step timed from the host's side
    # read 16-25% over a whole step on lent H200s (benchmarks/README.md, runs 8 and 9).
    # ``steady``: one-sample steps back to back (``steady_seconds``), for benchmarks that
    # compare the two.
    timer = steady_seconds if steady else median_seconds
    return rate, timer(functools.partial(step, x[:1], y[:1]), device, repeats)


def training_entry(
    model: str, precision: str, timed: tuple[float, float | None], what: str, where: str
) -> dict[str, Any]:
    """A ``training`` entry of the profile: the throughput, and on a GPU the host's time to
    issue one step."""
    rate, host = timed
    entry = {"model": model, "precision": precision, **measured(rate, what, where)}
    if host is not None:
        entry["host_step_s"] = measured(
            host, f"{what}: the host's time per step (a step of one sample)", where
        )
    return entry


@dataclass(frozen=True)
class ModelToTime:
    """A registered model whose plain training step ``measure`` times: its builder, a batch
    of its input (any device: only the shape and dtype are used) and the batch size."""

    name: str
    build: Callable[[], torch.nn.Module]
    example: Callable[[int], torch.Tensor]
    batch: int
