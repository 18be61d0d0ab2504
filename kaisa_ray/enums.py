"""Closed sets of options, accepted as strings or enums at the public edge.

Each closed set of the project's K-FAC options is defined here once; the JobSpec (pydantic),
the tuner, the service and the dashboard (through ``GET /v1/registry``) use these enums.

Strings are matched case-insensitively with ``-`` and ``_`` interchangeable, and any ``Enum``
member whose name matches is accepted too, so the reference implementation's enums
(``kfac.enums.ComputeMethod.EIGEN`` and friends) work unchanged.
"""

from __future__ import annotations

import enum
from typing import TypeVar

from kaisa_ray.errors import ConfigurationError

_E = TypeVar("_E", bound=enum.Enum)


class ComputeMethod(enum.StrEnum):
    """How second-order information is held: eigendecompositions or damped inverses."""

    EIGEN = "eigen"
    INVERSE = "inverse"


class AssignmentStrategy(enum.StrEnum):
    """Cost model for load-balancing decomposition work: n³ (compute) or n² (memory)."""

    COMPUTE = "compute"
    MEMORY = "memory"


class DistributedStrategy(enum.StrEnum):
    """KAISA's named gradient worker fractions."""

    COMM_OPT = "comm-opt"
    MEM_OPT = "mem-opt"
    HYBRID_OPT = "hybrid-opt"


class Parallel(enum.StrEnum):
    """How the model's parameters are spread over the ranks: whole on every rank (DDP, or
    gradients averaged by hand) or sharded by rows (FSDP2's ``fully_shard``: docs/fsdp.md)."""

    DDP = "ddp"
    FSDP = "fsdp"


class ShardUnits(enum.StrEnum):
    """What a sharded job (``parallel: fsdp``) applies FSDP2's ``fully_shard`` to before the
    whole model: each ``nn.Linear`` and ``nn.Conv2d`` (``layers``: a layer's parameters
    gathered around its own forward and backward), each child module of the model that holds
    parameters (``blocks``: a transformer's blocks), or nothing (``model``: one unit, every
    parameter gathered for the whole forward and backward)."""

    LAYERS = "layers"
    BLOCKS = "blocks"
    MODEL = "model"


class KFACApprox(enum.StrEnum):
    """How Conv2d factors treat spatial positions (Eschenhagen et al., NeurIPS 2023).

    ``expand`` takes every (sample, position) pair as a row (the classic KFC factors);
    ``reduce`` averages each sample's patches and output gradients over positions first,
    which makes a conv factor about as cheap as a linear layer's.
    """

    EXPAND = "expand"
    REDUCE = "reduce"


class RunningAverage(enum.StrEnum):
    """Where the factors' running averages start.

    ``identity`` (the reference's convention) starts ``A`` and ``G`` at the identity, which
    then outweighs the measured curvature for about ``1 / (1 - factor_decay)`` updates;
    ``debiased`` starts them at zero and divides by ``1 - Π decay`` as Adam does, so the
    first update is exactly the first batch's factor and every later one a weighted mean of
    the batches seen.
    """

    IDENTITY = "identity"
    DEBIASED = "debiased"


class FactorScale(enum.StrEnum):
    """The units of the K-FAC factors, and so of the damping.

    ``reference`` follows kfac-pytorch: ``G`` from the gradients of the mean loss (so it
    shrinks with the batch size as ``1/B²``) and Conv2d rows divided by the number of output
    positions. ``fisher`` builds the Kronecker factors of the Fisher itself: ``G`` from
    per-example gradients (the mean-loss gradients times the number of examples) and, for
    Conv2d, the factors of Grosse & Martens (2016, ``expand``) or Eschenhagen et al. (2023,
    ``reduce``), so a damping value means the same at every batch size.
    """

    REFERENCE = "reference"
    FISHER = "fisher"


class MatmulPrecision(enum.StrEnum):
    """The float32 matrix-product precision of K-FAC's factor and preconditioning products,
    with the meaning of ``torch.set_float32_matmul_precision``: ``highest`` (IEEE float32),
    ``high`` (TF32 on CUDA; float32 where the CPU has no faster mode) and ``medium`` (also
    bfloat16 products with float32 accumulation on CPUs that have them, e.g. AMX). The
    decompositions always run at ``highest``."""

    HIGHEST = "highest"
    HIGH = "high"
    MEDIUM = "medium"


