"""``POST /v1/plan``: what a job would cost on GPUs of a hardware preset, and what the tuner
would choose there (``kaisa-ray plan`` over REST); ``GET /v1/plan/hardware`` lists the presets.

The body is a JobSpec (``spec``) or a model with workers and a batch size, plus the hardware
preset and the budgets to sweep. Only the presets shipped with kaisa-ray can be named: a
client never makes the service read a file. The body, the model's ``params`` included, is
checked here as a JobSpec's are (422, never 500). Planning is pure computation on shapes (no
Ray, no GPU, no job is created) and can take minutes: it runs in a worker process of the
service's plan pool (``service.worker_pool``), at most ``--max-plans`` at once (429 beyond),
each for at most ``--plan-timeout-s`` (504), ended when its client goes, bounded by
``MAX_WORKERS``.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.security import HTTPBearer
from pydantic import BaseModel, ByteSize, ConfigDict, Field, ValidationError

from kaisa_ray.enums import ComputeMethod, KFACApprox, OptimizerName, Precision
from kaisa_ray.errors import ConfigurationError
from kaisa_train.planning import (
    PlanRequest,
    hardware_names,
    load_hardware,
    request_from_spec,
)
from kaisa_train.spec import JobSpec, ModelSpec
from service.routes.schemas import ErrorBody, ValidationErrorBody
from service.runtime import RuntimeDep
from service.worker_pool import PoolTimeoutError, WorkRefusedError

MAX_WORKERS = 65536
"""The largest world size a plan is computed for over REST, as for ``kaisa-ray plan``: a plan
prices the grid's columns and classes of rows, not every rank, so its cost barely grows with
the world size (measured: ``benchmarks/plan_speed.py``)."""

Interval = tuple[Annotated[int, Field(ge=1)], Annotated[int, Field(ge=1)]]


class PlanBody(BaseModel):
    """A job to plan: ``spec`` (a JobSpec), or ``model`` with ``workers`` and
    ``batch_size``; the other fields override the spec's or the defaults."""

    model_config = ConfigDict(extra="forbid")

    spec: JobSpec | None = None
    model: str | None = Field(None, description="a registered model: resnet50, bert-large, ...")
    params: dict[str, Any] = Field(default_factory=dict, description="the model's parameters")
    workers: Annotated[int, Field(ge=1, le=MAX_WORKERS)] | None = None
    batch_size: Annotated[int, Field(ge=1, le=2**20)] | None = None
    hardware: str = Field("a100-80gb-hdr", description="a preset: GET /v1/plan/hardware")
    budgets: Annotated[list[ByteSize], Field(max_length=32)] = Field(
        default_factory=list,
        description="memory budgets per GPU to sweep ('40GiB'); default: the spec's "
        "memory_budget, else the GPU's memory",
    )
    gpus_per_node: Annotated[int, Field(ge=1, le=1024)] | None = None
    intervals: Annotated[list[Interval], Field(min_length=1, max_length=16)] | None = None
    precision: Precision | None = None
    kfac_approx: KFACApprox | None = None
    sequence_approx: KFACApprox | None = Field(
        None, description="Linear layers' tokens: every token a row, or one per sequence"
    )
    compute_method: ComputeMethod | None = None
    optimizer: OptimizerName | None = None
    accumulation_steps: Annotated[int, Field(ge=1, le=65536)] = 1
    seq_len: Annotated[int, Field(ge=1, le=65536)] | None = None
    skip_layers: Annotated[list[str], Field(max_length=64)] | None = None


class PlanResult(BaseModel):
    """``kaisa-ray plan --json``: inputs, the model's shapes, what the prediction rests on,
    memory, collectives and candidates per strategy, the choice per budget, and the budgets
    where the choice changes."""

    inputs: dict[str, Any]
    model: dict[str, Any]
    basis: dict[str, Any]
    strategies: list[dict[str, Any]]
    choices: list[dict[str, Any]]
    changes: list[dict[str, Any]]


class HardwarePreset(BaseModel):
    name: str
    description: str
    gpu: str
    memory_bytes: int
    gpus_per_node: int


def refused(message: str, field: str = "body") -> RequestValidationError:
    """A body that names no job to plan, as the API answers every bad body: 422 with the
    field and the reason (``service.app``'s handler writes it)."""
    return RequestValidationError(
        [{"type": "value_error", "loc": ("body", field), "msg": message, "input": None}]
    )


