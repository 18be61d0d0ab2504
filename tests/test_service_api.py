"""The job service's HTTP API (``service.app``) in-process: FastAPI's ``TestClient`` with the
app's lifespan (store on a SQLite file, the follower thread) and ``FakeRunner`` in place of
Ray, so each test scripts what Ray and the progress sink say and watches the API follow."""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.exc import OperationalError
from support import sweep_data as sweeps
from support.fake_runner import FakeRunner
from support.polling import wait_for
from support.service_app import TOKEN, Service, anonymous, spec, start

from kaisa_ray.enums import ComputeMethod, DistributedStrategy, KFACApprox, Precision
from kaisa_ray.train.records import (
    CandidateRow,
    KFACChoice,
    RecordKind,
    SweepMetric,
    TrialState,
    TunerRecord,
)
from service.database import sole_writer
from service.errors import DatabaseInUseError
from service.job_data import Job
from service.lifecycle import JobEvent, JobState
from service.runner import RayJobStatus, submission_id

if TYPE_CHECKING:
    import httpx

T = TypeVar("T")


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    fake = FakeRunner()
    app, client = start(tmp_path, fake)
    with client:
        yield Service(app, client, fake)


def fields(response: httpx.Response) -> list[str]:
    assert response.status_code == 422, response.text
    assert "Traceback" not in response.text
    body = response.json()
    assert set(body) == {"detail", "problems"}
    assert body["detail"].startswith(f"{len(body['problems'])} problem(s): ")
    return [problem["field"] for problem in body["problems"]]


def history(job: dict[str, Any]) -> list[tuple[str | None, str, str]]:
    return [(t["from_state"], t["to_state"], t["event"]) for t in job["transitions"]]


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


# -- authentication ----------------------------------------------------------------------

PROTECTED = [
    ("POST", "/v1/jobs"),
    ("GET", "/v1/jobs"),
    ("GET", "/v1/jobs/some-job"),
    ("GET", "/v1/jobs/some-job/metrics"),
    ("GET", "/v1/jobs/some-job/events"),
    ("GET", "/v1/jobs/some-job/logs"),
    ("POST", "/v1/jobs/some-job/cancel"),
    ("DELETE", "/v1/jobs/some-job"),
    ("GET", "/metrics"),
]
UNAUTHORIZED = (
    "missing or wrong token: send 'Authorization: Bearer <token>' with the token the service "
    "was started with ($KAISA_RAY_TOKEN, or the file of --token-file)"
)
WRONG = {
    "none": None,
    "wrong token": f"Bearer {TOKEN}x",
    "empty token": "Bearer ",
    "other scheme": f"Basic {TOKEN}",
}


@pytest.mark.parametrize("authorization", list(WRONG.values()), ids=list(WRONG))
@pytest.mark.parametrize(("method", "path"), PROTECTED, ids=[f"{m} {p}" for m, p in PROTECTED])
def test_every_endpoint_needs_the_token(
    service: Service, method: str, path: str, authorization: str | None
) -> None:
    body = {"json": spec()} if method == "POST" and path == "/v1/jobs" else {}
    if authorization is None:
        response = anonymous(service.client, method, path, **body)
    else:
        headers = {"Authorization": authorization}
        response = service.client.request(method, path, headers=headers, **body)
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == "Bearer"
    assert response.json() == {"detail": UNAUTHORIZED}
    assert service.store.page()[1] == 0


def test_a_request_without_the_token_is_refused_before_its_body_is_read(
    service: Service,
) -> None:
    broken = anonymous(
        service.client,
        "POST",
        "/v1/jobs",
        content=b"{not json",
        headers={"Content-Type": "application/json"},
    )
    invalid = anonymous(service.client, "POST", "/v1/jobs", json={"bogus": 1})
    assert (broken.status_code, invalid.status_code) == (401, 401)
    assert broken.json() == invalid.json() == {"detail": UNAUTHORIZED}


def test_health_and_readiness_need_no_token(service: Service) -> None:
    assert anonymous(service.client, "GET", "/healthz").status_code == 200
    assert anonymous(service.client, "GET", "/readyz").status_code == 200


