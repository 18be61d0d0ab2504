"""The tuner's choice: the fastest candidate strategy within a memory budget.

``choose(profile, budget)`` prices every candidate with ``tuner.cost`` and returns the fastest
one within the budget (and within an optional cap on K-FAC's overhead over the plain step),
with the whole table and a reason for every rejection. When nothing fits,
``NoFeasibleCandidateError`` says what would.

Time per step alone always prefers the longest intervals: it cannot see that stale curvature
costs steps. With ``adaptive=True`` the intervals are not chosen here but adapted per layer
during training to the staleness measured there (``kaisa_ray.intervals``): ``choose`` picks the
fraction and the rung every layer starts on (the fixed choice's: the fastest step within the
budget and the overhead cap, memory priced with the staleness sketches; a layer whose curvature
moves shortens from there), and each layer's cost per update, which keeps the adapted
intervals within the cap (``AdaptivePlan``). The memory does not depend on the intervals, so
any schedule the layers adapt to stays within the budget the fraction was chosen under.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from kaisa_ray.assignment import LayerShape
from kaisa_ray.errors import ConfigurationError
from kaisa_ray.intervals import LayerCost, check_rungs
from kaisa_ray.plan import Plan, plan
from kaisa_ray.schedule import STALENESS_PROBES as PROBES
from kaisa_ray.strategy import placeable_fractions
from tuner.cost import (
    Candidate,
    Profile,
    every_step_seconds,
    layer_costs,
    plan_of,
    prices,
    state_bytes,
)

DEFAULT_INTERVALS: tuple[tuple[int, int], ...] = ((1, 10), (5, 50), (10, 100))
PREDICTED, MEASURED = "predicted", "measured"
"""How a ``Decision`` was made: by the cost model, or by measuring candidates in trials."""


@dataclass(frozen=True, kw_only=True)
class AdaptivePlan:
    """What adaptive intervals start from (``kaisa_ray.intervals.AdaptiveIntervals``): the
    ladder, the starting rung, each layer's seconds per update on the chosen fraction, and the
    cap on the interval-dependent seconds per step that ``max_overhead`` leaves (None: none)."""

    rungs: tuple[tuple[int, int], ...]
    start: int
    layer_costs: dict[str, LayerCost]
    max_seconds: float | None = None


@dataclass(frozen=True, kw_only=True)
class Decision:
    chosen: Candidate
    candidates: tuple[Candidate, ...]
    budget_bytes: int | None
    how: str = PREDICTED  # or MEASURED (``tuner.verify``: the pick of verification trials)
    adaptive: AdaptivePlan | None = None  # intervals adapted online from ``chosen``'s


class NoFeasibleCandidateError(ConfigurationError):
    """No strategy fits the memory budget; the message says what would."""


def _gib(n: float) -> str:
    """Bytes for people: GiB from 1 GiB up, MiB below."""
    if abs(n) >= 2**30:
        return f"{n / 2**30:.3f} GiB"
    return f"{n / 2**20:.2f} MiB"


def choose(
    profile: Profile,
    budget_bytes: int | None,
    *,
    intervals: Sequence[tuple[int, int]] = DEFAULT_INTERVALS,
    max_overhead: float | None = None,
    adaptive: bool = False,
) -> Decision:
    """The fastest candidate that fits ``budget_bytes`` (and ``max_overhead``, if given);
    with ``adaptive``, the fraction and starting rung of intervals adapted online (see the
    module docstring).

    Raises:
        NoFeasibleCandidateError: the budget is below the job's base memory (by how much is said),
            or no strategy's K-FAC state fits beside it (what would fit is said).
        ConfigurationError: an interval pair is invalid, or (adaptive) the pairs do not nest.
    """
    for fus, ius in intervals:
        if fus < 1 or ius < 1 or ius % fus:
            raise ConfigurationError(
                f"interval pair ({fus}, {ius}) is invalid: both must be positive and the "
                "inverse interval a multiple of the factor interval"
            )
    if adaptive:
        intervals = check_rungs(intervals)
    if budget_bytes is not None and profile.base_memory_bytes >= budget_bytes:
        raise NoFeasibleCandidateError(
            f"the memory budget {_gib(budget_bytes)} is smaller than the job itself: model, "
            f"optimizer state and activations take {_gib(profile.base_memory_bytes)} per "
            f"worker, {_gib(profile.base_memory_bytes - budget_bytes)} over, before any K-FAC "
            "state; raise memory_budget, lower dataset.batch_size, or train with kfac: off"
        )
    table: list[Candidate] = []
    plans = {}
    for fraction in placeable_fractions(profile.world_size, profile.scaling):
        strategy = plans[fraction] = plan_of(profile, fraction, adaptive)
        for candidate in prices(profile, strategy, intervals):
            reason = None
            if budget_bytes is not None and candidate.memory_bytes > budget_bytes:
                reason = (
                    f"needs {_gib(candidate.memory_bytes)}, over the budget by "
                    f"{_gib(candidate.memory_bytes - budget_bytes)}"
                )
            elif max_overhead is not None and candidate.overhead > max_overhead:
                reason = (
                    f"K-FAC overhead {candidate.overhead:.0%} of the plain step is over the cap "
                    f"of {max_overhead:.0%}"
                )
            table.append(_with_reason(candidate, reason))
    feasible = [c for c in table if c.rejected is None]
    if not feasible:
        raise NoFeasibleCandidateError(
            _what_would_fit(profile, table, budget_bytes, max_overhead, PROBES if adaptive else 0)
        )
    best = min(feasible, key=lambda c: (c.step_s, -c.grad_worker_fraction))
    if not adaptive:
        return Decision(chosen=best, candidates=tuple(table), budget_bytes=budget_bytes)
    return _adaptive_decision(profile, table, best, plans, intervals, max_overhead, budget_bytes)


def _adaptive_decision(
    profile: Profile,
    table: list[Candidate],
    start: Candidate,
    plans: dict[float, Plan],
    rungs: Sequence[tuple[int, int]],
    max_overhead: float | None,
    budget_bytes: int | None,
) -> Decision:
    """Start where the fixed choice would be, ``start`` (its fraction and its rung: the fastest
    step that fits, a rung over the cap is ruled out in the table already); the layers move
    from there.

    Measured (docs/adaptive-intervals.md): starting every layer on the shortest rung paid its
    factor work on every step for most of a short run, because the angle's sampling floor (7-12
    degrees on Fashion-MNIST) keeps a layer from lengthening fast, and the fraction fastest on
    average over the rungs was not the one fastest on the rungs the layers ended on."""
    fraction = start.grad_worker_fraction
    costs = layer_costs(profile, plans[fraction])
    cap = None
    if max_overhead is not None:
        cap = max_overhead * profile.step_s - every_step_seconds(profile, plans[fraction])
        # The cap as the schedule prices it (the per-layer costs) may round apart from the
        # candidate's: never below what the starting rung needs.
        cap = max(
            cap,
            sum(
                cost.per_step((start.factor_update_steps, start.inv_update_steps))
                for cost in costs.values()
            ),
        )
    adaptive = AdaptivePlan(
        rungs=tuple(rungs),
        start=list(rungs).index((start.factor_update_steps, start.inv_update_steps)),
        layer_costs=costs,
        max_seconds=cap,
    )
    return Decision(
        chosen=start, candidates=tuple(table), budget_bytes=budget_bytes, adaptive=adaptive
    )


def _with_reason(candidate: Candidate, reason: str | None) -> Candidate:
    if reason is None:
        return candidate
    return dataclasses.replace(candidate, rejected=reason)


def _mem_opt_state(
    layers: Sequence[LayerShape], world: int, profile: Profile, probes: int = 0
) -> int:
    """The worst rank's K-FAC state bytes under MEM-OPT (the least memory of any f)."""
    return state_bytes(
        plan(
            list(layers),
            world,
            1 / world,
            compute_method=profile.compute_method,
            staleness_probes=probes,
            scaling=profile.scaling,
            parallel=profile.parallel,
        )
    )


