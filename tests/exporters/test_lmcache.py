"""LMCache's multiprocess server's /metrics through the collector and its mapping, over a real HTTP server on
127.0.0.1: the fixture rendered from LMCache 0.5.6's metric definitions through OpenTelemetry's Prometheus exporter
(tests/fixtures/lmcache/PROVENANCE.md)."""

from __future__ import annotations

from pathlib import Path

from support.lifecycle import mapped_histogram
from support.realservers import served_exposition
from support.scrape import collect_once, raw_value

from kvscope.exporters.config import parse_config
from kvscope.exporters.lmcache import LmcacheCollector
from kvscope.exporters.normalizer import mapping_for

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "lmcache"
MP_SERVER = FIXTURES / "metrics_rendered_v0.5.6_mp_SYNTHETIC.txt"
# Every raw family of the fixture that the mapping leaves out, and why (mappings/lmcache.yaml says the same).
NOT_MAPPED = {
    "target_info": "the OpenTelemetry resource",
    "lmcache_mp_lookups_requests_total": "a count of lookups; the model counts tokens",
    "lmcache_mp_lookup_early_exit_requests_total": "lookups that never probed the cache",
    "lmcache_mp_l1_read_chunks_total": "retrieves to the engine and reads for L2 stores together",
    "lmcache_mp_l1_write_chunks_total": "the engine's stores and loads from L2 together",
    "lmcache_mp_l2_store_submitted_requests_total": "submitted; the completed ones are mapped",
    "lmcache_mp_l2_store_submitted_objects_chunks_total": "submitted; the completed ones are mapped",
    "lmcache_mp_l2_prefetch_load_submitted_requests_total": "submitted; the completed ones are mapped",
    "lmcache_mp_l2_prefetch_load_submitted_objects_chunks_total": "submitted; the completed ones are mapped",
    "lmcache_mp_l2_prefetch_lookup_requests_total": "a prefetch's L2 lookups; its hits are the L2 hit keys",
    "lmcache_mp_l2_prefetch_lookup_objects_chunks_total": "a prefetch's L2 lookups; its hits are the L2 hit keys",
    **{f"lmcache_mp_{tier}_{quantity}_seconds_count": "the +Inf bucket"
       for tier in ("l1_chunk", "l0_block") for quantity in ("lifetime", "idle_before_evict", "reuse_gap")},
    **{f"lmcache_mp_l1_chunk_evict_reuse_gap_seconds{part}": "eviction to the next write: no stored chunk's lifecycle"
       for part in ("_bucket", "_sum", "_count")},
    **{f"lmcache_mp_real_reuse_gap_seconds{part}": "the store's reuse gap, L1 and L2 together: no one tier's"
       for part in ("_bucket", "_sum", "_count")},
    **{f"lmcache_mp_real_reuse_gap_objects{part}": "a reuse gap counted in the store's chunk accesses, not time"
       for part in ("_bucket", "_sum", "_count")},
    "lmcache_mp_l1_eviction_loop_ticks_total": "iterations of L1's eviction loop, not evictions",
    "lmcache_mp_l1_eviction_loop_triggered_total": "iterations of L1's eviction loop, not evictions",
    "lmcache_mp_l1_allocation_failure_chunks_total": "a failure: the model has no failure instrument",
    "lmcache_mp_l1_read_failure_chunks_total": "a failure: the model has no failure instrument",
    "lmcache_mp_l2_prefetch_failure_chunks_total": "a failure: the model has no failure instrument",
    "lmcache_mp_l1_usage_ratio": "a ratio of the allocated bytes (mapped) to a size LMCache does not export",
    "lmcache_mp_l1_staging_bytes": "part of L1's allocated bytes, not beside them",
    "lmcache_mp_timeouts_total": "the server's own health, no KV quantity",
    "lmcache_mp_event_bus_dropped_events_total": "the server's own health, no KV quantity",
    "lmcache_mp_event_bus_subscriber_exceptions_total": "the server's own health, no KV quantity",
    **{f"lmcache_mp_{transfer}_throughput_GB_per_second{part}": "rates of single transfers, not what moved"
       for transfer in ("l0_l1_store", "l0_l1_load", "l2_store", "l2_load", "transfer_staging")
       for part in ("_bucket", "_sum", "_count")},
    **{f"lmcache_mp_transfer_phase_{quantity}_total": "per executor phase, engine-side copies only: no tier's bytes"
       for quantity in ("bytes", "elapsed_seconds")},
    **{f"lmcache_mp_num_{state}_{transfer}_total": "per GPU stream and rank, moved or not: no store operations"
       for state in ("submitted", "finished") for transfer in ("stores", "retrieves")},
    **{f"lmcache_blend_{phase}_duration_milliseconds{part}": "CacheBlend's phase durations"
       for phase in ("lookup", "fingerprint_match", "prefix_lookup", "coordinator_match", "sparse_prefetch",
                     "retrieve", "scatter")
       for part in ("_bucket", "_sum", "_count")},
    **{f"lmcache_blend_{name}_total": "CacheBlend: its hits reuse non-prefix chunks, its fingerprint table no tier"
       for name in ("lookup_requests", "lookup_requested_tokens", "lookup_hit_tokens", "lookup_prefix_hit_tokens",
                    "lookup_non_prefix_hit_tokens", "lookup_segmented_prefix_hit_tokens", "lookup_fingerprint_hits",
                    "lookup_storage_hits", "lookup_stale_chunks", "lookup_no_gpu_context_errors", "retrieve_requests",
                    "retrieve_chunks", "retrieve_failures", "fingerprints_registered", "chunks_evicted",
                    "fingerprint_matches", "coordinator_matches", "coordinator_match_timeouts",
                    "sparse_prefetch_l2_keys", "sparse_prefetch_found_keys", "scatter_tokens",
                    "scatter_prefix_chunks", "scatter_shifted_chunks", "scatter_dropped_chunks", "retrieve_noops")},
}  # fmt: skip


