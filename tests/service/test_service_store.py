"""The job store (``service.store.repository.JobStore``) on a real SQLite file: jobs,
idempotency keys, pages, state transitions, progress, metric history, deletion, reopening; and
the Alembic migrations against the tables of ``service.store.rows``."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import (
    Column,
    Integer,
    MetaData,
    Table,
    create_engine,
    func,
    inspect,
    select,
    text,
    update,
)

from kaisa_train.records import LatestMetrics, TrialOutcome, TrialState
from service.errors import JobConflictError, JobNotFoundError
from service.model.job_data import Job, Metric, Progress, Transition
from service.model.lifecycle import IllegalTransitionError, JobEvent, JobState
from service.model.sweep_state import SweepState
from service.store.database import MIGRATIONS
from service.store.repository import JobStore
from service.store.rows import Base, JobRow, MetricRow, TransitionRow
from tests.support.service_app import TUNER


def spec(name: str = "job", **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "model": {"name": "lenet"},
        "dataset": {"name": "synthetic", "batch_size": 8},
        "stop": {"max_steps": 10},
        **extra,
    }


def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'data' / 'jobs.db'}"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[JobStore]:
    opened = JobStore(url(tmp_path))
    try:
        yield opened
    finally:
        opened.close()


def new(store: JobStore, name: str = "job", **extra: Any) -> Job:
    job, created = store.create(spec(name, **extra))
    assert created
    return job


def step(seq: int, at_step: int, **values: Any) -> Metric:
    return Metric(seq=seq, kind="step", step=at_step, at=1.8e9 + seq, values=values)


SWEEP = SweepState.model_validate(
    {
        "trials_planned": 2,
        "metric": "test_accuracy",
        "mode": "max",
        "space": {"optimizer.lr": {"loguniform": [0.001, 0.1]}},
        "concurrent": 1,
        "trials": {"t_00000": {"state": "SUCCEEDED", "params": {"optimizer.lr": 0.01}, "step": 10}},
    }
)


def rows(store: JobStore, column: Any, job_id: str) -> int:
    """How many rows of ``column``'s table belong to the job."""
    with store.engine.connect() as connection:
        return int(connection.scalar(select(func.count()).where(column == job_id)) or 0)


# -- schema ------------------------------------------------------------------------------


def test_the_migrations_make_exactly_the_tables_schema(tmp_path: Path) -> None:
    opened = JobStore(url(tmp_path))  # migrates
    try:
        with opened.engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            assert compare_metadata(context, Base.metadata) == []
            assert set(Base.metadata.tables) == {"jobs", "transitions", "metrics", "heartbeat"}
            config = Config()
            config.set_main_option("script_location", str(MIGRATIONS))
            head = ScriptDirectory.from_config(config).get_current_head()
            assert context.get_current_revision() == head
    finally:
        opened.close()
    assert (tmp_path / "data" / "jobs.db").is_file()


def test_the_schema_comparison_would_see_a_difference(tmp_path: Path) -> None:
    """The check above is not vacuous: a table the migrations lack is reported."""
    opened = JobStore(url(tmp_path))
    try:
        other = MetaData()
        for table in Base.metadata.tables.values():
            table.to_metadata(other)
        Table("extra", other, Column("id", Integer, primary_key=True))
        with opened.engine.connect() as connection:
            context = MigrationContext.configure(connection)
            diff = compare_metadata(context, other)
        assert [entry[0] for entry in diff] == ["add_table"]
        assert diff[0][1].name == "extra"
    finally:
        opened.close()


def test_a_store_opens_a_database_made_by_an_earlier_store(tmp_path: Path) -> None:
    first = JobStore(url(tmp_path))
    job = new(first, "kept")
    first.close()
    second = JobStore(url(tmp_path))  # migrating an up-to-date database changes nothing
    try:
        assert second.get(job.id) == job
    finally:
        second.close()


def alembic(db_url: str, move: str, revision: str) -> None:
    """Run Alembic's ``upgrade`` or ``downgrade`` to ``revision`` on the database (at
    ``upgrade 0001``: the schema an older service left)."""
    engine = create_engine(db_url)
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        getattr(command, move)(config, revision)
    engine.dispose()


def head_revision() -> str | None:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    return ScriptDirectory.from_config(config).get_current_head()


