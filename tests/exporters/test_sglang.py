"""SGLang's /metrics through the collector and its mapping, over a real HTTP server on 127.0.0.1: the fixture
rendered from SGLang 0.5.23's metric definitions (tests/fixtures/sglang/PROVENANCE.md)."""

from __future__ import annotations

from pathlib import Path

from support.realservers import served_exposition
from support.scrape import collect_once, raw_value

from kvscope.exporters.config import parse_config
from kvscope.exporters.normalizer import mapping_for
from kvscope.exporters.sglang import SglangCollector

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "sglang"
HICACHE = FIXTURES / "metrics_rendered_v0.5.23_hicache_SYNTHETIC.txt"
# Every raw family of the fixture that the mapping leaves out, and why (mappings/sglang.yaml says the same).
NOT_MAPPED = {
    "sglang:num_requests_total": "a request count",
    "sglang:cache_hit_rate": "a ratio kv.prompt.tokens gives over any window",
    "sglang:hicache_host_used_tokens": "host occupancy in tokens; the model has it in bytes",
    "sglang:evicted_tokens_total": "device token slots freed; evictions are blocks of a named store",
    "sglang:load_back_tokens_total": "the tokens of kv.prompt.tokens{source=host}",
    "sglang:prefetched_tokens_total": "L3 -> host tokens; stores count bytes and operations",
    "sglang:backuped_tokens_total": "host -> L3 tokens; stores count bytes and operations",
    "sglang:storage_prefetch_hit_tokens_total": "L3 query hits before transfer",
}


def scrape(url: str, **extra):
    config = parse_config({"targets": [{"name": "sglang-a", "source": "sglang", "url": url, **extra}]}).targets[0]
    raw = collect_once(SglangCollector(config))
    return raw, mapping_for("sglang").apply(raw, config.labels)


def test_every_family_is_mapped_or_left_out_with_a_reason(metrics_server):
    raw, _ = scrape(metrics_server.serve("/metrics", HICACHE.read_bytes()))
    read = {name for rule in mapping_for("sglang").rules for name in rule.match}
    assert {s.name for s in raw} == read | set(NOT_MAPPED)
    assert not read & set(NOT_MAPPED)


def test_prompt_tokens_by_source_are_the_scheduler_s_split_and_add_up_to_the_tokenizer_s_count(metrics_server):
    raw, normalized = scrape(metrics_server.serve("/metrics", HICACHE.read_bytes()))
    got = {(s.name, s.labels): s.value for s in normalized}

    def model(name: str, **labels: str) -> float:
        return got[(name, tuple(sorted({"engine": "0", **labels}.items())))]

    split = "sglang:prefill_effective_tokens_total"
    for mode, source in (
        ("input", "computed"),
        ("device_hit", "gpu"),
        ("host_hit", "host"),
        ("storage_hit", "storage"),
    ):
        assert model("kv.prompt.tokens", source=source) == raw_value(raw, split, mode=mode) > 0
    prompt = raw_value(raw, "sglang:prompt_tokens_total")  # streaming and not, summed
    assert model("kv.engine.prompt.tokens") == prompt == 12_288
    assert sum(v for (name, _), v in got.items() if name == "kv.prompt.tokens") == prompt
    for cache_source, medium in (("device", "gpu"), ("host", "host"), ("storage", "external")):
        assert model("kv.prompt.cached.tokens", medium=medium) == raw_value(
            raw, "sglang:cached_tokens_total", cache_source=cache_source
        )
    assert model("kv.prefix.capacity.tokens", layer="host") == raw_value(raw, "sglang:hicache_host_total_tokens")
    assert len(got) == 9


def test_the_target_s_engine_label_names_the_server(metrics_server):
    _, normalized = scrape(metrics_server.serve("/metrics", HICACHE.read_bytes()), labels={"engine": "sglang-a"})
    assert {s.label_map["engine"] for s in normalized} == {"sglang-a"}


def test_promtool_accepts_the_served_exposition(metrics_server, check_metrics):
    target = {"name": "sglang-a", "source": "sglang", "url": metrics_server.serve("/metrics", HICACHE.read_bytes())}
    text = served_exposition(parse_config({"exporter": {"listen_port": 0}, "targets": [target]}))
    for name in ('kv_engine_prompt_tokens_total{engine="0"', 'kv_prompt_tokens_total{engine="0",source="storage",',
                 'kv_prefix_capacity_tokens{engine="0",layer="host",'):  # fmt: skip
        assert f"\n{name}" in text, name
    check_metrics(text)
