"""A plan built without enumerating ranks is the plan built rank by rank.

``kaisa_ray.plan`` composes each rank's plan from its column's and its row's, keeps the
gradient broadcasts as the first row's, and assigns layers with heaps: here each is held to the
direct construction (every rank, every row, every bucket; the greedy minimum over all columns
and ranks) written out as it was before, over world sizes, fractions and options.
"""

from __future__ import annotations

import random

import pytest

from kaisa_ray.assignment import Assignment, LayerPlacement, LayerShape, assign
from kaisa_ray.buckets import BucketKey, Collective, Piece, Purpose, StepType, fill
from kaisa_ray.enums import AssignmentStrategy
from kaisa_ray.plan import Plan, calls_for_rank, memory_for_rank, plan
from kaisa_ray.schedule import Schedule
from kaisa_ray.strategy import valid_fractions

LAYERS = [
    LayerShape(name="conv1", a_dim=26, g_dim=8),
    LayerShape(name="conv2", a_dim=201, g_dim=16),
    LayerShape(name="fc1", a_dim=785, g_dim=128),
    LayerShape(name="fc2", a_dim=129, g_dim=10),
    LayerShape(name="grouped", a_dim=65, g_dim=32, groups=4),
    LayerShape(name="fc3", a_dim=129, g_dim=10),  # ties fc2
]
OPTIONS = [
    {},
    {"compute_method": "inverse", "symmetry_aware": True, "staleness_probes": 8},
    {"colocate_factors": False, "assignment_strategy": "memory", "allreduce_bucket_cap_mb": 0.05},
]
WORLDS = [1, 2, 3, 4, 6, 8, 12, 16]


