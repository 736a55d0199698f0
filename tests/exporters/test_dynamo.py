"""NVIDIA Dynamo's /metrics through the collector and its mapping, over a real HTTP server on 127.0.0.1: the
frontend's and both workers' expositions captured from a real Dynamo 1.6.1 stack (tests/fixtures/dynamo,
PROVENANCE.md; mocker workers imitating vLLM, and in the `sglang` run SGLang), held against the raw values they come
from, the responses' usage of the same run and a golden normalized output (regenerate with KVSCOPE_UPDATE_GOLDEN=1
after a deliberate mapping change, and review the diff)."""

from __future__ import annotations

import importlib.util
import json
import os
from collections import Counter
from pathlib import Path

import pytest
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support.realservers import scrape_once, served_exposition
from support.scrape import collect_once, raw_value

from kvscope.exporters.config import parse_config
from kvscope.exporters.dynamo import INSTANCE_LABEL, DynamoCollector, instance_id_samples
from kvscope.exporters.normalizer import mapping_for
from kvscope.exporters.otel import TelemetryBridge
from kvscope.exporters.scrape import Scraper
from kvscope.samples import Sample

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "dynamo"
GOLDEN = FIXTURES / "normalized.golden.json"
CAPTURES = sorted(path.name for path in FIXTURES.glob("*.prom"))
RUNS = ("routed", "small_blocks")  # mockers imitating vLLM (vllm:* series)
SGLANG = "sglang"  # the routed run's settings, the mockers imitating SGLang (--engine-type sglang: sglang:* series)
VLLM_WORKERS = [c for c in CAPTURES if "worker" in c and not c.startswith(f"{SGLANG}_")]
SGLANG_WORKERS = [c for c in CAPTURES if c.startswith(f"{SGLANG}_worker")]


def scrape(url: str, name: str = "dynamo-a", **extra) -> tuple[list[Sample], list[Sample], DynamoCollector]:
    config = parse_config({"targets": [{"name": name, "source": "dynamo", "url": url, **extra}]}).targets[0]
    collector = DynamoCollector(config)
    raw = collect_once(collector)
    return raw, mapping_for("dynamo").apply(raw, config.labels), collector


def served(metrics_server, capture: str) -> tuple[list[Sample], list[Sample]]:
    raw, normalized, collector = scrape(metrics_server.serve(f"/{capture}", (FIXTURES / capture).read_bytes()))
    assert collector.take_read_errors() == []
    return raw, normalized


def model(normalized: list[Sample], name: str, **labels: str) -> float:
    matching = [s.value for s in normalized if s.name == name and s.label_map == labels]
    assert len(matching) == 1, (name, labels, [s.label_map for s in normalized if s.name == name])
    return matching[0]


def usage(run: str) -> dict:
    return json.loads((FIXTURES / f"{run}_usage.json").read_text())


def golden_form(normalized: list[Sample]) -> list[dict]:
    return sorted(({"name": s.name, "labels": s.label_map, "value": s.value} for s in normalized), key=json.dumps)


def test_the_captures_are_the_three_runs_with_frontend_and_both_workers():
    for run in (*RUNS, SGLANG):
        assert {f"{run}_frontend.prom", f"{run}_worker0.prom", f"{run}_worker1.prom"} <= set(CAPTURES)
    assert {"small_blocks_midload_frontend.prom", "small_blocks_midload_worker0.prom"} <= set(CAPTURES)


