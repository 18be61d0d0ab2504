"""The exact memory and communication of a KAISA strategy, before anything runs.

``plan(...)`` needs no process group and no data: from layer shapes, the world size and the
strategy it returns, per rank, the bytes the K-FAC state will hold and, per step type, every
collective with its group and payload. The preconditioner executes the very schedule a plan
is priced from (``kaisa_ray.schedule``), so the plan is not an estimate: the tests count the
bytes and calls that each rank actually sends and compare them to it.

Collectives (payload = bytes of the tensor each participant passes):

- factor all-reduce over all ranks on factor-update steps: every layer's batch A and G,
  bucketed up to ``allreduce_bucket_cap_mb`` in backward order (reverse registration), only the
  upper triangle with ``symmetry_aware``, a diagonal A (an embedding's) as its diagonal;
- decomposition broadcast within gradient-worker groups on inverse-update steps (when f·W > 1),
  bucketed by (group, source rank, dtype);
- preconditioned-gradient broadcast within receiver groups every step (when f < 1), bucketed
  by (group, source rank, dtype);
- with staleness measured (``staleness_probes > 0``), one all-reduce over all ranks on steps
  with decomposition updates: three float64 numbers per layer (``kaisa_ray.staleness``).

With per-layer intervals (``kaisa_ray.intervals``) a step updates only some layers' factors and
decompositions: ``Plan.calls_at`` gives its collectives, the same bucketing over those layers
(``Schedule.restricted``); with every layer, the step types' calls above.

Nothing here is built rank by rank: a rank's plan is its column's and its row's (``Plan``), the
gradient broadcasts are the first row's moved row by row (``Schedule``), and the assignment
finds the least-loaded column and rank with heaps. A plan of 65,536 ranks costs about what
one of 64 does (``benchmarks/plan_speed.py``); the runtime still gets every bucket it runs.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, overload

from kaisa_ray.assignment import Assignment, LayerShape, assign, itemsize
from kaisa_ray.assignment import PlannedLayer as PlannedLayer  # defined there, exported here too

# The plan's vocabulary, defined in kaisa_ray.buckets and exported here too:
from kaisa_ray.buckets import STEP_SCALAR_BYTES as STEP_SCALAR_BYTES
from kaisa_ray.buckets import Bucket as Bucket
from kaisa_ray.buckets import Collective as Collective
from kaisa_ray.buckets import Options as Options
from kaisa_ray.buckets import Purpose as Purpose
from kaisa_ray.buckets import StepType as StepType
from kaisa_ray.buckets import decomposition_parts
from kaisa_ray.enums import (
    AssignmentStrategy,
    ComputeMethod,
    DistributedStrategy,
    FactorReduction,
    Parallel,
    Scaling,
    parse_enum,
)
from kaisa_ray.errors import ConfigurationError
from kaisa_ray.schedule import Schedule, schedule
from kaisa_ray.strategy import placeable, resolve_grad_worker_fraction

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True, kw_only=True)
class RankPlan:
    rank: int
    memory: dict[str, int]
    calls: dict[StepType, tuple[Collective, ...]]

    def bytes(self, step_type: StepType | str) -> int:
        return sum(c.nbytes for c in self.calls[StepType(step_type)])


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Memory and communication of one strategy, per rank and step type.

    A rank's plan is made of what every rank does, what its column does and what its row
    does (rank = row · columns + column, ``kaisa_ray.assignment``):

    - memory: the factors and buffers (every rank) and the decompositions of the layers
      placed on its column (``column_memory``);
    - ``calls[PLAIN]``: its row's gradient broadcasts (``row_calls``);
    - ``calls[FACTOR_UPDATE]``: the factor all-reduces (``factor_calls``), then its row's;
    - ``calls[INVERSE_UPDATE]``: the factor all-reduces, its column's decomposition
      broadcasts (``column_calls``), its row's gradient broadcasts, the staleness all-reduce
      (``staleness_calls``).

    With ``factor_reduction='deferred'`` a factor update's factor all-reduces are replaced by
    one number (``agree_calls``, first on every step that folds factors), and the factor
    all-reduces (of the running averages) are made on inverse updates only.

    So a plan of 65,536 ranks is not 65,536 objects: ``ranks`` builds a rank's plan when asked
    for it, and ``representatives`` names the few ranks that stand for all the others.
    """

    world_size: int
    grad_worker_fraction: float
    options: Options
    layers: tuple[PlannedLayer, ...]
    assignment: Assignment
    _rows: dict[int, tuple[Collective, ...]] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )

    @functools.cached_property
    def schedule(self) -> Schedule:
        """Every collective, bucket by bucket (built when first asked for: the memory needs
        only the assignment)."""
        return schedule(self.layers, self.assignment, self.options)

    @functools.cached_property
    def ranks(self) -> Sequence[RankPlan]:
        """Every rank's plan, by rank (each built when first asked for)."""
        return _Ranks(self)

    @functools.cached_property
    def loaded_columns(self) -> tuple[int, ...]:
        """The columns that some layer is placed on, lowest first."""
        return tuple(sorted({self.assignment.column_of(layer.name) for layer in self.layers}))

    @functools.cached_property
    def representatives(self) -> tuple[int, ...]:
        """Ranks that stand for all: every rank has the memory and, on every step type, the
        calls (purposes, ops, bytes, in order) of the representative of its column, a rank no
        higher than itself (only the gradient broadcasts' group and source move with the row).
        They are the first row's ranks of the loaded columns and of the first column without
        layers, if any (all such columns hold and send the same)."""
        loaded = set(self.loaded_columns)
        empty = next((c for c in range(self.assignment.columns) if c not in loaded), None)
        return tuple(sorted(loaded | ({empty} if empty is not None else set())))

    @functools.cached_property
    def factor_calls(self) -> tuple[Collective, ...]:
        """The factor all-reduces of a factor-update step (every rank takes part)."""
        return tuple(b.collective for b in self.schedule.factor_buckets)

    @functools.cached_property
    def gather_calls(self) -> tuple[Collective, ...]:
        """FSDP2 under COMM-OPT: the all-gather of the gradient rows, on every step (every
        rank)."""
        return tuple(b.collective for b in self.schedule.gather_buckets)

    @functools.cached_property
    def agree_calls(self) -> tuple[Collective, ...]:
        """Deferred factor reduction: whether every rank folds this factor step's batch
        factors (every rank, on steps that fold factors)."""
        return tuple(b.collective for b in self.schedule.agree_buckets)

    @functools.cached_property
    def finite_calls(self) -> tuple[Collective, ...]:
        """FSDP2's ``rows_mode``: whether every rank's gradient rows are finite (every rank,
        on steps that fold factors or measure staleness)."""
        return tuple(b.collective for b in self.schedule.finite_buckets)

    @functools.cached_property
    def clip_calls(self) -> tuple[Collective, ...]:
        """FSDP2's ``rows_mode``: the KL clip's sums over every rank's rows (every rank, every
        step)."""
        return tuple(b.collective for b in self.schedule.clip_buckets)

    def row_gather_calls(self, row: int) -> tuple[Collective, ...]:
        """FSDP2's ``rows_mode``: the gathers of the gradient rows within receiver group
        ``row``, every step."""
        return tuple(b.collective for b in self.schedule.gather_buckets_of_row(row))

    def column_gather_calls(self, column: int) -> tuple[Collective, ...]:
        """FSDP2's ``rows_mode`` under HYBRID-OPT: the all-gathers of what the rows gathered,
        within ``column``'s workers, every step."""
        return self._column_gathers.get(column, ())

    @functools.cached_property
    def _column_gathers(self) -> dict[int, tuple[Collective, ...]]:
        found: dict[int, list[Collective]] = {}
        for bucket in self.schedule.gather_columns:
            found.setdefault(bucket.group[0], []).append(bucket.collective)  # its column
        return {column: tuple(calls) for column, calls in found.items()}

    @functools.cached_property
    def staleness_calls(self) -> tuple[Collective, ...]:
        """The staleness all-reduce of a decomposition step (every rank), if measured."""
        return tuple(b.collective for b in self.schedule.staleness_buckets)

    def column_calls(self, column: int) -> tuple[Collective, ...]:
        """The decomposition broadcasts within ``column`` (its ranks all take part)."""
        return self._by_column.get(column, ())

    def row_calls(self, row: int) -> tuple[Collective, ...]:
        """The gradient broadcasts within receiver group ``row`` (its ranks all take part)."""
        found = self._rows.get(row)
        if found is None:
            first = tuple(b.collective for b in self.schedule.gradient_row)
            if row == 0:
                found = first
            else:  # the first row's, moved (as Schedule.gradient_buckets_of_row moves buckets)
                columns = self.assignment.columns
                group = tuple(range(row * columns, (row + 1) * columns))
                found = tuple(
                    Collective(
                        purpose=c.purpose,
                        op=c.op,
                        group=group,
                        src=None if c.src is None else c.src + row * columns,
                        nbytes=c.nbytes,
                    )
                    for c in first
                )
            self._rows[row] = found
        return found

    def column_memory(self, column: int) -> dict[str, int]:
        """Bytes of K-FAC state on every rank of ``column`` (``memory_for_rank``)."""
        return _memory(self._every_rank, self._decompositions.get(column, 0))

    def most_memory(self) -> dict[str, int]:
        """The memory of the rank that holds the most K-FAC state (the lowest such rank)."""
        held = self._decompositions
        return self.column_memory(max(self.representatives, key=lambda c: held.get(c, 0)))

    @functools.cached_property
    def _by_column(self) -> dict[int, tuple[Collective, ...]]:
        found: dict[int, list[Collective]] = {}
        for bucket in self.schedule.decomposition_buckets:
            found.setdefault(bucket.group[0], []).append(bucket.collective)  # its column
        return {column: tuple(calls) for column, calls in found.items()}

    @functools.cached_property
    def _every_rank(self) -> tuple[int, int]:
        return _every_rank_bytes(self.layers, self.options)

    @functools.cached_property
    def _decompositions(self) -> dict[int, int]:
        """Bytes of decompositions on the ranks of each loaded column."""
        found: dict[int, int] = {}
        for layer in self.layers:
            column = self.assignment.column_of(layer.name)
            found[column] = found.get(column, 0) + decomposition_bytes(layer, self.options)
        return found

    def rank_plan(self, rank: int) -> RankPlan:
        """``rank``'s plan, composed of its column's and its row's (see the class)."""
        row, column = divmod(rank, self.assignment.columns)
        gradients = self.row_calls(row) + self.clip_calls
        factors, finite = self.factor_calls, self.finite_calls
        # deferred: the agreement on every factor step, the averages on decomposition steps
        agree = self.agree_calls
        batches = () if self.options.deferred else factors
        gathers = self.gather_calls + self.row_gather_calls(row) + self.column_gather_calls(column)
        return RankPlan(
            rank=rank,
            memory=self.column_memory(column),
            calls={
                StepType.PLAIN: gathers + gradients,
                StepType.FACTOR_UPDATE: agree + batches + gathers + finite + gradients,
                StepType.INVERSE_UPDATE: agree
                + factors
                + gathers
                + finite
                + self.column_calls(column)
                + gradients
                + self.staleness_calls,
            },
        )

    def calls_at(
        self, rank: int, factor_layers: Collection[str], decomposition_layers: Collection[str]
    ) -> tuple[Collective, ...]:
        """The collectives ``rank`` issues on a step where ``factor_layers`` update their
        factors and ``decomposition_layers`` their decompositions (per-layer intervals), in
        the order it issues them. No layer: ``calls[PLAIN]``; every layer in both:
        ``calls[INVERSE_UPDATE]``."""
        sched = self.schedule.restricted(factor_layers, decomposition_layers)
        staleness = bool(decomposition_layers)
        finite = bool(factor_layers) or (staleness and self.options.staleness_probes > 0)
        return _calls(sched, rank, staleness=staleness, finite=finite)

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


