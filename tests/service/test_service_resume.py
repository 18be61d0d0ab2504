"""A graceful restart that resumes (``service.domain.restart``), in process: the app's lifespan on a
real SQLite file, ``FakeRunner`` in place of Ray, and a second app on the same data
directory as the service's next start. The same with the real ``kaisa-ray serve``, its
embedded Ray head and a training job is ``test_service_ops.py``."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest
from support import sweep_data as sweeps
from support.fake_runner import FakeRunner
from support.service_app import Service, start

from service.app import FOLLOWER_STOP_S, RAY_CLOSE_S
from service.domain.restart import READS_S
from service.runner import RayJobStatus, submission_id
from service.store.repository import JobStore


def steps(service: Service, job_id: str) -> list[tuple[int, float]]:
    points = service.client.get(f"/v1/jobs/{job_id}/metrics?kind=step").json()["points"]
    return [(p["step"], p["values"]["loss"]) for p in points]


def push_steps(fake: FakeRunner, job_id: str, first: int, last: int, loss: float) -> None:
    fake.push(
        job_id, *({"kind": "step", "step": s, "loss": loss} for s in range(first, last + 1, 10))
    )


def test_a_graceful_stop_interrupts_a_running_job_and_the_next_start_resumes_it(
    tmp_path: Path,
) -> None:
    """A job at step 70 with a checkpoint at 50 when the service stops: INTERRUPTED (not
    FAILED), its log kept; a queued job stays QUEUED, a cancelling one is CANCELLED. The next
    service on the database resumes it first, as a new Ray Job of the same run; the new life
    starts at the checkpoint, and the history goes on from step 50 with no step twice and
    none missing; its logs (both lives) are served after yet another restart."""
    first = FakeRunner()
    app, client = start(tmp_path, first, max_running=2, jobs_stop_with_service=True)
    with client:
        service = Service(app, client, first)
        job = service.running("resumed", total_steps=100)
        push_steps(first, job["id"], 10, 70, loss=1.0)
        first.push(job["id"], {"kind": "checkpoint", "step": 50, "path": "/runs/x/checkpoint_1"})
        service.wait(job["id"], "step 70", lambda j: j["progress"]["step"] == 70)
        doomed = service.submitted("cancelled-at-stop")
        first.stop_takes_effect = False
        assert client.post(f"/v1/jobs/{doomed['id']}/cancel").json()["state"] == "CANCELLING"
        waiting = service.submit("still-queued")  # max_running: two in Ray already
        assert service.job(waiting["id"])["queue_position"] == 1
    store = JobStore(f"sqlite:///{tmp_path / 'jobs.db'}")
    try:
        stopped = store.get(job["id"])
        assert stopped.state == "INTERRUPTED"
        assert stopped.failure_reason is None
        assert "resumes from its latest checkpoint" in (
            store.transitions(job["id"])[-1].reason or ""
        )
        assert store.get(doomed["id"]).state == "CANCELLED"
        assert store.get(waiting["id"]).state == "QUEUED"
    finally:
        store.close()
    kept = (tmp_path / "logs" / f"{job['id']}.log").read_text()
    assert f"log of {submission_id(job['id'])}" in kept

    second = FakeRunner()
    app, client = start(tmp_path, second, max_running=2, jobs_stop_with_service=True)
    with client:
        service = Service(app, client, second)
        resumed = service.wait(job["id"], "resubmitted", lambda j: j["submission_id"] is not None)
        assert resumed["submission_id"] == submission_id(job["id"], 1)
        assert resumed["state"] == "QUEUED"
        assert second.submitted[submission_id(job["id"], 1)]["name"] == "resumed"
        second.push(
            job["id"],
            {"kind": "worker", "rank": 0},
            {"kind": "start", "total_steps": 100, "from_step": 50, "resumed_from": "ckpt"},
        )
        service.wait_state(job["id"], "RUNNING")
        push_steps(second, job["id"], 60, 100, loss=0.5)
        service.wait(job["id"], "step 100", lambda j: j["progress"]["step"] == 100)
        second.finish(job["id"], RayJobStatus.SUCCEEDED)
        done = service.wait_state(job["id"], "SUCCEEDED")
        assert steps(service, job["id"]) == [
            *((s, 1.0) for s in range(10, 51, 10)),  # the first life, to its checkpoint
            *((s, 0.5) for s in range(60, 101, 10)),  # the second, from it
        ]
        history = [(t["from_state"], t["to_state"]) for t in done["transitions"]]
        assert ("RUNNING", "INTERRUPTED") in history
        assert ("INTERRUPTED", "QUEUED") in history
        assert history[-1] == ("RUNNING", "SUCCEEDED")
        assert "FAILED" not in str(history)

    third = FakeRunner()  # a Ray that knows none of it: the logs come from the service's copy
    third.fail_logs = RuntimeError("no such Ray Job")
    app, client = start(tmp_path, third)
    with client:
        response = client.get(f"/v1/jobs/{job['id']}/logs")
        assert response.status_code == 200, response.text
        log = response.text
    lives = [submission_id(job["id"]), submission_id(job["id"], 1)]
    assert [f"log of {sid}" in log for sid in lives] == [True, True]
    assert log.index(lives[0]) < log.index(lives[1])


def test_a_graceful_stop_ends_in_bounded_time_when_ray_answers_late(tmp_path: Path) -> None:
    """Ray under load answers the last reads of progress and logs (and its client's close)
    only after 20 s: the stop waits for none of them past its bounds, and the job is
    INTERRUPTED all the same (it resumes from its checkpoint; the records Ray did not give in
    time are re-run)."""
    fake = FakeRunner()
    app, client = start(tmp_path, fake, max_running=2, jobs_stop_with_service=True)
    with client:
        service = Service(app, client, fake)
        job = service.running("late", total_steps=100)
        push_steps(fake, job["id"], 10, 30, loss=1.0)
        service.wait(job["id"], "step 30", lambda j: j["progress"]["step"] == 30)
        fake.answer_after_s = 20.0
        began = time.monotonic()
    took = time.monotonic() - began
    assert READS_S + RAY_CLOSE_S + FOLLOWER_STOP_S == 12
    assert took < 14, took  # the bounds above, and what the stop itself takes
    store = JobStore(f"sqlite:///{tmp_path / 'jobs.db'}")
    try:
        assert store.get(job["id"]).state == "INTERRUPTED"
    finally:
        store.close()


def test_a_phase_of_the_stop_that_fails_skips_none_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The jobs' interruption raises (a store or a Ray that fails in a way nobody foresaw):
    the stop logs it by name and goes on: Ray's client is closed and the store too (with the
    embedded head, the head and every process it started are stopped the same way)."""

    def broken(*args: object) -> None:
        raise RuntimeError("an interruption that fails")

    monkeypatch.setattr("service.app.interrupt", broken)
    fake = FakeRunner()
    app, client = start(tmp_path, fake, jobs_stop_with_service=True)
    with caplog.at_level(logging.INFO, logger="service.app"), client:
        service = Service(app, client, fake)
        service.running("stopped", total_steps=100)
    assert fake.closed
    assert "shutdown: the jobs interrupted failed; going on" in caplog.text
    assert "an interruption that fails" in caplog.text
    last = caplog.records[-1].getMessage()
    assert "these phases failed: ['the jobs interrupted']" in last
    assert "Ray's client" in last
    assert "the store" in last
    assert "shutdown complete" not in caplog.text


def test_a_worker_group_restarted_from_its_checkpoint_records_no_step_twice(
    tmp_path: Path,
) -> None:
    """Within one Ray Job too (Ray Train restarts the worker group after a worker failure):
    the records past the checkpoint's step are replaced by the new attempt's, also when they
    arrive in the same batch as its start."""
    fake = FakeRunner()
    app, client = start(tmp_path, fake)
    with client:
        service = Service(app, client, fake)
        job = service.running("recovers", total_steps=60)
        push_steps(fake, job["id"], 10, 40, loss=1.0)
        service.wait(job["id"], "step 40", lambda j: j["progress"]["step"] == 40)
        records: list[dict[str, Any]] = [
            {"kind": "step", "step": 50, "loss": 1.0},  # the last of the failed attempt
            {"kind": "worker", "rank": 0},
            {"kind": "start", "total_steps": 60, "from_step": 20},
            *({"kind": "step", "step": s, "loss": 0.5} for s in (30, 40, 50, 60)),
        ]
        fake.push(job["id"], *records)
        service.wait(job["id"], "step 60", lambda j: j["progress"]["step"] == 60)
        assert steps(service, job["id"]) == [
            (10, 1.0), (20, 1.0), (30, 0.5), (40, 0.5), (50, 0.5), (60, 0.5)
        ]  # fmt: skip


def test_an_interrupted_sweep_starts_over(tmp_path: Path) -> None:
    """Ray Tune does not resume its trials here: the resumed sweep starts over, and its view
    of the stopped life's trials is dropped, not merged with the new life's."""
    first = FakeRunner()
    app, client = start(tmp_path, first, jobs_stop_with_service=True)
    with client:
        service = Service(app, client, first)
        body = sweeps.sweep_spec()
        job = service.submitted(body.pop("name"), **body)
        first.push(job["id"], *sweeps.FIRST)
        service.wait(job["id"], "its trials", lambda j: len(j["sweep"]["trials"]) == 2)
    second = FakeRunner()
    app, client = start(tmp_path, second, jobs_stop_with_service=True)
    with client:
        service = Service(app, client, second)
        resumed = service.wait(job["id"], "resubmitted", lambda j: j["submission_id"] is not None)
        assert resumed["sweep"]["trials"] == []  # the plan, from the spec; no trial yet
        assert resumed["progress"]["step"] == 0
        second.push(job["id"], sweeps.START)
        running = service.wait_state(job["id"], "RUNNING")
        assert running["sweep"]["trials"] == []
