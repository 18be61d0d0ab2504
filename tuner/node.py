"""Measure one node into a hardware profile (``kaisa-ray measure-node``).

``measure(base, name=...)`` times, on this machine's device: a tiny operation (the per-operation
latency), float32 (and bf16, and on CUDA float32 at matmul precision 'high': TF32) matrix
products at a ladder of sizes, ``torch.linalg.eigh`` at a ladder of sizes, K-FAC's own
decompositions (``kaisa_ray.decomposition``'s batched eigen and Cholesky-inverse solvers, as
``kaisa_ray.batching.decompose`` calls them) of one factor and of a batch of factors at a
ladder of sizes, and ResNet-50's training step at batch 32 (fp32 and bf16, SGD), and
optionally the training steps of other registered models (with their factor work and, on a
GPU, K-FAC's host costs on each: ``tuner.node_training``); with several
GPUs (or ``ranks`` CPU processes over gloo, to try it out) the intra-node all-reduce and
broadcast between them (``tuner.measure.time_collectives``, turned into nccl-tests' bus
bandwidth). It returns the profile as a mapping in the file format of ``tuner.hardware``:
every measured number is ``kind: measured`` with the machine, the date and the torch version
in its ``source``; what a single node cannot measure (the links between nodes) is kept from
``base`` with its own sources. The caller writes it as YAML.
"""

from __future__ import annotations

import copy
import datetime
import functools
import os
import platform
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kaisa_ray.enums import ComputeMethod, Precision
from kaisa_ray.errors import ConfigurationError
from tuner.hardware_file import hardware_from_dict
from tuner.measure import median_seconds
from tuner.node_kfac import OVERHEAD_LAYERS, kfac_overheads, model_kfac_host
from tuner.node_training import (
    ModelToTime,
    measured,
    model_factor_work,
    training_entry,
    training_rate,
)

MATMUL_SIZES = (64, 128, 256, 512, 1024, 4096)
EIGH_SIZES = (64, 256, 512, 1024, 2048, 4096)
DECOMPOSE_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)
DECOMPOSE_BATCH = 8  # factors of one size decomposed together (K-FAC batches a size's factors)
QUICK_SIZES = (32, 64, 128)