class _Ranks(Sequence[RankPlan]):
    """``Plan.ranks``: rank ``r``'s ``RankPlan``, built on first access and kept."""

    def __init__(self, owner: Plan) -> None:
        self._plan = owner
        self._built: dict[int, RankPlan] = {}

    def __len__(self) -> int:
        return self._plan.world_size

    @overload
    def __getitem__(self, index: int) -> RankPlan: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[RankPlan, ...]: ...

    def __getitem__(self, index: int | slice) -> RankPlan | tuple[RankPlan, ...]:
        if isinstance(index, slice):
            return tuple(self[r] for r in range(self._plan.world_size)[index])
        rank = range(self._plan.world_size)[index]  # negative indices; IndexError past the end
        found = self._built.get(rank)
        if found is None:
            found = self._built[rank] = self._plan.rank_plan(rank)
        return found

    def __iter__(self) -> Iterator[RankPlan]:
        return (self[r] for r in range(self._plan.world_size))


def memory_for_rank(
    layers: Sequence[PlannedLayer], assignment: Assignment, options: Options, rank: int
) -> dict[str, int]:
    """Bytes of K-FAC state on ``rank``: the factors (every rank), the decompositions (the
    layer's gradient workers) and the buffers: a batch-factor buffer per factor, with
    staleness measured each factor's sketch (``n × staleness_probes``, every rank), and the
    step's two device scalars (the skipped-step count and the KL clip's scale).
    ``Plan.column_memory`` gives the same per column, from the same parts."""
    held = sum(
        decomposition_bytes(layer, options)
        for layer in layers
        if assignment.is_grad_worker(layer.name, rank)
    )
    return _memory(_every_rank_bytes(layers, options), held)


