"""The job store's tables (SQLAlchemy 2). Their schema is created and changed by the Alembic
migrations in ``service/migrations``; a test checks that the two agree."""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class JobRow(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(16), index=True)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    idempotency_key: Mapped[str | None] = mapped_column(String(200), unique=True)
    submission_id: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[float] = mapped_column(Float, index=True)
    updated_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)
    failure_reason: Mapped[str | None] = mapped_column(Text)
    step: Mapped[int] = mapped_column(Integer, default=0)
    total_steps: Mapped[int | None] = mapped_column(Integer)
    latest: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    tuner: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    sweep: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # a sweep job's trials (0002)
    cursor: Mapped[int] = mapped_column(Integer, default=0)  # next progress-sink record to read
    attempts: Mapped[int] = mapped_column(Integer, default=0)  # worker-group starts seen
    # 0003: how often a graceful restart resumed it; the number its records start at in this
    # life (the progress sink numbers a resumed run from 0 again); what admission counts.
    resumes: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    seq_base: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    resources: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class TransitionRow(Base):
    __tablename__ = "transitions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    from_state: Mapped[str] = mapped_column(String(16))
    to_state: Mapped[str] = mapped_column(String(16))
    event: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)
    at: Mapped[float] = mapped_column(Float)


class HeartbeatRow(Base):
    """One row, written by every readiness check: a real write to the jobs' database."""

    __tablename__ = "heartbeat"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    at: Mapped[float] = mapped_column(Float)
    pid: Mapped[int] = mapped_column(Integer)


class MetricRow(Base):
    __tablename__ = "metrics"
    __table_args__ = (
        UniqueConstraint("job_id", "seq", name="uq_metrics_job_seq"),
        Index("ix_metrics_job_kind", "job_id", "kind"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(Integer)  # the record's number in the progress sink
    kind: Mapped[str] = mapped_column(String(16))
    step: Mapped[int | None] = mapped_column(Integer)
    at: Mapped[float] = mapped_column(Float)
    values: Mapped[dict[str, Any]] = mapped_column(JSON)
