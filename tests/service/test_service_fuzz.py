"""The service's REST API fuzzed against its own OpenAPI schema (schemathesis).

The app runs in-process on a ``FakeRunner``, with its lifespan (store, follower) started by
schemathesis' ASGI client, which keeps an app's lifespan running until ``shutdown_lifespans``.
Every operation gets generated requests, valid and invalid (schemathesis' coverage and fuzzing
phases, positive and negative modes), with the service's token where the schema asks for it;
each response must be no 5xx, have a documented status code, content type and headers, and a
body that matches the schema; invalid requests must be refused with a 4xx, and requests
without the token with a 401. Random job ids only reach the 404 paths, so the
``/v1/jobs/{job_id}`` family is fuzzed again with the ids of real jobs in every state (with
progress, evaluations, a checkpoint and a tuner record). The event stream is read to its end
for finished jobs, and for a running job up to a time limit (its stream ends with the job).

The schema is read from an app that is not started (it depends on no setting), at import, so
that ``schema.parametrize()`` can make one test per operation; each case is sent to the
started app of the ``service`` fixture. (``schemathesis.pytest.from_fixture`` would read it
from the fixture, but the lazy schema of schemathesis 4.32.5 sets ``request.node._nodeid``,
which pytest 9.2 no longer has.)
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from pydantic import SecretStr
from schemathesis import Case, GenerationMode, Response
from schemathesis.checks import not_a_server_error
from schemathesis.python import asgi
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from support import sweep_data as sweeps
from support.fake_runner import FakeRunner

from kaisa_train.records import CandidateRow, KFACChoice, TunerRecord
from service.app import create_app
from service.domain.hub import EVERY_JOB
from service.runner import RayJobStatus
from service.settings import Settings

TOKEN = "fuzz-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BASE_URL = f"http://{asgi.HOST}"
# Every call has a time limit: a running job's event stream ends only with the job.
CALL_TIMEOUT_S = 5.0
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
    ignored_auth,
]
FUZZ = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
# The jobs of the pool: "running", "auto" (kfac: auto, with the tuner's record) and "sweep" (its
# trials, one failed, and its result) run on.
KINDS = ("running", "auto", "sweep", "succeeded", "failed", "cancelled")
FINISHED = ("succeeded", "failed", "cancelled")
EVENTS = "/v1/jobs/{job_id}/events"
ALL_EVENTS = "/v1/events"  # never ends on its own: checked below, with a time limit

schema = schemathesis.openapi.from_dict(
    create_app(Settings(token=SecretStr(TOKEN))).openapi(),
    config=schemathesis.Config.from_dict(
        {
            "base-url": BASE_URL,
            "request-timeout": CALL_TIMEOUT_S,
            # The token, as the security scheme says (the negative cases and ignored_auth also
            # send requests without it, or with a wrong one).
            "auth": {"openapi": {"HTTPBearer": {"bearer": TOKEN}}},
            # Query parameters that no operation has are ignored, as FastAPI does and the
            # schema allows: not something the service must refuse.
            "generation": {"allow-extra-parameters": False, "database": "none"},
        }
    ),
)


def _row(fraction: float, memory: int, ms: float, rejected: str | None) -> CandidateRow:
    return CandidateRow(
        grad_worker_fraction=fraction,
        factor_update_steps=5,
        inv_update_steps=50,
        memory_bytes=memory,
        kfac_state_bytes=memory // 2,
        ms_per_step=ms,
        rejected=rejected,
    )


TUNER = TunerRecord(
    cache="miss",
    profile_s=1.0,
    budget_bytes=2**31,
    base_memory_bytes=2**20,
    kfac_transient_bytes=0,
    plain_ms_per_step=8.0,
    chosen=KFACChoice(grad_worker_fraction=1.0, factor_update_steps=5, inv_update_steps=50),
    candidates=[_row(1.0, 123456, 12.5, None), _row(0.5, 99999, 14.0, "slower")],
).wire()


def job_spec(name: str, *, auto: bool = False, sweep: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": name,
        "model": {"name": "lenet"},
        "dataset": {"name": "synthetic", "batch_size": 8},
        "kfac": "auto" if auto or sweep else {"strategy": "comm-opt"},
        "scaling": {"workers": 2},
        "stop": {"max_steps": 40},
    }
    if sweep:
        spec["sweep"] = {"space": sweeps.SPACE, "trials": 3, "concurrent": 2}
    return spec


def step(n: int) -> dict[str, Any]:
    return {"kind": "step", "step": n, "loss": 2.0 / n, "accuracy": 0.5, "ms_per_step": 9.5}


@dataclass
class Service:
    app: FastAPI
    runner: FakeRunner
    client: asgi.ASGIClient
    jobs: dict[str, str] = field(default_factory=dict)  # kind -> a job of the pool

    def job(self, kind: str) -> str:
        """A new job in the state ``kind`` names, with progress reports and an evaluation."""
        spec = job_spec(f"fuzz-{kind}", auto=kind == "auto", sweep=kind == "sweep")
        response = self.client.post("/v1/jobs", json=spec, headers=AUTH)
        assert response.status_code == 201, response.text
        job_id: str = response.json()["id"]
        if kind == "sweep":
            nan = {"kind": "trial", "trial": sweeps.C, "state": "RUNNING", "test_loss": math.nan}
            self.runner.push(job_id, *sweeps.FIRST, nan, *sweeps.SECOND, sweeps.RESULT)
            self.wait(job_id, lambda job: job["sweep"]["best"] is not None)
            return job_id
        records: list[dict[str, Any]] = []
        if kind == "auto":
            records += [{"kind": "profiling"}, TUNER]
        records += [
            {"kind": "worker", "rank": 0},
            {"kind": "start", "total_steps": 40},
            step(1),
            step(10),
            step(20),
            {"kind": "eval", "step": 20, "test_loss": 0.6, "test_accuracy": 0.8},
            {"kind": "checkpoint", "step": 20},
        ]
        self.runner.push(job_id, *records)  # read once the follower has submitted the job
        if kind == "succeeded":
            self.runner.finish(job_id, RayJobStatus.SUCCEEDED)
        elif kind == "failed":
            self.runner.finish(job_id, RayJobStatus.FAILED, "a worker died\nTraceback ...")
        self.wait(job_id, lambda job: job["progress"]["step"] == 20)
        if kind == "cancelled":
            cancel = self.client.post(f"/v1/jobs/{job_id}/cancel", headers=AUTH)
            assert cancel.status_code == 200, cancel.text
        if kind in FINISHED:
            self.wait(job_id, lambda job: job["state"] == kind.upper())
        return job_id

    def wait(self, job_id: str, done: Callable[[dict[str, Any]], bool]) -> None:
        deadline = time.monotonic() + 10
        while True:
            job: dict[str, Any] = self.client.get(f"/v1/jobs/{job_id}", headers=AUTH).json()
            if done(job):
                return
            assert time.monotonic() < deadline, f"job {job_id} is stuck: {job}"
            time.sleep(0.01)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    data_dir: Path = tmp_path_factory.mktemp("fuzz-service")
    runner = FakeRunner()
    settings = Settings(
        data_dir=data_dir,
        token=SecretStr(TOKEN),
        poll_interval_s=0.05,
        status_interval_s=0.05,
        # The fuzzer's bursts are not a client's: the rate limit (429, documented) has its own
        # test; here every generated request reaches the route it is for.
        post_rate=1e6,
        post_burst=10**6,
    )
    app = create_app(settings, runner=runner)
    try:
        with asgi.get_client(app) as client:  # type: ignore[arg-type]  # starts the lifespan
            assert app.state.runtime.follower.is_alive()
            service = Service(app, runner, client)
            service.jobs = {kind: service.job(kind) for kind in KINDS}
            yield service
    finally:
        asgi.shutdown_lifespans()  # the lifespan's end: the follower stops, the store closes


def call(case: Case[Any], service: Service, checks: list[Any] = CHECKS, **kwargs: Any) -> Response:
    """``case`` sent to the started app, and its response checked."""
    # Bound to the app, the schema's transport is the ASGI one, also for the requests that
    # checks send on their own (ignored_auth).
    case.operation.schema.app = case.operation.app = service.app
    return case.call_and_validate(checks=checks, **kwargs)


@pytest.mark.timeout(180)
@schema.exclude(path=ALL_EVENTS).parametrize()
@FUZZ
def test_every_operation_conforms_to_the_schema(case: Case[Any], service: Service) -> None:
    call(case, service)


@pytest.mark.timeout(120)
@schema.include(path_regex=r"^/v1/jobs/\{job_id\}").exclude(path=EVENTS).parametrize()
@schema.given(kind=st.sampled_from(KINDS))
@FUZZ
def test_operations_on_real_jobs_conform_to_the_schema(
    case: Case[Any], kind: str, service: Service
) -> None:
    positive = case.meta is not None and case.meta.generation.mode is GenerationMode.POSITIVE
    # Cancel and delete change the job: a valid request gets a job of its own.
    fresh = positive and case.method.upper() in ("POST", "DELETE")
    case.path_parameters["job_id"] = service.job(kind) if fresh else service.jobs[kind]
    # Not negative_data_rejection: schemathesis counts a query value that is not a string as
    # invalid (``kind={"a": "b"}``), but on the wire it is one (``kind=ab``), a valid kind.
    # The test above checks that invalid requests are refused.
    response = call(case, service, checks=[c for c in CHECKS if c is not negative_data_rejection])
    if positive:
        assert response.status_code != 404, f"{case.method} {case.formatted_path}: {response.text}"


def subscribed(service: Service, job_id: str) -> None:
    """Wait until a stream of ``job_id`` (or ``EVERY_JOB``) is open: what it sends from then
    on, it has subscribed to."""
    hub = service.app.state.runtime.jobs.hub
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while hub.subscribers(job_id) == 0:
        assert time.monotonic() < deadline, f"no stream of {job_id} opened"
        time.sleep(0.01)


def events(service: Service, job_id: str, timeout_s: float = CALL_TIMEOUT_S) -> str:
    case = schema[EVENTS]["GET"].Case(path_parameters={"job_id": job_id}, headers=dict(AUTH))
    response = call(case, service, timeout=timeout_s)
    assert response.status_code == 200, response.text
    return response.text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", FINISHED)
def test_the_event_stream_of_a_finished_job_conforms_and_ends(kind: str, service: Service) -> None:
    job_id = service.job(kind)
    began = time.monotonic()
    text = events(service, job_id)
    assert time.monotonic() - began < CALL_TIMEOUT_S / 2, "the stream did not end on its own"
    assert text.count("event: state") == 1
    assert f'"state":"{kind.upper()}"' in text


@pytest.mark.timeout(60)
def test_the_event_stream_of_a_running_job_conforms(service: Service) -> None:
    job_id = service.job("running")

    def report() -> None:
        subscribed(service, job_id)
        service.runner.push(
            job_id,
            step(21),
            {"kind": "eval", "step": 21, "test_loss": 0.5, "test_accuracy": 0.85},
            TUNER,
        )

    reporter = threading.Thread(target=report)
    reporter.start()
    text = events(service, job_id, timeout_s=2.0)  # cut at the time limit, checked so far
    reporter.join()
    assert '"state":"RUNNING"' in text
    for event in ("progress", "eval", "tuner"):
        assert f"event: {event}" in text


@pytest.mark.timeout(60)
def test_the_event_stream_of_every_job_conforms(service: Service) -> None:
    job_id = service.job("running")

    def report() -> None:
        subscribed(service, EVERY_JOB)
        service.runner.push(job_id, step(22), TUNER)
        service.client.post(f"/v1/jobs/{service.job('running')}/cancel", headers=AUTH)

    reporter = threading.Thread(target=report)
    reporter.start()
    case = schema[ALL_EVENTS]["GET"].Case(headers=dict(AUTH))
    response = call(case, service, timeout=2.0)  # cut at the time limit, checked so far
    reporter.join()
    assert response.status_code == 200, response.text
    for event in ("ready", "progress", "tuner", "state"):
        assert f"event: {event}" in response.text, event


@pytest.mark.timeout(60)
def test_a_body_that_is_not_utf8_gets_a_documented_answer(service: Service) -> None:
    """The fuzzer finds this now and then; here it is every time."""
    response = service.client.post(
        "/v1/jobs",
        data=b'{"name": "\xff\xfe"}',
        headers={**AUTH, "Content-Type": "application/json"},
    )
    case = schema["/v1/jobs"]["POST"].Case(body={}, media_type="application/json")
    case.validate_response(
        response,
        checks=[
            not_a_server_error,
            status_code_conformance,
            content_type_conformance,
            response_schema_conformance,
        ],
    )
    assert 400 <= response.status_code < 500
