"""The tuner's cost model and choice, as pure functions of synthetic profiles (no processes)."""

from __future__ import annotations

import dataclasses

import pytest
from support.profiles import EVEN, LENET, MIB, profile

from kaisa_ray.errors import ConfigurationError
from kaisa_ray.plan import plan
from tuner.choice import NoFeasibleCandidateError, choose
from tuner.cost import CubicFit, LinkFit, precondition_flops, predict


def test_fits_recover_the_parameters_of_exact_data() -> None:
    link = LinkFit.fit([1e3, 1e5, 1e7], [2e-5 + n / 5e8 for n in (1e3, 1e5, 1e7)])
    assert link.latency_s == pytest.approx(2e-5)
    assert link.bytes_per_s == pytest.approx(5e8)
    cubic = CubicFit.fit([64, 256, 1024], [1e-4 + 3e-10 * n**3 for n in (64, 256, 1024)])
    assert cubic.c0 == pytest.approx(1e-4)
    assert cubic.c3 == pytest.approx(3e-10)
    with pytest.raises(ValueError, match="two different x"):
        LinkFit.fit([5, 5], [1, 2])


def test_predicted_kfac_state_is_the_plans_exactly() -> None:
    decision = choose(profile(), None)
    assert len(decision.candidates) == 3 * 3  # f in {1/4, 1/2, 1} x three interval pairs
    for candidate in decision.candidates:
        expected = max(
            r.memory["total"] for r in plan(list(LENET), 4, candidate.grad_worker_fraction).ranks
        )
        assert candidate.kfac_state_bytes == expected
        assert candidate.memory_bytes == 200 * MIB + expected


def test_eigen_preconditioning_is_two_sandwiches() -> None:
    fc1 = LENET[2]
    assert precondition_flops(fc1, "eigen") == 2 * precondition_flops(fc1, "inverse")
    assert precondition_flops(fc1, "inverse") == 2 * 128 * 785 * (785 + 128)


def test_slow_network_fast_compute_chooses_comm_opt() -> None:
    slow = LinkFit(latency_s=1e-3, bytes_per_s=1e7)  # 10 MB/s
    fast_compute = profile(allreduce=slow, broadcast=slow, precondition_s_per_flop=1 / 1e13)
    chosen = choose(fast_compute, None, intervals=[(5, 50)]).chosen
    assert chosen.grad_worker_fraction == 1.0


def test_fast_network_slow_compute_chooses_mem_opt() -> None:
    fast = LinkFit(latency_s=1e-6, bytes_per_s=1e12)
    slow_compute = profile(
        allreduce=fast,
        broadcast=fast,
        precondition_s_per_flop=1 / 1e8,
        decomposition=CubicFit(c0=0.0, c3=1e-8),
        layers=EVEN,
    )
    chosen = choose(slow_compute, None, intervals=[(5, 50)]).chosen
    assert chosen.grad_worker_fraction == 0.25
    # With LeNet's one dominant layer, 1/4 and 1/2 cost the same: the larger f wins the tie.
    lenet = dataclasses.replace(slow_compute, layers=LENET)
    assert choose(lenet, None, intervals=[(5, 50)]).chosen.grad_worker_fraction == 0.5


def test_ranks_sharing_cores_make_work_done_by_one_rank_cheaper() -> None:
    # LeNet at 4 workers with a free network: fc1 dominates, so every fraction's slowest rank
    # preconditions about as much: the fractions are within a hair of each other. With
    # four ranks on two cores (contention 2, and the profile's compute times measured with
    # every rank busy), MEM-OPT's fc1 rank works while the others mostly wait, so it runs
    # nearly at the solo rate: MEM-OPT is now the faster.
    fast = LinkFit(latency_s=0.0, bytes_per_s=1e15)
    own_cores = profile(allreduce=fast, broadcast=fast)
    shared = dataclasses.replace(own_cores, contention=2.0)
    pairs = [(5, 50)]
    one = {c.grad_worker_fraction: c for c in choose(own_cores, None, intervals=pairs).candidates}
    two = {c.grad_worker_fraction: c for c in choose(shared, None, intervals=pairs).candidates}
    # Work every rank repeats is priced as measured (it was measured with every rank busy).
    assert two[1.0].breakdown["precondition"] == pytest.approx(one[1.0].breakdown["precondition"])
    assert two[0.25].breakdown["precondition"] < 0.7 * one[0.25].breakdown["precondition"]
    gain_own = one[1.0].step_s - one[0.25].step_s
    gain_shared = two[1.0].step_s - two[0.25].step_s
    assert gain_shared > gain_own + 0.003  # MEM-OPT pulls ahead by milliseconds per step
    assert choose(shared, None, intervals=pairs).chosen.grad_worker_fraction < 1.0