def test_a_database_made_at_revision_0001_is_upgraded_in_place(tmp_path: Path) -> None:
    """A database of the first schema (no jobs.sweep) keeps every job, transition and metric
    when a newer store opens it, and its jobs work on: the sweep column comes empty."""
    (tmp_path / "data").mkdir()
    alembic(url(tmp_path), "upgrade", "0001")
    engine = create_engine(url(tmp_path))
    with engine.begin() as connection:
        assert "sweep" not in {c["name"] for c in inspect(connection).get_columns("jobs")}
        connection.execute(
            text(
                "INSERT INTO jobs (id, name, state, spec, idempotency_key, submission_id, "
                "created_at, updated_at, started_at, finished_at, failure_reason, step, "
                "total_steps, latest, tuner, cursor, attempts) VALUES ('old', 'kept', "
                "'RUNNING', :spec, 'key-old', 'kaisa-ray-old', 1.0, 2.0, 1.5, NULL, NULL, 20, "
                "100, :latest, :tuner, 7, 1)"
            ),
            {
                "spec": '{"name": "kept", "stop": {"max_steps": 100}}',
                "latest": '{"loss": 0.5, "step": 20}',
                "tuner": TUNER.model_dump_json(exclude={"kind"}, exclude_unset=True),
            },
        )
        connection.execute(
            text(
                "INSERT INTO transitions (job_id, from_state, to_state, event, reason, at) "
                "VALUES ('old', '', 'QUEUED', 'submit', NULL, 1.0), "
                "('old', 'QUEUED', 'RUNNING', 'run', NULL, 1.5)"
            )
        )
        connection.execute(
            text(
                'INSERT INTO metrics (job_id, seq, kind, step, at, "values") '
                "VALUES ('old', 3, 'step', 20, 1.6, '{\"loss\": 0.5}')"
            )
        )
    engine.dispose()

    opened = JobStore(url(tmp_path))  # migrates to the newest revision
    try:
        with opened.engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            assert context.get_current_revision() == head_revision() != "0001"
            assert compare_metadata(context, Base.metadata) == []
        job = opened.get("old")
        assert (job.name, job.state, job.spec) == (
            "kept",
            JobState.RUNNING,
            {"name": "kept", "stop": {"max_steps": 100}},
        )
        assert (job.idempotency_key, job.submission_id) == ("key-old", "kaisa-ray-old")
        assert (job.created_at, job.updated_at, job.started_at, job.finished_at) == (
            1.0,
            2.0,
            1.5,
            None,
        )
        assert (job.step, job.total_steps, job.cursor, job.attempts) == (20, 100, 7, 1)
        assert job.latest == LatestMetrics(loss=0.5, step=20)
        assert job.tuner == TUNER
        assert job.sweep is None
        assert [(t.from_state, t.to_state, t.event) for t in opened.transitions("old")] == [
            (None, JobState.QUEUED, "submit"),
            (JobState.QUEUED, JobState.RUNNING, "run"),
        ]
        assert opened.metrics("old") == [
            Metric(seq=3, kind="step", step=20, at=1.6, values={"loss": 0.5})
        ]
        # The old job goes on in the new schema.
        stored = opened.add_progress("old", Progress(cursor=8, sweep=SWEEP))
        assert (stored.sweep, stored.latest, stored.step) == (SWEEP, job.latest, 20)
        with pytest.raises(JobConflictError, match="'key-old' was used for job old"):
            # (created in 1970: a key that never expires here, to see the old row's key kept)
            opened.create(spec("kept"), idempotency_key="key-old", idempotency_ttl_s=2e9)
    finally:
        opened.close()


def test_the_sweep_migration_downgrades_keeping_the_jobs(tmp_path: Path) -> None:
    opened = JobStore(url(tmp_path))
    job = new(opened, "kept")
    opened.add_progress(job.id, Progress(cursor=1, sweep=SWEEP))
    opened.close()
    alembic(url(tmp_path), "downgrade", "0001")
    engine = create_engine(url(tmp_path))
    with engine.connect() as connection:
        assert "sweep" not in {c["name"] for c in inspect(connection).get_columns("jobs")}
        assert connection.scalar(text("SELECT name FROM jobs WHERE id = :id"), {"id": job.id}) == (
            "kept"
        )
    engine.dispose()
    again = JobStore(url(tmp_path))  # and up again
    try:
        assert again.get(job.id).sweep is None
        assert again.get(job.id).name == "kept"
    finally:
        again.close()


