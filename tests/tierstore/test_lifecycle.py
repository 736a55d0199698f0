"""Block lifecycle per tier (vLLM's --kv-cache-metrics meaning): lifetime, idle time before eviction and reuse gaps on
hand-worked chains with explicit clock times, the sample of chain positions, placement, and on the A/B's request
clock.

Blocks are 100 B (conftest.BLOCK); a tier of "N blocks" has capacity N x 100 B. The store-level tests follow every
block and save chains as the engine does: put, then have the tiers follow what was stored.
"""

from __future__ import annotations

import pytest

from kvscope.tierstore import lifecycle
from kvscope.tierstore.ab import run_ab
from kvscope.tierstore.lifecycle import BOUNDS, Followed, Histogram, first_sampled, follow
from kvscope.tierstore.report import lifecycle_lines
from kvscope.tierstore.scenario import parse_scenario
from kvscope.tierstore.store import TieredStore

BLOCK = 100  # conftest.BLOCK


@pytest.fixture
def every_block(monkeypatch):
    """The tiers follow every block."""
    monkeypatch.setattr(lifecycle, "SAMPLE_EVERY", 1)


def save(store: TieredStore, chain: list[str], start: int = 0) -> None:
    """What the engine does with the blocks of `chain` from `start`: put them, and the tiers follow them."""
    store.put(chain[start:], BLOCK)
    follow(store.tiers, chain[0], chain[start:], start)


def observed(store: TieredStore, tier: int, quantity: str) -> tuple[int, float, dict[float, int]]:
    """(count, sum, {bound: observations at most it} for the bounds whose count grew) of one tier's quantity."""
    histogram = store.tiers[tier].lifecycle.snapshot()[quantity]
    steps, before = {}, 0
    for bound, below in zip(BOUNDS, histogram["buckets"], strict=True):
        if below > before:
            steps[bound] = below
        before = below
    return histogram["count"], histogram["sum"], steps


def test_lifetime_idle_time_and_reuse_gaps_of_a_hand_worked_chain(every_block, make_store, chain):
    """An LRU tier of 3 blocks. t=0: a0-a2 stored. t=1: all three hit (their first access: no gap). t=1.5: a0 hit
    (gap 0.5 s), t=21: a0 hit (gap 19.5 s). t=25: b0 evicts a1, the least recent (lived 25 s, idle 24 s since its
    hit at 1). t=40: b1 evicts a2 (lived 40 s, idle 39 s)."""
    store = make_store([("dram", 3)])
    a = chain("a", 3)
    save(store, a)
    for seconds, keys in ((1, a), (1.5, a[:1]), (21, a[:1])):
        store.at(seconds)
        store.read_prefix(keys)
    for seconds, key in ((25, "b0"), (40, "b1")):
        store.at(seconds)
        save(store, [key])
    assert "a1" not in store and "a2" not in store and "a0" in store
    assert observed(store, 0, "lifetime") == (2, 65.0, {30.0: 1, 60.0: 2})
    assert observed(store, 0, "idle_before_evict") == (2, 63.0, {30.0: 1, 60.0: 2})
    assert observed(store, 0, "reuse_gap") == (2, 20.0, {0.5: 1, 20.0: 2})


def test_a_block_never_hit_is_idle_its_whole_lifetime(every_block, make_store):
    store = make_store([("dram", 1, "fifo")])
    save(store, ["x"])
    store.at(3)
    save(store, ["y"])  # evicts x, stored at 0 and never hit
    assert observed(store, 0, "lifetime") == observed(store, 0, "idle_before_evict") == (1, 3.0, {5.0: 1})
    assert observed(store, 0, "reuse_gap") == (0, 0.0, {})


def test_each_tier_times_its_own_copy_and_a_block_moved_up_ends_no_lifetime(every_block, make_store):
    """Demote placement: a block evicted from dram at t=2 is stored in nof then, followed there too (its nof lifetime
    starts there); its promotion back to dram at t=7 takes it out of nof, which is no eviction."""
    store = make_store([("dram", 1), ("nof", 4)], placement="demote", promote_on_hit=True)
    save(store, ["x"])
    store.at(2)
    save(store, ["y"])  # x: dram -> nof
    store.at(7)
    assert store.read_prefix(["x"]).blocks == 1  # served by nof, moved up to dram: y goes down
    assert observed(store, 0, "lifetime") == (2, 7.0, {2.0: 1, 5.0: 2})  # x lived 2 s in dram, y 5 s
    assert observed(store, 1, "lifetime") == (0, 0.0, {})  # x left nof by a promotion
    assert observed(store, 1, "reuse_gap") == (0, 0.0, {})  # its one hit there is its first
    store.at(8)
    save(store, ["z"])  # x (stored in dram again at 7) goes down: 1 s in dram
    assert observed(store, 0, "lifetime") == (3, 8.0, {1.0: 1, 2.0: 2, 5.0: 3})


