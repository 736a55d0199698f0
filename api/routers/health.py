"""Liveness for load balancers and the service's own state."""

from __future__ import annotations

from fastapi import APIRouter

from kvscope import __version__
from kvscope.api.deps import ServicesDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz(services: ServicesDep) -> dict:
    running = sum(1 for test in services.ab.list() if test.status == "running")
    return {
        "status": "ok",
        "version": __version__,
        "ab_running": running,
        "alerts_active": len(services.alerts.active()),
    }
