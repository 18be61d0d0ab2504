"""What the service says about itself: the registry, the dashboard's files, the OpenAPI schema.

The job service's HTTP API (``service.app``) in-process: FastAPI's ``TestClient`` with the
app's lifespan (store on a SQLite file, the follower thread) and ``FakeRunner`` in place of
Ray, so each test scripts what Ray and the progress sink say and watches the API follow."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from support.fake_runner import FakeRunner
from support.service_app import Service, anonymous, spec, start

from kaisa_ray.enums import ComputeMethod, DistributedStrategy, KFACApprox, Precision
from kaisa_train.records import (
    RecordKind,
    SweepMetric,
    TrialState,
)
from service.errors import DatabaseInUseError
from service.model.lifecycle import JobState
from service.store.database import sole_writer

if TYPE_CHECKING:
    pass


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
