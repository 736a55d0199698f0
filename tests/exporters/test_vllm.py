"""vLLM's /metrics through the collector and its mapping, over a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support.lifecycle import mapped_histogram
from support.scrape import collect_once, raw_value

from kvscope.exporters.base import CollectError
from kvscope.exporters.config import parse_config
from kvscope.exporters.normalizer import mapping_for
from kvscope.exporters.vllm import VllmCollector
from kvscope.tierstore.lifecycle import BOUNDS

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm"
DEFAULT = FIXTURES / "metrics_rendered_v0.33.0_default_SYNTHETIC.txt"
OFFLOADING = FIXTURES / "metrics_rendered_v0.33.0_offloading_kvcachemetrics_SYNTHETIC.txt"

# vLLM 0.8.5 (V1): only the gpu_ names existed.
OLD_NAMES = """\
# TYPE vllm:gpu_prefix_cache_queries_total counter
vllm:gpu_prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
# TYPE vllm:gpu_prefix_cache_hits_total counter
vllm:gpu_prefix_cache_hits_total{engine="0",model_name="m"} 250.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.5
"""
# vLLM 0.10: both names, deprecated and current, for the same counter; and two engines in one scrape.
BOTH_NAMES_TWO_ENGINES = """\
# TYPE vllm:gpu_prefix_cache_queries_total counter
vllm:gpu_prefix_cache_queries_total{engine="0",model_name="m"} 700.0
vllm:gpu_prefix_cache_queries_total{engine="1",model_name="m"} 300.0
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 700.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 300.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9
"""


def scrape(url: str, **extra) -> tuple[list, list]:
    config = parse_config({"targets": [{"name": "vllm-a", "source": "vllm", "url": url, **extra}]}).targets[0]
    raw = collect_once(VllmCollector(config))
    return raw, mapping_for("vllm").apply(raw, config.labels)


def values(normalized) -> dict[tuple[str, tuple], float]:
    return {(s.name, s.labels): s.value for s in normalized}


def test_v0_33_offloading_connector_maps_onto_the_model(metrics_server):
    raw, normalized = scrape(metrics_server.serve("/metrics", OFFLOADING.read_bytes()))
    assert not any(s.name.endswith("_created") for s in raw)
    assert all(not s.normalized for s in raw) and all(s.normalized for s in normalized)
    gpu, external = (("engine", "0"), ("layer", "gpu")), (("engine", "0"), ("layer", "external"))
    offload = (("system", "vllm_offload:0"), ("tier", "dram"))
    prefix_and_store = {k: v for k, v in values(normalized).items() if k[0].startswith(("kv.prefix.", "kv.store."))}
    assert prefix_and_store == {
        ("kv.prefix.query.tokens", gpu): 18432.0,
        ("kv.prefix.hit.tokens", gpu): 9216.0,
        ("kv.prefix.query.tokens", external): 9216.0,
        ("kv.prefix.hit.tokens", external): 4608.0,
        ("kv.store.put.bytes", offload): 75497472.0,
        ("kv.store.put.ops", offload): 3.0,
        ("kv.store.get.bytes", offload): 37748736.0,
        ("kv.store.get.ops", offload): 3.0,
    }


def test_v0_33_kv_cache_metrics_map_onto_the_block_lifecycle_of_the_gpu_cache(metrics_server):
    """--kv-cache-metrics' histograms, bucket by bucket (the bounds the embedded store counts in too), each sum its
    own series; the GPU prefix cache is the store `vllm:<engine>`, tier gpu. The fixture's three evicted blocks lived
    35 s on average, idle 12 s; six reuse gaps."""
    raw, normalized = scrape(metrics_server.serve("/metrics", OFFLOADING.read_bytes()))
    got, gpu = values(normalized), {"system": "vllm:0", "tier": "gpu"}
    bounds = {s.label_map["le"] for s in raw if s.name == "vllm:kv_block_lifetime_seconds_bucket"}
    assert bounds == {*map(repr, BOUNDS), "+Inf"}
    counts = {quantity: mapped_histogram(raw, got, f"vllm:kv_block_{quantity}_seconds", quantity, gpu)
              for quantity in ("lifetime", "idle_before_evict", "reuse_gap")}  # fmt: skip
    assert counts == {"lifetime": 3, "idle_before_evict": 3, "reuse_gap": 6}
    gpu_series = (("system", "vllm:0"), ("tier", "gpu"))
    assert (got[("kv.block.lifetime", gpu_series)], got[("kv.block.idle", gpu_series)]) == (3 * 35.0, 3 * 12.0)


def test_v0_33_default_has_no_offload_series(metrics_server):
    _, normalized = scrape(metrics_server.serve("/metrics", DEFAULT.read_bytes()))
    assert {s.name for s in normalized} == {
        "kv.prefix.query.tokens", "kv.prefix.hit.tokens", "kv.prompt.tokens", "kv.prompt.cached.tokens",
        "kv.engine.prompt.tokens", "kv.engine.preemptions", "kv.engine.ttft.requests", "kv.engine.prompt.requests",
    }  # fmt: skip


# Two models served by one engine: their buckets add up per bound, and the bounds stay as vLLM writes them.
TWO_MODELS_HISTOGRAMS = """\
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="a"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="a"} 5.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="a"} 5.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="a"} 1.5
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="b"} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="b"} 1.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="b"} 1.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="b"} 0.05
# TYPE vllm:request_prompt_tokens histogram
vllm:request_prompt_tokens_bucket{engine="0",le="1000.0",model_name="a"} 4.0
vllm:request_prompt_tokens_bucket{engine="0",le="+Inf",model_name="a"} 5.0
vllm:request_prompt_tokens_count{engine="0",model_name="a"} 5.0
vllm:request_prompt_tokens_sum{engine="0",model_name="a"} 4200.0
"""


def test_ttft_and_prompt_length_buckets_keep_their_bound_and_take_the_target_s_role(metrics_server):
    """The histograms' buckets (not their _count or _sum) map bound by bound (`le` as `upper_bound`), summed over
    model_name; `role` is the target's label, which joins the engine's TTFT to the NICs of that role in the
    recording rules."""
    _, normalized = scrape(metrics_server.serve("/metrics", TWO_MODELS_HISTOGRAMS), labels={"role": "nof"})

    def bucket(le: str) -> tuple:
        return (("engine", "0"), ("role", "nof"), ("upper_bound", le))

    assert values(normalized) == {
        ("kv.engine.ttft.requests", bucket("0.1")): 3.0,
        ("kv.engine.ttft.requests", bucket("+Inf")): 6.0,
        ("kv.engine.prompt.requests", bucket("1000.0")): 4.0,
        ("kv.engine.prompt.requests", bucket("+Inf")): 5.0,
    }


def test_old_gpu_prefix_names_are_read(metrics_server):
    _, normalized = scrape(metrics_server.serve("/metrics", OLD_NAMES))
    gpu = (("engine", "0"), ("layer", "gpu"))
    assert values(normalized) == {("kv.prefix.query.tokens", gpu): 1000.0, ("kv.prefix.hit.tokens", gpu): 250.0}


def test_deprecated_and_current_name_together_are_not_counted_twice(metrics_server):
    raw, normalized = scrape(metrics_server.serve("/metrics", BOTH_NAMES_TWO_ENGINES))
    assert values(normalized) == {
        ("kv.prefix.query.tokens", (("engine", "0"), ("layer", "gpu"))): 700.0,
        ("kv.prefix.query.tokens", (("engine", "1"), ("layer", "gpu"))): 300.0,
    }
    assert {s.name for s in raw} == {"vllm:gpu_prefix_cache_queries_total", "vllm:prefix_cache_queries_total"}


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ("this is { not metrics", 200, "vllm-a: not a Prometheus text exposition"),
        ("oops", 500, "vllm-a: GET http://127.0.0.1"),
    ],
)
def test_bad_answers_raise_collect_error_naming_the_target(metrics_server, body, status, message):
    with pytest.raises(CollectError, match=message):
        scrape(metrics_server.serve("/metrics", body, status))


def test_unreachable_target_names_itself():
    with pytest.raises(CollectError, match=re.escape("vllm-a: GET http://127.0.0.1:9/metrics failed")):
        scrape("http://127.0.0.1:9/metrics")


REAL = FIXTURES / "real-cpu-0.32"
GOLDEN = REAL / "normalized.golden.json"


def _golden_form(normalized) -> list[dict]:
    return sorted(({"name": s.name, "labels": s.label_map, "value": s.value} for s in normalized), key=json.dumps)


@pytest.mark.parametrize("capture", sorted(p.name for p in REAL.glob("vllm_*.prom")))
def test_real_vllm_0_32_captures_map_every_kv_family(metrics_server, capture):
    """Whole /metrics of a real vLLM 0.32 (CPU): every KV family the model knows is mapped, each value is the raw
    one it comes from, the prompt-token sources add up to the prompt tokens, and the output equals the golden file."""
    raw, normalized = scrape(metrics_server.serve("/metrics", (REAL / capture).read_bytes()))
    got = values(normalized)
    engine = (("engine", "0"),)

    def model(name: str, **labels: str) -> float:
        return got[(name, tuple(sorted({"engine": "0", **labels}.items())))]

    for vllm_source, source in (("local_compute", "computed"), ("local_cache_hit", "gpu"),
                                ("external_kv_transfer", "external")):  # fmt: skip
        assert model("kv.prompt.tokens", source=source) == raw_value(
            raw, "vllm:prompt_tokens_by_source_total", source=vllm_source
        )
    prompt = raw_value(raw, "vllm:prompt_tokens_total")
    assert sum(v for (name, _), v in got.items() if name == "kv.prompt.tokens") == prompt > 0
    assert got[("kv.engine.prompt.tokens", engine)] == prompt
    assert model("kv.prefix.query.tokens", layer="gpu") == prompt
    assert model("kv.prompt.tokens", source="gpu") == model("kv.prefix.hit.tokens", layer="gpu")
    assert model("kv.prompt.cached.tokens", medium="gpu") == raw_value(
        raw, "vllm:prompt_tokens_cached_by_source_total", source="device"
    )
    assert got[("kv.engine.preemptions", engine)] == raw_value(raw, "vllm:num_preemptions_total")
    assert model("kv.prefix.capacity.tokens", layer="gpu") == 40 * 32  # --num-gpu-blocks-override 40, blocks of 32
    # Every TTFT and prompt-length bucket, as the engine counted it; a target that names no role gets role "".
    for histogram, instrument in (("vllm:time_to_first_token_seconds", "kv.engine.ttft.requests"),
                                  ("vllm:request_prompt_tokens", "kv.engine.prompt.requests")):  # fmt: skip
        bounds = {s.label_map["le"] for s in raw if s.name == f"{histogram}_bucket"}
        assert "+Inf" in bounds and len(bounds) > 5
        for le in bounds:
            assert model(instrument, role="", upper_bound=le) == raw_value(raw, f"{histogram}_bucket", le=le)
        assert model(instrument, role="", upper_bound="+Inf") == raw_value(raw, f"{histogram}_count") > 0
    if "mooncake" in capture:  # the connector's saves and loads, counted by the engine's own Mooncake client
        store = (("system", "mooncake"), ("tier", "dram"))
        assert (
            got[("kv.store.put.bytes", store)]
            == 3_473_408
            == raw_value(raw, "vllm:mooncake_store_operation_bytes_total", operation="save_put")
        )
        assert got[("kv.store.put.ops", store)] == 48 and got[("kv.store.get.ops", store)] == 33
        assert got[("kv.store.get.bytes", store)] == 8_421_376
        assert got[("kv.tier.written.bytes", store)] == got[("kv.store.put.bytes", store)]  # one memory replica
        assert model("kv.prompt.tokens", source="external") == model("kv.prefix.hit.tokens", layer="external") > 0
    else:
        assert got[("kv.engine.preemptions", engine)] == 22
    golden = json.loads(GOLDEN.read_text())
    assert _golden_form(normalized) == golden[capture]
