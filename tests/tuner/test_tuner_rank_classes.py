"""The cost model prices a class of ranks at a time (``tuner.rank_classes``); here it is held,
exactly, to pricing every rank as it did before: the slowest rank's seconds and breakdown,
the K-FAC state, the per-layer costs of adaptive intervals, over world sizes whose rows and
columns straddle nodes in different ways, with contention and staleness."""

from __future__ import annotations

import dataclasses
import random

import pytest

from kaisa_ray.assignment import LayerShape
from kaisa_ray.plan import Plan, StepType, plan
from kaisa_ray.strategy import valid_fractions
from kaisa_train.planning import load_hardware
from tuner.cost import (
    CubicFit,
    LinkFit,
    Profile,
    every_step_seconds,
    layer_costs,
    precondition_flops,
    price,
    prices,
)
from tuner.topology import Topology

HARDWARE = load_hardware("a100-80gb-hdr")


def layers(seed: int, count: int) -> tuple[LayerShape, ...]:
    rng = random.Random(seed)
    return tuple(
        LayerShape(
            name=f"l{i}",
            a_dim=rng.choice([27, 64, 257, 513, 1025]),
            g_dim=rng.choice([16, 64, 256, 512]),
            groups=rng.choice([1, 1, 2]),
        )
        for i in range(count)
    )


