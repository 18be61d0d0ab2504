"""What ``tuner.node.measure`` times of K-FAC's fixed costs (hooks, Python, launches: the host's
work beside the arithmetic): on a stand-in of tiny Linear layers, per layer and per shape group
(``kfac_overheads``, the profile's ``kfac_overhead_s``), and on a model itself
(``model_kfac_host``, ``kfac_host_s``: what its preconditioning and its factor updates add to a
step of one sample).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kaisa_ray.enums import ComputeMethod, KFACApprox
from tuner.measure import median_seconds, steady_seconds
from tuner.node_training import ModelToTime, measured, model_and_batch

OVERHEAD_LAYERS = 16


def _tiny_stack(distinct: bool) -> torch.nn.Sequential:
    """``OVERHEAD_LAYERS`` Linear layers of width 8 (one shape group) or of widths 8, 9, ...
    (a group each): K-FAC's work on them is its fixed cost per layer and per group."""
    widths = [8 + (i if distinct else 0) for i in range(OVERHEAD_LAYERS + 1)]
    return torch.nn.Sequential(
        *(torch.nn.Linear(widths[i], widths[i + 1]) for i in range(OVERHEAD_LAYERS))
    )


def _train_step(
    model: torch.nn.Module, x: torch.Tensor, optimizer: torch.optim.Optimizer, pre: Any
) -> None:
    optimizer.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    if pre is not None:
        pre.step()
    optimizer.step()


def _tiny_kfac(model: torch.nn.Module, every: int) -> Any:
    """The preconditioner ``kfac_overheads`` times on a tiny stack: the inverse method,
    factors updated every ``every`` steps (0: none, a plain step), never decomposed again."""
    from kaisa_ray import KFACPreconditioner

    if not every:
        return None
    return KFACPreconditioner(
        model,
        factor_update_steps=every,
        inv_update_steps=10**9,
        compute_method=ComputeMethod.INVERSE,
        damping=0.1,
    )


def kfac_overheads(device: torch.device, repeats: int) -> tuple[float, float, float]:
    """K-FAC's fixed seconds (hooks, Python, launches, small operations) where its
    arithmetic is negligible: (a factor update, per layer; preconditioning a step, per layer;
    per shape group besides), from whole training steps of tiny Linear stacks with
    K-FAC (``_tiny_kfac``) quiet, and updating factors every step."""
    found: dict[tuple[bool, str], float] = {}
    for distinct in (False, True):
        torch.manual_seed(0)
        model = _tiny_stack(distinct).to(device)
        x = torch.randn(4, 8, device=device)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        for label, every in (("plain", 0), ("quiet", 10**9), ("factors", 1)):
            preconditioner = _tiny_kfac(model, every)
            step = functools.partial(_train_step, model, x, optimizer, preconditioner)
            for _ in range(3):
                step()
            found[distinct, label] = median_seconds(step, device, max(repeats, 21))
            if preconditioner is not None:
                preconditioner.remove_hooks()
    layers = OVERHEAD_LAYERS
    per_group = max(0.0, found[True, "quiet"] - found[False, "quiet"]) / (layers - 1)
    per_layer = max(0.0, found[False, "quiet"] - found[False, "plain"] - per_group) / layers
    factors = max(0.0, found[True, "factors"] - found[True, "quiet"]) / layers
    return factors, per_layer, per_group


# The preconditioner ``model_kfac_host`` times: the JobSpec's curvature (its defaults).
HOST_CURVATURE: dict[str, Any] = {
    "running_average": "debiased",
    "factor_scale": "fisher",
    "pi_damping": True,
    "damping": 0.1,
    "kl_clip": None,
}
NEVER = 10**9  # an interval that never comes round again after the first step


def model_kfac_host(
    timed: ModelToTime, device: torch.device, repeats: int, where: str, *, steady: bool = False
) -> list[dict[str, Any]]:
    """``kfac_host_s`` entries of the profile: the seconds K-FAC's preconditioning (per
    compute method) and one factor update of every layer (per approximation) add to a step
    of ``timed``'s model when the host decides it: steps of one sample, whose kernels the
    device finishes before the host has launched them all (the same operations as at any
    batch; ``training_rate`` times the plain step's host time the same way). Each is a
    difference of whole-step medians: the quiet K-FAC step (factors and decompositions
    never updated after the first step) over the plain step; a step that updates every
    layer's factors (the inverse method) over the inverse method's quiet step. ``steady``:
    steps back to back (``steady_seconds``) instead of each waited for (``median_seconds``),
    for benchmarks that compare the two."""
    from kaisa_ray import KFACPreconditioner

    model, x, y = model_and_batch(timed.build, device, timed.example, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)

    def step(preconditioner: KFACPreconditioner | None) -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1)
        )
        loss.backward()  # type: ignore[no-untyped-call]
        if preconditioner is not None:
            preconditioner.step()
        optimizer.step()

    def seconds(**options: Any) -> float:
        preconditioner = KFACPreconditioner(model, **HOST_CURVATURE, **options) if options else None
        try:
            for _ in range(3):  # the first step updates the factors and decompositions
                step(preconditioner)
            timer = steady_seconds if steady else median_seconds
            return timer(functools.partial(step, preconditioner), device, repeats)
        finally:
            if preconditioner is not None:
                preconditioner.remove_hooks()

    plain = seconds()
    quiet = {
        method: seconds(compute_method=method, factor_update_steps=NEVER, inv_update_steps=NEVER)
        for method in (ComputeMethod.EIGEN.value, ComputeMethod.INVERSE.value)
    }
    found = [
        {
            "model": timed.name,
            "phase": "precondition",
            "compute_method": method,
            **measured(
                max(0.0, quiet[method] - plain),
                f"{timed.name}: what the {method} method's preconditioning adds to a "
                "one-sample step (the host's time)",
                where,
            ),
        }
        for method in quiet
    ]
    for approx in (KFACApprox.REDUCE.value, KFACApprox.EXPAND.value):
        updating = seconds(
            compute_method=ComputeMethod.INVERSE.value,
            kfac_approx=approx,
            factor_update_steps=1,
            inv_update_steps=NEVER,
        )
        found.append(
            {
                "model": timed.name,
                "phase": "factors",
                "kfac_approx": approx,
                **measured(
                    max(0.0, updating - quiet[ComputeMethod.INVERSE.value]),
                    f"{timed.name}: what a {approx} factor update of every layer adds to a "
                    "one-sample step (the host's time)",
                    where,
                ),
            }
        )
    return found
