"""The service's own health: ``/healthz`` (the process answers), ``/readyz`` (Ray, the
database and the disks: ``service.domain.readiness``) and ``/metrics`` (Prometheus; behind the
token, checked by the middleware)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from service.domain import readiness
from service.routes.jobs import BEARER
from service.routes.responses import PLAIN_ROUTE_ERRORS
from service.routes.schemas import Health
from service.runtime import RuntimeDep

__all__ = ["router"]

router = APIRouter(tags=["service"])


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """The process answers (on the event loop itself: no worker thread, which a burst of
    requests may all be holding)."""
    return Health(status="ok")


@router.get(
    "/readyz",
    response_model=Health,
    responses={
        503: {
            "model": Health,
            "description": "Ray, the database or a disk is not ready: each check says which "
            "(retry after Retry-After seconds)",
        }
    },
)
def readyz(runtime: RuntimeDep) -> JSONResponse:
    """Ray reachable, the database written (a heartbeat row), and free space on the disks
    the service and its jobs write to (``service.domain.readiness``)."""
    checks = readiness.checks(runtime)
    ok = all(v == "ok" for v in checks.values())
    body = Health(status="ok" if ok else "unavailable", checks=checks)
    headers = None if ok else {"Retry-After": str(readiness.RETRY_AFTER_S)}
    return JSONResponse(body.model_dump(), status_code=200 if ok else 503, headers=headers)


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
        **PLAIN_ROUTE_ERRORS,
    },
    dependencies=[Depends(BEARER)],
)
def metrics(runtime: RuntimeDep) -> Response:
    """Prometheus metrics: jobs by state, submissions, request latency, throughput."""
    return Response(generate_latest(runtime.metrics.registry), media_type=CONTENT_TYPE_LATEST)
