"""What a plan's communication is made of: the step types, a collective's purpose, the
pieces and buckets a call carries, a call as a rank sees it (``Collective``), the
preconditioner options that change memory or communication, and the greedy bucketing every
schedule uses (``fill``).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kaisa_ray.assignment import DType, PlannedLayer, itemsize
from kaisa_ray.enums import (
    AssignmentStrategy,
    ComputeMethod,
    FactorReduction,
    Parallel,
    Scaling,
)

__all__ = [
    "STEP_SCALAR_BYTES",
    "Bucket",
    "BucketKey",
    "Collective",
    "Options",
    "Piece",
    "Purpose",
    "StepType",
    "all_ranks",
    "decomposition_parts",
    "factor_numel",
    "fill",
]


class StepType(enum.StrEnum):
    PLAIN = "plain"
    FACTOR_UPDATE = "factor_update"
    INVERSE_UPDATE = "inverse_update"


class Purpose(enum.StrEnum):
    FACTORS = "factors"
    DECOMPOSITIONS = "decompositions"
    GRADIENTS = "gradients"
    STALENESS = "staleness"


@dataclass(frozen=True, kw_only=True)
class Piece:
    """One tensor inside a bucket: which layer, which part, how many elements."""

    layer: str
    part: str  # "a"/"g" (factors), "qa", "da", "a_inv", ... (decompositions), "grad", "staleness"
    numel: int


@dataclass(frozen=True, kw_only=True)
class Bucket:
    """One collective call: its pieces travel together in one flat buffer."""

    purpose: Purpose
    # "all_reduce" | "broadcast"; FSDP2's gradient rows: "all_gather" (COMM-OPT, and a
    # column's workers under HYBRID-OPT), "gather" to a row's worker, "scatter" back from it
    op: str
    group: tuple[int, ...]
    src: int | None
    dtype: DType
    pieces: tuple[Piece, ...]

    @functools.cached_property
    def numel(self) -> int:
        return sum(p.numel for p in self.pieces)

    @functools.cached_property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)

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
class Options:
    """The preconditioner settings that change memory or communication."""

    compute_method: ComputeMethod = ComputeMethod.EIGEN
    compute_eigenvalue_outer_product: bool = True
    symmetry_aware: bool = False
    assignment_strategy: AssignmentStrategy = AssignmentStrategy.COMPUTE
    colocate_factors: bool = True
    allreduce_bucket_cap_mb: float = 25.0
    staleness_probes: int = 0  # columns of each factor's staleness sketch; 0: not measured
    scaling: Scaling = Scaling.KRONECKER
    parallel: Parallel = Parallel.DDP
    factor_reduction: FactorReduction = FactorReduction.EVERY_UPDATE

    @property
    def deferred(self) -> bool:
        """The factors' running averages are all-reduced on decomposition steps only."""
        return self.factor_reduction is FactorReduction.DEFERRED

    @property
    def bucket_cap_bytes(self) -> int:
        return int(self.allreduce_bucket_cap_mb * 2**20)


# The preconditioner's per-step device scalars: an int64 count and a float64 scale.
STEP_SCALAR_BYTES = 16


@dataclass(frozen=True, kw_only=True)
class Collective:
    """One call as a rank sees it."""

    purpose: Purpose
    op: str
    group: tuple[int, ...]
    src: int | None
    nbytes: int


@functools.lru_cache(maxsize=4)
def all_ranks(world_size: int) -> tuple[int, ...]:
    """The group of all ranks (one tuple shared by the plans of a world size)."""
    return tuple(range(world_size))


def factor_numel(dim: int, groups: int, symmetric: bool, *, diagonal: bool = False) -> int:
    """Elements of a factor as it travels: whole, its upper triangle (``symmetric``), or a
    diagonal factor's diagonal."""
    if diagonal:
        return groups * dim
    return groups * (dim * (dim + 1) // 2 if symmetric else dim * dim)


def decomposition_parts(
    layer: PlannedLayer, options: Options
) -> tuple[list[Piece], list[Piece], int]:
    """The broadcast pieces of A and of G, and the elements each gradient worker holds
    besides: the outer-product table, EKFAC's fitted diagonal, or Adam's moments and their
    count."""
    k, a, g = layer.groups, layer.a_dim, layer.g_dim
    if options.compute_method is ComputeMethod.EIGEN:
        a_parts = [
            Piece(layer=layer.name, part="qa", numel=k * a * a),
            Piece(layer=layer.name, part="da", numel=k * a),
        ]
        if layer.diagonal_a:  # its basis is the identity, neither held nor sent
            a_parts = a_parts[1:]
        g_parts = [
            Piece(layer=layer.name, part="qg", numel=k * g * g),
            Piece(layer=layer.name, part="dg", numel=k * g),
        ]
        if options.scaling is Scaling.ADAM_EIGENBASIS:
            table = 2 * k * g * a + k  # m, v and steps
        elif options.scaling is Scaling.EKFAC:
            table = k * g * a  # the fitted diagonal
        else:
            table = k * g * a if options.compute_eigenvalue_outer_product else 0
        return a_parts, g_parts, table
    return (
        [Piece(layer=layer.name, part="a_inv", numel=k * a if layer.diagonal_a else k * a * a)],
        [Piece(layer=layer.name, part="g_inv", numel=k * g * g)],
        0,
    )


BucketKey = tuple[int, int | None, DType]  # (group's index in ``groups``, source, dtype)


def fill(
    items: Iterable[tuple[BucketKey, Piece]],
    *,
    groups: Mapping[int, tuple[int, ...]],
    purpose: Purpose,
    op: str,
    cap_bytes: int,
) -> list[Bucket]:
    """Greedy bucketing in order; a bucket holds one (group, src, dtype) key, up to the cap.

    Keys are whole groups (by index: hashing a group of 65,536 ranks per piece was most of
    a plan's time), never group sizes: two different groups of the same size never share a
    bucket (the reference's hang).
    """
    open_buckets: dict[BucketKey, list[Piece]] = {}
    order: list[tuple[BucketKey, list[Piece]]] = []
    for key, piece in items:
        current = open_buckets.get(key)
        size = piece.numel * itemsize(key[2])
        if current is not None and (
            sum(p.numel for p in current) * itemsize(key[2]) + size > cap_bytes
        ):
            current = None
        if current is None:
            current = []
            open_buckets[key] = current
            order.append((key, current))
        current.append(piece)
    return [
        Bucket(
            purpose=purpose,
            op=op,
            group=groups[key[0]],
            src=key[1],
            dtype=key[2],
            pieces=tuple(pieces),
        )
        for key, pieces in order
    ]