@functools.lru_cache(maxsize=4096)  # the same layers in every plan of a job
def decomposition_bytes(layer: PlannedLayer, options: Options) -> int:
    """Bytes of one layer's decompositions, held by each of its gradient workers."""
    a_parts, g_parts, table = decomposition_parts(layer, options)
    return itemsize(layer.inv_dtype) * (sum(p.numel for p in a_parts + g_parts) + table)


def _every_rank_bytes(layers: Sequence[PlannedLayer], options: Options) -> tuple[int, int]:
    """Bytes every rank holds: the factors, and the buffers (a batch-factor buffer per factor,
    with staleness measured each factor's sketch, under EKFAC the batch's fitted diagonal, and
    the step's two device scalars)."""
    factors = extra = 0
    for layer in layers:
        elem = itemsize(layer.factor_dtype)
        factors += elem * layer.factor_elements
        extra += elem * layer.groups * (layer.a_dim + layer.g_dim) * options.staleness_probes
        if options.scaling is Scaling.EKFAC:  # the batch's fitted diagonal
            extra += elem * layer.groups * layer.g_dim * layer.a_dim
    return factors, factors + extra + STEP_SCALAR_BYTES


def _memory(every_rank: tuple[int, int], decompositions: int) -> dict[str, int]:
    factors, buffers = every_rank
    memory = {"factors": factors, "decompositions": decompositions, "buffers": buffers}
    memory["total"] = sum(memory.values())
    return memory


