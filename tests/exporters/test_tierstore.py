"""An A/B on the embedded store, scraped through the `tierstore` source: the exported model equals the run."""

from __future__ import annotations

import asyncio

from support.lifecycle import LIFECYCLE
from support.realservers import served_exposition

from kvscope.exporters.config import parse_config
from kvscope.exporters.scrape import Scraper
from kvscope.tierstore import lifecycle
from kvscope.tierstore.ab import run_ab
from kvscope.tierstore.lifecycle import BOUNDS
from kvscope.tierstore.live import ENGINES
from kvscope.tierstore.misses import CAUSES
from kvscope.tierstore.scenario import parse_scenario

SCENARIO = {
    "name": "exported",
    "workload": {"kind": "multi_round", "sessions": 5, "rounds": 6, "first_prompt_tokens": 700, "output_tokens": 300},
    "kv": {"block_tokens": 64, "bytes_per_token": 100},
    "arms": {
        "small": {"tiers": [{"name": "dram", "capacity": "200KB"}]},
        "tiered": {"tiers": [{"name": "dram", "capacity": "100KB"}, {"name": "nof", "capacity": "10MB"}]},
    },
}


def scrape(targets: list[dict]):
    scraper = Scraper(parse_config({"targets": targets}).targets)

    async def once():
        try:
            return await scraper.scrape_all()
        finally:
            await scraper.close()

    return asyncio.run(once())


def test_exported_model_equals_the_ab_totals(monkeypatch):
    monkeypatch.setattr(lifecycle, "SAMPLE_EVERY", 1)  # every block's lifecycle: this scenario's are few
    result = run_ab(parse_scenario(SCENARIO), publish=True)
    try:
        [state] = scrape([{"name": "embedded", "source": "tierstore", "stores": ["exported/small", "exported/tiered"]}])
    finally:
        for arm in SCENARIO["arms"]:
            ENGINES.withdraw(f"exported/{arm}")
    assert state.up
    model = {(s.name, s.labels): s.value for s in state.normalized}
    for arm, arm_result in result["arms"].items():
        store = f"exported/{arm}"
        totals = arm_result["totals"]
        engine = (("engine", store), ("layer", "external"))
        assert model[("kv.prefix.query.tokens", engine)] == totals["query_tokens"]
        assert model[("kv.prefix.hit.tokens", engine)] == totals["hit_tokens"]
        for tier, counters in totals["tiers"].items():
            labels = (("system", f"tierstore:{store}"), ("tier", tier))
            assert model[("kv.store.put.bytes", labels)] == counters["put_bytes"]
            assert model[("kv.tier.written.bytes", labels)] == counters["written_bytes"]
            assert model[("kv.tier.evictions", labels)] == counters["evictions"]
            assert model[("kv.tier.allocated.bytes", labels)] == counters["allocated_bytes"]
            assert model[("kv.tier.capacity.bytes", labels)] == counters["capacity_bytes"]
            quantities = totals["block_lifecycle"]["tiers"][tier]
            for quantity, (buckets, seconds) in LIFECYCLE.items():
                histogram = quantities[quantity]
                assert model[(seconds, labels)] == histogram["sum"]
                for bound, below in zip([*map(repr, BOUNDS), "+Inf"], [*histogram["buckets"], histogram["count"]],
                                        strict=True):  # fmt: skip
                    assert model[(buckets, (*labels, ("upper_bound", bound)))] == below
    assert result["arms"]["small"]["totals"]["evictions"]["dram"] > 0, "the small arm must evict to mean anything"
    lifecycles = {arm: arm_result["totals"]["block_lifecycle"]["tiers"] for arm, arm_result in result["arms"].items()}
    assert lifecycles["small"]["dram"]["lifetime"]["count"] > 0
    assert lifecycles["tiered"]["nof"]["reuse_gap"]["count"] > 0
    for arm, arm_result in result["arms"].items():
        engine_misses = {
            (dict(labels)["cause"], dict(labels).get("tier", "")): value
            for (name, labels), value in model.items()
            if name == "kv.miss.tokens" and ("engine", f"exported/{arm}") in labels
        }
        causes = arm_result["totals"]["miss_causes"]
        expected = {(cause, ""): causes[cause] for cause in CAUSES if cause != "evicted"}
        # a series for every tier from the first scrape, where the contract leaves out the tiers that evicted none
        evicted = causes["evicted_by_tier"]
        expected |= {("evicted", tier): evicted.get(tier, 0) for tier in arm_result["totals"]["tiers"]}
        assert engine_misses == expected
        assert sum(engine_misses.values()) == arm_result["totals"]["query_tokens"] - arm_result["totals"]["hit_tokens"]
    assert model[("kv.miss.tokens", (("cause", "evicted"), ("engine", "exported/small"), ("tier", "dram")))] > 0
    assert model[("kv.tier.evictions", (("system", "tierstore:exported/tiered"), ("tier", "nof")))] == 0


def test_an_unpublished_store_yields_nothing():
    [state] = scrape([{"name": "embedded", "source": "tierstore", "stores": ["nothing/here"]}])
    assert state.up and state.raw == [] and state.normalized == []


def test_promtool_accepts_the_miss_causes_as_served(check_metrics):
    run_ab(parse_scenario(SCENARIO), publish=True)
    try:
        target = {"name": "embedded", "source": "tierstore", "stores": ["exported/small"]}
        text = served_exposition(parse_config({"exporter": {"listen_port": 0}, "targets": [target]}))
    finally:
        for arm in SCENARIO["arms"]:
            ENGINES.withdraw(f"exported/{arm}")
    assert '\nkv_miss_tokens_total{cause="evicted",engine="exported/small",' in text
    assert '\nkv_miss_tokens_total{cause="chain_broken",engine="exported/small",' in text
    check_metrics(text)
