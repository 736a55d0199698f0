"""The built-in page: A/B tests, alerts and verdicts, live, without Grafana and without a front-end build.

`GET /` serves api/static/index.html; its script and style sheet are served from /ui/. The page is plain
JavaScript that polls the JSON API every two seconds and draws its charts as inline SVG.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter, HTTPException, Response, status

router = APIRouter(include_in_schema=False)

_STATIC = files("kvscope.api") / "static"
_TYPES = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}
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


@router.get("/ui/{name}")
def asset(name: str) -> Response:
    if name not in _TYPES:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no asset {name!r}")
    return Response((_STATIC / name).read_bytes(), media_type=_TYPES[name], headers=_HEADERS)
