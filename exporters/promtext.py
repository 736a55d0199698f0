"""Sources that serve Prometheus text over HTTP (vLLM, Mooncake): fetch with httpx, parse with prometheus_client.

Subclasses only name their `source`; the parser's families give each sample its kind. `*_created` series
(client libraries' creation timestamps) are skipped: they are not measurements.
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families
from pydantic import AnyHttpUrl

from kvscope.exporters.base import CollectError, Collector, TargetConfig
from kvscope.samples import Kind, Sample, labels_of

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
        for family in text_string_to_metric_families(text):
            kind = _KINDS.get(family.type, "unknown")
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                samples.append(Sample(source, sample.name, labels_of(sample.labels), float(sample.value), kind))
    except ValueError as error:
        raise CollectError(f"{target}: not a Prometheus text exposition: {error}") from None
    return samples
