"""Sweep jobs in the service, without Ray: the Ray Job's entrypoint (``kaisa-ray sweep`` for a
spec with a sweep, checked against the real CLI's parser), and ``interpret`` turning a sweep's
progress-sink records, batch by batch, into the job's state, progress and sweep view
(``service.domain.sweeps``) and the event streams' updates."""

from __future__ import annotations

import copy
import json
import math
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner
from support.sweep_data import (
    A_PARAMS,
    B_PARAMS,
    BEST,
    BEST_SPEC,
    C_PARAMS,
    DIVERGED,
    FIRST,
    RESULT,
    SECOND,
    SPACE,
    START,
    A,
    B,
    C,
    numbered,
    plain_spec,
    queued,
    read,
    sweep_spec,
)

import kaisa_train.cli as train_cli
from kaisa_train.records import TrialOutcome, TrialRecord, TrialState, parse_record
from service.cli import main as kaisa_ray_cli
from service.domain.interpretation import interpret
from service.domain.sweeps import ended, merge, plan
from service.model.lifecycle import JobEvent, JobState
from service.model.sweep_state import TrialEntry
from service.runner import entrypoint

# -- the entrypoint ----------------------------------------------------------------------


def test_a_spec_with_a_sweep_runs_kaisa_ray_sweep() -> None:
    spec = sweep_spec()
    words = shlex.split(entrypoint("0190abc", spec, "/shared/runs"))
    # The spec travels in the cluster's key-value store, not on the command line.
    assert words[:4] == ["kaisa-ray", "sweep", "--spec-key", "spec/0190abc"]
    assert words[4:] == ["--run-name", "0190abc", "--no-progress", "--storage-path", "/shared/runs"]


def test_a_spec_without_a_sweep_trains() -> None:
    spec = plain_spec()
    words = shlex.split(entrypoint("0190abc", spec, None))
    assert words[:4] == ["kaisa-ray", "train", "--spec-key", "spec/0190abc"]
    assert words[4:] == ["--run-name", "0190abc", "--no-progress"]
    # A sweep section set to null (how a spec dumped without one says so) is no sweep.
    assert shlex.split(entrypoint("j", {**spec, "sweep": None}, None))[1] == "train"


@pytest.mark.parametrize("swept", [True, False], ids=["sweep", "train"])
def test_the_cli_accepts_the_entrypoint(
    swept: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command line the Ray Job runs, parsed by kaisa-ray's own CLI (with --dry-run, so
    nothing starts): every flag exists on that command and the spec it reads from the
    cluster's key-value store (faked at its seam here) is valid there."""
    spec = sweep_spec() if swept else plain_spec()
    read: list[str] = []

    def from_the_cluster(key: str) -> str:
        read.append(key)
        return json.dumps(spec)

    monkeypatch.setattr(train_cli, "_read_key", from_the_cluster)
    words = shlex.split(entrypoint("0190abc", spec, str(tmp_path / "runs")))
    result = CliRunner().invoke(kaisa_ray_cli, [*words[1:], "--dry-run"])
    assert result.exit_code == 0, result.output
    assert read == ["spec/0190abc"]
    shown = json.loads(result.output)
    if swept:
        assert shown["trials"] == 3
        assert shown["space"] == SPACE
        assert shown["direction"] == "max"
    else:
        assert shown["run_name"] == "0190abc"
        assert shown["storage"] == str(tmp_path / "runs")


# -- interpret: a sweep's records, batch by batch ----------------------------------------


def test_a_sweep_in_three_batches() -> None:
    job = queued()
    first, job = read(job, FIRST)
    assert first.events == [JobEvent.RUN]  # the sweep runs: no PROFILING, whatever its kfac
    assert job.state is JobState.RUNNING
    assert (job.step, job.total_steps) == (0, 3)
    assert job.sweep is not None
    assert job.sweep.model_dump(mode="json", exclude={"trials"}) == {
        "trials_planned": 3,
        "concurrent": 2,
        "metric": "test_accuracy",
        "mode": "max",
        "space": SPACE,
        "best": None,
        "best_spec": None,
        "seconds": None,
    }
    assert job.sweep.trials == {
        A: TrialEntry(
            state=TrialState.RUNNING,
            params=A_PARAMS,
            step=20,
            metrics={"test_accuracy": 0.6, "test_loss": 1.1, "train_s": 4.0},
        ),
        B: TrialEntry(
            state=TrialState.RUNNING,
            params=B_PARAMS,
            step=20,
            metrics={"test_accuracy": 0.3, "test_loss": 2.0, "train_s": 4.2},
        ),
    }
    # Every trial record goes to the event streams as it came (with its time), in order.
    assert [kind for kind, _ in first.updates] == ["trial"] * 4
    assert first.updates[0][1] == {
        "kind": "trial",
        "trial": A,
        "state": "RUNNING",
        "params": A_PARAMS,
        "time": 1.8e9 + 1,
    }
    assert first.updates[3][1]["test_accuracy"] == 0.3
    assert first.progress.metrics == []  # a trial's evaluations are not the job's history

    second, job = read(job, SECOND)
    assert second.events == []
    assert job.state is JobState.RUNNING
    assert (job.step, job.total_steps) == (3, 3)  # succeeded, stopped early, failed
    assert job.sweep is not None
    trials = job.sweep.trials
    assert {t: trials[t].state for t in trials} == {A: "SUCCEEDED", B: "STOPPED", C: "FAILED"}
    # What the first batch said of B stays: the second only merges onto it.
    assert trials[B].params == B_PARAMS
    assert trials[B].metrics == {"test_accuracy": 0.3, "test_loss": 2.0, "train_s": 4.2}
    assert (trials[A].step, trials[A].metrics["test_accuracy"]) == (60, 0.8)
    assert trials[C] == TrialEntry(state=TrialState.FAILED, params=C_PARAMS, error=DIVERGED)
    assert [data["state"] for _, data in second.updates] == [
        "STOPPED",
        "RUNNING",
        "RUNNING",
        "SUCCEEDED",
        "FAILED",
    ]
    assert second.updates[-1][1]["error"] == DIVERGED

    third, job = read(job, [RESULT])
    assert third.events == []  # the end of the job is Ray's to say
    assert (job.step, job.total_steps) == (3, 3)
    assert job.sweep is not None
    assert job.sweep.best == TrialOutcome.model_validate(BEST)
    assert job.sweep.best_spec == BEST_SPEC
    assert job.sweep.seconds == 42.5
    trials = job.sweep.trials
    assert (trials[A].value, trials[A].checkpoint) == (0.8, BEST["checkpoint"])
    assert trials[A].metrics == {"test_accuracy": 0.8, "test_loss": 0.6, "train_s": 11.5}
    assert trials[B].run == f"job-1.{B}"
    assert trials[C].error == DIVERGED
    assert trials[C].value is None  # a failed trial has no value
    assert [kind for kind, _ in third.updates] == ["sweep"]
    assert third.updates[0][1] == {**RESULT, "time": 1.8e9 + len(FIRST) + len(SECOND)}


