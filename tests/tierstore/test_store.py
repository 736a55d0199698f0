"""Tier and TieredStore: chain lookups, placement (replicate / demote / promote_on_hit) and per-tier counters.

Blocks are 100 B (conftest.BLOCK); a tier of "N blocks" has capacity N x 100 B.
"""

from __future__ import annotations

import pytest

from kvscope.tierstore.ab import run_ab
from kvscope.tierstore.policies import POLICIES, make_policy
from kvscope.tierstore.store import TieredStore
from kvscope.tierstore.tier import LONG_RUN, Tier


def counters(store: TieredStore, tier: str, *names: str) -> tuple[int, ...]:
    return tuple(store.counters()[tier][name] for name in names)


# --------------------------------------------------------------------------- chain semantics


def test_missing_head_makes_whole_chain_miss(make_store, chain, block):
    """The tail is still resident but the head was evicted: a prefix lookup must find 0 blocks."""
    store = make_store([("dram", 4)])
    a = chain("a", 3)
    store.put(a, block)
    store.put(["b0"], block)  # full: a0, a1, a2, b0
    store.put(["c0"], block)  # LRU evicts a0, the oldest
    assert "a0" not in store and "a1" in store and "a2" in store
    hit = store.prefix(a)
    assert hit.blocks == 0
    assert hit.segments == []


def test_run_stops_at_first_missing_block(make_store, chain, block):
    """Blocks after a hole do not count, even though they are present."""
    store = make_store([("dram", 10)])
    a = chain("a", 5)
    store.put(a, block)
    store.tiers[0].remove("a2")
    hit = store.prefix(a)
    assert (hit.blocks, hit.segments) == (2, [(0, 0, 2)])
    assert store.prefix(a, start=3).blocks == 2  # a3, a4
    assert store.prefix(a, start=0, stop=1).blocks == 1
    assert store.prefix(a, start=2).blocks == 0


def test_prefix_has_no_side_effects(make_store, chain, block):
    """prefix() only looks: no hits, no reads, no recency change."""
    store = make_store([("dram", 3)])
    store.put(chain("a", 2), block)
    store.put(["b0"], block)
    store.prefix(chain("a", 2))
    assert counters(store, "dram", "hits", "read_bytes") == (0, 0)
    store.put(["c0"], block)  # a0 must still be the LRU victim
    assert "a0" not in store and "b0" in store


def test_read_refreshes_the_run_only_not_blocks_after_its_first_miss(make_tier, chain, block, drain):
    """A read finds the run and refreshes it in one pass: a2, present but behind the hole at a1, keeps its age."""
    tier = make_tier("dram", 10)
    a = chain("a", 3)
    tier.write([*a, "b0"], block, is_put=True)
    tier.remove("a1")
    assert tier.read_run(a, 0, 3) == (1, block)
    assert (tier.counters.hits, tier.counters.read_bytes) == (1, block)
    assert drain(tier.policy) == ["a2", "b0", "a0"]


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("held", [0, 1, LONG_RUN - 1, LONG_RUN, LONG_RUN + 1, 3 * LONG_RUN, 5 * LONG_RUN])
@pytest.mark.parametrize("end", [LONG_RUN, LONG_RUN + 1, 4 * LONG_RUN, 10 * LONG_RUN])
def test_a_run_of_any_length_is_read_as_block_by_block(make_tier, chain, block, drain, policy, held, end):
    """Runs shorter and longer than LONG_RUN (whose rest a C loop reads), ending at a hole or at `end`: the same
    run, hits and eviction order as reading and refreshing one block at a time."""
    keys = chain("k", 5 * LONG_RUN + 3)
    expected = min(held, end)
    tier = make_tier("dram", 10 * LONG_RUN, policy)
    reference = make_tier("dram", 10 * LONG_RUN, policy)
    for each in (tier, reference):
        each.write([*keys[:held], "other"], block, is_put=True)
        each.write(keys[held + 1 :], block, is_put=True)  # present after the hole: never part of the run
    assert tier.read_run(keys, 0, end) == ((expected, expected * block) if expected else (0, 0))
    for key in keys[:expected]:
        assert reference.read_run([key], 0, 1) == (1, block)
    assert tier.counters.hits == reference.counters.hits == expected
    assert drain(tier.policy) == drain(reference.policy)


