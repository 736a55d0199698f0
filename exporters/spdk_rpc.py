"""The SPDK source's JSON-RPC transport: the `spdk` package's own client on a Unix socket or TCP, one call at a time
under the scrape's deadline. What it answers is handed to the parsers (exporters/spdk_answers.py) untouched; the
collector (exporters/spdk.py) decides what to ask and runs this in a worker thread.

`TransportError` is the conversation failing (nothing listening, a closed connection, an answer that is not
JSON-RPC, no answer in time): the scrape fails. A JSON-RPC error answer is not: `Session.call` returns it as an
`RpcFailure`.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import threading
import time
from typing import Any

from spdk.rpc.client import JSONRPCClient, JSONRPCException

from kvscope.exporters.spdk_answers import RpcFailure, decode


class TransportError(Exception):
    """The conversation itself failed; `stale` when a kept connection turned out closed before any answer."""

    def __init__(self, message: str, stale: bool = False) -> None:
        super().__init__(message)
        self.stale = stale


class Client(JSONRPCClient):
    """SPDK's client, decoding answers with spdk_answers.decode: an integer literal too long for any counter is
    kept as a number the parsers report out of range, not handed to int() (which refuses past 4300 digits, and
    the client would take that for a partial answer and wait until the deadline)."""

    def decode_one_response(self) -> Any:
        buffer = self._recv_buf.lstrip()
        try:
            response, end = decode(buffer)
        except ValueError:
            return None  # partial: the client reads more
        self._recv_buf = buffer[end:]
        return response


class Session:
    """Calls on one client, one at a time, each bounded by what is left of the scrape's deadline."""

    def __init__(self, client: JSONRPCClient, deadline: float, aborted: threading.Event) -> None:
        self.client = client
        self.deadline = deadline
        self.aborted = aborted
        self.answered = 0

    def call(self, method: str, params: dict | None = None) -> Any:
        if self.aborted.is_set():
            raise TransportError(f"{method}: the scrape was abandoned")
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TransportError(f"{method}: the scrape's time budget was spent before asking")
        client = self.client
        if client.sock is None:
            raise TransportError(f"{method}: connection closed", stale=True)
        client.timeout = remaining
        try:
            request_id = client.send(method, params)
            response = client.recv()
        except JSONRPCException as error:
            text = squash(error.message)
            raise TransportError(f"{method}: {text}", stale=text.startswith("Connection closed")) from None
        except OSError as error:
            raise TransportError(f"{method}: {error!r}", stale=True) from None
        if (
            not isinstance(response, dict)
            or response.get("id") != request_id
            or ("result" in response) == ("error" in response)
        ):
            raise TransportError(f"{method}: not a JSON-RPC answer to request {request_id}: {snippet(response)}")
        self.answered += 1
        if "error" in response:
            error = response["error"]
            if not isinstance(error, dict):
                return RpcFailure(method, "malformed", snippet(error))
            return RpcFailure(method, str(error.get("code", "")), str(error.get("message", "")))
        return response["result"]


def connect(socket_path: str | None, address: str | None, port: int, deadline: float) -> JSONRPCClient:
    """A client connected to the Unix socket, else to address:port (a host name is resolved first)."""
    remaining = max(deadline - time.monotonic(), 0.001)
    if socket_path is not None:
        addr, tcp_port = socket_path, None
    else:
        addr, tcp_port = resolve(address or "", port), port
    try:
        client = Client(addr, tcp_port, timeout=remaining)
    except JSONRPCException as error:
        raise TransportError(f"cannot connect: {squash(error.message)}") from None
    # The client adds a handler to its per-address logger each time it is built; keep one across reconnects.
    logger = client.get_logger()
    for handler in logger.handlers[:-1]:
        logger.removeHandler(handler)
    return client


def resolve(host: str, port: int) -> str:
    """The spdk client takes IP literals only: resolve a host name first."""
    with contextlib.suppress(ValueError):
        return str(ipaddress.ip_address(host))
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as error:
        raise TransportError(f"cannot resolve {host!r}: {error}") from None
    return str(infos[0][4][0])


def unblock(client: JSONRPCClient) -> None:
    """Make a thread blocked in the client's recv return: lift its CPU-time timeout (positive again, whatever
    CPU time passed) and shut its socket down (recv reads EOF)."""
    client.timeout = 1e9
    sock = client.sock
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def close_quietly(client: JSONRPCClient) -> None:
    sock, client.sock = client.sock, None
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            sock.close()


def squash(text: Any) -> str:
    return snippet(" ".join(str(text).split()))


def snippet(value: Any, limit: int = 200) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "…"
