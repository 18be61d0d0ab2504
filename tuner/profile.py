"""Profiling a job on its own workers, before training: what ``tuner.cost`` needs.

``profile_job`` runs on every rank of the job (it is collective), on the real model, optimizer
and batches. It measures the plain step, the base memory, K-FAC's factor and preconditioning
time (from a few real K-FAC steps, phase by phase), fits decomposition time and the
collectives between these ranks, and then puts the model, optimizer and RNG back exactly as
they were: profiling changes nothing about the training that follows. Every rank returns the
same ``Profile`` (times and memory are the slowest rank's).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from kaisa_ray.amp import MixedPrecision, optimizer_step
from kaisa_ray.assignment import LayerShape
from kaisa_ray.enums import BasisUpdate, ComputeMethod, FactorReduction, Scaling
from kaisa_ray.preconditioner import KFACPreconditioner
from kaisa_ray.registration import registered_layers
from kaisa_ray.strategy import placeable_fractions
from tuner.cost import Profile, precondition_flops
from tuner.measure import (
    DEFAULT_DIMS,
    compute_contention,
    fit_decomposition,
    time_collectives,
)
from tuner.memory import TensorMemory

Batch = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
REGISTRATION_OPTIONS = ("skip_layers", "kfac_approx", "factor_dtype", "inv_dtype", "embeddings")


@dataclass(frozen=True, kw_only=True)
class ProfileResult:
    profile: Profile
    seconds: float  # wall time profiling took on this rank


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _slowest(value: float, device: torch.device) -> float:
    if not _distributed():
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class _Trainee:
    """One rank's training step, and what it holds, for profiling and measuring."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: Batch
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    device: torch.device
    precision: MixedPrecision = field(default_factory=MixedPrecision)

    def __post_init__(self) -> None:
        self.scaler = self.precision.grad_scaler()

    def step(self, preconditioner: KFACPreconditioner | None, i: int) -> None:
        """One training step, as the train loop takes it (autocast, GradScaler)."""
        x, y = self.batch(i)
        x, y = x.to(self.device), y.to(self.device)
        self.optimizer.zero_grad(set_to_none=True)
        with self.precision.autocast():
            loss = self.loss_fn(self.model(x), y)
        optimizer_step(loss, self.optimizer, preconditioner, self.scaler)

    def kfac(self, **options: Any) -> KFACPreconditioner:
        """A preconditioner on this model that unscales fp16 gradients like training's."""
        return KFACPreconditioner(self.model, grad_scaler=self.scaler, **options)

    def held(self) -> list[torch.Tensor]:
        """What training holds between steps: parameters, buffers, gradients, optimizer state."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        state = [t for entry in self.optimizer.state.values() for t in entry.values()]
        return [
            *self.model.parameters(),
            *self.model.buffers(),
            *grads,
            *filter(torch.is_tensor, state),
        ]

    def save(self) -> Callable[[], None]:
        """Snapshot the model, optimizer and RNG; the returned function puts them back."""
        model = copy.deepcopy(self.model.state_dict())
        optimizer = copy.deepcopy(self.optimizer.state_dict())
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None

        def restore() -> None:
            self.model.load_state_dict(model)
            self.optimizer.load_state_dict(optimizer)
            torch.set_rng_state(rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)

        return restore

    def sync(self) -> None:
        _sync(self.device)


def profile_job(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
    *,
    steps: int = 4,
    compute_method: str = ComputeMethod.EIGEN,
    kfac_options: dict[str, Any] | None = None,
    precision: MixedPrecision | None = None,
) -> ProfileResult:
    """Measure a job on this rank (collective: every rank calls it with its own batches).

    Args:
        model: the model as trained (DDP-wrapped when distributed, or sharded by FSDP2).
        optimizer: its optimizer; its state is restored afterwards.
        batch: ``batch(i)`` gives the i-th profiling batch on this rank, on any device.
        loss_fn: ``loss_fn(output, target)``.
        device: where training runs.
        steps: timed steps per phase (after the counted warm-up steps).
        compute_method: K-FAC's ``compute_method`` (``eigen`` or ``inverse``).
        kfac_options: other ``KFACPreconditioner`` arguments: those that change which layers
            are registered (``skip_layers``, ``kfac_approx``) and those that change the work
            (the curvature options, ``measure_staleness``).
        precision: autocast and gradient scaling, as training uses them (default fp32).
    """
    began = time.perf_counter()
    options = dict(kfac_options or {})
    trainee = _Trainee(model, optimizer, batch, loss_fn, device, precision or MixedPrecision())
    restore = trainee.save()

    # Plain steps: the peak of two (the first creates the optimizer state), then timed ones
    # outside the count, since counting CPU allocations slows every operation.
    with TensorMemory(device, existing=trainee.held()) as memory:
        trainee.step(None, 0)
        trainee.step(None, 1)
    base_memory = memory.peak_bytes
    times = []
    for i in range(2, steps + 2):
        trainee.sync()
        start = time.perf_counter()
        trainee.step(None, i)
        trainee.sync()
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times)

    # A few real K-FAC steps (factors every step, decompositions at the first two): phases.
    unwrapped = model.module if isinstance(model, DistributedDataParallel) else model
    # Which layers register depends on these options only (the curvature options do not).
    registering = {k: v for k, v in options.items() if k in REGISTRATION_OPTIONS}
    layers = tuple(
        LayerShape(
            name=layer.name,
            a_dim=layer.a_dim,
            g_dim=layer.g_dim,
            groups=layer.groups,
            diagonal_a=layer.diagonal_a,
        )
        for layer in registered_layers(unwrapped, **registering)
    )
    preconditioner = trainee.kfac(
        factor_update_steps=1,
        inv_update_steps=lambda step: 1 if step < 2 else 10**6,  # decompose at steps 0 and 1
        compute_method=compute_method,
        grad_worker_fraction=1.0,
        **options,
    )
    parallel = preconditioner.plan.options.parallel  # FSDP2 where the model is sharded
    # The warm-up step allocates the K-FAC state and decomposes once. The next one updates
    # the factors and decomposes them again, as every inverse-update step of training does
    # (old decompositions live until new ones replace them). Its peak over the base and the
    # state is K-FAC's transient memory: activations the hooks keep, batch factors,
    # decomposition workspace, communication buffers.
    with TensorMemory(device, existing=trainee.held()) as memory:
        trainee.step(preconditioner, steps + 2)
        state_bytes = preconditioner.memory_usage()["total"]
        memory.reset_peak()
        trainee.step(preconditioner, steps + 3)
    transient = memory.peak_bytes - base_memory - state_bytes
    preconditioner.times.reset()
    for i in range(steps + 4, 2 * steps + 4):
        trainee.step(preconditioner, i)
    phases = preconditioner.times.reset()
    preconditioner.remove_hooks()
    by_fraction = _transients_by_fraction(
        trainee, 2 * steps + 4, base_memory, compute_method, options
    )
    flops = sum(precondition_flops(layer, compute_method) for layer in layers)
    factor_s = phases["factors"] / steps
    precondition_s = phases["precondition"] / steps

    largest = max((layer.largest_solve for layer in layers), default=64)
    dims = tuple(d for d in DEFAULT_DIMS if d <= 2 * largest) or (32, 64)
    if len(dims) < 2:
        dims = (dims[0] // 2, dims[0])
    decomposition = fit_decomposition(
        device,
        compute_method,
        dims=dims,
        repeats=2,
        basis_update=str(options.get("basis_update", BasisUpdate.EIGH)),
    )
    allreduce, broadcast = time_collectives(device)
    contention = compute_contention(device)

    restore()

    world = dist.get_world_size() if _distributed() else 1
    profile = Profile(
        world_size=world,
        layers=layers,
        base_memory_bytes=int(_slowest(float(base_memory), device)),
        kfac_transient_bytes=int(_slowest(float(max(transient, 0)), device)),
        kfac_transient_by_fraction=by_fraction,
        step_s=_slowest(step_s, device),
        factor_s=_slowest(factor_s, device),
        decomposition=decomposition,
        precondition_s_per_flop=_slowest(precondition_s / flops if flops else 0.0, device),
        allreduce=allreduce,
        broadcast=broadcast,
        compute_method=compute_method,
        scaling=str(options.get("scaling", Scaling.KRONECKER)),
        factor_reduction=str(options.get("factor_reduction", FactorReduction.EVERY_UPDATE)),
        parallel=str(parallel),
        contention=contention,
    )
    # The decomposition fit is local: take rank 0's, so every rank holds the same profile.
    if _distributed():
        shared: list[Any] = [profile.decomposition]
        dist.broadcast_object_list(shared, src=0)
        profile = dataclasses.replace(profile, decomposition=shared[0])
    return ProfileResult(profile=profile, seconds=time.perf_counter() - began)


def _transients_by_fraction(
    trainee: _Trainee,
    batch: int,
    base_memory: int,
    compute_method: str,
    options: dict[str, Any],
) -> tuple[tuple[float, int], ...]:
    """K-FAC's temporaries over its state under every ``grad_worker_fraction`` (collective):
    for each, a warm-up step and an inverse-update step counted as in ``profile_job``, and
    what the worst rank's peak holds over the base and the worst rank's state, so that base +
    this + the plan's worst state is the worst rank's peak. (Which collectives a step makes,
    and so which buffers are in flight beside the state, depends on the fraction.)"""
    if not _distributed():
        return ()
    found = []
    scaling = options.get("scaling", Scaling.KRONECKER)
    for fraction in placeable_fractions(dist.get_world_size(), scaling):
        preconditioner = trainee.kfac(
            factor_update_steps=1,
            inv_update_steps=lambda step: 1 if step < 2 else 10**6,
            compute_method=compute_method,
            grad_worker_fraction=fraction,
            **options,
        )
        with TensorMemory(trainee.device, existing=trainee.held()) as memory:
            trainee.step(preconditioner, batch)
            state = preconditioner.memory_usage()["total"]
            memory.reset_peak()
            trainee.step(preconditioner, batch + 1)
        preconditioner.remove_hooks()
        peak = _slowest(float(memory.peak_bytes), trainee.device)
        worst_state = _slowest(float(state), trainee.device)
        base = _slowest(float(base_memory), trainee.device)
        found.append((fraction, int(max(peak - base - worst_state, 0))))
    return tuple(found)


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """One candidate strategy measured on the job's workers (the slowest rank's figures)."""

    grad_worker_fraction: float
    factor_update_steps: int
    inv_update_steps: int
    memory_bytes: int  # peak tensor bytes held by a worker, the worst rank's
    step_s: float  # seconds per step over whole inverse-update periods, the slowest rank's
    steps: int  # steps timed


def measure_candidate(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
    *,
    grad_worker_fraction: float,
    factor_update_steps: int,
    inv_update_steps: int,
    min_steps: int = 50,
    count_memory: bool = True,
    kfac_options: dict[str, Any] | None = None,
    precision: MixedPrecision | None = None,
) -> Measurement:
    """Train with one candidate strategy and measure it (collective, like ``profile_job``).

    Memory: the peak of everything a worker holds (parameters, gradients, optimizer and K-FAC
    state, activations, temporaries) over the first ``inv_update_steps + 1`` steps, which
    include a re-decomposition. Time: the following whole inverse-update periods (at least
    ``min_steps`` steps), so factor and decomposition work is amortized exactly as in
    training. Without ``count_memory`` (``memory_bytes`` is then 0) one step replaces the
    counted ones: any ``inv_update_steps`` consecutive steps hold one decomposition. The
    model, optimizer and RNG are put back afterwards.
    """
    trainee = _Trainee(model, optimizer, batch, loss_fn, device, precision or MixedPrecision())
    restore = trainee.save()
    first = inv_update_steps + 1 if count_memory else 1
    with TensorMemory(device, existing=trainee.held()) if count_memory else nullcontext() as memory:
        preconditioner = trainee.kfac(
            factor_update_steps=factor_update_steps,
            inv_update_steps=inv_update_steps,
            grad_worker_fraction=grad_worker_fraction,
            **(kfac_options or {}),
        )
        for i in range(first):
            trainee.step(preconditioner, i)
    timed = inv_update_steps * max(1, math.ceil(min_steps / inv_update_steps))
    trainee.sync()
    start = time.perf_counter()
    for i in range(first, first + timed):
        trainee.step(preconditioner, i)
    trainee.sync()
    elapsed = time.perf_counter() - start
    preconditioner.remove_hooks()
    restore()
    return Measurement(
        grad_worker_fraction=preconditioner.grad_worker_fraction,
        factor_update_steps=factor_update_steps,
        inv_update_steps=inv_update_steps,
        memory_bytes=int(_slowest(float(memory.peak_bytes if memory else 0), device)),
        step_s=_slowest(elapsed / timed, device),
        steps=timed,
    )