@pytest.mark.parametrize("token", [None, ""], ids=["none", "empty"])
def test_without_a_configured_token_everything_is_open(tmp_path: Path, token: str | None) -> None:
    fake = FakeRunner()
    # Addressed to loopback: without a token, only loopback names are answered
    # (test_service_guards.py).
    _, client = start(tmp_path, fake, token=token, base_url="http://127.0.0.1:8000")
    with client:

        def call(method: str, path: str, **kwargs: Any) -> int:
            return anonymous(client, method, path, **kwargs).status_code

        created = anonymous(client, "POST", "/v1/jobs", json=spec())
        assert created.status_code == 201
        url = f"/v1/jobs/{created.json()['id']}"
        assert call("GET", "/v1/jobs") == 200
        assert call("GET", url) == 200
        assert call("GET", f"{url}/metrics") == 200
        assert call("GET", f"{url}/logs") == 200
        assert call("GET", "/metrics") == 200
        assert call("POST", f"{url}/cancel") == 200
        wait_for(lambda: anonymous(client, "GET", url).json()["state"] == "CANCELLED", "cancelled")
        assert call("GET", f"{url}/events") == 200  # a finished job's stream ends at once
        assert call("DELETE", url) == 204
        # A token sent anyway does no harm.
        assert client.get("/v1/jobs").status_code == 200


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


CHOSEN = KFACChoice(grad_worker_fraction=1.0, factor_update_steps=5, inv_update_steps=50)
CANDIDATES = [
    CandidateRow(
        grad_worker_fraction=1.0,
        factor_update_steps=5,
        inv_update_steps=50,
        memory_bytes=1000,
        kfac_state_bytes=400,
        ms_per_step=12.5,
        rejected=None,
    ),
    CandidateRow(
        grad_worker_fraction=0.5,
        factor_update_steps=5,
        inv_update_steps=50,
        memory_bytes=1200,
        kfac_state_bytes=600,
        ms_per_step=20.0,
        rejected="needs 1.17 KiB, over the budget by 0.17 KiB",
    ),
]
TUNER = TunerRecord(
    cache="miss",
    profile_s=1.5,
    budget_bytes=1100,
    base_memory_bytes=500,
    kfac_transient_bytes=100,
    plain_ms_per_step=9.0,
    chosen=CHOSEN,
    candidates=CANDIDATES,
)


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


def events(lines: Iterator[str]) -> Iterator[tuple[str, str]]:
    """(event, data) of each server-sent event in ``lines``."""
    kind = "message"
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                yield kind, "\n".join(data)
            kind, data = "message", []
        elif line.startswith("event:"):
            kind = line.removeprefix("event:").strip()
        elif line.startswith("data:"):
            data.append(line.removeprefix("data:").removeprefix(" "))


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
    # Each record's event carries the record itself: its kind, its fields, the sink's time.
    assert [data for kind, data in received if kind == "progress"] == [
        {"kind": "step", "step": 10, "loss": 2.0, "time": 1.8e9},
        {"kind": "step", "step": 20, "loss": 1.0, "time": 1.8e9},
    ]
    assert [data for kind, data in received if kind == "eval"] == [
        {"kind": "eval", "step": 20, "test_accuracy": 0.5, "time": 1.8e9}
    ]
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
    step = {"job_id": first["id"], "kind": "step", "step": 10, "loss": 2.0, "time": 1.8e9}
    assert ("progress", step) in received
    evaluated = {"job_id": first["id"], "kind": "eval", "step": 10, "test_accuracy": 0.4}
    assert ("eval", {**evaluated, "time": 1.8e9}) in received
    states = [(d["id"], d["state"]) for k, d in received if k == "state"]
    assert (second["id"], "QUEUED") in states  # a whole JobView, as GET /v1/jobs/{id} has it
    assert states.index((first["id"], "SUCCEEDED")) > 0
    assert received[-1] == ("deleted", {"job_id": first["id"], "id": first["id"]})


def test_the_stream_of_every_job_needs_the_token(service: Service) -> None:
    response = service.client.get("/v1/events", headers={"Authorization": "Bearer wrong"})
    assert response.status_code == 401


# -- GET /v1/registry --------------------------------------------------------------------


