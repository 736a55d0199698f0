"""Mooncake store /metrics (tested against 0.3.13.post1): the master's (`mooncake_master -metrics_port`) and an
embedded store client's (`enable_client_http_server`, `/metrics` on `client_http_port`).

One source for both roles: the master's and the client's series have disjoint names, so `mappings/mooncake.yaml`
applies to either and each target says only its URL and `labels: {system: ...}` (default `mooncake`).

Quirks of Mooncake's exposition (ylt metrics) and how they are handled here:

- **Counters without `_total`** (`mem_cache_hit_nums_`, `master_evicted_key_count`, `mooncake_transfer_read_bytes`,
  ...): prometheus_client's parser would report them as `<name>_total`; the shared parser in promtext.py gives
  them back the name on the wire.
- **Unlabelled histogram sums**: a client histogram's `_bucket` series carry `client_mode="real"` but its `_sum`
  and `_count` carry no label at all. prometheus_client accepts it; the samples are kept as they are (nothing is
  mapped from them).
- **`le="4096.000000"`**: bucket bounds are printed with six decimals. Accepted and kept verbatim in the raw
  samples (Prometheus 3 would store them normalized, `le="4096"`); nothing is mapped from histogram buckets.
- **Series that appear only after first use** (`segment_*`, `master_value_size_bytes`, `master_*_mem` evictions,
  the client's `mooncake_ssd_*`, batch latencies, per-`op_name` series): an absent series means "not used yet",
  not an error; the mapping prefers series that exist from the first scrape (see `mappings/mooncake.yaml`).
- **`/metrics/summary`** (both roles) is a one-line or multi-line human summary, not an exposition: a target
  pointed at it fails with a CollectError naming the target (the parser rejects it).
"""

from __future__ import annotations

from pydantic import Field, field_validator

from kvscope.exporters.promtext import HttpTargetConfig, PrometheusTextCollector, parse_exposition
from kvscope.samples import Sample


class MooncakeTargetConfig(HttpTargetConfig):
    labels: dict[str, str] = Field(
        default_factory=lambda: {"system": "mooncake"},
        description="labels for the mapping; `system` names the store in the KV-tier model (default mooncake)",
    )

    @field_validator("labels")
    @classmethod
    def _default_system(cls, labels: dict[str, str]) -> dict[str, str]:
        return {"system": "mooncake", **labels}


class MooncakeCollector(PrometheusTextCollector):
    source = "mooncake"
    Config = MooncakeTargetConfig


def parse_mooncake(text: str, target: str) -> list[Sample]:
    """Raw samples of a Mooncake master or client exposition, under the names Mooncake exposes."""
    return parse_exposition(MooncakeCollector.source, text, target)
