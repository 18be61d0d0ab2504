"""Whole gradients of layers sharded by FSDP2 (``fully_shard``), for the length of a step.

FSDP2 keeps each parameter as a ``DTensor`` sharded by rows (``Shard(0)`` on a 1-D mesh) and,
after backward, each gradient as the rank's rows of the gradient averaged over ranks. K-FAC's
factors are unchanged (the hooks see the rank's own activations and the whole weight), but
``G⁻¹ ∇W A⁻¹`` mixes rows, so a step needs each layer's whole gradient (docs/fsdp.md).

``ShardedGradients.gather`` all-gathers every registered layer's rows in one collective per
dtype and lends the whole gradients to the layers' helpers (``LayerHelper.whole``) while the
step runs exactly as under DDP; ``Wholes.write_back`` then writes each rank's rows of the
result into its shards.
The rows are ``torch.chunk``'s split (``⌈n/W⌉`` a rank, the last ranks fewer or none), the
split FSDP2 and DTensor make.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from kaisa_ray.errors import ConfigurationError
from kaisa_ray.layers import LayerHelper

FIX = "Train this model with DistributedDataParallel, or leave these layers out with skip_layers."


def _dtensor() -> type | None:
    """``DTensor`` where its module was imported (no DTensor exists otherwise)."""
    tensors = sys.modules.get("torch.distributed.tensor")
    found = getattr(tensors, "DTensor", None)
    return found if isinstance(found, type) else None


def _names(names: Sequence[str]) -> str:
    return ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")


def sharded_layers(modules: Iterable[tuple[str, nn.Module]], world_size: int) -> bool:
    """Whether the layers' parameters are sharded the way ``ShardedGradients`` takes them
    (FSDP2: every parameter of every layer a ``DTensor`` with ``Shard(0)`` on a 1-D mesh of
    all ``world_size`` ranks); False if none is a ``DTensor``. Anything else sharded (some
    layers sharded and some not, another placement, a 2-D mesh) raises ConfigurationError
    naming the layers and the fix."""
    dtensor = _dtensor()
    if dtensor is None:
        return False
    modules = list(modules)
    sharded = [
        name
        for name, module in modules
        if any(isinstance(p, dtensor) for p in module.parameters(recurse=False))
    ]
    if not sharded:
        return False
    plain = [
        name
        for name, module in modules
        if any(not isinstance(p, dtensor) for p in module.parameters(recurse=False))
    ]
    if plain:
        raise ConfigurationError(
            f"layers {_names(plain)} are not sharded while layers {_names(sharded)} are "
            "(FSDP2's fully_shard): K-FAC takes a model whose K-FAC layers are all sharded or "
            "none. Apply fully_shard to every block holding a K-FAC layer (or to the whole "
            f"model). {FIX}"
        )
    from torch.distributed.tensor import Shard

    odd = []
    for name, module in modules:
        for param in module.parameters(recurse=False):
            mesh, placements = param.device_mesh, param.placements  # type: ignore[attr-defined]
            if mesh.ndim != 1 or tuple(placements) != (Shard(0),) or mesh.size() != world_size:
                odd.append(f"{name} ({tuple(placements)} on a mesh of {tuple(mesh.shape)})")
                break
    if odd:
        raise ConfigurationError(
            f"layers {_names(odd)} are sharded in a way K-FAC does not precondition: it takes "
            f"FSDP2's rows (Shard(0)) on a 1-D mesh of all {world_size} ranks (fully_shard "
            "without a 2-D mesh or tensor parallelism; docs/fsdp.md). " + FIX
        )
    return True


def shard_layers(model: nn.Module) -> None:
    """FSDP2 as a K-FAC job applies it: ``fully_shard`` on each ``nn.Linear`` and ``nn.Conv2d``
    with parameters (a unit of its own: its gathers and frees around its own forward and
    backward), then on the whole model (the rest of the parameters)."""
    from torch.distributed.fsdp import fully_shard

    for module in model.modules():
        own = next(module.parameters(recurse=False), None)
        if isinstance(module, (nn.Linear, nn.Conv2d)) and own is not None:
            fully_shard(module)
    fully_shard(model)


def all_gather_rows(gathered: torch.Tensor, mine: torch.Tensor) -> None:
    """Every rank's ``mine`` into ``gathered``, by rank (over all ranks)."""
    # torch 2.13 names it all_gather_single (all_gather_into_tensor, now deprecated, before)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(gathered, mine)


