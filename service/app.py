"""The FastAPI application: the REST API under ``/v1``, health, readiness and Prometheus, the
dashboard and the API docs.

``create_app(settings)`` builds it from module-level routers (``service.routes``: ``jobs``,
``plan``, ``health``, ``pages``) that read the service's state from
``app.state.runtime``; its lifespan opens the store, connects to Ray (or starts the embedded
head), and runs the follower. Tests pass a fake ``runner``. The token is checked in one place,
the ``BearerAuth`` middleware; domain errors map to HTTP in one handler.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import secrets
import signal
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from pydantic import TypeAdapter
from sqlalchemy.exc import OperationalError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from kaisa_train.records import Record
from kaisa_train.spec import field_problems
from service.domain import readiness
from service.domain.follower import RayJobFollower
from service.domain.hub import Hub
from service.domain.job_logs import LogArchive
from service.domain.jobs import Jobs
from service.domain.limits import Pricer
from service.domain.restart import interrupt, resume, stop_training, within
from service.domain.sandbox import DataRoots
from service.domain.views import ViewCache
from service.errors import ServiceError, TookTooLongError
from service.head import RayHead
from service.metrics import ServiceMetrics
from service.middleware import BearerAuth, BodyLimit, RateLimit, SecurityHeaders, SpecBody, Timing
from service.origin import SameOrigin
from service.routes.health import router as health_router
from service.routes.jobs import router as job_router
from service.routes.pages import SECURITY_HEADERS, STATIC, swagger_ui
from service.routes.pages import router as page_router
from service.routes.plan import router as plan_router
from service.routes.schemas import ErrorBody, FieldProblem, ValidationErrorBody
from service.runner import RayRunner, Runner
from service.runtime import Runtime
from service.settings import Settings
from service.store.database import sole_writer
from service.store.repository import JobStore
from service.worker_pool import WorkerPool

__all__ = ["API_VERSION", "create_app"]

logger = logging.getLogger(__name__)

API_VERSION = "v1"


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


def create_app(
    settings: Settings | None = None,
    *,
    runner: Runner | None = None,
    jobs_stop_with_service: bool | None = None,
) -> FastAPI:
    """The service. ``runner``: a fake Ray for tests (default: the real one).
    ``jobs_stop_with_service``: whether stopping the service stops its Ray Jobs, so that it
    interrupts them and resumes them at its next start (``service.domain.restart``) [default: with
    the embedded head; a test's fake runner says so itself]."""
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
            jobs = Jobs(
                store,
                active,
                Hub(),
                idempotency_ttl_s=settings.idempotency_ttl_s,
                logs=LogArchive(settings.data_dir / "logs"),
            )
            await run_in_threadpool(resume, jobs)  # what a graceful stop interrupted
            follower = RayJobFollower(
                jobs,
                interval_s=settings.poll_interval_s,
                status_interval_s=settings.status_interval_s,
                max_running=settings.max_running,
                driver_cpus=settings.driver_cpus,
                lost_grace_s=settings.lost_grace_s,
            )
            plans = WorkerPool(
                what="plans",
                size=settings.max_plans,
                timeout_s=settings.plan_timeout_s,
                knob="kaisa-ray serve --max-plans, --plan-timeout-s",
            )
            checks = WorkerPool(
                what="model checks",
                size=2,
                timeout_s=30,
                wait_s=10,  # a submission waits for a worker rather than being refused
                knob="building the model on the meta device",
            )
            stop_pools_on_signal(plans, checks)
            runtime = Runtime(
                settings,
                store,
                jobs,
                follower,
                metrics,
                ViewCache(store.version_now),
                plans,
                Pricer(checks),
                head,
            )
            metrics.bind(store, plans)
            app.state.runtime = runtime
            follower.start()
            # What start-up loaded (Ray, torch, pydantic's schemas: some 300 000 objects) lives
            # as long as the process; left to the collector, every full collection walks it all
            # (150 ms here), a pause every request in flight waits for. Freeze it, once per
            # process: a process that builds apps one after another (the tests) keeps the first
            # one's start-up frozen rather than paying a full collection per app.
            if gc.get_freeze_count() == 0:
                gc.collect()
                gc.freeze()
            try:
                yield
            finally:
                logger.info("shutting down: the follower, Ray, the embedded head, the store")
                clock = _PhaseClock()
                failed: list[str] = []

                async def phase(name: str, step: Callable[[], Awaitable[object]]) -> None:
                    # One phase's failure never skips the next: above all, the embedded head
                    # (and every process it started) is stopped whatever went before.
                    try:
                        await step()
                    except Exception:
                        logger.exception("shutdown: %s failed; going on", name)
                        failed.append(name)
                    clock.lap(name)

                async def pools() -> None:
                    await plans.close()
                    await checks.close()

                async def ray_client() -> None:
                    try:
                        await run_in_threadpool(within, RAY_CLOSE_S, active.close)
                    except TookTooLongError as err:  # the head's stop below ends it anyway
                        logger.warning("Ray's client did not close: %s", err)

                await phase("the plan and check pools", pools)
                await phase(
                    "the follower",
                    lambda: run_in_threadpool(follower.stop, timeout=FOLLOWER_STOP_S),
                )
                stops_jobs = jobs_stop_with_service
                if stops_jobs if stops_jobs is not None else head is not None:
                    stop = functools.partial(stop_training, head) if head else None
                    await phase(
                        "the jobs interrupted",
                        lambda: run_in_threadpool(interrupt, jobs, follower, stop),
                    )
                await phase("Ray's client", ray_client)
                if head is not None:
                    # Its jobs are interrupted and resume from their checkpoints: nothing on
                    # the head needs a drain, and it is killed at once (no SIGTERM first).
                    # Where Ray's client has not closed in time, its disconnection may still
                    # run when the head's raylet goes, and Ray then ends this process at any
                    # moment: nothing of the head is left waiting for a kill by then.
                    embedded = head
                    await phase(
                        "the embedded head",
                        lambda: run_in_threadpool(functools.partial(embedded.stop, grace_s=0)),
                    )
                await phase("the store", lambda: run_in_threadpool(store.close))
                if failed:
                    logger.error("shutdown ended; these phases failed: %s (%s)", failed, clock)
                else:
                    logger.info("shutdown complete (%s)", clock)

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
    app.include_router(job_router, prefix=f"/{API_VERSION}")
    app.include_router(plan_router, prefix=f"/{API_VERSION}")
    app.include_router(health_router)
    app.include_router(page_router)
    app.openapi = functools.partial(_openapi, app)  # type: ignore[method-assign]
    app.mount("/static/vendor/swagger", StaticFiles(directory=swagger_ui()), name="swagger")
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    # The outermost last: Timing > SecurityHeaders > SameOrigin > RateLimit > BearerAuth >
    # BodyLimit > SpecBody > DataRoots.
    app.add_middleware(DataRoots, roots=settings.roots)  # while FastAPI validates the body
    app.add_middleware(SpecBody, path=f"/{API_VERSION}/jobs")
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(BearerAuth, token=settings.secret, prefixes=(f"/{API_VERSION}", "/metrics"))
    app.add_middleware(
        RateLimit,
        rate=settings.post_rate,
        burst=settings.post_burst,
        prefixes=(f"/{API_VERSION}",),
    )
    app.add_middleware(
        SameOrigin,
        guarded_by_token=settings.secret is not None,
        allowed_hosts=tuple(settings.allowed_hosts),
    )
    app.add_middleware(SecurityHeaders, headers=SECURITY_HEADERS)
    app.add_middleware(Timing, observe=metrics.observe, prefixes=(f"/{API_VERSION}",))
    return app


def stop_pools_on_signal(*pools: WorkerPool) -> None:
    """SIGTERM and SIGINT end the pools' tasks at once, before uvicorn's graceful drain
    waits for the requests in flight (a plan can take minutes), then do what they did. Only
    the main thread may set handlers (the lifespan runs there under uvicorn; a test's
    client runs it elsewhere, and stops the pools at the lifespan's end)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        then = signal.getsignal(sig)
        if not callable(then):
            continue

        def first_the_pools(signum: int, frame: Any, then: Any = then) -> None:
            for pool in pools:
                pool.stop_now()
            then(signum, frame)

        signal.signal(sig, first_the_pools)


FOLLOWER_STOP_S = 3.0
"""How long a stop waits for the follower's pass in flight (a Ray call under load can take
longer: the jobs' interruption does not need it to end)."""
RAY_CLOSE_S = 5.0
"""How long a stop waits for Ray's client to close (``ray.shutdown``) before it kills the
head (a second or less on a quiet machine; more on one busy with other Rays)."""


class _PhaseClock:
    """The seconds each phase of the shutdown took, for its last log line: where a slow stop
    spent its time."""

    def __init__(self) -> None:
        self._last = time.monotonic()
        self._laps: list[tuple[str, float]] = []

    def lap(self, phase: str) -> None:
        now = time.monotonic()
        self._laps.append((phase, now - self._last))
        self._last = now

    def __str__(self) -> str:
        return ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in self._laps)


