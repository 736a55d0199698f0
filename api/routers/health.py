"""Liveness for load balancers and the service's own state."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvscope import __version__
from kvscope.api.deps import ServicesDep
from kvscope.api.responses import Health

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz(services: ServicesDep) -> Health:
    # a coroutine: it reads memory only, so it answers from the event loop even when the thread pool is busy
    running = sum(1 for test in services.ab.list() if test.status == "running")
    return Health(status="ok", version=__version__, ab_running=running, alerts_active=len(services.alerts.active()))


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request) -> Response:
    """The service's own metrics and the KV-tier model of everything it scrapes (A/B engines, clusters)."""
    return Response(request.app.state.telemetry.metrics_body(), media_type=CONTENT_TYPE_LATEST)
