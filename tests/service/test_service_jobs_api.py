"""The jobs API: submitting (``POST /v1/jobs``: bodies, limits, idempotency), listing, a job
and how it moves, cancelling and deleting.

The job service's HTTP API (``service.app``) in-process: FastAPI's ``TestClient`` with the
app's lifespan (store on a SQLite file, the follower thread) and ``FakeRunner`` in place of
Ray, so each test scripts what Ray and the progress sink say and watches the API follow."""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from sqlalchemy.exc import OperationalError
from support.fake_runner import FakeRunner
from support.polling import wait_for
from support.service_app import CANDIDATES, CHOSEN, TUNER, Service, spec, start

from kaisa_train.records import (
    TunerRecord,
)
from service.model.job_data import Job
from service.model.lifecycle import JobEvent
from service.runner import RayJobStatus, submission_id

if TYPE_CHECKING:
    pass

from support.service_app import fields, history

# -- POST /v1/jobs -----------------------------------------------------------------------


def test_a_submitted_job_is_queued_and_reaches_ray(service: Service) -> None:
    response = service.client.post("/v1/jobs", json=spec("first"))
    assert response.status_code == 201
    job = response.json()
    assert job["state"] == "QUEUED"
    assert job["name"] == "first"
    assert job["submission_id"] is None
    assert job["progress"] == {"step": 0, "total": None, "percent": None, "target_met": False}
    assert (job["metrics"], job["decision"], job["tuner"], job["failure_reason"]) == (
        {},
        None,
        None,
        None,
    )
    assert (job["started_at"], job["finished_at"]) == (None, None)
    # The stored spec is the validated one, with every default filled in.
    assert job["spec"]["model"] == {"name": "lenet", "params": {}}
    assert job["spec"]["kfac"]["damping"] == 0.1
    assert job["spec"]["stop"]["max_steps"] == 100
    sid = submission_id(job["id"])
    stored = service.wait(job["id"], "submitted", lambda j: j["submission_id"] == sid)
    assert service.fake.submitted == {sid: job["spec"]}
    assert stored["state"] == "QUEUED"
    assert stored["sweep"] is None  # an ordinary job
    assert history(stored) == [(None, "QUEUED", "submit")]
    assert shlex.split(service.fake.entrypoints[sid])[:2] == ["kaisa-ray", "train"]


def test_an_idempotency_key_makes_a_retry_return_the_same_job(service: Service) -> None:
    headers = {"Idempotency-Key": "retry-me"}
    first = service.client.post("/v1/jobs", json=spec("once"), headers=headers)
    again = service.client.post("/v1/jobs", json=spec("once"), headers=headers)
    assert (first.status_code, again.status_code) == (201, 201)
    assert again.json()["id"] == first.json()["id"]
    # The same spec spelled with its defaults is the same spec.
    explicit = spec("once", kfac={"damping": 0.1}, seed=0)
    third = service.client.post("/v1/jobs", json=explicit, headers=headers)
    assert third.json()["id"] == first.json()["id"]
    listed = service.client.get("/v1/jobs").json()
    assert [j["id"] for j in listed["jobs"]] == [first.json()["id"]]
    assert listed["total"] == 1
    sid = submission_id(first.json()["id"])
    service.wait(first.json()["id"], "submitted", lambda j: j["submission_id"] == sid)
    assert list(service.fake.submitted) == [sid]
    other = service.client.post("/v1/jobs", json=spec("once"), headers={"Idempotency-Key": "new"})
    assert other.status_code == 201
    assert other.json()["id"] != first.json()["id"]


def test_an_idempotency_key_reused_for_another_spec_is_a_conflict(service: Service) -> None:
    headers = {"Idempotency-Key": "k-1"}
    first = service.client.post("/v1/jobs", json=spec("a"), headers=headers)
    response = service.client.post("/v1/jobs", json=spec("b"), headers=headers)
    assert response.status_code == 409
    assert response.json() == {
        "detail": f"idempotency key 'k-1' was used for job {first.json()['id']} with a "
        "different spec; use a new key for a new job"
    }
    assert service.client.get("/v1/jobs").json()["total"] == 1