def _what_would_fit(
    profile: Profile,
    table: list[Candidate],
    budget_bytes: int | None,
    max_overhead: float | None,
    probes: int = 0,
) -> str:
    smallest = min(table, key=lambda c: c.memory_bytes)
    over_budget = budget_bytes is not None and smallest.memory_bytes > budget_bytes
    if not over_budget:
        fastest = min(table, key=lambda c: c.overhead)
        return (
            f"no strategy keeps K-FAC's overhead within {max_overhead:.0%}: the lowest is "
            f"{fastest.overhead:.0%} (f={fastest.grad_worker_fraction:g}, intervals "
            f"{fastest.factor_update_steps}/{fastest.inv_update_steps}); raise the cap or add "
            "longer intervals"
        )
    assert budget_bytes is not None
    transient = profile.transient_bytes(smallest.grad_worker_fraction)
    lines = [
        f"no strategy fits the memory budget {_gib(budget_bytes)}: the smallest, f="
        f"{smallest.grad_worker_fraction:g}, needs {_gib(smallest.memory_bytes)} "
        f"({_gib(profile.base_memory_bytes)} for the job, {_gib(smallest.kfac_state_bytes)} "
        f"of K-FAC state, {_gib(transient)} of K-FAC temporaries). "
        "What would fit:",
        f"  - a budget of at least {_gib(smallest.memory_bytes)}",
    ]
    room = budget_bytes - profile.base_memory_bytes - transient
    by_size = sorted(profile.layers, key=lambda layer: layer.factor_elements)
    for skipped in range(1, len(by_size)):
        kept = by_size[: len(by_size) - skipped]
        if _mem_opt_state(kept, profile.world_size, profile, probes) <= room:
            names = ", ".join(layer.name for layer in by_size[len(by_size) - skipped :])
            lines.append(f"  - skip_layers the largest: {names}")
            break
    for more in (2, 4, 8):
        world = profile.world_size * more
        if _mem_opt_state(profile.layers, world, profile, probes) <= room:
            lines.append(f"  - {world} workers (MEM-OPT spreads the decompositions)")
            break
    return "\n".join(lines)
