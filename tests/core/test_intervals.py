"""Per-layer intervals and their staleness measurement, one process (the fast tier).

The rule on synthetic measurements (shorter above the target, longer within the margin, the
overhead cap); the schedule's aligned steps; the sketch estimator and the angle against their
definitions; the preconditioner measuring without changing what it computes, updating only the
layers whose intervals say so, its memory equal to the plan's, and a resume that continues an
adaptive schedule bit for bit. The distributed checks (every rank the same schedule, bytes sent
equal to the plan under a changing schedule) are in ``test_distributed.py``.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from support.kfac_training import batches, small_cnn, train

from kaisa_ray import KFACPreconditioner
from kaisa_ray.errors import ConfigurationError
from kaisa_ray.intervals import (
    AdaptiveIntervals,
    IntervalSchedule,
    LayerCost,
    Measurement,
    check_rungs,
)
from kaisa_ray.plan import plan
from kaisa_ray.staleness import PROBES, angle_degrees, probe, relative_change, sketch

RUNGS = ((1, 2), (2, 4), (2, 8))


def measured(layer: str, step: int, angle: float) -> Measurement:
    return Measurement(layer=layer, step=step, change_a=0.1, change_g=0.1, angle=angle)


# -- the ladder and the policy --------------------------------------------------------------


@pytest.mark.parametrize(
    ("rungs", "message"),
    [
        ([], "at least one rung"),
        ([(2, 5)], r"multiple of the factor interval, e.g. \(2, 4\)"),
        ([(0, 10)], "must be positive"),
        ([(2, 10), (3, 30)], "do not nest"),
        ([(1, 10), (5, 15)], "do not nest"),
        ([(1, 10), (1, 10)], "do not nest"),
        ([(1, 10, 3)], "two integers"),
    ],
)
def test_a_ladder_that_does_not_nest_is_refused_naming_the_fix(
    rungs: list[tuple[int, ...]], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        check_rungs(rungs)


def test_the_ladder_is_sorted_shortest_first() -> None:
    assert check_rungs([(10, 100), (1, 10), (5, 50)]) == ((1, 10), (5, 50), (10, 100))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"start": 3}, "must index the ladder's 3 rungs"),
        ({"target_angle": 0.0}, r"must be in \(0, 90\) degrees"),
        ({"target_angle": math.nan}, r"must be in \(0, 90\) degrees"),
        ({"margin": 1.5}, r"must be in \(0, 1\]"),
        ({"max_seconds": 0.1}, "max_seconds needs costs"),
        ({"max_seconds": -1.0, "costs": {}}, "positive number of seconds"),
    ],
)
def test_bad_policies_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        AdaptiveIntervals(**kwargs)  # type: ignore[arg-type]


# -- the schedule ---------------------------------------------------------------------------


def test_fixed_schedules_update_every_layer_on_the_reference_steps() -> None:
    schedule = IntervalSchedule.fixed(["a", "b"], 2, lambda step: 3 if step < 6 else 4)
    assert [bool(schedule.factor_layers(s)) for s in range(5)] == [1, 0, 1, 0, 1]
    assert [s for s in range(13) if schedule.decomposition_layers(s)] == [0, 3, 8, 12]
    assert schedule.factor_layers(4) == {"a", "b"}
    assert schedule.decide(6, [measured("a", 6, 80.0)]) == []  # fixed: no rule
    assert schedule.state_dict() == {}


def test_layers_on_different_rungs_update_on_aligned_steps() -> None:
    schedule = IntervalSchedule.adaptive(["a", "b"], AdaptiveIntervals(rungs=RUNGS))
    schedule.decide(0, [measured("a", 0, 1.0), measured("b", 0, 1.0)])  # the first: no change
    # b stays stale for good; a is stable: it lengthens (2/8 is reached at step 4).
    for step in (2, 4):
        schedule.decide(step, [measured("a", step, 1.0), measured("b", step, 30.0)])
    assert schedule.rung_of("a") == (2, 8)
    assert schedule.rung_of("b") == (1, 2)
    updates = [
        (sorted(schedule.factor_layers(s)), sorted(schedule.decomposition_layers(s)))
        for s in range(4, 10)
    ]
    assert updates == [
        (["a", "b"], ["b"]),
        (["b"], []),
        (["a", "b"], ["b"]),
        (["b"], []),
        (["a", "b"], ["a", "b"]),  # a's factor and decomposition steps are b's too
        (["b"], []),
    ]


def test_the_rule_shortens_above_the_target_and_lengthens_within_the_margin() -> None:
    policy = AdaptiveIntervals(rungs=RUNGS, start=1, target_angle=10.0, margin=0.5)
    schedule = IntervalSchedule.adaptive(["x"], policy)
    assert schedule.decide(0, [measured("x", 0, 50.0)]) == []  # nothing to compare with yet
    (change,) = schedule.decide(4, [measured("x", 4, 10.5)])
    assert (change.before, change.after, change.gap) == ((2, 4), (1, 2), 4)
    assert "10.50° of staleness after 4 steps, over the 10° target: shorter" in change.reason
    assert schedule.decide(6, [measured("x", 6, 10.0)]) == []  # at the target: stays
    assert schedule.decide(8, [measured("x", 8, 5.01)]) == []  # above the margin: stays
    assert "within the 10° target" in schedule.reason("x")
    (longer,) = schedule.decide(10, [measured("x", 10, 5.0)])
    assert (longer.before, longer.after) == ((1, 2), (2, 4))
    assert schedule.decide(12, [measured("x", 12, -1.0)]) == []  # not measured: stays
    assert schedule.rung_of("x") == (2, 4)


def test_the_overhead_cap_stops_a_layer_shortening() -> None:
    costs = {
        "a": LayerCost(factor_s=0.0, decomposition_s=0.4),
        "b": LayerCost(factor_s=0.0, decomposition_s=0.4),
    }
    policy = AdaptiveIntervals(rungs=RUNGS, start=2, costs=costs, max_seconds=0.17)
    schedule = IntervalSchedule.adaptive(["a", "b"], policy)
    assert schedule.cost_per_step() == pytest.approx(0.1)  # 0.4/8 + 0.4/8
    schedule.decide(0, [measured("a", 0, 1.0), measured("b", 0, 1.0)])
    # a to 2/4: 0.1 + 0.05 = 0.15 <= 0.17; then b to 2/4 would be 0.2: kept.
    (change,) = schedule.decide(8, [measured("a", 8, 80.0), measured("b", 8, 80.0)])
    assert (change.layer, change.after) == ("a", (2, 4))
    assert "a shorter rung would exceed the overhead cap" in schedule.reason("b")
    assert schedule.decide(12, [measured("a", 12, 80.0)]) == []  # 1/2 would cost 0.25
    assert schedule.cost_per_step() == pytest.approx(0.15)
    with pytest.raises(ConfigurationError, match=r"starting rung .* over max_seconds"):
        IntervalSchedule.adaptive(
            ["a", "b"], AdaptiveIntervals(rungs=RUNGS, costs=costs, max_seconds=0.17)
        )


def test_the_schedule_state_round_trips() -> None:
    schedule = IntervalSchedule.adaptive(["a", "b"], AdaptiveIntervals(rungs=RUNGS))
    schedule.decide(0, [measured("a", 0, 1.0)])
    schedule.decide(2, [measured("a", 2, 1.0)])
    copy = IntervalSchedule.adaptive(["a", "b"], AdaptiveIntervals(rungs=RUNGS))
    assert copy.load_state_dict(schedule.state_dict()) == []
    assert copy.state_dict() == schedule.state_dict()
    assert copy.gap("a", 7) == 5
    assert copy.gap("b", 7) is None
    other = IntervalSchedule.adaptive(["a", "b"], AdaptiveIntervals(rungs=((1, 10),)))
    problems = other.load_state_dict(schedule.state_dict())
    assert problems == [
        "a: its rung (2, 4) is not on this ladder",
        "b: its rung (1, 2) is not on this ladder",
    ]


# -- the measurement ------------------------------------------------------------------------


def test_the_sketch_estimates_the_relative_change_of_a_factor() -> None:
    generator = torch.Generator().manual_seed(0)
    for n in (16, 128, 785):
        x = torch.randn(4 * n, n, generator=generator, dtype=torch.float64)
        factor = (x.T @ x / (4 * n)).unsqueeze(0)
        old = sketch(factor)
        assert old.shape == (1, n, PROBES)
        assert relative_change(factor, old).item() == 0.0
        assert relative_change(2 * factor, old).item() == pytest.approx(1.0, rel=1e-12)
        noise = torch.randn(n, n, generator=generator, dtype=torch.float64)
        moved = factor + 0.05 * (noise + noise.T)
        exact = torch.linalg.matrix_norm(moved - factor) / torch.linalg.matrix_norm(factor)
        # Hutchinson's estimator with 8 probes: within 30% of the exact relative change.
        assert relative_change(moved, old).item() == pytest.approx(exact.item(), rel=0.3)
    # The probes are the same on every rank and in every run: a function of the dimension.
    assert torch.equal(
        probe(32, torch.float32, torch.device("cpu")), probe(32, torch.float32, torch.device("cpu"))
    )


def test_the_angle_between_preconditioned_gradients() -> None:
    a = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    b = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    assert angle_degrees(a, a).item() == pytest.approx(0.0, abs=1e-6)
    assert angle_degrees(a, 3 * b).item() == pytest.approx(45.0)
    assert angle_degrees(a, -a).item() == pytest.approx(180.0)
    assert angle_degrees(a, torch.zeros(2, 2)).item() == -1.0
    assert angle_degrees(a, torch.full((2, 2), math.nan)).item() == -1.0


# -- in the preconditioner ------------------------------------------------------------------


def _kfac(model: torch.nn.Module, **kwargs: object) -> KFACPreconditioner:
    options = {"damping": 0.01, "factor_decay": 0.8, "kl_clip": 0.05, "lr": 0.1} | kwargs
    return KFACPreconditioner(model, **options)  # type: ignore[arg-type]


def test_measuring_staleness_changes_nothing_it_computes() -> None:
    data = batches(12, dtype=torch.float64)
    params = []
    for options in (
        {"factor_update_steps": 2, "inv_update_steps": 4},
        {"factor_update_steps": 2, "inv_update_steps": 4, "measure_staleness": True},
        # One rung is a fixed schedule: the adaptive machinery with nothing to adapt.
        {"intervals": AdaptiveIntervals(rungs=((2, 4),))},
    ):
        model = small_cnn(dtype=torch.float64)
        preconditioner = _kfac(model, **options)
        train(model, preconditioner, torch.optim.SGD(model.parameters(), lr=0.1), data)
        params.append([p.detach().clone() for p in model.parameters()])
        if preconditioner.measures_staleness:
            readings = preconditioner.staleness()
            assert [r.measured_step for r in readings] == [8] * 4
            assert all(0 <= r.angle < 90 and r.measured_change_a > 0 for r in readings)
            assert preconditioner.memory_usage() == preconditioner.plan.ranks[0].memory
    for other in params[1:]:
        for a, b in zip(params[0], other, strict=True):
            assert torch.equal(a, b)


def test_the_reference_state_dict_has_no_staleness_state() -> None:
    model = small_cnn()
    preconditioner = _kfac(model)
    train(model, preconditioner, torch.optim.SGD(model.parameters(), lr=0.1), batches(2))
    state = preconditioner.state_dict()
    assert state["intervals"] == {}
    assert all("sketch_a" not in layer for layer in state["layers"].values())
    assert preconditioner.staleness() == []
    assert preconditioner.memory_usage() == plan(model, 1).ranks[0].memory


def _adaptive(model: torch.nn.Module) -> KFACPreconditioner:
    # A target between the layers' staleness on this model: some lengthen, some shorten.
    policy = AdaptiveIntervals(rungs=RUNGS, start=1, target_angle=6.0, margin=0.5)
    return _kfac(model, intervals=policy)


def test_adaptive_layers_update_only_on_their_own_steps() -> None:
    model = small_cnn(dtype=torch.float64)
    preconditioner = _adaptive(model)
    calls: dict[str, list[int]] = {layer.name: [] for layer in preconditioner.layers}
    for layer in preconditioner.layers:

        def count(*_: object, name: str = layer.name) -> None:
            calls[name].append(preconditioner.steps)

        layer.helper.module.register_forward_hook(count)
    computed: dict[str, list[int]] = {layer.name: [] for layer in preconditioner.layers}
    factors: dict[str, list[int]] = {layer.name: [] for layer in preconditioner.layers}
    rungs = {
        layer.name: preconditioner.schedule.rung_of(layer.name) for layer in preconditioner.layers
    }
    expected_factors: dict[str, list[int]] = {name: [] for name in rungs}
    expected_decompositions: dict[str, list[int]] = {name: [] for name in rungs}
    before = {
        layer.name: layer.decomposition.tensors().get("qa") for layer in preconditioner.layers
    }
    sums = {layer.name: None for layer in preconditioner.layers}

    def on_step(step: int) -> None:
        for layer in preconditioner.layers:
            name = layer.name
            f, d = rungs[name]
            if step % f == 0:
                expected_factors[name].append(step)
            if step % d == 0:
                expected_decompositions[name].append(step)
            qa = layer.decomposition.tensors()["qa"]
            if qa is not before[name]:
                computed[name].append(step)
                before[name] = qa
            assert layer.a_factor is not None
            total = float(layer.a_factor.sum())
            if total != sums[name]:
                factors[name].append(step)
                sums[name] = total
            rungs[name] = preconditioner.schedule.rung_of(name)

    train(
        model,
        preconditioner,
        torch.optim.SGD(model.parameters(), lr=0.1),
        batches(24, dtype=torch.float64),
        on_step,
    )
    assert computed == expected_decompositions
    assert factors == expected_factors
    # Every layer's forward hook ran every step, but its factors only on its factor steps.
    assert all(len(steps) == 24 for steps in calls.values())
    assert len({rung for rung in rungs.values()}) > 1, f"no layer moved: {rungs}"
    assert len({tuple(v) for v in expected_decompositions.values()}) > 1


def test_an_adaptive_schedule_resumes_bit_for_bit() -> None:
    data = batches(30, dtype=torch.float64)
    split = 11  # a step with some layers mid-interval: the schedule must come from the state

    def run(
        stop: int, state: dict[str, object] | None
    ) -> tuple[list[torch.Tensor], KFACPreconditioner, dict[str, object]]:
        model = small_cnn(dtype=torch.float64)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        preconditioner = _adaptive(model)
        start = 0
        if state is not None:
            model.load_state_dict(state["model"])  # type: ignore[arg-type]
            optimizer.load_state_dict(state["optimizer"])  # type: ignore[arg-type]
            preconditioner.load_state_dict(state["kfac"])  # type: ignore[arg-type]
            start = split
        train(model, preconditioner, optimizer, data[start:stop])
        saved = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "kfac": preconditioner.state_dict(),
        }
        return [p.detach().clone() for p in model.parameters()], preconditioner, saved

    whole, uninterrupted, _ = run(30, None)
    _, _, at_split = run(split, None)
    buffer = io.BytesIO()
    torch.save(at_split, buffer)
    buffer.seek(0)
    resumed_params, resumed, _ = run(30, torch.load(buffer, weights_only=True))
    for a, b in zip(whole, resumed_params, strict=True):
        assert torch.equal(a, b)
    assert resumed.state_dict()["intervals"] == uninterrupted.state_dict()["intervals"]
    assert resumed.staleness() == uninterrupted.staleness()


def test_adaptive_intervals_and_fixed_steps_are_not_both_given() -> None:
    model = small_cnn()
    with pytest.raises(ConfigurationError, match="either adaptive intervals or the fixed"):
        _kfac(model, intervals=AdaptiveIntervals(), inv_update_steps=10)
    with pytest.raises(ConfigurationError, match="leave measure_staleness on"):
        _kfac(model, intervals=AdaptiveIntervals(), measure_staleness=False)
    with pytest.raises(
        ConfigurationError, match=r"must be a kaisa_ray\.intervals\.AdaptiveIntervals"
    ):
        _kfac(model, intervals=((1, 10),))


def test_a_preconditioner_loads_a_checkpoint_from_before_staleness() -> None:
    model = small_cnn()
    plain = _kfac(model)
    train(model, plain, torch.optim.SGD(model.parameters(), lr=0.1), batches(3))
    state = plain.state_dict()
    resumed_model = small_cnn()
    adaptive = _adaptive(resumed_model)
    adaptive.load_state_dict(state)  # no sketches, no intervals: it measures from now on
    assert all(layer.sketch_a is None for layer in adaptive.layers)
    assert adaptive.steps == 3
    optimizer = torch.optim.SGD(resumed_model.parameters(), lr=0.1)
    train(resumed_model, adaptive, optimizer, batches(6))
    assert all(layer.sketch_a is not None for layer in adaptive.layers)
    # Step 4 took the first sketches; step 8 measured against them.
    assert {r.measured_step for r in adaptive.staleness()} == {8}
    assert all(r.angle >= 0 for r in adaptive.staleness())
