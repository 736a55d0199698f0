"""A JSON-RPC 2.0 peer that plays an SPDK target: it listens on a Unix socket (or TCP on 127.0.0.1), reads the spdk
package's JSONRPCClient requests off the stream and answers each with what an `answer(method, params)` function
says: a capture under tests/fixtures/spdk/ (live/: a real nvmf_tgt v26.09-pre; top level: SPDK's doc examples) sent
as captured but for the envelope `id`, set to the request's, or an answer built by the test (DERIVED).

A protocol peer, not a patched client: tests/exporters/test_spdk.py drives the collector against it, and the live
dashboard test (tests/dashboards/conftest.py) scrapes a target whose counters move.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "spdk"

# A capture's path under FIXTURES, a DERIVED {"result": ...} / {"error": ...}, or DERIVED bytes: a whole JSON-RPC
# response as sent (for what json.dumps cannot write, such as an integer literal of thousands of digits).
Answer = str | dict | bytes


def capture(path: str) -> dict:
    return json.loads((FIXTURES / path).read_bytes())


class SpdkPeer:
    """A JSON-RPC 2.0 server: requests may come several per read or split across reads; one answer each, in order.

    `mode` changes what it sends: "answer", "slow" (after `delay_s`), "garbage" (not JSON, connection kept),
    "garbage_close", "not_jsonrpc" (JSON that is no response), "wrong_id", "trickle" (one space every 50 ms, never
    an answer)."""

    def __init__(self, answer: Callable[[str, Any], Answer], path: Path | None = None) -> None:
        self.answer = answer
        self.mode = "answer"
        self.delay_s = 0.0
        self.connections = 0
        self.requests: list[tuple[str, Any]] = []
        self._open: list[socket.socket] = []
        self._closed = threading.Event()
        if path is not None:
            self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.listener.bind(str(path))
        else:
            self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.listener.settimeout(0.05)
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    @property
    def port(self) -> int:
        return self.listener.getsockname()[1]

    def methods(self) -> list[str]:
        return [method for method, _ in self.requests]

    def hang_up_all(self) -> None:
        """What a restarted target does to its clients' connections."""
        for conn in list(self._open):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Stop listening for real (the accept thread is gone before the socket closes): connect is refused."""
        self._closed.set()
        self._acceptor.join()
        self.listener.close()
        self.hang_up_all()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            self.connections += 1
            self._open.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        decoder, buffer = json.JSONDecoder(), ""
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                buffer += data.decode()
                while (text := buffer.lstrip()) != "":
                    try:
                        request, end = decoder.raw_decode(text)
                    except ValueError:
                        break  # a request split across reads: wait for the rest
                    buffer = text[end:]
                    if not self._respond(conn, request):
                        return
                else:
                    buffer = ""

    def _respond(self, conn: socket.socket, request: Any) -> bool:
        valid = (
            isinstance(request, dict)
            and request.get("jsonrpc") == "2.0"
            and isinstance(request.get("method"), str)
            and "id" in request
        )
        if not valid:
            error = {"code": -32600, "message": "Invalid request"}
            conn.sendall(json.dumps({"jsonrpc": "2.0", "id": None, "error": error}).encode() + b"\n")
            return True
        self.requests.append((request["method"], request.get("params")))
        mode = self.mode
        if mode == "garbage":
            conn.sendall(b"this is not json-rpc\n")
            return True
        if mode == "garbage_close":
            conn.sendall(b"<html>502 Bad Gateway</html>\n")
            return False
        if mode == "not_jsonrpc":
            conn.sendall(b"[1, 2, 3]\n")
            return True
        if mode == "trickle":
            while not self._closed.is_set():
                try:
                    conn.sendall(b" ")
                except OSError:
                    return False
                time.sleep(0.05)
            return False
        if mode == "slow":
            time.sleep(self.delay_s)
        request_id = request["id"] + (1000 if mode == "wrong_id" else 0)
        answer = self.answer(request["method"], request.get("params"))
        try:
            conn.sendall(envelope(answer, request_id))
        except OSError:
            return False
        return True


def envelope(answer: Answer, request_id: int) -> bytes:
    """A capture's bytes with only the envelope id set to the request's; or a DERIVED answer, compact like SPDK."""
    if isinstance(answer, bytes):
        out = re.sub(rb'"id":\s*\d+', b'"id":%d' % request_id, answer, count=1)
        assert re.search(rb'"id":%d\b' % request_id, out)
        return out
    if isinstance(answer, dict):
        return json.dumps({"jsonrpc": "2.0", "id": request_id, **answer}, separators=(",", ":")).encode() + b"\n"
    raw = (FIXTURES / answer).read_bytes()
    out = re.sub(rb'"id":\s*\d+', b'"id":%d' % request_id, raw, count=1)
    assert json.loads(out)["id"] == request_id
    return out
