"""The preconditioner's layers from its checked options: each registered module's
``KFACLayer``, the device check ``cuda_graphs`` needs, and the description logged at start."""

from __future__ import annotations

from collections.abc import Sequence

from kaisa_ray.errors import ConfigurationError
from kaisa_ray.kfac_layer import KFACLayer
from kaisa_ray.layers import describe_shapes
from kaisa_ray.options import PreconditionerOptions
from kaisa_ray.registration import Registered
from kaisa_ray.staleness import PROBES


def kfac_layers(found: Sequence[Registered], options: PreconditionerOptions) -> list[KFACLayer]:
    """One ``KFACLayer`` per registered module, in registration order."""
    return [
        KFACLayer(
            reg.name,
            reg.helper,
            compute_method=options.compute_method,
            outer_product=options.compute_eigenvalue_outer_product,
            factor_dtype=reg.factor_dtype,
            inv_dtype=reg.inv_dtype,
            running_average=options.running_average,
            factor_scale=options.factor_scale,
            pi_damping=options.pi_damping,
            factor_samples=options.factor_samples,
            staleness_probes=PROBES if options.measures_staleness else 0,
            scaling=options.scaling,
            adam_betas=options.adam_betas,
            adam_eps=options.adam_eps,
            basis_update=options.basis_update,
        )
        for reg in found
    ]


def require_cuda(layers: Sequence[KFACLayer]) -> None:
    """Raise unless every layer is on a CUDA device (what ``cuda_graphs=True`` replays on)."""
    devices = {layer.helper.weight().device.type for layer in layers}
    if devices != {"cuda"}:
        raise ConfigurationError(
            "cuda_graphs=True replays the preconditioning from a CUDA graph, but the "
            f"model's registered layers are on {', '.join(sorted(devices)) or 'no device'}"
            ": move the model to the GPU (model.cuda()) before building the "
            "preconditioner, or leave cuda_graphs off."
        )


def described(layers: Sequence[KFACLayer]) -> str:
    """Each layer's name, module type and shapes, for the log."""
    return ", ".join(
        f"{layer.name} {type(layer.helper.module).__name__} [{describe_shapes(layer.helper)}]"
        for layer in layers
    )
