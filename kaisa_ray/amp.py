"""Mixed precision for a K-FAC training step: autocast, and a GradScaler where fp16 needs one.

K-FAC adds one constraint to PyTorch's usual AMP recipe: the preconditioner must see
unscaled gradients, so the order of a step is::

    with precision.autocast():
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)      # only when the scaler is enabled (fp16)
    preconditioner.step()           # built with grad_scaler=scaler: G factors are unscaled too
    scaler.step(optimizer)          # skips the step if the gradients overflowed
    scaler.update()

``optimizer_step`` is that sequence after the forward pass; ``MixedPrecision`` gives the
autocast context and the scaler for a device. bf16 needs no scaler (its exponent range is
float32's); fp16 does. Both run on CUDA and on the CPU, so nothing here assumes either.

Example::

    precision = MixedPrecision(mode="bf16", device_type=device.type)
    scaler = precision.grad_scaler()
    preconditioner = KFACPreconditioner(model, grad_scaler=scaler)
    with precision.autocast():
        loss = F.cross_entropy(model(x), y)
    optimizer_step(loss, optimizer, preconditioner, scaler)
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch

from kaisa_ray.enums import Precision, parse_enum
from kaisa_ray.errors import ConfigurationError

__all__ = ["MixedPrecision", "Precision", "optimizer_step"]


_DTYPES = {
    Precision.FP32: torch.float32,
    Precision.BF16: torch.bfloat16,
    Precision.FP16: torch.float16,
}


@dataclass(frozen=True, kw_only=True)
class MixedPrecision:
    """Autocast and gradient scaling for training in ``mode`` on ``device_type``.

    Raises:
        ConfigurationError: an unknown mode, or a mode the device cannot run (bf16 on a GPU
            without bfloat16 support, autocast on a device type torch cannot autocast).
    """

    mode: Precision | str = Precision.FP32
    device_type: str = "cpu"

    def __post_init__(self) -> None:
        mode = parse_enum(Precision, self.mode, "precision")
        object.__setattr__(self, "mode", mode)
        if mode is Precision.FP32:
            return
        try:
            available = torch.amp.autocast_mode.is_autocast_available(self.device_type)
        except RuntimeError:  # not a device type torch knows
            available = False
        if not available:
            raise ConfigurationError(
                f"precision={mode.value} needs autocast, which torch does not offer on "
                f"{self.device_type!r}; use precision fp32 there"
            )
        if (
            mode is Precision.BF16
            and self.device_type == "cuda"
            and not torch.cuda.is_bf16_supported()
        ):
            raise ConfigurationError(
                "precision=bf16 on a GPU without bfloat16 support (before Ampere); use fp16, "
                "which trains with a GradScaler, or fp32"
            )

    @property
    def precision(self) -> Precision:
        return Precision(self.mode)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype autocast computes in (float32 when it is off)."""
        return _DTYPES[self.precision]

    @property
    def enabled(self) -> bool:
        return self.precision is not Precision.FP32

    def autocast(self) -> AbstractContextManager[object]:
        """``torch.autocast`` for the forward pass and the loss (a no-op for fp32)."""
        return torch.autocast(self.device_type, dtype=self.dtype, enabled=self.enabled)

    def grad_scaler(self) -> torch.amp.GradScaler:
        """A GradScaler, enabled for fp16 only (a disabled one passes everything through)."""
        return torch.amp.GradScaler(self.device_type, enabled=self.precision is Precision.FP16)


class Preconditioner(Protocol):
    def step(self) -> None: ...


def optimizer_step(
    loss: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    preconditioner: Preconditioner | None,
    scaler: torch.amp.GradScaler,
) -> None:
    """Backward, precondition and step, in the order K-FAC needs under a GradScaler.

    ``preconditioner`` is anything with a ``step()`` (a ``KFACPreconditioner``, built with
    ``grad_scaler=scaler``), or None for a plain step. With the scaler disabled this is
    ``loss.backward(); preconditioner.step(); optimizer.step()``.
    """
    scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
    if preconditioner is not None:
        if scaler.is_enabled():
            scaler.unscale_(optimizer)
        preconditioner.step()
    scaler.step(optimizer)
    scaler.update()
