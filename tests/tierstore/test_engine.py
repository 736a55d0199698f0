"""Engine emulator: whole-block hits, the always-computed last token, recompute, TTFT cost model, GPU cache.

Blocks are 256 tokens of 1,000 B (256,000 B); prefill runs at 1,000 tokens/s so TTFT terms read as seconds.
"""

from __future__ import annotations

import pytest

from kvscope.tierstore.engine import EngineEmulator, RequestClock, RequestTimes
from kvscope.tierstore.mooncake_tier import MooncakeTier
from kvscope.tierstore.policies import MooncakePolicy, make_policy
from kvscope.tierstore.store import TieredStore
from kvscope.tierstore.tier import Tier
from kvscope.tierstore.workloads import Request

TOKENS = 256
BLOCK_BYTES = 256_000
PREFILL = 1_000.0


def blocks(count: int) -> int:
    return count * BLOCK_BYTES


def request(prompt_tokens: int, n_keys: int, output_keys=()) -> Request:
    return Request(1, 0, prompt_tokens, [f"k{i}" for i in range(n_keys)], list(output_keys))


def engine(*tiers: Tier, gpu: Tier | None = None) -> EngineEmulator:
    return EngineEmulator(TieredStore(list(tiers)), TOKENS, BLOCK_BYTES, PREFILL, gpu)


def dram(capacity_blocks: int = 100, bandwidth: float | None = None) -> Tier:
    return Tier("dram", blocks(capacity_blocks), make_policy("lru"), read_bandwidth=bandwidth)


def test_cold_then_warm_prompt_hits_whole_blocks():
    """1034 tokens = 4 full blocks + 10: cold it recomputes all and saves 4 blocks; warm it hits 1024."""
    emulator = engine(dram())
    cold = emulator.serve(request(1034, 4))
    assert (cold.hit_tokens, cold.recompute_tokens, cold.put_bytes) == (0, 1034, blocks(4))
    warm = emulator.serve(request(1034, 4))
    assert (warm.external_hit_tokens, warm.gpu_hit_tokens, warm.recompute_tokens, warm.put_bytes) == (1024, 0, 10, 0)


def test_partial_prefix_hits_present_blocks_and_saves_only_the_missing():
    """Store holds k0,k1 (from a 600-token prompt); a 1034-token prompt hits 512 and saves k2,k3."""
    emulator = engine(dram())
    emulator.serve(request(600, 2))
    served = emulator.serve(request(1034, 4))
    assert (served.hit_tokens, served.recompute_tokens, served.put_bytes) == (512, 522, blocks(2))


def test_fully_cached_prompt_of_exactly_k_blocks_hits_k_minus_1():
    """The prompt's last token is always computed: 1024 tokens = 4 blocks, all cached, hits only 3."""
    emulator = engine(dram())
    emulator.serve(request(1024, 4))
    served = emulator.serve(request(1024, 4))
    assert (served.hit_tokens, served.recompute_tokens, served.put_bytes) == (768, 256, 0)
    one_more = emulator.serve(request(1025, 4))  # with one token past the 4th block, all 4 blocks hit
    assert (one_more.hit_tokens, one_more.recompute_tokens) == (1024, 1)


def test_single_block_prompt_never_hits():
    """A 256-token prompt (1 block) cannot hit anything: (256 - 1) // 256 = 0 hittable blocks."""
    emulator = engine(dram())
    emulator.serve(request(256, 1))
    served = emulator.serve(request(256, 1))
    assert (served.hit_tokens, served.recompute_tokens) == (0, 256)
    assert emulator.store.tiers[0].counters.hits == 0


def test_output_keys_are_saved_and_hit_next_time():
    """Cached output blocks count in put_bytes and extend the next prompt's hit."""
    emulator = engine(dram())
    first = emulator.serve(request(600, 2, output_keys=["k2"]))
    assert first.put_bytes == blocks(3)
    following = emulator.serve(request(1034, 4))
    assert (following.hit_tokens, following.put_bytes) == (768, blocks(1))


def test_ttft_is_recompute_over_prefill_plus_hit_bytes_over_each_tier_bandwidth():
    """dram (2 blocks, 1 MB/s) over nof (100 blocks, 0.5 MB/s), replicated.

    Request 1 (1034 tokens, cold): TTFT = 1034 / 1000 = 1.034 s; dram keeps only k2,k3, nof holds k0..k3.
    Request 2 (same prompt): k0,k1 from nof, k2,k3 from dram, 10 tokens recomputed:
        10 / 1000 + 512,000 / 1e6 + 512,000 / 5e5 = 0.01 + 0.512 + 1.024 = 1.546 s.
    """
    nof = Tier("nof", blocks(100), make_policy("lru"), read_bandwidth=5e5)
    emulator = engine(dram(2, bandwidth=1e6), nof)
    assert emulator.serve(request(1034, 4)).ttft_s == pytest.approx(1.034)
    served = emulator.serve(request(1034, 4))
    assert served.hit_tokens == 1024
    assert served.ttft_s == pytest.approx(1.546)
    counters = emulator.store.counters()
    assert (counters["dram"]["hits"], counters["dram"]["read_bytes"]) == (2, blocks(2))
    assert (counters["nof"]["hits"], counters["nof"]["read_bytes"]) == (2, blocks(2))