def scrape(url: str, **extra):
    config = parse_config({"targets": [{"name": "lmcache-a", "source": "lmcache", "url": url, **extra}]}).targets[0]
    raw = collect_once(LmcacheCollector(config))
    return raw, mapping_for("lmcache").apply(raw, config.labels)


def test_every_family_is_mapped_or_left_out_with_a_reason(metrics_server):
    raw, _ = scrape(metrics_server.serve("/metrics", MP_SERVER.read_bytes()))
    read = {name for rule in mapping_for("lmcache").rules for name in rule.match}
    assert {s.name for s in raw} == read | set(NOT_MAPPED)
    assert not read & set(NOT_MAPPED)


def test_lookups_hits_evictions_and_moves_between_tiers_equal_the_raw_counters(metrics_server):
    raw, normalized = scrape(metrics_server.serve("/metrics", MP_SERVER.read_bytes()))
    got = {(s.name, s.labels): s.value for s in normalized}

    def model(name: str, **labels: str) -> float:
        return got[(name, tuple(sorted(labels.items())))]

    prefix = "lmcache_mp_"
    lookup = {"engine": "lmcache", "layer": "lmcache"}
    assert model("kv.prefix.query.tokens", **lookup) == raw_value(raw, prefix + "lookup_requested_tokens_total")
    hit = raw_value(raw, prefix + "lookup_hit_tokens_total")
    assert model("kv.prefix.hit.tokens", **lookup) == hit == 2_560
    l1_tokens = model("kv.prompt.cached.tokens", engine="lmcache", medium="host")
    l2_tokens = model("kv.prompt.cached.tokens", engine="lmcache", medium="external")
    assert l1_tokens == raw_value(raw, prefix + "lookup_hit_l1_tokens_total") == 1_536
    assert l2_tokens == raw_value(raw, prefix + "lookup_hit_l2_tokens_total") == 1_024
    assert l1_tokens + l2_tokens == hit  # LMCache's own invariant, per lookup
    store = {"system": "lmcache"}
    for tier in ("l1", "l2"):
        assert model("kv.tier.hits", **store, tier=tier) == raw_value(raw, f"{prefix}lookup_hit_{tier}_keys_total")
    assert model("kv.tier.evictions", **store, tier="l1") == raw_value(raw, prefix + "l1_evicted_chunks_total") == 12
    assert model("kv.tier.evictions", **store, tier="l2") == raw_value(raw, prefix + "l2_evicted_objects_chunks_total")
    moved = "kv.tier.transferred.blocks"
    assert model(moved, **store, from_tier="l1", to_tier="l2") == raw_value(
        raw, prefix + "l2_store_completed_objects_chunks_total"
    )
    assert model(moved, **store, from_tier="l2", to_tier="l1") == raw_value(
        raw, prefix + "l2_prefetch_load_completed_chunks_total"
    )
    assert model("kv.store.put.ops", **store, tier="l2") == raw_value(
        raw, prefix + "l2_store_completed_requests_total", l2_name="FSL2Adapter"
    )
    assert model("kv.store.get.ops", **store, tier="l2") == raw_value(raw, prefix + "l2_load_completed_requests_total")
    # The chunks the retrieves loaded into the GPU: L1's reads but those for the L2 stores (36 - 16).
    loaded = model(moved, **store, from_tier="l1", to_tier="l0")
    assert loaded == raw_value(raw, prefix + "num_chunks_loaded_total", worker_id="0") == 20
    assert loaded == raw_value(raw, prefix + "l1_read_chunks_total") - raw_value(
        raw, prefix + "l2_store_submitted_objects_chunks_total"
    )
    # What each tier holds, 16 MiB a chunk: the chunks written to it and not evicted (L1 36 of 48, L2 12 of 16).
    chunk = 16 * 2**20
    held = {tier: model("kv.tier.allocated.bytes", **store, tier=tier) for tier in ("l1", "l2")}
    l1_chunks = raw_value(raw, prefix + "l1_write_chunks_total") - raw_value(raw, prefix + "l1_evicted_chunks_total")
    l2_chunks = raw_value(raw, prefix + "l2_store_completed_objects_chunks_total") - raw_value(
        raw, prefix + "l2_evicted_objects_chunks_total"
    )
    assert held == {"l1": l1_chunks * chunk, "l2": l2_chunks * chunk} == {"l1": 36 * chunk, "l2": 12 * chunk}
    assert held["l1"] == raw_value(raw, prefix + "l1_memory_usage_bytes")
    assert held["l2"] == raw_value(raw, prefix + "l2_usage_bytes", l2_name="FSL2Adapter")
    assert len([series for series in got if not series[0].startswith("kv.block.")]) == 15