@pytest.mark.parametrize("capture", [c for c in CAPTURES if "frontend" in c])
def test_a_frontend_s_and_its_router_s_series_map_as_dynamo_wrote_them(metrics_server, capture):
    """Per model: prompt and cached tokens (the histograms' sums), KV blocks and block size; per router: prompt
    tokens routed, cached prefix chosen and best eligible, KV events applied by event and status; per worker: the
    router's count of its active blocks. Every mapped value is the raw one; the router is named by its own id, on
    the events too (Dynamo labels them with the frontend's instance id, in hex: the collector's decimal)."""
    raw, normalized = served(metrics_server, capture)
    router = {s.label_map["router_id"] for s in raw if "router_id" in s.label_map}
    assert len(router) == 1
    (router_id,) = router
    assert {s.label_map[INSTANCE_LABEL] for s in raw} == {router_id}  # the frontend's instance id is the router's
    assert model(normalized, "kv.frontend.prompt.tokens", model="tiny") == raw_value(
        raw, "dynamo_frontend_input_sequence_tokens_sum", model="tiny"
    )
    assert model(normalized, "kv.frontend.cached.tokens", model="tiny") == raw_value(
        raw, "dynamo_frontend_cached_tokens_sum", model="tiny"
    )
    assert model(normalized, "kv.model.blocks", model="tiny") == raw_value(raw, "dynamo_frontend_model_total_kv_blocks")
    assert model(normalized, "kv.model.block.tokens", model="tiny") == 16
    per_router = {"router": router_id, "model": "tiny", "phase": "aggregated"}
    assert model(normalized, "kv.router.prompt.tokens", **per_router) == raw_value(
        raw, "dynamo_component_router_input_sequence_tokens_sum"
    )
    counters = {"selected": "dynamo_component_router_kv_selected_cached_prefix_tokens_total",
                "best_eligible": "dynamo_component_router_kv_best_eligible_cached_prefix_tokens_total"}  # fmt: skip
    for choice, name in counters.items():
        assert model(normalized, "kv.router.prefix.tokens", **per_router, choice=choice) == raw_value(raw, name) > 0
    events = [s for s in raw if s.name == "dynamo_component_kv_cache_events_applied"]
    assert len(events) == 27  # stored, removed, cleared x ok and 8 rejection statuses
    for sample in events:
        labels = sample.label_map
        assert model(normalized, "kv.router.events", router=router_id, event=labels["event_type"],
                     status=labels["status"]) == sample.value  # fmt: skip
    workers = {s.label_map["worker_id"] for s in raw if s.name == "dynamo_frontend_worker_active_decode_blocks"}
    assert len(workers) == 2
    for worker in workers:
        assert model(normalized, "kv.engine.active.blocks", engine="0", worker_id=worker) == raw_value(
            raw, "dynamo_frontend_worker_active_decode_blocks", worker_id=worker
        )
    # the router's counters are per router: no mapped router series names a worker
    assert not any("worker_id" in s.label_map for s in normalized if s.name.startswith("kv.router."))


@pytest.mark.parametrize("capture", VLLM_WORKERS)
def test_a_worker_s_engine_series_carry_its_id_as_the_frontend_writes_it(metrics_server, capture):
    """KV usage, preemptions and TTFT buckets of the mocker's engine (vllm:* names, labelled only engine and model)
    carry the worker's instance id: the hex worker_id of its dynamo_component_* series, in decimal, which is the id
    the frontend's per-worker series use."""
    raw, normalized = served(metrics_server, capture)
    run = capture.split("_worker")[0].removesuffix("_midload")
    role = capture.removesuffix(".prom").rsplit("_", 1)[1]
    worker = usage(run)["worker_ids"][role]
    hex_ids = {s.label_map["worker_id"] for s in raw if s.name.startswith("dynamo_component_") and "worker_id" in
               s.label_map}  # fmt: skip
    assert hex_ids == {f"{int(worker):x}"}
    assert {s.label_map["worker_id"] for s in normalized} == {worker}
    engine = {"engine": "0", "worker_id": worker}
    assert model(normalized, "kv.engine.cache.usage", **engine) == raw_value(raw, "vllm:kv_cache_usage_perc")
    assert model(normalized, "kv.engine.preemptions", **engine) == raw_value(raw, "vllm:num_preemptions_total")
    bounds = {s.label_map["le"] for s in raw if s.name == "vllm:time_to_first_token_seconds_bucket"}
    assert "+Inf" in bounds and len(bounds) > 5
    for le in bounds:
        assert model(normalized, "kv.engine.ttft.requests", **engine, role="", upper_bound=le) == raw_value(
            raw, "vllm:time_to_first_token_seconds_bucket", le=le
        )
    assert model(normalized, "kv.engine.ttft.requests", **engine, role="", upper_bound="+Inf") == raw_value(
        raw, "vllm:time_to_first_token_seconds_count"
    )
    assert {s.name for s in normalized} == {"kv.engine.cache.usage", "kv.engine.preemptions", "kv.engine.ttft.requests"}


