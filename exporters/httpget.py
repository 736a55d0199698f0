"""The GET of a Prometheus text source's /metrics: one connection kept per target, plain HTTP/1.1 where it can be.

A target is asked the same GET every few seconds, usually on the node's own loopback or network. httpx cost about
1.2 ms of CPU per GET of a vLLM engine's 74 kB exposition (httpx, httpcore's pool, anyio and h11 stacked on asyncio;
0.9 ms on a kept connection), which was a third of a realistic node's scrape (bench/scrape.py). `PlainGet` sends a
request built once on a connection kept between scrapes and reads the answer with httptools (uvicorn's C parser:
lengths, chunks, keep-alive), about 0.3 ms. It asks for the body uncompressed (a target on the node's network is
not worth the gzip on both sides; an answer compressed anyway is decompressed).

A URL it does not take (https, a user and password, an HTTP proxy in the environment) goes through httpx
(`HttpxGet`: its TLS, credentials and proxy settings). Either way the answer is the body's text or a `GetError`
saying why not: no connection, a status other than 2xx, a malformed answer, no answer within the target's timeout.
A connection kept from the last scrape that turns out closed before answering is opened again once (a GET can be
repeated); one a scrape abandoned (its deadline, an error) is closed, never reused mid-answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import urllib.request
import zlib
from typing import Protocol

import httptools
import httpx
from pydantic import AnyHttpUrl


class GetError(Exception):
    """A GET that gave no body: the message says why."""


class Get(Protocol):
    async def text(self) -> str: ...

    async def close(self) -> None: ...


def get_for(url: AnyHttpUrl, timeout_s: float) -> Get:
    """PlainGet where it can serve `url`, else httpx."""
    proxies = urllib.request.getproxies()
    if url.scheme == "http" and url.username is None and not (proxies.get("http") or proxies.get("all")):
        return PlainGet(url, timeout_s)
    return HttpxGet(str(url), timeout_s)


class HttpxGet:
    """GET through httpx: TLS, credentials in the URL and the environment's proxies."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self._url = url
        self._client = httpx.AsyncClient(timeout=timeout_s)

    async def text(self) -> str:
        try:
            response = await self._client.get(self._url)
            response.raise_for_status()
        except httpx.HTTPError as error:
            raise GetError(repr(error)) from None
        return response.text

    async def close(self) -> None:
        await self._client.aclose()


