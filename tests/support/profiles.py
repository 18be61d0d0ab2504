"""Tuner profiles built by hand: what the cost model's and the tuner's tests share."""

from __future__ import annotations

import dataclasses

from kaisa_ray.assignment import LayerShape
from tuner.cost import CubicFit, LinkFit, Profile

# Eight equal layers: the strategies differ clearly (LeNet's fc1 dominates so much that every
# f < 1 leaves the same worst rank at 4 workers: the model ties them, and takes the larger f).
EVEN = tuple(LayerShape(name=f"fc{i}", a_dim=513, g_dim=512) for i in range(8))


MIB = 2**20


def profile(**changes: object) -> Profile:
    base = Profile(
        world_size=4,
        layers=LENET,
        base_memory_bytes=200 * MIB,
        step_s=0.025,
        factor_s=0.02,
        decomposition=CubicFit(c0=1e-4, c3=2e-10),
        precondition_s_per_flop=1 / 30e9,
        allreduce=LinkFit(latency_s=1e-4, bytes_per_s=1e9),
        broadcast=LinkFit(latency_s=1e-4, bytes_per_s=1e9),
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


LENET = (
    LayerShape(name="conv1", a_dim=26, g_dim=8),
    LayerShape(name="conv2", a_dim=201, g_dim=16),
    LayerShape(name="fc1", a_dim=785, g_dim=128),
    LayerShape(name="fc2", a_dim=129, g_dim=10),
)