def test_shrinking_budget_moves_from_comm_opt_to_mem_opt_and_never_exceeds_it() -> None:
    # A profile where COMM-OPT is fastest when memory is no object (a 10 MB/s network).
    slow = LinkFit(latency_s=1e-3, bytes_per_s=1e7)
    p = profile(layers=EVEN, allreduce=slow, broadcast=slow, precondition_s_per_flop=1 / 1e13)
    table = choose(p, None, intervals=[(5, 50)]).candidates
    by_f = {c.grad_worker_fraction: c.memory_bytes for c in table}
    assert by_f[0.25] < by_f[0.5] < by_f[1.0]
    assert choose(p, None, intervals=[(5, 50)]).chosen.grad_worker_fraction == 1.0
    chosen = []
    for budget in (by_f[1.0], by_f[1.0] - 1, by_f[0.5] - 1, by_f[0.25]):
        decision = choose(p, budget, intervals=[(5, 50)])
        assert decision.chosen.memory_bytes <= budget
        chosen.append(decision.chosen.grad_worker_fraction)
    # f never grows as the budget shrinks. (Here 1/2 is never picked: it pays for both the
    # decomposition and the gradient broadcasts, and is slower than 1/4 on this network.)
    assert chosen == sorted(chosen, reverse=True)
    assert chosen[0] == 1.0
    assert chosen[-1] == 0.25
    rejected = [c for c in choose(p, by_f[0.25], intervals=[(5, 50)]).candidates if c.rejected]
    assert {c.grad_worker_fraction for c in rejected} == {0.5, 1.0}
    assert all("over the budget by" in (c.rejected or "") for c in rejected)


def test_longer_intervals_are_cheaper_and_the_cap_limits_overhead() -> None:
    p = profile()
    table = {(c.grad_worker_fraction, c.factor_update_steps): c for c in choose(p, None).candidates}
    assert table[(1.0, 10)].step_s < table[(1.0, 5)].step_s < table[(1.0, 1)].step_s
    cheapest = min(c.overhead for c in table.values())
    decision = choose(p, None, max_overhead=cheapest * 1.01)
    assert decision.chosen.overhead <= cheapest * 1.01
    assert any("over the cap" in (c.rejected or "") for c in decision.candidates)
    with pytest.raises(NoFeasibleCandidateError, match="overhead"):
        choose(p, None, max_overhead=cheapest / 2)


def test_a_budget_below_the_model_says_by_how_much() -> None:
    with pytest.raises(NoFeasibleCandidateError, match=r"smaller than the job itself") as err:
        choose(profile(), 150 * MIB)
    assert "50.00 MiB over" in str(err.value)  # 200 MiB - 150 MiB


def test_nothing_fits_says_what_would() -> None:
    p = profile(world_size=2)
    smallest = min(c.memory_bytes for c in choose(p, None).candidates)
    with pytest.raises(NoFeasibleCandidateError) as err:
        choose(p, smallest - 1)
    message = str(err.value)
    assert "a budget of at least" in message
    assert "skip_layers the largest: fc1" in message


def test_predict_matches_the_table_and_bad_intervals_are_refused() -> None:
    p = profile()
    row = next(
        c
        for c in choose(p, None).candidates
        if (c.grad_worker_fraction, c.factor_update_steps) == (0.5, 5)
    )
    assert predict(p, 0.5, 5, 50) == row
    with pytest.raises(ConfigurationError, match="multiple of the factor interval"):
        choose(p, None, intervals=[(5, 12)])


# -- adaptive intervals: the fraction, the starting rung and each layer's cost ---------------