def _spd(n: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` symmetric positive definite ``n × n`` matrices, as a batch of K-FAC factors
    ``(count, 1, n, n)``: a covariance of 2n random rows plus a small ridge."""
    x = torch.randn(count, 2 * n, n, generator=generator)
    return (x.transpose(-1, -2) @ x / (2 * n) + 1e-3 * torch.eye(n)).unsqueeze(1)


def _ladder(sizes: tuple[int, ...], quick: bool, largest: int | None) -> tuple[int, ...]:
    chosen = QUICK_SIZES if quick else sizes
    return tuple(n for n in chosen if largest is None or n <= largest) or chosen[:1]


def extraction_rate(device: torch.device, repeats: int, quick: bool = False) -> float:
    """Elements per second of K-FAC's factor extraction: the position sums of a 3×3
    convolution's input (``Conv2dHelper.position_sums``, the ``reduce`` factors' work; the
    input's elements times its kernel rows counted), on a reference input of 32 × 64 × 32 × 32
    (8 × 16 × 16 × 16 with ``quick``)."""
    from kaisa_ray.conv_layers import Conv2dHelper

    n, c, side = (8, 16, 16) if quick else (32, 64, 32)
    helper = Conv2dHelper(torch.nn.Conv2d(c, c, 3, padding=1).to(device))
    x = torch.randn(n, c, side, side, device=device)
    seconds = median_seconds(functools.partial(helper.position_sums, x), device, repeats)
    return x.numel() * 3 / seconds


def decomposition_times(
    device: torch.device, sizes: tuple[int, ...], repeats: int, batch: int = DECOMPOSE_BATCH
) -> dict[str, list[tuple[int, int, float]]]:
    """Per method, ``(n, count, seconds per factor)`` of K-FAC's own solvers on float32
    factors: one factor alone and ``batch`` at once (larger sizes: as many as fit the memory
    of ``batch`` factors of 1024, at least 2), damping 1e-3."""
    from kaisa_ray.decomposition import EigenDecomposition, InverseDecomposition

    generator = torch.Generator().manual_seed(0)
    found: dict[str, list[tuple[int, int, float]]] = {m.value: [] for m in ComputeMethod}
    for n in sizes:
        many = max(2, min(batch, batch * 1024**2 // n**2))
        for count in (1, many):
            factors = _spd(n, count, generator).to(device)
            for method, solver in (
                (ComputeMethod.EIGEN.value, EigenDecomposition.solve_many),
                (ComputeMethod.INVERSE.value, InverseDecomposition.solve_many),
            ):
                seconds = median_seconds(
                    functools.partial(solver, factors, [1e-3] * count),
                    device,
                    max(2, repeats // 2),
                )
                found[method].append((n, count, seconds / count))
    return found


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def _collective_worker(rank: int, world: int, port: int, device_type: str, out: Any) -> None:
    from tuner.measure import time_collectives, time_tiny_allreduce

    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        device = torch.device(f"cuda:{rank}") if device_type == "cuda" else torch.device("cpu")
        if device_type == "cuda":
            torch.cuda.set_device(device)
        allreduce, broadcast = time_collectives(device)
        tiny_s = time_tiny_allreduce(device)
        if rank == 0:
            out.put(
                (
                    allreduce.latency_s,
                    allreduce.bytes_per_s,
                    broadcast.latency_s,
                    broadcast.bytes_per_s,
                    tiny_s,
                )
            )
    finally:
        dist.destroy_process_group()


def _collectives(device_type: str, ranks: int) -> tuple[float, float, float, float, float]:
    """(all-reduce latency, algorithm bytes/s, broadcast latency, bytes/s, a 4-byte
    all-reduce's seconds) between ``ranks`` processes on this node."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    mp.spawn(  # type: ignore[attr-defined,no-untyped-call]
        _collective_worker, args=(ranks, port, device_type, queue), nprocs=ranks, join=True
    )
    result: tuple[float, float, float, float, float] = queue.get()
    return result


def measure(
    base: dict[str, Any],
    *,
    name: str,
    device: str = "cuda",
    quick: bool = False,
    ranks: int | None = None,
    resnet50: Callable[[], torch.nn.Module] | None = None,
    models: tuple[ModelToTime, ...] = (),
    largest: int | None = None,
) -> dict[str, Any]:
    """This node as a hardware profile mapping (see the module docstring).

    Args:
        base: a parsed profile whose inter-node links (and, without several GPUs, intra-node
            links) are kept.
        quick: small sizes, few repeats, no training throughput (a trial of the command).
        ranks: processes for the intra-node collectives [default: the GPUs visible; 1 on CPU].
        resnet50: builds the ResNet-50 whose training throughput is measured (the train
            layer's model; without it, or with ``quick``, the base's throughputs are kept).
        largest: leave out sizes above this from the ladders (a CPU's small models).
        models: more models whose fp32 training throughput is measured at their batch size
            (also with ``quick``), each replacing the base's entries for that model.

    Raises:
        ConfigurationError: ``device`` is cuda and there is no GPU.
    """
    hardware_from_dict(base, "the base profile")  # a valid base, or say why not
    target = torch.device(device)
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ConfigurationError(
            "no CUDA device here: measure-node measures a GPU node, so run it on one "
            "(or pass --device cpu to try the command out)"
        )
    gpu = _device_name(target)
    stamp = datetime.date.today().isoformat()
    where = (
        f"measured by kaisa-ray measure-node on {gpu}, host {socket.gethostname()}, {stamp}, "
        f"torch {torch.__version__}"
    )
    repeats = 5 if quick else 10
    profile = copy.deepcopy(base)
    profile["name"] = name
    profile["description"] = f"{gpu}: measured {stamp}; links between nodes from {base['name']}"
    gpu_entry = profile["gpu"]
    gpu_entry["name"] = gpu
    if target.type == "cuda":
        total = torch.cuda.get_device_properties(target).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    gpu_entry["memory_bytes"] = measured(total, "total device memory as torch reports it", where)

    # The models' steps first: after the large products and decompositions below, LeNet's
    # step measured 1.45x slower on this CPU in one run (1.05x when timed first).
    hosted: set[str] = set()
    for timed in models:
        found = training_rate(  # a small model's step is short: more repeats
            timed.build, target, Precision.FP32.value, 3 * repeats, timed.example, timed.batch
        )
        profile["kernels"] = [
            *(
                k
                for k in profile.get("kernels", [])
                if (k.get("model"), k.get("batch")) != (timed.name, timed.batch)
            ),
            *model_factor_work(timed, target, repeats, where),
        ]
        # K-FAC's host costs on the model (one-sample steps: any batch's); on a CPU the host
        # is the device, and one sample says little of a batch
        if target.type == "cuda" and timed.name not in hosted:
            hosted.add(timed.name)
            profile["kfac_host_s"] = [
                *(h for h in profile.get("kfac_host_s", []) if h.get("model") != timed.name),
                *model_kfac_host(timed, target, 3 * repeats, where),
            ]
        profile["training"] = [
            *(t for t in profile.get("training", []) if t.get("model") != timed.name),
            training_entry(
                timed.name,
                Precision.FP32.value,
                found,
                f"{timed.name} training, batch {timed.batch}, fp32, SGD",
                where,
            ),
        ]
    tiny = torch.ones(8, device=target)
    per_op = median_seconds(lambda: [tiny.add_(1) for _ in range(100)], target, repeats) / 100
    gpu_entry["kernel_latency_s"] = measured(per_op, "median time of a tiny operation", where)

    rates: dict[str, list[dict[str, Any]]] = {Precision.FP32.value: []}
    generator = torch.Generator().manual_seed(0)
    for n in _ladder(MATMUL_SIZES, quick, largest):
        a = torch.randn(n, n, generator=generator).to(target)
        seconds = median_seconds(functools.partial(torch.matmul, a, a), target, repeats)
        rates[Precision.FP32.value].append(
            {"n": n, **measured(2 * n**3 / seconds, f"float32 {n}x{n} matmul", where)}
        )
    if target.type == "cuda":
        n = 4096 if not quick else 256
        for precision, dtype in (
            (Precision.BF16.value, torch.bfloat16),
            (Precision.FP16.value, torch.float16),
        ):
            a = torch.randn(n, n, generator=generator).to(target, dtype)
            seconds = median_seconds(functools.partial(torch.matmul, a, a), target, repeats)
            entry = measured(2 * n**3 / seconds, f"{precision} {n}x{n} matmul", where)
            rates[precision] = [{"n": n, **entry}]
    if target.type == "cuda":  # float32 products at precision 'high': TF32 tensor cores
        before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high")
        try:
            rates["tf32"] = []
            for n in _ladder(MATMUL_SIZES, quick, largest):
                a = torch.randn(n, n, generator=generator).to(target)
                seconds = median_seconds(functools.partial(torch.matmul, a, a), target, repeats)
                entry = measured(2 * n**3 / seconds, f"float32 {n}x{n} matmul, TF32", where)
                rates["tf32"].append({"n": n, **entry})
        finally:
            torch.set_float32_matmul_precision(before)
    gpu_entry["matmul_flops_per_s"] = {**gpu_entry.get("matmul_flops_per_s", {}), **rates}
    if target.type != "cuda":  # half-precision rates of the base do not describe this device
        gpu_entry["matmul_flops_per_s"] = rates

    eigh = []
    for n in _ladder(EIGH_SIZES, quick, largest):
        x = torch.randn(n, n, generator=generator)
        spd = (x @ x.T / n + torch.eye(n)).to(target)
        seconds = median_seconds(
            functools.partial(torch.linalg.eigh, spd), target, max(2, repeats // 2)
        )
        eigh.append({"n": n, **measured(seconds, f"torch.linalg.eigh of a float32 {n}x{n}", where)})
    gpu_entry["eigh_s"] = eigh
    factors, per_layer, per_group = kfac_overheads(target, repeats)
    stack = f"{OVERHEAD_LAYERS} Linear layers of width 8"
    gpu_entry["kfac_overhead_s"] = {
        "factors_per_layer": measured(
            factors, f"a factor update's fixed cost per layer, from {stack}", where
        ),
        "precondition_per_layer": measured(
            per_layer, f"a quiet K-FAC step's fixed cost per layer, from {stack}", where
        ),
        "precondition_per_group": measured(
            per_group, f"a quiet K-FAC step's fixed cost per shape group, from {stack}", where
        ),
    }
    gpu_entry["extract_elements_per_s"] = measured(
        extraction_rate(target, repeats, quick),
        "K-FAC's position sums of a 3x3 convolution's input (elements x kernel rows)",
        where,
    )
    solved = decomposition_times(target, _ladder(DECOMPOSE_SIZES, quick, largest), repeats)
    gpu_entry["decompose_s"] = {
        method: [
            {
                "n": n,
                "count": count,
                **measured(
                    seconds,
                    f"K-FAC's {method} solver, float32 {n}x{n}, "
                    + ("one factor alone" if count == 1 else f"per factor of {count} at once"),
                    where,
                ),
            }
            for n, count, seconds in rows
        ]
        for method, rows in solved.items()
    }

    count = ranks or (torch.cuda.device_count() if target.type == "cuda" else 1)
    profile["node"] = {"gpus": measured(count, "devices measured on this node", where)}
    if count > 1:
        ar_lat, ar_bw, _, bc_bw, tiny_s = _collectives(target.type, count)
        bus = 2 * (count - 1) / count  # nccl-tests' busbw of an all-reduce
        latency = (
            measured(ar_lat, f"all-reduce latency (a-b fit) over {count} ranks", where)
            if ar_lat > 0
            # A noisy fit's intercept can come out zero (clamped): the latency is then below
            # what the fit resolves, and the smallest all-reduce's time bounds it from above.
            else measured(
                tiny_s,
                f"median time of a 4-byte all-reduce over {count} ranks (the a-b fit's "
                "intercept was not positive: an upper bound on the latency)",
                where,
            )
        )
        profile["links"]["intra_node"] = {
            "latency_s": latency,
            "allreduce_busbw": measured(
                ar_bw * bus, f"all-reduce a-b fit over {count} ranks, as busbw", where
            ),
            "broadcast_busbw": measured(bc_bw, f"broadcast a-b fit over {count} ranks", where),
        }
    if resnet50 is not None and not quick:
        training = [
            entry for entry in profile.get("training", []) if entry.get("model") != "resnet50"
        ]
        for precision in (Precision.FP32.value, Precision.BF16.value):
            found = training_rate(resnet50, target, precision, repeats)
            training.append(
                training_entry(
                    "resnet50",
                    precision,
                    found,
                    f"ResNet-50 training, batch 32, {precision}, SGD",
                    where,
                )
            )
        profile["training"] = training
    hardware_from_dict(profile, f"the measured profile {name}")  # what we write must load
    return profile
