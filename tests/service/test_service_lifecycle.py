"""The job lifecycle (``service.model.lifecycle``): every (state, event) pair either moves a job as
``TRANSITIONS`` says or raises ``IllegalTransitionError`` naming the state and the event."""

from __future__ import annotations

import itertools
import pickle

import pytest

from service.errors import ServiceError
from service.model.lifecycle import (
    ACTIVE,
    FINISHED,
    TRANSITIONS,
    IllegalTransitionError,
    JobEvent,
    JobState,
    transition,
)

PAIRS = list(itertools.product(JobState, JobEvent))


@pytest.mark.parametrize(("state", "event"), PAIRS, ids=[f"{s}-{e}" for s, e in PAIRS])
def test_every_pair_follows_the_table_or_is_refused(state: JobState, event: JobEvent) -> None:
    if (state, event) in TRANSITIONS:
        assert transition(state, event) is TRANSITIONS[(state, event)]
    else:
        with pytest.raises(IllegalTransitionError) as caught:
            transition(state, event)
        message = str(caught.value)
        assert state.value in message
        assert event.value in message
        assert message.startswith(f"a {state.value} job cannot {event.value};")
        assert caught.value.state is state
        assert caught.value.event is event


def test_the_table_names_only_known_states_and_events() -> None:
    for (state, event), target in TRANSITIONS.items():
        assert isinstance(state, JobState)
        assert isinstance(event, JobEvent)
        assert isinstance(target, JobState)


def test_finished_and_active_split_the_states() -> None:
    assert {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED} == FINISHED
    assert set(JobState) - FINISHED == ACTIVE
    assert [s for s in JobState if s.finished] == [
        JobState.SUCCEEDED,
        JobState.FAILED,
        JobState.CANCELLED,
    ]


@pytest.mark.parametrize("state", sorted(FINISHED))
def test_a_finished_job_accepts_no_event(state: JobState) -> None:
    assert [e for (s, e) in TRANSITIONS if s == state] == []
    for event in JobEvent:
        with pytest.raises(IllegalTransitionError, match=f"; {state.value} is final$"):
            transition(state, event)


def test_the_main_path_of_a_job() -> None:
    assert transition(JobState.QUEUED, JobEvent.PROFILE) is JobState.PROFILING
    assert transition(JobState.QUEUED, JobEvent.RUN) is JobState.RUNNING
    assert transition(JobState.PROFILING, JobEvent.RUN) is JobState.RUNNING
    assert transition(JobState.RUNNING, JobEvent.SUCCEED) is JobState.SUCCEEDED


def test_recovery() -> None:
    assert transition(JobState.RUNNING, JobEvent.RECOVER) is JobState.RECOVERING
    assert transition(JobState.PROFILING, JobEvent.RECOVER) is JobState.RECOVERING
    assert transition(JobState.RECOVERING, JobEvent.RUN) is JobState.RUNNING
    assert transition(JobState.RECOVERING, JobEvent.PROFILE) is JobState.PROFILING
    with pytest.raises(IllegalTransitionError, match="a QUEUED job cannot recover"):
        transition(JobState.QUEUED, JobEvent.RECOVER)
    with pytest.raises(IllegalTransitionError, match="a RUNNING job cannot profile"):
        transition(JobState.RUNNING, JobEvent.PROFILE)


def test_cancelling() -> None:
    assert transition(JobState.QUEUED, JobEvent.CANCEL) is JobState.CANCELLING
    assert transition(JobState.RUNNING, JobEvent.CANCEL) is JobState.CANCELLING
    assert transition(JobState.CANCELLING, JobEvent.CANCELLED) is JobState.CANCELLED
    # Ray has the last word: a job that ends on its own while the stop is on its way.
    assert transition(JobState.CANCELLING, JobEvent.SUCCEED) is JobState.SUCCEEDED
    assert transition(JobState.CANCELLING, JobEvent.FAIL) is JobState.FAILED
    with pytest.raises(IllegalTransitionError, match="a CANCELLING job cannot cancel"):
        transition(JobState.CANCELLING, JobEvent.CANCEL)
    with pytest.raises(IllegalTransitionError, match="a CANCELLING job cannot run"):
        transition(JobState.CANCELLING, JobEvent.RUN)
    with pytest.raises(IllegalTransitionError, match="a RUNNING job cannot cancelled"):
        transition(JobState.RUNNING, JobEvent.CANCELLED)


@pytest.mark.parametrize("state", sorted(ACTIVE))
def test_every_active_job_can_fail(state: JobState) -> None:
    assert transition(state, JobEvent.FAIL) is JobState.FAILED


def test_a_graceful_stop_interrupts_and_the_next_start_resumes() -> None:
    for state in (JobState.QUEUED, JobState.PROFILING, JobState.RUNNING, JobState.RECOVERING):
        assert transition(state, JobEvent.INTERRUPT) is JobState.INTERRUPTED
    assert transition(JobState.INTERRUPTED, JobEvent.RESUME) is JobState.QUEUED
    assert transition(JobState.INTERRUPTED, JobEvent.CANCEL) is JobState.CANCELLING
    assert transition(JobState.INTERRUPTED, JobEvent.FAIL) is JobState.FAILED
    assert not JobState.INTERRUPTED.finished  # it goes on
    for event in (JobEvent.RUN, JobEvent.SUCCEED, JobEvent.INTERRUPT):
        with pytest.raises(IllegalTransitionError, match="a INTERRUPTED job cannot"):
            transition(JobState.INTERRUPTED, event)
    with pytest.raises(IllegalTransitionError, match="a CANCELLING job cannot interrupt"):
        transition(JobState.CANCELLING, JobEvent.INTERRUPT)


def test_the_message_lists_what_the_state_allows() -> None:
    with pytest.raises(IllegalTransitionError) as caught:
        transition(JobState.QUEUED, JobEvent.CANCELLED)
    assert str(caught.value) == (
        "a QUEUED job cannot cancelled; it can: cancel, fail, interrupt, profile, run, succeed"
    )
    with pytest.raises(IllegalTransitionError) as caught:
        transition(JobState.SUCCEEDED, JobEvent.RUN)
    assert str(caught.value) == "a SUCCEEDED job cannot run; SUCCEEDED is final"


def test_the_error_is_a_service_error_and_pickles() -> None:
    err = IllegalTransitionError(JobState.CANCELLED, JobEvent.SUCCEED)
    assert isinstance(err, ServiceError)  # a KaisaRayError, answered 409 by the API
    assert isinstance(err, ValueError)
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is IllegalTransitionError
    assert copy.state is JobState.CANCELLED
    assert copy.event is JobEvent.SUCCEED
    assert str(copy) == str(err)
    assert copy.args == err.args
