"""The service's own health: ``/healthz`` (the process answers), ``/readyz`` (Ray and the
database) and ``/metrics`` (Prometheus; behind the token, checked by the middleware)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from service.job_routes import BEARER
from service.responses import PLAIN_ROUTE_ERRORS
from service.runtime import RuntimeDep
from service.schemas import Health

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
    dependencies=[Depends(BEARER)],
)
def metrics(runtime: RuntimeDep) -> Response:
    """Prometheus metrics: jobs by state, submissions, request latency, throughput."""
    return Response(generate_latest(runtime.metrics.registry), media_type=CONTENT_TYPE_LATEST)
