"""LMCache's multiprocess server's /metrics (rendered from 0.5.6's metric definitions): its lookups (tokens asked
for and found, split by L1 and L2), L1 and L2 evictions, and the chunks and requests it moved between L1 and L2.

An LMCache multiprocess server sits beside the engines that use it (`lmcache server`, its Prometheus pull port);
its counters are OpenTelemetry instruments exported by opentelemetry-exporter-prometheus, so each name carries its
unit (`_tokens`, `_chunks`, `_keys`, `_requests`) and every series the instrument scope (`otel_scope_*`). Its
lookups are per model, not per engine: the server is one engine of the KV-tier model, named by the target's
`engine` label (default "lmcache"), and its two cache tiers are `l1` and `l2` of the store named by the target's
`system` label (default "lmcache"). What is mapped and what is not is in `mappings/lmcache.yaml`.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from kvscope.exporters.promtext import HttpTargetConfig, PrometheusTextCollector

_DEFAULT_LABELS = {"engine": "lmcache", "system": "lmcache"}


class LmcacheTargetConfig(HttpTargetConfig):
    """An LMCache multiprocess server with metrics on: `http://host:prometheus_port/metrics` (default port 9090)."""

    labels: dict[str, str] = Field(
        default_factory=lambda: dict(_DEFAULT_LABELS),
        description="labels for the mapping; `engine` names its lookups and `system` its tiers (default lmcache)",
    )

    @field_validator("labels")
    @classmethod
    def _default_engine_and_system(cls, labels: dict[str, str]) -> dict[str, str]:
        return {**_DEFAULT_LABELS, **labels}


class LmcacheCollector(PrometheusTextCollector):
    source = "lmcache"
    Config = LmcacheTargetConfig