def test_adaptive_choice_starts_where_the_fixed_choice_would_be() -> None:
    p = profile(layers=EVEN)
    decision = choose(p, None, adaptive=True)
    assert decision.adaptive is not None
    chosen = decision.chosen
    # Not adaptive, the fastest per step: the longest intervals here. Adaptive starts there,
    # on the same fraction, priced with the staleness sketches.
    feasible = [c for c in decision.candidates if c.rejected is None]
    fastest = min(feasible, key=lambda c: (c.step_s, -c.grad_worker_fraction))
    assert chosen == fastest
    assert (chosen.factor_update_steps, chosen.inv_update_steps) == (10, 100)
    assert decision.adaptive.rungs[decision.adaptive.start] == (10, 100)
    fixed = choose(p, None).chosen
    assert fixed.key == chosen.key
    assert chosen.step_s > fixed.step_s  # the measurement's own cost, in the prediction
    # Staleness measured: the plan's sketches are in every candidate's memory.
    f = chosen.grad_worker_fraction
    sketches = plan(list(EVEN), 4, f, staleness_probes=8).ranks[0].memory["total"]
    assert chosen.kfac_state_bytes == sketches
    assert sketches - plan(list(EVEN), 4, f).ranks[0].memory["total"] == 8 * 4 * 8 * 1025


def test_layer_costs_add_up_to_a_candidates_interval_dependent_time() -> None:
    from tuner.cost import every_step_seconds, layer_costs

    p = profile(layers=EVEN)
    for fraction in (0.25, 0.5, 1.0):
        strategy = plan(list(EVEN), 4, fraction, staleness_probes=8)
        costs = layer_costs(p, strategy)
        assert set(costs) == {layer.name for layer in EVEN}
        for fus, ius in ((1, 10), (5, 50)):
            candidate = predict(p, fraction, fus, ius, staleness=True)
            kfac = sum(candidate.breakdown.values())
            dependent = sum(cost.per_step((fus, ius)) for cost in costs.values())
            assert dependent + every_step_seconds(p, strategy) == pytest.approx(kfac, rel=1e-9)


def test_adaptive_choice_under_an_overhead_cap_keeps_the_layers_within_it() -> None:
    p = profile(layers=EVEN, world_size=1)  # one fraction: the cap decides the rungs alone
    shortest = predict(p, 1.0, 1, 10, staleness=True).overhead
    middle = predict(p, 1.0, 5, 50, staleness=True).overhead
    cap = (shortest + middle) / 2  # rules out 1/10 only
    decision = choose(p, None, adaptive=True, max_overhead=cap)
    assert decision.adaptive is not None
    assert decision.adaptive.rungs[decision.adaptive.start] == (10, 100)
    seconds = decision.adaptive.max_seconds
    assert seconds is not None
    # What the layers may spend per step: 5/50 everywhere fits, 1/10 everywhere does not.
    costs = decision.adaptive.layer_costs.values()
    assert sum(c.per_step((5, 50)) for c in costs) <= seconds
    assert seconds < sum(c.per_step((1, 10)) for c in costs)
    # A cap below even the longest rung's cost: nothing fits, and the error says so.
    longest = predict(p, 1.0, 10, 100, staleness=True).overhead
    with pytest.raises(NoFeasibleCandidateError, match="overhead"):
        choose(p, None, adaptive=True, max_overhead=longest / 2)


def test_an_adaptive_ladder_must_nest() -> None:
    with pytest.raises(ConfigurationError, match="do not nest"):
        choose(profile(), None, adaptive=True, intervals=[(1, 10), (3, 30), (2, 20)])


def test_each_fraction_takes_its_own_measured_temporaries() -> None:
    """Profiling measures K-FAC's temporaries under every fraction (COMM-OPT's decomposition
    broadcasts are not MEM-OPT's gradient broadcasts): a candidate's memory adds its own
    fraction's, a fraction not measured the fraction-free figure; the budget sees the same."""
    p = profile(
        layers=EVEN,
        kfac_transient_bytes=9 * MIB,
        kfac_transient_by_fraction=((0.25, 1 * MIB), (1.0, 8 * MIB)),
    )
    by_f = {c.grad_worker_fraction: c for c in choose(p, None, intervals=[(5, 50)]).candidates}
    for fraction, transient in ((0.25, 1 * MIB), (0.5, 9 * MIB), (1.0, 8 * MIB)):
        c = by_f[fraction]
        assert c.memory_bytes == 200 * MIB + transient + c.kfac_state_bytes, fraction
    # A budget the COMM-OPT temporaries would have ruled MEM-OPT out of.
    mem = by_f[0.25].memory_bytes
    assert choose(p, mem, intervals=[(5, 50)]).chosen.grad_worker_fraction == 0.25
    with pytest.raises(NoFeasibleCandidateError, match=r"1\.00 MiB of K-FAC temporaries"):
        choose(p, mem - 1, intervals=[(5, 50)])