# -- create and get ----------------------------------------------------------------------


def test_create_stores_a_queued_job(store: JobStore) -> None:
    before = time.time()
    job, created = store.create(spec("first"))
    assert created
    assert job.state is JobState.QUEUED
    assert job.name == "first"
    assert job.spec == spec("first")
    assert job.idempotency_key is None
    assert job.submission_id is None
    assert before <= job.created_at == job.updated_at <= time.time()
    assert (job.started_at, job.finished_at, job.failure_reason) == (None, None, None)
    assert (job.step, job.total_steps, job.latest, job.tuner, job.sweep) == (
        0,
        None,
        LatestMetrics(),
        None,
        None,
    )
    assert (job.cursor, job.attempts) == (0, 0)
    assert len(job.id) == 19
    assert store.get(job.id) == job
    assert store.transitions(job.id) == [
        Transition(job.id, None, JobState.QUEUED, "submit", None, job.created_at)
    ]


def test_jobs_get_distinct_ids(store: JobStore) -> None:
    ids = {new(store).id for _ in range(20)}
    assert len(ids) == 20


def test_an_idempotency_key_returns_the_same_job(store: JobStore) -> None:
    job, created = store.create(spec("a"), idempotency_key="key-1")
    assert created
    assert job.idempotency_key == "key-1"
    again, created_again = store.create(spec("a"), idempotency_key="key-1")
    assert not created_again
    assert again == job
    assert store.page()[1] == 1
    other, created_other = store.create(spec("a"), idempotency_key="key-2")
    assert created_other
    assert other.id != job.id
    assert store.page()[1] == 2


def test_an_idempotency_key_with_another_spec_is_a_conflict(store: JobStore) -> None:
    job, _ = store.create(spec("a"), idempotency_key="key-1")
    with pytest.raises(JobConflictError, match=f"'key-1' was used for job {job.id}"):
        store.create(spec("b"), idempotency_key="key-1")
    with pytest.raises(JobConflictError, match="different spec"):
        store.create(spec("a", seed=3), idempotency_key="key-1")
    assert store.page()[1] == 1


