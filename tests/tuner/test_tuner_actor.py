"""The tuner actor's state (profile cache and choice) and the cache key, without Ray;
the tuner's record as text."""

from __future__ import annotations

import pytest
import torch
from support.profiles import EVEN, MIB, profile

from kaisa_train.auto_choice import candidate_rows, data_note
from kaisa_train.models import MLP, LeNetCNN
from kaisa_train.records import KFACChoice, TunerRecord
from kaisa_train.tables import decision_line, tuning_table
from tuner.actor import TunerState
from tuner.choice import NoFeasibleCandidateError, choose
from tuner.keys import profile_key


def test_a_cached_profile_is_reused_and_the_cache_is_bounded() -> None:
    state = TunerState(max_profiles=2)
    assert state.lookup("a") is None
    first = state.decide("a", profile(), None)
    assert state.lookup("a") == profile()
    # A second identical job sends no profile and gets the same decision from the cache.
    assert state.decide("a", None, None) == first
    state.decide("b", profile(world_size=2), None)
    state.lookup("a")  # a is now the most recently used
    state.decide("c", profile(world_size=8), None)  # evicts b, the least recently used
    assert state.lookup("b") is None
    assert state.lookup("a") is not None
    assert state.stats() == {"profiles": 2, "hits": 3, "misses": 2}
    with pytest.raises(KeyError, match="no profile cached under b; profile the job first"):
        state.decide("b", None, None)
    assert state.forget("a") == 1
    assert state.forget() == 1


def test_the_actor_passes_budget_cap_and_intervals_to_choose() -> None:
    state = TunerState()
    with pytest.raises(NoFeasibleCandidateError, match="smaller than the job itself"):
        state.decide("a", profile(), 100 * MIB)
    decision = state.decide("a", None, 2**40, None, [[1, 10]])  # lists, as from JSON
    assert {(c.factor_update_steps, c.inv_update_steps) for c in decision.candidates} == {(1, 10)}
    assert decision == choose(profile(), 2**40, intervals=[(1, 10)])


def test_memory_beside_the_profile_counts_against_the_budget_and_is_not_cached() -> None:
    """A streamed dataset's window on a CPU worker: counted in the memory weighed, for this
    job only (the cached profile stays the model's)."""
    state = TunerState()
    budget = profile().base_memory_bytes + 2**30
    assert state.decide("a", profile(), budget).chosen is not None
    with pytest.raises(NoFeasibleCandidateError, match="smaller than the job itself"):
        state.decide("a", None, budget, extra_bytes=2**30)
    assert state.lookup("a") == profile()


def test_a_profile_whose_steps_waited_for_data_says_so_with_the_fix() -> None:
    assert data_note(wait_ms=1.0, step_ms=40.0) is None
    note = data_note(wait_ms=30.0, step_ms=40.0)
    assert note is not None
    assert "did not keep up: each step waited 30 ms of its 40 ms" in note
    assert "scaling.cpus_per_worker" in note


def test_the_cache_key_follows_model_batch_options_and_workers() -> None:
    cpu = torch.device("cpu")
    batch = torch.zeros(64, 1, 28, 28)
    key = profile_key(LeNetCNN(), batch, cpu, {"kfac_approx": "reduce"})
    assert key == profile_key(LeNetCNN(), batch.clone(), cpu, {"kfac_approx": "reduce"})
    others = {
        profile_key(LeNetCNN(), torch.zeros(32, 1, 28, 28), cpu, {"kfac_approx": "reduce"}),
        profile_key(MLP(), batch, cpu, {"kfac_approx": "reduce"}),
        profile_key(LeNetCNN(), batch, cpu, {"kfac_approx": "expand"}),
    }
    assert key not in others
    assert len(others) == 3


def test_the_record_reads_as_a_table_with_the_choice_and_the_reasons() -> None:
    decision = choose(profile(world_size=2, layers=EVEN), 250 * MIB)
    chosen = decision.chosen
    record = TunerRecord(
        how="predicted",
        cache="miss",
        profile_s=1.5,
        budget_bytes=250 * MIB,
        base_memory_bytes=200 * MIB,
        kfac_transient_bytes=0,
        plain_ms_per_step=25.0,
        chosen=KFACChoice(
            grad_worker_fraction=chosen.grad_worker_fraction,
            factor_update_steps=chosen.factor_update_steps,
            inv_update_steps=chosen.inv_update_steps,
        ),
        candidates=candidate_rows(decision.candidates),
    )
    text = tuning_table(record)
    lines = text.splitlines()
    assert lines[0].split() == [
        "f",
        "intervals",
        "MiB/worker",
        "K-FAC",
        "MiB",
        "ms/step",
        "verdict",
    ]
    assert len(lines) == 1 + len(decision.candidates) + 2
    assert sum("CHOSEN" in line for line in lines) == 1
    assert any("over the budget" in line for line in lines)  # COMM-OPT holds too much here
    assert "budget 250.00 MiB per worker" in text
    assert "1.5 s of profiling" in lines[-1]
    assert "from the tuner's cache" in decision_line(record.model_copy(update={"cache": "hit"}))


def test_a_slower_candidate_says_by_how_much_measured_where_both_were_measured() -> None:
    """A verified choice compares unrounded trial times, so two rows may print the same
    milliseconds: the verdict then reads +0.0%, not a bare "slower"."""
    decision = choose(profile(world_size=2, layers=EVEN), 2**40)
    rows = candidate_rows(decision.candidates)
    chosen = decision.chosen
    best = next(row for row in rows if row.key() == chosen.key)
    tied = next(row for row in rows if row.key() != chosen.key and row.rejected is None)
    unmeasured = [row for row in rows if row.key() not in {best.key(), tied.key()}]
    best = best.model_copy(update={"measured_memory_bytes": MIB, "measured_ms_per_step": 44.01})
    tied = tied.model_copy(update={"measured_memory_bytes": MIB, "measured_ms_per_step": 44.04})
    record = TunerRecord(
        how="measured",
        cache="miss",
        profile_s=1.0,
        budget_bytes=None,
        base_memory_bytes=MIB,
        kfac_transient_bytes=0,
        plain_ms_per_step=20.0,
        chosen=best.choice(),
        candidates=[best, tied, *unmeasured],
    )
    lines = tuning_table(record).splitlines()
    assert lines[1].split()[5:] == ["1.00", "44.0", "CHOSEN"]
    assert lines[2].split()[5:] == ["1.00", "44.0", "slower:", "+0.1%", "measured"]
    for line, row in zip(lines[3:], unmeasured, strict=False):
        expected = f"{row.ms_per_step / best.ms_per_step - 1:+.1%}"
        assert line.split()[-3:] == ["slower:", expected, "predicted"], line
