"""When each layer updates its factors and its decomposition: fixed intervals (the reference's)
or intervals adapted online to the curvature's measured staleness.

Every layer ``l`` has a factor interval ``f_l`` and a decomposition interval ``d_l`` (a multiple
of ``f_l``); it updates its factors on the steps ``s`` with ``s % f_l == 0`` and its
decomposition on those with ``s % d_l == 0``. Updates stay aligned across layers: on a step
where a layer with a long interval updates, every layer with a shorter one (a divisor) updates
too, so their factors travel in the same all-reduce buckets.

- **Fixed** (``FixedIntervals``): every layer has the preconditioner's ``factor_update_steps``
  and ``inv_update_steps`` (a constant or a callable of the step), the reference semantics.
- **Adaptive** (``AdaptiveIntervals``): each layer sits on a rung of a ladder of nested interval
  pairs (each interval divides the next rung's) and moves between rungs on its own decomposition
  steps, by a deterministic rule on the staleness measured there (``kaisa_ray.staleness``): the
  angle ``θ`` between the layer's gradient preconditioned with its previous decomposition (taken
  a whole interval ago) and with the fresh one. A layer whose ``θ`` exceeds ``target_angle``
  moves one rung shorter; one whose ``θ`` is within ``margin · target_angle`` moves one rung
  longer (the margin keeps it from oscillating: the staleness a longer interval accumulates is
  measured at the end of it, and the layer comes back if it was too much). The angle is not
  extrapolated from one interval to another: measured on Fashion-MNIST, it is mostly a floor of
  sampling noise in the running averages (about 7° after 10 steps, 8° after 50 and 12° after
  100 on the same layer), not a drift that grows with the interval. With ``max_seconds`` and
  per-layer ``costs``, the interval-dependent K-FAC seconds per step, ``Σ_l factor_s_l / f_l +
  decomposition_s_l / d_l``, never go over the cap: a layer does not shorten past it.

Every rank must reach the same schedule: the rule runs on every rank with the same inputs (the
all-reduced measurements; the costs and the policy, which every rank is given), so the
decisions, the steps each layer updates on and the collectives of every step agree. The state
(each layer's rung and last decomposition step) is part of the preconditioner's checkpoint, so
a resumed run continues the schedule exactly.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kaisa_ray.errors import ConfigurationError
from kaisa_ray.hyperparams import IntParam, resolve_int

Rung = tuple[int, int]
"""A (factor interval, decomposition interval) pair."""

DEFAULT_RUNGS: tuple[Rung, ...] = ((1, 10), (5, 50), (10, 100))
DEFAULT_TARGET_ANGLE = 15.0  # degrees
DEFAULT_MARGIN = 0.5
NOT_MEASURED = -1.0
"""The value of a measurement that could not be taken (no previous decomposition, no gradient)."""


def check_rungs(rungs: Sequence[Sequence[int]]) -> tuple[Rung, ...]:
    """The ladder as nested (factor, decomposition) pairs, shortest first.

    Raises:
        ConfigurationError: a pair is not two positive integers with the decomposition interval
            a multiple of the factor interval, or the pairs do not nest (each interval a
            divisor of the next pair's), which updates of different layers need to align.
    """
    pairs: list[Rung] = []
    for pair in rungs:
        if len(pair) != 2 or any(isinstance(v, bool) or not isinstance(v, int) for v in pair):
            raise ConfigurationError(f"a rung must be two integers (factor, inverse); got {pair!r}")
        f, d = int(pair[0]), int(pair[1])
        if f < 1 or d < 1:
            raise ConfigurationError(
                f"rung ({f}, {d}) is invalid: both intervals must be positive, e.g. (1, 10)"
            )
        if d % f:
            raise ConfigurationError(
                f"rung ({f}, {d}) is invalid: the inverse interval must be a multiple of the "
                f"factor interval, e.g. ({f}, {f * max(1, round(d / f))})"
            )
        pairs.append((f, d))
    if not pairs:
        raise ConfigurationError("the ladder of adaptive intervals needs at least one rung")
    pairs.sort(key=lambda p: (p[1], p[0]))
    for (f0, d0), (f1, d1) in itertools.pairwise(pairs):
        if (f0, d0) == (f1, d1) or f1 % f0 or d1 % d0:
            raise ConfigurationError(
                f"rungs ({f0}, {d0}) and ({f1}, {d1}) do not nest: adaptive intervals need each "
                "interval to divide the next rung's (so that layers on different rungs update "
                "on shared steps), e.g. (1, 10), (5, 50), (10, 100)"
            )
    return tuple(pairs)


@dataclass(frozen=True, kw_only=True)
class LayerCost:
    """Seconds one update of a layer costs the slowest rank: its factors (computation and
    all-reduce) and its decomposition (computation on the rank it is placed on, broadcast)."""

    factor_s: float
    decomposition_s: float

    def __post_init__(self) -> None:
        for name in ("factor_s", "decomposition_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigurationError(f"{name}={value!r} must be a finite number >= 0")

    def per_step(self, rung: Rung) -> float:
        return self.factor_s / rung[0] + self.decomposition_s / rung[1]


@dataclass(frozen=True, kw_only=True)
class AdaptiveIntervals:
    """Per-layer intervals adapted online to measured staleness (see the module docstring).

    Attributes:
        rungs: nested (factor, decomposition) interval pairs, shortest first after checking.
        start: the rung every layer starts on (index into ``rungs``).
        target_angle: degrees of staleness a layer's decomposition may reach before its next:
            above it, the layer's intervals shorten.
        margin: the intervals lengthen when the staleness is within ``margin · target_angle``
            (hysteresis: a layer does not oscillate between rungs).
        costs: seconds per update of each layer (``LayerCost``), for ``max_seconds``.
        max_seconds: the cap on ``Σ_l costs[l].per_step(rung_l)``; None: no cap.

    Example:
        >>> policy = AdaptiveIntervals(rungs=((1, 10), (5, 50), (10, 100)), target_angle=10)
        >>> policy.rungs[policy.start]
        (1, 10)
    """

    rungs: tuple[Rung, ...] = DEFAULT_RUNGS
    start: int = 0
    target_angle: float = DEFAULT_TARGET_ANGLE
    margin: float = DEFAULT_MARGIN
    costs: Mapping[str, LayerCost] | None = None
    max_seconds: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "rungs", check_rungs(self.rungs))
        if isinstance(self.start, bool) or not 0 <= self.start < len(self.rungs):
            raise ConfigurationError(
                f"start={self.start!r} must index the ladder's {len(self.rungs)} rungs (0 is the "
                "shortest)"
            )
        if not (math.isfinite(self.target_angle) and 0 < self.target_angle < 90):
            raise ConfigurationError(
                f"target_angle={self.target_angle!r} must be in (0, 90) degrees, e.g. 10"
            )
        if not (math.isfinite(self.margin) and 0 < self.margin <= 1):
            raise ConfigurationError(f"margin={self.margin!r} must be in (0, 1], e.g. 0.5")
        if self.max_seconds is not None:
            if not (math.isfinite(self.max_seconds) and self.max_seconds > 0):
                raise ConfigurationError(
                    f"max_seconds={self.max_seconds!r} must be a positive number of seconds"
                )
            if self.costs is None:
                raise ConfigurationError(
                    "max_seconds needs costs: the seconds per update of every layer"
                )

    def describe(self) -> str:
        ladder = ", ".join(f"{f}/{d}" for f, d in self.rungs)
        return (
            f"adaptive over {ladder} from {self.rungs[self.start][0]}/"
            f"{self.rungs[self.start][1]}, target {self.target_angle:g}°"
        )


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """What a layer's decomposition update measured (``NOT_MEASURED`` where it could not)."""

    layer: str
    step: int
    change_a: float  # relative change of A since the layer's previous decomposition
    change_g: float  # the same for G
    angle: float  # degrees between the gradient preconditioned stale and fresh


@dataclass(frozen=True, kw_only=True)
class IntervalChange:
    """A layer's move to another rung, and why."""

    step: int
    layer: str
    before: Rung
    after: Rung
    reason: str
    angle: float
    gap: int


@dataclass
class _LayerState:
    rung: int
    last_decomposition: int | None = None
    reason: str = "the starting rung"


@dataclass
class IntervalSchedule:
    """The steps each layer updates on, and (adaptive) the rule that moves its intervals.

    Build it with ``fixed`` or ``adaptive``. ``factor_layers(step)`` and
    ``decomposition_layers(step)`` say which layers update on a step; after a step's
    decomposition updates, ``decide(step, measurements)`` applies the rule (adaptive only) and
    returns the changes.
    """

    names: tuple[str, ...]
    policy: AdaptiveIntervals | None = None
    factor_update_steps: IntParam = 1
    inv_update_steps: IntParam = 1
    _state: dict[str, _LayerState] = field(default_factory=dict)

    @classmethod
    def fixed(
        cls, names: Iterable[str], factor_update_steps: IntParam, inv_update_steps: IntParam
    ) -> IntervalSchedule:
        return cls(
            names=tuple(names),
            factor_update_steps=factor_update_steps,
            inv_update_steps=inv_update_steps,
        )

    @classmethod
    def adaptive(cls, names: Iterable[str], policy: AdaptiveIntervals) -> IntervalSchedule:
        schedule = cls(names=tuple(names), policy=policy)
        schedule._state = {name: _LayerState(rung=policy.start) for name in schedule.names}
        if policy.costs is not None:
            missing = [name for name in schedule.names if name not in policy.costs]
            if missing:
                raise ConfigurationError(
                    f"costs has no entry for layers {missing}; give every registered layer's"
                )
        cost = schedule.cost_per_step()
        if policy.max_seconds is not None and cost is not None and cost > policy.max_seconds:
            raise ConfigurationError(
                f"the starting rung {policy.rungs[policy.start]} costs {cost:.4g} s per step, "
                f"over max_seconds={policy.max_seconds:.4g}; start on a longer rung"
            )
        return schedule

    @property
    def adaptive_policy(self) -> bool:
        return self.policy is not None

    # -- which layers update on a step ------------------------------------------------------

    def rung_of(self, name: str, step: int = 0) -> Rung:
        """The layer's (factor, decomposition) intervals now (fixed: at ``step``)."""
        if self.policy is None:
            return (
                resolve_int("factor_update_steps", self.factor_update_steps, step),
                resolve_int("inv_update_steps", self.inv_update_steps, step),
            )
        return self.policy.rungs[self._state[name].rung]

    def factor_layers(self, step: int) -> frozenset[str]:
        if self.policy is None:
            every = resolve_int("factor_update_steps", self.factor_update_steps, step)
            return frozenset(self.names) if step % every == 0 else frozenset()
        rungs = self.policy.rungs
        return frozenset(n for n in self.names if step % rungs[self._state[n].rung][0] == 0)

    def decomposition_layers(self, step: int) -> frozenset[str]:
        if self.policy is None:
            every = resolve_int("inv_update_steps", self.inv_update_steps, step)
            return frozenset(self.names) if step % every == 0 else frozenset()
        rungs = self.policy.rungs
        return frozenset(n for n in self.names if step % rungs[self._state[n].rung][1] == 0)

    def gap(self, name: str, step: int) -> int | None:
        """Steps since the layer's previous decomposition (None: this is its first)."""
        if self.policy is None:
            return None
        last = self._state[name].last_decomposition
        return None if last is None else step - last

    def reason(self, name: str) -> str:
        """Why the layer is on its rung (adaptive), or 'fixed'."""
        return "fixed" if self.policy is None else self._state[name].reason

    def cost_per_step(self, override: Mapping[str, int] | None = None) -> float | None:
        """Interval-dependent seconds per step at the current rungs (with ``override``: some
        layers on other rungs); None without costs."""
        policy = self.policy
        if policy is None or policy.costs is None:
            return None
        rungs = {name: state.rung for name, state in self._state.items()} | dict(override or {})
        return sum(policy.costs[name].per_step(policy.rungs[rungs[name]]) for name in self.names)

    # -- the rule ---------------------------------------------------------------------------

    def decide(self, step: int, measurements: Sequence[Measurement]) -> list[IntervalChange]:
        """Apply the rule to the layers that decomposed on ``step`` (in registration order),
        with what was measured there; returns the layers that moved. Fixed: nothing."""
        policy = self.policy
        if policy is None:
            return []
        by_layer = {m.layer: m for m in measurements}
        changes = []
        for name in self.names:
            measured = by_layer.get(name)
            if measured is None:
                continue
            state = self._state[name]
            gap = None if state.last_decomposition is None else step - state.last_decomposition
            state.last_decomposition = step
            if gap is None or gap <= 0 or measured.angle < 0 or not math.isfinite(measured.angle):
                continue  # nothing to compare with: the rung stays
            target, reason = self._rule(state.rung, measured.angle, gap)
            if target < state.rung:
                target, reason = self._within_cap(name, state.rung, target, reason)
            if target != state.rung:
                changes.append(
                    IntervalChange(
                        step=step,
                        layer=name,
                        before=policy.rungs[state.rung],
                        after=policy.rungs[target],
                        reason=reason,
                        angle=measured.angle,
                        gap=gap,
                    )
                )
                state.rung = target
            state.reason = reason
        return changes

    def _rule(self, rung: int, angle: float, gap: int) -> tuple[int, str]:
        policy = self.policy
        assert policy is not None
        rungs, target, margin = policy.rungs, policy.target_angle, policy.margin
        seen = f"{angle:.2f}° of staleness after {gap} steps"
        if angle > target:
            if rung == 0:
                return rung, f"{seen}, over the {target:g}° target (already the shortest)"
            return rung - 1, f"{seen}, over the {target:g}° target: shorter"
        if angle <= margin * target:
            if rung + 1 == len(rungs):
                return rung, f"{seen}, within {margin:g} x the {target:g}° target (the longest)"
            return rung + 1, f"{seen}, within {margin:g} x the {target:g}° target: longer"
        return rung, f"{seen}, within the {target:g}° target"

    def _within_cap(self, name: str, rung: int, target: int, reason: str) -> tuple[int, str]:
        """The shortest rung in [target, rung] within the overhead cap (rung itself if none)."""
        policy = self.policy
        assert policy is not None
        if policy.max_seconds is None:
            return target, reason
        for candidate in range(target, rung):
            cost = self.cost_per_step({name: candidate})
            if cost is not None and cost <= policy.max_seconds:
                if candidate == target:
                    return target, reason
                return candidate, f"{reason}; only as far as {policy.rungs[candidate]} (cap)"
        return rung, f"{reason}; kept: a shorter rung would exceed the overhead cap"

    # -- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Each layer's rung (as its intervals) and last decomposition step (adaptive)."""
        if self.policy is None:
            return {}
        return {
            name: {
                "rung": list(self.policy.rungs[state.rung]),
                "last_decomposition": state.last_decomposition,
                "reason": state.reason,
            }
            for name, state in self._state.items()
        }

    def load_state_dict(self, saved: Mapping[str, Any]) -> list[str]:
        """Restore ``state_dict()``; returns what could not be restored (layers saved on a
        rung that is not on this ladder keep the starting rung), empty when everything was."""
        if self.policy is None:
            return []
        problems = []
        for name, state in self._state.items():
            entry = saved.get(name)
            if entry is None:
                problems.append(f"{name}: not in the checkpoint")
                continue
            rung = (int(entry["rung"][0]), int(entry["rung"][1]))
            if rung not in self.policy.rungs:
                problems.append(f"{name}: its rung {rung} is not on this ladder")
                continue
            state.rung = self.policy.rungs.index(rung)
            last = entry.get("last_decomposition")
            state.last_decomposition = None if last is None else int(last)
            state.reason = str(entry.get("reason", state.reason))
        return problems
