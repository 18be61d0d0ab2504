"""The tuner's cost model: a candidate strategy's memory and time per step, pure functions
of a measured profile (the choice under a budget is ``tuner.choice``).

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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kaisa_ray.assignment import LayerShape
from kaisa_ray.enums import ComputeMethod, FactorReduction, Parallel, Scaling
from kaisa_ray.intervals import LayerCost
from kaisa_ray.plan import Plan, plan
from kaisa_ray.schedule import STALENESS_PROBES as PROBES
from tuner.rank_classes import LayerSeconds, RankClasses


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
    A diagonal A has no products on its side (its basis is the identity, its inverse scales
    the columns).
    """
    k, a, g = layer.groups, layer.a_dim, layer.g_dim
    one_sandwich = 2.0 * k * g * a * (g if layer.diagonal_a else a + g)
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
    # ``deferred``: the factors' all-reduce on decomposition steps only (kaisa_ray.enums)
    factor_reduction: str = FactorReduction.EVERY_UPDATE
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
        profile, plan_of(profile, fraction, staleness), factor_update_steps, inv_update_steps
    )


def plan_of(profile: Profile, fraction: float, staleness: bool) -> Plan:
    """The plan of ``profile``'s job at ``fraction`` (with ``staleness``: its sketches too)."""
    return plan(
        list(profile.layers),
        profile.world_size,
        fraction,
        compute_method=profile.compute_method,
        staleness_probes=PROBES if staleness else 0,
        scaling=profile.scaling,
        parallel=profile.parallel,
        factor_reduction=profile.factor_reduction,
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
    weights = {layer.name: layer.factor_elements for layer in profile.layers}
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
            # a diagonal A is decomposed from its diagonal: no solver to price
            a_s=0.0
            if layer.diagonal_a
            else layer.groups * profile.decomposition.seconds(layer.a_dim),
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
    state = state_bytes(strategy)
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


def state_bytes(strategy: Plan) -> int:
    """The most K-FAC state bytes any rank holds."""
    return strategy.most_memory()["total"]
