"""The Prometheus text sources' GET (exporters/httpget.py): one connection kept per target, answers framed every
way HTTP/1.1 frames them, and every failure a GetError saying why, the connection never reused mid-answer."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import Awaitable, Callable

import pytest
from pydantic import AnyHttpUrl

from kvscope.exporters.httpget import GetError, HttpxGet, PlainGet, get_for

BODY = b'vllm:prefix_cache_queries_total{engine="0"} 1000.0\n' * 2000  # about 100 kB: several reads

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def serve(handler: Handler) -> tuple[asyncio.Server, str, list[int]]:
    """A server on 127.0.0.1 answering each connection with `handler`; returns it, its URL and a list that gets one
    entry per connection accepted."""
    connections: list[int] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}/metrics", connections


def answering(*heads: bytes, body: bytes = BODY, requests: int = 1_000) -> Handler:
    """Answers up to `requests` GETs on a connection, each with the next of `heads` (the last repeated) and `body`."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for index in range(requests):
            request = await reader.readuntil(b"\r\n\r\n")
            assert request.startswith(b"GET /metrics HTTP/1.1\r\n") and b"Accept-Encoding: identity" in request
            writer.write(heads[min(index, len(heads) - 1)] + body)
            await writer.drain()

    return handler


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())


def test_one_connection_is_kept_for_every_get():
    async def test() -> None:
        server, url, connections = await serve(answering(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(BODY)))
        get = PlainGet(AnyHttpUrl(url), 2.0)
        for _ in range(5):
            assert await get.text() == BODY.decode()
        assert len(connections) == 1
        await get.close()
        server.close()

    run(test)


def test_a_kept_connection_the_target_closed_is_opened_again_once():
    """uvicorn closes a connection idle for 5 s, a scrape interval's length: the next GET finds it closed."""

    async def test() -> None:
        head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(BODY)
        server, url, connections = await serve(answering(head, requests=1))  # closes after each answer
        get = PlainGet(AnyHttpUrl(url), 2.0)
        for _ in range(3):
            assert await get.text() == BODY.decode()
            await asyncio.sleep(0.05)  # the close reaches the client
        assert len(connections) == 3
        await get.close()
        server.close()

    run(test)


@pytest.mark.parametrize(
    ("head", "body"),
    [
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)),
        (b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n", BODY),  # ends with its connection
        (
            b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(gzip.compress(BODY)),
            gzip.compress(BODY),
        ),
    ],
    ids=["chunked", "delimited by close", "gzip anyway"],
)
def test_every_framing_gives_the_body(head, body):
    async def test() -> None:
        server, url, _ = await serve(answering(head, body=body, requests=1))
        get = PlainGet(AnyHttpUrl(url), 2.0)
        assert await get.text() == BODY.decode()
        assert await get.text() == BODY.decode()  # a new connection: that one closed
        await get.close()
        server.close()

    run(test)


def test_a_charset_decodes_the_body():
    async def test() -> None:
        body = 'x{name="é"} 1\n'.encode("latin-1")
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=ISO-8859-1\r\nContent-Length: %d\r\n\r\n"
        server, url, _ = await serve(answering(head % len(body), body=body))
        assert await PlainGet(AnyHttpUrl(url), 2.0).text() == 'x{name="é"} 1\n'
        server.close()

    run(test)


async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")
    await asyncio.sleep(5)


async def half(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part")


async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"\x00\x01 this is not HTTP\r\n\r\n")
    await asyncio.sleep(1)


@pytest.mark.parametrize(
    ("handler", "message"),
    [
        (answering(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 5\r\n\r\n", body=b"down\n"), "^answered 503 "),
        (silent, r"^no answer within 0\.3 s$"),
        (half, "^the connection closed in the middle of the answer$"),
        (garbage, "^not an HTTP answer: "),
    ],
    ids=["status", "silent", "cut short", "garbage"],
)
def test_a_failed_get_says_why_and_drops_its_connection(handler, message):
    async def test() -> None:
        server, url, connections = await serve(handler)
        get = PlainGet(AnyHttpUrl(url), 0.3)
        for attempt in (1, 2):
            with pytest.raises(GetError, match=message):
                await get.text()
            assert len(connections) == attempt, "a connection left mid-answer is never reused"
        server.close()

    run(test)


def test_nothing_listening_is_a_get_error():
    async def test() -> None:
        server, url, _ = await serve(silent)
        server.close()
        await server.wait_closed()
        with pytest.raises(GetError, match=r"^cannot connect to 127\.0\.0\.1:\d+: "):
            await PlainGet(AnyHttpUrl(url), 1.0).text()

    run(test)


def test_a_get_abandoned_at_the_deadline_leaves_no_connection_to_reuse():
    async def test() -> None:
        server, url, connections = await serve(silent)
        get = PlainGet(AnyHttpUrl(url), 5.0)
        for attempt in (1, 2):
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(get.text(), 0.1)  # the scrape loop's deadline, before the GET's own
            assert len(connections) == attempt
        server.close()

    run(test)


def test_what_plain_http_cannot_serve_goes_through_httpx(monkeypatch):
    for env in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(env, raising=False)
    assert isinstance(get_for(AnyHttpUrl("http://gpu-a:8000/metrics"), 1.0), PlainGet)
    assert isinstance(get_for(AnyHttpUrl("https://gpu-a:8000/metrics"), 1.0), HttpxGet)
    assert isinstance(get_for(AnyHttpUrl("http://user:secret@gpu-a:8000/metrics"), 1.0), HttpxGet)
    monkeypatch.setenv("HTTP_PROXY", "http://proxy:3128")
    assert isinstance(get_for(AnyHttpUrl("http://gpu-a:8000/metrics"), 1.0), HttpxGet)
