"""Every collective of every step type, for all ranks (``Schedule``), built from layer shapes,
an assignment and the options (``schedule()``); the preconditioner's runtime executes it
(``kaisa_ray.comm``) and ``kaisa_ray.plan`` prices it per rank.

The gradient broadcasts are held as the first row's and moved row by row; FSDP2's gradient
rows (``rows_mode``) are gathered to a row's worker, all-gathered within a column under
HYBRID-OPT, scattered back, with two small all-reduces (whether the rows are finite, the KL
clip's sums).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from kaisa_ray.assignment import Assignment, DType, PlannedLayer
from kaisa_ray.buckets import (
    Bucket,
    BucketKey,
    Options,
    Piece,
    Purpose,
    all_ranks,
    decomposition_parts,
    factor_numel,
    fill,
)
from kaisa_ray.enums import Parallel, Scaling

__all__ = ["STALENESS_PROBES", "STALENESS_VALUES", "Schedule", "rows_mode", "schedule"]


STALENESS_PROBES = 8  # columns of each factor's staleness sketch (``kaisa_ray.staleness``)
STALENESS_VALUES = 3  # per layer: the change of A, of G, and the angle (kaisa_ray.staleness)


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """Every collective of every step type, for all ranks; the runtime executes this.

    The gradient broadcasts are held as the first row's (``gradient_row``): every row buckets
    its layers alike, each from the row's own worker of the layer's column, so row ``i``'s
    buckets are the first row's moved by ``i`` rows. ``gradient_buckets`` lists them all (built
    when first asked for: 32,768 rows of them at 65,536 ranks and f = 1/2).
    """

    assignment: Assignment
    factor_buckets: tuple[Bucket, ...]
    decomposition_buckets: tuple[Bucket, ...]
    gradient_row: tuple[Bucket, ...]
    staleness_buckets: tuple[Bucket, ...] = ()
    gather_buckets: tuple[Bucket, ...] = ()  # FSDP2: every rank's gradient rows, every step
    # FSDP2 with fewer gradient workers than ranks (``rows_mode``): the first row's gathers
    # of the rows to the row's worker (moved by row as ``gradient_row`` is), the column
    # workers' all-gathers of what their rows gathered (HYBRID-OPT), the all-reduce of
    # whether every gradient row is finite (on steps that fold factors or measure
    # staleness), and the all-reduce of the KL clip's per-layer sums over each rank's rows
    gather_row: tuple[Bucket, ...] = ()
    gather_columns: tuple[Bucket, ...] = ()
    finite_buckets: tuple[Bucket, ...] = ()
    clip_buckets: tuple[Bucket, ...] = ()
    # ``factor_reduction='deferred'``: on each factor step, the all-reduce of how many ranks
    # found their batch factors and gradients finite (every rank folds, or none does); the
    # factor buckets then carry the running averages, on decomposition steps
    agree_buckets: tuple[Bucket, ...] = ()
    layers: tuple[PlannedLayer, ...] = ()
    options: Options = field(default_factory=Options)
    _subsets: dict[tuple[frozenset[str], frozenset[str]], Schedule] = field(
        default_factory=dict, compare=False, repr=False
    )

    @functools.cached_property
    def gradient_buckets(self) -> tuple[Bucket, ...]:
        """Every row's gradient broadcasts, row by row (each row's in the first row's order)."""
        return tuple(
            bucket
            for row in range(self.assignment.grad_workers)
            for bucket in self.gradient_buckets_of_row(row)
        )

    def gradient_buckets_of_row(self, row: int) -> tuple[Bucket, ...]:
        """The gradient broadcasts (FSDP2's ``rows_mode``: scatters) within receiver group
        ``row``."""
        return self._moved(self.gradient_row, row)

    def gather_buckets_of_row(self, row: int) -> tuple[Bucket, ...]:
        """FSDP2's ``rows_mode``: the gathers of the gradient rows within receiver group
        ``row``, each to the row's worker of a column."""
        return self._moved(self.gather_row, row)

    def _moved(self, first: tuple[Bucket, ...], row: int) -> tuple[Bucket, ...]:
        """The first row's buckets as row ``row`` issues them."""
        if row == 0:
            return first
        columns = self.assignment.columns
        group = tuple(range(row * columns, (row + 1) * columns))
        return tuple(
            dataclasses.replace(
                bucket, group=group, src=None if bucket.src is None else bucket.src + row * columns
            )
            for bucket in first
        )

    def for_rank(self, buckets: Sequence[Bucket], rank: int) -> list[Bucket]:
        return [b for b in buckets if rank in b.members]

    def restricted(
        self, factor_layers: Collection[str], decomposition_layers: Collection[str]
    ) -> Schedule:
        """The schedule of a step on which only these layers update their factors and their
        decompositions (per-layer intervals): the same bucketing over just those layers.
        Every layer in both gives this schedule itself. Built once per pair of sets. With
        deferred factor reduction the factor buckets are the decomposed layers' (their running
        averages), and the agreement is on every step that folds factors."""
        names = frozenset(layer.name for layer in self.layers)
        key = (frozenset(factor_layers), frozenset(decomposition_layers))
        if key == (names, names):
            return self
        found = self._subsets.get(key)
        if found is None:
            unknown = (key[0] | key[1]) - names
            if unknown:
                raise ValueError(f"layers {sorted(unknown)} are not in this schedule")
            reduced = key[1] if self.options.deferred else key[0]
            found = Schedule(
                assignment=self.assignment,
                factor_buckets=tuple(
                    _factor_buckets(
                        [layer for layer in self.layers if layer.name in reduced],
                        self.assignment,
                        self.options,
                    )
                ),
                decomposition_buckets=tuple(
                    _decomposition_buckets(
                        [layer for layer in self.layers if layer.name in key[1]],
                        self.assignment,
                        self.options,
                    )
                ),
                gradient_row=self.gradient_row,
                staleness_buckets=self.staleness_buckets,
                gather_buckets=self.gather_buckets,
                gather_row=self.gather_row,
                gather_columns=self.gather_columns,
                finite_buckets=self.finite_buckets,
                clip_buckets=self.clip_buckets,
                agree_buckets=self.agree_buckets if key[0] else (),
                layers=self.layers,
                options=self.options,
            )
            self._subsets[key] = found
        return found


