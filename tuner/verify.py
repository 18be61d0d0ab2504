"""``kfac.verify: K``'s choice policy, a pure function: which candidates to measure, and
which one wins once measured.

The K fastest predicted candidates that fit are measured (each in a short trial on the job's
workers, run by ``kaisa_train.tuning``); the fastest measured one that fits the budget as
measured wins. A trial that failed, or whose measured peak is over the budget, rules its
candidate out with the reason; if none is left, ``NoFeasibleCandidateError`` says why each
lost.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tuner.choice import MEASURED, Decision, NoFeasibleCandidateError
from tuner.cost import Candidate

__all__ = ["Measurement", "shortlist", "verified"]

Key = tuple[float, int, int]


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """What one candidate's trial measured: its peak memory per worker and time per step, or
    the error it failed with."""

    memory_bytes: int | None = None
    step_s: float | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        if self.error is None and (self.memory_bytes is None or self.step_s is None):
            raise ValueError("a measurement has memory_bytes and step_s, or an error")


def shortlist(candidates: Sequence[Candidate], count: int) -> list[Candidate]:
    """The ``count`` fastest predicted candidates that fit (fastest first)."""
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    feasible = [c for c in candidates if c.rejected is None]
    return sorted(feasible, key=lambda c: c.step_s)[:count]


def verified(
    candidates: Sequence[Candidate],
    measured: Mapping[Key, Measurement],
    budget_bytes: int | None,
) -> Decision:
    """The decision once ``measured`` (by candidate key) is known: every candidate with what
    was measured of it, and the fastest measured one that fits as the choice (the larger
    fraction on a tie, as ``choose`` breaks ties).

    Raises:
        NoFeasibleCandidateError: no measured candidate fits; the message lists why each lost.
    """
    rows: list[Candidate] = []
    for candidate in candidates:
        found = measured.get(candidate.key)
        if found is None:
            rows.append(candidate)
            continue
        rejected = candidate.rejected
        if found.error is not None:
            rejected = f"its trial failed: {found.error}"
        elif budget_bytes is not None and (found.memory_bytes or 0) > budget_bytes:
            rejected = f"measured {found.memory_bytes} bytes, over the budget of {budget_bytes}"
        rows.append(
            dataclasses.replace(
                candidate,
                measured_memory_bytes=found.memory_bytes,
                measured_step_s=found.step_s,
                rejected=rejected,
            )
        )
    fits = [r for r in rows if r.measured_step_s is not None and r.rejected is None]
    if not fits:
        reasons = "; ".join(
            f"f={r.grad_worker_fraction:g} {r.factor_update_steps}/{r.inv_update_steps}: "
            f"{r.rejected}"
            for r in rows
            if r.key in measured
        )
        raise NoFeasibleCandidateError(
            f"none of the {len(measured)} verified candidates fits when measured ({reasons}); "
            "raise memory_budget, or verify more candidates"
        )
    best = min(fits, key=lambda r: (r.measured_step_s or 0.0, -r.grad_worker_fraction))
    return Decision(chosen=best, candidates=tuple(rows), budget_bytes=budget_bytes, how=MEASURED)