def test_the_same_key_from_many_threads_makes_one_job(store: JobStore) -> None:
    results: list[tuple[Job, bool]] = []
    barrier = threading.Barrier(8)

    def create() -> None:
        barrier.wait()
        results.append(store.create(spec("racy"), idempotency_key="race"))

    threads = [threading.Thread(target=create) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(results) == 8
    assert sorted(created for _, created in results) == [False] * 7 + [True]
    assert len({job.id for job, _ in results}) == 1
    assert store.page()[1] == 1


def test_an_unknown_job_is_not_found(store: JobStore) -> None:
    with pytest.raises(JobNotFoundError, match="no job 'nope'"):
        store.get("nope")
    with pytest.raises(JobNotFoundError):
        store.transitions("nope")
    with pytest.raises(JobNotFoundError):
        store.metrics("nope")
    with pytest.raises(JobNotFoundError):
        store.apply("nope", JobEvent.RUN)
    with pytest.raises(JobNotFoundError):
        store.add_progress("nope", Progress(cursor=1))
    with pytest.raises(JobNotFoundError):
        store.set_submission("nope", "sid")
    with pytest.raises(JobNotFoundError):
        store.delete("nope")


def test_set_submission(store: JobStore) -> None:
    job = new(store)
    stored = store.set_submission(job.id, "kaisa-ray-x")
    assert stored.submission_id == "kaisa-ray-x"
    assert store.get(job.id).submission_id == "kaisa-ray-x"
    assert stored.updated_at >= job.updated_at


# -- pages -------------------------------------------------------------------------------


def test_page_is_newest_first_with_limit_offset_and_total(store: JobStore) -> None:
    made = [new(store, f"job{i}") for i in range(5)]
    newest_first = [j.id for j in reversed(made)]
    jobs, total = store.page()
    assert total == 5
    assert [j.id for j in jobs] == newest_first
    jobs, total = store.page(limit=2)
    assert (total, [j.id for j in jobs]) == (5, newest_first[:2])
    jobs, total = store.page(limit=2, offset=2)
    assert (total, [j.id for j in jobs]) == (5, newest_first[2:4])
    jobs, total = store.page(limit=2, offset=4)
    assert (total, [j.id for j in jobs]) == (5, newest_first[4:])
    jobs, total = store.page(offset=10)
    assert (total, jobs) == (5, [])


def test_page_filters_by_state(store: JobStore) -> None:
    queued, running, failed, succeeded = (new(store, n) for n in ("q", "r", "f", "s"))
    store.apply(running.id, JobEvent.RUN)
    store.apply(failed.id, JobEvent.FAIL, "boom")
    store.apply(succeeded.id, JobEvent.RUN)
    store.apply(succeeded.id, JobEvent.SUCCEED)
    jobs, total = store.page(states=[JobState.RUNNING])
    assert (total, [j.id for j in jobs]) == (1, [running.id])
    jobs, total = store.page(states=[JobState.QUEUED, JobState.FAILED])
    assert (total, [j.id for j in jobs]) == (2, [failed.id, queued.id])
    jobs, total = store.page(states=[JobState.CANCELLED])
    assert (total, jobs) == (0, [])
    jobs, total = store.page(states=[JobState.QUEUED, JobState.FAILED], limit=1, offset=1)
    assert (total, [j.id for j in jobs]) == (2, [queued.id])
    assert store.counts() == {
        JobState.QUEUED: 1,
        JobState.PROFILING: 0,
        JobState.RUNNING: 1,
        JobState.RECOVERING: 0,
        JobState.CANCELLING: 0,
        JobState.INTERRUPTED: 0,
        JobState.SUCCEEDED: 1,
        JobState.FAILED: 1,
        JobState.CANCELLED: 0,
    }
    assert [j.id for j in store.active()] == [queued.id, running.id]  # oldest first


# -- state -------------------------------------------------------------------------------


def test_apply_writes_the_transitions_in_order(store: JobStore) -> None:
    job = new(store)
    profiling = store.apply(job.id, JobEvent.PROFILE)
    assert profiling.state is JobState.PROFILING
    assert profiling.started_at is not None
    assert profiling.finished_at is None
    running = store.apply(job.id, JobEvent.RUN)
    recovering = store.apply(job.id, JobEvent.RECOVER, "a worker died")
    again = store.apply(job.id, JobEvent.RUN)
    done = store.apply(job.id, JobEvent.SUCCEED)
    assert running.started_at == recovering.started_at == again.started_at == profiling.started_at
    assert done.state is JobState.SUCCEEDED
    assert done.finished_at is not None
    assert done.finished_at >= done.started_at  # type: ignore[operator]
    assert done.updated_at == done.finished_at
    assert done.failure_reason is None
    assert store.get(job.id) == done
    history = store.transitions(job.id)
    assert [(t.from_state, t.to_state, t.event, t.reason) for t in history] == [
        (None, JobState.QUEUED, "submit", None),
        (JobState.QUEUED, JobState.PROFILING, "profile", None),
        (JobState.PROFILING, JobState.RUNNING, "run", None),
        (JobState.RUNNING, JobState.RECOVERING, "recover", "a worker died"),
        (JobState.RECOVERING, JobState.RUNNING, "run", None),
        (JobState.RUNNING, JobState.SUCCEEDED, "succeed", None),
    ]
    assert [t.at for t in history] == sorted(t.at for t in history)
    assert history[-1].at == done.finished_at
    assert all(t.job_id == job.id for t in history)


def test_a_failure_keeps_its_reason(store: JobStore) -> None:
    job = new(store)
    store.apply(job.id, JobEvent.RUN)
    failed = store.apply(job.id, JobEvent.FAIL, "the Ray Job failed: OOM")
    assert failed.state is JobState.FAILED
    assert failed.failure_reason == "the Ray Job failed: OOM"
    assert failed.finished_at is not None
    other = new(store)
    assert store.apply(other.id, JobEvent.FAIL).failure_reason == "failed (no reason was given)"
    assert store.get(other.id).started_at is None


def test_a_cancel_before_the_start(store: JobStore) -> None:
    job = new(store)
    cancelling = store.apply(job.id, JobEvent.CANCEL, "cancelled by a user")
    assert cancelling.state is JobState.CANCELLING
    assert cancelling.finished_at is None
    cancelled = store.apply(job.id, JobEvent.CANCELLED)
    assert cancelled.state is JobState.CANCELLED
    assert cancelled.started_at is None
    assert cancelled.finished_at is not None
    assert cancelled.failure_reason is None
    assert store.transitions(job.id)[1].reason == "cancelled by a user"


def test_an_illegal_event_raises_and_changes_nothing(store: JobStore) -> None:
    job = new(store)
    store.apply(job.id, JobEvent.RUN)
    done = store.apply(job.id, JobEvent.SUCCEED)
    history = store.transitions(job.id)
    with pytest.raises(IllegalTransitionError, match="a SUCCEEDED job cannot run"):
        store.apply(job.id, JobEvent.RUN)
    with pytest.raises(IllegalTransitionError, match="a SUCCEEDED job cannot fail"):
        store.apply(job.id, JobEvent.FAIL, "late")
    assert store.get(job.id) == done
    assert store.transitions(job.id) == history
    queued = new(store)
    with pytest.raises(IllegalTransitionError, match="a QUEUED job cannot recover"):
        store.apply(queued.id, JobEvent.RECOVER)
    assert store.get(queued.id) == queued
    assert len(store.transitions(queued.id)) == 1


# -- progress ----------------------------------------------------------------------------


def test_add_progress_stores_metrics_and_what_they_change(store: JobStore) -> None:
    job = new(store)
    tuner = TUNER
    stored = store.add_progress(
        job.id,
        Progress(
            cursor=3,
            metrics=[step(1, 10, loss=2.0), step(2, 20, loss=1.5)],
            step=20,
            total_steps=100,
            latest=LatestMetrics(loss=1.5, step=20),
            tuner=tuner,
            attempts=1,
        ),
    )
    assert (stored.cursor, stored.step, stored.total_steps) == (3, 20, 100)
    assert stored.latest == LatestMetrics(loss=1.5, step=20)
    assert stored.tuner == tuner
    assert stored.attempts == 1
    assert store.get(job.id) == stored
    later = store.add_progress(
        job.id,
        Progress(
            cursor=4,
            metrics=[Metric(seq=3, kind="eval", step=20, at=1.8e9, values={"test_accuracy": 0.5})],
            latest=LatestMetrics(test_accuracy=0.5),
        ),
    )
    # What a batch does not say stays as it was; latest metrics merge.
    assert (later.cursor, later.step, later.total_steps, later.attempts) == (4, 20, 100, 1)
    assert later.latest == LatestMetrics(loss=1.5, step=20, test_accuracy=0.5)
    assert later.latest.numbers() == {"loss": 1.5, "step": 20, "test_accuracy": 0.5}
    assert later.tuner == tuner
    assert later.state is JobState.QUEUED  # progress never moves the state
    assert [m.seq for m in store.metrics(job.id)] == [1, 2, 3]


def test_add_progress_stores_the_sweep_view(store: JobStore) -> None:
    job = new(store)
    stored = store.add_progress(job.id, Progress(cursor=2, step=1, total_steps=2, sweep=SWEEP))
    assert (stored.sweep, stored.step, stored.total_steps) == (SWEEP, 1, 2)
    assert store.get(job.id) == stored
    later = store.add_progress(job.id, Progress(cursor=3, latest=LatestMetrics(loss=1.0)))
    assert later.sweep == SWEEP  # a batch without sweep records keeps it
    best = TrialOutcome(trial_id="t_00000", state=TrialState.SUCCEEDED, value=0.9)
    ended = SWEEP.model_copy(update={"best": best, "best_spec": {"name": "best"}})
    assert store.add_progress(job.id, Progress(cursor=4, sweep=ended)).sweep == ended
    assert store.get(job.id).sweep == ended


def test_a_stored_sweep_reads_as_its_state_and_an_odd_one_as_none(
    store: JobStore, caplog: pytest.LogCaptureFixture
) -> None:
    """What the column held before the state was typed (a trial without value, checkpoint or
    run; no mode) reads as the state; a value that does not read leaves the job listed."""
    kept, odd = new(store, "kept"), new(store, "odd")
    before = {
        "trials_planned": 2,
        "metric": "test_loss",
        "space": {},
        "trials": {"t_1": {"state": "FAILED", "params": {}, "metrics": {}, "error": "nan"}},
    }
    with store.engine.begin() as connection:
        connection.execute(update(JobRow).where(JobRow.id == kept.id).values(sweep=before))
        connection.execute(
            update(JobRow).where(JobRow.id == odd.id).values(sweep={"trials": "none"})
        )
    state = store.get(kept.id).sweep
    assert state is not None
    assert (state.mode, state.trials_ended, state.trials["t_1"].error) == ("min", 1, "nan")
    with caplog.at_level("WARNING"):
        assert store.get(odd.id).sweep is None
    assert f"job {odd.id}: the stored sweep state is unreadable" in caplog.text
    assert {job.id for job in store.page()[0]} == {kept.id, odd.id}


def test_add_progress_is_idempotent_on_repeated_seqs(store: JobStore) -> None:
    job = new(store)
    first = Progress(cursor=3, metrics=[step(0, 1), step(1, 2), step(2, 3)], step=3)
    store.add_progress(job.id, first)
    store.add_progress(job.id, first)  # the same read again
    overlapping = Progress(cursor=5, metrics=[step(2, 3), step(3, 4), step(4, 5)], step=5)
    stored = store.add_progress(job.id, overlapping)
    assert stored.cursor == 5
    points = store.metrics(job.id)
    assert [(m.seq, m.step) for m in points] == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
    assert rows(store, MetricRow.job_id, job.id) == 5


def test_an_older_cursor_changes_nothing(store: JobStore) -> None:
    job = new(store)
    newer = store.add_progress(
        job.id, Progress(cursor=5, metrics=[step(4, 50)], step=50, latest=LatestMetrics(loss=1.0))
    )
    stale = store.add_progress(
        job.id,
        Progress(
            cursor=3,
            metrics=[step(2, 30)],
            step=30,
            total_steps=7,
            latest=LatestMetrics(loss=9.0),
            tuner=TUNER,
            attempts=4,
        ),
    )
    assert stale == newer
    assert store.get(job.id) == newer
    assert [m.seq for m in store.metrics(job.id)] == [4]


def test_metrics_filter_by_kind_and_since(store: JobStore) -> None:
    job = new(store)
    evals = [
        Metric(seq=seq, kind="eval", step=seq, at=1.8e9, values={"test_accuracy": seq / 10})
        for seq in (2, 5)
    ]
    steps = [step(seq, seq, loss=1.0 / (seq + 1)) for seq in (0, 1, 3, 4, 6)]
    store.add_progress(job.id, Progress(cursor=7, metrics=steps + evals))
    everything = store.metrics(job.id)
    assert [m.seq for m in everything] == [0, 1, 2, 3, 4, 5, 6]
    assert everything[2] == evals[0]
    assert everything[0] == Metric(seq=0, kind="step", step=0, at=1.8e9, values={"loss": 1.0})
    assert [m.seq for m in store.metrics(job.id, kinds=["eval"])] == [2, 5]
    assert [m.seq for m in store.metrics(job.id, kinds=["step"])] == [0, 1, 3, 4, 6]
    assert [m.seq for m in store.metrics(job.id, kinds=["step", "eval"])] == list(range(7))
    assert [m.seq for m in store.metrics(job.id, kinds=["tuner"])] == []
    assert [m.seq for m in store.metrics(job.id, since=3)] == [3, 4, 5, 6]
    assert [m.seq for m in store.metrics(job.id, kinds=["step"], since=3)] == [3, 4, 6]
    assert [m.seq for m in store.metrics(job.id, since=7)] == []
    assert [m.seq for m in store.metrics(job.id, limit=2)] == [0, 1]
    assert [m.seq for m in store.metrics(job.id, since=2, limit=2)] == [2, 3]


def test_metrics_are_per_job(store: JobStore) -> None:
    a, b = new(store, "a"), new(store, "b")
    store.add_progress(a.id, Progress(cursor=2, metrics=[step(0, 1), step(1, 2)]))
    store.add_progress(b.id, Progress(cursor=1, metrics=[step(0, 7)]))
    assert [m.step for m in store.metrics(a.id)] == [1, 2]
    assert [m.step for m in store.metrics(b.id)] == [7]


# -- delete ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "events",
    [
        [],
        [JobEvent.PROFILE],
        [JobEvent.RUN],
        [JobEvent.RUN, JobEvent.RECOVER],
        [JobEvent.RUN, JobEvent.CANCEL],
    ],
    ids=["QUEUED", "PROFILING", "RUNNING", "RECOVERING", "CANCELLING"],
)
def test_only_a_finished_job_can_be_deleted(store: JobStore, events: list[JobEvent]) -> None:
    job = new(store)
    for event in events:
        job = store.apply(job.id, event)
    with pytest.raises(JobConflictError, match=f"job {job.id} is {job.state.value}; only finished"):
        store.delete(job.id)
    assert store.get(job.id) == job