def _factor_buckets(
    layers: Sequence[PlannedLayer], assignment: Assignment, options: Options
) -> list[Bucket]:
    if assignment.world_size == 1:
        return []
    items: list[tuple[BucketKey, Piece]] = []
    for layer in reversed(layers):  # backward order: buckets fill as backprop proceeds
        key: BucketKey = (0, None, layer.factor_dtype)
        for part, dim in (("a", layer.a_dim), ("g", layer.g_dim)):
            diagonal = part == "a" and layer.diagonal_a
            numel = factor_numel(dim, layer.groups, options.symmetry_aware, diagonal=diagonal)
            items.append((key, Piece(layer=layer.name, part=part, numel=numel)))
        if options.scaling is Scaling.EKFAC:  # the batch's fitted diagonal, with its factors
            numel = layer.groups * layer.g_dim * layer.a_dim
            items.append((key, Piece(layer=layer.name, part="s", numel=numel)))
    return fill(
        items,
        groups={0: all_ranks(assignment.world_size)},
        purpose=Purpose.FACTORS,
        op="all_reduce",
        cap_bytes=options.bucket_cap_bytes,
    )


def _decomposition_buckets(
    layers: Sequence[PlannedLayer], assignment: Assignment, options: Options
) -> list[Bucket]:
    if not assignment.broadcasts_decompositions:
        return []
    items: list[tuple[BucketKey, Piece]] = []
    groups: dict[int, tuple[int, ...]] = {}
    for layer in layers:
        place = assignment.placements[layer.name]
        column = assignment.column_of(layer.name)
        groups[column] = place.workers
        a_parts, g_parts, _ = decomposition_parts(layer, options)
        items += [((column, place.a_rank, layer.inv_dtype), p) for p in a_parts]
        items += [((column, place.g_rank, layer.inv_dtype), p) for p in g_parts]
    return fill(
        items,
        groups=groups,
        purpose=Purpose.DECOMPOSITIONS,
        op="broadcast",
        cap_bytes=options.bucket_cap_bytes,
    )


