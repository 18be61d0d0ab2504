"""A graceful restart resumes (issue 30), with real parts: ``kaisa-ray serve`` with its
embedded Ray head, a SQLite file, a training job checkpointing to the data directory. A
SIGTERM while the job trains; the next ``kaisa-ray serve`` on the same data directory
resumes it from its latest checkpoint to the end, its step records going on with no step
twice and none missing; both lives' logs kept in the service's copy after Ray's has gone
with the heads. The same in process, with a fake Ray: ``test_service_resume.py``."""

from __future__ import annotations

import contextlib
import signal
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.polling import wait_for
from support.service_process import ServiceProcess, start_service

from service.head import RayHead
from service.runner import submission_id

pytestmark = [pytest.mark.slow, pytest.mark.ray]

TOKEN = "restart-token-0123456789"
STEPS, EVERY = 1500, 100


def job_spec() -> dict[str, Any]:
    return {
        "name": "resumed",
        "model": {"name": "lenet"},
        "dataset": {"name": "synthetic", "batch_size": 32, "limit": 1024},
        "kfac": "off",
        "scaling": {"workers": 1},
        "stop": {"max_steps": STEPS},
        "eval_every": EVERY,
        "checkpoint": {"every_steps": EVERY, "keep": 2},
    }


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    where = tmp_path / "service"
    yield where
    head = RayHead.load(where / "ray" / "head.json")  # a head a failed test left running
    if head is not None and head.alive():
        head.stop(grace_s=1)


def serve(data_dir: Path) -> ServiceProcess:
    env = {"KAISA_RAY_EMBEDDED_CPUS": "2", "KAISA_RAY_STATUS_INTERVAL_S": "0.5"}
    return start_service(data_dir, token=TOKEN, env=env, timeout_s=180)


def sigterm(service: ServiceProcess) -> float:
    began = time.monotonic()
    service.process.send_signal(signal.SIGTERM)
    service.process.wait(timeout=60)
    assert service.process.returncode == 0, service.log.read_text()[-3000:]
    return time.monotonic() - began


@pytest.mark.timeout(900)
def test_a_job_running_at_sigterm_finishes_after_the_restart_from_its_checkpoint(
    data_dir: Path,
) -> None:
    first = serve(data_dir)
    try:
        client = first.client()
        job = client.submit(job_spec())
        trained = wait_for(
            lambda: (
                (j := client.job(job["id"]))["metrics"].get("checkpoint_step", 0) >= 2 * EVERY and j
            ),
            "two checkpoints",
            timeout_s=300,
        )
        assert trained["state"] == "RUNNING"
        client.close()
    finally:
        stopped_in = sigterm(first)
    stopped_at = time.time()
    print(f"SIGTERM with the job at step {trained['progress']['step']}: {stopped_in:.1f} s")
    with contextlib.closing(sqlite3.connect(data_dir / "jobs.db")) as database:
        state, reason = database.execute(
            "SELECT state, failure_reason FROM jobs WHERE id = ?", (job["id"],)
        ).fetchone()
        interrupted_at_step = database.execute(
            "SELECT max(step) FROM metrics WHERE job_id = ? AND kind = 'step'", (job["id"],)
        ).fetchone()[0]
    assert (state, reason) == ("INTERRUPTED", None)
    assert (data_dir / "logs" / f"{job['id']}.log").is_file()  # kept before the head went

    second = serve(data_dir)
    try:
        client = second.client()
        done = wait_for(
            lambda: (j := client.job(job["id"]))["state"] in ("SUCCEEDED", "FAILED") and j,
            "the resumed job to end",
            timeout_s=400,
        )
        assert done["state"] == "SUCCEEDED", done["failure_reason"]
        assert done["progress"]["step"] == STEPS
        history = [(t["from_state"], t["to_state"]) for t in done["transitions"]]
        assert ("RUNNING", "INTERRUPTED") in history
        assert ("INTERRUPTED", "QUEUED") in history
        assert "FAILED" not in str(history)
        points = client.metrics(job["id"], kinds=["step"])["points"]
        client.close()
    finally:
        sigterm(second)
    steps = [p["step"] for p in points]
    assert steps == list(range(10, STEPS + 1, 10))  # no step twice, none missing
    # The first life's records up to its checkpoint were kept, the rest done again: a
    # resume from the checkpoint, not from the start.
    before = [p["step"] for p in points if time_of(p) < stopped_at]
    after = [p["step"] for p in points if time_of(p) > stopped_at]
    assert before == steps[: len(before)]
    assert before[-1] % EVERY == 0  # ended at a checkpoint
    assert 2 * EVERY <= before[-1] <= interrupted_at_step
    assert after[0] == before[-1] + 10

    # Both lives' logs are kept in the service's copy, in order, past Ray's (which went with
    # each head); that a later start serves this copy is shown with a fake Ray in
    # test_service_resume.py.
    log = (data_dir / "logs" / f"{job['id']}.log").read_text()
    first_life, second_life = submission_id(job["id"]), submission_id(job["id"], 1)
    assert f"Ray Job {first_life} -----" in log
    assert f"Ray Job {second_life} -----" in log
    assert log.index(first_life) < log.index(second_life)
    assert f"finished at step {STEPS}" in log


def time_of(point: dict[str, Any]) -> float:
    from datetime import datetime

    return datetime.fromisoformat(point["at"]).timestamp()
