"""Which modules of a model K-FAC preconditions, and why the others are left alone.

Shared by the preconditioner and by ``plan()``, so a plan priced from a model describes the
layers the preconditioner will actually register.

A layer whose weight (or bias) is the same parameter as another module's (a language model's
output head tied to its input embedding) is left to the optimizer, and the construction log
says so: its gradient sums every use of the parameter, and the layer's Kronecker factors
describe only its own use, so preconditioning it as the layer would replace the other
modules' share of the gradient with the layer's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from kaisa_ray.assignment import PlannedLayer
from kaisa_ray.conv_layers import Conv2dHelper
from kaisa_ray.enums import KFACApprox, parse_enum
from kaisa_ray.errors import ConfigurationError
from kaisa_ray.layers import EmbeddingHelper, LayerHelper, LinearHelper


def make_helper(
    module: nn.Module,
    approx: KFACApprox,
    sequence_approx: KFACApprox = KFACApprox.EXPAND,
    embeddings: bool = False,
) -> LayerHelper | None:
    """The helper for a supported module, or ``None`` if K-FAC leaves it to the optimizer:
    ``approx`` for a convolution's positions, ``sequence_approx`` for a Linear layer's;
    ``nn.Embedding`` only with ``embeddings``."""
    if isinstance(module, nn.Conv2d):
        return Conv2dHelper(module, approx)
    if isinstance(module, nn.Linear):
        return LinearHelper(module, sequence_approx)
    if embeddings and isinstance(module, nn.Embedding):
        return EmbeddingHelper(module)
    return None


@dataclass(frozen=True, kw_only=True)
class Registered:
    """A module K-FAC will precondition."""

    name: str
    module: nn.Module
    helper: LayerHelper
    factor_dtype: torch.dtype
    inv_dtype: torch.dtype

    def planned(self) -> PlannedLayer:
        return PlannedLayer(
            name=self.name,
            a_dim=self.helper.a_dim,
            g_dim=self.helper.g_dim,
            groups=self.helper.groups,
            diagonal_a=self.helper.diagonal_a,
            factor_dtype=self.factor_dtype,
            inv_dtype=self.inv_dtype,
            grad_dtype=self.helper.weight().dtype,
        )


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside DDP, so layer names do not depend on the wrapper."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def compile_patterns(skip_layers: Iterable[str] | str | None) -> list[re.Pattern[str]]:
    if isinstance(skip_layers, str):
        skip_layers = [skip_layers]
    try:
        return [re.compile(p) for p in skip_layers or []]
    except re.error as exc:
        raise ConfigurationError(
            f"skip_layers contains an invalid regular expression: {exc}."
        ) from exc


def _holders(model: nn.Module) -> dict[int, list[tuple[str, nn.Module]]]:
    """Each parameter (by identity) and the modules that hold it directly, by their names."""
    holders: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), []).append((name or "<root>", module))
    return holders


def _tied(module: nn.Module, holders: dict[int, list[tuple[str, nn.Module]]]) -> str | None:
    """Why ``module`` cannot be preconditioned on its own: a parameter it shares with other
    modules (their names and kinds), or None."""
    for part in ("weight", "bias"):
        param = getattr(module, part, None)
        if not isinstance(param, nn.Parameter):
            continue
        others = [
            f"{name} ({type(other).__name__})"
            for name, other in holders.get(id(param), [])
            if other is not module
        ]
        if others:
            return (
                f"{part} tied with {', '.join(others)}; its gradient sums every use of the "
                "shared parameter, which this layer's factors do not describe"
            )
    return None


def _skip_reason(
    name: str,
    module: nn.Module,
    patterns: list[re.Pattern[str]],
    holders: dict[int, list[tuple[str, nn.Module]]],
) -> str | None:
    cls = type(module).__name__
    if any(p.match(name) or p.match(cls) for p in patterns):
        return "skip_layers"
    if isinstance(module, nn.Embedding) and module.sparse:
        return "sparse=True: its gradient is sparse, which K-FAC does not precondition"
    if cls == "NonDynamicallyQuantizableLinear":
        return "used by MultiheadAttention through its weight, not its forward"
    weight = getattr(module, "weight", None)
    if isinstance(weight, nn.parameter.UninitializedParameter):
        raise ConfigurationError(
            f"layer {name!r} is a lazy module that has not been initialised; run one forward "
            "pass before creating the KFACPreconditioner."
        )
    if not isinstance(weight, torch.Tensor) or not weight.requires_grad:
        return "frozen"
    return _tied(module, holders)


def _dtype(requested: torch.dtype | None, module: nn.Module, argument: str) -> torch.dtype:
    if requested is not None:
        if not requested.is_floating_point:
            raise ConfigurationError(
                f"{argument}={requested} is not a floating-point dtype; use torch.float32 "
                "or torch.float64."
            )
        return requested
    weight = getattr(module, "weight", None)
    dtype = weight.dtype if isinstance(weight, torch.Tensor) else torch.float32
    return torch.promote_types(dtype, torch.float32)


def discover(
    model: nn.Module,
    *,
    skip_layers: Iterable[str] | str | None = None,
    kfac_approx: KFACApprox | str = KFACApprox.EXPAND,
    sequence_approx: KFACApprox | str = KFACApprox.EXPAND,
    factor_dtype: torch.dtype | None = None,
    inv_dtype: torch.dtype | None = None,
    embeddings: bool = False,
) -> tuple[list[Registered], list[str]]:
    """The modules to precondition, in registration order, and descriptions of the rest
    (``nn.Embedding`` among them only with ``embeddings``)."""
    approx = parse_enum(KFACApprox, kfac_approx, "kfac_approx")
    sequences = parse_enum(KFACApprox, sequence_approx, "sequence_approx")
    patterns = compile_patterns(skip_layers)
    found: list[Registered] = []
    seen: set[nn.Module] = set()
    skipped: list[str] = []
    holders = _holders(unwrap(model))
    for name, module in unwrap(model).named_modules():
        helper = make_helper(module, approx, sequences, embeddings)
        if helper is None:
            if any(True for _ in module.parameters(recurse=False)):
                skipped.append(f"{name or '<root>'} ({type(module).__name__})")
            continue
        reason = _skip_reason(name, module, patterns, holders)
        if reason is not None:
            skipped.append(f"{name} ({type(module).__name__}: {reason})")
            continue
        if module in seen:  # one module reachable under two names
            continue
        seen.add(module)
        found.append(
            Registered(
                name=name,
                module=module,
                helper=helper,
                factor_dtype=_dtype(factor_dtype, module, "factor_dtype"),
                inv_dtype=_dtype(inv_dtype or factor_dtype, module, "inv_dtype"),
            )
        )
    return found, skipped


def registered_layers(model: nn.Module, **options: object) -> list[PlannedLayer]:
    """Shapes and dtypes of the layers ``discover`` finds (for ``plan()``)."""
    found, _ = discover(model, **options)  # type: ignore[arg-type]
    return [r.planned() for r in found]