@pytest.mark.parametrize(
    "events",
    [[JobEvent.RUN, JobEvent.SUCCEED], [JobEvent.FAIL], [JobEvent.CANCEL, JobEvent.CANCELLED]],
    ids=["SUCCEEDED", "FAILED", "CANCELLED"],
)
def test_delete_removes_a_finished_job_and_its_history(
    store: JobStore, events: list[JobEvent]
) -> None:
    job = new(store)
    kept = new(store, "kept")
    for stored in (job, kept):
        store.add_progress(stored.id, Progress(cursor=2, metrics=[step(0, 1), step(1, 2)]))
        store.apply(stored.id, JobEvent.RUN if events[0] is JobEvent.RUN else events[0])
    for event in events[1:]:
        store.apply(job.id, event)
    assert rows(store, TransitionRow.job_id, job.id) == len(events) + 1
    store.delete(job.id)
    with pytest.raises(JobNotFoundError):
        store.get(job.id)
    assert rows(store, JobRow.id, job.id) == 0
    assert rows(store, TransitionRow.job_id, job.id) == 0
    assert rows(store, MetricRow.job_id, job.id) == 0
    with pytest.raises(JobNotFoundError):
        store.delete(job.id)
    # The other job keeps everything.
    assert len(store.transitions(kept.id)) == 2
    assert len(store.metrics(kept.id)) == 2
    assert [j.id for j in store.page()[0]] == [kept.id]