class PlainGet:
    """GET of one http:// URL on a connection kept between calls, bounded by `timeout_s`."""

    def __init__(self, url: AnyHttpUrl, timeout_s: float) -> None:
        self._host, self._port = (url.host or "").strip("[]"), url.port or 80
        host = f"[{self._host}]" if ":" in self._host else self._host
        host += "" if self._port == 80 else f":{self._port}"
        target = (url.path or "/") + (f"?{url.query}" if url.query else "")
        self._request = (
            f"GET {target} HTTP/1.1\r\nHost: {host}\r\nAccept: */*\r\nAccept-Encoding: identity\r\n"
            "User-Agent: kvscope\r\n\r\n"
        ).encode()
        self._timeout_s = timeout_s
        self._connection: _Connection | None = None

    async def text(self) -> str:
        try:
            async with asyncio.timeout(self._timeout_s):
                return await self._answer()
        except TimeoutError:
            raise GetError(f"no answer within {self._timeout_s:g} s") from None

    async def close(self) -> None:
        self._drop()

    async def _answer(self) -> str:
        loop = asyncio.get_running_loop()
        kept = self._connection is not None and self._connection.usable(loop)
        while True:
            if not kept:
                self._drop()  # closed by the target, or opened on another (now closed) event loop
                self._connection = await self._connect(loop)
            connection = self._connection
            assert connection is not None
            try:
                text = await connection.exchange(self._request)
            except BaseException as error:  # an error, the deadline: what the connection holds next is unknown
                self._drop()
                if kept and isinstance(error, _ClosedUnanswered):
                    kept = False  # the target closed the kept connection (its idle timeout): open one once more
                    continue
                raise
            if not connection.keep:
                self._drop()
            return text

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> _Connection:
        try:
            _, connection = await loop.create_connection(lambda: _Connection(loop), self._host, self._port)
        except OSError as error:
            raise GetError(f"cannot connect to {self._host}:{self._port}: {error.strerror or repr(error)}") from None
        return connection

    def _drop(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None


class _ClosedUnanswered(GetError):
    """The connection closed before any byte of the answer came."""


class _Connection(asyncio.Protocol):
    """One TCP connection and the answer it is reading (httptools calls the `on_*` methods from feed_data)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self._parser: httptools.HttpResponseParser | None = None
        self._answer: asyncio.Future[None] | None = None
        self._reason = b""
        self._headers: dict[bytes, bytes] = {}
        self._body: list[bytes] = []
        self._received = False
        self.keep = False  # the last answer leaves the connection open for the next GET

    def usable(self, loop: asyncio.AbstractEventLoop) -> bool:
        return self._loop is loop and self._transport is not None and not self._transport.is_closing()

    def close(self) -> None:
        if self._transport is not None:
            with contextlib.suppress(RuntimeError):  # its event loop has ended: so has the connection
                self._transport.abort()

    async def exchange(self, request: bytes) -> str:
        """Send `request` and read the answer's body as text."""
        assert self._transport is not None
        self._parser = httptools.HttpResponseParser(self)
        self._answer = self._loop.create_future()
        self._reason, self._headers, self._body, self._received, self.keep = b"", {}, [], False, False
        self._transport.write(request)
        await self._answer
        parser, self._parser = self._parser, None
        status = parser.get_status_code()
        if not 200 <= status < 300:
            raise GetError(f"answered {status} {self._reason.decode(errors='replace')}".rstrip())
        return _text(b"".join(self._body), self._headers)

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self._parser is None or self._answer is None or self._answer.done():
            self.close()  # bytes nobody asked for: the connection cannot be trusted with the next GET
            return
        self._received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._settle(GetError(f"not an HTTP answer: {error}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._answer is None or self._answer.done():
            return
        if not self._received:
            self._settle(_ClosedUnanswered("the connection closed before an answer"))
        elif self._parser is not None and _delimited_by_close(self._parser, self._headers):
            self._settle(None)  # an answer with neither length nor chunks ends with its connection
        else:
            self._settle(GetError("the connection closed in the middle of the answer"))

    # httptools callbacks

    def on_status(self, reason: bytes) -> None:
        self._reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        assert self._parser is not None
        self.keep = self._parser.should_keep_alive()  # llhttp forgets it once the message is complete

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._settle(None)

    def _settle(self, error: Exception | None) -> None:
        if self._answer is not None and not self._answer.done():
            if error is None:
                self._answer.set_result(None)
            else:
                self._answer.set_exception(error)


def _delimited_by_close(parser: httptools.HttpResponseParser, headers: dict[bytes, bytes]) -> bool:
    """Whether the answer's body ends where its connection does (HTTP/1.1 section 6.3, case 7)."""
    if b"content-length" in headers or b"chunked" in headers.get(b"transfer-encoding", b"").lower():
        return False
    try:
        return parser.get_status_code() >= 200
    except httptools.HttpParserError:
        return False


def _text(body: bytes, headers: dict[bytes, bytes]) -> str:
    """The body as text: decompressed as its Content-Encoding says, decoded by its charset (UTF-8 by default, bad
    bytes replaced, as httpx's Response.text does)."""
    encoding = headers.get(b"content-encoding", b"identity").strip().lower()
    try:
        if encoding == b"gzip":
            body = gzip.decompress(body)
        elif encoding == b"deflate":
            body = zlib.decompress(body)
        elif encoding != b"identity":
            raise GetError(f"answered in an encoding it was not asked for: {encoding.decode(errors='replace')}")
    except (OSError, EOFError, zlib.error) as error:
        raise GetError(f"a {encoding.decode()} body that does not decompress: {error}") from None
    charset = "utf-8"
    for parameter in headers.get(b"content-type", b"").decode("latin-1").split(";")[1:]:
        key, _, value = parameter.strip().partition("=")
        if key.lower() == "charset" and value:
            charset = value.strip('"')
    try:
        return body.decode(charset, errors="replace")
    except LookupError:
        return body.decode("utf-8", errors="replace")
