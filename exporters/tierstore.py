"""The embedded tiered store's own counters (engines published in kvscope.tierstore.live), so an A/B run on the
embedded store is scraped, mapped and exported exactly like a production cluster.

Raw names: `tierstore_engine_<counter>` (labels `store`) for the emulated engine and `tierstore_tier_<counter>`
(labels `store`, `tier`) for each tier, with the counters of kvscope.tierstore.tier.TierCounters; the engine's missed
prompt tokens by cause (kvscope.tierstore.misses) as `tierstore_engine_miss_tokens_total` (labels `store`, `cause`,
and `tier` for `evicted`: the tier that evicted the block last); each tier's block lifecycle
(kvscope.tierstore.lifecycle) as vLLM's `--kv-cache-metrics` histograms, `tierstore_tier_block_lifetime_seconds`,
`_idle_before_evict_seconds` and `_reuse_gap_seconds` (`_bucket` by `le` as vLLM writes its bounds, `_sum`, `_count`).
"""

from __future__ import annotations

from dataclasses import asdict

from pydantic import Field

from kvscope.exporters.base import Collector, TargetConfig
from kvscope.samples import Labels, Sample, labels_of
from kvscope.tierstore.lifecycle import BOUNDS, Histogram
from kvscope.tierstore.live import ENGINES
from kvscope.tierstore.misses import CAUSES

_GAUGES = {"allocated_bytes", "capacity_bytes"}
_LE = [*map(repr, BOUNDS), "+Inf"]  # as prometheus_client writes vLLM's bounds: 0.001, ..., 1.0, ..., 1800.0


class TierstoreTargetConfig(TargetConfig):
    stores: list[str] | None = Field(None, description="published names to read; all when omitted")


class TierstoreCollector(Collector):
    source = "tierstore"
    Config = TierstoreTargetConfig

    async def collect(self) -> list[Sample]:
        wanted = self.config.stores  # type: ignore[attr-defined]
        samples: list[Sample] = []
        for store, engine in ENGINES.snapshot().items():
            if wanted is not None and store not in wanted:
                continue
            engine_labels = labels_of({"store": store})
            for counter, value in asdict(engine.counters).items():
                name = f"tierstore_engine_{counter}_total"
                samples.append(Sample(self.source, name, engine_labels, value, "counter"))
            if engine.misses is not None:
                samples += self._miss_samples(store, engine.misses.snapshot())
            tiers = ([engine.gpu_cache] if engine.gpu_cache else []) + engine.store.tiers + engine.store.attached
            for tier in tiers:
                labels = labels_of({"store": store, "tier": tier.name})
                for counter, value in tier.counters.as_dict().items():
                    kind = "gauge" if counter in _GAUGES else "counter"
                    name = f"tierstore_tier_{counter}" if kind == "gauge" else f"tierstore_tier_{counter}_total"
                    samples.append(Sample(self.source, name, labels, value, kind))
                for quantity, histogram in tier.lifecycle.histograms.items():
                    samples += self._histogram_samples(f"tierstore_tier_block_{quantity}_seconds", labels, histogram)
        return samples

    def _histogram_samples(self, name: str, labels: Labels, histogram: Histogram) -> list[Sample]:
        """A histogram's series as Prometheus writes them: cumulative buckets by `le`, the sum and the count."""
        buckets, by_bound = [*histogram.cumulative(), histogram.count], dict(labels)
        return [
            *(Sample(self.source, f"{name}_bucket", labels_of({**by_bound, "le": le}), value, "histogram")
              for le, value in zip(_LE, buckets, strict=True)),
            Sample(self.source, f"{name}_sum", labels, histogram.sum, "histogram"),
            Sample(self.source, f"{name}_count", labels, histogram.count, "histogram"),
        ]  # fmt: skip

    def _miss_samples(self, store: str, causes: dict) -> list[Sample]:
        """Missed tokens by cause, `evicted` one series per tier (every cause present, 0 included, so a rate of
        each exists from the first scrape)."""
        name = "tierstore_engine_miss_tokens_total"
        by_cause = [({"store": store, "cause": cause}, causes[cause]) for cause in CAUSES if cause != "evicted"]
        by_tier = [({"store": store, "cause": "evicted", "tier": tier}, tokens)
                   for tier, tokens in causes["evicted_by_tier"].items()]  # fmt: skip
        return [Sample(self.source, name, labels_of(labels), value, "counter") for labels, value in by_cause + by_tier]
