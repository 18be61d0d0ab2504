"""The token: which routes need it, how it is checked, and what the page and the probes may
do without it.

The job service's HTTP API (``service.app``) in-process: FastAPI's ``TestClient`` with the
app's lifespan (store on a SQLite file, the follower thread) and ``FakeRunner`` in place of
Ray, so each test scripts what Ray and the progress sink say and watches the API follow."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from support.fake_runner import FakeRunner
from support.polling import wait_for
from support.service_app import TOKEN, Service, anonymous, spec, start

if TYPE_CHECKING:
    pass


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
