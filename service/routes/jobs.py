"""The jobs API under ``/v1``: submit, list, read, follow (server-sent events), cancel and
delete jobs; their metric history and logs; and the registry of what a job may name and of
every closed set the answers use.

A module-level router: it reads the service's state and settings from the app
(``service.runtime``). The token is checked once, by the ``BearerAuth`` middleware, for every
``/v1`` route; the router only declares the scheme, so the API's schema shows it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Header, Query, Response, status
from fastapi.responses import PlainTextResponse
from fastapi.security import HTTPBearer
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.concurrency import run_in_threadpool

from kaisa_ray.enums import ComputeMethod, DistributedStrategy, KFACApprox, OptimizerName, Precision
from kaisa_train.records import TRIAL_METRICS, RecordKind, SweepMetric, TrialState, Unit
from kaisa_train.reference import STARTER, field_defaults
from kaisa_train.registry import dataset_names, model_names
from kaisa_train.spec import AUTO, JobSpec
from service.domain import limits
from service.domain.hub import EVERY_JOB
from service.domain.interpretation import EVENT_OF
from service.domain.job_logs import LogArchive
from service.domain.metric_views import CHARTS, COLUMNS, METRICS
from service.errors import JobNotFoundError, RayUnavailableError
from service.model.job_data import Job
from service.model.lifecycle import FINISHED, JobState
from service.routes.responses import (
    INVALID,
    NOT_FOUND,
    PLAIN_ROUTE_ERRORS,
    SSE_EVENT,
    TOO_MANY,
    UNAUTHORIZED,
    UNWRITABLE,
    error,
    json_error,
)
from service.routes.schemas import (
    JobDetail,
    JobList,
    JobView,
    MetricHistory,
    NamedMetric,
    Registry,
    job_detail,
    job_view,
    metric_point,
)
from service.runtime import Runtime, RuntimeDep

__all__ = ["registry_now", "router"]

BEARER = HTTPBearer(
    auto_error=False,
    description="the service's token ($KAISA_RAY_TOKEN or --token-file of kaisa-ray serve)",
)

router = APIRouter(
    # The scheme, for the API's schema; the BearerAuth middleware checks the token.
    dependencies=[Depends(BEARER)],
    responses=UNAUTHORIZED,
)


def registry_now() -> Registry:
    """The registry's answer: what is installed now, and the closed sets."""
    return Registry(
        models=model_names(),
        datasets=dataset_names(),
        optimizers=[name for name in OptimizerName if name.trainable],
        strategies=[*DistributedStrategy, AUTO],
        compute_methods=list(ComputeMethod),
        kfac_approximations=list(KFACApprox),
        precisions=list(Precision),
        job_states=list(JobState),
        finished_states=sorted(FINISHED),
        trial_states=list(TrialState),
        ended_trial_states=[s for s in TrialState if s.ended],
        sweep_metrics=[
            NamedMetric(name=m, direction=m.direction, unit=m.unit) for m in SweepMetric
        ],
        trial_metrics=list(TRIAL_METRICS),
        record_kinds=list(RecordKind),
        events={kind: name for kind, name in EVENT_OF.items()},
        units=list(Unit),
        metrics=METRICS,
        charts=CHARTS,
        columns=COLUMNS,
        defaults=field_defaults(),
        starter=STARTER,
    )


@router.post(
    "/jobs",
    status_code=status.HTTP_201_CREATED,
    response_model=JobView,
    responses={
        **error(409, "the idempotency key was used for a different spec"),
        **error(413, "the body is over the size limit"),
        **error(415, "the body is neither JSON nor YAML"),
        **TOO_MANY,
        **INVALID,
        **UNWRITABLE,
    },
    openapi_extra={
        "requestBody": {
            "content": {"application/yaml": {"schema": {"$ref": "#/components/schemas/JobSpec"}}}
        }
    },
    tags=["jobs"],
)
async def submit_job(
    spec: JobSpec,
    runtime: RuntimeDep,
    idempotency_key: Annotated[
        str | None,
        Header(
            max_length=200,
            description="send the same key again to get the same job, not a second one",
        ),
    ] = None,
) -> JobView:
    """Store a job as QUEUED; it starts on Ray when admission control lets it (its
    ``queue_position`` says how many are ahead). The body is JSON, or YAML with
    ``Content-Type: application/yaml``. The job, and each trial of a sweep, must be within
    the service's caps (workers, GPUs and CPUs per worker, the model's size, the cluster's
    memory: ``service.domain.limits``)."""
    memory = (await run_in_threadpool(runtime.follower.capacity)).memory_bytes
    need = await limits.check(spec, runtime.settings, runtime.pricer, memory)

    def store() -> JobView:
        job, created = runtime.jobs.create(
            spec.model_dump(mode="json"), idempotency_key, need.as_json()
        )
        if created:
            runtime.metrics.submissions.inc()
        return job_view(job, runtime.store.queue_position(job))

    return await run_in_threadpool(store)


