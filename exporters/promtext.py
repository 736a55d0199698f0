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
from itertools import compress
from operator import ne

from prometheus_client.parser import text_string_to_metric_families
from pydantic import AnyHttpUrl

from kvscope.exporters.base import CollectError, Collector, TargetConfig
from kvscope.exporters.httpget import GetError, get_for
from kvscope.samples import Kind, Sample, labels_of

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

    A target serves the same series scrape after scrape, and many of their values stay the same (prometheus_client's
    parser took 17 ms of CPU for one scrape of a vLLM engine, bench/scrape.py). So an exposition with the last one's
    number of lines is compared with it line by line: a line that did not change keeps its sample (the same object),
    and the sample lines that did are read again if their series (each line up to its value) are the same, which
    costs their values only (checked and converted a list at a time: a vLLM engine's 555 samples in 0.07 ms of CPU
    unchanged, 0.41 ms with every value changed, most of it making their samples). Any other change (a line added,
    a series or comment that differs) has the exposition parsed whole, and kept for the next scrape when its samples
    line up one to one with its sample lines.
    """

    def __init__(self, source: str, target: str) -> None:
        self.source, self.target = source, target
        self._lines: list[str] = []  # the kept exposition, line by line (empty: nothing kept)
        self._series: list[str | None] = []  # per line: a sample line's series text; None for any other line
        self._slots: list[int] = []  # per line: the index of its sample in _samples; -1 when not a measurement
        self._samples: list[Sample] = []

    def parse(self, text: str) -> list[Sample]:
        lines = text.split("\n")
        if len(lines) != len(self._lines):
            return self._parse_whole(text, lines)
        changed = list(compress(range(len(lines)), map(ne, lines, self._lines)))
        if changed:
            changed_lines = [lines[index] for index in changed]
            series = [self._series[index] for index in changed]
            if None in series or not all(map(str.startswith, changed_lines, series)):
                return self._parse_whole(text, lines)  # not a sample line of the same series
            rests = [line[len(line_series) :] for line, line_series in zip(changed_lines, series, strict=True)]
            if not all(map(_SEPARATOR, rests)):
                return self._parse_whole(text, lines)
            try:
                values = list(map(float, rests))  # float() takes the blank before the value
            except ValueError:  # a timestamp after it, or no number
                values = [self._value(rest) for rest in rests]
            samples, slots = self._samples.copy(), self._slots
            for index, value in zip(changed, values, strict=True):
                if (slot := slots[index]) >= 0:
                    kept = samples[slot]
                    samples[slot] = Sample(kept.source, kept.name, kept.labels, value, kept.kind)
            self._lines, self._samples = lines, samples
        return self._samples.copy()

    def _value(self, rest: str) -> float:
        """The value of a sample line's rest (what follows its series)."""
        try:
            return float(rest.split(None, 1)[0])
        except (ValueError, IndexError):
            raise CollectError(f"{self.target}: not a Prometheus text exposition: {rest.strip()!r}") from None

    def _parse_whole(self, text: str, lines: list[str]) -> list[Sample]:
        self._lines = []
        try:
            families = list(text_string_to_metric_families(text))
        except ValueError as error:
            raise CollectError(f"{self.target}: not a Prometheus text exposition: {error}") from None
        series = [match[1] if (match := _SAMPLE.fullmatch(line)) else None for line in lines]
        wire = [line_series.partition("{")[0].lstrip(" \t") for line_series in series if line_series is not None]
        on_the_wire = set(wire)
        parsed: list[Sample | None] = []
        for family in families:
            kind = _KINDS.get(family.type, "unknown")
            for sample in family.samples:
                name = sample.name
                if kind == "counter" and name not in on_the_wire and name.removesuffix("_total") in on_the_wire:
                    name = name.removesuffix("_total")
                measured = not name.endswith("_created")
                parsed.append(
                    Sample(self.source, name, labels_of(sample.labels), float(sample.value), kind) if measured else None
                )
        samples = [sample for sample in parsed if sample is not None]
        aligned = len(parsed) == len(wire) and all(
            sample is None or sample.name == name for sample, name in zip(parsed, wire, strict=True)
        )
        if aligned:
            self._slots, slot, entries = [], 0, iter(parsed)
            for line_series in series:
                if line_series is not None and next(entries) is not None:
                    self._slots.append(slot)
                    slot += 1
                else:
                    self._slots.append(-1)
            self._lines, self._series, self._samples = lines, series, samples
        return samples.copy()


# A sample line: its series (what indents it, the name and the label set up to the line's last brace), its value,
# then what follows (a timestamp). Comments, blank lines and anything else match nothing.
_SAMPLE = re.compile(r"([ \t]*[^\s#{]+(?:\{.*\})?)[ \t]+\S+.*")
_SEPARATOR = re.compile(r"[ \t]").match  # what separates a sample line's series from its value