def test_the_registry_lists_what_a_spec_may_name(service: Service) -> None:
    response = service.client.get("/v1/registry")
    assert response.status_code == 200
    body = response.json()
    assert {"lenet", "mlp", "resnet20"} <= set(body["models"])
    assert {"fashion-mnist", "mnist", "synthetic"} <= set(body["datasets"])
    # Every closed set the answers use, from its one definition (the dashboard reads them).
    assert body["job_states"] == [s.value for s in JobState]
    assert set(body["finished_states"]) == {s.value for s in JobState if s.finished}
    assert body["strategies"] == [*(s.value for s in DistributedStrategy), "auto"]
    assert body["compute_methods"] == [m.value for m in ComputeMethod]
    assert body["kfac_approximations"] == [a.value for a in KFACApprox]
    assert body["precisions"] == [p.value for p in Precision]
    assert body["trial_states"] == [s.value for s in TrialState]
    assert body["ended_trial_states"] == [s.value for s in TrialState if s.ended]
    assert body["record_kinds"] == [k.value for k in RecordKind]
    assert body["sweep_metrics"] == [
        {"name": m.value, "direction": m.direction.value, "unit": m.unit} for m in SweepMetric
    ]
    assert body["events"]["step"] == "progress"
    assert service.client.get("/v1/registry", headers={"Authorization": ""}).status_code == 401


def test_the_api_schema_shows_the_typed_records(service: Service) -> None:
    schema = service.client.get("/openapi.json").json()
    components = schema["components"]["schemas"]
    union = components["Record"]
    assert union["discriminator"]["propertyName"] == "kind"
    assert set(union["discriminator"]["mapping"]) == {k.value for k in RecordKind}
    assert {"loss", "samples_per_s", "kfac_factors_ms"} <= set(
        components["StepRecord"]["properties"]
    )
    # A job's tuner record and its decision are the typed record, not a bag of keys.
    job = components["JobView"]["properties"]
    assert {"$ref": "#/components/schemas/TunerRecord"} in job["tuner"]["anyOf"]
    assert {"$ref": "#/components/schemas/KFACChoice"} in job["decision"]["anyOf"]
    assert "rejected" in components["CandidateRow"]["properties"]


# -- the dashboard's files ---------------------------------------------------------------


def test_the_dashboard_page_and_its_files_are_served_without_a_token(service: Service) -> None:
    bare = {"Authorization": ""}
    page = service.client.get("/", headers=bare)
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "default-src 'self'" in policy
    assert "script-src 'self';" in policy  # no inline or outside scripts
    for src in re.findall(r'(?:src|href)="([^"#]+)"', page.text):
        assert src.startswith("/static/"), f"{src}: the page loads only the service's files"
        asset = service.client.get(src, headers=bare)
        assert asset.status_code == 200, src
    plotly = service.client.get("/static/vendor/plotly.min.js", headers=bare)
    assert plotly.headers["content-type"].startswith("text/javascript")
    assert len(plotly.content) > 1_000_000
    assert b"plotly" in plotly.content[:2000].lower()
    assert service.client.get("/static/nothing.js").status_code == 404
    assert "/" not in service.client.get("/openapi.json").json()["paths"]


def test_without_plotly_the_charts_bundle_is_a_clear_404(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "plotly" else real(name, *a)
    )
    response = service.client.get("/static/vendor/plotly.min.js")
    assert response.status_code == 404
    assert "pip install plotly" in response.json()["detail"]


# -- sweep jobs --------------------------------------------------------------------------


def sweep_job(service: Service) -> dict[str, Any]:
    """A submitted sweep of 3 trials, 2 at once, over the learning rate and the damping."""
    return service.submitted(
        "swept",
        kfac={"strategy": "auto"},
        sweep={"space": sweeps.SPACE, "trials": 3, "concurrent": 2},
    )


def sweep_result(job: dict[str, Any]) -> dict[str, Any]:
    """The sweep's last record, its best spec the job's own with the best trial's params."""
    best_spec = {k: v for k, v in job["spec"].items() if k != "sweep"}
    best_spec["optimizer"] = {**best_spec["optimizer"], "lr": 0.05}
    best_spec["kfac"] = {**best_spec["kfac"], "damping": 0.1}
    return {**sweeps.RESULT, "best_spec": best_spec}


