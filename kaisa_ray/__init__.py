"""kaisa-ray: K-FAC second-order preconditioning in the KAISA style.

The core (this package's top-level modules) imports torch only. Add it to a training loop in
two lines::

    preconditioner = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=10)
    ...
    loss.backward(); preconditioner.step(); optimizer.step()

``KFACPreconditioner`` (and ``QuadraticModelStep``, K-FAC's own step size) is imported when
first used, so that the closed sets (``enums``) and
the exception tree (``errors``) load without torch (the service's client commands use them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kaisa_ray.enums import (
    AssignmentStrategy,
    ComputeMethod,
    DistributedStrategy,
    KFACApprox,
    Precision,
)
from kaisa_ray.errors import ConfigurationError, KaisaRayError, StateDictError

if TYPE_CHECKING:
    from kaisa_ray.preconditioner import KFACPreconditioner
    from kaisa_ray.quadratic import QuadraticModelStep

__all__ = [
    "AssignmentStrategy",
    "ComputeMethod",
    "ConfigurationError",
    "DistributedStrategy",
    "KFACApprox",
    "KFACPreconditioner",
    "KaisaRayError",
    "Precision",
    "QuadraticModelStep",
    "StateDictError",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "KFACPreconditioner":
        from kaisa_ray.preconditioner import KFACPreconditioner

        return KFACPreconditioner
    if name == "QuadraticModelStep":
        from kaisa_ray.quadratic import QuadraticModelStep

        return QuadraticModelStep
    raise AttributeError(f"module 'kaisa_ray' has no attribute {name!r}")
