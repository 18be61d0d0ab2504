"""The job store: jobs, their state transitions and their metric history, in a database.

SQLite (a file in the data directory) by default; any SQLAlchemy URL works, e.g.
``postgresql+psycopg://user@host/kaisa``. The schema is brought up to date with Alembic at
open, so a newer service opens an older file. Every state change goes through
``JobStore.apply``, which runs ``lifecycle.transition`` and writes the transition row in the
same database transaction as the new state: the history can never disagree with the state.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from sqlalchemy import create_engine, delete, func, make_url, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from kaisa_train.records import LatestMetrics, TunerRecord
from service.errors import JobConflictError, JobNotFoundError
from service.model.cleaning import plain_text
from service.model.job_data import Job, Metric, Progress, Transition
from service.model.lifecycle import (
    ACTIVE,
    FINISHED,
    IllegalTransitionError,
    JobEvent,
    JobState,
    transition,
)
from service.model.sweep_state import SweepState
from service.store.database import migrate, private_file, sqlite_file, sqlite_pragmas
from service.store.rows import HeartbeatRow, JobRow, MetricRow, TransitionRow

__all__ = ["JobStore", "new_job_id"]

logger = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)


def job_of(row: JobRow) -> Job:
    """The job a row holds, as a snapshot."""
    return Job(
        id=row.id,
        name=row.name,
        state=JobState(row.state),
        spec=dict(row.spec),
        idempotency_key=row.idempotency_key,
        submission_id=row.submission_id,
        created_at=row.created_at,
        updated_at=row.updated_at,
        started_at=row.started_at,
        finished_at=row.finished_at,
        failure_reason=row.failure_reason,
        step=row.step,
        total_steps=row.total_steps,
        latest=_stored(LatestMetrics, row.id, "latest metrics", row.latest) or LatestMetrics(),
        tuner=_stored(TunerRecord, row.id, "tuner record", row.tuner),
        sweep=_stored(SweepState, row.id, "sweep state", row.sweep),
        cursor=row.cursor,
        attempts=row.attempts,
        resumes=row.resumes or 0,
        seq_base=row.seq_base or 0,
        resources=row.resources,
    )


def _stored(model: type[M], job_id: str, what: str, value: Any) -> M | None:
    """A JSON column read as its model: None where it is empty, or (logged) where it does not
    read, so that one odd row never keeps a job from being listed."""
    if not value:
        return None
    try:
        return model.model_validate(value)
    except ValidationError as err:
        logger.warning("job %s: the stored %s is unreadable, shown as none: %s", job_id, what, err)
        return None


def _move(session: Session, row: JobRow, event: JobEvent, reason: str | None) -> None:
    """Move ``row`` by ``event`` and add its transition row, in ``session``."""
    old = JobState(row.state)
    new = transition(old, event)
    now = time.time()
    reason = plain_text(reason) if reason else reason  # Ray's messages carry colour codes
    row.state, row.updated_at = new.value, now
    if new in (JobState.PROFILING, JobState.RUNNING) and row.started_at is None:
        row.started_at = now
    if new in FINISHED:
        row.finished_at = now
    if new is JobState.FAILED:
        row.failure_reason = reason or "failed (no reason was given)"
    session.add(
        TransitionRow(
            job_id=row.id,
            from_state=old.value,
            to_state=new.value,
            event=event.value,
            reason=reason,
            at=now,
        )
    )


def new_job_id() -> str:
    """Sortable by creation time (hex milliseconds), then random."""
    return f"{int(time.time() * 1000):011x}{secrets.token_hex(4)}"


class JobStore:
    """The service's database. Thread-safe: writes are serialised by a lock."""

    def __init__(self, url: str) -> None:
        path = sqlite_file(url)
        if path is not None:
            private_file(path)
        self.url = url
        sqlite = make_url(url).get_backend_name() == "sqlite"
        self.engine = create_engine(
            url, connect_args={"check_same_thread": False} if sqlite else {}
        )
        if sqlite:
            sqlite_pragmas(self.engine)
        migrate(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self._write = threading.Lock()
        self.version = 0
        """Goes up after every write transaction (committed or not): what this process
        read from the store at an older version may be out of date. The service is the
        database's only writer, so this is all a read cache has to watch."""

    def close(self) -> None:
        self.engine.dispose()

    def version_now(self) -> int:
        return self.version

    @contextmanager
    def _writing(self) -> Iterator[Session]:
        with self._write:
            try:
                with self._sessions.begin() as session:
                    yield session
            finally:
                # After the commit, so a reader that saw the old version cannot have read
                # anything older than what that version stands for.
                self.version += 1

    def _row(self, session: Session, job_id: str) -> JobRow:
        row = session.get(JobRow, job_id, with_for_update=True)
        if row is None:
            raise JobNotFoundError(job_id)
        return row

    # -- jobs ----------------------------------------------------------------------------

    def create(
        self,
        spec: Mapping[str, Any],
        *,
        idempotency_key: str | None = None,
        idempotency_ttl_s: float = 24 * 3600,
        resources: Mapping[str, Any] | None = None,
    ) -> tuple[Job, bool]:
        """Store a new QUEUED job; returns it and True, or, when ``idempotency_key`` was
        used in the last ``idempotency_ttl_s`` for the same spec, that job and False (a
        retried POST). The same key with a different spec is a ``JobConflictError``; an
        older use of the key is forgotten (the old job keeps everything but the key)."""
        spec = dict(spec)
        with self._writing() as session:
            if idempotency_key is not None:
                found = session.scalars(
                    select(JobRow).where(JobRow.idempotency_key == idempotency_key)
                ).first()
                if found is not None and found.created_at < time.time() - idempotency_ttl_s:
                    found.idempotency_key = None  # expired: the key names a new job now
                    session.flush()
                    found = None
                if found is not None:
                    if found.spec != spec:
                        raise JobConflictError(
                            f"idempotency key {idempotency_key!r} was used for job {found.id} "
                            "with a different spec; use a new key for a new job"
                        )
                    return job_of(found), False
            now = time.time()
            row = JobRow(
                id=new_job_id(),
                name=str(spec.get("name", "")),
                state=JobState.QUEUED.value,
                spec=spec,
                idempotency_key=idempotency_key,
                created_at=now,
                updated_at=now,
                step=0,
                latest={},
                cursor=0,
                attempts=0,
                resumes=0,
                seq_base=0,
                resources=dict(resources) if resources is not None else None,
            )
            session.add(row)
            session.add(
                TransitionRow(
                    job_id=row.id,
                    from_state="",
                    to_state=JobState.QUEUED.value,
                    event="submit",
                    reason=None,
                    at=now,
                )
            )
            try:
                session.flush()
            except IntegrityError as err:  # pragma: no cover - the lock rules this out
                raise JobConflictError(f"idempotency key {idempotency_key!r} is taken") from err
            return job_of(row), True

    def get(self, job_id: str) -> Job:
        with self._sessions() as session:
            row = session.get(JobRow, job_id)
            if row is None:
                raise JobNotFoundError(job_id)
            return job_of(row)

    def page(
        self, *, states: Iterable[JobState] = (), limit: int = 50, offset: int = 0
    ) -> tuple[list[Job], int]:
        """Jobs newest first, filtered by state; and how many match in all."""
        wanted = [s.value for s in states]
        query = select(JobRow)
        count = select(func.count()).select_from(JobRow)
        if wanted:
            query = query.where(JobRow.state.in_(wanted))
            count = count.where(JobRow.state.in_(wanted))
        query = query.order_by(JobRow.created_at.desc(), JobRow.id.desc())
        with self._sessions() as session:
            rows = session.scalars(query.limit(limit).offset(offset)).all()
            total = session.scalar(count) or 0
            return [job_of(r) for r in rows], total

    def active(self) -> list[Job]:
        """Jobs that are not finished, oldest first (what the follower follows)."""
        query = (
            select(JobRow)
            .where(JobRow.state.in_([s.value for s in ACTIVE]))
            .order_by(JobRow.created_at)
        )
        with self._sessions() as session:
            return [job_of(r) for r in session.scalars(query).all()]

    def following(self, queued: int) -> list[Job]:
        """What the follower follows: every job in Ray or being cancelled, and the first
        ``queued`` jobs waiting for admission (a burst may queue thousands; reading them all
        on every pass would hold the GIL the requests need). Oldest first."""
        waiting = (JobRow.state == JobState.QUEUED.value) & JobRow.submission_id.is_(None)
        in_ray = (
            select(JobRow)
            .where(JobRow.state.in_([s.value for s in ACTIVE]), ~waiting)
            .order_by(JobRow.created_at)
        )
        first = select(JobRow).where(waiting).order_by(JobRow.created_at, JobRow.id).limit(queued)
        with self._sessions() as session:
            rows = [*session.scalars(in_ray).all(), *session.scalars(first).all()]
        return sorted((job_of(r) for r in rows), key=lambda job: (job.created_at, job.id))

    def counts(self) -> dict[JobState, int]:
        with self._sessions() as session:
            rows = session.execute(select(JobRow.state, func.count()).group_by(JobRow.state))
            found = {JobState(state): n for state, n in rows}
        return {state: found.get(state, 0) for state in JobState}

    def delete(self, job_id: str) -> None:
        """Delete a finished job and its history; a job that is not finished is a conflict."""
        with self._writing() as session:
            row = self._row(session, job_id)
            if JobState(row.state) not in FINISHED:
                raise JobConflictError(
                    f"job {job_id} is {row.state}; only finished jobs can be deleted: cancel it "
                    "first (POST /v1/jobs/{id}/cancel) and delete it once it is CANCELLED"
                )
            session.execute(delete(MetricRow).where(MetricRow.job_id == job_id))
            session.execute(delete(TransitionRow).where(TransitionRow.job_id == job_id))
            session.delete(row)

    # -- state ---------------------------------------------------------------------------

    def apply(self, job_id: str, event: JobEvent, reason: str | None = None) -> Job:
        """Move a job by ``event`` (``lifecycle.transition``) and record the transition."""
        with self._writing() as session:
            row = self._row(session, job_id)
            _move(session, row, event, reason)
            return job_of(row)

    def cancel(self, job_id: str, reason: str = "cancelled by a user") -> Job:
        """Ask for a job to stop, checked and applied in one transaction: CANCELLING (or
        CANCELLED for a job that never reached Ray); a job already cancelling or cancelled
        is returned as it is (so concurrent cancels all succeed); a job that finished
        otherwise is a ``JobConflictError``."""
        with self._writing() as session:
            row = self._row(session, job_id)
            state = JobState(row.state)
            if state in (JobState.CANCELLING, JobState.CANCELLED):
                return job_of(row)
            if state in FINISHED:
                raise JobConflictError(
                    f"job {job_id} already finished as {state}; nothing to cancel"
                )
            _move(session, row, JobEvent.CANCEL, reason)
            return job_of(row)

    def queue(self) -> list[str]:
        """The jobs waiting for admission (QUEUED, not yet sent to Ray), first in line first."""
        query = (
            select(JobRow.id)
            .where(JobRow.state == JobState.QUEUED.value, JobRow.submission_id.is_(None))
            .order_by(JobRow.created_at, JobRow.id)
        )
        with self._sessions() as session:
            return list(session.scalars(query).all())

    def queue_position(self, job: Job) -> int | None:
        """1 for the next job to be admitted, and so on; None for a job not waiting."""
        if job.state is not JobState.QUEUED or job.submission_id is not None:
            return None
        query = (
            select(func.count())
            .select_from(JobRow)
            .where(
                JobRow.state == JobState.QUEUED.value,
                JobRow.submission_id.is_(None),
                (JobRow.created_at < job.created_at)
                | ((JobRow.created_at == job.created_at) & (JobRow.id < job.id)),
            )
        )
        with self._sessions() as session:
            return int(session.scalar(query) or 0) + 1

    def interrupted(self) -> list[Job]:
        """The jobs a graceful stop interrupted, oldest first (to resume)."""
        query = (
            select(JobRow)
            .where(JobRow.state == JobState.INTERRUPTED.value)
            .order_by(JobRow.created_at, JobRow.id)
        )
        with self._sessions() as session:
            return [job_of(r) for r in session.scalars(query).all()]

    def resume(self, job_id: str, reason: str) -> Job:
        """An INTERRUPTED job back in the queue (first in line: the oldest), to be submitted
        again from its latest checkpoint: its submission forgotten, its progress cursor at the
        start of a new life whose records are numbered after every record it has."""
        with self._writing() as session:
            row = self._row(session, job_id)
            _move(session, row, JobEvent.RESUME, reason)
            last = session.scalar(select(func.max(MetricRow.seq)).where(MetricRow.job_id == job_id))
            row.seq_base = max(row.seq_base + row.cursor, (last or -1) + 1)
            row.cursor = 0
            row.submission_id = None
            row.resumes = (row.resumes or 0) + 1
            if row.sweep is not None or (row.spec or {}).get("sweep"):
                # A sweep starts over (Ray Tune does not resume its trials here): its view of
                # the trials is of the life that was stopped.
                row.sweep, row.step, row.total_steps = None, 0, None
            return job_of(row)

    def set_submission(self, job_id: str, submission_id: str) -> Job:
        with self._writing() as session:
            row = self._row(session, job_id)
            row.submission_id, row.updated_at = submission_id, time.time()
            return job_of(row)

    def transitions(self, job_id: str) -> list[Transition]:
        return self.detail(job_id)[1]

    def detail(self, job_id: str) -> tuple[Job, list[Transition]]:
        """A job and its transitions, oldest first, read at once."""
        query = (
            select(TransitionRow).where(TransitionRow.job_id == job_id).order_by(TransitionRow.id)
        )
        with self._sessions() as session:
            row = session.get(JobRow, job_id)
            if row is None:
                raise JobNotFoundError(job_id)
            return job_of(row), [
                Transition(
                    job_id=r.job_id,
                    from_state=JobState(r.from_state) if r.from_state else None,
                    to_state=JobState(r.to_state),
                    event=r.event,
                    reason=r.reason,
                    at=r.at,
                )
                for r in session.scalars(query).all()
            ]

    # -- progress ------------------------------------------------------------------------

    def add_progress(self, job_id: str, progress: Progress) -> Job:
        """Store a batch of progress records and what they change on the job, at once: its
        metrics, fields and the state changes the records mean (``progress.events``; one that
        no longer applies, say after a cancel, is skipped), in one transaction, so the cursor
        never moves past a record whose state change was not written."""
        with self._writing() as session:
            row = self._row(session, job_id)
            if progress.cursor < row.cursor:
                return job_of(row)  # an older read than what is stored: nothing new
            for from_step, seq in progress.restarts:
                session.execute(
                    delete(MetricRow).where(
                        MetricRow.job_id == job_id, MetricRow.step > from_step, MetricRow.seq < seq
                    )
                )
            known = set(
                session.scalars(
                    select(MetricRow.seq).where(
                        MetricRow.job_id == job_id,
                        MetricRow.seq.in_([m.seq for m in progress.metrics]),
                    )
                ).all()
            )
            for metric in progress.metrics:
                if metric.seq in known:
                    continue
                session.add(
                    MetricRow(
                        job_id=job_id,
                        seq=metric.seq,
                        kind=metric.kind,
                        step=metric.step,
                        at=metric.at,
                        values=metric.values,
                    )
                )
            row.cursor = progress.cursor
            if progress.step is not None:
                row.step = progress.step
            if progress.total_steps is not None:
                row.total_steps = progress.total_steps
            if progress.latest is not None:
                row.latest = {**(row.latest or {}), **progress.latest.numbers()}
            if progress.tuner is not None:
                row.tuner = progress.tuner.values()
            if progress.sweep is not None:
                row.sweep = progress.sweep.stored()
            if progress.attempts is not None:
                row.attempts = progress.attempts
            row.updated_at = time.time()
            for event in progress.events:
                try:
                    _move(session, row, event, None)
                except IllegalTransitionError:
                    continue
            return job_of(row)

    def metrics(
        self, job_id: str, *, kinds: Iterable[str] = (), since: int = 0, limit: int = 10_000
    ) -> list[Metric]:
        self.get(job_id)
        query = select(MetricRow).where(MetricRow.job_id == job_id, MetricRow.seq >= since)
        wanted = list(kinds)
        if wanted:
            query = query.where(MetricRow.kind.in_(wanted))
        query = query.order_by(MetricRow.seq).limit(limit)
        with self._sessions() as session:
            return [
                Metric(seq=r.seq, kind=r.kind, step=r.step, at=r.at, values=dict(r.values))
                for r in session.scalars(query).all()
            ]

    def writable(self) -> bool:
        """Readiness: a real write to the database's file, committed (the heartbeat row: its
        time and this process), as every write of a job is. A full disk, another process's
        lock or a read-only file raise here as they would on a POST."""
        # Not through _writing: no job changes, so what readers cached stays current.
        with self._write, self._sessions.begin() as session:
            beat = session.get(HeartbeatRow, 1)
            if beat is None:
                session.add(HeartbeatRow(id=1, at=time.time(), pid=os.getpid()))
            else:
                beat.at, beat.pid = time.time(), os.getpid()
        return True
