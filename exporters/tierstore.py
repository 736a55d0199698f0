"""The embedded tiered store's own counters (engines published in kvscope.tierstore.live), so an A/B run on the
embedded store is scraped, mapped and exported exactly like a production cluster.

Raw names: `tierstore_engine_<counter>` (labels `store`) for the emulated engine and `tierstore_tier_<counter>`
(labels `store`, `tier`) for each tier, with the counters of kvscope.tierstore.tier.TierCounters.
"""

from __future__ import annotations

from dataclasses import asdict

from pydantic import Field

from kvscope.exporters.base import Collector, TargetConfig
from kvscope.samples import Sample, labels_of
from kvscope.tierstore.live import ENGINES

_GAUGES = {"allocated_bytes", "capacity_bytes"}


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
            tiers = ([engine.gpu_cache] if engine.gpu_cache else []) + engine.store.tiers + engine.store.attached
            for tier in tiers:
                labels = labels_of({"store": store, "tier": tier.name})
                for counter, value in tier.counters.as_dict().items():
                    kind = "gauge" if counter in _GAUGES else "counter"
                    name = f"tierstore_tier_{counter}" if kind == "gauge" else f"tierstore_tier_{counter}_total"
                    samples.append(Sample(self.source, name, labels, value, kind))
        return samples
