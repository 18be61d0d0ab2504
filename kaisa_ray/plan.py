"""The exact memory and communication of a KAISA strategy, before anything runs.

``plan(...)`` needs no process group and no data: from layer shapes, the world size and the
strategy it returns, per rank, the bytes the K-FAC state will hold and, per step type, every
collective with its group and payload. The preconditioner executes the very schedule built
here (``schedule()``), so the plan is not an estimate: the tests count the bytes and calls
that each rank actually sends and compare them to it.

Collectives (payload = bytes of the tensor each participant passes):

- factor all-reduce over all ranks on factor-update steps: every layer's batch A and G,
  bucketed up to ``allreduce_bucket_cap_mb`` in backward order (reverse registration), only the
  upper triangle with ``symmetry_aware``;
- decomposition broadcast within gradient-worker groups on inverse-update steps (when f·W > 1),
  bucketed by (group, source rank, dtype);
- preconditioned-gradient broadcast within receiver groups every step (when f < 1), bucketed
  by (group, source rank, dtype).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from kaisa_ray.assignment import Assignment, LayerShape, assign
from kaisa_ray.enums import AssignmentStrategy, ComputeMethod, DistributedStrategy, parse_enum
from kaisa_ray.strategy import resolve_grad_worker_fraction


class StepType(enum.StrEnum):
    PLAIN = "plain"
    FACTOR_UPDATE = "factor_update"
    INVERSE_UPDATE = "inverse_update"


class Purpose(enum.StrEnum):
    FACTORS = "factors"
    DECOMPOSITIONS = "decompositions"
    GRADIENTS = "gradients"


@dataclass(frozen=True, kw_only=True)
class Piece:
    """One tensor inside a bucket: which layer, which part, how many elements."""

    layer: str
    part: str  # "a"/"g" (factors), "qa", "da", "a_inv", ... (decompositions), "grad"
    numel: int


@dataclass(frozen=True, kw_only=True)
class Bucket:
    """One collective call: its pieces travel together in one flat buffer."""

    purpose: Purpose
    op: str  # "all_reduce" | "broadcast"
    group: tuple[int, ...]
    src: int | None
    dtype: torch.dtype
    pieces: tuple[Piece, ...]

    @functools.cached_property
    def numel(self) -> int:
        return sum(p.numel for p in self.pieces)

    @functools.cached_property
    def nbytes(self) -> int:
        return self.numel * _elem(self.dtype)

    @functools.cached_property
    def members(self) -> frozenset[int]:
        return frozenset(self.group)

    @functools.cached_property
    def collective(self) -> Collective:
        """The call as each member sees it (the same for all, built once: at a world size
        of 1024 there are a million rank-and-bucket pairs)."""
        return Collective(
            purpose=self.purpose, op=self.op, group=self.group, src=self.src, nbytes=self.nbytes
        )


@dataclass(frozen=True, kw_only=True)
class PlannedLayer(LayerShape):
    """A layer's shape plus the dtypes of its state."""

    factor_dtype: torch.dtype = torch.float32
    inv_dtype: torch.dtype = torch.float32
    grad_dtype: torch.dtype = torch.float32


@dataclass(frozen=True, kw_only=True)
class Options:
    """The preconditioner settings that change memory or communication."""

    compute_method: ComputeMethod = ComputeMethod.EIGEN
    compute_eigenvalue_outer_product: bool = True
    symmetry_aware: bool = False
    assignment_strategy: AssignmentStrategy = AssignmentStrategy.COMPUTE
    colocate_factors: bool = True
    allreduce_bucket_cap_mb: float = 25.0

    @property
    def bucket_cap_bytes(self) -> int:
        return int(self.allreduce_bucket_cap_mb * 2**20)


