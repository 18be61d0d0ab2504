"""The configurations ``cuda_graphs=True`` is checked against eager steps in, on this CPU at
the capture seam (``tests/core/test_graphs.py``) and on CUDA (``tests/core/test_gpu.py``)."""

from __future__ import annotations

from typing import Any

CONFIGS: dict[str, dict[str, Any]] = {
    "inverse": {"compute_method": "inverse"},
    "eigen": {"compute_method": "eigen"},
    "eigen, no table, pi-damping": {
        "compute_method": "eigen",
        "compute_eigenvalue_outer_product": False,
        "pi_damping": True,
    },
    "adam-eigenbasis": {"compute_method": "eigen", "scaling": "adam-eigenbasis", "kl_clip": None},
    "ekfac": {"compute_method": "eigen", "scaling": "ekfac"},
}


def graphed_kwargs(config: str) -> dict[str, Any]:
    """The preconditioner's keywords for ``CONFIGS[config]``: factor and decomposition updates
    in between, a damping and a learning rate that change every step (the graph reads them
    from scalars on the device) and a KL clip small enough to scale every step."""
    return {
        "factor_update_steps": 2,
        "inv_update_steps": 4,
        "damping": lambda step: 0.01 * (1.0 + 0.1 * step),
        "lr": lambda step: 0.05 / (1.0 + step),
        "kl_clip": 1e-7,
        **CONFIGS[config],
    }
