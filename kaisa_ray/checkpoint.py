"""Per-layer checkpoint logic: complete, portable state dicts and safe restores.

A state dict holds every layer's factors and decompositions, so it loads under any world
size and strategy. Under a strategy with f < 1 a rank holds only some decompositions, so
building the state dict gathers the rest (a collective). Restoring validates everything
before changing anything: a checkpoint that does not fit leaves the preconditioner as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from kaisa_ray.assignment import Assignment
from kaisa_ray.errors import StateDictError
from kaisa_ray.kfac_layer import KFACLayer


def layer_states(
    layers: Sequence[KFACLayer],
    assignment: Assignment,
    rank: int,
    world_group: dist.ProcessGroup | None,
    *,
    gather: bool,
) -> dict[str, dict[str, Any]]:
    """Every layer's state; with ``gather``, decompositions come from a worker of each layer."""
    states = {layer.name: layer.state_dict() for layer in layers}
    if not gather:
        return states
    for layer in layers:
        src = assignment.placements[layer.name].workers[0]
        held: dict[str, torch.Tensor] = states[layer.name]["decomposition"]
        for part in layer.decomposition.saved_parts():
            if rank == src:
                tensor = held[part]
            else:
                device = layer.helper.weight().device
                tensor = torch.empty(layer.part_shape(part), dtype=layer.inv_dtype, device=device)
            dist.broadcast(tensor, src=src, group=world_group)
            held[part] = tensor
    return states


def validate(layers: Sequence[KFACLayer], state_dict: dict[str, Any]) -> None:
    """Raise ``StateDictError`` naming the problem unless ``state_dict`` fits ``layers``."""
    if "steps" not in state_dict or "layers" not in state_dict:
        raise StateDictError(
            "not a KFACPreconditioner state dict (keys 'steps' and 'layers' are missing); "
            "pass the object returned by KFACPreconditioner.state_dict()."
        )
    saved = state_dict["layers"]
    ours = {layer.name for layer in layers}
    if set(saved) != ours:
        missing, extra = sorted(ours - set(saved)), sorted(set(saved) - ours)
        raise StateDictError(
            f"checkpoint layers do not match this model: missing {missing}, unexpected "
            f"{extra}. Load it into the same model with the same skip_layers."
        )
    for layer in layers:
        for key, part in (("a_factor", "a"), ("g_factor", "g")):
            tensor = saved[layer.name].get(key)
            expected = layer.factor_shape(part)
            if tensor is not None and tuple(tensor.shape) not in _accepted(layer, part):
                raise StateDictError(
                    f"layer {layer.name!r}: checkpoint {key} has shape {tuple(tensor.shape)}, "
                    f"this model needs {expected}. Was the checkpoint saved from another model?"
                )


def _accepted(layer: KFACLayer, part: str) -> tuple[tuple[int, ...], ...]:
    """The shapes a checkpoint's factor ``part`` may have: this layer's, and for a diagonal A
    also the whole matrix that checkpoints written before it was held as its diagonal hold."""
    shape = layer.factor_shape(part)
    return (shape, (*shape, shape[-1])) if len(shape) == 2 else (shape,)


def _factor(
    layer: KFACLayer, part: str, tensor: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """A checkpoint's factor ``part`` as this layer holds it (a diagonal A written whole:
    its diagonal, the only values it has)."""
    if len(layer.factor_shape(part)) == 2 and tensor.dim() == 3:
        tensor = tensor.diagonal(dim1=-2, dim2=-1)
    return tensor.to(device, layer.factor_dtype).clone()


def restore(
    layers: Sequence[KFACLayer],
    saved: dict[str, dict[str, Any]],
    assignment: Assignment,
    rank: int,
    *,
    same_method: bool,
) -> list[KFACLayer]:
    """Install factors and this rank's decompositions; return the layers to recompute."""
    rebuild = []
    for layer in layers:
        entry = saved[layer.name]
        device = layer.helper.weight().device
        for key, part in (("a_factor", "a"), ("g_factor", "g")):
            tensor = entry.get(key)
            setattr(layer, key, None if tensor is None else _factor(layer, part, tensor, device))
        # Checkpoints from before bias correction hold factors to be used as they are.
        layer.average_weight = float(entry.get("average_weight", 1.0))
        # Staleness sketches, when measured here (a checkpoint without them, or with sketches
        # of another probe count, starts measuring at the next decomposition).
        for key in ("sketch_a", "sketch_g"):
            tensor = entry.get(key) if layer.staleness_probes else None
            if tensor is not None and tensor.shape[-1] != layer.staleness_probes:
                tensor = None
            setattr(
                layer,
                key,
                None if tensor is None else tensor.to(device, layer.factor_dtype).clone(),
            )
        decomposition = entry.get("decomposition") or {}
        if not assignment.is_grad_worker(layer.name, rank):
            layer.decomposition.clear()  # another rank preconditions this layer now
        elif same_method and decomposition:
            layer.decomposition.load(decomposition, device)
        else:
            rebuild.append(layer)
        layer.reset_batch()
    return rebuild
