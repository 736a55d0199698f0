"""Alerts reach a real Alertmanager (Debian prometheus-alertmanager on 127.0.0.1) and its webhook receiver."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from kvscope.api.alertmanager import AlertmanagerForwarder
from kvscope.api.alerts import COLLAPSE, AlertBook

BINARY = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Webhook:
    """A receiver Alertmanager posts notifications to."""

    def __init__(self) -> None:
        self.notifications: list[dict] = []
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                hook.notifications.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"


def wait_for(check, what: str, seconds: float = 20.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def alertmanager(tmp_path, require_real):
    require_real(BINARY is not None, "Alertmanager is not installed (Debian package prometheus-alertmanager)")
    hook = Webhook()
    config = tmp_path / "alertmanager.yml"
    config.write_text(
        "route:\n  receiver: hook\n  group_by: [alertname, arm]\n  group_wait: 0s\n  group_interval: 1s\n"
        "  repeat_interval: 1h\n"
        f"receivers:\n  - name: hook\n    webhook_configs:\n      - url: {hook.url}\n        send_resolved: true\n"
    )
    port = free_port()
    process = subprocess.Popen(
        [BINARY, f"--config.file={config}", f"--storage.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{url}/-/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(ready, "Alertmanager to start")
        yield url, hook
    finally:
        process.terminate()
        process.wait(10)
        hook.server.shutdown()


def test_a_firing_then_resolved_collapse_alert_reaches_alertmanager_and_its_receiver(alertmanager):
    url, hook = alertmanager
    book = AlertBook()
    forwarder = AlertmanagerForwarder(url, book, resend_s=0.5, generator_url="http://127.0.0.1:8321/").start()
    labels = {"ab": "ab-1", "arm": "dram_only", "tier": "dram"}
    try:
        book.set(COLLAPSE, labels, "pending", "round 7: dram fills next round")
        time.sleep(1.0)
        assert httpx.get(f"{url}/api/v2/alerts").json() == []  # pending stays in kvscope, as in Prometheus
        book.set(COLLAPSE, labels, "firing", "round 8: hit ratio 0.83 < 0.99 x its ideal 0.89")

        def firing_in_alertmanager():
            alerts = httpx.get(f"{url}/api/v2/alerts").json()
            return [a for a in alerts if a["labels"].get("alertname") == COLLAPSE and a["status"]["state"] == "active"]

        (alert,) = wait_for(firing_in_alertmanager, "the alert in Alertmanager")
        assert alert["labels"] == {"alertname": COLLAPSE, **labels}
        assert alert["annotations"]["summary"].startswith("round 8")
        notified = wait_for(lambda: [n for n in hook.notifications if n["status"] == "firing"], "a firing webhook")
        assert notified[0]["alerts"][0]["labels"]["arm"] == "dram_only"

        book.set(COLLAPSE, labels, None)
        resolved = wait_for(lambda: [n for n in hook.notifications if n["status"] == "resolved"], "a resolved webhook")
        assert resolved[0]["alerts"][0]["endsAt"] != "0001-01-01T00:00:00Z"
    finally:
        forwarder.stop()


def test_an_unreachable_alertmanager_is_reported_not_raised():
    book = AlertBook()
    forwarder = AlertmanagerForwarder(f"http://127.0.0.1:{free_port()}", book, resend_s=60)
    book.set(COLLAPSE, {"arm": "a"}, "firing", "collapsed")
    assert forwarder.post_once() is False
    forwarder.stop()