@pytest.mark.parametrize("run", RUNS)
def test_the_frontend_s_tokens_are_the_responses_and_the_router_s_gap_shows_with_evictions(metrics_server, run):
    """The frontend's prompt and cached tokens equal the responses' usage summed over the run. Nothing evicted
    (routed): the router's chosen cached prefix is what the workers served. Small blocks: blocks removed, requests
    preempted on both workers, and the router expected more cached prefix than the workers still held."""
    answers = usage(run)["served"]
    _, frontend = served(metrics_server, f"{run}_frontend.prom")
    cached = model(frontend, "kv.frontend.cached.tokens", model="tiny")
    assert model(frontend, "kv.frontend.prompt.tokens", model="tiny") == answers["prompt_tokens"]
    assert cached == answers["cached_tokens"] > 0
    prefix = {s.label_map["choice"]: s.value for s in frontend if s.name == "kv.router.prefix.tokens"}
    events = Counter()
    for sample in frontend:
        if sample.name == "kv.router.events":
            events[(sample.label_map["event"], sample.label_map["status"])] += sample.value
    workers = [served(metrics_server, f"{run}_worker{index}.prom")[1] for index in (0, 1)]
    preemptions = [s.value for normalized in workers for s in normalized if s.name == "kv.engine.preemptions"]
    # every event was applied (ok); nothing rejected
    assert sum(value for (_, status), value in events.items() if status != "ok") == 0
    if run == "routed":
        assert prefix == {"selected": cached, "best_eligible": cached}
        assert events[("removed", "ok")] == 0 and events[("stored", "ok")] > 0 and preemptions == [0, 0]
    else:
        assert prefix["best_eligible"] >= prefix["selected"] > 2 * cached
        assert events[("removed", "ok")] > 0 and all(preemptions)


def test_mid_load_the_workers_caches_are_in_use(metrics_server):
    """Scraped while the last round ran: both workers' KV usage above 0 (it falls to 0 when idle, as at the end)."""
    for index in (0, 1):
        _, busy = served(metrics_server, f"small_blocks_midload_worker{index}.prom")
        _, idle = served(metrics_server, f"small_blocks_worker{index}.prom")
        assert next(s.value for s in busy if s.name == "kv.engine.cache.usage") > 0.5
        assert [s.value for s in idle if s.name == "kv.engine.cache.usage"] == [0.0]


@pytest.mark.parametrize("capture", CAPTURES)
def test_each_capture_s_normalized_output_is_the_golden_one(metrics_server, capture):
    _, normalized = served(metrics_server, capture)
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    if os.environ.get("KVSCOPE_UPDATE_GOLDEN") == "1":
        golden[capture] = golden_form(normalized)
        GOLDEN.write_text(json.dumps(dict(sorted(golden.items())), indent=1) + "\n")
    assert golden_form(normalized) == golden[capture]


# Every family the SGLang-imitating mocker serves that the mapping leaves out, and why (mappings/dynamo.yaml).
SGLANG_NOT_MAPPED = {
    "sglang:cache_hit_rate": "the last prefill batch's hit ratio, kept until the next: neither a state nor a window",
    "sglang:num_requests_total": "finished requests: once served, the +Inf TTFT bucket counts the same ones",
    "sglang:num_running_reqs": "running requests, not KV",
    "sglang:num_queue_reqs": "queued requests, not KV",
    "sglang:e2e_request_latency_seconds": "a latency histogram other than TTFT",
    "sglang:inter_token_latency_seconds": "a latency histogram other than TTFT",
}


