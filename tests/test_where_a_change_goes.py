"""docs/layout.md's "Where a change goes", done: a new model and a new REST endpoint, each in
the files that page names and nowhere else (a new record kind is checked by
``test_definitions.py``: its enum member, its class and the union must agree)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi import APIRouter
from pydantic import BaseModel
from support.fake_runner import FakeRunner
from support.service_app import TOKEN, make_client
from torch import nn

from kaisa_train import registry, shapes
from kaisa_train.spec import JobSpecError, constructor_params, parse_job_spec
from service.app import API_VERSION, create_app
from service.settings import Settings


class Tiny(nn.Module):
    """A model as a plugin or ``models.py`` defines one: keyword parameters, typed."""

    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, hidden), nn.Linear(hidden, 10))

    def forward(self, x: Any) -> Any:
        return self.body(x)


def spec(**model: Any) -> dict[str, Any]:
    return {
        "name": "tiny",
        "model": {"name": "tiny", **model},
        "dataset": {"name": "synthetic", "batch_size": 8},
        "stop": {"max_steps": 10},
    }


def test_a_new_model_is_one_entry_in_the_registry(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``registry.py`` (or a package's ``kaisa_ray.models`` entry point), and ``shapes.py``'s
    ``PLANNING`` for ``kaisa-ray plan`` (its example input): the JobSpec takes it with its
    parameters checked against the constructor, the planner prices it, and the service lists
    it for the dashboard's form."""
    monkeypatch.setitem(registry.BUILTIN_MODELS, "tiny", Tiny)
    monkeypatch.setitem(
        shapes.PLANNING,
        "tiny",
        shapes.Planning(example_input=lambda model, n: torch.empty(n, 1, 28, 28, device="meta")),
    )
    constructor_params.cache_clear()
    job = parse_job_spec(spec(params={"hidden": 16}))
    assert job.model.params == {"hidden": 16}
    with pytest.raises(JobSpecError, match="model 'tiny' takes no parameter 'hiden'"):
        parse_job_spec(spec(params={"hiden": 16}))
    priced = shapes.workload("tiny", params={"hidden": 16}, batch_size=8)
    assert [(layer.name, layer.a_dim, layer.g_dim) for layer in priced.layers] == [
        ("body.1", 28 * 28 + 1, 16),
        ("body.2", 16 + 1, 10),
    ]
    app = create_app(Settings(data_dir=tmp_path, token=TOKEN), runner=FakeRunner())
    with make_client(app) as client:
        assert "tiny" in client.get(f"/{API_VERSION}/registry").json()["models"]
    constructor_params.cache_clear()


class Echo(BaseModel):
    said: str


def test_a_new_endpoint_is_a_router_the_app_includes(tmp_path: Path) -> None:
    """A module-level router (as ``routes/jobs.py``, ``routes/plan.py``) included under
    ``/v1``: the token is checked for it with no code of its own (the one auth path, the
    BearerAuth middleware), and the API's schema documents it."""
    router = APIRouter(tags=["echo"])

    @router.get("/echo", response_model=Echo)
    def echo(said: str) -> Echo:
        return Echo(said=said)

    app = create_app(Settings(data_dir=tmp_path, token=TOKEN), runner=FakeRunner())
    app.include_router(router, prefix=f"/{API_VERSION}")
    with make_client(app) as client:
        assert client.get(f"/{API_VERSION}/echo", params={"said": "hi"}).json() == {"said": "hi"}
        refused = client.get(
            f"/{API_VERSION}/echo", params={"said": "hi"}, headers={"Authorization": "Bearer wrong"}
        )
        assert refused.status_code == 401
        assert "/v1/echo" in client.get("/openapi.json").json()["paths"]
