"""The FastAPI application: the REST API under ``/v1``, health, readiness and Prometheus.

``create_app(settings)`` builds it; its lifespan opens the store, connects to Ray (or starts
the embedded head), and runs the follower. Tests pass a fake ``runner``.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import json
import logging
import os
import secrets
import signal
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request, Response, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from kaisa_ray.train.registry import dataset_names, model_names
from kaisa_ray.train.spec import JobSpec, field_problems
from service.errors import JobNotFoundError, RayUnavailableError, ServiceError, UnauthorizedError
from service.head import RayHead
from service.hub import EVERY_JOB, Hub
from service.jobs import Follower, Jobs
from service.lifecycle import JobState
from service.metrics import ServiceMetrics
from service.middleware import BearerAuth, BodyLimit, RateLimit, SecurityHeaders, SpecBody, Timing
from service.plan_routes import router as plan_router
from service.runner import RayRunner, Runner
from service.schemas import (
    ErrorBody,
    FieldProblem,
    Health,
    JobDetail,
    JobList,
    JobView,
    MetricHistory,
    Registry,
    ValidationErrorBody,
    job_detail,
    job_view,
    metric_point,
)
from service.settings import Settings
from service.store import Job, JobStore, sole_writer
from service.views import ViewCache

logger = logging.getLogger(__name__)

API_VERSION = "v1"
_bearer = HTTPBearer(
    auto_error=False,
    description="the service's token ($KAISA_RAY_TOKEN or --token-file of kaisa-ray serve)",
)


def _error(code: int, what: str) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorBody, "description": what}}


def _json_error(code: int, what: str, model: str = "ErrorBody") -> dict[int | str, dict[str, Any]]:
    """An error of a route whose success is not JSON: FastAPI would document a ``model`` under
    the route's media type (text/plain), but errors are always JSON."""
    schema = {"$ref": f"#/components/schemas/{model}"}
    return {code: {"description": what, "content": {"application/json": {"schema": schema}}}}


PLAIN_ROUTE_ERRORS = {
    **_json_error(401, "no token, or a wrong one"),
    **_json_error(500, "an internal error (see the log)"),
}


# One server-sent event, as OpenAPI tools read a stream: each event's fields.
SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "event": {
            "type": "string",
            "enum": ["state", "progress", "eval", "tuner", "trial", "sweep", "ready", "deleted"],
        },
        "data": {"type": "string", "description": "JSON: a JobView for state, else a record"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
    "required": ["data"],
}
UNAUTHORIZED = _error(401, "no token, or a wrong one")
NOT_FOUND = _error(404, "no such job")
INVALID: dict[int | str, dict[str, Any]] = {
    422: {"model": ValidationErrorBody, "description": "bad parameters or body"}
}
TOO_MANY: dict[int | str, dict[str, Any]] = {
    429: {
        "model": ErrorBody,
        "description": "over the rate limit of POSTs per client: retry after Retry-After seconds",
        "headers": {
            "Retry-After": {
                "description": "seconds to wait before retrying",
                "schema": {"type": "integer"},
            }
        },
    }
}


def _within_the_cluster(spec: JobSpec, settings: Settings) -> None:
    """The service's own maximums (below the JobSpec's): 422 naming the field and the knob."""
    problems = []
    if spec.scaling.workers > settings.max_workers:
        problems.append(
            (
                ("body", "scaling", "workers"),
                f"{spec.scaling.workers} workers is over this service's maximum of "
                f"{settings.max_workers} (kaisa-ray serve --max-workers, "
                "$KAISA_RAY_MAX_WORKERS); ask for fewer",
            )
        )
    if spec.scaling.gpus_per_worker > settings.max_gpus_per_worker:
        problems.append(
            (
                ("body", "scaling", "gpus_per_worker"),
                f"{spec.scaling.gpus_per_worker:g} GPUs per worker is over this service's "
                f"maximum of {settings.max_gpus_per_worker:g} (--max-gpus-per-worker); ask "
                "for fewer",
            )
        )
    if problems:
        raise RequestValidationError(
            [{"loc": loc, "msg": message, "type": "cluster_maximum"} for loc, message in problems]
        )