@pytest.mark.parametrize("capture", SGLANG_WORKERS)
def test_an_sglang_worker_s_ttft_buckets_carry_its_id_bound_by_bound(metrics_server, capture):
    """The mocker under --engine-type sglang serves SGLang's names: its TTFT buckets (labelled model_name and
    engine_type, no rank) map onto the worker's kv.engine.ttft.requests, bound by bound, with the id the frontend
    writes; `engine` is the target's label, none here. Nothing else of the worker is mapped."""
    raw, normalized = served(metrics_server, capture)
    worker = usage(SGLANG)["worker_ids"][capture.removesuffix(".prom").rsplit("_", 1)[1]]
    assert not any(s.name.startswith("vllm:") for s in raw)
    bounds = {s.label_map["le"] for s in raw if s.name == "sglang:time_to_first_token_seconds_bucket"}
    assert len(bounds) == 19 and "+Inf" in bounds  # SGLang's TTFT buckets, 0.1 s to 400 s
    per_worker = {"engine": "", "role": "", "worker_id": worker}
    for le in bounds:
        assert model(normalized, "kv.engine.ttft.requests", **per_worker, upper_bound=le) == raw_value(
            raw, "sglang:time_to_first_token_seconds_bucket", le=le
        )
    requests = model(normalized, "kv.engine.ttft.requests", **per_worker, upper_bound="+Inf")
    assert (
        requests
        == raw_value(raw, "sglang:time_to_first_token_seconds_count")
        == raw_value(raw, "sglang:num_requests_total")
    )
    assert requests > 0
    assert {s.name for s in normalized} == {"kv.engine.ttft.requests"}


def test_every_sglang_family_a_worker_serves_is_mapped_or_left_out_with_a_reason():
    read = {name for rule in mapping_for("dynamo").rules for name in rule.match if name.startswith("sglang:")}
    assert read == {"sglang:time_to_first_token_seconds_bucket"}
    for capture in SGLANG_WORKERS:
        text = (FIXTURES / capture).read_text()
        families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE sglang:")}
        assert families == {"sglang:time_to_first_token_seconds"} | set(SGLANG_NOT_MAPPED), capture


def test_behind_sglang_mockers_the_frontend_counts_no_cached_tokens_and_the_router_s_prefix_shows(metrics_server):
    """The routed run's workload and settings, the mockers imitating SGLang: every request is counted on the
    worker that served it, and the frontend's prompt tokens are the responses'. Their responses carry no cached
    tokens (no prompt_tokens_details), so the frontend's cached tokens are 0; yet the engines hit their caches (the
    last prefill batch's hit ratio above 0) and the router's cached prefix is the one the vLLM-imitating mockers
    served in the routed run: mapped apart, the gap shows."""
    answers = usage(SGLANG)["served"]
    _, frontend = served(metrics_server, f"{SGLANG}_frontend.prom")
    assert model(frontend, "kv.frontend.prompt.tokens", model="tiny") == answers["prompt_tokens"]
    assert model(frontend, "kv.frontend.cached.tokens", model="tiny") == answers["cached_tokens"] == 0
    routed = usage("routed")["served"]["cached_tokens"]
    prefix = {s.label_map["choice"]: s.value for s in frontend if s.name == "kv.router.prefix.tokens"}
    assert prefix == {"selected": routed, "best_eligible": routed} and routed > 0
    requests = 0.0
    for capture in SGLANG_WORKERS:
        raw, normalized = served(metrics_server, capture)
        requests += sum(s.value for s in normalized if s.label_map["upper_bound"] == "+Inf")
        assert raw_value(raw, "sglang:cache_hit_rate") > 0
    assert len(SGLANG_WORKERS) == 2 and requests == answers["requests"]


def test_promtool_accepts_the_served_exposition_of_an_sglang_worker(metrics_server, check_metrics):
    """An SGLang worker's TTFT series name no engine: the served series has none either, and promtool accepts it."""
    url = metrics_server.serve("/sglang", (FIXTURES / f"{SGLANG}_worker0.prom").read_bytes())
    text = served_exposition(parse_config({"exporter": {"listen_port": 0}, "targets": [
        {"name": "dynamo-sglang", "source": "dynamo", "url": url}]}))  # fmt: skip
    worker = usage(SGLANG)["worker_ids"]["worker0"]
    assert f'\nkv_engine_ttft_requests_total{{engine="",role="",target="dynamo-sglang",upper_bound="+Inf",' \
           f'worker_id="{worker}"}} 16' in text  # fmt: skip
    check_metrics(text)


