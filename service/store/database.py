"""The job database's file and engine: where a SQLite URL points, the locks that make the
service its only writer, the file's mode, SQLite's settings and the schema's migrations
(Alembic). ``service.store.repository`` reads and writes the jobs through it."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, event, make_url

from service.errors import DatabaseInUseError

__all__ = ["migrate", "private_file", "sole_writer", "sqlite_file", "sqlite_pragmas"]

MIGRATIONS = Path(__file__).parents[1] / "migrations"
logger = logging.getLogger(__name__)

BUSY_TIMEOUT_MS = 2000
"""How long a write waits for another process's lock on the SQLite file before it fails
(and the request answers 503): the service is the file's only writer, its own writes are
serialised by the store's lock, so only an outside process (a backup, a sqlite3 shell) or
a checkpoint of the WAL ever holds it."""


def sqlite_pragmas(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(connection: Any, _record: Any) -> None:
        cursor = connection.cursor()
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA journal_mode=WAL")  # readers never wait for the writer
        cursor.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()


def migrate(engine: Engine) -> None:
    """Bring the database's schema to the newest migration (Alembic ``upgrade head``)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "head")


def sqlite_file(url: str) -> Path | None:
    """The file a SQLite URL opens, resolved as SQLAlchemy resolves it (any driver:
    ``sqlite:///``, ``sqlite+pysqlite:///``, ``sqlite+aiosqlite:///``; relative to the working
    directory; symlinks followed); None for an in-memory database or another backend."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return None
    database = parsed.database or ""
    if database in ("", ":memory:") or parsed.query.get("mode") == "memory":
        return None
    if database.startswith("file:"):  # a SQLite URI filename (uri=true)
        database = database.removeprefix("file:").split("?", 1)[0]
        if not database or database == ":memory:":
            return None
    return Path(database).expanduser().resolve()


@contextmanager
def _flock(lock: Path, refusal: str) -> Iterator[None]:
    """Hold an exclusive lock on ``lock`` while the block runs (the kernel drops it when the
    process dies); another holder: ``DatabaseInUseError(refusal.format(pid=...))``."""
    lock.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with os.fdopen(os.open(lock, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600), "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            raise DatabaseInUseError(refusal.format(pid=holder)) from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextmanager
def sole_writer(url: str, data_dir: Path | None = None) -> Iterator[None]:
    """Hold exclusive locks on the service's data directory (``<data_dir>/service.lock``:
    its embedded Ray head's ``head.json``, logs and runs) and beside a SQLite database
    (``<file>.lock``, the file SQLAlchemy opens) while the block runs, so that a second
    service on either refuses to start: the service is the database's only writer (its
    follower submits each queued job once, and its read cache trusts that no one else
    writes), and one data directory holds one service's cluster. The kernel drops the locks
    when the process dies, so a killed service never blocks its restart. Other databases are
    not locked: run one service per database."""
    with contextlib.ExitStack() as stack:
        if data_dir is not None:
            where = Path(data_dir).expanduser().resolve()
            stack.enter_context(
                _flock(
                    where / "service.lock",
                    f"another kaisa-ray service (pid {{pid}}) uses the data directory {where}; "
                    "stop it, or give this one its own --data-dir",
                )
            )
        path = sqlite_file(url)
        if path is not None:
            stack.enter_context(
                _flock(
                    path.with_name(path.name + ".lock"),
                    f"another kaisa-ray service (pid {{pid}}) uses the database {path}; stop "
                    "it, or give this one its own --data-dir or --database-url",
                )
            )
        yield


def private_file(path: Path) -> None:
    """Create the database file readable by its owner only (0600; its folder, when made here,
    0700) before SQLite opens it: jobs' specs and failure reasons are the service's users'
    business. SQLite gives the WAL and shared-memory files the database file's mode. An
    existing file keeps its mode, but a warning says when others can read it."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            logger.warning(
                "the job database %s is readable by others (mode %o): chmod 600 it", path, mode
            )
