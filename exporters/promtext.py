"""Sources that serve Prometheus text over HTTP (vLLM, Mooncake): fetch with httpx, parse with prometheus_client.

Subclasses only name their `source`; the parser's families give each sample its kind. `*_created` series
(client libraries' creation timestamps) are skipped: they are not measurements. Raw samples keep the names on
the wire: prometheus_client appends `_total` to the samples of a counter whose name lacks it (Mooncake's
`mem_cache_hit_nums_` would come back as `mem_cache_hit_nums__total`, a name Prometheus never stores), so those
samples get their wire name back and raw samples, mappings and an auditor's PromQL all use one name.
"""

from __future__ import annotations

import re

import httpx
from prometheus_client.parser import text_string_to_metric_families
from pydantic import AnyHttpUrl

from kvscope.exporters.base import CollectError, Collector, TargetConfig
from kvscope.samples import Kind, Sample, labels_of

_SAMPLE_NAME = re.compile(r"\s*([A-Za-z_:][A-Za-z0-9_:]*)")  # a sample line's name: before its labels or value
_KINDS: dict[str, Kind] = {"counter": "counter", "gauge": "gauge", "histogram": "histogram", "summary": "summary"}


class HttpTargetConfig(TargetConfig):
    url: AnyHttpUrl


class PrometheusTextCollector(Collector):
    Config = HttpTargetConfig

    def __init__(self, config: HttpTargetConfig) -> None:
        super().__init__(config)
        self._client = httpx.AsyncClient(timeout=config.timeout_s)

    async def collect(self) -> list[Sample]:
        url = str(self.config.url)  # type: ignore[attr-defined]
        try:
            response = await self._client.get(url)
            response.raise_for_status()
        except httpx.HTTPError as error:
            raise CollectError(f"{self.config.name}: GET {url} failed: {error!r}") from None
        return parse_exposition(self.source, response.text, self.config.name)

    async def close(self) -> None:
        await self._client.aclose()


def parse_exposition(source: str, text: str, target: str) -> list[Sample]:
    """Raw samples of a Prometheus text exposition; garbage gets a CollectError naming the target."""
    samples: list[Sample] = []
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as error:
        raise CollectError(f"{target}: not a Prometheus text exposition: {error}") from None
    wire = {
        match.group(1)
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
        for match in [_SAMPLE_NAME.match(line)]
        if match
    }
    for family in families:
        kind = _KINDS.get(family.type, "unknown")
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            name = sample.name
            if kind == "counter" and name not in wire and name.removesuffix("_total") in wire:
                name = name.removesuffix("_total")
            samples.append(Sample(source, name, labels_of(sample.labels), float(sample.value), kind))
    return samples