def test_an_idempotency_key_over_200_characters_is_invalid(service: Service) -> None:
    response = service.client.post("/v1/jobs", json=spec(), headers={"Idempotency-Key": "k" * 201})
    assert fields(response) == ["header.idempotency-key"]
    assert service.client.get("/v1/jobs").json()["total"] == 0


@pytest.fixture
def small_limit(tmp_path: Path) -> Iterator[Service]:
    fake = FakeRunner()
    app, client = start(tmp_path, fake, max_body_bytes=400)
    with client:
        yield Service(app, client, fake)


def too_large() -> bytes:
    body = json.dumps(spec("big", dataset={"name": "synthetic", "data_dir": "x" * 1000})).encode()
    assert len(body) > 400
    return body


LIMIT_DETAIL = (
    "request body over the limit of 400 bytes; a job spec is a few hundred bytes "
    "(the service's --max-body-bytes sets the limit)"
)


def test_a_body_within_the_limit_is_accepted(small_limit: Service) -> None:
    body = json.dumps(spec("small")).encode()
    assert len(body) < 400
    response = small_limit.client.post(
        "/v1/jobs", content=body, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 201


def test_a_body_over_the_limit_by_content_length_is_413(small_limit: Service) -> None:
    response = small_limit.client.post(
        "/v1/jobs", content=too_large(), headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 413
    assert response.json() == {"detail": LIMIT_DETAIL}
    assert small_limit.client.get("/v1/jobs").json()["total"] == 0


def test_a_streamed_body_over_the_limit_is_413(small_limit: Service) -> None:
    body = too_large()

    def chunks() -> Iterator[bytes]:
        for at in range(0, len(body), 100):
            yield body[at : at + 100]

    request = small_limit.client.build_request(
        "POST", "/v1/jobs", content=chunks(), headers={"Content-Type": "application/json"}
    )
    assert "Content-Length" not in request.headers
    assert request.headers["Transfer-Encoding"] == "chunked"
    response = small_limit.client.send(request)
    assert response.status_code == 413
    assert response.json() == {"detail": LIMIT_DETAIL}
    assert small_limit.client.get("/v1/jobs").json()["total"] == 0


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"bogus": 1}, "bogus"),
        ({"kfac": {"damping": -1}}, "kfac.damping"),
        ({"scaling": {"workers": 0}}, "scaling.workers"),
        ({"model": {"name": "no-such-model"}}, "model.name"),
        ({"memory_budget": "a lot"}, "memory_budget"),
        ({"stop": {}}, "stop"),
        ({"name": "bad name!"}, "name"),
    ],
)
def test_an_invalid_spec_names_the_field(
    service: Service, overrides: dict[str, Any], field: str
) -> None:
    response = service.client.post("/v1/jobs", json=spec(**overrides))
    assert fields(response) == [field]
    assert service.client.get("/v1/jobs").json()["total"] == 0


def test_every_problem_of_a_spec_is_named_at_once(service: Service) -> None:
    bad = spec(
        bogus=True,
        kfac={"damping": -1},
        scaling={"workers": 0},
        model={"name": "no-such-model"},
        memory_budget="a lot",
    )
    response = service.client.post("/v1/jobs", json=bad)
    assert sorted(fields(response)) == [
        "bogus",
        "kfac.damping",
        "memory_budget",
        "model.name",
        "scaling.workers",
    ]
    problems = {p["field"]: p["message"] for p in response.json()["problems"]}
    assert problems["bogus"].startswith(
        "unknown field 'bogus' in the job; the job's fields are name"
    )
    assert problems["bogus"].endswith("(every field: docs/jobspec.md)")
    assert problems["kfac.damping"] == "Input should be greater than 0"
    assert problems["model.name"].startswith("unknown model 'no-such-model'; choose one of")
    assert problems["memory_budget"].endswith("write a size such as '2GiB' or '512MB'")


def test_a_body_that_is_not_json_is_invalid(service: Service) -> None:
    response = service.client.post(
        "/v1/jobs", content=b'{"name": "x",', headers={"Content-Type": "application/json"}
    )
    assert fields(response) == ["body"]
    assert response.json()["problems"][0]["message"].startswith("not valid JSON: ")