def test_a_sweep_job_shows_its_trials_and_best_spec(service: Service) -> None:
    job = sweep_job(service)
    words = shlex.split(service.fake.entrypoints[submission_id(job["id"])])
    assert words[:2] == ["kaisa-ray", "sweep"]
    assert words[words.index("--spec-key") + 1] == f"spec/{job['id']}"
    assert service.fake.submitted[submission_id(job["id"])] == job["spec"]
    assert words[words.index("--run-name") + 1] == job["id"]
    assert "--no-progress" in words
    # Before its first record, the plan from the spec, and no trials.
    planned = service.job(job["id"])["sweep"]
    assert planned == {
        "metric": "test_accuracy",
        "mode": "max",
        "trials_planned": 3,
        "concurrent": 2,
        "space": sweeps.SPACE,
        "trials_ended": 0,
        "trials": [],
        "best": None,
        "best_spec": None,
        "best_spec_yaml": None,
        "seconds": None,
    }

    service.fake.push(job["id"], *sweeps.FIRST)
    running = service.wait(
        job["id"],
        "two trials at step 20",
        lambda j: j["state"] == "RUNNING" and [t["step"] for t in j["sweep"]["trials"]] == [20, 20],
    )
    assert running["progress"] == {"step": 0, "total": 3, "percent": 0.0, "target_met": False}
    assert history(running) == [(None, "QUEUED", "submit"), ("QUEUED", "RUNNING", "run")]
    assert running["sweep"]["trials"] == [
        {
            "trial_id": sweeps.A,
            "state": "RUNNING",
            "params": sweeps.A_PARAMS,
            "step": 20,
            "metrics": {"test_accuracy": 0.6, "test_loss": 1.1, "train_s": 4.0},
            "value": None,
            "error": None,
            "checkpoint": None,
        },
        {
            "trial_id": sweeps.B,
            "state": "RUNNING",
            "params": sweeps.B_PARAMS,
            "step": 20,
            "metrics": {"test_accuracy": 0.3, "test_loss": 2.0, "train_s": 4.2},
            "value": None,
            "error": None,
            "checkpoint": None,
        },
    ]
    assert running["sweep"]["best"] is None

    result = sweep_result(job)
    service.fake.push(job["id"], *sweeps.SECOND, result)
    ended = service.wait(job["id"], "the sweep's result", lambda j: j["sweep"]["best"] is not None)
    assert ended["state"] == "RUNNING"  # until Ray says the Ray Job ended
    assert ended["progress"] == {"step": 3, "total": 3, "percent": 100.0, "target_met": False}
    shown = ended["sweep"]
    assert shown["trials_ended"] == 3
    assert shown["seconds"] == 42.5
    trials = {t["trial_id"]: t for t in shown["trials"]}
    assert [t["trial_id"] for t in shown["trials"]] == [sweeps.A, sweeps.B, sweeps.C]
    assert [t["state"] for t in shown["trials"]] == ["SUCCEEDED", "STOPPED", "FAILED"]
    assert trials[sweeps.C]["error"] == sweeps.DIVERGED
    assert (trials[sweeps.C]["params"], trials[sweeps.C]["value"]) == (sweeps.C_PARAMS, None)
    assert (trials[sweeps.B]["step"], trials[sweeps.B]["value"]) == (20, 0.3)
    assert shown["best"] == {
        "trial_id": sweeps.A,
        "params": sweeps.A_PARAMS,
        "value": 0.8,
        "step": 60,
        "metrics": {"test_accuracy": 0.8, "test_loss": 0.6, "train_s": 11.5},
        "checkpoint": sweeps.BEST["checkpoint"],
        "run": sweeps.BEST["run"],
    }
    assert shown["best_spec"] == result["best_spec"]
    # ... and as the job file the CLI prints (the dashboard shows this text).
    assert yaml.safe_load(shown["best_spec_yaml"]) == result["best_spec"]

    service.fake.finish(job["id"], RayJobStatus.SUCCEEDED)
    done = service.wait_state(job["id"], "SUCCEEDED")
    assert done["sweep"] == shown
    assert done["progress"] == ended["progress"]
    # The best spec is a job of its own: submitted as it is, it trains.
    again = service.client.post("/v1/jobs", json=shown["best_spec"])
    assert again.status_code == 201, again.text
    assert again.json()["spec"]["optimizer"]["lr"] == 0.05
    best_job = service.wait(again.json()["id"], "submitted", lambda j: j["submission_id"])
    assert best_job["sweep"] is None
    assert shlex.split(service.fake.entrypoints[best_job["submission_id"]])[1] == "train"


