"""The FastAPI application: routers per resource, the services started and stopped by the lifespan.

`create_app(settings)` is what `kvscope serve` runs under uvicorn and what tests start on 127.0.0.1. The lifespan
opens the verifier database, starts the A/B manager, and scrapes the published A/B engines (plus any configured
clusters) into the KV-tier model, exported with the service's own metrics on `/metrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import REGISTRY
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvscope import __version__
from kvscope.api.abmanager import ABManager
from kvscope.api.alertmanager import AlertmanagerForwarder
from kvscope.api.alerts import AlertBook
from kvscope.api.clusterwatch import ClusterWatch
from kvscope.api.deps import Services
from kvscope.api.metrics import RequestMetrics, ServiceCollector
from kvscope.api.routers import ab, alerts, dashboards, docs, evidence, health, page, predict
from kvscope.api.settings import Settings
from kvscope.api.yielding import InFlight
from kvscope.exporters.config import ExporterSettings, load_config
from kvscope.exporters.otel import TelemetryBridge
from kvscope.exporters.scrape import Scraper
from kvscope.exporters.tierstore import TierstoreTargetConfig
from kvscope.verifier.db import Database


def _scraper(settings: Settings, book: AlertBook) -> Scraper:
    """The published A/B engines, and the clusters of `settings.targets` (watched for collapse) when given."""
    targets = [TierstoreTargetConfig(name="tierstore", source="tierstore", interval_s=settings.scrape_interval_s)]
    if settings.targets:
        targets += load_config(settings.targets).targets
    return Scraper(targets, on_scrape=ClusterWatch(book))


def create_app(settings: Settings | None = None, on_started: Callable[[Services], None] | None = None) -> FastAPI:
    """The service; `on_started(services)` runs once everything is up (the demo starts its A/B there)."""
    settings = settings or Settings()
    in_flight = InFlight()  # counted by RequestMetrics, yielded to by the A/B threads

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        settings.db.parent.mkdir(parents=True, exist_ok=True)
        db = Database(settings.db)
        book = AlertBook()
        services = Services(
            settings,
            db,
            book,
            ABManager(
                db,
                book,
                settings.workdir,
                settings.criteria,
                retain_s=settings.ab_retain_s,
                max_real_store=settings.max_real_store_ab,
                max_running=settings.max_running_ab,
                max_real_bytes=settings.max_real_bytes,
                requests=in_flight,
            ),
        )
        app.state.services = services
        collector = ServiceCollector(services)
        REGISTRY.register(collector)
        forwarder = None
        if settings.alertmanager_url:
            generator = f"http://{settings.host}:{settings.port}/api/v1/alerts"
            forwarder = AlertmanagerForwarder(settings.alertmanager_url, book, settings.alert_resend_s, generator)
            forwarder.start()
        scraper = _scraper(settings, book)
        bridge = app.state.telemetry = TelemetryBridge(scraper, ExporterSettings())
        stop = asyncio.Event()
        scraping = asyncio.create_task(scraper.run(stop))
        if on_started:
            on_started(services)
        gc.freeze()  # what start-up made lives as long as the service: keep full collections from walking it
        try:
            yield
        finally:
            stop.set()
            await asyncio.to_thread(services.ab.shutdown)  # each test closes its runs: nothing recorded is lost
            await scraping
            await scraper.close()
            bridge.shutdown()
            REGISTRY.unregister(collector)
            if forwarder:
                forwarder.stop()
            db.close()

    app = FastAPI(
        title="kvscope",
        version=__version__,
        description="Live A/B tests of KV-cache tier layouts, hit-rate-collapse alerts and audit evidence.",
        lifespan=lifespan,
        docs_url=None,  # /docs and /redoc are the docs router's: their assets are the service's own, no CDN
        redoc_url=None,
    )
    for module in (health, predict, ab, alerts, dashboards, evidence, page, docs):
        app.include_router(module.router)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestMetrics, in_flight=in_flight)
    return app


async def _invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
    """422 naming each problem's place and reason. The input is not echoed back: it may hold what JSON cannot
    carry (1e999, NaN, a 4,300-digit integer) or what a client should not see again."""
    problems = [
        {"type": problem["type"], "loc": [part if isinstance(part, int) else str(part) for part in problem["loc"]],
         "msg": str(problem["msg"])}
        for problem in error.errors()
    ]  # fmt: skip
    return JSONResponse(status_code=422, content={"detail": problems})


class BodyLimit:
    """413 for request bodies over `max_bytes`, announced (Content-Length) or streamed: the body is read (up to the
    limit) before the app sees the request, so an oversized upload is refused without being parsed."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await _too_large(send, self.max_bytes)
            return
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await _too_large(send, self.max_bytes)
                return
            if message["type"] != "http.request" or not message.get("more_body"):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


async def _too_large(send: Send, limit: int) -> None:
    body = f'{{"detail":"request body larger than {limit} bytes"}}'.encode()
    await send({"type": "http.response.start", "status": 413, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})
