"""Forwarding the service's alerts to Alertmanager's /api/v2/alerts, the way Prometheus does.

Firing alerts are posted when they fire and re-sent every `resend_s` (Alertmanager expires an alert whose endsAt
passes without news, so each post sets endsAt a few resend periods ahead). A resolved alert is posted with its
real endsAt, and kept in the posts for `keep_resolved_s` so a lost request does not leave it firing. Pending
alerts stay in the service, as Prometheus keeps them. Posting happens on a background thread: an unreachable
Alertmanager never slows the A/B that raised the alert; failures are counted and logged.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import UTC, datetime

import httpx
from prometheus_client import Counter

from kvscope.api.alerts import RESOLVED_KEPT_S, RULES, Alert, AlertBook

log = logging.getLogger(__name__)
POSTS = Counter("kvscope_alertmanager_posts", "posts of alerts to Alertmanager", ["outcome"])


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def payload(alert: Alert, now: float, resend_s: float, generator_url: str) -> dict:
    """One alert in Alertmanager's v2 API shape, with its rule's severity and runbook (alerts.RULES)."""
    ends = alert.resolved_at if alert.state == "resolved" and alert.resolved_at else now + 4 * resend_s
    rule = RULES[alert.name]
    return {
        "labels": {"alertname": alert.name, "severity": rule.severity, **alert.labels},
        "annotations": {"summary": alert.summary, "description": alert.description, "runbook_url": rule.runbook_url},
        "startsAt": _iso(alert.fired_at or alert.active_at),
        "endsAt": _iso(ends),
        "generatorURL": generator_url,
    }


class AlertmanagerForwarder:
    def __init__(
        self,
        url: str,
        book: AlertBook,
        resend_s: float = 30.0,
        generator_url: str = "",
        keep_resolved_s: float = RESOLVED_KEPT_S,
    ) -> None:
        self.endpoint = url.rstrip("/") + "/api/v2/alerts"
        self.book, self.resend_s, self.generator_url = book, resend_s, generator_url
        self.keep_resolved_s = keep_resolved_s
        self._wake, self._stop = threading.Event(), threading.Event()
        self._client = httpx.Client(timeout=5.0)
        self._thread = threading.Thread(target=self._loop, name="alertmanager", daemon=True)
        book.subscribers.append(self.notify)

    def start(self) -> AlertmanagerForwarder:
        self._thread.start()
        return self

    def notify(self, alert: Alert) -> None:
        """A transition: post now if it concerns Alertmanager (firing or resolved)."""
        if alert.state != "pending":
            self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(10)
        self._client.close()
        self.book.subscribers.remove(self.notify)

    def post_once(self) -> bool:
        """Post every firing alert and the recently resolved ones; whether Alertmanager took them."""
        now = time.time()
        alerts = [
            a
            for a in self.book.list()
            if a.state == "firing" or (a.state == "resolved" and now - (a.resolved_at or now) < self.keep_resolved_s)
        ]
        if not alerts:
            return True
        body = [payload(alert, now, self.resend_s, self.generator_url) for alert in alerts]
        try:
            response = self._client.post(self.endpoint, json=body)
            response.raise_for_status()
        except httpx.HTTPError as error:
            POSTS.labels("error").inc()
            log.warning("posting %d alert(s) to %s failed: %s", len(body), self.endpoint, error)
            return False
        POSTS.labels("ok").inc()
        return True

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.post_once()
            self._wake.wait(self.resend_s)
            self._wake.clear()
        self.post_once()  # a last post on shutdown carries the final states
