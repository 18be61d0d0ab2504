"""The tuner's cost model and choice: pure functions of a measured profile and a budget.

A ``Profile`` holds what profiling measured on a job's own workers (base memory, the plain
step, the factor computation, fits of decomposition time and of collectives). For every
candidate ``(grad_worker_fraction, factor_update_steps, inv_update_steps)``, ``predict`` gives:

- memory per worker: the measured base, plus K-FAC's measured transient memory (the
  temporaries of a factor-and-decomposition step over its state, measured under the
  candidate's own fraction: which buffers are in flight depends on the strategy), plus the
  exact K-FAC state from ``kaisa_ray.plan``;
- time per step, on the slowest rank (collectives make every rank wait for it)::

      step + factors / fus + decompositions(rank) / ius + precondition(rank) + comm(rank)

  where the decompositions are those the assignment places on the rank, preconditioning
  covers the layers the rank is a gradient worker of, and communication is the plan's mean
  collectives per step priced with an α–β fit (latency + bytes / bandwidth) per operation.

``choose(profile, budget)`` returns the fastest candidate within the budget (and within an
optional cap on K-FAC's overhead over the plain step), with the whole table and a reason for
every rejection. When nothing fits, ``NoFeasibleCandidateError`` says what would.

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
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kaisa_ray.assignment import LayerShape
from kaisa_ray.enums import ComputeMethod, Parallel, Scaling
from kaisa_ray.errors import ConfigurationError
from kaisa_ray.intervals import LayerCost, check_rungs
from kaisa_ray.plan import Plan, plan
from kaisa_ray.schedule import STALENESS_PROBES as PROBES
from kaisa_ray.strategy import placeable_fractions
from tuner.rank_classes import LayerSeconds, RankClasses

DEFAULT_INTERVALS: tuple[tuple[int, int], ...] = ((1, 10), (5, 50), (10, 100))
PREDICTED, MEASURED = "predicted", "measured"
"""How a ``Decision`` was made: by the cost model, or by measuring candidates in trials."""


@dataclass(frozen=True, kw_only=True)
class LinkFit:
    """Seconds of one collective passing ``n`` bytes: ``latency_s + n / bytes_per_s``."""

    latency_s: float
    bytes_per_s: float

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s

    @classmethod
    def fit(cls, sizes: Sequence[float], seconds: Sequence[float]) -> LinkFit:
        """Least-squares line through (bytes, seconds), clamped to a non-negative latency."""
        slope, intercept = _line(sizes, seconds)
        slope = max(slope, 1e-15)
        return cls(latency_s=max(intercept, 0.0), bytes_per_s=1.0 / slope)


@dataclass(frozen=True, kw_only=True)
class CubicFit:
    """Seconds of decomposing one ``n × n`` factor: ``c0 + c3 · n³``."""

    c0: float
    c3: float

    def seconds(self, n: int) -> float:
        return self.c0 + self.c3 * n**3

    @classmethod
    def fit(cls, dims: Sequence[int], seconds: Sequence[float]) -> CubicFit:
        slope, intercept = _line([float(n) ** 3 for n in dims], seconds)
        return cls(c0=max(intercept, 0.0), c3=max(slope, 0.0))


def _line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("a fit needs at least two (x, y) points of equal count")
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        raise ValueError("a fit needs at least two different x values")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
    return slope, my - slope * mx


def precondition_flops(layer: LayerShape, compute_method: str) -> float:
    """Multiply-adds ×2 of preconditioning one layer's gradient once.

    Eigen: ``Q_Gᵀ ∇W Q_A`` and back, two products on each side; inverse: one on each side.
    """
    k, a, g = layer.groups, layer.a_dim, layer.g_dim
    one_sandwich = 2.0 * k * g * a * (a + g)
    return one_sandwich * (2 if compute_method == ComputeMethod.EIGEN else 1)


class DecompositionModel(Protocol):
    """Seconds of decomposing one ``n × n`` factor (``CubicFit``, or a measured table)."""

    def seconds(self, n: int) -> float: ...


class CollectivePricer(Protocol):
    """Seconds of one collective by its ranks and size (``tuner.topology.Topology``: the
    group's span over nodes decides the link)."""

    @property
    def period(self) -> int:
        """A group moved by a multiple of this many ranks costs the same."""
        ...

    def seconds(self, op: str, group: tuple[int, ...], nbytes: int) -> float: ...

    def pricer(self, op: str, group: tuple[int, ...]) -> Callable[[int], float]:
        """``seconds(op, group, ·)`` (for many calls over one group)."""
        ...


@dataclass(frozen=True, kw_only=True)
class Profile:
    """What profiling measured on a job's workers (seconds, bytes per worker)."""

    world_size: int
    layers: tuple[LayerShape, ...]
    base_memory_bytes: int  # model, optimizer state, activations: the peak without K-FAC
    kfac_transient_bytes: int = 0  # K-FAC's temporaries at the peak of a step, over its state
    # The same temporaries measured under each grad_worker_fraction (profiling steps each one):
    # COMM-OPT's broadcasts every decomposition to every rank, f < 1 broadcasts gradients
    # instead, so the peak over the state depends on the strategy. Missing: the one above.
    kfac_transient_by_fraction: tuple[tuple[float, int], ...] = ()
    step_s: float  # one plain forward + backward + optimizer step
    factor_s: float  # computing every layer's batch factors once (a factor-update step)
    decomposition: DecompositionModel
    precondition_s_per_flop: float
    # Each layer's preconditioning per step, in the order of ``layers``, where it is priced
    # per layer (a forecast's shape groups); empty: ``precondition_s_per_flop`` × its flops.
    layer_precondition_s: tuple[float, ...] = ()
    allreduce: LinkFit
    broadcast: LinkFit
    compute_method: str = ComputeMethod.EIGEN
    scaling: str = Scaling.KRONECKER  # what the eigen method's state holds besides its bases
    # ``fsdp``: the model was sharded by FSDP2 when profiled (the base memory measured holds
    # its shards); every candidate's plan then moves the gradient rows (docs/fsdp.md)
    parallel: str = Parallel.DDP
    # How much slower ranks compute all at once than one alone (``measure.compute_contention``):
    # 1 with a device or cores per rank; the times above were measured with every rank busy.
    contention: float = 1.0
    # Collectives priced by the nodes their group spans; None: every call at the ``allreduce``
    # and ``broadcast`` fits, as measured between the job's own workers.
    topology: CollectivePricer | None = None
    # On a GPU whose profile measured the host's time to issue the plain step: that time and
    # the device's (``step_s`` is then the longer), and the device's share of K-FAC's factor
    # and preconditioning seconds (the rest is the host's: Python and launches). A step then
    # takes the longer of the host's and the device's timelines, each with its share of
    # K-FAC's work (``overlapped``). None: the parts add to ``step_s``.
    host_step_s: float | None = None
    device_step_s: float | None = None
    factor_device_share: float = 1.0
    precondition_device_share: float = 1.0

    def transient_bytes(self, fraction: float) -> int:
        """K-FAC's temporaries over its state under ``fraction``, as measured (else the
        fraction-free ``kfac_transient_bytes``)."""
        for measured, nbytes in self.kfac_transient_by_fraction:
            if math.isclose(measured, fraction):
                return nbytes
        return self.kfac_transient_bytes

    def collective_seconds(self, op: str, group: tuple[int, ...], nbytes: int) -> float:
        if self.topology is not None:
            return self.topology.seconds(op, group, nbytes)
        return (self.allreduce if op == "all_reduce" else self.broadcast).seconds(nbytes)

    def collective_pricer(self, op: str, group: tuple[int, ...]) -> Callable[[int], float]:
        """``collective_seconds(op, group, ·)``: the group's link found once."""
        if self.topology is not None:
            return self.topology.pricer(op, group)
        return (self.allreduce if op == "all_reduce" else self.broadcast).seconds

    @property
    def collective_period(self) -> int:
        """A group moved by a multiple of this many ranks costs the same (without a
        topology, any group costs the same)."""
        return 1 if self.topology is None else self.topology.period


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One strategy and its predicted cost; ``rejected`` says why it cannot be chosen."""

    grad_worker_fraction: float
    factor_update_steps: int
    inv_update_steps: int
    memory_bytes: int  # worst rank: base + K-FAC transient + K-FAC state
    kfac_state_bytes: int  # worst rank, exactly as the plan holds it
    step_s: float  # predicted time per step on the slowest rank
    breakdown: dict[str, float] = field(default_factory=dict)  # seconds per step per phase
    rejected: str | None = None
    # What its verification trial measured (``tuner.verify``); None: not measured.
    measured_memory_bytes: int | None = None
    measured_step_s: float | None = None

    @property
    def key(self) -> tuple[float, int, int]:
        """The strategy: (grad_worker_fraction, factor_update_steps, inv_update_steps)."""
        return (self.grad_worker_fraction, self.factor_update_steps, self.inv_update_steps)

    @property
    def overhead(self) -> float:
        """K-FAC's predicted time per step over the plain step's, as a fraction."""
        base = self.step_s - sum(self.breakdown.values())
        return sum(self.breakdown.values()) / base if base > 0 else math.inf


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


def predict(
    profile: Profile,
    fraction: float,
    factor_update_steps: int,
    inv_update_steps: int,
    *,
    staleness: bool = False,
) -> Candidate:
    """Memory and time per step of one candidate (see the module docstring); with
    ``staleness``, measuring it (its sketches and its all-reduce) included."""
    return _priced(
        profile, _plan(profile, fraction, staleness), factor_update_steps, inv_update_steps
    )


def _plan(profile: Profile, fraction: float, staleness: bool) -> Plan:
    return plan(
        list(profile.layers),
        profile.world_size,
        fraction,
        compute_method=profile.compute_method,
        staleness_probes=PROBES if staleness else 0,
        scaling=profile.scaling,
        parallel=profile.parallel,
    )


def layer_costs(profile: Profile, strategy: Plan) -> dict[str, LayerCost]:
    """Seconds one update of each layer costs the slowest rank on ``strategy``, priced as
    ``choose`` prices a candidate and split over the layers: the factor work and the factor
    all-reduce of a factor-update step in proportion to each layer's factor elements (the
    profile times all layers together), the slowest rank's decompositions and their broadcasts
    (and the staleness all-reduce) of an inverse-update step in proportion to each layer's
    decomposition time. At a rung every layer shares, their sum is the candidate's
    interval-dependent time per step."""
    classes = rank_classes(profile, strategy)
    own = {layer.name: layer.a_s + layer.g_s for layer in _layer_seconds(profile)}
    decompositions = classes.decompositions_max
    _, factor_comm, inverse_comm = classes.communication_max()
    weights = {
        layer.name: layer.groups * (layer.a_dim**2 + layer.g_dim**2) for layer in profile.layers
    }
    total_weight = sum(weights.values()) or 1
    total_own = sum(own.values()) or 1.0
    return {
        name: LayerCost(
            factor_s=(profile.factor_s + factor_comm) * weights[name] / total_weight,
            decomposition_s=(decompositions + inverse_comm) * own[name] / total_own,
        )
        for name in weights
    }


def every_step_seconds(profile: Profile, strategy: Plan) -> float:
    """K-FAC's seconds per step that no interval changes, on the slowest rank: preconditioning
    and the collectives of a plain step (the gradient broadcasts of f < 1)."""
    breakdown = _priced(profile, strategy, 1, 1).breakdown
    plain, _, _ = rank_classes(profile, strategy).communication_max()
    return breakdown["precondition"] + plain


def _layer_seconds(profile: Profile) -> list[LayerSeconds]:
    """Each layer's decompositions (one update) and preconditioning (one step), in seconds."""
    per_layer = profile.layer_precondition_s or tuple(
        precondition_flops(layer, profile.compute_method) * profile.precondition_s_per_flop
        for layer in profile.layers
    )
    return [
        LayerSeconds(
            name=layer.name,
            a_s=layer.groups * profile.decomposition.seconds(layer.a_dim),
            g_s=layer.groups * profile.decomposition.seconds(layer.g_dim),
            precondition_s=precondition_s,
        )
        for layer, precondition_s in zip(profile.layers, per_layer, strict=True)
    ]