def rows_mode(assignment: Assignment, options: Options) -> bool:
    """FSDP2 with fewer gradient workers than ranks: each layer's gradient rows are gathered
    to its workers, preconditioned there, and each rank's rows scattered back to it
    (``kaisa_ray.sharding.RowExchange``); under COMM-OPT every rank all-gathers them all."""
    return options.parallel is Parallel.FSDP and assignment.broadcasts_gradients


def _rows_each(layer: PlannedLayer, world_size: int) -> int:
    """Elements of one rank's rows of a layer's gradient (``⌈rows / W⌉`` rows of ``a``
    elements, ``torch.chunk``'s split, padded), as FSDP2's gradient collectives move them."""
    return -(-layer.groups * layer.g_dim // world_size) * layer.a_dim


def _gradient_row(
    layers: Sequence[PlannedLayer], assignment: Assignment, options: Options
) -> list[Bucket]:
    """The first row's gradient broadcasts: each layer's from the row's worker of its column.
    FSDP2's ``rows_mode``: scatters of each rank's rows of the preconditioned gradient
    instead."""
    if not assignment.broadcasts_gradients:
        return []
    rows = rows_mode(assignment, options)
    return _first_row(layers, assignment, options, "scatter" if rows else "broadcast")


def _first_row(
    layers: Sequence[PlannedLayer], assignment: Assignment, options: Options, op: str
) -> list[Bucket]:
    """The first row's calls of ``op``, each layer's from (or to) the row's worker of its
    column (the row's rank in that column: the column's index, in the first row): its whole
    gradient (``broadcast``) or each rank's rows of it (FSDP2's ``gather`` and ``scatter``)."""
    world = assignment.world_size
    items = [
        (
            (0, assignment.column_of(layer.name), layer.grad_dtype),
            Piece(layer=layer.name, part="grad", numel=layer.groups * layer.g_dim * layer.a_dim)
            if op == "broadcast"
            else Piece(layer=layer.name, part="grad_rows", numel=_rows_each(layer, world)),
        )
        for layer in layers
    ]
    return fill(
        items,
        groups={0: assignment.receiver_group_of(0)},
        purpose=Purpose.GRADIENTS,
        op=op,
        cap_bytes=options.bucket_cap_bytes,
    )


def _gather_buckets(
    layers: Sequence[PlannedLayer], assignment: Assignment, options: Options
) -> list[Bucket]:
    """FSDP2 under COMM-OPT: each step's all-gather of the layers' gradient rows
    (``kaisa_ray.sharding``), one call per gradient dtype; a rank sends ``⌈rows / W⌉`` rows
    of every layer (the ``torch.chunk`` split, padded), so the call's bytes are the same on
    every rank."""
    if options.parallel is not Parallel.FSDP or rows_mode(assignment, options):
        return []
    world = assignment.world_size
    by_dtype: dict[DType, list[Piece]] = {}
    for layer in layers:
        piece = Piece(layer=layer.name, part="grad_rows", numel=_rows_each(layer, world))
        by_dtype.setdefault(layer.grad_dtype, []).append(piece)
    return [
        Bucket(
            purpose=Purpose.GRADIENTS,
            op="all_gather",
            group=all_ranks(world),
            src=None,
            dtype=dtype,
            pieces=tuple(pieces),
        )
        for dtype, pieces in by_dtype.items()
    ]


def _gather_row(
    layers: Sequence[PlannedLayer], assignment: Assignment, options: Options
) -> list[Bucket]:
    """FSDP2's ``rows_mode``: the first row's gathers, each rank's rows of each layer to the
    row's worker of the layer's column (one call per column and dtype, up to the cap)."""
    if not rows_mode(assignment, options):
        return []
    return _first_row(layers, assignment, options, "gather")


def _gather_columns(
    layers: Sequence[PlannedLayer], assignment: Assignment, options: Options
) -> list[Bucket]:
    """FSDP2's ``rows_mode`` with several workers a layer (HYBRID-OPT): each column's workers
    all-gather the rows their rows gathered (a row's ``columns`` ranks' shares, padded), so
    that every worker of a layer holds its whole gradient."""
    if not rows_mode(assignment, options) or assignment.grad_workers == 1:
        return []
    world, columns = assignment.world_size, assignment.columns
    items: list[tuple[BucketKey, Piece]] = []
    groups: dict[int, tuple[int, ...]] = {}
    for layer in layers:
        column = assignment.column_of(layer.name)
        groups[column] = assignment.placements[layer.name].workers
        numel = columns * _rows_each(layer, world)
        items.append(
            (
                (column, None, layer.grad_dtype),
                Piece(layer=layer.name, part="grad_rows", numel=numel),
            )
        )
    return fill(
        items,
        groups=groups,
        purpose=Purpose.GRADIENTS,
        op="all_gather",
        cap_bytes=options.bucket_cap_bytes,
    )


def _rows_reductions(
    layers: Sequence[PlannedLayer], assignment: Assignment, options: Options
) -> tuple[list[Bucket], list[Bucket]]:
    """FSDP2's ``rows_mode``: the all-reduce of the count of ranks whose gradient rows are
    not all finite, and the KL clip's per-layer sums over each rank's rows (float64; under no
    clip, the sums that say whether the preconditioned rows are finite)."""
    if not rows_mode(assignment, options):
        return [], []
    everyone = all_ranks(assignment.world_size)
    finite = Bucket(
        purpose=Purpose.GRADIENTS,
        op="all_reduce",
        group=everyone,
        src=None,
        dtype="float64",
        pieces=(Piece(layer="", part="finite", numel=1),),
    )
    clip = fill(
        [((0, None, "float64"), Piece(layer=layer.name, part="clip", numel=1)) for layer in layers],
        groups={0: everyone},
        purpose=Purpose.GRADIENTS,
        op="all_reduce",
        cap_bytes=options.bucket_cap_bytes,
    )
    return [finite], clip


def schedule(layers: Sequence[PlannedLayer], assignment: Assignment, options: Options) -> Schedule:
    """Build the communication schedule of a strategy (no process group needed)."""
    staleness_buckets: list[Bucket] = []
    if options.staleness_probes > 0 and assignment.world_size > 1:
        items = [
            (
                (0, None, "float64"),  # the staleness values travel in float64
                Piece(layer=layer.name, part="staleness", numel=STALENESS_VALUES),
            )
            for layer in layers
        ]
        staleness_buckets = fill(
            items,
            groups={0: all_ranks(assignment.world_size)},
            purpose=Purpose.STALENESS,
            op="all_reduce",
            cap_bytes=options.bucket_cap_bytes,
        )
    finite, clip = _rows_reductions(layers, assignment, options)
    agree: tuple[Bucket, ...] = ()
    if options.deferred and assignment.world_size > 1:
        agree = (
            Bucket(
                purpose=Purpose.FACTORS,
                op="all_reduce",
                group=all_ranks(assignment.world_size),
                src=None,
                dtype="float64",
                pieces=(Piece(layer="", part="finite", numel=1),),
            ),
        )
    return Schedule(
        assignment=assignment,
        factor_buckets=tuple(_factor_buckets(layers, assignment, options)),
        decomposition_buckets=tuple(_decomposition_buckets(layers, assignment, options)),
        gradient_row=tuple(_gradient_row(layers, assignment, options)),
        staleness_buckets=tuple(staleness_buckets),
        gather_buckets=tuple(_gather_buckets(layers, assignment, options)),
        gather_row=tuple(_gather_row(layers, assignment, options)),
        gather_columns=tuple(_gather_columns(layers, assignment, options)),
        finite_buckets=tuple(finite),
        clip_buckets=tuple(clip),
        agree_buckets=agree,
        layers=tuple(layers),
        options=options,
    )
