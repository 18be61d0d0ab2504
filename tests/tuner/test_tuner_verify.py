"""``kfac.verify``'s choice policy, a pure function (``tuner.verify``): which candidates are
measured, and which one wins once they are."""

from __future__ import annotations

import pytest

from tuner.choice import MEASURED, NoFeasibleCandidateError
from tuner.cost import Candidate
from tuner.verify import Measurement, shortlist, verified

MIB = 2**20


def candidate(f: float, fus: int, ms: float, rejected: str | None = None) -> Candidate:
    return Candidate(
        grad_worker_fraction=f,
        factor_update_steps=fus,
        inv_update_steps=10 * fus,
        memory_bytes=100 * MIB,
        kfac_state_bytes=10 * MIB,
        step_s=ms / 1000,
        rejected=rejected,
    )


TABLE = [
    candidate(1.0, 1, 30.0),
    candidate(1.0, 5, 20.0),
    candidate(0.5, 1, 25.0),
    candidate(0.5, 5, 15.0, rejected="needs 2 GiB, over the budget"),
    candidate(0.5, 10, 22.0),
]


def test_the_shortlist_is_the_fastest_predicted_that_fit() -> None:
    assert [c.key for c in shortlist(TABLE, 2)] == [(1.0, 5, 50), (0.5, 10, 100)]
    assert len(shortlist(TABLE, 10)) == 4  # never one the budget ruled out
    with pytest.raises(ValueError, match="at least 1"):
        shortlist(TABLE, 0)


def test_the_fastest_measured_that_fits_wins() -> None:
    measured = {
        (1.0, 5, 50): Measurement(memory_bytes=90 * MIB, step_s=0.024),
        (0.5, 10, 100): Measurement(memory_bytes=80 * MIB, step_s=0.021),
    }
    decision = verified(TABLE, measured, budget_bytes=200 * MIB)
    assert decision.how == MEASURED
    assert decision.chosen.key == (0.5, 10, 100)  # predicted second, measured first
    rows = {c.key: c for c in decision.candidates}
    assert rows[(1.0, 5, 50)].measured_step_s == 0.024
    assert rows[(1.0, 5, 50)].measured_memory_bytes == 90 * MIB
    assert rows[(1.0, 1, 10)].measured_step_s is None  # not measured: as predicted
    assert [c.key for c in decision.candidates] == [c.key for c in TABLE]  # the whole table


def test_a_failed_trial_or_a_measured_peak_over_the_budget_rules_a_candidate_out() -> None:
    measured = {
        (1.0, 5, 50): Measurement(error="TrainingDivergedError: nan at step 3"),
        (0.5, 10, 100): Measurement(memory_bytes=300 * MIB, step_s=0.010),
        (1.0, 1, 10): Measurement(memory_bytes=90 * MIB, step_s=0.040),
    }
    decision = verified(TABLE, measured, budget_bytes=200 * MIB)
    assert decision.chosen.key == (1.0, 1, 10)  # the slowest measured, the only one left
    rows = {c.key: c for c in decision.candidates}
    assert rows[(1.0, 5, 50)].rejected == "its trial failed: TrainingDivergedError: nan at step 3"
    assert rows[(0.5, 10, 100)].rejected == (
        f"measured {300 * MIB} bytes, over the budget of {200 * MIB}"
    )


def test_a_tie_goes_to_the_larger_fraction_as_choose_breaks_it() -> None:
    measured = {
        (0.5, 10, 100): Measurement(memory_bytes=MIB, step_s=0.02),
        (1.0, 5, 50): Measurement(memory_bytes=MIB, step_s=0.02),
    }
    assert verified(TABLE, measured, budget_bytes=None).chosen.key == (1.0, 5, 50)


def test_nothing_that_fits_when_measured_says_why_each_lost() -> None:
    measured = {
        (1.0, 5, 50): Measurement(error="OOM"),
        (0.5, 10, 100): Measurement(memory_bytes=300 * MIB, step_s=0.01),
    }
    with pytest.raises(NoFeasibleCandidateError) as caught:
        verified(TABLE, measured, budget_bytes=200 * MIB)
    message = str(caught.value)
    assert "none of the 2 verified candidates fits when measured" in message
    assert "f=1 5/50: its trial failed: OOM" in message
    assert "f=0.5 10/100: measured" in message
    assert "raise memory_budget, or verify more candidates" in message


def test_a_measurement_is_numbers_or_an_error() -> None:
    with pytest.raises(ValueError, match="memory_bytes and step_s, or an error"):
        Measurement(memory_bytes=MIB)