@functools.cache
def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def factor_numel(dim: int, groups: int, symmetric: bool) -> int:
    return groups * (dim * (dim + 1) // 2 if symmetric else dim * dim)


def decomposition_parts(
    layer: PlannedLayer, options: Options
) -> tuple[list[Piece], list[Piece], int]:
    """The broadcast pieces of A and of G, and the elements of the outer-product table."""
    k, a, g = layer.groups, layer.a_dim, layer.g_dim
    if options.compute_method is ComputeMethod.EIGEN:
        a_parts = [
            Piece(layer=layer.name, part="qa", numel=k * a * a),
            Piece(layer=layer.name, part="da", numel=k * a),
        ]
        g_parts = [
            Piece(layer=layer.name, part="qg", numel=k * g * g),
            Piece(layer=layer.name, part="dg", numel=k * g),
        ]
        table = k * g * a if options.compute_eigenvalue_outer_product else 0
        return a_parts, g_parts, table
    return (
        [Piece(layer=layer.name, part="a_inv", numel=k * a * a)],
        [Piece(layer=layer.name, part="g_inv", numel=k * g * g)],
        0,
    )


BucketKey = tuple[tuple[int, ...], int | None, torch.dtype]  # (group, source rank, dtype)


def _fill(
    items: Iterable[tuple[BucketKey, Piece]],
    *,
    purpose: Purpose,
    op: str,
    cap_bytes: int,
) -> list[Bucket]:
    """Greedy bucketing in order; a bucket holds one (group, src, dtype) key, up to the cap.

    Keys are whole groups, never group sizes: two different groups of the same size never
    share a bucket (the reference's hang).
    """
    open_buckets: dict[BucketKey, list[Piece]] = {}
    order: list[tuple[BucketKey, list[Piece]]] = []
    for key, piece in items:
        current = open_buckets.get(key)
        size = piece.numel * _elem(key[2])
        if current is not None and (
            sum(p.numel for p in current) * _elem(key[2]) + size > cap_bytes
        ):
            current = None
        if current is None:
            current = []
            open_buckets[key] = current
            order.append((key, current))
        current.append(piece)
    return [
        Bucket(purpose=purpose, op=op, group=key[0], src=key[1], dtype=key[2], pieces=tuple(pieces))
        for key, pieces in order
    ]


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """Every collective of every step type, for all ranks; the runtime executes this."""

    assignment: Assignment
    factor_buckets: tuple[Bucket, ...]
    decomposition_buckets: tuple[Bucket, ...]
    gradient_buckets: tuple[Bucket, ...]

    def for_rank(self, buckets: Sequence[Bucket], rank: int) -> list[Bucket]:
        return [b for b in buckets if rank in b.members]


def schedule(layers: Sequence[PlannedLayer], assignment: Assignment, options: Options) -> Schedule:
    """Build the communication schedule of a strategy (no process group needed)."""
    world = tuple(range(assignment.world_size))
    cap = options.bucket_cap_bytes
    factor_buckets: list[Bucket] = []
    items: list[tuple[BucketKey, Piece]]
    if assignment.world_size > 1:
        items = []
        for layer in reversed(layers):  # backward order: buckets fill as backprop proceeds
            for part, dim in (("a", layer.a_dim), ("g", layer.g_dim)):
                numel = factor_numel(dim, layer.groups, options.symmetry_aware)
                items.append(
                    (
                        (world, None, layer.factor_dtype),
                        Piece(layer=layer.name, part=part, numel=numel),
                    )
                )
        factor_buckets = _fill(items, purpose=Purpose.FACTORS, op="all_reduce", cap_bytes=cap)
    decomposition_buckets: list[Bucket] = []
    if assignment.broadcasts_decompositions:
        items = []
        for layer in layers:
            place = assignment.placements[layer.name]
            a_parts, g_parts, _ = decomposition_parts(layer, options)
            items += [((place.workers, place.a_rank, layer.inv_dtype), p) for p in a_parts]
            items += [((place.workers, place.g_rank, layer.inv_dtype), p) for p in g_parts]
        decomposition_buckets = _fill(
            items, purpose=Purpose.DECOMPOSITIONS, op="broadcast", cap_bytes=cap
        )
    gradient_buckets: list[Bucket] = []
    if assignment.broadcasts_gradients:
        items = []
        for row in assignment.receiver_groups():
            for layer in layers:
                src = assignment.grad_source(layer.name, row[0])
                numel = layer.groups * layer.g_dim * layer.a_dim
                items.append(
                    (
                        (row, src, layer.grad_dtype),
                        Piece(layer=layer.name, part="grad", numel=numel),
                    )
                )
        gradient_buckets = _fill(items, purpose=Purpose.GRADIENTS, op="broadcast", cap_bytes=cap)
    return Schedule(
        assignment=assignment,
        factor_buckets=tuple(factor_buckets),
        decomposition_buckets=tuple(decomposition_buckets),
        gradient_buckets=tuple(gradient_buckets),
    )


@dataclass(frozen=True, kw_only=True)
class Collective:
    """One call as a rank sees it."""

    purpose: Purpose
    op: str
    group: tuple[int, ...]
    src: int | None
    nbytes: int


@dataclass(frozen=True, kw_only=True)
class RankPlan:
    rank: int
    memory: dict[str, int]
    calls: dict[StepType, tuple[Collective, ...]]

    def bytes(self, step_type: StepType | str) -> int:
        return sum(c.nbytes for c in self.calls[StepType(step_type)])


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Memory and communication of one strategy, per rank and step type."""

    world_size: int
    grad_worker_fraction: float
    options: Options
    layers: tuple[PlannedLayer, ...]
    schedule: Schedule
    ranks: tuple[RankPlan, ...] = field(default=())

    @property
    def assignment(self) -> Assignment:
        return self.schedule.assignment

    def mean_bytes_per_step(
        self, rank: int, factor_update_steps: int, inv_update_steps: int
    ) -> float:
        """Average payload per step at the given (aligned) intervals."""
        r = self.ranks[rank]
        plain, factor = r.bytes(StepType.PLAIN), r.bytes(StepType.FACTOR_UPDATE)
        inverse = r.bytes(StepType.INVERSE_UPDATE)
        return (
            plain + (factor - plain) / factor_update_steps + (inverse - factor) / inv_update_steps
        )


def memory_for_rank(
    layers: Sequence[PlannedLayer], assignment: Assignment, options: Options, rank: int
) -> dict[str, int]:
    factors = decompositions = 0
    for layer in layers:
        elem = _elem(layer.factor_dtype)
        factors += elem * layer.groups * (layer.a_dim**2 + layer.g_dim**2)
        if assignment.is_grad_worker(layer.name, rank):
            a_parts, g_parts, table = decomposition_parts(layer, options)
            numel = sum(p.numel for p in a_parts + g_parts) + table
            decompositions += _elem(layer.inv_dtype) * numel
    memory = {"factors": factors, "decompositions": decompositions, "buffers": factors}
    memory["total"] = sum(memory.values())
    return memory


def calls_for_rank(sched: Schedule, rank: int) -> dict[StepType, tuple[Collective, ...]]:
    def collectives(buckets: Sequence[Bucket]) -> list[Collective]:
        return [b.collective for b in sched.for_rank(buckets, rank)]

    factors = collectives(sched.factor_buckets)
    decompositions = collectives(sched.decomposition_buckets)
    gradients = collectives(sched.gradient_buckets)
    return {
        StepType.PLAIN: tuple(gradients),
        StepType.FACTOR_UPDATE: tuple(factors + gradients),
        StepType.INVERSE_UPDATE: tuple(factors + decompositions + gradients),
    }


def layer_shapes(model: nn.Module, **preconditioner_kwargs: object) -> list[PlannedLayer]:
    """The layers a ``KFACPreconditioner`` would register on ``model``, with their dtypes."""
    from kaisa_ray.registration import registered_layers

    return registered_layers(model, **preconditioner_kwargs)


def plan(
    model_or_layers: nn.Module | Sequence[PlannedLayer | LayerShape],
    world_size: int,
    grad_worker_fraction: DistributedStrategy | float | str = DistributedStrategy.COMM_OPT,
    *,
    compute_method: ComputeMethod | str = ComputeMethod.EIGEN,
    compute_eigenvalue_outer_product: bool = True,
    symmetry_aware: bool = False,
    assignment_strategy: AssignmentStrategy | str = AssignmentStrategy.COMPUTE,
    colocate_factors: bool = True,
    allreduce_bucket_cap_mb: float = 25.0,
    skip_layers: Iterable[str] | str | None = None,
) -> Plan:
    """Price a strategy: per-rank K-FAC memory and per-step collectives, exactly.

    Args:
        model_or_layers: a model (its layers are found as the preconditioner would, with
            ``skip_layers``) or a list of ``LayerShape``/``PlannedLayer``.
        world_size: number of ranks.
        grad_worker_fraction: as for ``KFACPreconditioner``.

    Example:
        >>> from kaisa_ray.plan import plan
        >>> from kaisa_ray.assignment import LayerShape
        >>> p = plan([LayerShape(name="fc", a_dim=785, g_dim=128)], 4, "mem-opt")
        >>> p.ranks[0].memory["factors"]  # float32 A and G
        2530436
    """
    options = Options(
        compute_method=parse_enum(ComputeMethod, compute_method, "compute_method"),
        compute_eigenvalue_outer_product=compute_eigenvalue_outer_product,
        symmetry_aware=symmetry_aware,
        assignment_strategy=parse_enum(
            AssignmentStrategy, assignment_strategy, "assignment_strategy"
        ),
        colocate_factors=colocate_factors,
        allreduce_bucket_cap_mb=allreduce_bucket_cap_mb,
    )
    fraction = resolve_grad_worker_fraction(grad_worker_fraction, world_size)
    if isinstance(model_or_layers, nn.Module):
        layers = layer_shapes(model_or_layers, skip_layers=skip_layers)
    else:
        layers = [
            layer
            if isinstance(layer, PlannedLayer)
            else PlannedLayer(
                name=layer.name, a_dim=layer.a_dim, g_dim=layer.g_dim, groups=layer.groups
            )
            for layer in model_or_layers
        ]
    return build_plan(layers, world_size, fraction, options)


def build_plan(
    layers: Sequence[PlannedLayer], world_size: int, fraction: float, options: Options
) -> Plan:
    grad_workers = round(fraction * world_size)
    assignment = assign(
        list(layers),
        world_size=world_size,
        grad_workers=grad_workers,
        strategy=options.assignment_strategy,
        colocate_factors=options.colocate_factors,
    )
    sched = schedule(layers, assignment, options)
    ranks = tuple(
        RankPlan(
            rank=r,
            memory=memory_for_rank(layers, assignment, options, r),
            calls=calls_for_rank(sched, r),
        )
        for r in range(world_size)
    )
    return Plan(
        world_size=world_size,
        grad_worker_fraction=fraction,
        options=options,
        layers=tuple(layers),
        schedule=sched,
        ranks=ranks,
    )