def profile(world: int, shapes: tuple[LayerShape, ...], **changes: object) -> Profile:
    base = Profile(
        world_size=world,
        layers=shapes,
        base_memory_bytes=2**30,
        step_s=0.1,
        factor_s=0.05,
        decomposition=CubicFit(c0=1e-4, c3=2e-11),
        precondition_s_per_flop=1e-12,
        allreduce=LinkFit(latency_s=1e-4, bytes_per_s=3e9),
        broadcast=LinkFit(latency_s=2e-4, bytes_per_s=2e9),
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


# What tuner.cost did before the classes: a pass over every rank (a85ad65, verbatim but for names).


def uncontended(work: list[float], contention: float) -> list[float]:
    busiest = max(work, default=0.0)
    if contention <= 1.0 or busiest <= 0.0:
        return work
    busy = sum(work) / (len(work) * busiest)
    scale = (1.0 + (contention - 1.0) * busy) / contention
    return [seconds * scale for seconds in work]


def every_rank(
    p: Profile, strategy: Plan, fus: int, ius: int
) -> tuple[float, dict[str, float], int]:
    assignment = strategy.assignment
    worst: tuple[float, dict[str, float]] | None = None
    world = len(strategy.ranks)
    decompositions = [0.0] * world
    precondition = [0.0] * world
    for rank_plan in strategy.ranks:
        rank = rank_plan.rank
        for layer in p.layers:
            place = assignment.placements[layer.name]
            if place.a_rank == rank:
                decompositions[rank] += layer.groups * p.decomposition.seconds(layer.a_dim)
            if place.g_rank == rank:
                decompositions[rank] += layer.groups * p.decomposition.seconds(layer.g_dim)
            if assignment.is_grad_worker(layer.name, rank):
                flops = precondition_flops(layer, p.compute_method)
                precondition[rank] += flops * p.precondition_s_per_flop
    decompositions = uncontended(decompositions, p.contention)
    precondition = uncontended(precondition, p.contention)
    for rank_plan in strategy.ranks:
        rank = rank_plan.rank
        plain, factor, inverse = (
            sum(p.collective_seconds(c.op, c.group, c.nbytes) for c in rank_plan.calls[t])
            for t in (StepType.PLAIN, StepType.FACTOR_UPDATE, StepType.INVERSE_UPDATE)
        )
        breakdown = {
            "factors": p.factor_s / fus,
            "decompositions": decompositions[rank] / ius,
            "precondition": precondition[rank],
            "communication": plain + (factor - plain) / fus + (inverse - factor) / ius,
        }
        total = p.step_s + sum(breakdown.values())
        if worst is None or total > worst[0]:
            worst = (total, breakdown)
    assert worst is not None
    return worst[0], worst[1], max(r.memory["total"] for r in strategy.ranks)


def every_rank_layer_costs(p: Profile, strategy: Plan) -> dict[str, tuple[float, float]]:
    assignment = strategy.assignment
    per_rank = [0.0] * len(strategy.ranks)
    own: dict[str, float] = {}
    for layer in p.layers:
        place = assignment.placements[layer.name]
        a = layer.groups * p.decomposition.seconds(layer.a_dim)
        g = layer.groups * p.decomposition.seconds(layer.g_dim)
        per_rank[place.a_rank] += a
        per_rank[place.g_rank] += g
        own[layer.name] = a + g
    decompositions = max(uncontended(per_rank, p.contention), default=0.0)
    factor_comm = inverse_comm = 0.0
    for rank_plan in strategy.ranks:
        plain, factor, inverse = (
            sum(p.collective_seconds(c.op, c.group, c.nbytes) for c in rank_plan.calls[t])
            for t in (StepType.PLAIN, StepType.FACTOR_UPDATE, StepType.INVERSE_UPDATE)
        )
        factor_comm = max(factor_comm, factor - plain)
        inverse_comm = max(inverse_comm, inverse - factor)
    weights = {x.name: x.groups * (x.a_dim**2 + x.g_dim**2) for x in p.layers}
    total_weight = sum(weights.values()) or 1
    total_own = sum(own.values()) or 1.0
    return {
        name: (
            (p.factor_s + factor_comm) * weights[name] / total_weight,
            (decompositions + inverse_comm) * own[name] / total_own,
        )
        for name in weights
    }


def every_rank_every_step(p: Profile, strategy: Plan) -> float:
    _, breakdown, _ = every_rank(p, strategy, 1, 1)
    plain = max(
        sum(p.collective_seconds(c.op, c.group, c.nbytes) for c in r.calls[StepType.PLAIN])
        for r in strategy.ranks
    )
    return breakdown["precondition"] + plain


CASES = [
    # world, gpus per node (None: the α-β fits, no topology), contention, staleness probes
    (1, None, 1.0, 0),
    (4, None, 2.0, 0),
    (12, 8, 1.0, 0),  # rows of 3 and 6 straddle nodes, the last node is part-full
    (24, 8, 1.0, 8),
    (24, 5, 1.7, 0),
    (30, 4, 1.0, 8),
    (36, 3, 3.0, 0),
    (64, 8, 1.0, 0),
    (60, 7, 1.3, 8),
]


@pytest.mark.parametrize(("world", "per_node", "contention", "probes"), CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_pricing_by_class_is_pricing_every_rank(
    world: int, per_node: int | None, contention: float, probes: int, seed: int
) -> None:
    shapes = layers(seed, 5 + 9 * seed)
    topology = None if per_node is None else Topology.of(HARDWARE, per_node)
    p = profile(world, shapes, topology=topology, contention=contention)
    intervals = [(1, 1), (1, 10), (5, 50), (3, 7 * 3)]
    for fraction in valid_fractions(world):
        strategy = plan(list(shapes), world, fraction, staleness_probes=probes)
        priced = prices(p, strategy, intervals)
        for (fus, ius), candidate in zip(intervals, priced, strict=True):
            step_s, breakdown, state = every_rank(p, strategy, fus, ius)
            assert (candidate.step_s, candidate.breakdown) == (step_s, breakdown)
            assert candidate.kfac_state_bytes == state
            assert price(p, strategy, fus, ius) == candidate
        assert {
            name: (cost.factor_s, cost.decomposition_s)
            for name, cost in layer_costs(p, strategy).items()
        } == every_rank_layer_costs(p, strategy)
        assert every_step_seconds(p, strategy) == every_rank_every_step(p, strategy)


def test_the_classes_notice_a_row_that_costs_more() -> None:
    """12 ranks on nodes of 8, f = 1/3: rows of 3 ranks, row 2 (ranks 6-8) spans two nodes,
    so its gradient broadcasts cost more than the other rows': with communication the only
    cost, the slowest rank is in it."""
    shapes = layers(3, 6)
    free = CubicFit(c0=0.0, c3=0.0)
    p = profile(
        12,
        shapes,
        topology=Topology.of(HARDWARE, 8),
        decomposition=free,
        precondition_s_per_flop=0.0,
    )
    strategy = plan(list(shapes), 12, 1 / 3)
    rows = [
        sum(p.collective_seconds(c.op, c.group, c.nbytes) for c in strategy.row_calls(i))
        for i in range(4)
    ]
    assert rows[2] > rows[0] == rows[1]
    (candidate,) = prices(p, strategy, [(10, 100)])
    assert candidate.step_s == every_rank(p, strategy, 10, 100)[0]
    assert candidate.breakdown["communication"] >= rows[2]


def test_the_pricer_of_a_group_is_its_seconds() -> None:
    topology = Topology.of(HARDWARE, 8)
    for group in [tuple(range(16)), tuple(range(3, 40, 5)), (0, 9, 10), tuple(range(6, 9)), (5,)]:
        for op in ("all_reduce", "broadcast"):
            for nbytes in (0, 1, 4096, 3 * 2**20 + 7):
                assert topology.pricer(op, group)(nbytes) == topology.seconds(op, group, nbytes)


@pytest.mark.parametrize("per_node", [1, 3, 5, 8])
def test_the_span_of_spaced_ranks_is_counted_by_formula_exactly(per_node: int) -> None:
    topology = Topology.of(HARDWARE, per_node)

    def counted(group: tuple[int, ...]) -> tuple[int, int]:
        nodes: dict[int, int] = {}
        for rank in group:
            nodes[rank // per_node] = nodes.get(rank // per_node, 0) + 1
        return len(nodes), max(nodes.values(), default=0)

    rng = random.Random(per_node)
    groups = [
        tuple(range(first, first + step * p, step))
        for first in range(20)
        for step in range(1, 12)
        for p in range(0, 30)
    ]
    groups += [tuple(rng.sample(range(200), rng.randint(1, 40))) for _ in range(300)]
    groups += [(4, 5, 7), (9, 8, 7), (2, 2, 3)]
    for group in groups:
        assert topology.span(group) == counted(group), group


def test_a_sharded_plan_costs_its_gather_on_every_step() -> None:
    """FSDP2's all-gather of the gradient rows under COMM-OPT (``plan(..., parallel='fsdp')``)
    is priced as the all-gather half of a ring all-reduce of every rank's share, on every
    step type, and is the only difference from the DDP plan's price."""
    shapes = layers(3, 6)
    world = 4
    ddp, fsdp = plan(shapes, world, "comm-opt"), plan(shapes, world, "comm-opt", parallel="fsdp")
    (gather,) = fsdp.gather_calls
    base = profile(world, shapes)
    expected = base.allreduce.seconds(world * gather.nbytes) / 2
    for fus, ius in [(1, 1), (1, 10), (10, 100)]:
        plain, sharded = price(base, ddp, fus, ius), price(base, fsdp, fus, ius)
        assert sharded.step_s - plain.step_s == pytest.approx(expected, rel=1e-9), (fus, ius)
        assert sharded.kfac_state_bytes == plain.kfac_state_bytes


def test_a_sharded_mem_opt_plan_costs_its_gathers_and_scatters_in_place_of_broadcasts() -> None:
    """FSDP2 under MEM-OPT: each gather of the rows to a worker and each scatter back is
    priced as a broadcast of the other members' shares (the worker's link carries them all),
    the clip's sums as an all-reduce on every step and whether the rows are finite on factor
    steps, in place of DDP's broadcasts of the whole preconditioned gradients."""
    shapes = layers(3, 6)
    world = 4
    ddp, fsdp = plan(shapes, world, "mem-opt"), plan(shapes, world, "mem-opt", parallel="fsdp")
    base = profile(world, shapes)
    calls = fsdp.ranks[0].calls[StepType.PLAIN]
    moved = [c for c in calls if c.op in ("gather", "scatter")]
    assert {c.op for c in moved} == {"gather", "scatter"}
    assert fsdp.gather_calls == ()
    every_step = sum(base.broadcast.seconds(c.nbytes * (world - 1)) for c in moved) + sum(
        base.allreduce.seconds(c.nbytes) for c in fsdp.clip_calls
    )
    every_step -= sum(base.broadcast.seconds(c.nbytes) for c in ddp.ranks[0].calls[StepType.PLAIN])
    (finite,) = fsdp.finite_calls
    for fus, ius in [(1, 1), (1, 10), (10, 100)]:
        plain, sharded = price(base, ddp, fus, ius), price(base, fsdp, fus, ius)
        expected = every_step + base.allreduce.seconds(finite.nbytes) / fus
        assert sharded.step_s - plain.step_s == pytest.approx(expected, rel=1e-9), (fus, ius)
        assert sharded.kfac_state_bytes == plain.kfac_state_bytes
