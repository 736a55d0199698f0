"""Real servers on 127.0.0.1 for the tests that start them: a free port, polling until something is ready, a real
binary with its log kept (Prometheus, Alertmanager), an HTTP receiver of POSTs (Alertmanager's webhook, an OTLP
endpoint), the shipped alertmanager.yml pointed at such a receiver, the kvscope service under uvicorn in a thread,
and the exposition kvscope's exporter serves after one scrape.

Whether a real binary must be there is for the `require_real` and `real_binary` fixtures (tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TypeVar

import httpx
import uvicorn
import yaml
from pydantic import SecretStr

from kvscope.api.app import create_app
from kvscope.api.settings import Settings
from kvscope.exporters.otel import TelemetryBridge
from kvscope.exporters.scrape import Scraper
from kvscope.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"
TOKEN = "test-token"  # the bearer token of the service `Service` starts

T = TypeVar("T")


def wait_for(check: Callable[[], T], what: str, seconds: float = 20.0, interval: float = 0.1) -> T:
    """Call `check` every `interval` seconds until it returns something truthy, and return that; an AssertionError
    naming `what` once `seconds` have passed without."""
    deadline = time.monotonic() + seconds
    while not (found := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {seconds:.0f} s waiting for {what}")
        time.sleep(interval)
    return found


def ready(url: str) -> bool:
    """Whether GET `url` answers 200 (False while nothing listens)."""
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


# ----------------------------------------------------------------------------------------------- real binaries


class Process:
    """A real binary, stopped by its pid; its stderr is kept in `log` to explain a failure. `port` and `url`: where
    it listens, for a server."""

    def __init__(self, args: list[str], log: Path, port: int | None = None) -> None:
        self.log = log
        self.port = port
        self.url = f"http://{HOST}:{port}" if port is not None else None
        self._log_file = log.open("wb")
        self.popen = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=self._log_file)

    def stop(self) -> None:
        self.popen.terminate()
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(10)
        self._log_file.close()

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def wait_ready(self, what: str, seconds: float = 30.0) -> None:
        """Wait until GET /-/ready answers 200 (Prometheus, Alertmanager); fail with the log's tail if it exits or
        takes longer than `seconds`."""

        def up() -> bool:
            assert self.popen.poll() is None, f"{what} exited with {self.popen.returncode}:\n{self.tail()}"
            return ready(f"{self.url}/-/ready")

        try:
            wait_for(up, f"{what} to start", seconds)
        except AssertionError as error:
            raise AssertionError(f"{error}\n{self.tail()}") from None


def start_prometheus(binary: str, config: Path, tsdb: Path, log: Path, *flags: str, port: int | None = None) -> Process:
    """A real Prometheus on 127.0.0.1 (`port`, else a free one) with `config` and its TSDB in `tsdb`, started but
    not waited for (`wait_ready`)."""
    port = free_port() if port is None else port
    args = [binary, f"--config.file={config}", f"--storage.tsdb.path={tsdb}", f"--web.listen-address={HOST}:{port}"]
    return Process([*args, *flags], log, port)


def start_alertmanager(binary: str, config: Path, storage: Path, log: Path) -> Process:
    """A real Alertmanager on a free port of 127.0.0.1, alone (no cluster), started but not waited for."""
    port = free_port()
    args = [binary, f"--config.file={config}", f"--storage.path={storage}", f"--web.listen-address={HOST}:{port}"]
    return Process([*args, "--cluster.listen-address="], log, port)


# ------------------------------------------------------------------------------------------------ receivers


class PostReceiver:
    """An HTTP server on a free port of 127.0.0.1, in a thread, that keeps what it is posted, (path, body) in
    `posts`, and answers each POST 200 with an empty body (of `content_type`, if given)."""

    def __init__(self, content_type: str | None = None) -> None:
        self.posts: list[tuple[str, bytes]] = []
        posts = self.posts

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                posts.append((self.path, self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                if content_type is not None:
                    self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer((HOST, 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://{HOST}:{self.server.server_port}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Webhook(PostReceiver):
    """The receiver Alertmanager posts notifications to (on any path of `url`)."""

    @property
    def notifications(self) -> list[dict]:
        """Every notification received so far, in order, with the path it was posted on."""
        return [{"path": path, **json.loads(body)} for path, body in list(self.posts)]

    def firing(self, alertname: str) -> list[tuple[dict, dict]]:
        """(notification, alert) for every firing alert called `alertname` received so far."""
        return [
            (notification, alert)
            for notification in self.notifications
            for alert in notification["alerts"]
            if alert["status"] == "firing" and alert["labels"].get("alertname") == alertname
        ]


# ------------------------------------------------------------------------------------------ the kvscope service


class Uvicorn:
    """An ASGI app under uvicorn in a thread on 127.0.0.1:`port`, started; `stop()` is a clean shutdown (the
    lifespan's teardown runs)."""

    def __init__(self, app, port: int) -> None:
        self.port = port
        self.url = f"http://{HOST}:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host=HOST, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.client = httpx.Client(base_url=self.url, timeout=10)

        def started() -> bool:
            assert self.thread.is_alive(), "the service did not start"
            return self.server.started

        wait_for(started, "the service to start", 20, 0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        self.client.close()


class Service(Uvicorn):
    """The kvscope service on a free port, its database (`db`) and A/B workdir under `folder`, the bearer token
    TOKEN; `settings` add to or override those."""

    def __init__(self, folder: Path, **settings: object) -> None:
        defaults = {"host": HOST, "port": free_port(), "token": SecretStr(TOKEN)}
        defaults |= {"db": folder / "service.duckdb", "workdir": folder / "ab"}
        chosen = Settings(**{**defaults, **settings})
        self.db = chosen.db
        super().__init__(create_app(chosen), chosen.port)


# ---------------------------------------------------------------------------------------------- the exporter


def shipped_alertmanager_config(hook: Webhook) -> dict:
    """deploy/alertmanager/alertmanager.yml with its receivers posting to `hook` (one path per receiver) and its
    waits cut to a second; routes, matchers and inhibitions stay as shipped."""
    config = yaml.safe_load((ROOT / "deploy" / "alertmanager" / "alertmanager.yml").read_text())
    for receiver in config["receivers"]:
        for webhook in receiver.get("webhook_configs", []):
            webhook["url"] = f"{hook.url}/{receiver['name']}"
    routes = [config["route"]]
    while routes:
        route = routes.pop()
        route.update(group_wait="0s", group_interval="1s")
        routes.extend(route.get("routes", []))
    return config


def scrape_once(scraper: Scraper) -> None:
    """Scrape every target of `scraper` once, then close its connections (the states stay)."""

    async def once() -> None:
        await scraper.scrape_all()
        await scraper.close()

    asyncio.run(once())


def served_exposition(config) -> str:
    """What kvscope's Prometheus endpoint serves after one scrape of `config`'s targets (a parsed config)."""
    scraper = Scraper(config.targets)
    scrape_once(scraper)
    bridge = TelemetryBridge(scraper, config.exporter)
    try:
        return httpx.get(f"http://{HOST}:{bridge.serve()}/metrics").text
    finally:
        bridge.shutdown()
