"""The Prometheus exposition of the scrape snapshots, rendered once per series and cached.

A scrape's samples are the same series scrape after scrape and often the same values, so each series' text is
rendered by prometheus_client the first time it is seen (its name, sorted labels and escaping exactly as
prometheus_client writes them) and kept; a later scrape only writes the value when it changed. Names are the ones
OpenTelemetry's Prometheus exporter gives the same instruments (its own name and unit mapping), so /metrics and
OTLP name every instrument alike, and the labels are the ones it would write (each family's series carry the union
of their label keys, a missing one as ""), less the `otel_scope_*` labels, which were the same on every series.

The cost this saves: converting every data point through the OpenTelemetry SDK and then escaping and validating
every label of every sample in prometheus_client took 20 ms of CPU for one scrape of 8 NICs (bench/scrape.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from email.utils import formatdate
from operator import itemgetter

import uvicorn
import uvloop
from opentelemetry.exporter.prometheus._mapping import map_unit, sanitize_attribute, sanitize_full_name
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from kvscope.samples import Labels

# The cache of rendered series is emptied past this many: a source whose label values churn must not grow it.
MAX_CACHED_SERIES = 1 << 17
# zlib's fastest level: 130 kB of exposition compress in 0.2 ms to 6.1 kB, where level 6 takes 0.66 ms for 5.3 kB
# and level 9 (gzip.compress's default) 1.4 ms for 4.8 kB; an answer compressed on every node every scrape
# interval is worth its CPU, not its last kilobyte.
GZIP_LEVEL = 1

# One row of a family: its labels, the scrape target it came from (None for series that name no target), its value.
Row = tuple[Labels, str | None, float]


@dataclass(frozen=True, slots=True)
class Family:
    """An instrument as Prometheus sees it: its HELP and TYPE lines, and the name its samples carry."""

    header: str
    sample_name: str

    @classmethod
    def of(cls, name: str, kind: str, unit: str, description: str) -> Family:
        """As OpenTelemetry's Prometheus exporter maps an instrument (name, unit suffix, `_total` of a counter)."""
        make = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        family = make(sanitize_full_name(name), description, labels=[], unit=map_unit(unit))
        family.add_metric([], 0.0)
        *header, sample = _render([family]).splitlines()
        return cls("".join(f"{line}\n" for line in header), sample.rsplit(" ", 1)[0])


class Exposition:
    """Families of rows rendered as Prometheus text, every series' text kept between renders."""

    def __init__(self, resource: dict[str, str]) -> None:
        info = InfoMetricFamily(
            "target", "Target metadata", value={sanitize_attribute(k): v for k, v in resource.items()}
        )
        self._target_info = _render([info])  # the resource's attributes, as OpenTelemetry's exporter writes them
        # (sample name, labels, target, label keys) -> [the series' text before its value, last value, its line]
        self._series: dict[tuple, list] = {}
        # sample name -> the family's rows when last rendered, and its lines: rows equal to the last (the same label
        # tuples, targets and values) are not looked at one by one again
        self._families: dict[str, tuple[list[Row], str]] = {}
        self._lock = threading.Lock()  # two scrapes at once must not interleave their updates of one series

    def render(self, families: Iterable[tuple[Family, Sequence[Row]]]) -> str:
        """The text of every family that has rows (a family without rows is left out, as OpenTelemetry does)."""
        with self._lock:
            if len(self._series) > MAX_CACHED_SERIES:
                self._series.clear()
                self._families.clear()
            parts = [self._target_info]
            for family, rows in families:
                if rows:
                    parts.append(family.header)
                    parts.append(self._family_lines(family.sample_name, rows))
            return "".join(parts)

    def _family_lines(self, sample_name: str, rows: Sequence[Row]) -> str:
        last = self._families.get(sample_name)
        if last is None or last[0] != rows:
            rows = list(rows)
            last = self._families[sample_name] = (rows, "".join(self._lines(sample_name, rows)))
        return last[1]

    def _lines(self, sample_name: str, rows: Sequence[Row]) -> Iterator[str]:
        keys: set[str] = set()
        for labels, target, _ in rows:
            keys.update(map(itemgetter(0), labels))
            if target is not None:
                keys.add("target")
        label_keys = tuple(sorted(keys))
        series = self._series
        for labels, target, value in rows:
            key = (sample_name, labels, target, label_keys)
            cached = series.get(key)
            if cached is None:
                cached = series[key] = [_series_text(sample_name, labels, target, label_keys), None, ""]
            if cached[1] != value:  # NaN never equals itself: written again each time, which is correct
                cached[1], cached[2] = value, f"{cached[0]} {floatToGoString(value)}\n"
            yield cached[2]