def _openapi(app: FastAPI) -> dict[str, Any]:
    """The API's schema, with every progress record's typed schema (``Record``: what the
    event streams send, and what a job's ``tuner`` and metric points hold) among its
    components."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title,
            version=app.version,
            summary=app.summary,
            routes=app.routes,
        )
        records = TypeAdapter(Record).json_schema(
            ref_template="#/components/schemas/{model}", mode="serialization"
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name, definition in records.pop("$defs", {}).items():
            components.setdefault(name, definition)
        components["Record"] = records
        app.openapi_schema = schema
    return app.openapi_schema


def _handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def service_error(_: Request, err: ServiceError) -> JSONResponse:
        return JSONResponse(
            ErrorBody(detail=str(err)).model_dump(),
            status_code=err.status,
            headers=getattr(err, "headers", None),  # Retry-After of a 429
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
            problems.append(FieldProblem(field=where, message=str(item.get("msg", "invalid"))))
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

    @app.exception_handler(OperationalError)
    async def database_unavailable(request: Request, err: OperationalError) -> JSONResponse:
        # Another process's lock, a full disk, a read-only file: the service's condition,
        # which passes; never a 500 (service.domain.readiness).
        logger.warning("database: %s on %s %s", err.orig, request.method, request.url.path)
        return JSONResponse(
            ErrorBody(detail=readiness.database_unavailable(err)).model_dump(),
            status_code=503,
            headers={"Retry-After": str(readiness.RETRY_AFTER_S)},
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
