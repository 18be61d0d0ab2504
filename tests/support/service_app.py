"""The service's app in this process, with a fake Ray behind it (``FakeRunner``), through
Starlette's test client: what the API tests share."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from service.app import create_app
from service.settings import Settings
from service.store import JobStore
from support.fake_runner import FakeRunner
from support.polling import wait_for_job

if TYPE_CHECKING:
    import httpx
    from starlette.testclient import TestClient


TOKEN = "test-token-0123456789"


AUTH = {"Authorization": f"Bearer {TOKEN}"}


def make_client(
    app: FastAPI, *, raise_server_exceptions: bool = True, base_url: str = "http://testserver"
) -> TestClient:
    """Starlette's test client (imported here: with httpx rather than httpx2 its import warns
    that this is deprecated, which says nothing about the service)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Using `httpx` with `starlette.testclient`")
        from starlette.testclient import TestClient

    return TestClient(
        app, headers=AUTH, raise_server_exceptions=raise_server_exceptions, base_url=base_url
    )


def spec(name: str = "job", **overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": name,
        "model": {"name": "lenet"},
        "dataset": {"name": "synthetic", "batch_size": 8},
        "stop": {"max_steps": 100},
    }
    body.update(overrides)
    return body


@dataclass
class Service:
    app: FastAPI
    client: TestClient
    fake: FakeRunner

    @property
    def store(self) -> JobStore:
        store: JobStore = self.app.state.runtime.store
        return store

    def submit(self, name: str = "job", **overrides: Any) -> dict[str, Any]:
        response = self.client.post("/v1/jobs", json=spec(name, **overrides))
        assert response.status_code == 201, response.text
        body: dict[str, Any] = response.json()
        return body

    def job(self, job_id: str) -> dict[str, Any]:
        response = self.client.get(f"/v1/jobs/{job_id}")
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    def wait(
        self, job_id: str, what: str, check: Callable[[dict[str, Any]], bool]
    ) -> dict[str, Any]:
        return wait_for_job(self.job, job_id, what, check)

    def wait_state(self, job_id: str, state: str) -> dict[str, Any]:
        return self.wait(job_id, state, lambda job: job["state"] == state)

    def submitted(self, name: str = "job", **overrides: Any) -> dict[str, Any]:
        """A job that has reached the (fake) Ray."""
        job = self.submit(name, **overrides)
        return self.wait(job["id"], "submitted", lambda j: j["submission_id"] is not None)

    def running(self, name: str = "job", total_steps: int = 100) -> dict[str, Any]:
        job = self.submitted(name)
        self.fake.push(
            job["id"], {"kind": "worker", "rank": 0}, {"kind": "start", "total_steps": total_steps}
        )
        return self.wait_state(job["id"], "RUNNING")

    def hold_submissions(self) -> None:
        """Ray refuses every submission and the follower keeps trying (jobs stay unsubmitted)."""
        self.fake.fail_submit = RuntimeError("held by the test")
        self.app.state.runtime.follower.submit_tries = 1_000_000


def start(
    tmp_path: Path,
    fake: FakeRunner,
    *,
    raise_server_exceptions: bool = True,
    jobs_stop_with_service: bool | None = None,
    base_url: str = "http://testserver",
    **settings: Any,
) -> tuple[FastAPI, TestClient]:
    options: dict[str, Any] = {
        "data_dir": tmp_path,
        "token": TOKEN,
        "poll_interval_s": 0.02,
        "status_interval_s": 0.02,
        "lost_grace_s": 0.2,
        "post_rate": 1e6,  # the rate limit has its own test (test_service_abuse.py)
        "post_burst": 10**6,
    }
    options.update(settings)
    app = create_app(
        Settings(**options), runner=fake, jobs_stop_with_service=jobs_stop_with_service
    )
    return app, make_client(app, raise_server_exceptions=raise_server_exceptions, base_url=base_url)


def anonymous(client: TestClient, method: str, url: str, **kwargs: Any) -> httpx.Response:
    """A request without the client's Authorization header."""
    request = client.build_request(method, url, **kwargs)
    del request.headers["Authorization"]
    response: httpx.Response = client.send(request)
    return response
