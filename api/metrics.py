"""The service's own metrics on /metrics, next to the KV-tier model it exports: requests by route and status,
their latency, A/B tests by status and alerts by state (read at scrape time, without side effects)."""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvscope.api.deps import Services
from kvscope.api.yielding import InFlight

REQUESTS = Counter("kvscope_http_requests", "HTTP requests served", ["method", "route", "status"])
LATENCY = Histogram(
    "kvscope_http_request_duration_seconds",
    "time to serve an HTTP request",
    ["method", "route"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)


class RequestMetrics:
    """Counts and times every request by its route template (not its path: ids would explode the series), and keeps
    `in_flight` up to date: A/B threads yield to the requests it counts (kvscope.api.yielding)."""

    def __init__(self, app: ASGIApp, in_flight: InFlight) -> None:
        self.app, self.in_flight = app, in_flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), 500
        self.in_flight.started()

        async def tracked(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        finally:
            self.in_flight.ended()
            template = _template(scope)
            REQUESTS.labels(scope["method"], template, str(status)).inc()
            LATENCY.labels(scope["method"], template).observe(time.perf_counter() - started)


def _template(scope: Scope) -> str:
    """The matched route's path template; for a mounted app (the static files) the mount's, as `/ui/{path}`."""
    route = scope.get("route")
    if route is not None:
        return getattr(route, "path", "unmatched")
    mounted = scope.get("root_path", "").removeprefix(scope.get("app_root_path", scope.get("root_path", "")))
    return f"{mounted}/{{path}}" if mounted else "unmatched"


class ServiceCollector(Collector):
    """A/B tests by status and alerts by state, as gauges read from the running services."""

    def __init__(self, services: Services) -> None:
        self.services = services

    def collect(self) -> Iterator[GaugeMetricFamily]:
        tests = GaugeMetricFamily("kvscope_ab_tests", "A/B tests known to the service", labels=["status"])
        statuses = [test.status for test in self.services.ab.list()]
        for status in ("running", "finished", "stopped", "failed"):
            tests.add_metric([status], statuses.count(status))
        yield tests
        alerts = GaugeMetricFamily("kvscope_alerts", "alerts by name and state", labels=["alertname", "state"])
        counts: dict[tuple[str, str], int] = {}
        for alert in self.services.alerts.list():
            counts[(alert.name, alert.state)] = counts.get((alert.name, alert.state), 0) + 1
        for (name, state), count in sorted(counts.items()):
            alerts.add_metric([name, state], count)
        yield alerts
