"""The generated Grafana dashboards: listed, served, and pushed to a Grafana with grafana-client."""

from __future__ import annotations

import json
from pathlib import Path

from fastapi import APIRouter, HTTPException, status
from pydantic import BaseModel, ConfigDict, Field

from kvscope.api.deps import Authorized, SettingsDep, TokenFirst
from kvscope.api.responses import DashboardEntry, Provisioned, ProvisionedDashboard, errors

router = APIRouter(prefix="/api/v1/dashboards", tags=["dashboards"], route_class=TokenFirst)


def _dashboards(folder: Path) -> dict[str, dict]:
    """uid -> dashboard JSON, for every *.json in the dashboards folder."""
    found = {}
    for path in sorted(folder.glob("*.json")):
        dashboard = json.loads(path.read_text())
        found[dashboard.get("uid") or path.stem] = dashboard
    return found


@router.get("")
def list_dashboards(settings: SettingsDep) -> list[DashboardEntry]:
    return [
        DashboardEntry(uid=uid, title=d.get("title", uid), tags=d.get("tags", []))
        for uid, d in _dashboards(settings.dashboards_dir).items()
    ]


@router.get("/{uid}", responses=errors(404))
def get_dashboard(uid: str, settings: SettingsDep) -> dict:
    """The dashboard's JSON model, as Grafana imports it."""
    dashboard = _dashboards(settings.dashboards_dir).get(uid)
    if dashboard is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no dashboard with uid {uid!r}")
    return dashboard


class ProvisionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    folder_uid: str | None = Field(None, description="Grafana folder to put them in")
    overwrite: bool = True


@router.post("/provision", dependencies=[Authorized], responses=errors(401, 409, 413, 422, 502))
def provision(body: ProvisionRequest, settings: SettingsDep) -> Provisioned:
    """Push every dashboard to the configured Grafana (settings: KVSCOPE_GRAFANA_URL, KVSCOPE_GRAFANA_TOKEN)."""
    from grafana_client import GrafanaApi
    from grafana_client.client import GrafanaException

    if not settings.grafana_url or settings.grafana_token is None:
        raise HTTPException(status.HTTP_409_CONFLICT, "no Grafana configured: set KVSCOPE_GRAFANA_URL and _TOKEN")
    grafana = GrafanaApi.from_url(settings.grafana_url, credential=settings.grafana_token.get_secret_value())
    pushed = []
    for uid, dashboard in _dashboards(settings.dashboards_dir).items():
        payload = {"dashboard": {**dashboard, "id": None}, "overwrite": body.overwrite}
        if body.folder_uid:
            payload["folderUid"] = body.folder_uid
        try:
            answer = grafana.dashboard.update_dashboard(payload)
        except GrafanaException as error:
            raise HTTPException(status.HTTP_502_BAD_GATEWAY, f"Grafana refused dashboard {uid!r}: {error}") from None
        except OSError as error:  # the HTTP client's connection errors (requests' are OSErrors)
            raise HTTPException(
                status.HTTP_502_BAD_GATEWAY,
                f"Grafana at {settings.grafana_url} could not be reached: {type(error).__name__}",
            ) from None
        pushed.append(ProvisionedDashboard(uid=uid, url=answer.get("url"), version=answer.get("version")))
    return Provisioned(grafana=settings.grafana_url, dashboards=pushed)
