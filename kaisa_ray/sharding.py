"""Whole gradients of layers sharded by FSDP2 (``fully_shard``), for the length of a step.

FSDP2 keeps each parameter as a ``DTensor`` sharded by rows (``Shard(0)`` on a 1-D mesh) and,
after backward, each gradient as the rank's rows of the gradient averaged over ranks. K-FAC's
factors are unchanged (the hooks see the rank's own activations and the whole weight), but
``G⁻¹ ∇W A⁻¹`` mixes rows, so a step needs each layer's whole gradient (docs/fsdp.md).

Under COMM-OPT (every rank a gradient worker of every layer) ``ShardedGradients.gather``
all-gathers every registered layer's rows in one collective per dtype and lends the whole
gradients to the layers' helpers (``LayerHelper.whole``) while the step runs exactly as under
DDP; ``Wholes.write_back`` then writes each rank's rows of the result into its shards.

With fewer gradient workers than ranks (MEM-OPT, HYBRID-OPT: ``plan.rows_mode``)
``RowExchange`` gathers each layer's rows only to its workers (to the row's worker, then, under
HYBRID-OPT, among the column's workers), which precondition the whole gradient and scatter each
rank of their row its rows of the result; every rank then clips and sets its own rows, the KL
clip's sums added up over ranks. No rank but a layer's workers holds its whole gradient.

The rows are ``torch.chunk``'s split (``⌈n/W⌉`` a rank, the last ranks fewer or none), the
split FSDP2 and DTensor make; every collective moves ``⌈n/W⌉`` rows a rank, padded.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from kaisa_ray.apply import finite_flags
from kaisa_ray.buckets import Bucket
from kaisa_ray.comm import Communicator, torch_dtype
from kaisa_ray.enums import ShardUnits
from kaisa_ray.errors import ConfigurationError
from kaisa_ray.layers import LayerHelper
from kaisa_ray.plan import Plan
from kaisa_ray.schedule import rows_mode

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


def shard_layers(
    model: nn.Module, units: ShardUnits | str = ShardUnits.LAYERS, *, bf16: bool = False
) -> None:
    """FSDP2 as a K-FAC job applies it: ``fully_shard`` on each unit (``ShardUnits``: by
    default each ``nn.Linear`` and ``nn.Conv2d`` with parameters, a unit of its own: its
    gathers and frees around its own forward and backward), then on the whole model (the
    rest of the parameters). With ``bf16``, FSDP2's mixed precision as its users run it
    (``MixedPrecisionPolicy``): parameters gathered and computed in bfloat16, gradients
    reduced in float32, the shards, the optimizer and the model's output in float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = root = MixedPrecisionPolicy()
    if bf16:  # the units' outputs stay bfloat16 between them; the model's is float32
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        root = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
        )
    units = ShardUnits(units)
    if units is ShardUnits.LAYERS:
        for module in model.modules():
            own = next(module.parameters(recurse=False), None)
            if isinstance(module, (nn.Linear, nn.Conv2d)) and own is not None:
                fully_shard(module, mp_policy=policy)
    elif units is ShardUnits.BLOCKS:
        for child in model.children():
            if next(child.parameters(), None) is not None:
                fully_shard(child, mp_policy=policy)
    fully_shard(model, mp_policy=root)


def all_gather_rows(
    gathered: torch.Tensor, mine: torch.Tensor, group: dist.ProcessGroup | None = None
) -> None:
    """Every member's ``mine`` into ``gathered``, by rank (over all ranks, or ``group``)."""
    # torch 2.13 names it all_gather_single (all_gather_into_tensor, now deprecated, before)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(gathered, mine, group=group)


def gather_rows(
    mine: torch.Tensor, parts: list[torch.Tensor] | None, dst: int, group: dist.ProcessGroup | None
) -> None:
    """Every member's ``mine`` into ``parts`` (by the group's order) on ``dst``, a global
    rank; ``parts`` is None elsewhere."""
    dist.gather(mine, parts, dst=dst, group=group)


def scatter_rows(
    mine: torch.Tensor, parts: list[torch.Tensor] | None, src: int, group: dist.ProcessGroup | None
) -> None:
    """Each member's part of ``parts`` (by the group's order, given on ``src``, a global rank)
    into its ``mine``."""
    dist.scatter(mine, parts, src=src, group=group)


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


