"""Health, readiness and Prometheus; internal errors answered without a trace.

The job service's HTTP API (``service.app``) in-process: FastAPI's ``TestClient`` with the
app's lifespan (store on a SQLite file, the follower thread) and ``FakeRunner`` in place of
Ray, so each test scripts what Ray and the progress sink say and watches the API follow."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.fake_runner import FakeRunner
from support.service_app import Service, spec, start

if TYPE_CHECKING:
    pass


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
