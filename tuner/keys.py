"""What a profile depends on (``profile_key``), computed on the job's ranks: the tuner caches
profiles under it. Kept out of the tuner actor's module (``actor.py``), whose process then
imports no torch."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["profile_key"]


def _device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"cpu:{platform.machine()}:{os.cpu_count()}:{torch.get_num_threads()} threads"


def profile_key(
    model: nn.Module,
    sample: torch.Tensor,
    device: torch.device,
    options: dict[str, Any],
) -> str:
    """What a profile depends on, hashed; the same on every rank (collective when distributed).

    Args:
        model: the model as trained (its class, parameter and buffer shapes and dtypes).
        sample: one training batch's input on this rank (its shape and dtype).
        device: where training runs (its kind, name and the threads it uses).
        options: K-FAC options that change the work (compute method, approximation, ...).
    """
    shapes = [
        (name, list(tensor.shape), str(tensor.dtype))
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]
    ]
    here = {"host": socket.gethostname(), "device": _device_description(device)}
    world = [here]
    if dist.is_available() and dist.is_initialized():
        world = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(world, here)
    hosts: dict[str, int] = {}
    for entry in world:
        hosts[entry["host"]] = hosts.get(entry["host"], 0) + 1
    described = {
        "model": type(model).__name__,
        "shapes": shapes,
        "batch": [list(sample.shape), str(sample.dtype)],
        "options": {k: options[k] for k in sorted(options)},
        "workers": len(world),
        "workers_per_node": sorted(hosts.values()),
        "devices": sorted({entry["device"] for entry in world}),
        "torch": torch.__version__,
    }
    text = json.dumps(described, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]