@pytest.mark.timeout(60)
def test_the_events_of_a_sweep_job_carry_its_trials_and_result(service: Service) -> None:
    job = sweep_job(service)
    result = sweep_result(job)
    received: list[tuple[str, Any]] = []
    with service.client.stream("GET", f"/v1/jobs/{job['id']}/events") as stream:
        for kind, data in events(stream.iter_lines()):
            received.append((kind, json.loads(data)))
            if len(received) == 1:  # subscribed: the sweep runs, in two batches, and ends
                service.fake.push(job["id"], *sweeps.FIRST)
                service.wait(job["id"], "running", lambda j: j["state"] == "RUNNING")
                service.fake.push(job["id"], *sweeps.SECOND, result)
                service.fake.finish(job["id"], RayJobStatus.SUCCEEDED)
    others = [(kind, data) for kind, data in received if kind != "state"]
    trial_records = [r for r in [*sweeps.FIRST, *sweeps.SECOND] if r["kind"] == "trial"]
    assert [kind for kind, _ in others] == ["trial"] * len(trial_records) + ["sweep"]
    assert [data for _, data in others[:-1]] == [{**r, "time": 1.8e9} for r in trial_records]
    failed = [data for kind, data in others if kind == "trial" and data["state"] == "FAILED"]
    assert failed == [
        {"kind": "trial", "trial": sweeps.C, "state": "FAILED", "error": sweeps.DIVERGED}
        | {"time": 1.8e9}
    ]
    _, last = others[-1]
    assert last["best"] == sweeps.BEST
    assert last["best_spec"] == result["best_spec"]
    assert [t["trial_id"] for t in last["trials"]] == [sweeps.A, sweeps.B, sweeps.C]
    states = [data["state"] for kind, data in received if kind == "state"]
    assert states[0] == "QUEUED"
    assert states[-1] == "SUCCEEDED"
    assert "RUNNING" in states
    assert received[-1][1]["progress"] == {
        "step": 3,
        "total": 3,
        "percent": 100.0,
        "target_met": False,
    }


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


# -- health, readiness, Prometheus -------------------------------------------------------


def test_health(service: Service) -> None:
    response = service.client.get("/healthz")
    assert (response.status_code, response.json()) == (200, {"status": "ok", "checks": {}})


DISKS_OK = {"data_dir": "ok", "checkpoint_root": "ok"}  # test_service_readiness.py


def test_readiness_follows_ray(service: Service) -> None:
    ready = service.client.get("/readyz")
    assert (ready.status_code, ready.json()) == (
        200,
        {"status": "ok", "checks": {"ray": "ok", "database": "ok", **DISKS_OK}},
    )
    service.fake.up = False
    unready = service.client.get("/readyz")
    assert (unready.status_code, unready.json()) == (
        503,
        {"status": "unavailable", "checks": {"ray": "unreachable", "database": "ok", **DISKS_OK}},
    )
    assert service.client.get("/healthz").status_code == 200  # alive all the same
    service.fake.up = True
    assert service.client.get("/readyz").status_code == 200


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_prometheus_metrics(service: Service) -> None:
    running = service.running("busy")
    service.fake.push(
        running["id"], {"kind": "step", "step": 25, "loss": 1.0, "samples_per_s": 1234.5}
    )
    service.wait(running["id"], "step 25", lambda j: j["progress"]["step"] == 25)
    idle = service.submit("idle")  # stays QUEUED: no worker starts
    service.client.post("/v1/jobs", json=spec("idle"), headers={"Idempotency-Key": "k"})
    service.client.post("/v1/jobs", json=spec("idle"), headers={"Idempotency-Key": "k"})
    response = service.client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    found = samples(response.text)

    def value(metric: str, **labels: str) -> float:
        return found[(metric, frozenset(labels.items()))]

    assert value("kaisa_ray_jobs", state="RUNNING") == 1
    assert value("kaisa_ray_jobs", state="QUEUED") == 2
    assert value("kaisa_ray_jobs", state="SUCCEEDED") == 0
    assert value("kaisa_ray_job_submissions_total") == 3  # a retried POST is no submission
    assert value("kaisa_ray_job_samples_per_second", job_id=running["id"], name="busy") == 1234.5
    assert value("kaisa_ray_job_progress_ratio", job_id=running["id"], name="busy") == 0.25
    assert not any(
        dict(labels).get("job_id") == idle["id"] for (_, labels) in found
    )  # only running jobs have throughput
    assert (
        value(
            "kaisa_ray_http_request_duration_seconds_count",
            method="POST",
            route="/v1/jobs",
            status="201",
        )
        == 4
    )
    assert (
        value(
            "kaisa_ray_http_request_duration_seconds_bucket",
            method="POST",
            route="/v1/jobs",
            status="201",
            le="+Inf",
        )
        == 4
    )
    assert (
        value(
            "kaisa_ray_http_request_duration_seconds_count",
            method="GET",
            route="/v1/jobs/{job_id}",
            status="200",
        )
        >= 2
    )
    assert 'kaisa_ray_jobs{state="RUNNING"} 1.0' in response.text
    assert re.search(
        r'kaisa_ray_http_request_duration_seconds_bucket\{[^}]*route="/v1/jobs"[^}]*\}',
        response.text,
    )


