"""``POST /v1/plan`` and ``GET /v1/plan/hardware`` in-process (FastAPI's ``TestClient`` with
the app's lifespan, a SQLite file and ``FakeRunner`` for Ray): the same plan as the CLI's,
from a model or a JobSpec, the token required, bad bodies named, and no job created."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
from support.fake_runner import FakeRunner
from support.service_app import TOKEN, anonymous, start

from kaisa_train.planning import PlanRequest, plan_job

if TYPE_CHECKING:
    from starlette.testclient import TestClient


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    fake = FakeRunner()
    _, test_client = start(tmp_path_factory.mktemp("plan-api"), fake)
    with test_client:
        yield test_client
    assert not fake.submitted  # planning never starts anything on Ray


def post(client: TestClient, body: dict[str, Any], code: int = 200) -> dict[str, Any]:
    response = client.post("/v1/plan", json=body)
    assert response.status_code == code, response.text
    found: dict[str, Any] = response.json()
    return found


def test_the_presets_are_listed(client: TestClient) -> None:
    response = client.get("/v1/plan/hardware")
    assert response.status_code == 200
    presets = {p["name"]: p for p in response.json()}
    assert presets["a100-80gb-hdr"]["gpu"] == "NVIDIA A100-SXM4-80GB"
    assert presets["h100-80gb-ndr"]["gpus_per_node"] == 8
    assert presets["a100-80gb-hdr"]["memory_bytes"] == 80 * 2**30


def test_a_model_is_planned_as_the_cli_plans_it(client: TestClient) -> None:
    body = {
        "model": "resnet50",
        "workers": 32,
        "batch_size": 32,
        "budgets": ["40GB", "4GiB"],
        "intervals": [[10, 100]],
    }
    report = post(client, body)
    expected = plan_job(
        PlanRequest(
            model="resnet50",
            batch_size=32,
            workers=32,
            hardware="a100-80gb-hdr",
            budgets=(40 * 10**9, 4 * 2**30),
            intervals=((10, 100),),
        )
    ).to_json()
    assert report == expected
    assert [c["budget_bytes"] for c in report["choices"]] == [40 * 10**9, 4 * 2**30]
    assert report["choices"][0]["chosen"]["strategy"].startswith(("HYBRID-OPT", "MEM-OPT"))
    assert report["choices"][1]["chosen"] is None
    assert "no strategy fits the memory budget" in report["choices"][1]["reason"]


def test_a_model_with_its_tokens_reduced_is_planned_as_the_cli_plans_it(
    client: TestClient,
) -> None:
    body = {"model": "bert-large", "workers": 8, "batch_size": 8, "seq_len": 128}
    report = post(client, {**body, "sequence_approx": "reduce"})
    expected = plan_job(
        PlanRequest(
            model="bert-large",
            params={"seq_len": 128},
            batch_size=8,
            workers=8,
            hardware="a100-80gb-hdr",
            sequence_approx="reduce",
        )
    ).to_json()
    assert report == expected
    assert report["inputs"]["sequence_approx"] == "reduce"


def test_a_job_spec_is_planned_with_its_settings(client: TestClient) -> None:
    spec = {
        "name": "bert-phase1",
        "model": {"name": "bert-large", "params": {"seq_len": 128}},
        "dataset": {"name": "synthetic", "batch_size": 16},
        "kfac": {"strategy": "mem-opt", "factor_update_steps": 1, "inv_update_steps": 10},
        "precision": "bf16",
        "memory_budget": "40GB",
        "scaling": {"workers": 8},
        "stop": {"max_steps": 10},
    }
    report = post(client, {"spec": spec, "hardware": "h100-80gb-ndr", "accumulation_steps": 4})
    inputs = report["inputs"]
    assert (inputs["model"], inputs["workers"], inputs["batch_size"]) == ("bert-large", 8, 16)
    assert (inputs["precision"], inputs["seq_len"], inputs["spec_strategy"]) == (
        "bf16",
        128,
        "mem-opt",
    )
    assert inputs["accumulation_steps"] == 4
    assert inputs["hardware"] == "h100-80gb-ndr"
    assert [c["budget_bytes"] for c in report["choices"]] == [40 * 10**9]
    assert len(report["strategies"]) == 4  # f = 1/8, 1/4, 1/2, 1


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"model": "resnet50", "workers": 8}, "give spec, or model with workers and batch_size"),
        (
            {"model": "resnet50", "workers": 8, "batch_size": 32, "hardware": "/etc/passwd"},
            "unknown hardware '/etc/passwd': one of a100-80gb-hdr, h100-80gb-ndr",
        ),
        (
            {"model": "resnet50", "workers": 8, "batch_size": 32, "params": {"depth": 101}},
            "params.depth: model 'resnet50' takes no parameter 'depth'",  # as a JobSpec's
        ),
        (
            {"model": "nope", "workers": 8, "batch_size": 32},
            "unknown model 'nope'",
        ),
    ],
)
def test_a_job_that_cannot_be_planned_says_why(
    client: TestClient, body: dict[str, Any], message: str
) -> None:
    found = post(client, body, 422)
    assert message in found["detail"]


def test_bad_fields_are_named(client: TestClient) -> None:
    found = post(client, {"model": "resnet50", "workers": 100000, "batch_size": 0, "x": 1}, 422)
    fields = {p["field"] for p in found["problems"]}
    assert {"workers", "batch_size", "x"} <= fields
    bad_spec = post(client, {"spec": {"name": "j", "model": {"name": "lenet"}}}, 422)
    assert any(p["field"].startswith("spec.") for p in bad_spec["problems"])


def test_a_plan_goes_up_to_65536_gpus_as_on_the_command_line(client: TestClient) -> None:
    body = {"model": "lenet", "workers": 65536, "batch_size": 64, "intervals": [[10, 100]]}
    report = post(client, body)
    assert (
        report
        == plan_job(
            PlanRequest(
                model="lenet",
                batch_size=64,
                workers=65536,
                hardware="a100-80gb-hdr",
                intervals=((10, 100),),
            )
        ).to_json()
    )
    assert len(report["strategies"]) == 17  # f = 2^k / 65536
    assert report["inputs"]["nodes"] == 8192
    found = post(client, {**body, "workers": 65537}, 422)
    assert [p["field"] for p in found["problems"]] == ["workers"]


def test_the_token_is_required(client: TestClient) -> None:
    response = anonymous(client, "POST", "/v1/plan", json={"model": "lenet"})
    assert response.status_code == 401
    assert anonymous(client, "GET", "/v1/plan/hardware").status_code == 401
    assert TOKEN not in response.text


def test_the_route_is_in_the_openapi_schema(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    operation = schema["paths"]["/v1/plan"]["post"]
    assert set(operation["responses"]) >= {"200", "401", "422"}
    assert "PlanBody" in schema["components"]["schemas"]


def test_plans_do_not_create_jobs(client: TestClient) -> None:
    post(client, {"model": "lenet", "workers": 2, "batch_size": 64})
    assert client.get("/v1/jobs").json()["total"] == 0


def test_a_sharded_job_is_planned_sharded(client: TestClient) -> None:
    """A JobSpec that says ``scaling.parallel: fsdp`` is planned with FSDP2's gather."""
    spec = {
        "name": "sharded",
        "model": {"name": "resnet50"},
        "dataset": {"name": "synthetic", "batch_size": 32},
        "kfac": {"strategy": "mem-opt"},
        "scaling": {"workers": 8, "parallel": "fsdp"},
        "stop": {"max_steps": 100},
    }
    report = post(client, {"spec": spec})
    assert report["inputs"]["parallel"] == "fsdp"
    by_workers = {s["grad_workers"]: s["collectives"] for s in report["strategies"]}
    assert by_workers[8]["gradient_rows"]["calls"] == 1  # COMM-OPT's all-gather
    assert by_workers[1]["gradient_rows"]["calls"] > 1  # MEM-OPT's gathers to the workers
