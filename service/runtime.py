"""What a running service holds (``Runtime``, opened by the app's lifespan and kept on
``app.state.runtime``), and the dependency that hands it to a route (``RuntimeDep``): the
routes are module-level routers that read everything, settings included, from the app."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from service.domain.follower import RayJobFollower
from service.domain.jobs import Jobs
from service.domain.limits import Pricer
from service.domain.views import ViewCache
from service.head import RayHead
from service.metrics import ServiceMetrics
from service.settings import Settings
from service.store.repository import JobStore
from service.worker_pool import WorkerPool

__all__ = ["Runtime", "RuntimeDep"]


@dataclass
class Runtime:
    """What the lifespan opened."""

    settings: Settings
    store: JobStore
    jobs: Jobs
    follower: RayJobFollower
    metrics: ServiceMetrics
    views: ViewCache
    plans: WorkerPool  # POST /v1/plan's workers
    pricer: Pricer  # models' footprints, for the caps and admission (service.domain.limits)
    head: RayHead | None = None


async def _runtime(request: Request) -> Runtime:
    runtime: Runtime = request.app.state.runtime
    return runtime


RuntimeDep = Annotated[Runtime, Depends(_runtime)]