SEVERAL_WORKERS = """\
# TYPE dynamo_component_uptime_seconds gauge
dynamo_component_uptime_seconds{worker_id="a"} 1
dynamo_component_uptime_seconds{worker_id="b"} 1
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="tiny"} 3
"""


def test_an_exposition_of_several_workers_attaches_no_id_and_says_why(metrics_server):
    """`--num-workers 2` in one process: whose engine series are whose cannot be told. Nothing is attached, the
    scrape counts a read error, and the rest is exported as it is."""
    raw, normalized, collector = scrape(metrics_server.serve("/metrics", SEVERAL_WORKERS))
    assert not any(INSTANCE_LABEL in s.label_map for s in raw)
    (error,) = collector.take_read_errors()
    assert error.reason == "unparseable" and "several Dynamo instance ids" in error.detail and "a, b" in error.detail
    assert [(s.name, s.label_map, s.value) for s in normalized] == [
        ("kv.engine.preemptions", {"engine": "0", "worker_id": ""}, 3.0)
    ]


def test_an_exposition_without_dynamo_s_own_series_is_left_as_it_is():
    samples = [Sample("dynamo", "vllm:num_preemptions_total", (("engine", "0"),), 1.0, "counter")]
    assert instance_id_samples(samples) == (samples, None)


def test_promtool_accepts_the_served_exposition_of_a_frontend_and_two_workers(metrics_server, check_metrics):
    targets = [
        {"name": f"dynamo-{role}", "source": "dynamo", "url": metrics_server.serve(f"/{role}", (
            FIXTURES / f"small_blocks_midload_{role}.prom").read_bytes())}
        for role in ("frontend", "worker0", "worker1")
    ]  # fmt: skip
    text = served_exposition(parse_config({"exporter": {"listen_port": 0}, "targets": targets}))
    for name in ("kv_router_prefix_tokens_total{", "kv_router_events_total{", "kv_frontend_cached_tokens_total{",
                 "kv_engine_cache_usage{", "kv_engine_active_blocks{", "kv_model_blocks{"):  # fmt: skip
        assert f"\n{name}" in text, name
    check_metrics(text)


def test_the_served_families_are_what_opentelemetry_s_exporter_makes_of_them(metrics_server):
    """kvscope renders its endpoint itself: the new instruments (a ratio's unit "1" among them) come out with the
    names, types, help, series and values OpenTelemetry's own Prometheus exporter gives them (less otel_scope_*)."""
    targets = [
        {"name": f"dynamo-{role}", "source": "dynamo", "url": metrics_server.serve(f"/{role}", (
            FIXTURES / f"small_blocks_midload_{role}.prom").read_bytes())}
        for role in ("frontend", "worker0")
    ]  # fmt: skip
    config = parse_config({"exporter": {"listen_port": 0}, "targets": targets})
    scraper = Scraper(config.targets)
    scrape_once(scraper)
    registry = CollectorRegistry()
    bridge = TelemetryBridge(scraper, config.exporter, readers=[PrometheusMetricReader(registry=registry)])

    def described(text: str) -> dict[str, tuple]:
        return {
            family.name: (family.type, family.documentation, sorted(
                (s.name, sorted((k, v) for k, v in s.labels.items() if not k.startswith("otel_scope_")), s.value)
                for s in family.samples))
            for family in text_string_to_metric_families(text)
        }  # fmt: skip

    try:
        ours, theirs = described(bridge.prometheus_text()), described(generate_latest(registry).decode())
    finally:
        bridge.shutdown()
    assert {"kv_engine_cache_usage", "kv_router_prefix_tokens", "kv_router_events", "kv_model_blocks"} <= set(ours)
    assert ours == theirs