def rank_classes(profile: Profile, strategy: Plan) -> RankClasses:
    """``strategy``'s ranks priced on ``profile``, a class of ranks at a time: what every
    candidate of the plan is priced from (``price`` builds it for one)."""
    return RankClasses(
        strategy,
        _layer_seconds(profile),
        pricer=profile.collective_pricer,
        period=profile.collective_period,
        contention=profile.contention,
    )


def price(
    profile: Profile, strategy: Plan, factor_update_steps: int, inv_update_steps: int
) -> Candidate:
    """One candidate priced on a plan already built (``choose`` prices each plan at every
    interval pair this way); for callers that also read the plan's memory and collectives."""
    return _priced(profile, strategy, factor_update_steps, inv_update_steps)


def prices(
    profile: Profile, strategy: Plan, intervals: Sequence[tuple[int, int]]
) -> list[Candidate]:
    """``price`` at every interval pair, the plan's ranks priced once for all of them."""
    classes = rank_classes(profile, strategy)
    return [_priced(profile, strategy, fus, ius, classes) for fus, ius in intervals]


def _priced(
    profile: Profile,
    strategy: Plan,
    fus: int,
    ius: int,
    classes: RankClasses | None = None,
) -> Candidate:
    """The candidate of ``strategy`` at ``fus``/``ius``, on its slowest rank (seconds per step:
    the module docstring), from its ``rank_classes`` (built here if not given)."""
    classes = classes or rank_classes(profile, strategy)
    total, breakdown = classes.slowest(
        step_s=profile.step_s, factor_s=profile.factor_s, fus=fus, ius=ius
    )
    if profile.host_step_s is not None and profile.device_step_s is not None:
        total, breakdown = overlapped(profile, breakdown)
    state = _state_bytes(strategy)
    return Candidate(
        grad_worker_fraction=strategy.grad_worker_fraction,
        factor_update_steps=fus,
        inv_update_steps=ius,
        memory_bytes=profile.base_memory_bytes
        + profile.transient_bytes(strategy.grad_worker_fraction)
        + state,
        kfac_state_bytes=state,
        step_s=total,
        breakdown=breakdown,
    )


