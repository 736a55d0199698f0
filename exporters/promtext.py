"""Sources that serve Prometheus text over HTTP (vLLM, Mooncake): fetch with exporters/httpget.py (a connection kept
per target), parse with prometheus_client.

Subclasses only name their `source`; the parser's families give each sample its kind. `*_created` series
(client libraries' creation timestamps) are skipped: they are not measurements. Raw samples keep the names on
the wire: prometheus_client appends `_total` to the samples of a counter whose name lacks it (Mooncake's
`mem_cache_hit_nums_` would come back as `mem_cache_hit_nums__total`, a name Prometheus never stores), so those
samples get their wire name back and raw samples, mappings and an auditor's PromQL all use one name.
"""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families
from pydantic import AnyHttpUrl

from kvscope.exporters.base import CollectError, Collector, TargetConfig
from kvscope.exporters.httpget import GetError, get_for
from kvscope.samples import Kind, Labels, Sample, labels_of

_KINDS: dict[str, Kind] = {"counter": "counter", "gauge": "gauge", "histogram": "histogram", "summary": "summary"}


class HttpTargetConfig(TargetConfig):
    url: AnyHttpUrl


class PrometheusTextCollector(Collector):
    Config = HttpTargetConfig

    def __init__(self, config: HttpTargetConfig) -> None:
        super().__init__(config)
        self._url = str(config.url)
        self._get = get_for(config.url, config.timeout_s)
        self._parser = ExpositionParser(self.source, config.name)

    async def collect(self) -> list[Sample]:
        try:
            text = await self._get.text()
        except GetError as error:
            raise CollectError(f"{self.config.name}: GET {self._url} failed: {error}") from None
        return self._parser.parse(text)

    async def close(self) -> None:
        await self._get.close()


def parse_exposition(source: str, text: str, target: str) -> list[Sample]:
    """Raw samples of a Prometheus text exposition; garbage gets a CollectError naming the target."""
    return ExpositionParser(source, target).parse(text)


class ExpositionParser:
    """A target's expositions, parsed by prometheus_client; what it made of the last one is kept.

    A target serves the same series scrape after scrape, only their values change (prometheus_client's parser took
    17 ms of CPU for one scrape of a vLLM engine, bench/scrape.py). So an exposition whose skeleton (every line
    with its sample's value and timestamp cut off) is the last one's reuses the last parse's names, labels and
    kinds, line for line, and reads only the values. Any other exposition is parsed whole, and kept for the next
    scrape when its samples line up one to one with its sample lines.
    """

    def __init__(self, source: str, target: str) -> None:
        self.source, self.target = source, target
        self._skeleton: list[tuple[str, str, str]] | None = None
        self._series: list[tuple[str, Labels, Kind] | None] = []  # per sample line; None: not a measurement

    def parse(self, text: str) -> list[Sample]:
        skeleton, values = _skeleton(text)
        if skeleton != self._skeleton:
            return self._parse_whole(text, skeleton, len(values))
        try:
            numbers = list(map(float, values))
        except ValueError as error:
            raise CollectError(f"{self.target}: not a Prometheus text exposition: {error}") from None
        source = self.source
        return [
            Sample(source, series[0], series[1], number, series[2])
            for series, number in zip(self._series, numbers, strict=True)
            if series is not None
        ]

    def _parse_whole(self, text: str, skeleton: list[tuple[str, str, str]], sample_lines: int) -> list[Sample]:
        try:
            families = list(text_string_to_metric_families(text))
        except ValueError as error:
            raise CollectError(f"{self.target}: not a Prometheus text exposition: {error}") from None
        wire = [series.partition("{")[0] for _, series, _ in skeleton if series]
        on_the_wire = set(wire)
        parsed: list[tuple[str, Labels, Kind, float] | None] = []
        for family in families:
            kind = _KINDS.get(family.type, "unknown")
            for sample in family.samples:
                name = sample.name
                if kind == "counter" and name not in on_the_wire and name.removesuffix("_total") in on_the_wire:
                    name = name.removesuffix("_total")
                measured = not name.endswith("_created")
                parsed.append((name, labels_of(sample.labels), kind, float(sample.value)) if measured else None)
        names = [sample[0] if sample else None for sample in parsed]
        aligned = len(parsed) == sample_lines and all(n is None or n == w for n, w in zip(names, wire, strict=False))
        self._skeleton = skeleton if aligned else None
        self._series = [sample[:3] if sample else None for sample in parsed] if aligned else []
        return [Sample(self.source, name, labels, value, kind) for name, labels, kind, value in filter(None, parsed)]


# One line of an exposition: a comment; a sample (its series: the name and the label set up to the line's last
# brace, then its value, then what follows: a timestamp); or anything else, which no parse will match. Blank lines
# match nothing.
_LINE = re.compile(r"^[ \t]*(?:(#.*)|([^\s#{]+(?:\{.*\})?)[ \t]+(\S+).*|(\S.*))$", re.MULTILINE)


def _skeleton(text: str) -> tuple[list[tuple[str, str, str]], list[str]]:
    """Each line of an exposition without its sample's value and timestamp, and the values, in line order."""
    lines = _LINE.findall(text)
    return [(comment, series, other) for comment, series, _, other in lines], [v for _, s, v, _ in lines if s]
