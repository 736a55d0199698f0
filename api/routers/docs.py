"""The API docs, Swagger UI at /docs and Redoc at /redoc, with their scripts, style sheet and icon served by the
service itself (from the fastapi-offline package, under /docs/assets/): they render with no network.

FastAPI's recipe for self-hosted docs assets: the app is made with `docs_url=None, redoc_url=None`, and these
routes build the same pages with `get_swagger_ui_html` and `get_redoc_html`, pointed at the local files.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

router = APIRouter(include_in_schema=False)

ASSETS = "/docs/assets"
# Swagger UI 5 and Redoc 2, as the fastapi-offline package ships them (swagger-ui-bundle.js, swagger-ui.css,
# redoc.standalone.js, favicon.png); StaticFiles serves that folder and nothing outside it
router.mount(ASSETS, StaticFiles(packages=[("fastapi_offline", "static")]), name="docs-assets")

_HEADERS = {
    # FastAPI's pages start Swagger UI with an inline script; both UIs set inline styles, Redoc searches in a
    # worker made from a blob. Everything else comes from the service alone, as on the built-in page.
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data:; worker-src 'self' blob:; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
}


@router.get("/docs")
def swagger_ui(request: Request) -> HTMLResponse:
    root, app = request.scope.get("root_path", ""), request.app
    page = get_swagger_ui_html(
        openapi_url=root + app.openapi_url,
        title=f"{app.title} - Swagger UI",
        oauth2_redirect_url=root + app.swagger_ui_oauth2_redirect_url,
        swagger_js_url=f"{root}{ASSETS}/swagger-ui-bundle.js",
        swagger_css_url=f"{root}{ASSETS}/swagger-ui.css",
        swagger_favicon_url=f"{root}{ASSETS}/favicon.png",
        # no badge from the public validator service: the spec is checked by nobody but its reader
        swagger_ui_parameters={"validatorUrl": None, **(app.swagger_ui_parameters or {})},
    )
    page.headers.update(_HEADERS)
    return page


@router.get("/docs/oauth2-redirect")
def swagger_ui_oauth2_redirect() -> HTMLResponse:
    return get_swagger_ui_oauth2_redirect_html()


@router.get("/redoc")
def redoc(request: Request) -> HTMLResponse:
    root, app = request.scope.get("root_path", ""), request.app
    page = get_redoc_html(
        openapi_url=root + app.openapi_url,
        title=f"{app.title} - ReDoc",
        redoc_js_url=f"{root}{ASSETS}/redoc.standalone.js",
        redoc_favicon_url=f"{root}{ASSETS}/favicon.png",
        with_google_fonts=False,
    )
    page.headers.update(_HEADERS)
    return page