def rows_of(rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """The first and one-past-last row rank ``rank`` holds of ``rows`` (``torch.chunk``'s split)."""
    each = -(-rows // world_size)
    start = min(rows, rank * each)
    return start, min(rows, start + each)


@dataclass(frozen=True)
class _Piece:
    helper: LayerHelper
    is_bias: bool
    shape: torch.Size  # the whole parameter's
    offset: int  # in a rank's part of the buffer, in elements
    each: int  # ⌈rows / W⌉ × the elements of a row: this piece's part of every rank's share


class ShardedGradients:
    """Whole gradients in place of FSDP2's shards during a step (the module docstring)."""

    def __init__(self, helpers: Sequence[LayerHelper], rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.helpers = list(helpers)

    def _pieces(self) -> dict[torch.dtype, list[_Piece]]:
        by_dtype: dict[torch.dtype, list[_Piece]] = {}
        offsets: dict[torch.dtype, int] = {}
        for helper in self.helpers:
            for is_bias, param in ((False, helper.weight()), (True, helper.bias())):
                if param is None or param.grad is None:
                    continue
                dtype = param.grad.dtype
                shape = param.shape
                row = shape[1:].numel()
                each = -(-shape[0] // self.world_size) * row
                offset = offsets.get(dtype, 0)
                by_dtype.setdefault(dtype, []).append(_Piece(helper, is_bias, shape, offset, each))
                offsets[dtype] = offset + each
        return by_dtype

    def gather(self) -> Wholes:
        """All-gather the layers' gradient rows (one collective per dtype) and lend each
        helper its layer's whole gradients (``LayerHelper.whole``) until ``release``."""
        wholes: dict[LayerHelper, dict[bool, torch.Tensor]] = {h: {} for h in self.helpers}
        for dtype, pieces in self._pieces().items():
            share = sum(p.each for p in pieces)
            device = _shard_grad(pieces[0].helper, pieces[0].is_bias).device
            mine = torch.zeros(share, dtype=dtype, device=device)
            for piece in pieces:
                local = _shard_grad(piece.helper, piece.is_bias).to_local()  # type: ignore[attr-defined]
                mine[piece.offset : piece.offset + local.numel()] = local.reshape(-1)
            gathered = torch.empty(self.world_size * share, dtype=dtype, device=device)
            all_gather_rows(gathered, mine)
            parts = gathered.view(self.world_size, share)
            for piece in pieces:
                row = piece.shape[1:].numel()
                blocks = []
                for rank in range(self.world_size):
                    start, end = rows_of(piece.shape[0], rank, self.world_size)
                    blocks.append(parts[rank, piece.offset : piece.offset + (end - start) * row])
                wholes[piece.helper][piece.is_bias] = torch.cat(blocks).view(piece.shape)
        lent = Wholes(self.rank, self.world_size, wholes)
        for helper, found in wholes.items():
            if False in found:
                helper.whole = (found[False], found.get(True))
        return lent


class Wholes:
    """The whole gradients lent for one step (``ShardedGradients.gather``)."""

    def __init__(
        self, rank: int, world_size: int, wholes: dict[LayerHelper, dict[bool, torch.Tensor]]
    ) -> None:
        self.rank, self.world_size, self.wholes = rank, world_size, wholes

    def release(self) -> None:
        """The helpers read their parameters' own gradients again."""
        for helper in self.wholes:
            helper.whole = None

    def write_back(self) -> None:
        """Each rank's rows of the (preconditioned) whole gradients into its shards."""
        for helper, found in self.wholes.items():
            for is_bias, whole in found.items():
                local = _shard_grad(helper, is_bias).to_local()  # type: ignore[attr-defined]
                start, end = rows_of(whole.shape[0], self.rank, self.world_size)
                local.copy_(whole[start:end])


def _shard_grad(helper: LayerHelper, is_bias: bool) -> torch.Tensor:
    """The rank's rows of a layer's weight or bias gradient (a ``DTensor``)."""
    param = helper.bias() if is_bias else helper.weight()
    grad = None if param is None else param.grad
    if grad is None:
        raise RuntimeError(f"{helper.describe()} has no gradient shard to write back.")
    return grad
