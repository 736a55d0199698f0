"""Hit-rate-collapse alerts, predicted and live."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter

from kvscope.api.deps import ServicesDep

router = APIRouter(prefix="/api/v1", tags=["alerts"])


@router.get("/alerts")
def list_alerts(services: ServicesDep, state: Literal["pending", "firing", "resolved"] | None = None) -> list[dict]:
    """Every alert raised since the service started, newest first; `state` filters."""
    alerts = sorted(services.alerts.list(state), key=lambda alert: alert.active_at, reverse=True)
    return [alert.as_json() for alert in alerts]
