"""What one worker of a job holds in memory, predicted from the model's shapes.

Built on PyTorch's meta device as ``kaisa-ray plan`` builds it (``kaisa_train.shapes``:
parameters with shapes and no storage, one forward pass of a meta batch): the model's
parameters, the activations autograd keeps for backward at the job's batch size, and from
them the tuner's own memory model (``tuner.forecast.memory_basis``: weights, gradients and
optimizer state, activations, K-FAC's temporaries) plus K-FAC's state where every worker
holds every factor and decomposition (COMM-OPT, the most a worker of any strategy holds:
``kaisa_ray.plan``). The service bounds a job by it and admits jobs by it.

Example:
    >>> print(footprint("mlp", {"hidden": [65536, 65536, 65536]}, batch_size=128))
    mlp: 8.64e+09 parameters (32.2GiB in float32), 96.4MiB of activations at batch 128
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ByteSize

from kaisa_ray.enums import ComputeMethod, KFACApprox, OptimizerName, Precision, Scaling
from kaisa_ray.errors import ConfigurationError
from kaisa_ray.plan import plan
from kaisa_train.shapes import build_on_meta, workload
from tuner.forecast import FLOAT32, memory_basis

__all__ = ["Footprint", "footprint"]


@dataclass(frozen=True, kw_only=True)
class Footprint:
    """A worker's memory, predicted (bytes)."""

    model: str
    batch_size: int
    parameters: int
    activation_bytes: int | None  # None: the model does not say what its input looks like
    worker_bytes: int  # everything one worker's tensors hold (see the module docstring)

    @property
    def model_bytes(self) -> int:
        """The model's parameters in float32 and its activations at the batch size: what
        the service's --max-model-bytes bounds."""
        return FLOAT32 * self.parameters + (self.activation_bytes or 0)

    def __str__(self) -> str:
        weights = ByteSize(FLOAT32 * self.parameters).human_readable()
        text = f"{self.model}: {self.parameters:.3g} parameters ({weights} in float32)"
        if self.activation_bytes is None:
            return text + " (activations not known: the model has no example input)"
        activations = ByteSize(self.activation_bytes).human_readable()
        return text + f", {activations} of activations at batch {self.batch_size}"

    def as_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "batch_size": self.batch_size,
            "parameters": self.parameters,
            "activation_bytes": self.activation_bytes,
            "worker_bytes": self.worker_bytes,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Footprint:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__})


def footprint(
    model: str,
    params: Mapping[str, Any] | None = None,
    *,
    batch_size: int,
    precision: str = Precision.FP32,
    optimizer: str = OptimizerName.SGD.value,
    kfac: bool = True,
    kfac_approx: str = KFACApprox.REDUCE,
    sequence_approx: str = KFACApprox.EXPAND,
    compute_method: str = ComputeMethod.INVERSE,
    scaling: str = Scaling.KRONECKER,
    embeddings: bool = False,
) -> Footprint:
    """One worker's predicted memory for model ``model`` built with ``params``.

    Raises:
        ConfigurationError: the model cannot be built with ``params`` (its constructor's own
            refusal: a ``seq_len`` beyond BERT's positions, say).
    """
    try:
        job = workload(
            model,
            batch_size=batch_size,
            params=params,
            precision=precision,
            kfac_approx=kfac_approx,
            sequence_approx=sequence_approx,
            optimizer=optimizer,
            compute_method=compute_method,
            scaling=scaling,
            embeddings=embeddings,
        )
    except ConfigurationError as err:
        if "does not say what its input looks like" not in str(err):
            raise
        return _parameters_only(model, params, batch_size, optimizer)
    except ValueError as err:  # the constructor refused its arguments
        raise ConfigurationError(f"model {model!r} cannot be built: {err}") from err
    base, transient = memory_basis(job)
    state = 0
    if kfac and job.layers:
        every = plan(
            list(job.layers), 1, 1.0, compute_method=job.compute_method, scaling=job.scaling
        )
        state = int(every.ranks[0].memory["total"])
    return Footprint(
        model=model,
        batch_size=batch_size,
        parameters=job.parameters,
        activation_bytes=job.activation_bytes,
        worker_bytes=int(base + state + (transient if kfac else 0)),
    )


def _parameters_only(
    model: str, params: Mapping[str, Any] | None, batch_size: int, optimizer: str
) -> Footprint:
    try:
        built = build_on_meta(model, params)
    except ValueError as err:
        raise ConfigurationError(f"model {model!r} cannot be built: {err}") from err
    parameters = sum(p.numel() for p in built.parameters())
    states = OptimizerName(optimizer).state_tensors
    return Footprint(
        model=model,
        batch_size=batch_size,
        parameters=parameters,
        activation_bytes=None,
        worker_bytes=FLOAT32 * parameters * (2 + states),
    )