# -- reopening ---------------------------------------------------------------------------


def test_everything_survives_closing_and_reopening(tmp_path: Path) -> None:
    first = JobStore(url(tmp_path))
    job, _ = first.create(spec("durable"), idempotency_key="k")
    first.set_submission(job.id, "kaisa-ray-sid")
    first.apply(job.id, JobEvent.RUN)
    first.add_progress(
        job.id,
        Progress(
            cursor=2,
            metrics=[step(0, 5, loss=1.0), step(1, 10, loss=0.5)],
            step=10,
            total_steps=20,
            latest=LatestMetrics(loss=0.5),
            tuner=TUNER,
            sweep=SWEEP,
            attempts=1,
        ),
    )
    done = first.apply(job.id, JobEvent.FAIL, "out of memory")
    history = first.transitions(job.id)
    points = first.metrics(job.id)
    first.close()

    second = JobStore(url(tmp_path))
    try:
        assert second.get(job.id) == done
        assert done.submission_id == "kaisa-ray-sid"
        assert done.failure_reason == "out of memory"
        assert done.tuner == TUNER
        assert done.sweep == SWEEP
        assert second.transitions(job.id) == history
        assert second.metrics(job.id) == points
        again, created = second.create(spec("durable"), idempotency_key="k")
        assert (again.id, created) == (job.id, False)
        with pytest.raises(JobConflictError):
            second.create(spec("other"), idempotency_key="k")
    finally:
        second.close()


def test_a_second_store_on_the_same_file_sees_the_writes(tmp_path: Path) -> None:
    writer, reader = JobStore(url(tmp_path)), JobStore(url(tmp_path))
    try:
        job = new(writer)
        writer.apply(job.id, JobEvent.RUN)
        assert reader.get(job.id).state is JobState.RUNNING
    finally:
        writer.close()
        reader.close()


def test_the_database_is_writable_and_uses_wal(store: JobStore) -> None:
    assert store.writable() is True
    with store.engine.connect() as connection:
        assert connection.scalar(text("PRAGMA journal_mode")) == "wal"
        assert connection.scalar(text("PRAGMA foreign_keys")) == 1


def test_a_store_creates_its_directory(tmp_path: Path) -> None:
    nested = tmp_path / "a" / "b"
    opened = JobStore(f"sqlite:///{nested / 'jobs.db'}")
    try:
        new(opened)
    finally:
        opened.close()
    assert (nested / "jobs.db").is_file()
    engine = create_engine(f"sqlite:///{nested / 'jobs.db'}")
    with engine.connect() as connection:
        assert connection.scalar(select(func.count()).select_from(JobRow)) == 1
    engine.dispose()
