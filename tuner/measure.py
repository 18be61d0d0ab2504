"""Measurements of this hardware that the cost model is fitted to (run inside the workers).

Each function times real work at a few sizes and fits the ``tuner.cost`` model to it:
collectives between the job's own ranks (``time_collectives``), factor decompositions
(``fit_decomposition``) and preconditioning products (``precondition_rate``). They use torch
and ``torch.distributed`` only; every rank must call ``time_collectives`` together. Each call
is bounded: a few repeats at a few sizes, medians taken, so a slow outlier does not bend the
fit.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from kaisa_ray.enums import BasisUpdate, ComputeMethod
from kaisa_ray.solvers import power_qr
from tuner.cost import CubicFit, LinkFit

DEFAULT_MESSAGE_BYTES = (4 * 2**10, 256 * 2**10, 4 * 2**20, 16 * 2**20)
DEFAULT_DIMS = (64, 128, 256, 512)


def sync(device: torch.device) -> None:
    """Wait for ``device`` (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median wall seconds of ``run`` after a warm-up call, the device synchronised around."""
    run()  # warm-up: first calls pay for allocation and kernel selection
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def steady_seconds(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Mean wall seconds of ``run`` called ``repeats`` times back to back after a warm-up,
    the device synchronised once before and once after: where the host decides (a step whose
    kernels the device finishes before the host has launched the next), the host's steady
    time per call, without the wait for the device that ``median_seconds`` takes per call."""
    run()
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    sync(device)
    return (time.perf_counter() - start) / repeats


def _slowest_median(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The slowest rank's median seconds of the collective ``run``, after a barrier: every
    rank waits for the slowest, so that is what a collective costs; collective."""
    dist.barrier()
    local = median_seconds(run, device, repeats)
    worst = torch.tensor([local], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst.item())


def time_collectives(
    device: torch.device,
    sizes: Sequence[int] = DEFAULT_MESSAGE_BYTES,
    repeats: int = 5,
) -> tuple[LinkFit, LinkFit]:
    """α–β fits of float32 all-reduce and broadcast over the default group; collective.

    With one rank there is nothing to send: both fits are free (zero latency, unbounded
    bandwidth), which is what the plan's empty schedule costs.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        free = LinkFit(latency_s=0.0, bytes_per_s=float("inf"))
        return free, free
    fits = []
    for op in ("all_reduce", "broadcast"):
        seconds = []
        for nbytes in sizes:
            buffer = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=device)

            def call(buffer: torch.Tensor = buffer, op: str = op) -> None:
                if op == "all_reduce":
                    dist.all_reduce(buffer)
                else:
                    dist.broadcast(buffer, src=0)

            seconds.append(_slowest_median(call, device, repeats))
        fits.append(LinkFit.fit([float(s) for s in sizes], seconds))
    return fits[0], fits[1]


def time_tiny_allreduce(device: torch.device, repeats: int = 5) -> float:
    """The slowest rank's median seconds of a 4-byte all-reduce over the default group (an
    upper bound on the link's latency, where an α–β fit's intercept is lost in noise);
    collective."""
    tiny = torch.ones(1, dtype=torch.float32, device=device)
    return _slowest_median(lambda: dist.all_reduce(tiny), device, repeats)


def _spd(n: int, device: torch.device, generator: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, n, generator=generator).to(device)
    return x @ x.T / n + torch.eye(n, device=device)


def fit_decomposition(
    device: torch.device,
    compute_method: str = ComputeMethod.EIGEN,
    dims: Sequence[int] = DEFAULT_DIMS,
    repeats: int = 3,
    basis_update: str = BasisUpdate.EIGH,
) -> CubicFit:
    """Seconds to decompose an ``n × n`` float32 factor (``eigh``, or a Cholesky inverse), or
    with ``basis_update='power-qr'`` to refresh its eigenbasis (what every decomposition
    after the first costs then)."""
    generator = torch.Generator().manual_seed(0)
    seconds = []
    for n in dims:
        factor = _spd(n, device, generator)
        basis = torch.linalg.eigh(factor)[1]

        def decompose(f: torch.Tensor = factor, q: torch.Tensor = basis) -> object:
            if compute_method == ComputeMethod.EIGEN and basis_update == BasisUpdate.POWER_QR:
                return power_qr(f, q)
            if compute_method == ComputeMethod.EIGEN:
                return torch.linalg.eigh(f)
            return torch.cholesky_inverse(torch.linalg.cholesky(f))

        seconds.append(median_seconds(decompose, device, repeats))
    return CubicFit.fit(list(dims), seconds)


def precondition_rate(device: torch.device, a_dim: int, g_dim: int, repeats: int = 5) -> float:
    """Seconds per flop of the ``G-side @ grad @ A-side`` products at one layer's size.

    Pass the largest layer's dimensions: it dominates preconditioning, and small products
    run at a lower rate that would overstate the total if it were used for every layer.
    """
    generator = torch.Generator().manual_seed(1)
    qa = torch.randn(a_dim, a_dim, generator=generator).to(device)
    qg = torch.randn(g_dim, g_dim, generator=generator).to(device)
    grad = torch.randn(g_dim, a_dim, generator=generator).to(device)
    seconds = median_seconds(lambda: qg.T @ grad @ qa, device, repeats)
    flops = 2.0 * g_dim * a_dim * (a_dim + g_dim)
    return seconds / flops


def compute_contention(device: torch.device, size: int = 256, repeats: int = 7) -> float:
    """How much slower a rank computes when every rank computes at once than when it computes
    alone (collective; the same value on every rank, at least 1).

    About 1 when each rank has its own device or cores; about ranks ÷ cores when ranks share
    a machine's cores, as in a local Ray cluster on a laptop. The cost model uses it to see
    that work done on one rank while the others wait runs faster than work every rank does.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return 1.0
    generator = torch.Generator().manual_seed(2)
    a = torch.randn(size, size, generator=generator).to(device)

    def work() -> object:
        return [a @ a for _ in range(8)]

    dist.barrier()
    solo = median_seconds(work, device, repeats) if dist.get_rank() == 0 else 0.0
    dist.barrier()  # the others wait here while rank 0 computes alone
    together = median_seconds(work, device, repeats)
    mine = torch.tensor([together, solo], dtype=torch.float64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    ratio = statistics.median(float(t[0]) for t in every) / float(every[0][1])
    return max(1.0, ratio)
