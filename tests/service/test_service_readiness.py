"""``/readyz`` tells the truth, and a write that cannot happen answers 503 (issue 30), in
process: FastAPI's ``TestClient`` with the app's lifespan, a real SQLite file and
``FakeRunner`` in place of Ray. The database is locked by another process (BEGIN
EXCLUSIVE, held), and the full disk is a real 2 MB tmpfs (mounted where the tests run as
root; skipped elsewhere, with a check of the same path on a real disk below its threshold
that runs everywhere)."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.fake_runner import FakeRunner
from support.service_app import Service, spec, start


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    fake = FakeRunner()
    app, client = start(tmp_path, fake)
    with client:
        yield Service(app, client, fake)


HOLD_THE_LOCK = """
import sqlite3, sys
connection = sqlite3.connect(sys.argv[1], timeout=0, isolation_level=None)
connection.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.read()
connection.rollback()
"""
"""Another process holding the database's exclusive lock until its stdin closes."""


def heartbeat(database: Path) -> tuple[float, int]:
    with contextlib.closing(sqlite3.connect(database)) as connection:
        at, pid = connection.execute("SELECT at, pid FROM heartbeat WHERE id = 1").fetchone()
    return float(at), int(pid)


def test_readiness_writes_a_heartbeat_row_to_the_database(service: Service, tmp_path: Path) -> None:
    began = time.time()
    response = service.client.get("/readyz")
    assert response.status_code == 200, response.text
    assert response.json()["checks"] == {
        "ray": "ok",
        "database": "ok",
        "data_dir": "ok",
        "checkpoint_root": "ok",
    }
    at, pid = heartbeat(tmp_path / "jobs.db")
    assert at >= began
    assert pid == os.getpid()
    assert service.client.get("/readyz").status_code == 200
    assert heartbeat(tmp_path / "jobs.db")[0] >= at


def test_under_another_process_s_exclusive_lock_readiness_and_writes_answer_503(
    service: Service, tmp_path: Path
) -> None:
    """While another connection holds the database's exclusive lock: /readyz 503 saying the
    database cannot be written, and every POST (submit, cancel) 503 with Retry-After, not
    500; reads go on. Once it lets go, all is well again."""
    job = service.submit("before-the-lock")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_THE_LOCK, str(tmp_path / "jobs.db")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "locked"
        ready = service.client.get("/readyz")
        assert ready.status_code == 503, ready.text
        assert ready.headers["Retry-After"] == "5"
        assert ready.json()["checks"]["database"] == (
            "not writable: OperationalError: database is locked"
        )
        for path, body in (
            ("/v1/jobs", spec("during-the-lock")),
            (f"/v1/jobs/{job['id']}/cancel", None),
        ):
            refused = service.client.post(path, json=body)
            assert refused.status_code == 503, (path, refused.text)
            assert refused.headers["Retry-After"] == "5"
            detail = refused.json()["detail"]
            assert "database cannot be written now (database is locked)" in detail
            assert "nothing was changed" in detail
        assert service.client.get("/v1/jobs").status_code == 200  # reads go on (WAL)
    finally:
        holder.communicate("", timeout=30)  # its stdin closes: it lets go and exits
    assert holder.returncode == 0
    assert service.client.get("/readyz").status_code == 200
    assert service.client.post("/v1/jobs", json=spec("after-the-lock")).status_code == 201
    assert service.job(job["id"])["state"] == "QUEUED"  # the refused cancel changed nothing


def test_a_disk_below_the_free_space_floor_is_not_ready(tmp_path: Path) -> None:
    """The check compares the real free space of the data directory's disk with the floor
    (here above any disk's size, so that it fails everywhere) and names the fix."""
    _, client = start(tmp_path, FakeRunner(), min_free_bytes=2**60)
    with client:
        ready = client.get("/readyz")
    assert ready.status_code == 503
    checks = ready.json()["checks"]
    assert checks["database"] == "ok"
    assert f"on the disk of {tmp_path}, below 1.0EiB (--min-free-bytes)" in checks["data_dir"]


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}): needs root")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def test_on_a_full_tmpfs_readiness_and_writes_answer_503(tmp_path: Path) -> None:
    """The data directory on a 2 MB tmpfs, filled to the last byte: /readyz 503 (the disk
    below its floor, the heartbeat write refused), a submission 503 with Retry-After, not
    500. Space freed: ready again, and the submission goes through."""
    with tmpfs(tmp_path / "small", "2m") as data:
        _, client = start(data, FakeRunner(), min_free_bytes=512 * 1024)
        with client:
            assert client.post("/v1/jobs", json=spec("fits")).status_code == 201
            assert client.get("/readyz").status_code == 200
            filler = data / "filler"
            with filler.open("wb", buffering=0) as out, contextlib.suppress(OSError):
                while True:  # until ENOSPC
                    out.write(b"\0" * 4096)
            ready = client.get("/readyz")
            assert ready.status_code == 503, ready.text
            checks = ready.json()["checks"]
            assert "below 512.0KiB (--min-free-bytes)" in checks["data_dir"], checks
            submitted = [client.post("/v1/jobs", json=spec(f"full-{i}")) for i in range(20)]
            statuses = {r.status_code for r in submitted}
            assert 500 not in statuses
            refused = [r for r in submitted if r.status_code == 503]
            assert refused, statuses  # the disk refuses the database's pages
            assert refused[0].headers["Retry-After"] == "5"
            assert "database or disk is full" in refused[0].json()["detail"]
            filler.unlink()
            assert client.get("/readyz").status_code == 200
            assert client.post("/v1/jobs", json=spec("after")).status_code == 201