@pytest.mark.parametrize("body", [[1, 2], "a job", 3, None], ids=["list", "str", "int", "null"])
def test_a_body_that_is_not_an_object_is_invalid(service: Service, body: Any) -> None:
    response = service.client.post(
        "/v1/jobs", content=json.dumps(body), headers={"Content-Type": "application/json"}
    )
    assert fields(response) == ["body"]


def test_a_missing_body_is_invalid(service: Service) -> None:
    response = service.client.post("/v1/jobs")
    assert fields(response) == ["body"]
    assert response.json()["problems"][0]["message"] == "Field required"


# -- GET /v1/jobs ------------------------------------------------------------------------


def test_list_filters_by_state_and_pages(service: Service) -> None:
    queued = service.submitted("queued")
    running = service.running("running")
    failed = service.submitted("failed")
    service.fake.finish(failed["id"], RayJobStatus.FAILED, "boom")
    service.wait_state(failed["id"], "FAILED")

    def listing(query: str) -> dict[str, Any]:
        response = service.client.get(f"/v1/jobs{query}")
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    everything = listing("")
    assert [j["id"] for j in everything["jobs"]] == [failed["id"], running["id"], queued["id"]]
    assert (everything["total"], everything["limit"], everything["offset"]) == (3, 50, 0)
    assert everything["next_offset"] is None
    assert [j["state"] for j in everything["jobs"]] == ["FAILED", "RUNNING", "QUEUED"]

    only_running = listing("?state=RUNNING")
    assert [j["id"] for j in only_running["jobs"]] == [running["id"]]
    assert only_running["total"] == 1
    two = listing("?state=QUEUED&state=FAILED")
    assert [j["id"] for j in two["jobs"]] == [failed["id"], queued["id"]]
    assert two["total"] == 2
    assert listing("?state=CANCELLED") == {
        "jobs": [],
        "total": 0,
        "limit": 50,
        "offset": 0,
        "next_offset": None,
    }

    first = listing("?limit=2")
    assert [j["id"] for j in first["jobs"]] == [failed["id"], running["id"]]
    assert (first["total"], first["limit"], first["offset"], first["next_offset"]) == (3, 2, 0, 2)
    second = listing(f"?limit=2&offset={first['next_offset']}")
    assert [j["id"] for j in second["jobs"]] == [queued["id"]]
    assert (second["total"], second["offset"], second["next_offset"]) == (3, 2, None)
    middle = listing("?limit=1&offset=1")
    assert ([j["id"] for j in middle["jobs"]], middle["next_offset"]) == ([running["id"]], 2)
    past = listing("?offset=10")
    assert (past["jobs"], past["total"], past["next_offset"]) == ([], 3, None)
    filtered = listing("?state=QUEUED&state=FAILED&limit=1")
    assert ([j["id"] for j in filtered["jobs"]], filtered["next_offset"]) == ([failed["id"]], 1)


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("limit=0", ["query.limit"]),
        ("limit=501", ["query.limit"]),
        ("limit=many", ["query.limit"]),
        ("offset=-1", ["query.offset"]),
        ("state=BOGUS", ["query.state.0"]),
        ("state=RUNNING&state=running", ["query.state.1"]),
        ("limit=0&state=BOGUS", ["query.state.0", "query.limit"]),
    ],
)
def test_list_parameters_are_checked(service: Service, query: str, expected: list[str]) -> None:
    assert fields(service.client.get(f"/v1/jobs?{query}")) == expected


# -- GET /v1/jobs/{id} and how jobs move -------------------------------------------------


def test_an_unknown_job_is_404(service: Service) -> None:
    response = service.client.get("/v1/jobs/no-such-job")
    assert response.status_code == 404
    assert response.json() == {
        "detail": "no job 'no-such-job'; GET /v1/jobs lists the jobs there are"
    }


