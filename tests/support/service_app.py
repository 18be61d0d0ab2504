"""The service's app in this process, with a fake Ray behind it (``FakeRunner``), through
Starlette's test client: what the API tests share."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from fastapi import FastAPI

from kaisa_train.records import CandidateRow, KFACChoice, TunerRecord
from service.app import create_app
from service.settings import Settings
from service.store.repository import JobStore
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