class Scaling(enum.StrEnum):
    """What divides the gradient in K-FAC's eigenbasis (the eigen method): ``kronecker``, the
    damped eigenvalue products ``λ_G λ_A + γ`` (K-FAC); ``ekfac``, the per-example gradients'
    second moments in the eigenbasis plus γ (EKFAC: George et al. 2018), fitted on factor
    updates; ``adam-eigenbasis``, Adam's moments of the rotated gradient (SOAP's recipe on
    K-FAC's factors: Vyas et al. 2024). The fitted diagonal and the moments are kept per layer
    where its decompositions are and rotated into each new basis."""

    KRONECKER = "kronecker"
    EKFAC = "ekfac"
    ADAM_EIGENBASIS = "adam-eigenbasis"


class BasisUpdate(enum.StrEnum):
    """How the eigen method's bases are refreshed on a decomposition step after the first:
    ``eigh``, a full eigendecomposition of each factor; ``power-qr``, one step of subspace
    iteration from the basis held (``Q ← qr(F Q)``, columns first sorted by their Rayleigh
    quotients, which stand in for the eigenvalues), SOAP's refresh (Vyas et al. 2024,
    Algorithm 4) at about half an ``eigh``'s cost. Only for scalings that do not divide by
    the eigenvalues (``adam-eigenbasis``, ``ekfac``); a factor's first decomposition is an
    ``eigh`` either way."""

    EIGH = "eigh"
    POWER_QR = "power-qr"


class FactorReduction(enum.StrEnum):
    """When the factors are averaged over the ranks: ``every-update``, each factor-update
    step's batch factors (KAISA's and the reference's); ``deferred``, each rank's running
    average of its own batch factors, on decomposition steps only. The running average is
    linear, so the average of the ranks' averages is the average of the averaged batches (up
    to rounding): the factors every decomposition sees are the same, for
    ``inv_update_steps / factor_update_steps`` times fewer factor all-reduces, plus a
    one-number all-reduce each factor step that keeps every rank skipping the same
    non-finite steps."""

    EVERY_UPDATE = "every-update"
    DEFERRED = "deferred"


class EvalMetric(enum.StrEnum):
    """What an evaluation measures (the eval record's fields, a stop target's metric)."""

    TEST_ACCURACY = "test_accuracy"
    TEST_LOSS = "test_loss"


class UpdateMode(enum.StrEnum):
    """What moves the parameters: the optimizer, from the preconditioned gradients, or K-FAC
    itself (``QuadraticModelStep``: the step from the damped quadratic model)."""

    OPTIMIZER = "optimizer"
    QUADRATIC_MODEL = "quadratic-model"


class OptimizerName(enum.StrEnum):
    """The optimizers a job names (``optimizer.name``): SGD, Adam and AdamW from torch; SOAP,
    Muon and PSGD Kron, the peers that precondition the gradient themselves (heavyball, the
    ``peers`` extra); and LAMB, which a plan prices (BERT-Large's optimizer in KAISA) but no
    job here trains with."""

    SGD = "sgd"
    ADAM = "adam"
    ADAMW = "adamw"
    SOAP = "soap"
    MUON = "muon"
    PSGD_KRON = "psgd-kron"
    LAMB = "lamb"

    @property
    def peer(self) -> bool:
        """A peer from heavyball, run with ``kfac: off``."""
        return self in (OptimizerName.SOAP, OptimizerName.MUON, OptimizerName.PSGD_KRON)

    @property
    def trainable(self) -> bool:
        """A job can train with it (LAMB is priced only)."""
        return self is not OptimizerName.LAMB

    @property
    def state_tensors(self) -> int:
        """Parameter-sized float32 tensors of optimizer state, as the plan counts them: SGD's
        momentum, else two moments."""
        return 1 if self is OptimizerName.SGD else 2


class Precision(enum.StrEnum):
    """The dtype the forward pass computes in: float32, or autocast to bfloat16/float16."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


def _normalise(text: str) -> str:
    return text.strip().lower().replace("_", "-")


def parse_enum(enum_cls: type[_E], value: object, argument: str) -> _E:
    """Convert ``value`` (string, this enum, or a same-named foreign enum) to ``enum_cls``.

    Raises:
        ConfigurationError: (a ``KaisaRayError`` and a ``ValueError``) naming ``argument``
            and listing the accepted values.
    """
    if isinstance(value, enum_cls):
        return value
    if isinstance(value, enum.Enum):
        value = value.name
    if isinstance(value, str):
        wanted = _normalise(value)
        for member in enum_cls:
            if wanted in (_normalise(member.name), _normalise(str(member.value))):
                return member
    choices = ", ".join(repr(str(m.value)) for m in enum_cls)
    raise ConfigurationError(f"{argument}={value!r} is not valid; choose one of {choices}.")