# What Dynamo's real vLLM worker serves beyond the mocker, as its names and labels are written in Dynamo 1.6.1's
# sources (dynamo.common.utils.prometheus.LLMBackendMetrics: model, dynamo_component, dp_rank) and vLLM's: hand-made
# from those names (a real vLLM worker needs a GPU), not captured. Both usage gauges, as such a worker serves them.
REAL_VLLM_WORKER_SYNTHETIC = """\
# TYPE dynamo_component_uptime_seconds gauge
dynamo_component_uptime_seconds{worker_id="ff"} 10
# TYPE dynamo_component_total_blocks gauge
dynamo_component_total_blocks{dp_rank="0",dynamo_component="backend",model="m"} 1000
dynamo_component_total_blocks{dp_rank="1",dynamo_component="backend",model="m"} 1000
# TYPE dynamo_component_gpu_cache_usage_percent gauge
dynamo_component_gpu_cache_usage_percent{dp_rank="0",dynamo_component="backend",model="m"} 0.25
dynamo_component_gpu_cache_usage_percent{dp_rank="1",dynamo_component="backend",model="m"} 0.5
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 4096
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 1024
"""


def test_a_real_vllm_worker_s_gauges_map_per_rank_and_its_usage_once(metrics_server):
    """Not seen live: Dynamo's per-rank KV blocks, vLLM's prefix-cache counters, and the usage read once (vLLM's
    own gauge first) though the worker serves it under both names."""
    text = REAL_VLLM_WORKER_SYNTHETIC
    _, normalized, _ = scrape(metrics_server.serve("/metrics", text))
    worker = str(0xFF)
    assert {(s.name, tuple(sorted(s.label_map.items())), s.value) for s in normalized} == {
        ("kv.engine.blocks", (("engine", "0"), ("worker_id", worker)), 1000.0),
        ("kv.engine.blocks", (("engine", "1"), ("worker_id", worker)), 1000.0),
        ("kv.engine.cache.usage", (("engine", "0"), ("worker_id", worker)), 0.25),
        ("kv.engine.cache.usage", (("engine", "1"), ("worker_id", worker)), 0.5),
        ("kv.prefix.query.tokens", (("engine", "0"), ("layer", "gpu"), ("worker_id", worker)), 4096.0),
        ("kv.prefix.hit.tokens", (("engine", "0"), ("layer", "gpu"), ("worker_id", worker)), 1024.0),
    }
    # without vLLM's gauge, Dynamo's is read, its dp_rank as the engine
    only_dynamo = "\n".join(line for line in text.splitlines() if "kv_cache_usage_perc" not in line) + "\n"
    _, normalized, _ = scrape(metrics_server.serve("/dynamo-only", only_dynamo))
    usage = {s.label_map["engine"]: s.value for s in normalized if s.name == "kv.engine.cache.usage"}
    assert usage == {"0": 0.25, "1": 0.5}


# ---- KVBM, Dynamo's KV block manager: a fixture rendered from Dynamo 1.6.1's names and KVBM's source ----
KVBM = FIXTURES / "kvbm_rendered_v1.6.1_SYNTHETIC.txt"
ROOT = FIXTURES.parents[2]
KVBM_NOT_MAPPED = {
    "kvbm_object_read_failures": "blocks whose object-storage read failed; the model has no failure count",
    "kvbm_object_write_failures": "blocks whose object-storage write failed; the model has no failure count",
}
# Offload and onboard counters by the tiers a block left and entered (dynamo.prometheus_names.kvbm's comments).
KVBM_MOVES = {
    "kvbm_offload_blocks_d2h": ("gpu", "host"),
    "kvbm_offload_blocks_h2d": ("host", "disk"),
    "kvbm_offload_blocks_d2d": ("gpu", "disk"),
    "kvbm_offload_blocks_d2o": ("gpu", "object"),
    "kvbm_onboard_blocks_h2d": ("host", "gpu"),
    "kvbm_onboard_blocks_d2d": ("disk", "gpu"),
    "kvbm_onboard_blocks_o2d": ("object", "gpu"),
}