@router.get("/jobs", response_model=JobList, responses=INVALID, tags=["jobs"])
async def list_jobs(
    runtime: RuntimeDep,
    state: Annotated[list[JobState] | None, Query(description="only these states")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    offset: Annotated[int, Query(ge=0, le=2**31)] = 0,
) -> Response:
    """Jobs, newest first."""
    wanted = tuple(sorted(set(state or ())))

    def read() -> bytes:
        jobs, total = runtime.store.page(states=wanted, limit=limit, offset=offset)
        more = offset + len(jobs) < total
        waiting = any(j.state is JobState.QUEUED and j.submission_id is None for j in jobs)
        queue = (
            {job_id: n + 1 for n, job_id in enumerate(runtime.store.queue())} if (waiting) else {}
        )
        return (
            JobList(
                jobs=[job_view(j, queue.get(j.id)) for j in jobs],
                total=total,
                limit=limit,
                offset=offset,
                next_offset=offset + len(jobs) if more else None,
            )
            .model_dump_json()
            .encode()
        )

    body = await runtime.views.get(("list", wanted, limit, offset), read)
    return Response(body, media_type="application/json")


@router.get(
    "/jobs/{job_id}",
    response_model=JobDetail,
    responses={**NOT_FOUND, **INVALID},
    tags=["jobs"],
)
async def get_job(job_id: str, runtime: RuntimeDep) -> Response:
    """A job: state, progress, latest metrics, the tuner's decision and table, a sweep's
    trials and best spec, history."""

    def read() -> bytes:
        job, transitions = runtime.store.detail(job_id)
        position = runtime.store.queue_position(job)
        return job_detail(job, transitions, position).model_dump_json().encode()

    body = await runtime.views.get(("job", job_id), read)
    return Response(body, media_type="application/json")


@router.get(
    "/jobs/{job_id}/metrics",
    response_model=MetricHistory,
    responses={**NOT_FOUND, **INVALID},
    tags=["jobs"],
)
def get_metrics(
    job_id: str,
    runtime: RuntimeDep,
    kind: Annotated[
        list[Literal["step", "eval", "intervals"]] | None,
        Query(
            description="only these kinds: step (a progress report), eval, intervals (each "
            "layer's K-FAC intervals and staleness)"
        ),
    ] = None,
    since: Annotated[int, Query(ge=0, le=2**31)] = 0,
    limit: Annotated[int, Query(ge=1, le=20_000)] = 10_000,
) -> MetricHistory:
    """The metric history: a point per progress report (step), evaluation (eval) and report
    of the K-FAC intervals (intervals)."""
    points = runtime.store.metrics(job_id, kinds=kind or (), since=since, limit=limit)
    return MetricHistory(
        job_id=job_id,
        points=[metric_point(m) for m in points],
        next_since=points[-1].seq + 1 if points else since,
    )


@router.get(
    "/jobs/{job_id}/events",
    response_class=EventSourceResponse,
    responses={
        200: {
            "description": "server-sent events: state (the job, on connect and on every "
            "change), progress, eval and tuner; for a sweep job, trial (a trial started, "
            "evaluated or ended: its record) and sweep (the result: every trial, the best "
            "and its spec); the stream ends when the job finishes",
            "content": {"text/event-stream": {"schema": SSE_EVENT}},
        },
        **NOT_FOUND,
        **INVALID,
    },
    tags=["jobs"],
)
async def job_events(job_id: str, runtime: RuntimeDep) -> EventSourceResponse:
    """Follow a job live."""
    await run_in_threadpool(runtime.store.get, job_id)  # 404 before the stream starts
    return EventSourceResponse(_stream(runtime, job_id), ping=15)


@router.get(
    "/events",
    response_class=EventSourceResponse,
    responses={
        200: {
            "description": "server-sent events of every job: ready (once subscribed: "
            "what happens from then on is sent), state (a JobView, on every change), "
            "progress, eval, tuner, trial and sweep (records with job_id), deleted",
            "content": {"text/event-stream": {"schema": SSE_EVENT}},
        },
    },
    tags=["jobs"],
)
async def all_events(runtime: RuntimeDep) -> EventSourceResponse:
    """Follow every job live (the dashboard's job list)."""
    return EventSourceResponse(_stream_all(runtime), ping=15)


@router.get("/registry", response_model=Registry, tags=["jobs"])
async def registry() -> Registry:
    """What a JobSpec may name (models and datasets, built in and from installed plugins) and
    every closed set the API's answers use (job and trial states, strategies, compute
    methods, precisions, record kinds, sweep metrics): the dashboard reads them here."""
    return registry_now()


@router.get(
    "/jobs/{job_id}/logs",
    response_class=PlainTextResponse,
    responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
        **PLAIN_ROUTE_ERRORS,
        **json_error(404, "no such job"),
        **json_error(503, "Ray cannot be reached"),
        **json_error(422, "bad parameters or body", "ValidationErrorBody"),
    },
    tags=["jobs"],
)
def job_logs(job_id: str, runtime: RuntimeDep) -> PlainTextResponse:
    """The job driver's log (the Ray Job's output): the service's copy of each ended life of
    the job (a finished job's, kept past Ray's and past restarts; an earlier life of a job a
    restart resumed), then the live log of the life now in Ray; empty before the job reached
    Ray."""
    job = runtime.store.get(job_id)
    logs = runtime.jobs.logs
    kept = (logs.read(job.id) if logs is not None else None) or ""
    sid = job.submission_id
    if sid is None or (job.state.finished and LogArchive.header(sid) in kept):
        return PlainTextResponse(kept)
    try:
        text = runtime.jobs.runner.logs(sid)
    except Exception as err:
        if kept:  # what is kept, and why the rest is missing
            return PlainTextResponse(f"{kept}[the log of Ray Job {sid} cannot be read: {err}]\n")
        raise RayUnavailableError(f"cannot read the job's log from Ray: {err}") from err
    return PlainTextResponse(kept + text)