def test_l1_chunks_and_l0_blocks_map_onto_the_block_lifecycle(metrics_server):
    """The lifecycle histograms of L1's chunks (tier l1) and the engine's GPU blocks (tier l0), bucket by bucket in
    LMCache's bounds: the fixture's 12 evicted L1 chunks (as many as L1 evicted, every chunk followed) lived 62.5 s on
    average, 5 GPU blocks 21.2 s."""
    raw, normalized = scrape(metrics_server.serve("/metrics", MP_SERVER.read_bytes()))
    got = {(s.name, s.labels): s.value for s in normalized}
    counts = {(tier, quantity): mapped_histogram(raw, got, f"lmcache_mp_{histogram}_{quantity}_seconds", quantity,
                                                 {"system": "lmcache", "tier": tier})
              for tier, histogram in (("l1", "l1_chunk"), ("l0", "l0_block"))
              for quantity in ("lifetime", "idle_before_evict", "reuse_gap")}  # fmt: skip
    assert counts[("l1", "lifetime")] == raw_value(raw, "lmcache_mp_l1_evicted_chunks_total") == 12
    assert (counts[("l1", "reuse_gap")], counts[("l0", "lifetime")], counts[("l0", "reuse_gap")]) == (30, 5, 4)
    lifetime = {tier: got[("kv.block.lifetime", (("system", "lmcache"), ("tier", tier)))] for tier in ("l1", "l0")}
    assert lifetime == {"l1": 750.0, "l0": 106.0}  # 12 x 62.5 s, 5 x 21.2 s


def test_the_target_s_labels_name_the_engine_and_the_store(metrics_server):
    url = metrics_server.serve("/metrics", MP_SERVER.read_bytes())
    _, normalized = scrape(url, labels={"engine": "vllm-a", "system": "lmcache-node1"})
    assert {s.label_map.get("engine") for s in normalized if "engine" in s.label_map} == {"vllm-a"}
    assert {s.label_map.get("system") for s in normalized if "system" in s.label_map} == {"lmcache-node1"}
    _, only_engine = scrape(url, labels={"engine": "vllm-a"})  # the store keeps its default name
    assert {s.label_map["system"] for s in only_engine if "system" in s.label_map} == {"lmcache"}


def test_promtool_accepts_the_served_exposition(metrics_server, check_metrics):
    target = {"name": "lmcache-a", "source": "lmcache", "url": metrics_server.serve("/metrics", MP_SERVER.read_bytes())}
    text = served_exposition(parse_config({"exporter": {"listen_port": 0}, "targets": [target]}))
    for name in ('kv_prefix_hit_tokens_total{engine="lmcache",layer="lmcache",',
                 'kv_tier_transferred_blocks_total{from_tier="l1",system="lmcache",',
                 'kv_tier_evictions_total{system="lmcache",target="lmcache-a",tier="l2"}'):  # fmt: skip
        assert f"\n{name}" in text, name
    check_metrics(text)