def test_a_job_shows_its_progress_metrics_and_decision(service: Service) -> None:
    job = service.submitted("tracked")
    service.fake.push(
        job["id"],
        {"kind": "worker", "rank": 0},
        TUNER.wire(),
        {"kind": "start", "total_steps": 200},
        {"kind": "step", "step": 10, "loss": 2.5, "accuracy": 0.25, "samples_per_s": 900.0},
        {"kind": "step", "step": 20, "loss": 1.5, "accuracy": 0.5, "samples_per_s": 1000.0},
        {"kind": "eval", "step": 20, "test_loss": 1.7, "test_accuracy": 0.45},
    )
    shown = service.wait(
        job["id"],
        "running at step 20",
        lambda j: j["state"] == "RUNNING" and j["progress"]["step"] == 20,
    )
    assert shown["progress"] == {"step": 20, "total": 200, "percent": 10.0, "target_met": False}
    assert shown["metrics"] == {
        "loss": 1.5,
        "accuracy": 0.5,
        "samples_per_s": 1000.0,
        "step": 20,
        "test_loss": 1.7,
        "test_accuracy": 0.45,
    }
    assert shown["decision"] == CHOSEN.model_dump()
    assert TunerRecord.model_validate(shown["tuner"]) == TUNER  # the record, typed
    assert [c["rejected"] for c in shown["tuner"]["candidates"]] == [None, CANDIDATES[1].rejected]
    assert history(shown) == [(None, "QUEUED", "submit"), ("QUEUED", "RUNNING", "run")]
    assert shown["started_at"] is not None
    assert shown["finished_at"] is None
    assert shown["failure_reason"] is None

    service.fake.finish(job["id"], RayJobStatus.SUCCEEDED)
    done = service.wait_state(job["id"], "SUCCEEDED")
    assert done["finished_at"] is not None
    assert done["finished_at"] >= done["started_at"]
    assert done["failure_reason"] is None
    assert done["progress"] == {"step": 20, "total": 200, "percent": 100.0, "target_met": False}
    assert history(done)[-1] == ("RUNNING", "SUCCEEDED", "succeed")
    assert [t["reason"] for t in done["transitions"]] == [None, None, None]


def test_profiling_then_running(service: Service) -> None:
    job = service.submitted()
    service.fake.push(job["id"], {"kind": "worker", "rank": 0}, {"kind": "profiling"})
    profiling = service.wait_state(job["id"], "PROFILING")
    assert profiling["started_at"] is not None
    service.fake.push(job["id"], {"kind": "start", "total_steps": 50})
    running = service.wait_state(job["id"], "RUNNING")
    assert running["started_at"] == profiling["started_at"]
    assert running["progress"]["total"] == 50
    assert history(running) == [
        (None, "QUEUED", "submit"),
        ("QUEUED", "PROFILING", "profile"),
        ("PROFILING", "RUNNING", "run"),
    ]


def test_a_restarted_worker_group_is_recovering_then_running(service: Service) -> None:
    job = service.running()
    assert service.store.get(job["id"]).attempts == 1
    # Workers of other ranks, and a start while running, change nothing.
    service.fake.push(
        job["id"], {"kind": "worker", "rank": 1}, {"kind": "start"}, {"kind": "step", "step": 5}
    )
    service.wait(job["id"], "step 5", lambda j: j["progress"]["step"] == 5)
    assert service.job(job["id"])["state"] == "RUNNING"
    assert service.store.get(job["id"]).attempts == 1

    service.fake.push(job["id"], {"kind": "worker", "rank": 0})
    service.wait_state(job["id"], "RECOVERING")
    assert service.store.get(job["id"]).attempts == 2
    service.fake.push(job["id"], {"kind": "start", "total_steps": 100})
    again = service.wait_state(job["id"], "RUNNING")
    assert history(again) == [
        (None, "QUEUED", "submit"),
        ("QUEUED", "RUNNING", "run"),
        ("RUNNING", "RECOVERING", "recover"),
        ("RECOVERING", "RUNNING", "run"),
    ]
    assert service.store.get(job["id"]).attempts == 2