def _request(body: PlanBody) -> PlanRequest:
    if body.hardware not in hardware_names():
        raise refused(
            f"unknown hardware {body.hardware!r}: one of {', '.join(hardware_names())} "
            "(GET /v1/plan/hardware); a measured profile is used with the CLI's --hardware FILE",
            "hardware",
        )
    budgets = tuple(int(b) for b in body.budgets)
    if body.spec is not None:
        if body.model is not None:
            raise refused("give spec or model (with workers and batch_size), not both")
        request = request_from_spec(body.spec, body.hardware, budgets, body.gpus_per_node)
    else:
        if body.model is None or body.workers is None or body.batch_size is None:
            raise refused("give spec, or model with workers and batch_size")
        request = PlanRequest(
            model=body.model,
            batch_size=body.batch_size,
            workers=body.workers,
            hardware=body.hardware,
            budgets=budgets,
            gpus_per_node=body.gpus_per_node,
        )
    params = {**request.params, **body.params}
    if body.seq_len is not None:
        params["seq_len"] = body.seq_len
    overrides: dict[str, Any] = {"params": params, "accumulation_steps": body.accumulation_steps}
    for name in (
        "workers",
        "batch_size",
        "precision",
        "kfac_approx",
        "sequence_approx",
        "compute_method",
    ):
        value = getattr(body, name)
        if value is not None:
            overrides[name] = value
    if body.optimizer is not None:
        overrides["optimizer"] = body.optimizer
    if body.intervals is not None:
        overrides["intervals"] = tuple(tuple(pair) for pair in body.intervals)
    if body.skip_layers is not None:
        overrides["skip_layers"] = tuple(body.skip_layers)
    _params_fit_the_model(request.model, params)
    request = dataclasses.replace(request, **overrides)
    if request.workers > MAX_WORKERS:
        raise refused(
            f"workers={request.workers}: plans go up to {MAX_WORKERS} GPUs here", "workers"
        )
    return request


def _params_fit_the_model(model: str, params: dict[str, Any]) -> None:
    """The model and its ``params`` checked exactly as a JobSpec's ``model`` section is
    (names, types and bounds against the constructor): 422 naming each problem."""
    try:
        ModelSpec(name=model, params=params)
    except ValidationError as err:
        problems = []
        for item in err.errors():
            loc = tuple(item.get("loc", ()))
            where = ("model",) if loc[:1] == ("name",) else loc  # the body's own field names
            problems.append({**item, "loc": ("body", *where)})
        raise RequestValidationError(problems) from None


router = APIRouter(
    tags=["plan"],
    dependencies=[Depends(HTTPBearer(auto_error=False))],  # the token, as every /v1 route
    responses={401: {"model": ErrorBody, "description": "no token, or a wrong one"}},
)


@router.post(
    "/plan",
    status_code=status.HTTP_200_OK,
    response_model=PlanResult,
    responses={
        413: {"model": ErrorBody, "description": "the body is over the size limit"},
        422: {"model": ValidationErrorBody, "description": "a bad body, or a job not to plan"},
        429: {
            "model": ErrorBody,
            "description": "over the rate limit of POSTs per client (the service's middleware "
            "applies it to every POST), or --max-plans plans already running: retry after "
            "Retry-After seconds",
            "headers": {
                "Retry-After": {
                    "description": "seconds to wait before retrying",
                    "schema": {"type": "integer"},
                }
            },
        },
        503: {"model": ErrorBody, "description": "the service is stopping"},
        504: {
            "model": ErrorBody,
            "description": "the plan took longer than the service's --plan-timeout-s (plan it "
            "with `kaisa-ray plan` instead)",
        },
    },
)
async def plan(body: PlanBody, request: Request, runtime: RuntimeDep) -> PlanResult:
    """Price K-FAC for a job on GPUs of a hardware preset: memory and collectives per
    strategy, the time per step and its parts per candidate, the tuner's choice per budget."""
    try:
        wanted = _request(body)
    except ConfigurationError as err:
        raise refused(str(err)) from err
    task = {"kind": "plan", "request": dataclasses.asdict(wanted)}
    try:
        report = await runtime.plans.run(task, cancelled=request.is_disconnected)
    except WorkRefusedError as err:
        raise refused(str(err)) from err
    except PoolTimeoutError as err:
        raise PoolTimeoutError(
            f"the plan of {wanted.model} on {wanted.workers} GPUs took too long: {err}. Plan "
            "it on your own machine with `kaisa-ray plan` (no limit there), or ask for fewer "
            "workers"
        ) from err
    return PlanResult.model_validate(report)


@router.get("/plan/hardware", response_model=list[HardwarePreset])
def hardware() -> list[HardwarePreset]:
    """The hardware presets a plan can be priced on."""
    presets = []
    for name in hardware_names():
        found = load_hardware(name)
        presets.append(
            HardwarePreset(
                name=found.name,
                description=found.description,
                gpu=found.gpu_name,
                memory_bytes=int(found.memory_bytes.value),
                gpus_per_node=found.node_size,
            )
        )
    return presets
