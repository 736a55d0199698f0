"""Generate the dashboards' JSON from the builders, and tell whether the committed JSON is stale.

The JSON is what ships (kvscope.api serves and provisions `<uid>.json` from this folder), so it is committed and
must match what the builders produce: `write_all` rewrites it, `stale` lists what differs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard

from kvscope.dashboards import fabric, kv_tiers, live_ab, media

FOLDER = Path(__file__).resolve().parent

BUILDERS: dict[str, Callable[[], Dashboard]] = {
    module.UID: module.build for module in (kv_tiers, media, fabric, live_ab)
}


def render(uid: str) -> str:
    """One dashboard's JSON text: sorted keys and a final newline, so the committed files diff cleanly."""
    return json.dumps(BUILDERS[uid](), cls=JSONEncoder, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write_all(folder: Path = FOLDER) -> list[Path]:
    """Write every dashboard as `<uid>.json` into `folder` (created if needed); returns the paths written."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for uid in BUILDERS:
        path = folder / f"{uid}.json"
        path.write_text(render(uid), encoding="utf-8")
        written.append(path)
    return written


def stale(folder: Path = FOLDER) -> list[str]:
    """What in `folder` does not match the builders: missing or different dashboards, and kvscope-*.json files no
    builder makes (a dashboard removed from the code but not from the folder). Empty when up to date."""
    problems = []
    for uid in BUILDERS:
        path = folder / f"{uid}.json"
        if not path.exists():
            problems.append(f"{path}: missing")
        elif path.read_text(encoding="utf-8") != render(uid):
            problems.append(f"{path}: differs from what the builders make")
    for path in sorted(folder.glob("kvscope-*.json")):
        if path.stem not in BUILDERS:
            problems.append(f"{path}: no builder makes it")
    return problems