def test_a_failed_pass_loses_no_state_change(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database refuses a write once, as the follower moves a job by what its progress
    records say: the move is made on a later pass, not lost with the records already read."""
    store = service.store
    apply = store.apply
    refused: list[JobEvent] = []

    def flaky_apply(job_id: str, event: JobEvent, reason: str | None = None) -> Job:
        if event is JobEvent.RUN and not refused:
            refused.append(event)
            raise OperationalError("UPDATE jobs ...", {}, Exception("database is locked"))
        return apply(job_id, event, reason)

    job = service.submitted()
    monkeypatch.setattr(store, "apply", flaky_apply)
    service.fake.push(
        job["id"],
        {"kind": "worker", "rank": 0},
        {"kind": "start", "total_steps": 10},
        {"kind": "step", "step": 3, "loss": 1.0},
    )
    running = service.wait_state(job["id"], "RUNNING")
    assert running["progress"] == {"step": 3, "total": 10, "percent": 30.0, "target_met": False}
    assert history(running) == [(None, "QUEUED", "submit"), ("QUEUED", "RUNNING", "run")]


@pytest.mark.parametrize(
    ("status", "message", "reason"),
    [
        (RayJobStatus.FAILED, "CUDA out of memory", "the Ray Job failed: CUDA out of memory"),
        (
            RayJobStatus.FAILED,
            "  ",
            "the Ray Job failed: the Ray Job failed without a message; see its logs",
        ),
        (
            RayJobStatus.STOPPED,
            "",
            "the Ray Job was stopped outside the service (ray job stop?)",
        ),
        (
            RayJobStatus.MISSING,
            "",
            # After the grace period (lost_grace_s, 0.2 s in these tests).
            "lost with its cluster: the Ray cluster at fake-cluster:6379 has had no record of "
            "its Ray Job kaisa-ray-{id} for 0 s (the cluster or its head was restarted?); "
            "submit the job again",
        ),
    ],
    ids=["failed", "failed-silently", "stopped", "missing"],
)
def test_ray_ending_a_job_otherwise_fails_it(
    service: Service, status: RayJobStatus, message: str, reason: str
) -> None:
    job = service.running()
    reason = reason.format(id=job["id"])
    service.fake.finish(job["id"], status, message)
    failed = service.wait_state(job["id"], "FAILED")
    assert failed["failure_reason"] == reason
    assert failed["finished_at"] is not None
    assert history(failed)[-1] == ("RUNNING", "FAILED", "fail")
    assert failed["transitions"][-1]["reason"] == reason
    assert service.fake.stopped == []


def test_a_job_ray_refuses_fails_after_three_tries(service: Service) -> None:
    service.fake.fail_submit = RuntimeError("no ray")
    job = service.submit()
    failed = service.wait_state(job["id"], "FAILED")
    assert failed["failure_reason"] == "could not submit the job to Ray: no ray"
    assert "could not submit" in failed["failure_reason"]
    assert failed["submission_id"] is None
    assert service.fake.submitted == {}
    assert history(failed) == [(None, "QUEUED", "submit"), ("QUEUED", "FAILED", "fail")]
    assert service.app.state.runtime.follower.submit_tries == 3


# -- POST /v1/jobs/{id}/cancel -----------------------------------------------------------


def test_cancel_stops_the_ray_job(service: Service) -> None:
    service.fake.stop_takes_effect = False  # the job stays CANCELLING until the test says
    job = service.running()
    url = f"/v1/jobs/{job['id']}/cancel"
    response = service.client.post(url)
    assert response.status_code == 200
    assert response.json()["state"] == "CANCELLING"
    sid = submission_id(job["id"])
    wait_for(lambda: service.fake.stopped == [sid], "the Ray Job to be stopped")
    again = service.client.post(url)
    assert (again.status_code, again.json()["state"]) == (200, "CANCELLING")
    # The follower asks Ray once, however many passes it makes meanwhile.
    passes = service.app.state.runtime.follower.passes
    wait_for(lambda: service.app.state.runtime.follower.passes >= passes + 3, "three passes")
    assert service.fake.stopped == [sid]
    assert service.job(job["id"])["state"] == "CANCELLING"

    service.fake.finish(job["id"], RayJobStatus.STOPPED, "stopped")
    cancelled = service.wait_state(job["id"], "CANCELLED")
    assert cancelled["finished_at"] is not None
    assert cancelled["failure_reason"] is None
    assert history(cancelled) == [
        (None, "QUEUED", "submit"),
        ("QUEUED", "RUNNING", "run"),
        ("RUNNING", "CANCELLING", "cancel"),
        ("CANCELLING", "CANCELLED", "cancelled"),
    ]
    assert cancelled["transitions"][2]["reason"] == "cancelled by a user"
    once_more = service.client.post(url)
    assert (once_more.status_code, once_more.json()["state"]) == (200, "CANCELLED")
    assert service.job(job["id"])["transitions"] == cancelled["transitions"]


def test_cancel_takes_effect(service: Service) -> None:
    job = service.running()
    assert service.client.post(f"/v1/jobs/{job['id']}/cancel").json()["state"] == "CANCELLING"
    service.wait_state(job["id"], "CANCELLED")
    assert service.fake.stopped == [submission_id(job["id"])]


def test_a_job_that_succeeds_while_cancelling_succeeded(service: Service) -> None:
    service.fake.stop_takes_effect = False
    job = service.running()
    service.client.post(f"/v1/jobs/{job['id']}/cancel")
    wait_for(lambda: service.fake.stopped, "the Ray Job to be stopped")
    service.fake.finish(job["id"], RayJobStatus.SUCCEEDED)
    done = service.wait_state(job["id"], "SUCCEEDED")
    assert history(done)[-2:] == [
        ("RUNNING", "CANCELLING", "cancel"),
        ("CANCELLING", "SUCCEEDED", "succeed"),
    ]


@pytest.mark.parametrize(
    ("status", "state"), [(RayJobStatus.SUCCEEDED, "SUCCEEDED"), (RayJobStatus.FAILED, "FAILED")]
)
def test_cancelling_a_job_that_finished_otherwise_is_409(
    service: Service, status: RayJobStatus, state: str
) -> None:
    job = service.running()
    service.fake.finish(job["id"], status, "boom")
    service.wait_state(job["id"], state)
    response = service.client.post(f"/v1/jobs/{job['id']}/cancel")
    assert response.status_code == 409
    assert response.json() == {
        "detail": f"job {job['id']} already finished as {state}; nothing to cancel"
    }
    assert service.job(job["id"])["state"] == state
    assert service.fake.stopped == []


def test_a_job_cancelled_before_it_reached_ray_never_does(service: Service) -> None:
    service.hold_submissions()
    job = service.submit()
    response = service.client.post(f"/v1/jobs/{job['id']}/cancel")
    assert (response.status_code, response.json()["state"]) == (200, "CANCELLING")
    cancelled = service.wait_state(job["id"], "CANCELLED")
    assert history(cancelled) == [
        (None, "QUEUED", "submit"),
        ("QUEUED", "CANCELLING", "cancel"),
        ("CANCELLING", "CANCELLED", "cancelled"),
    ]
    assert cancelled["submission_id"] is None
    assert cancelled["started_at"] is None
    service.fake.fail_submit = None  # Ray would take it now; the job is over
    passes = service.app.state.runtime.follower.passes
    wait_for(lambda: service.app.state.runtime.follower.passes >= passes + 3, "three passes")
    assert service.fake.submitted == {}
    assert service.fake.stopped == []
    assert service.job(job["id"])["state"] == "CANCELLED"


def test_cancel_of_an_unknown_job_is_404(service: Service) -> None:
    response = service.client.post("/v1/jobs/no-such-job/cancel")
    assert response.status_code == 404
    assert response.json()["detail"].startswith("no job 'no-such-job'")


# -- DELETE /v1/jobs/{id} ----------------------------------------------------------------


def test_delete_only_a_finished_job(service: Service) -> None:
    job = service.running()
    url = f"/v1/jobs/{job['id']}"
    refused = service.client.delete(url)
    assert refused.status_code == 409
    assert refused.json()["detail"].startswith(f"job {job['id']} is RUNNING; only finished jobs")
    assert service.job(job["id"])["state"] == "RUNNING"

    service.fake.push(job["id"], {"kind": "step", "step": 1, "loss": 1.0})
    service.fake.finish(job["id"], RayJobStatus.SUCCEEDED)
    service.wait_state(job["id"], "SUCCEEDED")
    deleted = service.client.delete(url)
    assert deleted.status_code == 204
    assert deleted.content == b""
    for method, path in [
        ("GET", url),
        ("DELETE", url),
        ("GET", f"{url}/metrics"),
        ("GET", f"{url}/logs"),
        ("POST", f"{url}/cancel"),
    ]:
        assert service.client.request(method, path).status_code == 404, (method, path)
    assert service.client.get("/v1/jobs").json()["total"] == 0


def test_delete_of_an_unknown_job_is_404(service: Service) -> None:
    response = service.client.delete("/v1/jobs/no-such-job")
    assert response.status_code == 404
    assert response.json()["detail"].startswith("no job 'no-such-job'")