def test_kvbm_s_names_are_dynamo_s_own_and_every_family_is_mapped_or_left_out_with_a_reason(metrics_server):
    # Dynamo's generated constants, pure Python: read from the Dynamo venv's copy where the Dynamo tests installed it.
    names_file = ROOT / ".venv-dynamo" / "lib" / "python3.11" / "site-packages" / "dynamo" / "prometheus_names.py"
    if not names_file.is_file():
        pytest.skip(f"Dynamo 1.6.1's names are not installed ({names_file})")
    spec = importlib.util.spec_from_file_location("dynamo_prometheus_names", names_file)
    dynamo_names = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dynamo_names)
    raw, _, _ = scrape(metrics_server.serve("/kvbm", KVBM.read_bytes()), labels={"engine": "w0"})
    found = {s.name for s in raw}
    named = {f"kvbm_{value}" for key, value in vars(dynamo_names.kvbm).items() if key.isupper()}
    assert found == named


def test_every_kvbm_family_is_mapped_once_or_left_out_with_a_reason(metrics_server):
    raw, _, collector = scrape(metrics_server.serve("/kvbm", KVBM.read_bytes()), labels={"engine": "w0"})
    assert collector.take_read_errors() == []
    found = {s.name for s in raw}
    read = [name for rule in mapping_for("dynamo").rules for name in rule.match if name.startswith("kvbm_")]
    assert len(read) == len(set(read))  # one rule per family
    assert found == set(read) | set(KVBM_NOT_MAPPED)
    assert len(found) == 15
    assert {s.kind for s in raw if s.name.endswith("_hit_rate")} == {"gauge"}
    assert {s.kind for s in raw if not s.name.endswith("_hit_rate")} == {"counter"}


def test_kvbm_s_matched_tokens_moves_between_tiers_and_hit_ratios_equal_the_raw_values(metrics_server):
    raw, normalized, _ = scrape(metrics_server.serve("/kvbm", KVBM.read_bytes()), labels={"engine": "w0"})
    store = {"system": "kvbm:w0"}
    assert model(normalized, "kv.prefix.hit.tokens", engine="w0", layer="kvbm") == raw_value(raw, "kvbm_matched_tokens")
    for name, (from_tier, to_tier) in KVBM_MOVES.items():
        moved = model(normalized, "kv.tier.transferred.blocks", **store, from_tier=from_tier, to_tier=to_tier)
        assert moved == raw_value(raw, name) > 0, name
    assert model(normalized, "kv.tier.written.bytes", **store, tier="object") == raw_value(
        raw, "kvbm_offload_bytes_object"
    )
    assert model(normalized, "kv.tier.read.bytes", **store, tier="object") == raw_value(
        raw, "kvbm_onboard_bytes_object"
    )
    for tier in ("host", "disk", "object"):
        ratio = model(normalized, "kv.tier.hit.ratio", **store, tier=tier)
        assert ratio == raw_value(raw, f"kvbm_{tier}_cache_hit_rate")
        assert 0 < ratio < 1
    assert len(normalized) == 1 + len(KVBM_MOVES) + 2 + 3


def test_promtool_accepts_the_served_exposition_of_a_kvbm(metrics_server, check_metrics):
    url = metrics_server.serve("/kvbm", KVBM.read_bytes())
    target = {"name": "kvbm-w0", "source": "dynamo", "url": url, "labels": {"engine": "w0"}}
    text = served_exposition(parse_config({"exporter": {"listen_port": 0}, "targets": [target]}))
    for name in ('kv_tier_transferred_blocks_total{from_tier="gpu",system="kvbm:w0",target="kvbm-w0",to_tier="host"}',
                 'kv_tier_hit_ratio{system="kvbm:w0",target="kvbm-w0",tier="disk"}',
                 'kv_prefix_hit_tokens_total{engine="w0",layer="kvbm",target="kvbm-w0"}'):  # fmt: skip
        assert f"\n{name}" in text, name
    check_metrics(text)
