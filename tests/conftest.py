"""Suite-wide helpers: the real-component gate, and a real HTTP server on 127.0.0.1 whose answers a test sets
per path (body, status, delay)."""

import os
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


@dataclass
class Answer:
    body: bytes
    status: int = 200
    delay_s: float = 0.0


class MetricsServer:
    def __init__(self) -> None:
        self.answers: dict[str, Answer] = {}
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
