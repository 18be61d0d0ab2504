"""KAISA's gradient worker fraction: names, floats, and which values a world size admits."""

from __future__ import annotations

import enum
import math
from fractions import Fraction

from kaisa_ray.enums import DistributedStrategy, Scaling, parse_enum
from kaisa_ray.errors import ConfigurationError


def valid_fractions(world_size: int) -> list[float]:
    """Every f with f·W a divisor of W, smallest first (MEM-OPT ... COMM-OPT)."""
    small = [d for d in range(1, math.isqrt(world_size) + 1) if world_size % d == 0]
    large = [world_size // d for d in reversed(small) if d * d != world_size]
    return [d / world_size for d in small + large]


def placeable(scaling: Scaling | str, world_size: int, fraction: float) -> bool:
    """Whether ``scaling`` can be placed with ``fraction`` at ``world_size``: EKFAC fits its
    diagonal from each rank's examples projected onto the layers' bases, so with several
    ranks every rank must hold them (COMM-OPT, f = 1)."""
    return Scaling(scaling) is not Scaling.EKFAC or world_size == 1 or fraction >= 1.0


def placeable_fractions(world_size: int, scaling: Scaling | str) -> list[float]:
    """The fractions ``scaling`` can be placed with (``valid_fractions``, ``placeable``)."""
    return [f for f in valid_fractions(world_size) if placeable(scaling, world_size, f)]


def resolve_grad_worker_fraction(
    value: DistributedStrategy | float | str, world_size: int
) -> float:
    """Turn a strategy name or fraction into the float f, checked against ``world_size``.

    ``comm-opt`` is 1, ``mem-opt`` is 1/W and ``hybrid-opt`` is 0.5; a float must lie in
    (0, 1] and make ``f·W`` a divisor of W.

    Raises:
        ConfigurationError: naming the value and listing the valid ones for this world size.
    """
    if world_size < 1:
        raise ConfigurationError(f"world_size={world_size} must be at least 1.")
    if isinstance(value, str | enum.Enum):
        try:
            strategy = parse_enum(DistributedStrategy, value, "grad_worker_fraction")
        except ValueError:
            if isinstance(value, str):
                try:
                    return resolve_grad_worker_fraction(float(value), world_size)
                except ValueError:
                    pass
            raise
        fraction = {
            DistributedStrategy.COMM_OPT: 1.0,
            DistributedStrategy.MEM_OPT: 1.0 / world_size,
            DistributedStrategy.HYBRID_OPT: 0.5,
        }[strategy]
    elif isinstance(value, bool) or not isinstance(value, float | int):
        raise ConfigurationError(
            f"grad_worker_fraction must be a float in (0, 1] or one of 'comm-opt', "
            f"'hybrid-opt', 'mem-opt'; got {value!r}."
        )
    else:
        fraction = float(value)
    valid = valid_fractions(world_size)
    if not 0.0 < fraction <= 1.0:
        raise ConfigurationError(
            f"grad_worker_fraction={value!r} must be in (0, 1]; valid values for world size "
            f"{world_size}: {valid}."
        )
    workers = Fraction(fraction).limit_denominator(10**6) * world_size
    if workers.denominator != 1 or world_size % int(workers) != 0:
        raise ConfigurationError(
            f"grad_worker_fraction={value!r} gives {float(workers):g} gradient workers per "
            f"layer at world size {world_size}, which must be a whole divisor of it; valid "
            f"values for world size {world_size}: {valid}."
        )
    return float(int(workers)) / world_size
