"""A job's history: its metrics, its event stream and every job's, and its log.

The job service's HTTP API (``service.app``) in-process: FastAPI's ``TestClient`` with the
app's lifespan (store on a SQLite file, the follower thread) and ``FakeRunner`` in place of
Ray, so each test scripts what Ray and the progress sink say and watches the API follow."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest
from support.service_app import TUNER, Service, events, spec

from kaisa_train.records import (
    TunerRecord,
)
from service.runner import RayJobStatus, submission_id

if TYPE_CHECKING:
    pass

from support.service_app import fields

# -- GET /v1/jobs/{id}/metrics -----------------------------------------------------------


def test_the_metric_history(service: Service) -> None:
    job = service.running()  # records 0 (worker) and 1 (start)
    service.fake.push(
        job["id"],
        {"kind": "step", "step": 10, "loss": 2.0},  # 2
        {"kind": "checkpoint", "step": 10},  # 3
        {"kind": "step", "step": 20, "loss": 1.0},  # 4
        {"kind": "eval", "step": 20, "test_accuracy": 0.5},  # 5
        {"kind": "step", "step": 30, "loss": 0.5},  # 6
    )
    service.wait(job["id"], "step 30", lambda j: j["progress"]["step"] == 30)
    url = f"/v1/jobs/{job['id']}/metrics"

    def read(query: str = "") -> dict[str, Any]:
        response = service.client.get(url + query)
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    everything = read()
    assert everything["job_id"] == job["id"]
    points = everything["points"]
    assert [(p["seq"], p["kind"], p["step"]) for p in points] == [
        (2, "step", 10),
        (4, "step", 20),
        (5, "eval", 20),
        (6, "step", 30),
    ]
    assert points[0]["values"] == {"step": 10, "loss": 2.0}
    assert points[2]["values"] == {"step": 20, "test_accuracy": 0.5}
    assert points[0]["at"] == "2027-01-15T08:00:00Z"
    assert everything["next_since"] == 7

    evals = read("?kind=eval")
    assert [p["seq"] for p in evals["points"]] == [5]
    assert evals["next_since"] == 6
    steps = read("?kind=step")
    assert [p["seq"] for p in steps["points"]] == [2, 4, 6]
    both = read("?kind=step&kind=eval")
    assert [p["seq"] for p in both["points"]] == [2, 4, 5, 6]
    newer = read("?since=4")
    assert [p["seq"] for p in newer["points"]] == [4, 5, 6]
    assert newer["next_since"] == 7
    nothing_new = read(f"?since={everything['next_since']}")
    assert nothing_new == {"job_id": job["id"], "points": [], "next_since": 7}
    page = read("?limit=2")
    assert ([p["seq"] for p in page["points"]], page["next_since"]) == ([2, 4], 5)
    rest = read(f"?since={page['next_since']}")
    assert [p["seq"] for p in rest["points"]] == [5, 6]
    unknown = service.client.get(f"/v1/jobs/{job['id']}/metrics?kind=steps")
    assert unknown.status_code == 422
    assert [p["field"] for p in unknown.json()["problems"]] == ["query.kind.0"]


def test_metrics_of_an_unknown_job_is_404(service: Service) -> None:
    response = service.client.get("/v1/jobs/no-such-job/metrics")
    assert response.status_code == 404
    assert response.json()["detail"].startswith("no job 'no-such-job'")


def test_metrics_parameters_are_checked(service: Service) -> None:
    job = service.submit()
    response = service.client.get(f"/v1/jobs/{job['id']}/metrics?since=-1&limit=0")
    assert fields(response) == ["query.since", "query.limit"]


# -- GET /v1/jobs/{id}/events ------------------------------------------------------------


@pytest.mark.timeout(60)
def test_events_follow_a_job_until_it_finishes(service: Service) -> None:
    job = service.submitted()
    received: list[tuple[str, Any]] = []
    with service.client.stream("GET", f"/v1/jobs/{job['id']}/events") as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        for kind, data in events(stream.iter_lines()):
            received.append((kind, json.loads(data)))
            if len(received) == 1:  # subscribed: now the job runs and ends
                service.fake.push(
                    job["id"],
                    {"kind": "worker", "rank": 0},
                    {"kind": "start", "total_steps": 30},
                    TUNER.wire(),
                    {"kind": "step", "step": 10, "loss": 2.0},
                    {"kind": "step", "step": 20, "loss": 1.0},
                    {"kind": "eval", "step": 20, "test_accuracy": 0.5},
                )
                service.fake.finish(job["id"], RayJobStatus.SUCCEEDED)
    # The stream ended by itself, after the job finished.
    first_kind, first = received[0]
    assert first_kind == "state"
    assert (first["id"], first["state"]) == (job["id"], "QUEUED")
    last_kind, last = received[-1]
    assert last_kind == "state"
    assert last["state"] == "SUCCEEDED"
    assert last["progress"] == {"step": 20, "total": 30, "percent": 100.0, "target_met": False}
    assert last["finished_at"] is not None
    assert [kind for kind, _ in received if kind != "state"] == [
        "tuner",
        "progress",
        "progress",
        "eval",
    ]
    # Each record's event carries the record itself: its kind, its fields, the sink's time;
    # a metric's also its place in the history (the page merges the two by it: a point both
    # read and streamed is drawn once).
    history = service.client.get(f"/v1/jobs/{job['id']}/metrics").json()["points"]
    seqs = {(p["kind"], p["step"]): p["seq"] for p in history}
    assert [data for kind, data in received if kind == "progress"] == [
        {"kind": "step", "step": 10, "loss": 2.0, "time": 1.8e9, "seq": seqs["step", 10]},
        {"kind": "step", "step": 20, "loss": 1.0, "time": 1.8e9, "seq": seqs["step", 20]},
    ]
    assert [data for kind, data in received if kind == "eval"] == [
        {"kind": "eval", "step": 20, "test_accuracy": 0.5, "time": 1.8e9, "seq": seqs["eval", 20]}
    ]
    assert len(set(seqs.values())) == 3
    (tuner,) = [data for kind, data in received if kind == "tuner"]
    assert TunerRecord.model_validate(tuner) == TUNER.model_copy(update={"time": 1.8e9})
    states = [data["state"] for kind, data in received if kind == "state"]
    assert states[-1] == "SUCCEEDED"
    assert "SUCCEEDED" not in states[:-1]
    assert set(states) <= {"QUEUED", "RUNNING", "SUCCEEDED"}


@pytest.mark.timeout(60)
def test_events_of_a_finished_job_are_its_state(service: Service) -> None:
    job = service.running()
    service.fake.finish(job["id"], RayJobStatus.FAILED, "boom")
    service.wait_state(job["id"], "FAILED")
    with service.client.stream("GET", f"/v1/jobs/{job['id']}/events") as stream:
        received = [(kind, json.loads(data)) for kind, data in events(stream.iter_lines())]
    assert [(kind, data["state"]) for kind, data in received] == [("state", "FAILED")]
    assert received[0][1]["failure_reason"] == "the Ray Job failed: boom"


@pytest.mark.timeout(60)
def test_events_of_a_cancelled_job_end_with_cancelled(service: Service) -> None:
    job = service.running()
    received: list[tuple[str, Any]] = []
    with service.client.stream("GET", f"/v1/jobs/{job['id']}/events") as stream:
        for kind, data in events(stream.iter_lines()):
            received.append((kind, json.loads(data)))
            if len(received) == 1:
                assert service.client.post(f"/v1/jobs/{job['id']}/cancel").status_code == 200
    states = [data["state"] for kind, data in received if kind == "state"]
    assert states[0] == "RUNNING"
    assert states[-1] == "CANCELLED"


def test_events_of_an_unknown_job_is_404(service: Service) -> None:
    response = service.client.get("/v1/jobs/no-such-job/events")
    assert response.status_code == 404
    assert response.headers["content-type"] == "application/json"
    assert response.json()["detail"].startswith("no job 'no-such-job'")


# -- GET /v1/events (every job) ----------------------------------------------------------


@pytest.mark.timeout(60)
def test_the_stream_of_every_job_follows_two_jobs_and_a_deletion(service: Service) -> None:
    first = service.running("first")
    received: list[tuple[str, Any]] = []
    with service.client.stream("GET", "/v1/events") as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        for kind, data in events(stream.iter_lines()):
            received.append((kind, json.loads(data)))
            if kind == "ready":  # subscribed: now things happen
                second = service.client.post("/v1/jobs", json=spec("second")).json()
                service.fake.push(first["id"], {"kind": "step", "step": 10, "loss": 2.0})
                service.fake.push(first["id"], {"kind": "eval", "step": 10, "test_accuracy": 0.4})
                service.fake.finish(first["id"], RayJobStatus.SUCCEEDED)
            if kind == "state" and json.loads(data)["state"] == "SUCCEEDED":
                assert service.client.delete(f"/v1/jobs/{first['id']}").status_code == 204
            if kind == "deleted":
                break
    assert received[0] == ("ready", {"subscribed": True})
    ids = {data.get("id") or data.get("job_id") for _, data in received[1:]}
    assert ids == {first["id"], second["id"]}
    seen = [(k, {f: v for f, v in d.items() if f != "seq"}) for k, d in received]
    step = {"job_id": first["id"], "kind": "step", "step": 10, "loss": 2.0, "time": 1.8e9}
    assert ("progress", step) in seen
    evaluated = {"job_id": first["id"], "kind": "eval", "step": 10, "test_accuracy": 0.4}
    assert ("eval", {**evaluated, "time": 1.8e9}) in seen
    states = [(d["id"], d["state"]) for k, d in received if k == "state"]
    assert (second["id"], "QUEUED") in states  # a whole JobView, as GET /v1/jobs/{id} has it
    assert states.index((first["id"], "SUCCEEDED")) > 0
    assert received[-1] == ("deleted", {"job_id": first["id"], "id": first["id"]})


def test_the_stream_of_every_job_needs_the_token(service: Service) -> None:
    response = service.client.get("/v1/events", headers={"Authorization": "Bearer wrong"})
    assert response.status_code == 401


# -- GET /v1/jobs/{id}/logs --------------------------------------------------------------


def test_logs_come_from_ray(service: Service) -> None:
    job = service.submitted()
    response = service.client.get(f"/v1/jobs/{job['id']}/logs")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert response.text == f"log of {submission_id(job['id'])}\n"


def test_logs_are_empty_before_the_job_reached_ray(service: Service) -> None:
    service.hold_submissions()
    job = service.submit()
    response = service.client.get(f"/v1/jobs/{job['id']}/logs")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    assert response.text == ""


def test_logs_when_ray_cannot_answer_are_503(service: Service) -> None:
    job = service.submitted()
    service.fake.fail_logs = ConnectionError("connection refused")
    response = service.client.get(f"/v1/jobs/{job['id']}/logs")
    assert response.status_code == 503
    assert response.json() == {"detail": "cannot read the job's log from Ray: connection refused"}


def test_logs_of_an_unknown_job_is_404(service: Service) -> None:
    response = service.client.get("/v1/jobs/no-such-job/logs")
    assert response.status_code == 404
    assert response.json()["detail"].startswith("no job 'no-such-job'")