def greedy(
    layers: list[LayerShape],
    world_size: int,
    grad_workers: int,
    strategy: AssignmentStrategy,
    colocate: bool,
) -> dict[str, LayerPlacement]:
    """The assignment as it was written before: a minimum over every column and rank."""
    columns = [
        tuple(range(j, world_size, world_size // grad_workers))
        for j in range(world_size // grad_workers)
    ]
    column_load, rank_load = [0] * len(columns), [0] * world_size
    order = sorted(
        range(len(layers)),
        key=lambda i: -(layers[i].cost("a", strategy) + layers[i].cost("g", strategy)),
    )
    found = {}
    for index in order:
        layer = layers[index]
        a_cost, g_cost = layer.cost("a", strategy), layer.cost("g", strategy)
        j = min(range(len(columns)), key=lambda c: (column_load[c], c))
        column_load[j] += a_cost + g_cost
        members = columns[j]

        def least(members: tuple[int, ...] = members) -> int:
            return min(members, key=lambda r: (rank_load[r], r))

        if colocate:
            a_rank = g_rank = least()
            rank_load[a_rank] += a_cost + g_cost
        else:
            a_rank = least()
            rank_load[a_rank] += a_cost
            g_rank = least()
            rank_load[g_rank] += g_cost
        found[layer.name] = LayerPlacement(a_rank=a_rank, g_rank=g_rank, workers=members)
    return found


@pytest.mark.parametrize("seed", range(6))
def test_the_assignment_is_the_greedy_minimum_over_every_column_and_rank(seed: int) -> None:
    rng = random.Random(seed)
    dims = [rng.choice([3, 8, 16, 64, 65, 100]) for _ in range(40)]  # many ties
    layers = [
        LayerShape(name=f"l{i}", a_dim=dims[i], g_dim=rng.choice(dims), groups=rng.choice([1, 2]))
        for i in range(rng.randint(1, 40))
    ]
    for world in (1, 2, 6, 12, 16, 60):
        for workers in (d for d in range(1, world + 1) if world % d == 0):
            for strategy in AssignmentStrategy:
                for colocate in (True, False):
                    got = assign(
                        layers,
                        world_size=world,
                        grad_workers=workers,
                        strategy=strategy,
                        colocate_factors=colocate,
                    )
                    want = greedy(layers, world, workers, strategy, colocate)
                    assert got.placements == want, (world, workers, strategy, colocate)
                    assert list(got.placements) == [layer.name for layer in layers]


def buckets_of(p: Plan, rank: int) -> dict[StepType, tuple[Collective, ...]]:
    """``rank``'s calls as before: every bucket of the full schedule that includes it."""

    def calls(s: Schedule, staleness: bool) -> tuple[Collective, ...]:
        found = [
            *s.factor_buckets,
            *s.decomposition_buckets,
            *s.gradient_buckets,
            *(s.staleness_buckets if staleness else ()),
        ]
        return tuple(b.collective for b in found if rank in b.members)

    sched = p.schedule
    return {
        StepType.PLAIN: calls(sched.restricted((), ()), False),
        StepType.FACTOR_UPDATE: calls(sched.restricted([x.name for x in p.layers], ()), False),
        StepType.INVERSE_UPDATE: calls(sched, True),
    }


def every_row_gradients(p: Plan) -> list[tuple[tuple[int, ...], int, object, tuple[Piece, ...]]]:
    """The gradient buckets as they were built: every row, every layer, with the source the
    row's member of the layer's column."""
    grid: Assignment = p.assignment
    if not grid.broadcasts_gradients:
        return []
    items: list[tuple[BucketKey, Piece]] = []
    groups = dict(enumerate(grid.receiver_groups()))
    for index, row in groups.items():
        for layer in p.layers:
            src = grid.grad_source(layer.name, row[0])
            numel = layer.groups * layer.g_dim * layer.a_dim
            items.append(
                ((index, src, layer.grad_dtype), Piece(layer=layer.name, part="grad", numel=numel))
            )
    built = fill(
        items,
        groups=groups,
        purpose=Purpose.GRADIENTS,
        op="broadcast",
        cap_bytes=p.options.bucket_cap_bytes,
    )
    return [(b.group, b.src, b.dtype, b.pieces) for b in built]  # type: ignore[misc]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize(
    "options", OPTIONS, ids=["eigen", "inverse-symmetric-staleness", "apart-memory-small-cap"]
)
def test_every_ranks_plan_is_the_rank_by_rank_plan(world: int, options: dict[str, object]) -> None:
    for fraction in valid_fractions(world):
        p = plan(LAYERS, world, fraction, **options)  # type: ignore[arg-type]
        gradients = [(b.group, b.src, b.dtype, b.pieces) for b in p.schedule.gradient_buckets]
        assert gradients == every_row_gradients(p)
        assert len(p.ranks) == world
        empty = [r for r in p.representatives if r not in p.loaded_columns]
        assert len(empty) == (p.assignment.columns > len(p.loaded_columns))
        for rank in range(world):
            mine = p.ranks[rank]
            assert mine.rank == rank
            assert mine.calls == buckets_of(p, rank) == calls_for_rank(p.schedule, rank)
            assert mine.memory == memory_for_rank(p.layers, p.assignment, p.options, rank)
            # its representative: the same memory and calls but for where the row moves them
            column = rank % p.assignment.columns
            stand_in = p.ranks[column if column in p.loaded_columns else empty[0]]
            assert stand_in.rank <= rank
            assert stand_in.memory == mine.memory
            for step in StepType:
                same = [(c.purpose, c.op, c.nbytes) for c in mine.calls[step]]
                assert same == [(c.purpose, c.op, c.nbytes) for c in stand_in.calls[step]]
        assert [r.rank for r in p.ranks] == list(range(world))
        assert p.ranks[-1] is p.ranks[world - 1]


def test_the_representatives_are_the_loaded_columns_and_one_empty_one() -> None:
    p = plan(LAYERS, 64, 1 / 64)  # MEM-OPT: 64 columns, six layers
    assert p.loaded_columns == tuple(sorted(p.assignment.column_of(x.name) for x in LAYERS))
    assert p.representatives == (*p.loaded_columns, 6)  # columns 0-5 loaded, 6 the first empty
    full = plan(LAYERS, 4, 1.0)  # one column, every layer on it
    assert full.representatives == full.loaded_columns == (0,)
    with pytest.raises(IndexError):
        p.ranks[64]


def test_a_plan_of_65536_ranks_is_built_without_them() -> None:
    p = plan(LAYERS, 65536, 2 / 65536)  # two rows of 32,768
    assert len(p.ranks) == 65536
    last = p.ranks[65535]
    assert last.calls[StepType.PLAIN] == p.row_calls(1)
    assert {c.group for c in last.calls[StepType.PLAIN]} == {tuple(range(32768, 65536))}
    assert [c.src for c in last.calls[StepType.PLAIN]] == [
        c.src + 32768 for c in p.row_calls(0) if c.src is not None
    ]
    assert len(p.ranks._built) == 1  # type: ignore[attr-defined]


@pytest.mark.parametrize("world", WORLDS)
def test_a_sharded_ranks_plan_is_the_rank_by_rank_plan(world: int) -> None:
    """FSDP2 (``parallel='fsdp'``): composed from its row's gathers and scatters, its
    column's all-gathers and every rank's sums, a rank's plan is the schedule's bucket by
    bucket, and its representative's but for where the row moves them."""
    for fraction in valid_fractions(world):
        p = plan(LAYERS, world, fraction, parallel="fsdp")
        empty = [r for r in p.representatives if r not in p.loaded_columns]
        for rank in range(world):
            mine = p.ranks[rank]
            assert mine.calls == calls_for_rank(p.schedule, rank), (fraction, rank)
            column = rank % p.assignment.columns
            stand_in = p.ranks[column if column in p.loaded_columns else empty[0]]
            for step in StepType:
                same = [(c.purpose, c.op, c.nbytes) for c in mine.calls[step]]
                assert same == [(c.purpose, c.op, c.nbytes) for c in stand_in.calls[step]]
        ops = {c.op for c in p.ranks[0].calls[StepType.PLAIN]}
        assert ops == (
            {"all_gather"}
            if p.assignment.columns == 1
            else {"gather", "scatter", "all_reduce"}
            | ({"all_gather"} if p.assignment.grad_workers > 1 else set())
        ), fraction
