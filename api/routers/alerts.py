"""Hit-rate-collapse alerts, predicted and live."""

from __future__ import annotations

from fastapi import APIRouter

from kvscope.api.alerts import RULES, State
from kvscope.api.deps import ServicesDep
from kvscope.api.responses import AlertOut, errors

router = APIRouter(prefix="/api/v1", tags=["alerts"])


@router.get("/alerts", responses=errors(422))
async def list_alerts(services: ServicesDep, state: State | None = None) -> list[AlertOut]:
    """The alerts raised since the service started (resolved ones for a while after), newest first, each with its
    rule's severity and runbook; `state` filters."""
    # a coroutine: it reads memory only, so the event loop answers it without a hop to the thread pool
    alerts = sorted(services.alerts.list(state), key=lambda alert: alert.active_at, reverse=True)
    return [
        AlertOut(**alert.as_json(), severity=RULES[alert.name].severity, runbook_url=RULES[alert.name].runbook_url)
        for alert in alerts
    ]
