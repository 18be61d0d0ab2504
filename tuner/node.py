"""Measure one node into a hardware profile (``kaisa-ray measure-node``).

``measure(base, name=...)`` times, on this machine's device: a tiny operation (the per-operation
latency), float32 (and bf16) matrix products at a ladder of sizes, ``torch.linalg.eigh`` at a
ladder of sizes, and ResNet-50's training step at batch 32 (fp32 and bf16, SGD); with several
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

from kaisa_ray.enums import Precision
from kaisa_ray.errors import ConfigurationError
from tuner.hardware import hardware_from_dict
from tuner.measure import median_seconds

MATMUL_SIZES = (64, 128, 256, 512, 1024, 4096)
EIGH_SIZES = (64, 256, 512, 1024, 2048, 4096)
QUICK_SIZES = (32, 64, 128)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def _measured(value: float, what: str, where: str) -> dict[str, Any]:
    return {"value": float(value), "kind": "measured", "source": f"{what}; {where}"}


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


def _training_rate(
    build: Callable[[], torch.nn.Module], device: torch.device, precision: str, repeats: int
) -> float:
    """Samples per second of ResNet-50 training at batch 32 (224×224, SGD with momentum)."""
    torch.manual_seed(0)
    model = build().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(32, 3, 224, 224, device=device)
    y = torch.randint(0, 1000, (32,), device=device)
    autocast = torch.autocast(
        device.type, dtype=torch.bfloat16, enabled=precision == Precision.BF16
    )

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()

    for _ in range(3):
        step()
    return 32 / median_seconds(step, device, repeats)


def measure(
    base: dict[str, Any],
    *,
    name: str,
    device: str = "cuda",
    quick: bool = False,
    ranks: int | None = None,
    resnet50: Callable[[], torch.nn.Module] | None = None,
) -> dict[str, Any]:
    """This node as a hardware profile mapping (see the module docstring).

    Args:
        base: a parsed profile whose inter-node links (and, without several GPUs, intra-node
            links) are kept.
        quick: small sizes, few repeats, no training throughput (a trial of the command).
        ranks: processes for the intra-node collectives [default: the GPUs visible; 1 on CPU].
        resnet50: builds the ResNet-50 whose training throughput is measured (the train
            layer's model; without it, or with ``quick``, the base's throughputs are kept).

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
    gpu_entry["memory_bytes"] = _measured(total, "total device memory as torch reports it", where)

    tiny = torch.ones(8, device=target)
    per_op = median_seconds(lambda: [tiny.add_(1) for _ in range(100)], target, repeats) / 100
    gpu_entry["kernel_latency_s"] = _measured(per_op, "median time of a tiny operation", where)

    rates: dict[str, list[dict[str, Any]]] = {Precision.FP32.value: []}
    generator = torch.Generator().manual_seed(0)
    for n in QUICK_SIZES if quick else MATMUL_SIZES:
        a = torch.randn(n, n, generator=generator).to(target)
        seconds = median_seconds(functools.partial(torch.matmul, a, a), target, repeats)
        rates[Precision.FP32.value].append(
            {"n": n, **_measured(2 * n**3 / seconds, f"float32 {n}x{n} matmul", where)}
        )
    if target.type == "cuda":
        n = 4096 if not quick else 256
        for precision, dtype in (
            (Precision.BF16.value, torch.bfloat16),
            (Precision.FP16.value, torch.float16),
        ):
            a = torch.randn(n, n, generator=generator).to(target, dtype)
            seconds = median_seconds(functools.partial(torch.matmul, a, a), target, repeats)
            entry = _measured(2 * n**3 / seconds, f"{precision} {n}x{n} matmul", where)
            rates[precision] = [{"n": n, **entry}]
    gpu_entry["matmul_flops_per_s"] = {**gpu_entry.get("matmul_flops_per_s", {}), **rates}
    if target.type != "cuda":  # half-precision rates of the base do not describe this device
        gpu_entry["matmul_flops_per_s"] = rates

    eigh = []
    for n in QUICK_SIZES if quick else EIGH_SIZES:
        x = torch.randn(n, n, generator=generator)
        spd = (x @ x.T / n + torch.eye(n)).to(target)
        seconds = median_seconds(
            functools.partial(torch.linalg.eigh, spd), target, max(2, repeats // 2)
        )
        eigh.append(
            {"n": n, **_measured(seconds, f"torch.linalg.eigh of a float32 {n}x{n}", where)}
        )
    gpu_entry["eigh_s"] = eigh

    count = ranks or (torch.cuda.device_count() if target.type == "cuda" else 1)
    profile["node"] = {"gpus": _measured(count, "devices measured on this node", where)}
    if count > 1:
        ar_lat, ar_bw, _, bc_bw, tiny_s = _collectives(target.type, count)
        bus = 2 * (count - 1) / count  # nccl-tests' busbw of an all-reduce
        latency = (
            _measured(ar_lat, f"all-reduce latency (a-b fit) over {count} ranks", where)
            if ar_lat > 0
            # A noisy fit's intercept can come out zero (clamped): the latency is then below
            # what the fit resolves, and the smallest all-reduce's time bounds it from above.
            else _measured(
                tiny_s,
                f"median time of a 4-byte all-reduce over {count} ranks (the a-b fit's "
                "intercept was not positive: an upper bound on the latency)",
                where,
            )
        )
        profile["links"]["intra_node"] = {
            "latency_s": latency,
            "allreduce_busbw": _measured(
                ar_bw * bus, f"all-reduce a-b fit over {count} ranks, as busbw", where
            ),
            "broadcast_busbw": _measured(bc_bw, f"broadcast a-b fit over {count} ranks", where),
        }
    if resnet50 is not None and not quick:
        training = [
            entry for entry in profile.get("training", []) if entry.get("model") != "resnet50"
        ]
        for precision in (Precision.FP32.value, Precision.BF16.value):
            rate = _training_rate(resnet50, target, precision, repeats)
            training.append(
                {
                    "model": "resnet50",
                    "precision": precision,
                    **_measured(rate, f"ResNet-50 training, batch 32, {precision}, SGD", where),
                }
            )
        profile["training"] = training
    hardware_from_dict(profile, f"the measured profile {name}")  # what we write must load
    return profile
