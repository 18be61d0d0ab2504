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
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from kaisa_ray.assignment import LayerShape
from kaisa_ray.preconditioner import KFACPreconditioner
from kaisa_ray.registration import registered_layers
from tuner.cost import Profile, precondition_flops
from tuner.measure import DEFAULT_DIMS, fit_decomposition, time_collectives
from tuner.memory import TensorMemory, tensor_bytes

Batch = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


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


def profile_job(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
    *,
    steps: int = 4,
    compute_method: str = "eigen",
    kfac_options: dict[str, Any] | None = None,
) -> ProfileResult:
    """Measure a job on this rank (collective: every rank calls it with its own batches).

    Args:
        model: the model as trained (DDP-wrapped when distributed).
        optimizer: its optimizer; its state is restored afterwards.
        batch: ``batch(i)`` gives the i-th profiling batch on this rank, on any device.
        loss_fn: ``loss_fn(output, target)``.
        device: where training runs.
        steps: timed steps per phase (after one warm-up step).
        compute_method: K-FAC's ``compute_method`` (``eigen`` or ``inverse``).
        kfac_options: other ``KFACPreconditioner`` arguments that change which layers are
            registered (``skip_layers``, ``kfac_approx``).
    """
    began = time.perf_counter()
    options = dict(kfac_options or {})
    saved_model = copy.deepcopy(model.state_dict())
    saved_optimizer = copy.deepcopy(optimizer.state_dict())
    saved_rng = torch.get_rng_state()
    saved_cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None

    def one_step(preconditioner: KFACPreconditioner | None, i: int) -> None:
        x, y = batch(i)
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()  # type: ignore[no-untyped-call]
        if preconditioner is not None:
            preconditioner.step()
        optimizer.step()

    # Plain steps: time, and the peak of what they allocate on top of what already exists.
    existing = tensor_bytes(
        [*model.parameters(), *model.buffers()]
        + [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    )
    with TensorMemory(device) as memory:
        one_step(None, 0)
        times = []
        for i in range(1, steps + 1):
            _sync(device)
            start = time.perf_counter()
            one_step(None, i)
            _sync(device)
            times.append(time.perf_counter() - start)
    base_memory = existing + memory.peak_bytes
    step_s = statistics.median(times)

    # A few real K-FAC steps (factors every step, one decomposition first): phase times.
    unwrapped = model.module if isinstance(model, DistributedDataParallel) else model
    layers = tuple(
        LayerShape(name=layer.name, a_dim=layer.a_dim, g_dim=layer.g_dim, groups=layer.groups)
        for layer in registered_layers(unwrapped, **options)
    )
    preconditioner = KFACPreconditioner(
        model,
        factor_update_steps=1,
        inv_update_steps=10**6,
        compute_method=compute_method,
        grad_worker_fraction=1.0,
        **options,
    )
    one_step(preconditioner, steps + 1)  # warm-up, and the only decomposition
    preconditioner.times.reset()
    for i in range(steps + 2, 2 * steps + 2):
        one_step(preconditioner, i)
    phases = preconditioner.times.reset()
    preconditioner.remove_hooks()
    flops = sum(precondition_flops(layer, compute_method) for layer in layers)
    factor_s = phases["factors"] / steps
    precondition_s = phases["precondition"] / steps

    largest = max((max(layer.a_dim, layer.g_dim) for layer in layers), default=64)
    dims = tuple(d for d in DEFAULT_DIMS if d <= 2 * largest) or (32, 64)
    if len(dims) < 2:
        dims = (dims[0] // 2, dims[0])
    decomposition = fit_decomposition(device, compute_method, dims=dims, repeats=2)
    allreduce, broadcast = time_collectives(device)

    model.load_state_dict(saved_model)
    optimizer.load_state_dict(saved_optimizer)
    torch.set_rng_state(saved_rng)
    if saved_cuda_rng is not None:
        torch.cuda.set_rng_state_all(saved_cuda_rng)

    world = dist.get_world_size() if _distributed() else 1
    profile = Profile(
        world_size=world,
        layers=layers,
        base_memory_bytes=int(_slowest(float(base_memory), device)),
        step_s=_slowest(step_s, device),
        factor_s=_slowest(factor_s, device),
        decomposition=decomposition,
        precondition_s_per_flop=_slowest(precondition_s / flops if flops else 0.0, device),
        allreduce=allreduce,
        broadcast=broadcast,
        compute_method=compute_method,
    )
    # The decomposition fit is local: take rank 0's, so every rank holds the same profile.
    if _distributed():
        shared: list[Any] = [profile.decomposition]
        dist.broadcast_object_list(shared, src=0)
        profile = dataclasses.replace(profile, decomposition=shared[0])
    return ProfileResult(profile=profile, seconds=time.perf_counter() - began)
