"""The SPDK source's JSON-RPC transport: the `spdk` package's own client on a Unix socket or TCP, one call at a time
under the scrape's deadline. What it answers is handed to the parsers (exporters/spdk_answers.py) untouched; the
collector (exporters/spdk.py) decides what to ask and runs this in a worker thread.

`TransportError` is the conversation failing (nothing listening, a closed connection, an answer that is not
JSON-RPC, no answer in time): the scrape fails. A JSON-RPC error answer is not: `Session.call` returns it as an
`RpcFailure`.
"""

from __future__ import annotations

import codecs
import contextlib
import ipaddress
import json
import socket
import threading
import time
from functools import cached_property
from typing import Any

from spdk.rpc.client import JSONRPCClient, JSONRPCException

from kvscope.exporters.spdk_answers import RpcFailure, decode

RECV_SIZE = 65536  # bytes read at a time: the live captures' answers are 0.3 to 3 kB, iostat of many bdevs more


class TransportError(Exception):
    """The conversation itself failed; `stale` when a kept connection turned out closed before any answer."""

    def __init__(self, message: str, stale: bool = False) -> None:
        super().__init__(message)
        self.stale = stale


class Client(JSONRPCClient):
    """SPDK's client (its connection and request ids), sending and reading as kvscope needs:

    - answers decoded with spdk_answers.decode: an integer literal too long for any counter is kept as a number
      the parsers report out of range, not handed to int() (which refuses past 4300 digits, and the client would
      take that for a partial answer and wait until the deadline);
    - nothing formatted for its log unless the log wants it: SPDK's send and recv format every request and answer
      as indented JSON for debug and info lines before the logger's level is looked at (0.3 ms of CPU a scrape
      of the live captures, a third of the conversation);
    - recv waits `timeout` seconds of wall time, reading 64 KiB at a time: SPDK's counts process CPU time (every
      thread's), and once that budget is spent its loop retries a negative socket timeout forever.
    """

    def send(self, method: str, params: dict | None = None) -> int:
        self._request_id += 1
        request: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "id": self._request_id}
        if params:
            request["params"] = params
        self.sock.sendall(json.dumps(request).encode())
        return self._request_id

    def recv(self) -> Any:
        deadline = time.monotonic() + self.timeout
        response = self.decode_one_response()
        while response is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise JSONRPCException(f"Timeout while waiting for response:\n{self._recv_buf}\n")
            self.sock.settimeout(remaining)
            try:
                data = self.sock.recv(RECV_SIZE)
            except TimeoutError:
                raise JSONRPCException(f"Timeout while waiting for response:\n{self._recv_buf}\n") from None
            if not data:
                self.sock.close()
                self.sock = None
                raise JSONRPCException(f"Connection closed with partial response:\n{self._recv_buf}\n")
            try:
                self._recv_buf += self._utf8.decode(data)
            except UnicodeDecodeError as error:
                raise JSONRPCException(f"an answer that is not UTF-8: {error}") from None
            response = self.decode_one_response()
        return response

    def decode_one_response(self) -> Any:
        buffer = self._recv_buf.lstrip()
        try:
            response, end = decode(buffer)
        except ValueError:
            return None  # partial: the client reads more
        self._recv_buf = buffer[end:]
        return response

    @cached_property
    def _utf8(self) -> codecs.IncrementalDecoder:
        """The connection's bytes to text, a character split between two reads kept for the next."""
        return codecs.getincrementaldecoder("utf-8")()


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
    """Make a thread blocked in the client's recv return: shut its socket down (recv reads EOF)."""
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
