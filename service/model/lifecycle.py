"""The job lifecycle: states, events and the one function that moves a job between them.

Every change of a job's state in the service goes through ``transition``; a pair that is not
in ``TRANSITIONS`` raises ``IllegalTransitionError``, so an impossible history (a SUCCEEDED job
that starts RUNNING again, a CANCELLED job that SUCCEEDS) cannot be written::

    QUEUED ──profile──▶ PROFILING ──run──▶ RUNNING ──succeed──▶ SUCCEEDED
       │                    │                │  ▲
       │                    │            recover│run
       │                    │                ▼  │
       │                    └──────────▶ RECOVERING
       └─ cancel (any active state) ─▶ CANCELLING ──cancelled──▶ CANCELLED
          fail (any active state) ─▶ FAILED

    a job in Ray (queued, profiling, running, recovering) ──interrupt──▶ INTERRUPTED
    INTERRUPTED ──resume──▶ QUEUED (again, to go on from its latest checkpoint)

INTERRUPTED is where a graceful stop of the service leaves a job whose Ray Job it stops with
its embedded Ray head; the next service on the same database resumes it.
"""

from __future__ import annotations

from enum import StrEnum

from service.errors import ServiceError


class JobState(StrEnum):
    QUEUED = "QUEUED"
    PROFILING = "PROFILING"
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"
    CANCELLING = "CANCELLING"
    INTERRUPTED = "INTERRUPTED"  # stopped with the service; resumed when it starts again
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def finished(self) -> bool:
        return self in FINISHED


class JobEvent(StrEnum):
    PROFILE = "profile"  # the workers started and the tuner is profiling (kfac: auto)
    RUN = "run"  # the workers train (first start, or again after a restart)
    RECOVER = "recover"  # Ray Train lost a worker and restarts the worker group
    SUCCEED = "succeed"  # the Ray Job ended successfully
    FAIL = "fail"  # the Ray Job failed, or a step of the service failed for this job
    CANCEL = "cancel"  # a user asked to cancel
    CANCELLED = "cancelled"  # Ray stopped the job (or it never started)
    INTERRUPT = "interrupt"  # the service stopped, and its embedded Ray head with the job
    RESUME = "resume"  # the service started again: the job waits for admission once more


FINISHED = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
ACTIVE = frozenset(JobState) - FINISHED
_WORKING = frozenset({JobState.QUEUED, JobState.PROFILING, JobState.RUNNING, JobState.RECOVERING})

TRANSITIONS: dict[tuple[JobState, JobEvent], JobState] = {
    (JobState.QUEUED, JobEvent.PROFILE): JobState.PROFILING,
    (JobState.QUEUED, JobEvent.RUN): JobState.RUNNING,
    (JobState.PROFILING, JobEvent.RUN): JobState.RUNNING,
    (JobState.PROFILING, JobEvent.RECOVER): JobState.RECOVERING,
    (JobState.RUNNING, JobEvent.RECOVER): JobState.RECOVERING,
    (JobState.RECOVERING, JobEvent.PROFILE): JobState.PROFILING,
    (JobState.RECOVERING, JobEvent.RUN): JobState.RUNNING,
    **{(state, JobEvent.SUCCEED): JobState.SUCCEEDED for state in _WORKING},
    **{(state, JobEvent.FAIL): JobState.FAILED for state in ACTIVE},
    **{(state, JobEvent.CANCEL): JobState.CANCELLING for state in _WORKING},
    (JobState.CANCELLING, JobEvent.CANCELLED): JobState.CANCELLED,
    **{(state, JobEvent.INTERRUPT): JobState.INTERRUPTED for state in _WORKING},
    (JobState.INTERRUPTED, JobEvent.RESUME): JobState.QUEUED,
    (JobState.INTERRUPTED, JobEvent.CANCEL): JobState.CANCELLING,
    # Ray has the last word: a job that ends on its own while the stop is on its way.
    (JobState.CANCELLING, JobEvent.SUCCEED): JobState.SUCCEEDED,
}


class IllegalTransitionError(ServiceError, ValueError):
    """An event that cannot happen to a job in its current state (409 when a request asks
    for it)."""

    status = 409

    def __init__(self, state: JobState, event: JobEvent) -> None:
        self.state, self.event = state, event
        allowed = sorted(e.value for (s, e) in TRANSITIONS if s == state)
        super().__init__(
            f"a {state.value} job cannot {event.value}"
            + (f"; it can: {', '.join(allowed)}" if allowed else f"; {state.value} is final")
        )

    def __reduce__(self) -> tuple[type[IllegalTransitionError], tuple[JobState, JobEvent]]:
        return (type(self), (self.state, self.event))


def transition(state: JobState, event: JobEvent) -> JobState:
    """The state a job in ``state`` moves to on ``event``; raises ``IllegalTransitionError``."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalTransitionError(state, event) from None