@dataclass
class Runtime:
    """What the lifespan opened, kept on ``app.state.runtime``."""

    settings: Settings
    store: JobStore
    jobs: Jobs
    follower: Follower
    metrics: ServiceMetrics
    views: ViewCache
    head: RayHead | None = None


def _connect(settings: Settings) -> tuple[Runner, RayHead | None]:
    """Ray for the service: the configured cluster, or the embedded head (adopted after a
    restart, else started)."""
    from service.head import adopt_or_start

    head = None
    address = settings.ray_address
    if address is None:
        head, adopted = adopt_or_start(settings.data_dir, num_cpus=settings.head_cpus)
        address = head.gcs_address
        # Ray reads its auth settings when first imported: this must precede RayRunner.
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ["RAY_AUTH_TOKEN"] = head.token
        logger.info("%s embedded Ray head %s", "adopted" if adopted else "started", address)
    runner = RayRunner(
        address,
        dashboard_url=settings.dashboard_url,
        storage_path=settings.storage,
        driver_cpus=settings.driver_cpus,
    )
    return runner, head


def create_app(settings: Settings | None = None, *, runner: Runner | None = None) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # A second service on the database or the data directory: refused.
        with sole_writer(settings.database, settings.data_dir):
            store = await run_in_threadpool(JobStore, settings.database)
            head = None
            if runner is not None:
                active: Runner = runner
            else:
                handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
                active, head = await run_in_threadpool(_connect, settings)
                # ray.init installs Ray's own SIGTERM handler, which aborts the process: put
                # uvicorn's back, so that SIGTERM drains (the lifespan's end below) as SIGINT
                # does. Only the main thread may set handlers: the lifespan runs there.
                for sig, handler in handlers.items():
                    if callable(handler) and threading.current_thread() is threading.main_thread():
                        signal.signal(sig, handler)
            jobs = Jobs(store, active, Hub(), idempotency_ttl_s=settings.idempotency_ttl_s)
            follower = Follower(
                jobs,
                interval_s=settings.poll_interval_s,
                status_interval_s=settings.status_interval_s,
                max_running=settings.max_running,
                driver_cpus=settings.driver_cpus,
                lost_grace_s=settings.lost_grace_s,
            )
            runtime = Runtime(
                settings, store, jobs, follower, metrics, ViewCache(store.version_now), head
            )
            metrics.bind(store)
            app.state.runtime = runtime
            follower.start()
            # What start-up loaded (Ray, torch, pydantic's schemas: some 300 000 objects) lives
            # as long as the process; left to the collector, every full collection walks it all
            # (150 ms here), a pause every request in flight waits for. Freeze it.
            gc.collect()
            gc.freeze()
            try:
                yield
            finally:
                logger.info("shutting down: the follower, Ray, the embedded head, the store")
                gc.unfreeze()  # collectable again (a process may build more than one app)
                follower.stop()
                await run_in_threadpool(active.close)
                if head is not None:
                    await run_in_threadpool(head.stop)
                store.close()
                logger.info("shutdown complete")

    metrics = ServiceMetrics()
    app = FastAPI(
        title="kaisa-ray",
        version="0.1.0",
        summary="K-FAC training jobs on Ray: submit, follow, cancel.",
        lifespan=lifespan,
        responses={500: {"model": ErrorBody, "description": "an internal error (see the log)"}},
        docs_url=None,  # served by _pages from the swagger-ui-bundle package, not a CDN
        redoc_url=None,
    )
    app.state.settings = settings
    _handlers(app)
    app.include_router(_api(settings), prefix=f"/{API_VERSION}")
    app.include_router(plan_router, prefix=f"/{API_VERSION}")
    app.include_router(_health(settings))
    app.include_router(_pages())
    app.mount("/static/vendor/swagger", StaticFiles(directory=swagger_ui()), name="swagger")
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    # The outermost last: Timing > SecurityHeaders > RateLimit > BearerAuth > BodyLimit > SpecBody.
    app.add_middleware(SpecBody, path=f"/{API_VERSION}/jobs")
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(BearerAuth, token=settings.secret, prefixes=(f"/{API_VERSION}", "/metrics"))
    app.add_middleware(
        RateLimit,
        rate=settings.post_rate,
        burst=settings.post_burst,
        prefixes=(f"/{API_VERSION}",),
    )
    app.add_middleware(SecurityHeaders, headers=SECURITY_HEADERS)
    app.add_middleware(Timing, observe=metrics.observe, prefixes=(f"/{API_VERSION}",))
    return app