def _series_text(sample_name: str, labels: Labels, target: str | None, label_keys: tuple[str, ...]) -> str:
    """`name{label="value",...}` as prometheus_client writes it: keys sorted, each missing one as ""."""
    values = dict(labels)
    if target is not None:
        values["target"] = target
    family = GaugeMetricFamily(sample_name, "", labels=label_keys)
    family.add_metric([values.get(key, "") for key in label_keys], 0.0)
    return _render([family]).splitlines()[-1].rsplit(" ", 1)[0]


class _Families:
    """What generate_latest asks of a registry: the families to render."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def _render(families: list[Metric]) -> str:
    return generate_latest(_Families(families)).decode()


class MetricsServer:
    """`/metrics` over HTTP, served by uvicorn on a thread and event loop of its own (a slow render never delays a
    scrape), gzip-compressed when the scraper accepts it, as Prometheus does. The loop is uvloop's (uvicorn[standard]
    brings it), 0.08 ms of CPU less per GET than asyncio's."""

    def __init__(self, host: str, port: int, body: Callable[[], bytes]) -> None:
        self._body = body
        self._socket = socket.create_server((host, port))
        self.port: int = self._socket.getsockname()[1]
        config = uvicorn.Config(
            self._app,
            interface="asgi3",
            log_level="warning",
            access_log=False,
            lifespan="off",
            proxy_headers=False,
            date_header=False,  # each answer's own (_answer): uvicorn's is refreshed by waking every second
        )
        self._server = _Server(config)
        self._thread = threading.Thread(
            target=uvloop.run, args=(self._server.serve([self._socket]),), name="kvscope /metrics", daemon=True
        )
        self._thread.start()

    async def _app(self, scope: dict, _receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] not in ("/metrics", "/"):
            await _answer(send, 404, b"only /metrics is served here\n", [(b"content-type", b"text/plain")])
            return
        body = self._body()
        headers = [(b"content-type", CONTENT_TYPE_LATEST.encode())]
        if b"gzip" in dict(scope["headers"]).get(b"accept-encoding", b""):
            body = gzip.compress(body, GZIP_LEVEL)
            headers.append((b"content-encoding", b"gzip"))
        await _answer(send, 200, body, headers)

    def close(self) -> None:
        self._server.exit()
        self._thread.join(5)
        self._socket.close()


class _Server(uvicorn.Server):
    """uvicorn's server, asleep between requests. uvicorn's main loop wakes every 0.1 s to see `should_exit` and
    refresh its Date header, and each wake-up of an idle thread cost about 0.13 ms of CPU on a 2-core VM (0.33 ms
    per 0.25 s scrape interval, a fifth of the RDMA collector's, bench/scrape.py). Here the default headers are set
    once (the Date header is each answer's own) and `exit()` wakes the loop."""

    _loop: asyncio.AbstractEventLoop | None = None
    _wake: asyncio.Event | None = None

    async def main_loop(self) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        if not await self.on_tick(0):  # the default headers; False unless exit() came first
            await self._wake.wait()

    def exit(self) -> None:
        """Stop serving, from any thread."""
        self.should_exit = True
        if self._loop is not None and self._wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop has already ended
                self._loop.call_soon_threadsafe(self._wake.set)


async def _answer(send: Callable, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    headers = [*headers, (b"content-length", str(len(body)).encode()), (b"date", formatdate(usegmt=True).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
