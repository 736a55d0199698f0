"""The built-in page: A/B tests, alerts and verdicts, live, without Grafana and without a front-end build.

`GET /` serves api/static/index.html; its script and style sheet are served from /ui/ (Starlette's StaticFiles on
api/static). The page is plain JavaScript that polls the JSON API every two seconds and draws its charts as inline SVG.
"""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import PurePath

from fastapi import APIRouter, Response
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

router = APIRouter(include_in_schema=False)

_STATIC = files("kvscope.api") / "static"
# by suffix, whatever the machine's mimetypes say (without /etc/mime.types, Python 3.11 calls .js application/...)
_TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".html": "text/html; charset=utf-8",
}
_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    # everything comes from the service itself: no inline script, no CDN
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'",
}


@router.get("/")
def page() -> Response:
    html = (_STATIC / "index.html").read_bytes()
    return Response(html, media_type="text/html; charset=utf-8", headers=_HEADERS)


class _Assets(StaticFiles):
    """The files of api/static under /ui/, with the page's headers and content types. StaticFiles serves nothing
    outside that folder (no `..`, no symbolic link out of it) and answers 404 for a file that is not there."""

    def file_response(
        self, full_path: str | os.PathLike[str], stat_result: os.stat_result, scope: Scope, status_code: int = 200
    ) -> Response:
        response = super().file_response(full_path, stat_result, scope, status_code)
        response.headers.update(_HEADERS)
        if response.status_code != 304 and (media := _TYPES.get(PurePath(full_path).suffix)):
            response.headers["content-type"] = media
        return response


router.mount("/ui", _Assets(packages=[("kvscope.api", "static")]), name="ui")