def test_the_tiers_follow_one_chain_position_in_every_the_same_blocks_whichever_part_of_the_chain_they_see(
    monkeypatch, make_tier, chain
):
    """Every third position, from a phase the chain's head sets: a block is followed whether its chain is saved
    whole or in parts (a request's prompt, then its answer), and a lookup's run samples the same ones."""
    monkeypatch.setattr(lifecycle, "SAMPLE_EVERY", 3)
    a = chain("a", 12)
    followed = [position for position in range(12) if first_sampled(a[0], position) == 0]
    assert followed == list(range(followed[0], 12, 3))
    assert [position + first_sampled(a[0], position) for position in range(9)] == [
        next(p for p in followed if p >= position) for position in range(9)
    ]
    whole, parts = make_tier("whole", 12), make_tier("parts", 12)
    for tier in (whole, parts):
        tier.write(a, BLOCK, is_put=True)
    follow([whole], a[0], a, 0)
    follow([parts], a[0], a[:5], 0)
    follow([parts], a[0], a[5:], 5)
    for tier in (whole, parts):
        assert [a.index(key) for key, value in tier.policy.index.items() if type(value) is Followed] == followed


def test_a_gap_of_one_request_interval_lands_in_its_bound_s_bucket():
    """Float times of a paced clock (0.30000000000000004 - 0.2) count at the bound they equal."""
    histogram = Histogram()
    histogram.add([0.30000000000000004 - 0.2, 0.2 - 0.1, 0.1000001, -0.5])
    cumulative = histogram.cumulative()
    assert cumulative[0] == 1  # a time before another (overlapping recorded steps) counts as 0
    assert cumulative[BOUNDS.index(0.1)] == 3 and cumulative[BOUNDS.index(0.2)] == 4 == histogram.count


def test_an_ab_run_times_the_lifecycle_on_its_request_clock(every_block):
    """Four sessions served round robin, 0.1 s apart: a session's blocks are hit every 0.4 s (reuse gaps in the 0.5 s
    bucket, none below); a tier that holds everything evicts nothing, one too small evicts."""
    scenario = parse_scenario({
        "name": "lifecycle",
        "workload": {"kind": "multi_round", "sessions": 4, "rounds": 5, "first_prompt_tokens": 700,
                     "output_tokens": 300},
        "kv": {"block_tokens": 64, "bytes_per_token": 100},
        "arms": {"big": {"tiers": [{"name": "dram", "capacity": "10MB"}]},
                 "small": {"tiers": [{"name": "dram", "capacity": "200KB"}]}},
    })  # fmt: skip
    result = run_ab(scenario)
    big = result["arms"]["big"]["totals"]["block_lifecycle"]
    assert big["bounds_s"] == list(BOUNDS)
    dram = big["tiers"]["dram"]
    assert big["sampled_every"] == 1 and dram["lifetime"]["count"] == dram["idle_before_evict"]["count"] == 0
    gaps = dram["reuse_gap"]
    assert gaps["count"] > 0 and gaps["sum"] == pytest.approx(0.4 * gaps["count"])
    assert gaps["buckets"][BOUNDS.index(0.2)] == 0 and gaps["buckets"][BOUNDS.index(0.5)] == gaps["count"]
    small = result["arms"]["small"]["totals"]["block_lifecycle"]["tiers"]["dram"]
    assert small["lifetime"]["count"] > 0
    assert small["idle_before_evict"]["sum"] <= small["lifetime"]["sum"]


def test_the_report_line_gives_each_tier_s_means_and_median_buckets():
    """Three lifetimes (5 s, 10 s and 30 s): mean 15 s, the median in the bucket up to 10 s; quantities and tiers that
    observed nothing are left out, and so are arms on a real store."""
    lifetimes, nothing = Histogram(), Histogram().as_dict()
    lifetimes.add([5.0, 10.0, 30.0])
    dram = {"lifetime": lifetimes.as_dict(), "idle_before_evict": nothing, "reuse_gap": nothing}
    tiers = {"dram": dram, "nof": dict.fromkeys(dram, nothing)}
    lifecycle = {"bounds_s": list(BOUNDS), "sampled_every": 256, "tiers": tiers}
    result = {"arms": {"embedded": {"totals": {"block_lifecycle": lifecycle}}, "real": {"totals": {}}}}
    assert lifecycle_lines(result) == [
        "embedded block lifecycle (1 in 256 blocks, request clock; mean, median bucket): dram: lifetime 15 s (<= 10 s)"
    ]