def _calls(sched: Schedule, rank: int, *, staleness: bool, finite: bool) -> tuple[Collective, ...]:
    """One step's collectives on ``rank`` in the order the preconditioner issues them:
    (deferred factor reduction: the agreement to fold) factors (deferred: the averages),
    FSDP2's gradient rows (and, in ``rows_mode``, whether they are finite where ``finite``),
    decompositions, gradients (and ``rows_mode``'s clip sums), then (on steps with
    decompositions) staleness. Of the gradient broadcasts (and ``rows_mode``'s gathers)
    only its own row's can include it (no need to list every row's)."""
    row = rank // sched.assignment.columns
    buckets = [
        *sched.agree_buckets,
        *sched.factor_buckets,
        *sched.gather_buckets,
        *sched.gather_buckets_of_row(row),
        *sched.gather_columns,
        *(sched.finite_buckets if finite else ()),
        *sched.decomposition_buckets,
        *sched.gradient_buckets_of_row(row),
        *sched.clip_buckets,
        *(sched.staleness_buckets if staleness else ()),
    ]
    return tuple(b.collective for b in sched.for_rank(buckets, rank))


def calls_for_rank(sched: Schedule, rank: int) -> dict[StepType, tuple[Collective, ...]]:
    """``rank``'s collectives per step type, taken bucket by bucket from the schedule (what
    ``Plan.rank_plan`` composes from its column and row; the tests hold one to the other)."""
    none = sched.restricted((), ())
    factors_only = sched.restricted([layer.name for layer in sched.layers], ())
    return {
        StepType.PLAIN: _calls(none, rank, staleness=False, finite=False),
        StepType.FACTOR_UPDATE: _calls(factors_only, rank, staleness=False, finite=True),
        StepType.INVERSE_UPDATE: _calls(sched, rank, staleness=True, finite=True),
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
    embeddings: bool = False,
    staleness_probes: int = 0,
    scaling: Scaling | str = Scaling.KRONECKER,
    parallel: Parallel | str = Parallel.DDP,
    factor_reduction: FactorReduction | str = FactorReduction.EVERY_UPDATE,
) -> Plan:
    """Price a strategy: per-rank K-FAC memory and per-step collectives, exactly.

    Args:
        model_or_layers: a model (its layers are found as the preconditioner would, with
            ``skip_layers`` and ``embeddings``) or a list of ``LayerShape``/``PlannedLayer``.
        world_size: number of ranks.
        grad_worker_fraction: as for ``KFACPreconditioner``.
        staleness_probes: columns of each factor's staleness sketch when the preconditioner
            measures staleness (``kaisa_ray.staleness.PROBES``), else 0.
        scaling: as for ``KFACPreconditioner`` ('adam-eigenbasis' holds Adam's moments
            beside the eigen method's decompositions, and no eigenvalue table; 'ekfac' its
            fitted diagonal, reduced with the factors).
        parallel: 'ddp' (whole parameters on every rank) or 'fsdp' (sharded by FSDP2's
            ``fully_shard``: each step also all-gathers the layers' gradient rows).
        factor_reduction: as for ``KFACPreconditioner`` ('deferred': the factors' running
            averages all-reduced on decomposition steps, one number on factor steps).

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
        staleness_probes=staleness_probes,
        scaling=parse_enum(Scaling, scaling, "scaling"),
        parallel=parse_enum(Parallel, parallel, "parallel"),
        factor_reduction=parse_enum(FactorReduction, factor_reduction, "factor_reduction"),
    )
    fraction = resolve_grad_worker_fraction(grad_worker_fraction, world_size)
    if not isinstance(model_or_layers, Sequence):  # a model (torch is loaded: it made one)
        layers = layer_shapes(model_or_layers, skip_layers=skip_layers, embeddings=embeddings)
    else:
        layers = [
            layer
            if isinstance(layer, PlannedLayer)
            else PlannedLayer(
                name=layer.name,
                a_dim=layer.a_dim,
                g_dim=layer.g_dim,
                groups=layer.groups,
                diagonal_a=layer.diagonal_a,
            )
            for layer in model_or_layers
        ]
    return build_plan(layers, world_size, fraction, options)


def check_placement(scaling: Scaling, world_size: int, fraction: float) -> None:
    """Refuse a scaling the strategy cannot place (``strategy.placeable``)."""
    if not placeable(scaling, world_size, fraction):
        raise ConfigurationError(
            f"scaling='ekfac' fits its diagonal from every rank's examples projected onto "
            f"each layer's eigenbases, so every rank must hold them; grad_worker_fraction "
            f"{fraction:g} keeps them on {round(fraction * world_size)} of {world_size} "
            "ranks. Use grad_worker_fraction='comm-opt' (1), or scaling='adam-eigenbasis', "
            "whose per-layer state lives only on the layer's gradient workers."
        )


def check_deferral(options: Options) -> None:
    """Refuse deferred factor reduction where something reads the factors between
    decompositions or reduces more with them."""
    if not options.deferred:
        return
    reason = None
    if options.scaling is Scaling.EKFAC:
        reason = "scaling='ekfac' reduces its fitted diagonal with the factors every factor step"
    elif options.staleness_probes:
        reason = "measured staleness compares the factors between decompositions"
    elif options.parallel is Parallel.FSDP:
        reason = "a model sharded by FSDP2 (fully_shard) is not supported with it yet"
    if reason is not None:
        raise ConfigurationError(
            f"factor_reduction='deferred' averages the factors over the ranks only when they "
            f"are decomposed, but {reason}: use factor_reduction='every-update'."
        )


def build_plan(
    layers: Sequence[PlannedLayer], world_size: int, fraction: float, options: Options
) -> Plan:
    check_placement(options.scaling, world_size, fraction)
    check_deferral(options)
    grad_workers = round(fraction * world_size)
    assignment = assign(
        list(layers),
        world_size=world_size,
        grad_workers=grad_workers,
        strategy=options.assignment_strategy,
        colocate_factors=options.colocate_factors,
    )
    return Plan(
        world_size=world_size,
        grad_worker_fraction=fraction,
        options=options,
        layers=tuple(layers),
        assignment=assignment,
    )
