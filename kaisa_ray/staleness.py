"""How stale a layer's curvature is: how far its factors moved since its last decomposition, and
what that does to its preconditioned gradient.

Shapes as in ``layers.py``: factors ``(k, n, n)``, gradients ``grad_out_by_in`` ``(k, g, a)``.

- **Factor change.** At each decomposition every rank keeps a sketch ``S = F Ω`` of each factor
  (``Ω``: ``n × p`` Gaussian probes, the same on every rank and in every run, ``p = PROBES``).
  Later, ``‖F' Ω − S‖ / ‖S‖`` estimates the relative Frobenius change ``‖F' − F‖ / ‖F‖``
  (``E‖X Ω‖² = p ‖X‖²``, Hutchinson's estimator): ``O(n² p)`` work and ``n·p`` numbers per
  factor instead of a copy of the factor. Every rank holds the same factors after the factor
  all-reduce, so every rank can measure it.
- **Angle.** On a layer's decomposition step, the rank that computes its A decomposition
  preconditions the layer's gradient with the previous decomposition before replacing it, and
  with the fresh one as every step does; the angle between the two is what the staleness
  would have done to this step's update.

The preconditioner all-reduces the measurements of each decomposition step (each written by one
rank), so every rank decides on the same numbers (``kaisa_ray.intervals``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kaisa_ray.schedule import STALENESS_PROBES, STALENESS_VALUES

PROBES = STALENESS_PROBES
"""Columns of each factor's sketch."""
VALUES_PER_LAYER = STALENESS_VALUES
"""What a layer's decomposition step measures: the change of A, of G, and the angle."""


def probe(dim: int, dtype: torch.dtype, device: torch.device, probes: int = PROBES) -> torch.Tensor:
    """``Ω``: ``(dim, probes)`` standard normal, the same on every rank for a dimension.

    Drawn again at each use (a few thousand numbers) rather than cached: nothing K-FAC holds
    between steps escapes its exact memory accounting.
    """
    generator = torch.Generator().manual_seed(7919 * dim + probes)
    values = torch.randn(dim, probes, generator=generator, dtype=torch.float64)
    return values.to(device=device, dtype=dtype)


def sketch(factor: torch.Tensor, probes: int = PROBES) -> torch.Tensor:
    """``F Ω``: ``(k, n, probes)`` (a diagonal factor held as its diagonal ``(k, n)``: the
    same sketch, each row of ``Ω`` scaled)."""
    omega = probe(factor.shape[-1], factor.dtype, factor.device, probes)
    return factor.unsqueeze(-1) * omega if factor.dim() == 2 else factor @ omega


def relative_change(factor: torch.Tensor, old_sketch: torch.Tensor) -> torch.Tensor:
    """``‖F Ω − S‖ / ‖S‖`` (a 0-dim float64 tensor; ``inf`` when ``S`` is zero)."""
    new = sketch(factor, old_sketch.shape[-1])
    moved = torch.linalg.vector_norm((new - old_sketch).to(torch.float64))
    base = torch.linalg.vector_norm(old_sketch.to(torch.float64))
    ratio: torch.Tensor = moved / base
    return ratio


def angle_degrees(stale: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """Degrees between two preconditioned gradients (0-dim float64; ``NOT_MEASURED``, -1,
    where either is zero or not finite)."""
    a, b = stale.reshape(-1).to(torch.float64), fresh.reshape(-1).to(torch.float64)
    norms = torch.linalg.vector_norm(a) * torch.linalg.vector_norm(b)
    cosine = (a @ b / norms).clamp(-1.0, 1.0)
    degrees = torch.rad2deg(torch.arccos(cosine))
    ok = torch.isfinite(degrees) & (norms > 0)
    return torch.where(ok, degrees, torch.full_like(degrees, -1.0))


def sketch_nbytes(a_dim: int, g_dim: int, groups: int, elem: int, probes: int = PROBES) -> int:
    """Bytes of one layer's two sketches."""
    return elem * groups * (a_dim + g_dim) * probes


def degrees(value: float) -> str:
    return "-" if value < 0 or not math.isfinite(value) else f"{value:.2f}°"


@dataclass(frozen=True, kw_only=True)
class LayerStaleness:
    """One layer's intervals now, why it is on them, and how stale its curvature was.

    ``change_a``/``change_g``: relative change of A and G from the factors of its last
    decomposition to its latest factor update; ``measured_*`` and ``angle``: what its last
    decomposition step measured (the change over the whole interval, and the angle between the
    gradient preconditioned stale and fresh, in degrees). -1: not measured (yet).
    """

    layer: str
    factor_update_steps: int
    inv_update_steps: int
    change_a: float
    change_g: float
    measured_step: int | None
    measured_change_a: float
    measured_change_g: float
    angle: float
    reason: str
