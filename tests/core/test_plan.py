"""Pure logic of the KAISA strategies: fractions, the grid, work assignment, the plan."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kaisa_ray.assignment import LayerShape, assign
from kaisa_ray.enums import AssignmentStrategy
from kaisa_ray.plan import STEP_SCALAR_BYTES, PlannedLayer, Purpose, StepType, plan
from kaisa_ray.strategy import resolve_grad_worker_fraction, valid_fractions

LAYERS = [
    LayerShape(name="conv1", a_dim=26, g_dim=8),
    LayerShape(name="conv2", a_dim=201, g_dim=16),
    LayerShape(name="fc1", a_dim=785, g_dim=128),
    LayerShape(name="fc2", a_dim=129, g_dim=10),
]


@pytest.mark.parametrize(
    ("value", "world_size", "expected"),
    [
        ("comm-opt", 8, 1.0),
        ("mem-opt", 8, 0.125),
        ("hybrid-opt", 8, 0.5),
        ("MEM_OPT", 3, 1 / 3),
        (0.25, 8, 0.25),
        (1, 1, 1.0),
        ("0.5", 4, 0.5),
    ],
)
def test_fraction_names_and_values(value: object, world_size: int, expected: float) -> None:
    assert resolve_grad_worker_fraction(value, world_size) == pytest.approx(expected)  # type: ignore[arg-type]


def test_fraction_that_does_not_divide_lists_valid_values() -> None:
    with pytest.raises(
        ValueError,
        match=r"grad_worker_fraction=0.25 gives 1.5 gradient workers"
        r".*valid values for world size 6: \[0.1666",
    ):
        resolve_grad_worker_fraction(0.25, 6)
    with pytest.raises(ValueError, match=r"hybrid-opt.*0.5 gradient workers.*world size 1"):
        resolve_grad_worker_fraction("hybrid-opt", 1)
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        resolve_grad_worker_fraction(1.5, 4)
    assert valid_fractions(6) == [1 / 6, 2 / 6, 3 / 6, 1.0]


@pytest.mark.parametrize(("world_size", "workers"), [(8, 1), (8, 2), (8, 4), (8, 8), (6, 3)])
def test_grid_rows_meet_every_column_once(world_size: int, workers: int) -> None:
    grid = assign(LAYERS, world_size=world_size, grad_workers=workers)
    columns, rows = grid.worker_groups(), grid.receiver_groups()
    assert len(columns) == world_size // workers
    assert all(len(c) == workers for c in columns)
    assert sorted(r for c in columns for r in c) == list(range(world_size))
    assert sorted(r for row in rows for r in row) == list(range(world_size))
    for row in rows:
        for column in columns:
            assert len(set(row) & set(column)) == 1
    for layer in LAYERS:
        place = grid.placements[layer.name]
        assert place.workers in columns
        assert place.a_rank in place.workers
        assert place.g_rank in place.workers
        for rank in range(world_size):  # every rank gets the gradient from its own row
            source = grid.grad_source(layer.name, rank)
            assert source in place.workers
            assert source in grid.receiver_group_of(rank)


def test_greedy_assignment_balances_cost() -> None:
    layers = [LayerShape(name=f"l{i}", a_dim=d, g_dim=1) for i, d in enumerate([10, 9, 8, 7])]
    grid = assign(layers, world_size=2, grad_workers=1, strategy=AssignmentStrategy.COMPUTE)
    ranks = {n: p.a_rank for n, p in grid.placements.items()}
    # biggest first: 10 -> rank 0, 9 -> rank 1, 8 -> rank 1 (729 < 1000), 7 -> rank 0
    assert ranks == {"l0": 0, "l1": 1, "l2": 1, "l3": 0}
    by_memory = assign(layers, world_size=2, grad_workers=1, strategy=AssignmentStrategy.MEMORY)
    # n²: 100 -> 0, 81 -> 1, 64 -> 1 (81 < 100), 49 -> 0 (145 > 100+1... loads 101 vs 147)
    assert {n: p.a_rank for n, p in by_memory.placements.items()} == {
        "l0": 0,
        "l1": 1,
        "l2": 1,
        "l3": 0,
    }


def test_colocate_false_splits_a_and_g() -> None:
    grid = assign(
        [LayerShape(name="fc", a_dim=100, g_dim=90)],
        world_size=2,
        grad_workers=2,
        colocate_factors=False,
    )
    place = grid.placements["fc"]
    assert {place.a_rank, place.g_rank} == {0, 1}
    together = assign(
        [LayerShape(name="fc", a_dim=100, g_dim=90)],
        world_size=2,
        grad_workers=2,
        colocate_factors=True,
    ).placements["fc"]
    assert together.a_rank == together.g_rank


def test_plan_memory_is_the_sum_of_its_tensors() -> None:
    p = plan(LAYERS, 4, "mem-opt", compute_method="eigen")
    factors = 4 * sum(layer.a_dim**2 + layer.g_dim**2 for layer in LAYERS)
    total_decomp = sum(r.memory["decompositions"] for r in p.ranks)
    per_layer = 4 * sum(
        layer.a_dim**2 + layer.a_dim + layer.g_dim**2 + layer.g_dim + layer.a_dim * layer.g_dim
        for layer in LAYERS
    )
    assert all(r.memory["factors"] == factors for r in p.ranks)
    # a batch-factor buffer per factor, and the step's two device scalars
    assert all(r.memory["buffers"] == factors + STEP_SCALAR_BYTES for r in p.ranks)
    assert total_decomp == per_layer  # each layer on exactly one rank
    comm = plan(LAYERS, 4, "comm-opt", compute_method="eigen")
    assert all(r.memory["decompositions"] == per_layer for r in comm.ranks)
    inverse = plan(LAYERS, 1, 1.0, compute_method="inverse")
    assert inverse.ranks[0].memory["decompositions"] == factors


def test_plan_collectives_by_strategy() -> None:
    comm = plan(LAYERS, 4, "comm-opt")
    mem = plan(LAYERS, 4, "mem-opt")
    assert comm.ranks[0].calls[StepType.PLAIN] == ()
    assert {c.purpose for c in comm.ranks[0].calls[StepType.INVERSE_UPDATE]} == {
        Purpose.FACTORS,
        Purpose.DECOMPOSITIONS,
    }
    assert {c.purpose for c in mem.ranks[0].calls[StepType.INVERSE_UPDATE]} == {
        Purpose.FACTORS,
        Purpose.GRADIENTS,
    }
    grads = sum(layer.a_dim * layer.g_dim for layer in LAYERS) * 4
    assert mem.ranks[2].bytes(StepType.PLAIN) == grads
    factor_bytes = 4 * sum(layer.a_dim**2 + layer.g_dim**2 for layer in LAYERS)
    assert comm.ranks[1].bytes(StepType.FACTOR_UPDATE) == factor_bytes
    single = plan(LAYERS, 1, "comm-opt")
    assert all(single.ranks[0].calls[t] == () for t in StepType)


def test_symmetry_aware_sends_upper_triangles() -> None:
    full = plan(LAYERS, 2, "comm-opt").ranks[0].bytes(StepType.FACTOR_UPDATE)
    half = plan(LAYERS, 2, "comm-opt", symmetry_aware=True).ranks[0].bytes(StepType.FACTOR_UPDATE)
    assert half == 4 * sum(d * (d + 1) // 2 for layer in LAYERS for d in (layer.a_dim, layer.g_dim))
    assert half < full


def test_buckets_respect_cap_and_never_mix_groups_of_equal_size() -> None:
    p = plan(LAYERS, 4, "hybrid-opt", allreduce_bucket_cap_mb=0.01)
    cap = int(0.01 * 2**20)
    sched = p.schedule
    for bucket in sched.factor_buckets:
        assert bucket.nbytes <= cap or len(bucket.pieces) == 1
    groups = {b.group for b in sched.decomposition_buckets}
    assert groups == {(0, 2), (1, 3)}  # two different groups of the same size
    for bucket in sched.decomposition_buckets + sched.gradient_buckets:
        layers = {piece.layer for piece in bucket.pieces}
        for name in layers:
            assert sched.assignment.placements[name].workers == bucket.group or (
                bucket.purpose is Purpose.GRADIENTS
            )
    one_bucket = plan(LAYERS, 4, "hybrid-opt", allreduce_bucket_cap_mb=100)
    assert len(one_bucket.schedule.factor_buckets) == 1


def test_plan_from_model_matches_preconditioner_layers() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 5, padding=2), nn.Flatten(), nn.Linear(8 * 28 * 28, 10))
    p = plan(model, 2, "mem-opt")
    assert [(lay.name, lay.a_dim, lay.g_dim) for lay in p.layers] == [("0", 26, 8), ("2", 6273, 10)]
    skipped = plan(model, 2, "mem-opt", skip_layers=["Conv2d"])
    assert [lay.name for lay in skipped.layers] == ["2"]
    assert isinstance(p.layers[0], PlannedLayer)


def test_mean_bytes_per_step_amortises_intervals() -> None:
    p = plan(LAYERS, 4, "hybrid-opt")
    rank = p.ranks[0]
    mean = p.mean_bytes_per_step(0, factor_update_steps=5, inv_update_steps=50)
    plain, factor = rank.bytes(StepType.PLAIN), rank.bytes(StepType.FACTOR_UPDATE)
    inverse = rank.bytes(StepType.INVERSE_UPDATE)
    expected = (50 * plain + 10 * (factor - plain) + (inverse - factor)) / 50
    assert mean == pytest.approx(expected)