def test_one_batch_or_three_give_the_same_job() -> None:
    _, whole = read(queued(), [*FIRST, *SECOND, RESULT])
    job = queued()
    for batch in (FIRST, SECOND, [RESULT]):
        _, job = read(job, batch)
    assert (whole.state, whole.step, whole.total_steps, whole.cursor) == (
        job.state,
        job.step,
        job.total_steps,
        job.cursor,
    )
    assert whole.sweep == job.sweep


def test_interpret_leaves_the_stored_sweep_as_it_was() -> None:
    _, job = read(queued(), FIRST)
    before = copy.deepcopy(job.sweep)
    reading = interpret(job, numbered(SECOND, job.cursor), job.cursor + len(SECOND))
    assert job.sweep == before
    assert reading.progress.sweep is not None
    assert reading.progress.sweep.trials[A].state is TrialState.SUCCEEDED


def test_progress_counts_only_trials_that_are_over() -> None:
    _, job = read(queued(), FIRST)
    steps = []
    for record in SECOND:
        _, job = read(job, [record])
        steps.append(job.step)
    assert steps == [1, 1, 1, 2, 3]


def test_a_trial_that_is_over_stays_over() -> None:
    """A RUNNING record read after the trial's end (an evaluation that was on its way)
    updates its metrics but not its state."""
    _, job = read(queued(), [*FIRST, *SECOND])
    late = {"kind": "trial", "trial": B, "state": "RUNNING", "step": 40, "test_accuracy": 0.35}
    _, job = read(job, [late])
    assert job.sweep is not None
    assert job.sweep.trials[B].state is TrialState.STOPPED
    assert job.sweep.trials[B].step == 40
    assert job.step == 3


def test_a_trial_before_the_plan_takes_the_plan_from_the_spec() -> None:
    spec = sweep_spec(metric="test_loss", trials=5)
    reading, job = read(queued(spec), [FIRST[1]])
    assert reading.events == []  # only sweep-start says the sweep runs
    assert job.sweep is not None
    assert (job.sweep.trials_planned, job.sweep.metric, job.sweep.mode) == (
        5,
        "test_loss",
        "min",
    )
    assert job.sweep.space == SPACE
    assert list(job.sweep.trials) == [A]
    _, job = read(job, [START])
    assert (job.state, job.total_steps) == (JobState.RUNNING, 3)  # the record has the last word
    assert job.sweep is not None
    assert list(job.sweep.trials) == [A]


def test_a_diverged_trial_s_nan_becomes_null() -> None:
    """JSON has no NaN: neither the stored view nor the event (a browser's JSON.parse
    refuses Python's NaN) carries one."""
    record = {"kind": "trial", "trial": C, "state": "RUNNING", "step": 3, "test_loss": math.nan}
    reading, job = read(queued(), [START, record])
    assert job.sweep is not None
    assert job.sweep.trials[C].metrics == {"test_loss": None}
    json.dumps(reading.updates[0][1], allow_nan=False)
    assert reading.updates[0][1]["test_loss"] is None


def test_an_ordinary_job_has_no_sweep() -> None:
    reading, job = read(
        queued(plain_spec()),
        [{"kind": "worker", "rank": 0}, {"kind": "start", "total_steps": 60}],
    )
    assert reading.progress.sweep is None
    assert job.sweep is None
    assert (job.state, job.total_steps) == (JobState.RUNNING, 60)


# -- the view's helpers ------------------------------------------------------------------


def test_the_plan_of_a_spec() -> None:
    assert plan(sweep_spec()["sweep"]).model_dump(mode="json") == {
        "trials_planned": 3,
        "concurrent": 2,
        "metric": "test_accuracy",
        "mode": "max",
        "space": SPACE,
        "trials": {},
        "best": None,
        "best_spec": None,
        "seconds": None,
    }
    assert plan({"metric": "time_to_target", "space": SPACE}).mode == "min"
    assert plan(sweep_spec(metric="test_loss", mode="max")["sweep"]).mode == "max"


def test_ended_counts_the_final_states() -> None:
    view = merge(None, parse_record(START), spec=sweep_spec())
    assert ended(view) == 0
    for state, count in [("RUNNING", 0), ("SUCCEEDED", 1), ("STOPPED", 1), ("FAILED", 1)]:
        one = merge(view, TrialRecord(trial=A, state=TrialState(state)), spec={})
        assert ended(one) == count, state
    assert ended(None) == 0
