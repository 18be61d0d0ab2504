"""What ``/readyz`` checks, and what a request that cannot write answers.

Ready means the service can do its work now: Ray's job server answers, the jobs' database
takes a real write (``JobStore.writable``: the heartbeat row, committed to the file as a job's
changes are), and the disks it writes to (the data directory: database, logs, the embedded
head; the checkpoint root when it is a local folder) have at least ``min_free_bytes`` free.
A write that fails anyway (another process holds the database's lock, the disk filled up)
answers 503 with ``Retry-After``, never 500: it is the service's condition, not a bug, and
it passes.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from pydantic import ByteSize

from service.runtime import Runtime
from service.settings import Settings

__all__ = ["RETRY_AFTER_S", "checks", "database_unavailable", "disks"]

RETRY_AFTER_S = 5
"""What a 503 asks a client to wait: about one readiness probe's period."""

DiskUsage = Callable[[Path], int]


def _free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def disks(settings: Settings) -> dict[str, Path]:
    """The local folders the service and its jobs write to, by what they hold."""
    found = {"data_dir": settings.data_dir}
    storage = settings.storage
    if storage is not None and "://" not in storage:
        found["checkpoint_root"] = Path(storage)
    return found


def _existing(path: Path) -> Path:
    """``path``, or its nearest existing parent (a checkpoint root not made yet)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def checks(runtime: Runtime, free_bytes: DiskUsage = _free_bytes) -> dict[str, str]:
    """Each check's verdict: ``ok``, or what is wrong and what to do."""
    settings = runtime.settings
    found = {"ray": "ok", "database": "ok"}
    if not runtime.jobs.runner.reachable():
        found["ray"] = "unreachable"
    try:
        runtime.store.writable()
    except Exception as err:
        found["database"] = f"not writable: {type(err).__name__}: {_cause(err)}"
    floor = settings.min_free_bytes
    for name, path in disks(settings).items():
        try:
            free = free_bytes(_existing(path))
        except OSError as err:
            found[name] = f"cannot read the free space of {path}: {err}"
            continue
        found[name] = (
            "ok"
            if free >= floor
            else f"{ByteSize(free).human_readable()} free on the disk of {path}, below "
            f"{ByteSize(floor).human_readable()} (--min-free-bytes): free space there"
        )
    return found


def _cause(err: BaseException) -> str:
    """The database driver's own words (SQLAlchemy's message repeats the statement)."""
    original = getattr(err, "orig", None)
    return str(original if original is not None else err).splitlines()[0][:200]


def database_unavailable(err: BaseException) -> str:
    """What a request that could not write answers (503)."""
    return (
        f"the job database cannot be written now ({_cause(err)}); nothing was changed: retry "
        f"in {RETRY_AFTER_S} s (GET /readyz says when the service is ready again)"
    )