def overlapped(profile: Profile, parts: dict[str, float]) -> tuple[float, dict[str, float]]:
    """A step's seconds and K-FAC's parts of it where the host and the device run apart:
    the host issues the plain step (``host_step_s``) and all of K-FAC's phases (its Python
    and launches, and its waits for the device on update steps); the device runs the plain
    step (``device_step_s``) and K-FAC's arithmetic and collectives (the decompositions and
    communication whole, the factors and preconditioning at their device shares). The step
    takes the longer of the two; what it adds to the plain step is split among the phases
    in proportion to their seconds on the timeline that decides it, so that each part is
    what the phase adds to a whole step."""
    assert profile.host_step_s is not None
    assert profile.device_step_s is not None
    device_parts = {
        "factors": parts["factors"] * profile.factor_device_share,
        "decompositions": parts["decompositions"],
        "precondition": parts["precondition"] * profile.precondition_device_share,
        "communication": parts["communication"],
    }
    host = profile.host_step_s + sum(parts.values())
    device = profile.device_step_s + sum(device_parts.values())
    total = max(host, device, profile.step_s)
    weights = parts if host >= device else device_parts
    added, weight = total - profile.step_s, sum(weights.values())
    return total, {k: added * w / weight if weight > 0 else 0.0 for k, w in weights.items()}


def _state_bytes(strategy: Plan) -> int:
    """The most K-FAC state bytes any rank holds."""
    return strategy.most_memory()["total"]


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
        strategy = plans[fraction] = _plan(profile, fraction, adaptive)
        classes = rank_classes(profile, strategy)
        for fus, ius in intervals:
            candidate = _priced(profile, strategy, fus, ius, classes)
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
    return _state_bytes(
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
    by_size = sorted(profile.layers, key=lambda layer: layer.a_dim**2 + layer.g_dim**2)
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
