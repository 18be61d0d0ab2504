"""A model's own K-FAC operations, timed at their shapes on this node's device.

``measure_kernels(model, inputs, targets, ...)`` runs one forward and backward pass of the
model to capture every registered layer's input and output gradient, then times, with the
preconditioner's own code and settings (``KFACPreconditioner`` keyword arguments):

- each layer's batch factors from those tensors (``a_factor_s``, ``g_factor_s``: the hooks'
  work on a factor-update step), at the products' ``matmul_precision``;
- the decompositions, per factor size, as the preconditioner batches them
  (``kaisa_ray.batching.decompose``: ``seconds`` for ``count`` factors of that size);
- the preconditioning products of each shape group (``precondition_s`` for the whole group);
- a quiet step of the preconditioner (no factor or decomposition update: products, the
  gradients gathered and written back, the KL clip, Python) and a plain training step
  (forward, backward, optimizer) without K-FAC;
- the per-operation latency of a tiny kernel.

Every time is the median of ``repeats`` runs, the device synchronised around each run. The
result is what a cost model needs to price K-FAC on this node for this model at any
assignment: per layer, per group and per factor size, not from generic matmul curves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kaisa_ray import KFACPreconditioner, batching
from tuner.measure import median_seconds


@dataclass(frozen=True, kw_only=True)
class LayerKernels:
    name: str
    a_dim: int
    g_dim: int
    groups: int
    rows: int  # rows of the A factor's product (examples, or examples x positions)
    a_factor_s: float
    g_factor_s: float


@dataclass(frozen=True, kw_only=True)
class GroupKernels:
    layers: tuple[str, ...]
    a_dim: int
    g_dim: int
    groups: int
    precondition_s: float  # the group's batched products, all members


@dataclass(frozen=True, kw_only=True)
class DecompositionKernels:
    dim: int
    count: int  # factors of this size (times their groups) decomposed together
    seconds: float  # all of them, as batching.decompose runs them


@dataclass(frozen=True, kw_only=True)
class KernelProfile:
    device: str
    torch_version: str
    batch: int
    options: dict[str, Any]
    latency_s: float
    step_s: float  # a plain training step without K-FAC
    quiet_kfac_s: float  # the preconditioner's step() with nothing to update
    layers: tuple[LayerKernels, ...]
    groups: tuple[GroupKernels, ...]
    decompositions: tuple[DecompositionKernels, ...]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure_kernels(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    repeats: int = 10,
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
    **kfac: Any,
) -> KernelProfile:
    """Time ``model``'s K-FAC operations on ``inputs`` (on their device); ``kfac``: the
    preconditioner's keyword arguments (its own defaults otherwise). The model is trained
    for a few steps (its parameters change)."""
    device = inputs.device
    make_optimizer = optimizer or (lambda m: torch.optim.SGD(m.parameters(), lr=0.01))
    opt = make_optimizer(model)

    def forward_backward() -> None:
        opt.zero_grad(set_to_none=True)
        loss(model(inputs), targets).backward()  # type: ignore[no-untyped-call]

    def plain_step() -> None:
        forward_backward()
        opt.step()

    latency = (
        median_seconds(
            lambda: [torch.ones(8, device=device).add_(1) for _ in range(100)], device, repeats
        )
        / 100
    )
    step_s = median_seconds(plain_step, device, repeats)

    options = {**kfac, "factor_update_steps": 1, "inv_update_steps": 1, "grad_worker_fraction": 1}
    preconditioner = KFACPreconditioner(model, **options)
    captured: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    handles = []
    for layer in preconditioner.layers:
        module = layer.helper.module

        def hook(
            module: nn.Module, args: tuple[Any, ...], output: Any, name: str = layer.name
        ) -> None:
            x = args[0].detach()

            def grad_hook(grad: torch.Tensor) -> None:
                captured[name] = (x, grad.detach())

            output.register_hook(grad_hook)

        handles.append(module.register_forward_hook(hook))
    forward_backward()
    for handle in handles:
        handle.remove()
    preconditioner.step()  # factors folded, decompositions made, gradients preconditioned
    opt.step()

    layers = []
    divisor = preconditioner._hooks.g_divisor()
    with torch.no_grad(), preconditioner._products():
        for layer in preconditioner.layers:
            x, grad = captured[layer.name]
            a_s = median_seconds(functools.partial(layer.add_input, x), device, repeats)
            g_s = median_seconds(
                functools.partial(layer.add_grad_output, grad, divisor), device, repeats
            )
            layer.reset_batch()
            layers.append(
                LayerKernels(
                    name=layer.name,
                    a_dim=layer.helper.a_dim,
                    g_dim=layer.helper.g_dim,
                    groups=layer.helper.groups,
                    rows=_rows(layer.helper, x),
                    a_factor_s=a_s,
                    g_factor_s=g_s,
                )
            )

    damping = preconditioner.damping
    work: dict[int, list[tuple[Any, str, torch.Tensor, float | torch.Tensor]]] = {}
    for layer in preconditioner.layers:
        a, g = layer.factors()
        damp_a, damp_g = layer.factor_dampings(a, g, damping)
        if not layer.helper.diagonal_a:  # decomposed from its diagonal: no solver to time
            work.setdefault(layer.helper.a_dim, []).append((layer, "A", a, damp_a))
        work.setdefault(layer.helper.g_dim, []).append((layer, "G", g, damp_g))
    decompositions = []
    for dim, items in sorted(work.items()):
        seconds = median_seconds(
            functools.partial(batching.decompose, items), device, max(1, repeats // 3)
        )
        count = sum(item[0].helper.groups for item in items)
        decompositions.append(DecompositionKernels(dim=dim, count=count, seconds=seconds))

    forward_backward()
    groups = []
    with torch.no_grad(), preconditioner._products():
        for group in preconditioner._preconditioning.groups:
            raw = group.gather()
            seconds = median_seconds(
                functools.partial(group.precondition, raw, damping), device, repeats
            )
            groups.append(
                GroupKernels(
                    layers=tuple(layer.name for layer in group.layers),
                    a_dim=group.key.a_dim,
                    g_dim=group.key.g_dim,
                    groups=group.key.groups,
                    precondition_s=seconds,
                )
            )

    # A quiet step: intervals that update nothing after the first step.
    preconditioner.remove_hooks()
    quiet = KFACPreconditioner(
        model, **{**options, "factor_update_steps": 10**9, "inv_update_steps": 10**9}
    )
    forward_backward()
    quiet.step()  # the first step decomposes (identity factors): past it, nothing updates
    forward_backward()
    quiet_s = median_seconds(quiet.step, device, repeats)
    quiet.remove_hooks()
    return KernelProfile(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        torch_version=torch.__version__,
        batch=int(inputs.shape[0]),
        options={k: str(v) for k, v in kfac.items()},
        latency_s=latency,
        step_s=step_s,
        quiet_kfac_s=quiet_s,
        layers=tuple(layers),
        groups=tuple(groups),
        decompositions=tuple(decompositions),
    )


def _rows(helper: Any, x: torch.Tensor) -> int:
    """Rows of the layer's A-factor product: examples (Linear: every leading index, or one a
    sequence under ``sequence_approx='reduce'``), or examples x output positions for a
    convolution's ``expand`` factors."""
    from kaisa_ray.conv_layers import Conv2dHelper
    from kaisa_ray.enums import KFACApprox
    from kaisa_ray.layers import LinearHelper

    if isinstance(helper, LinearHelper) and helper.reduces(x):
        return int(x.shape[0])
    if isinstance(helper, Conv2dHelper):
        if helper.approx is KFACApprox.REDUCE:
            return int(x.shape[0])
        oh, ow = helper.output_size(x.shape[-2], x.shape[-1])
        return int(x.shape[0]) * oh * ow
    return int(x.numel() // x.shape[-1])