class _Rows:
    """One layer's gradient as FSDP2 splits it: ``rows`` rows of ``width`` elements (the
    weight's row, then the bias's element), ``each`` rows a rank in the collectives."""

    def __init__(self, helper: LayerHelper, rank: int, world_size: int) -> None:
        weight = helper.weight()
        self.helper = helper
        self.rows = weight.shape[0]
        self.weight_width = weight.shape[1:].numel()
        self.width = self.weight_width + (1 if helper.bias() is not None else 0)
        self.each = -(-self.rows // world_size)
        self.world_size = world_size
        start, end = rows_of(self.rows, rank, world_size)
        self.mine = end - start

    def local(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's rows of the weight's and the bias's gradients (FSDP2's own storage)."""
        weight = _shard_grad(self.helper, False).to_local()  # type: ignore[attr-defined]
        bias = None
        if self.helper.bias() is not None:
            bias = _shard_grad(self.helper, True).to_local()  # type: ignore[attr-defined]
        return weight, bias

    def matrix(self) -> torch.Tensor:
        """This rank's rows as ``(mine, width)`` (a copy)."""
        weight, bias = self.local()
        rows = weight.reshape(self.mine, self.weight_width)
        return rows if bias is None else torch.cat([rows, bias.reshape(-1, 1)], dim=1)

    def put(self, slot: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """``rows`` (``(n, width)``, at most ``each``; default: this rank's) into a flat slot
        of ``each × width`` elements, zeros after them."""
        square = slot.view(self.each, self.width)
        if rows is None:
            weight, bias = self.local()
            square[: self.mine, : self.weight_width] = weight.reshape(self.mine, self.weight_width)
            if bias is not None:
                square[: self.mine, self.weight_width] = bias
            square[self.mine :] = 0
        else:
            square[: rows.shape[0]] = rows
            square[rows.shape[0] :] = 0

    def lend_whole(self, shares: torch.Tensor) -> None:
        """Lend the helper the whole weight and bias gradients, put together from every
        rank's padded share ``(W, each, width)``."""
        weight = shares.new_empty(self.rows, self.weight_width)
        bias = shares.new_empty(self.rows) if self.width > self.weight_width else None
        for rank in range(self.world_size):
            start, end = rows_of(self.rows, rank, self.world_size)
            weight[start:end] = shares[rank, : end - start, : self.weight_width]
            if bias is not None:
                bias[start:end] = shares[rank, : end - start, self.weight_width]
        self.helper.whole = (weight.view(self.helper.weight().shape), bias)


class RowExchange:
    """FSDP2's gradient rows with fewer gradient workers than ranks (the module docstring):
    one rank's part of the plan's ``rows_mode`` collectives."""

    def __init__(
        self,
        helpers: Mapping[str, LayerHelper],
        buckets: tuple[list[Bucket], list[Bucket], list[Bucket], list[Bucket], list[Bucket]],
        group: Callable[[tuple[int, ...]], dist.ProcessGroup | None],
        rank: int,
        world_size: int,
        columns: int,
    ) -> None:
        self.rank, self.world_size, self.columns = rank, world_size, columns
        self.group = group
        self.gathers, self.column_gathers, self.scatters, self.finites, self.clips = buckets
        self.layers = {name: _Rows(helper, rank, world_size) for name, helper in helpers.items()}
        self.device = next(iter(helpers.values())).weight().device

    def gather(self) -> None:
        """Each layer's whole gradient to its workers (lent to their helpers until
        ``release``): the rows to the row's worker, then among the column's workers. Each
        bucket's buffers are let go of once its layers' whole gradients are made."""
        shares: dict[str, torch.Tensor] = {}  # HYBRID-OPT: what the row gathered, by layer
        for bucket in self.gathers:
            mine = torch.empty(bucket.numel, dtype=torch_dtype(bucket.dtype), device=self.device)
            offset = 0
            for piece in bucket.pieces:
                self.layers[piece.layer].put(mine[offset : offset + piece.numel])
                offset += piece.numel
            received = parts = None
            if bucket.src == self.rank:
                received = mine.new_empty(len(bucket.group), bucket.numel)
                parts = list(received.unbind(0))
            assert bucket.src is not None
            gather_rows(mine, parts, bucket.src, self.group(bucket.group))
            del mine
            if received is not None:  # kept for the column's all-gather (HYBRID-OPT)
                self._take(bucket, received, shares if self.column_gathers else None)
            del received, parts
        for bucket in self.column_gathers:
            mine = torch.cat([shares.pop(p.layer).reshape(-1) for p in bucket.pieces])
            gathered = mine.new_empty(len(bucket.group), mine.numel())
            all_gather_rows(gathered.view(-1), mine, self.group(bucket.group))
            del mine
            self._take(bucket, gathered, None)
            del gathered

    def _take(
        self, bucket: Bucket, received: torch.Tensor, shares: dict[str, torch.Tensor] | None
    ) -> None:
        """The pieces of a gathered bucket ``(members, numel)``: every rank's rows (lent as
        whole gradients), or, given ``shares``, a row's (kept there for the column's
        all-gather, a copy)."""
        offset = 0
        for piece in bucket.pieces:
            rows = self.layers[piece.layer]
            part = received[:, offset : offset + piece.numel]
            if shares is not None:
                shares[piece.layer] = part.contiguous()
            else:
                rows.lend_whole(part.reshape(self.world_size, rows.each, rows.width))
            offset += piece.numel

    def grads_finite(self) -> bool:
        """Whether every rank's gradient rows are finite."""
        grads = [t for rows in self.layers.values() for t in rows.local() if t is not None]
        flag = torch.zeros(1, dtype=torch.float64, device=self.device)
        if not all(finite_flags(grads)):
            flag += 1
        for bucket in self.finites:
            dist.all_reduce(flag, group=self.group(bucket.group))
        return bool(flag.item() == 0)

    def scatter(self, outputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each rank of the row its rows ``(mine, width)`` of the preconditioned gradients
        (``outputs``: this rank's layers' ``(k, g, a)``)."""
        mine: dict[str, torch.Tensor] = {}
        for bucket in self.scatters:
            dtype = torch_dtype(bucket.dtype)
            sent = parts = None
            if bucket.src == self.rank:
                sent = torch.empty(len(bucket.group), bucket.numel, dtype=dtype, device=self.device)
                offset = 0
                for piece in bucket.pieces:
                    rows = self.layers[piece.layer]
                    whole = outputs[piece.layer].reshape(rows.rows, rows.width)
                    for index, member in enumerate(bucket.group):
                        start, end = rows_of(rows.rows, member, self.world_size)
                        rows.put(sent[index, offset : offset + piece.numel], whole[start:end])
                    offset += piece.numel
                parts = list(sent.unbind(0))
            received = torch.empty(bucket.numel, dtype=dtype, device=self.device)
            assert bucket.src is not None
            scatter_rows(received, parts, bucket.src, self.group(bucket.group))
            del sent, parts
            offset = 0
            for piece in bucket.pieces:
                rows = self.layers[piece.layer]
                flat = received[offset : offset + piece.numel].view(rows.each, rows.width)
                mine[piece.layer] = flat[: rows.mine]
                offset += piece.numel
        return mine

    def lend_rows(self) -> dict[str, torch.Tensor]:
        """Lend every helper its rank's rows (FSDP2's storage) for the step's write; returns
        each layer's rows as ``(mine, width)`` copies (the raw gradient)."""
        raws = {}
        for name, rows in self.layers.items():
            raws[name] = rows.matrix()
            weight, bias = rows.local()
            rows.helper.whole = (weight, bias)
        return raws

    def sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (float64, a layer's sum over this rank's rows each) summed over ranks."""
        offset = 0
        for bucket in self.clips:
            dist.all_reduce(values[offset : offset + bucket.numel], group=self.group(bucket.group))
            offset += bucket.numel
        return values

    def release(self) -> None:
        """The helpers read their parameters' own gradients again."""
        for rows in self.layers.values():
            rows.helper.whole = None


def gradient_keeper(
    helpers: Mapping[str, LayerHelper],
    plan: Plan,
    comm: Communicator,
    rank: int,
    world_size: int,
) -> ShardedGradients | RowExchange:
    """What brings a sharded model's whole gradients to the ranks that precondition them under
    ``plan``: with fewer gradient workers than ranks (``rows_mode``) the rows' exchange with the
    layers' workers, else every rank's all-gather of every layer. ``helpers``: the registered
    layers by name, in the preconditioner's order."""
    if rows_mode(plan.assignment, plan.options):
        sched = plan.schedule
        row = rank // plan.assignment.columns
        buckets = (
            comm.mine(sched.gather_buckets_of_row(row)),
            comm.mine(sched.gather_columns),
            comm.mine(sched.gradient_buckets_of_row(row)),
            comm.mine(sched.finite_buckets),
            comm.mine(sched.clip_buckets),
        )
        return RowExchange(
            dict(helpers), buckets, comm.group, rank, world_size, plan.assignment.columns
        )
    return ShardedGradients(list(helpers.values()), rank, world_size)
