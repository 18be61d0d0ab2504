"""Alembic's environment for the job store: run by ``service.store.database.migrate`` (the
service does it at start-up) or by ``alembic`` with ``-x url=...``."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, create_engine

from service.store.rows import Base

config = context.config
target_metadata = Base.metadata


def run() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _migrate(connection)
        return
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option(
        "sqlalchemy.url"
    )
    if not url:
        raise SystemExit("give the database: alembic -x url=sqlite:///path/to/jobs.db upgrade head")
    engine = create_engine(url)
    with engine.connect() as conn:
        _migrate(conn)
    engine.dispose()


def _migrate(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=True,  # SQLite changes tables by copying them
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


run()
