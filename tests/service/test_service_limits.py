"""The service's caps hold on every path (issue 30), in process: FastAPI's ``TestClient``
with the app's lifespan, a real SQLite file, the real worker pool (models and plans priced
in processes of their own) and ``FakeRunner`` in place of Ray: a sweep's trials are held to
the caps as the job is, a floor on CPUs per worker, a bound on a model's size computed on
the meta device, admission by memory, and ``/v1/plan`` bounded, validated as a JobSpec is."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.fake_runner import FakeRunner
from support.polling import wait_for
from support.service_app import Service, spec, start
from support.slow_plugin import slow_plugin  # noqa: F401 (a fixture)

from service.domain.admission import PROCESS_BYTES
from service.runner import RayJobStatus

GiB = 2**30


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    fake = FakeRunner()
    app, client = start(tmp_path, fake, max_workers=2)
    with client:
        yield Service(app, client, fake)


def refused(service: Service, body: dict[str, Any]) -> list[dict[str, str]]:
    response = service.client.post("/v1/jobs", json=body)
    assert response.status_code == 422, response.text
    problems: list[dict[str, str]] = response.json()["problems"]
    return problems


def sweep(space: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    return spec("swept", kfac="auto", sweep={"space": space, "trials": 4}, **overrides)


# -- a sweep's trials ------------------------------------------------------------------------


def test_a_sweep_trial_over_the_worker_cap_is_refused_at_submission(service: Service) -> None:
    """scaling.workers drawn from {choice: [4]} on a service of --max-workers 2: refused
    when submitted, naming the trial, the cap and the fix; nothing reaches Ray."""
    [problem] = refused(service, sweep({"scaling.workers": {"choice": [1, 4]}}))
    assert problem["field"] == "sweep.space.scaling.workers"
    assert problem["message"] == (
        "a trial with scaling.workers = 4 (sweep.space): 4 workers is over this service's "
        "maximum of 2 (kaisa-ray serve --max-workers, $KAISA_RAY_MAX_WORKERS); ask for fewer"
    )
    assert service.fake.submitted == {}
    assert service.client.get("/v1/jobs").json()["total"] == 0
    ok = service.client.post("/v1/jobs", json=sweep({"scaling.workers": {"randint": [1, 2]}}))
    assert ok.status_code == 201, ok.text
    # What admission counts is the largest trial's: 2 workers of 1 CPU.
    stored = service.store.get(ok.json()["id"])
    assert stored.resources is not None
    assert stored.resources["cpus"] == 2


def test_the_job_s_own_workers_are_held_to_the_cap_as_before(service: Service) -> None:
    [problem] = refused(service, spec(scaling={"workers": 3}))
    assert problem["field"] == "scaling.workers"
    assert problem["message"].startswith("3 workers is over this service's maximum of 2")


# -- CPUs per worker -------------------------------------------------------------------------


def test_a_sliver_of_a_cpu_per_worker_is_refused(service: Service) -> None:
    """0.0001 CPU per worker let Ray pack 8 train workers (2.4 GB) on a 3-CPU head while
    admission counted a quarter of a CPU: refused, in the job and in a trial."""
    [problem] = refused(service, spec(scaling={"workers": 2, "cpus_per_worker": 0.0001}))
    assert problem["field"] == "scaling.cpus_per_worker"
    assert "0.0001 CPUs per worker is under this service's minimum of 0.5" in problem["message"]
    assert "--min-cpus-per-worker" in problem["message"]
    [problem] = refused(service, sweep({"scaling.cpus_per_worker": {"uniform": [0.01, 1]}}))
    assert problem["field"] == "sweep.space.scaling.cpus_per_worker"
    assert problem["message"].startswith("a trial with scaling.cpus_per_worker = 0.01")
    assert service.client.post("/v1/jobs", json=spec(scaling={"cpus_per_worker": 0.5})).is_success


# -- the model's size, on the meta device ------------------------------------------------------


def test_a_34_gb_model_is_refused_by_name(service: Service) -> None:
    """mlp with three hidden layers of 65536: each layer within its bound, the model 8.6e9
    parameters (34 GB in float32). Refused by what it is, computed on the meta device, with
    the cap and the fix; a trial whose batch makes a model too large, too."""
    huge = {"name": "mlp", "params": {"hidden": [65536, 65536, 65536]}}
    [problem] = refused(service, spec("huge", model=huge))
    assert problem["field"] == "model.params"
    message = problem["message"]
    assert message.startswith("mlp: 8.64e+09 parameters (32.2GiB in float32)")
    assert "over this service's maximum of 16.0GiB (kaisa-ray serve --max-model-bytes)" in message
    assert "use a smaller model or batch" in message
    wide = {"name": "mlp", "params": {"in_features": 2**20, "hidden": [1024]}}  # 4 GiB
    body = sweep({"dataset.batch_size": {"choice": [8, 65536]}}, model=wide)
    [problem] = refused(service, body)
    assert problem["message"].startswith("a trial with dataset.batch_size = 65536 (sweep.space)")
    assert service.fake.submitted == {}


def test_a_model_its_constructor_refuses_is_422_in_a_job_as_in_a_plan(service: Service) -> None:
    """BERT-Large's seq_len beyond its 512 positions: validated as a JobSpec (the types),
    then built on the meta device in a worker process (its constructor's own check)."""
    bert = {"name": "bert-large", "params": {"seq_len": 65536}}
    [problem] = refused(service, spec("bert", model=bert))
    assert problem["field"] == "model.params"
    assert "seq_len=65536 must be between 1 and max_position=512" in problem["message"]
    plan = {"model": "bert-large", "workers": 8, "batch_size": 8, "seq_len": 65536}
    response = service.client.post("/v1/plan", json=plan)
    assert response.status_code == 422, response.text
    assert "seq_len=65536 must be between 1 and max_position=512" in response.json()["detail"]


@pytest.mark.parametrize("hidden", [[-1], [0], [True]])
def test_plan_params_are_validated_as_a_job_spec_s(service: Service, hidden: list[Any]) -> None:
    """Before: 500 (and the connection closed). Now the JobSpec's own 422, the same words."""
    plan = {"model": "mlp", "workers": 8, "batch_size": 8, "params": {"hidden": hidden}}
    response = service.client.post("/v1/plan", json=plan)
    assert response.status_code == 422, response.text
    job = refused(service, spec(model={"name": "mlp", "params": {"hidden": hidden}}))
    [problem] = response.json()["problems"]
    assert problem["field"] == "params.hidden.0" if hidden != [True] else "params.hidden"
    assert problem["message"] == job[0]["message"]
    assert service.client.get("/healthz").status_code == 200


# -- admission by memory -----------------------------------------------------------------------


def test_admission_counts_memory_and_refuses_a_job_larger_than_the_cluster(
    tmp_path: Path,
) -> None:
    """The cluster's memory (Ray's memory resource) against each job's predicted memory
    (its workers' tensors and processes, every trial counted): a job that can never fit is
    refused at submission, naming the numbers; two that fit one at a time run one at a
    time, the second admitted when the first ends."""
    fake = FakeRunner()
    fake.cluster_memory = 4 * GiB
    app, client = start(tmp_path, fake)
    with client:
        service = Service(app, client, fake)
        big = {"name": "resnet20", "params": {}}  # 185 MiB of activations at batch 128
        [problem] = refused(
            service,
            spec("too-big", model=big, dataset={"name": "synthetic", "batch_size": 2048},
                 scaling={"workers": 4}),
        )  # fmt: skip
        assert problem["field"] == "scaling.workers"
        assert "4 worker(s) need about" in problem["message"]
        assert "more than the cluster's 4.0GiB (Ray's memory resource)" in problem["message"]
        half = {"name": "synthetic", "batch_size": 1024}  # about 1.8 GiB a worker
        first = service.submit("first", model=big, dataset=half)
        second = service.submit("second", model=big, dataset=half)
        need = service.store.get(first["id"]).resources
        assert need is not None
        assert 2.5 * GiB > need["memory_bytes"] > 1.5 * GiB, need
        assert need["memory_bytes"] > PROCESS_BYTES
        service.wait(first["id"], "admitted", lambda j: j["submission_id"] is not None)
        follower = app.state.runtime.follower
        passes = follower.passes
        wait_for(lambda: follower.passes >= passes + 3, "three more passes")
        assert service.job(second["id"])["queue_position"] == 1  # no room for both
        fake.finish(first["id"], RayJobStatus.SUCCEEDED)
        service.wait(second["id"], "admitted", lambda j: j["submission_id"] is not None)


# -- /v1/plan: bounded ------------------------------------------------------------------------

SLOW_PLAN = {"model": "slow-mlp", "params": {"seconds": 600}, "workers": 2, "batch_size": 8}


@pytest.mark.usefixtures("slow_plugin")
def test_plans_are_bounded_in_number_and_time_and_never_hold_the_service(
    tmp_path: Path,
) -> None:
    """One plan at a time (--max-plans 1), each for at most 3 s: a plan of a plugin model
    that takes minutes to build ends with 504 naming the limit and the CLI; a second plan
    while it runs is refused at once with 429 and Retry-After; the job list answers
    throughout; the worker that ran over is gone."""
    fake = FakeRunner()
    app, client = start(tmp_path, fake, max_plans=1, plan_timeout_s=3)
    with client:
        answers: dict[str, Any] = {}

        def slow_plan() -> None:
            answers["slow"] = client.post("/v1/plan", json=SLOW_PLAN)

        runner = threading.Thread(target=slow_plan)
        runner.start()
        plans = app.state.runtime.plans
        wait_for(lambda: plans.running == 1, "the plan to start", timeout_s=60)
        busy = client.post("/v1/plan", json=SLOW_PLAN)
        assert busy.status_code == 429, busy.text
        assert 1 <= int(busy.headers["Retry-After"]) <= 3
        assert "1 plans already running" in busy.json()["detail"]
        assert "--max-plans" in busy.json()["detail"]
        assert client.get("/v1/jobs").status_code == 200  # its p99: test_service_plan_burst
        pids = set(plans._pids)
        runner.join(timeout=60)
        slow = answers["slow"]
        assert slow.status_code == 504, slow.text
        detail = slow.json()["detail"]
        assert "over this service's time limit of 3 s" in detail
        assert "kaisa-ray plan" in detail
        assert plans.running == 0
        assert not plans._pids & pids  # killed
        metrics = client.get("/metrics").text
        assert 'kaisa_ray_plans_total{outcome="timeout"} 1.0' in metrics
        assert 'kaisa_ray_plans_total{outcome="busy"} 1.0' in metrics
        small = {"model": "lenet", "workers": 2, "batch_size": 32}  # milliseconds
        plans.timeout_s = 300  # whatever the load of the machine
        assert client.post("/v1/plan", json=small).status_code == 200  # a new worker