def test_requests_no_route_matched_are_timed_as_unmatched(service: Service) -> None:
    assert service.client.get("/v1/no-such-thing").status_code == 404
    assert service.client.get("/no-such-thing").status_code == 404
    found = samples(service.client.get("/metrics").text)
    routes = {
        dict(labels)["route"]
        for (name, labels) in found
        if name == "kaisa_ray_http_request_duration_seconds_count"
        and dict(labels)["status"] == "404"
    }
    assert routes == {"(unmatched)"}


# -- internal errors ---------------------------------------------------------------------


def test_an_internal_error_is_a_500_without_the_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeRunner()
    app, client = start(tmp_path, fake, raise_server_exceptions=False)
    with client:

        def broken(**_: Any) -> Any:
            return 1 / 0

        monkeypatch.setattr(app.state.runtime.store, "page", broken)
        response = client.get("/v1/jobs")
        assert response.status_code == 500
        assert response.headers["content-type"] == "application/json"
        assert set(response.json()) == {"detail"}
        assert re.fullmatch(
            r"internal error \(reference [0-9a-f]{8}\); the service log has it",
            response.json()["detail"],
        )
        assert "Traceback" not in response.text
        assert "ZeroDivisionError" not in response.text
        assert "division" not in response.text
        # The service goes on answering.
        assert client.get("/healthz").status_code == 200
        assert client.get("/readyz").status_code == 200
        metrics = samples(client.get("/metrics").text)
        key = frozenset({"method": "GET", "route": "/v1/jobs", "status": "500"}.items())
        assert metrics[("kaisa_ray_http_request_duration_seconds_count", key)] == 1


# -- OpenAPI -----------------------------------------------------------------------------


API_RESPONSES = {
    ("POST", "/v1/jobs"): {"201", "401", "409", "413", "415", "422", "429", "503"},
    ("GET", "/v1/jobs"): {"200", "401", "422"},
    ("GET", "/v1/jobs/{job_id}"): {"200", "401", "404", "422"},
    ("DELETE", "/v1/jobs/{job_id}"): {"204", "401", "404", "409", "422", "503"},
    ("GET", "/v1/jobs/{job_id}/metrics"): {"200", "401", "404", "422"},
    ("GET", "/v1/jobs/{job_id}/events"): {"200", "401", "404", "422"},
    ("GET", "/v1/jobs/{job_id}/logs"): {"200", "401", "404", "422", "503"},
    ("POST", "/v1/jobs/{job_id}/cancel"): {"200", "401", "404", "409", "422", "429", "503"},
    ("GET", "/v1/events"): {"200", "401"},
    ("GET", "/v1/registry"): {"200", "401"},
    ("POST", "/v1/plan"): {"200", "401", "413", "422", "429", "503", "504"},
    ("GET", "/v1/plan/hardware"): {"200", "401"},
}
SERVICE_RESPONSES = {
    ("GET", "/healthz"): {"200"},
    ("GET", "/readyz"): {"200", "503"},
    ("GET", "/metrics"): {"200", "401"},
}


