"""kaisa-ray: K-FAC second-order preconditioning in the KAISA style.

The core (this package's top-level modules) imports torch only. Add it to a training loop in
two lines::

    preconditioner = KFACPreconditioner(model, factor_update_steps=1, inv_update_steps=10)
    ...
    loss.backward(); preconditioner.step(); optimizer.step()
"""

from kaisa_ray.enums import AssignmentStrategy, ComputeMethod, DistributedStrategy, KFACApprox
from kaisa_ray.errors import ConfigurationError, KaisaRayError, StateDictError
from kaisa_ray.preconditioner import KFACPreconditioner

__all__ = [
    "AssignmentStrategy",
    "ComputeMethod",
    "ConfigurationError",
    "DistributedStrategy",
    "KFACApprox",
    "KFACPreconditioner",
    "KaisaRayError",
    "StateDictError",
]

__version__ = "0.1.0"