def test_tier_without_bandwidth_adds_no_load_time():
    emulator = engine(dram())
    emulator.serve(request(1034, 4))
    assert emulator.serve(request(1034, 4)).ttft_s == pytest.approx(0.01)


def test_gpu_cache_in_front_counts_gpu_hits_separately():
    """gpu (2 blocks, LRU) in front of dram (1 MB/s) that already holds k0..k3.

    A (600 tokens, k0,k1): gpu empty, dram serves 2 blocks -> external 512; TTFT 88/1000 + 0.512 = 0.6 s;
        k0,k1 then land in the gpu.
    B (1034 tokens, k0..k3): gpu serves k0,k1 (512, free), dram k2,k3 (512): TTFT 0.01 + 0.512 = 0.522 s;
        the gpu then takes k2,k3 and evicts k0,k1.
    """
    gpu = Tier("gpu", blocks(2), make_policy("lru"))
    emulator = engine(dram(bandwidth=1e6), gpu=gpu)
    emulator.store.put([f"k{i}" for i in range(4)], BLOCK_BYTES)
    a = emulator.serve(request(600, 2))
    assert (a.gpu_hit_tokens, a.external_hit_tokens, a.recompute_tokens) == (0, 512, 88)
    assert a.ttft_s == pytest.approx(0.6)
    b = emulator.serve(request(1034, 4))
    assert (b.gpu_hit_tokens, b.external_hit_tokens, b.hit_tokens, b.recompute_tokens) == (512, 512, 1024, 10)
    assert b.ttft_s == pytest.approx(0.522)
    assert b.put_bytes == 0
    assert (gpu.counters.hits, gpu.counters.puts, gpu.counters.written_bytes) == (2, 0, blocks(4))
    assert (gpu.counters.evictions, gpu.counters.allocated_bytes) == (2, blocks(2))
    assert emulator.store.tiers[0].counters.hits == 4  # 2 for A + 2 for B, none for gpu-served blocks
    assert ["k0" in gpu, "k1" in gpu, "k2" in gpu, "k3" in gpu] == [False, False, True, True]


def test_engine_releases_chains_to_the_store_and_the_gpu_cache():
    """With tail_first, a served request's tail must be the next victim in the store and in the gpu cache.

    Serve A (a0, a1) then B (b0, b1) in 4-block tiers; one more block evicts a1 (A released first, tail
    first). Without the release it would be a0, the first admitted.
    """
    store_tier = Tier("dram", blocks(4), make_policy("tail_first"))
    gpu = Tier("gpu", blocks(4), make_policy("tail_first"))
    emulator = engine(store_tier, gpu=gpu)
    for name in ("a", "b"):
        emulator.serve(Request(1, 0, 600, [f"{name}0", f"{name}1"]))
    for tier in (store_tier, gpu):
        evicted = tier.write(["c0"], BLOCK_BYTES, is_put=False, keep_evicted=True)
        assert [e.key for e in evicted] == ["a1"], tier.name


def test_a_paced_clock_puts_every_step_of_request_n_at_n_intervals_and_a_mirror_s_at_the_real_times():
    assert RequestClock(0.5)(3) == RequestTimes(1.5, 1.5, 1.5)
    rows = [{"request_start_s": [0.0, 0.9], "request_first_token_s": [0.2, None], "request_s": [0.5, 0.3]}]
    clock = RequestClock(0.8, rows)  # the real arm's second request came 0.1 s late; its engine gave no timing
    assert [clock(0), clock(1)] == [RequestTimes(0.0, 0.2, 0.5), RequestTimes(0.9, 0.9, 1.2)]
    assert clock(3).start == pytest.approx(2.5)  # past the rows, the pacing goes on from the last start
    # where the engine's events said when the connector saved, the save is then; where it saved nothing, at the
    # first token
    rows[0]["request_saved_s"] = [0.6, None]
    assert [RequestClock(0.8, rows)(n).saved for n in (0, 1)] == [0.6, 0.9]


def test_the_engine_leases_a_chain_when_its_prefill_is_saved_and_ends_on_the_decode_save():
    """A Mooncake segment behind a connector that saves whole chains: the save's existence check leases the chain
    at the request's first token, the decoded block is put when it is answered."""
    segment = MooncakeTier("dram", blocks(100), MooncakePolicy(lease_ttl=3.0, shards=1), retries_refused=False)
    rows = [{"request_start_s": [0.0, 0.8], "request_first_token_s": [0.1, 0.3], "request_s": [0.2, 0.5]}]
    emulator = EngineEmulator(TieredStore([segment]), TOKENS, BLOCK_BYTES, PREFILL, saves_whole_chain=True,
                              clock=RequestClock(0.8, rows))  # fmt: skip
    emulator.serve(request(1034, 4, ["out0"]))
    emulator.serve(request(1034, 4, ["out1"]))  # 4 blocks hit, looked up at 0.8, the chain saved at 1.1
    policy = segment.mooncake
    assert policy.now == pytest.approx(1.3)
    assert {key: policy._lease[key] for key in ("k0", "out0", "out1")} == pytest.approx(
        {"k0": 1.1 + 3.0, "out0": 0.2, "out1": 1.3}
    )