def openapi(service: Service) -> tuple[dict[str, Any], dict[tuple[str, str], Any]]:
    response = anonymous(service.client, "GET", "/openapi.json")
    assert response.status_code == 200
    schema: dict[str, Any] = response.json()
    operations = {
        (method.upper(), path): operation
        for path, methods in schema["paths"].items()
        for method, operation in methods.items()
    }
    return schema, operations


def test_the_openapi_schema_declares_every_path_and_error(service: Service) -> None:
    schema, operations = openapi(service)
    assert set(operations) == set(API_RESPONSES) | set(SERVICE_RESPONSES)
    for key, codes in {**API_RESPONSES, **SERVICE_RESPONSES}.items():
        assert set(operations[key]["responses"]) == codes | {"500"}, key
    for key in API_RESPONSES:
        assert operations[key]["security"] == [{"HTTPBearer": []}], key
    assert operations[("GET", "/metrics")]["security"] == [{"HTTPBearer": []}]
    assert "security" not in operations[("GET", "/healthz")]
    assert "security" not in operations[("GET", "/readyz")]
    assert schema["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    post = operations[("POST", "/v1/jobs")]
    assert post["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/JobSpec"
    }
    idempotency = [p for p in post["parameters"] if p["name"] == "idempotency-key"]
    assert (len(idempotency), idempotency[0]["in"]) == (1, "header")
    events = operations[("GET", "/v1/jobs/{job_id}/events")]["responses"]["200"]["content"]
    assert set(events) == {"text/event-stream"}
    logs = operations[("GET", "/v1/jobs/{job_id}/logs")]["responses"]["200"]["content"]
    assert set(logs) == {"text/plain"}


def test_the_openapi_schema_documents_errors_as_the_json_they_are(service: Service) -> None:
    """Every error is answered as JSON (``ErrorBody``; ``ValidationErrorBody`` for 422;
    ``Health`` for an unready /readyz), also on the routes whose success is plain text."""
    _, operations = openapi(service)
    wrong = []
    for (method, path), operation in sorted(operations.items()):
        for code, response in sorted(operation["responses"].items()):
            if int(code) < 400:
                continue
            model = {"422": "ValidationErrorBody"}.get(code, "ErrorBody")
            if (path, code) == ("/readyz", "503"):
                model = "Health"
            expected = {"application/json": {"schema": {"$ref": f"#/components/schemas/{model}"}}}
            if response.get("content") != expected:
                wrong.append(f"{method} {path} {code}: {sorted(response.get('content', {}))}")
    assert not wrong, "errors documented as other than JSON:\n" + "\n".join(wrong)


def test_a_second_service_on_the_same_database_is_refused(tmp_path: Path) -> None:
    """The service is its database's only writer: a second one on the same SQLite file
    refuses to start, naming the first's pid and the fix; the first is unaffected, and once
    it stops, a new one starts on the same file and finds its jobs."""
    _, first = start(tmp_path, FakeRunner())
    with first:
        job = first.post("/v1/jobs", json=spec("kept")).json()
        database = f"sqlite+pysqlite:///{tmp_path / 'jobs.db'}"  # the same file, another URL
        _, second = start(tmp_path / "elsewhere", FakeRunner(), database_url=database)
        with pytest.raises(DatabaseInUseError) as refused:
            second.__enter__()
        message = str(refused.value)
        assert f"pid {os.getpid()}" in message
        assert str(tmp_path / "jobs.db") in message
        assert "--data-dir or --database-url" in message
        assert first.get(f"/v1/jobs/{job['id']}").status_code == 200
    _, third = start(tmp_path, FakeRunner())
    with third:
        assert third.get(f"/v1/jobs/{job['id']}").json()["name"] == "kept"


def test_serve_refuses_a_database_another_service_holds(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from service.cli import main

    with sole_writer(f"sqlite:///{tmp_path / 'jobs.db'}"):
        result = CliRunner().invoke(main, ["serve", "--data-dir", str(tmp_path)])
    assert result.exit_code == 1, result.output
    assert "another kaisa-ray service" in result.output
    assert "Traceback" not in result.output
