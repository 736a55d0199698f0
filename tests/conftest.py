"""Suite-wide helpers: the real-component gate, the real binaries behind it (Prometheus, promtool, Alertmanager)
with `promtool check metrics`, and a real HTTP server on 127.0.0.1 whose answers a test sets per path (body, status,
delay). Plain helpers for the tests that start real servers are in tests/support/realservers.py."""

import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

REQUIRE_REAL = os.environ.get("KVSCOPE_REQUIRE_REAL") == "1"


@pytest.fixture
def require_real():
    """`require_real(available, "what is missing")`: skip when a real component is absent, or fail under
    KVSCOPE_REQUIRE_REAL=1 (CI), where every real component must be there."""

    def check(available: bool, missing: str) -> None:
        if available:
            return
        if REQUIRE_REAL:
            pytest.fail(f"{missing} (KVSCOPE_REQUIRE_REAL=1: real components are required)")
        pytest.skip(missing)

    return check


# A real binary the tests run: the names it goes by on PATH, what it is called when missing, and where it comes from.
BINARIES = {
    "prometheus": (("prometheus",), "prometheus", "Debian package prometheus"),
    "promtool": (("promtool",), "promtool", "Debian package prometheus"),
    "alertmanager": (
        ("prometheus-alertmanager", "alertmanager"),
        "Alertmanager",
        "Debian package prometheus-alertmanager",
    ),
}


@pytest.fixture
def real_binary(require_real):
    """`real_binary("promtool")`: the path of one of BINARIES; when it is not installed, `require_real` skips the
    test (or fails it under KVSCOPE_REQUIRE_REAL=1) naming the package that has it."""

    def find(name: str) -> str:
        names, called, package = BINARIES[name]
        path = next((found for found in map(shutil.which, names) if found), None)
        require_real(path is not None, f"{called} is not installed ({package})")
        return path

    return find


@pytest.fixture
def check_metrics(real_binary):
    """`check_metrics(text)`: `promtool check metrics` finds nothing to complain about in the exposition `text`
    (it exits 0 and prints nothing); returns promtool's run. Needs promtool (see `real_binary`)."""
    promtool = real_binary("promtool")

    def check(text: str) -> subprocess.CompletedProcess:
        checked = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert checked.stdout.strip() == "" and checked.stderr.strip() == ""
        return checked

    return check


@dataclass
class Answer:
    body: bytes
    status: int = 200
    delay_s: float = 0.0


class MetricsServer:
    def __init__(self) -> None:
        self.answers: dict[str, Answer] = {}
        self.served: dict[str, int] = {}  # path -> GETs answered
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                answer = server.answers.get(self.path, Answer(b"not found", 404))
                time.sleep(answer.delay_s)
                self.send_response(answer.status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(answer.body)))
                self.end_headers()
                self.wfile.write(answer.body)
                server.served[self.path] = server.served.get(self.path, 0) + 1

            def log_message(self, *args) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self._httpd.server_port}{path}"

    def serve(self, path: str, body: str | bytes, status: int = 200, delay_s: float = 0.0) -> str:
        """Answer GET `path` with `body` from now on; returns its URL."""
        self.answers[path] = Answer(body.encode() if isinstance(body, str) else body, status, delay_s)
        return self.url(path)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


@pytest.fixture
def metrics_server():
    server = MetricsServer()
    yield server
    server.close()