def test_fifo_read_counts_hits_without_reordering(make_tier, chain, block, drain):
    tier = make_tier("dram", 10, "fifo")
    tier.write(chain("a", 2), block, is_put=True)
    tier.write(["b0"], block, is_put=True)
    assert tier.read_run(chain("a", 2), 0, 2) == (2, 2 * block)
    assert tier.counters.hits == 2
    assert drain(tier.policy) == ["a0", "a1", "b0"]


def test_read_bytes_sum_each_blocks_size_once_sizes_differ(make_tier, block):
    """Reads multiply by the block size while every write had one size, and sum per block once two did."""
    tier = make_tier("dram", 10)
    tier.write(["a0"], block, is_put=True)
    assert tier.read_run(["a0"], 0, 1) == (1, block)
    tier.write(["b0", "b1"], block // 4, is_put=True)
    assert tier.read_run(["a0", "b0", "b1"], 0, 3)[1] == block + 2 * (block // 4)
    assert tier.read_run(["b0", "b1"], 0, 2) == (2, block // 2)
    assert tier.counters.read_bytes == 2 * block + block // 2 + block // 2


def test_read_prefix_reads_what_prefix_found(make_store, chain, block):
    """read_prefix serves exactly prefix()'s run, tier by tier; start and stop bound it the same way."""
    store = make_store([("dram", 3), ("nof", 10)])
    keys = chain("k", 6)
    store.put(keys, block)
    store.tiers[1].remove("k5")  # k5 is still in dram: the run goes on through it
    store.tiers[0].remove("k4")
    store.tiers[1].remove("k4")
    assert store.prefix(keys).segments == [(1, 0, 3), (0, 3, 4)]
    assert store.prefix(keys, 1, 3).blocks == store.read_prefix(keys, 1, 3).blocks == 2
    read = store.read_prefix(keys, 0, 99)
    assert (read.blocks, read.read_bytes) == (4, [block, 3 * block])
    assert counters(store, "dram", "hits") == (1,)
    assert counters(store, "nof", "hits") == (5,)


def test_segments_name_the_highest_tier_holding_each_block(make_store, chain, block):
    """Replicated 3-tier store: top holds the last 2 blocks, middle the last 3, bottom all 5."""
    store = make_store([("gpu", 2), ("dram", 3), ("nof", 10)])
    keys = chain("k", 5)
    store.put(keys, block)
    hit = store.prefix(keys)
    assert hit.blocks == 5
    # k0,k1 only in nof (2); k2 in dram and nof -> dram (1); k3,k4 everywhere -> gpu (0)
    assert hit.segments == [(2, 0, 2), (1, 2, 3), (0, 3, 5)]
    assert store.read_prefix(keys).read_bytes == [200, 100, 200]
    assert [store.counters()[t]["hits"] for t in ("gpu", "dram", "nof")] == [2, 1, 2]


# --------------------------------------------------------------------------- put


def test_put_skips_blocks_already_present(make_store, chain, block):
    """A connector saves only what no tier holds; the return value and every counter count only those."""
    store = make_store([("dram", 10), ("nof", 10)])
    assert store.put(chain("a", 2), block) == 200
    assert store.put(chain("a", 3), block) == 100
    assert store.put(chain("a", 3), block) == 0
    assert counters(store, "dram", "puts", "put_bytes", "written_bytes", "allocated_bytes") == (3, 300, 300, 300)
    assert counters(store, "nof", "puts", "put_bytes", "written_bytes", "allocated_bytes") == (0, 0, 300, 300)


def test_put_skips_blocks_held_only_by_a_lower_tier(make_store, block):
    """Demote: a0 lives in nof only, yet it is 'present' and not put again."""
    store = make_store([("dram", 1), ("nof", 10)], placement="demote")
    store.put(["a0"], block)
    store.put(["b0"], block)  # a0 demoted to nof
    assert store.put(["a0", "b0"], block) == 0
    assert counters(store, "dram", "puts") == (2,)


def test_chain_longer_than_tier_keeps_the_tail_and_counts_the_rest_evicted(make_tier, chain, block):
    """5 blocks into a 2-block tier: k3, k4 stay; k0..k2 are written and counted evicted at once."""
    tier = make_tier("dram", 2)
    keys = chain("k", 5)
    evicted = tier.write(keys, block, is_put=True, keep_evicted=True)
    assert [e.key for e in evicted] == ["k0", "k1", "k2"]
    assert [k in tier for k in keys] == [False, False, False, True, True]
    c = tier.counters
    assert (c.puts, c.put_bytes, c.written_bytes) == (5, 500, 500)
    assert (c.evictions, c.evicted_bytes, c.allocated_bytes) == (3, 300, 200)
    # ... and that chain is useless: its head is gone
    assert TieredStore([tier]).prefix(keys).blocks == 0


def test_overrun_also_evicts_resident_blocks_oldest_first(make_tier, chain, block):
    """A 3-block write into a full 2-block tier: 1 overrun block plus both residents are evicted."""
    tier = make_tier("dram", 2)
    tier.write(["x0", "x1"], block, is_put=True)
    evicted = tier.write(chain("k", 3), block, is_put=True, keep_evicted=True)
    assert [e.key for e in evicted] == ["k0", "x0", "x1"]
    assert tier.counters.allocated_bytes == 200
    assert tier.counters.evictions == 3


# --------------------------------------------------------------------------- replicate


def test_replicate_put_lands_in_every_tier_as_one_logical_put(make_store, chain, block):
    """Every tier writes the blocks; the logical put is counted once, by the top tier (where clients address it),
    so summing kv.store.put.bytes over tiers gives what the client saved, as for a DRAM-only arm."""
    store = make_store([("dram", 2), ("nof", 10)])
    store.put(chain("a", 2), block)
    assert counters(store, "dram", "puts", "put_bytes", "written_bytes", "allocated_bytes") == (2, 200, 200, 200)
    assert counters(store, "nof", "puts", "put_bytes", "written_bytes", "allocated_bytes") == (0, 0, 200, 200)


def test_replicate_upper_eviction_leaves_lower_copy_which_serves_the_hit(make_store, chain, block):
    """dram evicts chain a; nof (which never evicts) still holds it and serves the lookup."""
    store = make_store([("dram", 2), ("nof", 10)])
    a, b = chain("a", 2), chain("b", 2)
    store.put(a, block)
    store.put(b, block)  # dram evicts a0, a1
    assert counters(store, "dram", "evictions", "evicted_bytes", "allocated_bytes") == (2, 200, 200)
    assert counters(store, "nof", "evictions", "evicted_bytes", "allocated_bytes") == (0, 0, 400)
    hit = store.prefix(a)
    assert (hit.blocks, hit.segments) == (2, [(1, 0, 2)])
    assert store.read_prefix(a).read_bytes == [0, 200]
    assert counters(store, "nof", "hits", "read_bytes") == (2, 200)
    assert counters(store, "dram", "hits", "read_bytes") == (0, 0)
    # without promote_on_hit nothing moves
    assert "a0" not in store.tiers[0]


def test_replicate_promote_on_hit_copies_up(make_store, chain, block):
    """The lower tier keeps its copy; the upper one writes it (not a put) and evicts to make room."""
    store = make_store([("dram", 2), ("nof", 10)], promote_on_hit=True)
    a, b = chain("a", 2), chain("b", 2)
    store.put(a, block)
    store.put(b, block)
    store.read_prefix(a)
    assert counters(store, "dram", "puts", "put_bytes", "written_bytes") == (4, 400, 600)
    assert counters(store, "dram", "evictions", "allocated_bytes") == (4, 200)
    assert counters(store, "nof", "hits", "written_bytes", "allocated_bytes") == (2, 400, 400)
    assert all(key in store.tiers[0] and key in store.tiers[1] for key in a)
    assert store.prefix(a).segments == [(0, 0, 2)]


def test_replicate_promote_copies_into_every_tier_above(make_store, block):
    """a lives only in nof (evicted from gpu and dram): a hit copies it into dram and gpu."""
    store = make_store([("gpu", 1), ("dram", 1), ("nof", 10)], promote_on_hit=True)
    store.put(["a"], block)
    store.put(["b"], block)  # gpu and dram evict a
    assert store.prefix(["a"]).segments == [(2, 0, 1)]
    store.read_prefix(["a"])
    assert ["a" in tier for tier in store.tiers] == [True, True, True]
    assert counters(store, "gpu", "puts", "written_bytes") == (2, 300)
    assert counters(store, "dram", "puts", "written_bytes") == (0, 300)
    assert counters(store, "nof", "puts", "written_bytes", "hits") == (0, 200, 1)


@pytest.mark.parametrize("placement", ["replicate", "demote"])
def test_promote_on_hit_does_not_evict_blocks_of_the_same_lookup(make_store, chain, block, placement):
    """dram (2 blocks) holds the tail k2,k3, nof the head: promoting k0,k1 must not break reading k2,k3.

    Regression: the read used to promote each lower segment before reading the next one; promoting k0,k1
    evicted k2,k3 from dram and the read of segment (0, 2, 4) raised KeyError.
    """
    store = make_store([("dram", 2), ("nof", 10)], placement=placement, promote_on_hit=True)
    keys = chain("k", 4)
    store.put(keys, block)
    hit = store.prefix(keys)
    assert hit.segments == [(1, 0, 2), (0, 2, 4)]
    assert store.read_prefix(keys).read_bytes == [200, 200]
    assert counters(store, "dram", "hits") == (2,)
    assert counters(store, "nof", "hits") == (2,)
    # the head moved up (copied or moved) and evicted the tail from dram
    assert [k in store.tiers[0] for k in keys] == [True, True, False, False]
    in_nof = [True, True, True, True] if placement == "replicate" else [False, False, True, True]
    assert [k in store.tiers[1] for k in keys] == in_nof


# --------------------------------------------------------------------------- demote


def test_demote_moves_evictions_one_tier_down_and_last_tier_drops_them(make_store, block):
    """Three 1-block tiers, four puts: a ends up gone, b in nof, c in dram, d in gpu.

    gpu: 4 puts, evicts a,b,c (3); dram receives a,b,c (written, not put), evicts a,b (2);
    nof receives a,b, evicts a (1) which is gone for good.
    """
    store = make_store([("gpu", 1), ("dram", 1), ("nof", 1)], placement="demote")
    for key in ("a", "b", "c", "d"):
        store.put([key], block)
    assert ["d" in t for t in store.tiers] == [True, False, False]
    assert ["c" in t for t in store.tiers] == [False, True, False]
    assert ["b" in t for t in store.tiers] == [False, False, True]
    assert "a" not in store
    names = ("puts", "put_bytes", "written_bytes", "evictions", "allocated_bytes")
    assert counters(store, "gpu", *names) == (4, 400, 400, 3, 100)
    assert counters(store, "dram", *names) == (0, 0, 300, 2, 100)
    assert counters(store, "nof", *names) == (0, 0, 200, 1, 100)


def test_demote_is_exclusive_and_long_chain_overrun_is_demoted(make_store, chain, block):
    """5 blocks into a 2-block dram: k0..k2 overrun dram and land in nof; no block is in both tiers."""
    store = make_store([("dram", 2), ("nof", 10)], placement="demote")
    keys = chain("k", 5)
    assert store.put(keys, block) == 500
    assert [k in store.tiers[0] for k in keys] == [False, False, False, True, True]
    assert [k in store.tiers[1] for k in keys] == [True, True, True, False, False]
    assert counters(store, "dram", "puts", "written_bytes", "evictions", "allocated_bytes") == (5, 500, 3, 200)
    assert counters(store, "nof", "puts", "written_bytes", "evictions", "allocated_bytes") == (0, 300, 0, 300)
    assert store.prefix(keys).segments == [(1, 0, 3), (0, 3, 5)]


def test_demote_promote_on_hit_moves_up(make_store, chain, block):
    """a (in nof) is read and moves to dram; dram's residents b0,b1 are demoted to nof in exchange."""
    store = make_store([("dram", 2), ("nof", 10)], placement="demote", promote_on_hit=True)
    a, b = chain("a", 2), chain("b", 2)
    store.put(a, block)
    store.put(b, block)  # a demoted to nof
    assert store.read_prefix(a).read_bytes == [0, 200]
    assert all(key in store.tiers[0] and key not in store.tiers[1] for key in a)
    assert all(key in store.tiers[1] and key not in store.tiers[0] for key in b)
    # dram: 4 puts + 2 promoted writes; evicted a0,a1 then b0,b1
    assert counters(store, "dram", "puts", "written_bytes", "evictions", "allocated_bytes") == (4, 600, 4, 200)
    # nof: received a (200) then b (200); a left by promotion, which is not an eviction
    assert counters(store, "nof", "puts", "written_bytes", "evictions", "hits", "allocated_bytes") == (
        0,
        400,
        0,
        2,
        200,
    )


# --------------------------------------------------------------------------- construction


def test_store_and_tier_reject_bad_configuration(make_tier):
    with pytest.raises(ValueError, match="at least one tier"):
        TieredStore([])
    with pytest.raises(ValueError, match="unique"):
        TieredStore([make_tier("dram", 1), make_tier("dram", 2)])
    with pytest.raises(ValueError, match="replicate, demote"):
        TieredStore([make_tier("dram", 1)], placement="mirror")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="capacity must be positive"):
        Tier("dram", 0, make_policy("lru"))


# --------------------------------------------------------------------------- counters over a whole run


def test_counters_over_an_overflowing_replicated_run(scenario):
    """dram (6 blocks) overflows from round 2 on; nof (100 blocks) never evicts.

    Per round: allocated never exceeds capacity, nof never evicts, and with replicate and no promotion
    every tier writes exactly the bytes put that round.
    """
    dram_cap, nof_cap = 6 * 256_000, 100 * 256_000
    arms = {
        "tiered": {
            "tiers": [
                {"name": "dram", "capacity": dram_cap, "policy": "lru"},
                {"name": "nof", "capacity": nof_cap, "policy": "lru"},
            ]
        }
    }
    rows = run_ab(scenario(arms))["arms"]["tiered"]["rounds"]
    assert sum(r["evictions"]["dram"] for r in rows) > 0
    for row in rows:
        assert row["allocated_bytes"]["dram"] <= dram_cap
        assert row["allocated_bytes"]["nof"] <= nof_cap
        assert row["evictions"]["nof"] == 0
        assert row["written_bytes"] == {"dram": row["put_bytes"], "nof": row["put_bytes"]}
    # 4 sessions x 1500 tokens in round 4 -> 4 x 5 blocks, all in nof; dram full
    assert rows[-1]["allocated_bytes"] == {"dram": dram_cap, "nof": 20 * 256_000}


def test_an_attached_tier_is_never_read_or_written_but_is_counted(make_tier, chain, block):
    """An idle NoF pool in a DRAM-only arm: exported with zero counters, never part of placement or lookups."""
    dram, nof = make_tier("dram", 2), make_tier("nof", 10)
    store = TieredStore([dram], attached=[nof])
    store.put(chain("a", 4), block)
    assert store.prefix(chain("a", 4)).blocks == 0  # the head was evicted from dram; nof does not serve it
    assert store.counters()["nof"] == {**nof.counters.as_dict(), "written_bytes": 0, "allocated_bytes": 0}
    assert store.counters()["dram"]["evictions"] == 2