async def _runtime(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


def _authorizer(settings: Settings) -> Any:
    expected = settings.token.get_secret_value() if settings.token else None

    async def authorize(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    ) -> None:
        if expected is None:
            return
        given = credentials.credentials if credentials is not None else ""
        if credentials is None or not secrets.compare_digest(given.encode(), expected.encode()):
            raise UnauthorizedError

    return authorize


RuntimeDep = Annotated[Runtime, Depends(_runtime)]


def _api(settings: Settings) -> APIRouter:
    router = APIRouter(dependencies=[Depends(_authorizer(settings))], responses=UNAUTHORIZED)

    @router.post(
        "/jobs",
        status_code=status.HTTP_201_CREATED,
        response_model=JobView,
        responses={
            **_error(409, "the idempotency key was used for a different spec"),
            **_error(413, "the body is over the size limit"),
            **_error(415, "the body is neither JSON nor YAML"),
            **TOO_MANY,
            **INVALID,
        },
        openapi_extra={
            "requestBody": {
                "content": {
                    "application/yaml": {"schema": {"$ref": "#/components/schemas/JobSpec"}}
                }
            }
        },
        tags=["jobs"],
    )
    def submit_job(
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
        ``Content-Type: application/yaml``."""
        _within_the_cluster(spec, runtime.settings)
        job, created = runtime.jobs.create(spec.model_dump(mode="json"), idempotency_key)
        if created:
            runtime.metrics.submissions.inc()
        return job_view(job, runtime.store.queue_position(job))

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
                {job_id: n + 1 for n, job_id in enumerate(runtime.store.queue())}
                if (waiting)
                else {}
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
            list[Literal["step", "eval"]] | None,
            Query(description="only these kinds: step (a progress report), eval"),
        ] = None,
        since: Annotated[int, Query(ge=0, le=2**31)] = 0,
        limit: Annotated[int, Query(ge=1, le=20_000)] = 10_000,
    ) -> MetricHistory:
        """The metric history: a point per progress report (step) and evaluation (eval)."""
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
        """The models and datasets a JobSpec may name (built in, and installed plugins)."""
        return Registry(models=model_names(), datasets=dataset_names())

    @router.get(
        "/jobs/{job_id}/logs",
        response_class=PlainTextResponse,
        responses={
            200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
            **PLAIN_ROUTE_ERRORS,
            **_json_error(404, "no such job"),
            **_json_error(503, "Ray cannot be reached"),
            **_json_error(422, "bad parameters or body", "ValidationErrorBody"),
        },
        tags=["jobs"],
    )
    def job_logs(job_id: str, runtime: RuntimeDep) -> PlainTextResponse:
        """The job driver's log (the Ray Job's output); empty before the job reached Ray."""
        job = runtime.store.get(job_id)
        if job.submission_id is None:
            return PlainTextResponse("")
        try:
            text = runtime.jobs.runner.logs(job.submission_id)
        except Exception as err:
            raise RayUnavailableError(f"cannot read the job's log from Ray: {err}") from err
        return PlainTextResponse(text)

    @router.post(
        "/jobs/{job_id}/cancel",
        response_model=JobView,
        responses={
            **NOT_FOUND,
            **_error(409, "the job already finished otherwise"),
            **TOO_MANY,
            **INVALID,
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
        responses={**NOT_FOUND, **_error(409, "the job is not finished"), **INVALID},
        tags=["jobs"],
    )
    def delete_job(job_id: str, runtime: RuntimeDep) -> Response:
        """Forget a finished job and its history."""
        runtime.jobs.delete(job_id)
        return Response(status_code=status.HTTP_204_NO_CONTENT)

    return router


def _health(settings: Settings) -> APIRouter:
    router = APIRouter(tags=["service"])

    @router.get("/healthz", response_model=Health)
    async def healthz() -> Health:
        """The process answers (on the event loop itself: no worker thread, which a burst of
        requests may all be holding)."""
        return Health(status="ok")

    @router.get(
        "/readyz",
        response_model=Health,
        responses={503: {"model": Health, "description": "Ray or the database is not ready"}},
    )
    def readyz(runtime: RuntimeDep) -> JSONResponse:
        """Ray reachable and the database writable."""
        checks = {"ray": "ok", "database": "ok"}
        if not runtime.jobs.runner.reachable():
            checks["ray"] = "unreachable"
        try:
            runtime.store.writable()
        except Exception as err:
            checks["database"] = f"not writable: {type(err).__name__}"
        ok = all(v == "ok" for v in checks.values())
        body = Health(status="ok" if ok else "unavailable", checks=checks)
        return JSONResponse(body.model_dump(), status_code=200 if ok else 503)

    @router.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={
            200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
            **PLAIN_ROUTE_ERRORS,
        },
        dependencies=[Depends(_authorizer(settings))],
    )
    def metrics(runtime: RuntimeDep) -> Response:
        """Prometheus metrics: jobs by state, submissions, request latency, throughput."""
        return Response(generate_latest(runtime.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return router


async def _view_json(runtime: Runtime, job: Job) -> str:
    """A job's view as JSON, with its place in the queue while it waits."""
    position = None
    if job.state is JobState.QUEUED and job.submission_id is None:
        position = await run_in_threadpool(runtime.store.queue_position, job)
    return job_view(job, position).model_dump_json()


async def _stream(runtime: Runtime, job_id: str) -> AsyncIterator[ServerSentEvent]:
    """The job's state now, then every update until it finishes."""
    async with runtime.jobs.hub.subscribe(job_id) as queue:
        job = await run_in_threadpool(runtime.store.get, job_id)
        yield ServerSentEvent(await _view_json(runtime, job), event="state")
        while not job.state.finished:
            update = await queue.get()
            if update.kind == "state":
                try:
                    job = await run_in_threadpool(runtime.store.get, job_id)
                except JobNotFoundError:
                    return
                yield ServerSentEvent(await _view_json(runtime, job), event="state")
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


STATIC = Path(__file__).with_name("static")
PAGE_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
    "form-action 'self'"
)
"""The Content-Security-Policy of everything the service serves (the dashboard, the API docs,
their files, the API's answers): nothing from another origin and no inline scripts (Plotly's
and Swagger UI's inline styles aside, which they set on their own elements)."""
SECURITY_HEADERS = {
    "Content-Security-Policy": PAGE_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def swagger_ui() -> Path:
    """Swagger UI's files, from the swagger-ui-bundle package (served, never a CDN's)."""
    import swagger_ui_bundle  # type: ignore[import-untyped]

    return Path(swagger_ui_bundle.swagger_ui_path)


DOCS_PAGE = """<!doctype html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <title>kaisa-ray API</title>
  <link rel="stylesheet" href="/static/vendor/swagger/swagger-ui.css">
  <link rel="icon" href="/static/favicon.svg" type="image/svg+xml">
</head>
<body>
  <div id="swagger-ui"></div>
  <script src="/static/vendor/swagger/swagger-ui-bundle.js"></script>
  <script src="/static/docs.js"></script>
</body>
</html>
"""


def plotly_js() -> Path:
    """The plotly.js bundle that the plotly package ships in its wheel."""
    spec = importlib.util.find_spec("plotly")
    bundle = (
        Path(spec.origin).parent / "package_data" / "plotly.min.js"
        if spec and spec.origin
        else None
    )
    if bundle is None or not bundle.is_file():
        raise StarletteHTTPException(
            404,
            "plotly.js is not installed here: the dashboard's charts need the plotly "
            "package (pip install plotly; kaisa-ray depends on it)",
        )
    return bundle


def _pages() -> APIRouter:
    """The dashboard: one page and its files, served by the service itself (no token: they
    hold no data; the page asks for the token the API wants)."""
    router = APIRouter(include_in_schema=False)

    @router.get("/")
    async def index() -> FileResponse:
        return FileResponse(
            STATIC / "index.html",
            headers={"Content-Security-Policy": PAGE_POLICY, "Cache-Control": "no-cache"},
        )

    @router.get("/docs")
    async def docs() -> HTMLResponse:
        return HTMLResponse(DOCS_PAGE, headers={"Cache-Control": "no-cache"})

    @router.get("/static/vendor/plotly.min.js")
    async def plotly() -> FileResponse:
        return FileResponse(
            plotly_js(),
            media_type="text/javascript",
            headers={"Cache-Control": "public, max-age=86400"},
        )

    return router


def _handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def service_error(_: Request, err: ServiceError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
        return JSONResponse(
            ErrorBody(detail=str(err)).model_dump(), status_code=err.status, headers=headers
        )

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        problems = []
        body_items = []
        for item in err.errors():
            loc = tuple(item.get("loc", ()))
            if item.get("type") == "json_invalid":
                reason = (item.get("ctx") or {}).get("error") or item.get("msg", "invalid")
                problems.append(
                    FieldProblem(field="body", message=f"not valid JSON: {reason} at {loc[-1]}")
                )
                continue
            if len(loc) > 1 and loc[0] == "body":
                body_items.append({**item, "loc": loc[1:]})  # a field of the JobSpec
                continue
            where = ".".join(str(part) for part in loc) or "body"
            message = str(item.get("msg", "invalid"))
            if item.get("type") == "json_invalid":
                where, message = "body", f"not valid JSON: {message}"
            problems.append(FieldProblem(field=where, message=message))
        for field, message in field_problems(body_items):
            problems.append(FieldProblem(field=field, message=message))
        body = ValidationErrorBody(
            detail=f"{len(problems)} problem(s): "
            + "; ".join(f"{p.field}: {p.message}" for p in problems),
            problems=problems,
        )
        return JSONResponse(body.model_dump(), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        if err.status_code == 400 and "parsing the body" in str(err.detail):
            # FastAPI's answer to a body it cannot decode (not UTF-8): a bad body, like bad JSON.
            problem = FieldProblem(field="body", message="not valid JSON (is it UTF-8 text?)")
            body = ValidationErrorBody(
                detail=f"1 problem(s): body: {problem.message}", problems=[problem]
            )
            return JSONResponse(body.model_dump(), status_code=422)
        return JSONResponse(
            ErrorBody(detail=str(err.detail)).model_dump(),
            status_code=err.status_code,
            headers=getattr(err, "headers", None),
        )

    @app.exception_handler(Exception)
    async def internal(request: Request, err: Exception) -> JSONResponse:
        ref = secrets.token_hex(4)
        logger.error(
            "internal error %s on %s %s", ref, request.method, request.url.path, exc_info=err
        )
        return JSONResponse(
            ErrorBody(
                detail=f"internal error (reference {ref}); the service log has it"
            ).model_dump(),
            status_code=500,
        )