@router.post(
    "/jobs/{job_id}/cancel",
    response_model=JobView,
    responses={
        **NOT_FOUND,
        **error(409, "the job already finished otherwise"),
        **TOO_MANY,
        **INVALID,
        **UNWRITABLE,
    },
    tags=["jobs"],
)
def cancel_job(job_id: str, runtime: RuntimeDep) -> JobView:
    """Stop a job: CANCELLING now, CANCELLED when Ray has stopped it. Idempotent."""
    return job_view(runtime.jobs.cancel(job_id))


@router.delete(
    "/jobs/{job_id}",
    status_code=status.HTTP_204_NO_CONTENT,
    response_class=Response,
    responses={**NOT_FOUND, **error(409, "the job is not finished"), **INVALID, **UNWRITABLE},
    tags=["jobs"],
)
def delete_job(job_id: str, runtime: RuntimeDep) -> Response:
    """Forget a finished job and its history."""
    runtime.jobs.delete(job_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


async def _view_json(runtime: Runtime, job: Job) -> str:
    """A job's view as JSON, with its place in the queue while it waits."""
    position = None
    if job.state is JobState.QUEUED and job.submission_id is None:
        position = await run_in_threadpool(runtime.store.queue_position, job)
    return job_view(job, position).model_dump_json()


async def _stream(runtime: Runtime, job_id: str) -> AsyncIterator[ServerSentEvent]:
    """The job's state now, then every update until the one of its finishing.

    The stream ends on the update that says the job finished, not on a read of the store
    that finds it finished: a stream behind the follower reads a state update of the past
    (RUNNING, say) when the store already says SUCCEEDED, and the records published between
    the two must still be sent."""
    async with runtime.jobs.hub.subscribe(job_id) as queue:
        job = await run_in_threadpool(runtime.store.get, job_id)
        yield ServerSentEvent(await _view_json(runtime, job), event="state")
        finished = job.state.finished
        while not finished:
            update = await queue.get()
            if update.kind == "state":
                said = JobState(update.data["state"])
                try:
                    job = await run_in_threadpool(runtime.store.get, job_id)
                except JobNotFoundError:
                    return
                if job.state.finished and not said.finished:
                    continue  # a past update: its finishing one, and what came before, follow
                yield ServerSentEvent(await _view_json(runtime, job), event="state")
                finished = said.finished
            else:
                yield ServerSentEvent(json.dumps(update.data), event=update.kind)
    await asyncio.sleep(0)


async def _stream_all(runtime: Runtime) -> AsyncIterator[ServerSentEvent]:
    """``ready`` once subscribed, then every job's updates."""
    async with runtime.jobs.hub.subscribe(EVERY_JOB) as queue:
        yield ServerSentEvent(json.dumps({"subscribed": True}), event="ready")
        while True:
            update = await queue.get()
            if update.kind == "state":
                try:
                    job = await run_in_threadpool(runtime.store.get, update.job_id)
                except JobNotFoundError:
                    continue
                yield ServerSentEvent(await _view_json(runtime, job), event="state")
            else:
                data = {"job_id": update.job_id, **update.data}
                yield ServerSentEvent(json.dumps(data), event=update.kind)
