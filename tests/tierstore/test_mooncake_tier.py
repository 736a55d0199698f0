"""The embedded model of a Mooncake segment, worked by hand: what exist, get, put and the eviction thread do, in
which order, on the tier's clock of the requests (the real store is held against it in tests/test_mooncake_model.py).

The segment holds 10 blocks of 100 B; requests are 0.1 s apart on the clock (the helper moves it: `at`).
"""

from __future__ import annotations

import datetime
import math
import random
from pathlib import Path

import pytest

from kvscope.tierstore.mooncake import EvictionLog
from kvscope.tierstore.mooncake_tier import MooncakeTier
from kvscope.tierstore.policies import LruPolicy, MooncakePolicy
from kvscope.tierstore.store import TieredStore
from kvscope.tierstore.tier import Tier

BLOCK = 100


def segment(ttl: float = 0.05, watermark: float = 0.9, ratio: float = 0.05, retries: bool = True) -> MooncakeTier:
    return MooncakeTier("dram", 10 * BLOCK, MooncakePolicy(ttl, watermark, ratio, shards=1), retries)


def keys(prefix: str, count: int) -> list[str]:
    return [f"{prefix}{index}" for index in range(count)]


def held(tier: Tier) -> list[str]:
    return sorted(map(str, tier.policy.keys()))


def request(tier: MooncakeTier, at: float, reads: list[str] = (), puts: list[str] = ()) -> list[str]:
    """One request as kvscope's client makes it, `at` seconds: the clock moves, exist over the reads, exist then
    put; the keys evicted on the way."""
    evicted = [block.key for block in tier.at(at, keep_evicted=True)]
    tier.probe(reads)
    tier.probe(puts)
    missing = [key for key in puts if key not in tier]
    if missing:
        evicted += [block.key for block in tier.write(missing, BLOCK, is_put=True, keep_evicted=True)]
    return evicted


def test_nothing_is_evicted_at_the_watermark_and_above_it_a_batch_goes_oldest_first():
    tier = segment()
    assert request(tier, 0.0, puts=keys("a", 9)) == []  # 0.9 of the segment: not above the watermark
    # 1.0 > 0.9: one batch of ceil(10 x max(0.05, 1.0 - 0.9 + 0.05)) = 2 objects, the earliest lease timeouts
    assert request(tier, 0.1, puts=["b0"]) == ["a0", "a1"]
    assert tier.counters.allocated_bytes == 8 * BLOCK and tier.counters.evictions == 2


def test_the_pass_a_put_sets_off_neither_counts_nor_takes_the_blocks_it_is_writing():
    """The master's eviction base counts objects whose put completed: the pass that b's allocation wakes finds b
    being written, so it takes ceil(5 x 0.15) = 1 of a, not ceil(10 x 0.15) = 2; then the segment is back at the
    watermark and the next pass (b written) has nothing to do."""
    tier = segment()
    request(tier, 0.0, puts=keys("a", 5))
    assert request(tier, 0.1, puts=keys("b", 5)) == ["a0"]
    assert held(tier) == keys("a", 5)[1:] + keys("b", 5)


def test_a_chain_looked_up_keeps_its_lease_and_the_blocks_put_since_go_first():
    """A lease longer than the requests' spacing (the plateau): the chain read last stays, newer puts go."""
    tier = segment(ttl=1.0)
    request(tier, 0.0, puts=keys("a", 5))  # t=0
    request(tier, 0.1, puts=keys("b", 4))  # t=0.1
    # t=0.2: a read leases a0..a4 until 1.2; the put of c0 fills the segment; b0, b1 (lease 0.1) are the oldest
    assert request(tier, 0.2, reads=keys("a", 5), puts=["c0"]) == ["b0", "b1"]


def test_a_leased_block_is_never_evicted_however_large_the_batch():
    tier = segment(ttl=1.0, ratio=0.5)
    request(tier, 0.0, puts=keys("a", 9))
    # t=0.1: a is leased until 1.1; the batch would take ceil(10 x 0.6) = 6 objects, but only b0's lease has expired
    assert request(tier, 0.1, reads=keys("a", 9), puts=["b0"]) == ["b0"]
    assert held(tier) == keys("a", 9)


def test_a_lease_that_ran_out_no_longer_protects():
    tier = segment(ttl=0.15)
    request(tier, 0.0, puts=keys("a", 5))  # t=0
    request(tier, 0.1, reads=keys("a", 5), puts=keys("b", 4))  # t=0.1: a leased until 0.25
    assert request(tier, 0.2, puts=["c0"]) == ["b0", "b1"]  # t=0.2: a is leased, b (0.1) is the oldest
    assert request(tier, 0.3, puts=["d0", "d1"]) == ["b2", "b3"]  # t=0.3: a's lease ran out, but at 0.25
    assert request(tier, 0.4, puts=["e0", "e1"]) == ["c0", "a0"]  # t=0.4: c0 (0.2), then a's head (0.25)


def test_one_lookup_grants_its_keys_in_order_so_the_first_read_is_evicted_first():
    """Mooncake takes `now` per key: a chain's head, looked up first, is a little older than its tail."""
    tier = segment()
    request(tier, 0.0, puts=keys("a", 9))  # t=0
    request(tier, 0.1, reads=keys("a", 9)[::-1])  # t=0.1: leased until 0.15, a8 first
    assert request(tier, 0.2, puts=["b0"]) == ["a8", "a7"]  # t=0.2: every lease ran out; the earliest grants go


def test_a_put_that_does_not_fit_is_refused_and_a_client_that_does_not_retry_loses_it():
    tier = segment(watermark=1.0, retries=False)  # no eviction before the segment is full
    request(tier, 0.0, puts=keys("a", 9))
    evicted = request(tier, 0.1, puts=keys("b", 3))  # b0 fits, b1 and b2 are refused (-200)
    assert "b0" in tier and "b1" not in tier and "b2" not in tier and tier.refused == 2
    # the failed allocation flagged the eviction thread: it evicts though the segment is not above the watermark
    assert evicted == ["a0"]


def test_a_retrying_client_gets_its_blocks_in_once_the_thread_has_evicted():
    tier = segment(watermark=1.0, retries=True)
    request(tier, 0.0, puts=keys("a", 10))
    assert request(tier, 0.1, puts=keys("b", 2)) == ["a0", "a1"]  # one object a pass, each pass making room for one
    assert "b0" in tier and "b1" in tier and tier.refused == 0


def test_a_put_of_a_present_block_leases_it_instead_of_writing_it():
    tier = segment(ttl=1.0)
    request(tier, 0.0, puts=keys("a", 5))
    request(tier, 0.1, puts=keys("b", 4))
    request(tier, 0.2, puts=["a0", "a1", "a2", "a3", "a4"])  # present: only leased (until 1.2), nothing written
    assert tier.counters.puts == 9
    assert request(tier, 0.3, puts=["c0"]) == ["b0", "b1"]


@pytest.mark.parametrize("placement", ["demote", "replicate"])
def test_in_a_tiered_store_what_the_segment_evicts_is_offloaded_when_demoting(placement):
    ssd = Tier("ssd", 100 * BLOCK, LruPolicy())
    store = TieredStore([segment(), ssd], placement)
    for number, session in enumerate("abcd"):
        store.at(0.1 * number)
        store.read_prefix(keys(session, 3))
        store.put(keys(session, 3), BLOCK)
    assert store.tiers[0].counters.evictions > 0
    evicted = [key for key in keys("a", 3) if key not in store.tiers[0]]
    assert evicted and all(key in ssd for key in evicted)
    assert store.read_prefix(keys("a", 3)).blocks == 3  # the chain is whole across the two tiers


def test_a_flagged_thread_evicts_each_lease_as_it_runs_out_not_one_batch_when_the_clock_next_moves():
    """A full segment whose every block is leased refuses a put and flags the eviction thread, which can evict
    nothing yet. It wakes every 10 ms: the first lease to run out (a0's, at 1.0) goes at once, a batch of one, and
    the flag with it; a single pass at 1.5 would have found three run out and taken a batch of three."""
    tier = segment(ttl=1.0, watermark=1.0, ratio=0.3, retries=False)
    request(tier, 0.0, puts=keys("a", 10))
    for index, key in enumerate(keys("a", 10)):
        tier.at(0.01 * index)
        tier.probe([key])  # a_i leased until 1.0 + 0.01 i
    assert request(tier, 0.2, puts=["b0"]) == [] and tier.refused == 1
    assert [block.key for block in tier.at(1.5, keep_evicted=True)] == ["a0"]
    assert tier.counters.allocated_bytes == 9 * BLOCK


@pytest.mark.parametrize(("a_saved_at", "evicted"), [(0.3, ["b0", "b1", "b2"]), (0.05, ["a0", "a1", "a2"])])
def test_a_chain_saved_later_outlives_the_eviction_that_a_chain_saved_earlier_does_not(a_saved_at, evicted):
    """vLLM's connector leases a request's whole chain when its prefill is done. b's save was at 0.15: a chain whose
    save came later (a slower prefill) is kept when the segment overflows at 1.2 and b goes; one saved earlier goes
    first."""
    tier = segment(ttl=1.0, ratio=0.2)
    tier.write(keys("a", 4), BLOCK, is_put=True)
    tier.write(keys("b", 4), BLOCK, is_put=True)
    for at, chain in sorted([(0.15, "b"), (a_saved_at, "a")]):
        tier.at(at)
        tier.probe(keys(chain, 4))
    tier.at(1.2)
    # 10 blocks, above the watermark: a batch of ceil(10 x 0.3) = 3, the earliest lease timeouts
    assert [block.key for block in tier.write(keys("c", 2), BLOCK, is_put=True, keep_evicted=True)] == evicted


def test_a_batch_leases_shard_by_shard_from_a_random_start_so_a_chain_is_leased_out_of_order():
    """BatchExistKey visits the shards downwards from a random one, a shard's keys in batch order: the grants'
    order (which the eviction thread reads as the order of lease timeouts) is the chain's order only by chance."""
    chain = list(range(12))
    policy = MooncakePolicy(lease_ttl=1.0, eviction_ratio=1.0, shards=4, seed=7)
    policy.admit(chain, BLOCK)
    allowed = [sorted(chain, key=lambda key, start=start: ((start - policy.shard(key)) % 4, key)) for start in range(4)]
    seen = set()
    for batch in range(1, 30):
        policy.now = 10.0 * batch
        policy.grant_batch(chain)
        policy.now += 5.0  # every lease has run out: the thread's victims are the chain in the order of its grants
        order = [key for key, _ in policy.pop_batch(used_ratio=1.0, flagged=True)]
        assert order in allowed
        policy.admit(chain, BLOCK)
        seen.add(tuple(order))
    assert len(seen) > 1 and len({policy.shard(key) for key in chain}) > 1
    one_shard = MooncakePolicy(lease_ttl=1.0, eviction_ratio=1.0, shards=1)
    one_shard.admit(chain, BLOCK)
    one_shard.grant_batch(chain[::-1])
    one_shard.now = 5.0
    assert one_shard.pop_batch(used_ratio=1.0, flagged=True) == [(key, BLOCK) for key in chain[::-1]]


@pytest.mark.parametrize("seed", range(5))
def test_the_eviction_order_is_every_run_out_lease_earliest_first_whatever_the_mix_of_puts_and_lookups(seed):
    """The policy keeps its blocks in two orders (puts, lookups) and merges them; held against a plain table of
    leases kept by Mooncake's rules over random puts, lookups, discards and clock steps: every batch evicts the
    earliest (timeout, grant) leases that have run out, an overrun the earliest of all, and the lease timeouts ahead
    are the table's."""
    rng = random.Random(seed)
    policy = MooncakePolicy(lease_ttl=rng.choice([0.05, 0.3, 1.0]), eviction_ratio=0.2, shards=8, seed=seed)
    table: dict[int, tuple[float, int]] = {}  # key -> (lease timeout, grant number), by the rules
    grants = iter(range(10**9))
    next_key = 0
    for _ in range(300):
        step = rng.random()
        if step < 0.3:
            keys = list(range(next_key, next_key + rng.randint(1, 6)))
            next_key += len(keys)
            policy.admit(keys, BLOCK)
            table.update((key, (policy.now, next(grants))) for key in keys)
        elif step < 0.6 and table:
            keys = rng.sample(sorted(table), min(len(table), rng.randint(1, 8)))
            policy.grant(keys)
            for key in keys:
                if table[key][0] < policy.now + policy.lease_ttl:
                    table[key] = (policy.now + policy.lease_ttl, next(grants))
        elif step < 0.7 and table:
            key = rng.choice(sorted(table))
            assert policy.discard(key) == BLOCK
            del table[key]
        elif step < 0.85:
            ahead = policy.now + rng.choice([0.01, 0.1, 0.5])
            assert policy.lease_timeouts(ahead) == sorted(
                {lease for lease, _ in table.values() if policy.now < lease <= ahead}
            )
            policy.now = ahead
        elif step < 0.9:  # an overrun evicts block by block, leased or not: the earliest leases
            expected = sorted((lease, key) for key, lease in table.items())[:3]
            assert policy.pop_victims(3) == [(key, BLOCK) for _, key in expected]
            for _, key in expected:
                del table[key]
        else:
            wanted = math.ceil(len(table) * 0.2)  # flagged below the watermark: the eviction ratio
            expected = sorted((lease, key) for key, lease in table.items() if lease[0] <= policy.now)[:wanted]
            assert policy.pop_batch(used_ratio=0.5, flagged=True) == [(key, BLOCK) for _, key in expected]
            for _, key in expected:
                del table[key]
    assert sorted(policy.keys()) == sorted(table)


def test_while_the_real_masters_pass_runs_slow_no_other_starts_and_puts_find_no_room():
    """A mirror follows the real master's slow passes: one from 0.1 to 0.5 s. The put at 0.1 fills the segment;
    its pass waits for the slow one, so the put at 0.3 finds no room (refused: vLLM's connector does not retry);
    at 0.5 the pass runs, on what was run out by then."""
    tier = segment(retries=False)
    tier.follow_eviction_passes([(0.1, 0.5)])
    request(tier, 0.0, puts=keys("a", 9))
    assert request(tier, 0.1, puts=["b0"]) == []
    assert request(tier, 0.3, puts=["c0"]) == [] and tier.refused == 1
    assert request(tier, 0.6) == ["a0", "a1"]
    assert tier.mooncake.now == pytest.approx(0.6)


def test_a_slow_pass_takes_what_had_run_out_when_it_began():
    """The slow pass from 0.1 to 0.5 s judges leases as of 0.1: a's leases (until 0.35) ran out while it ran, but
    only b0's had run out when it began."""
    tier = segment(ttl=0.3, retries=False)
    tier.follow_eviction_passes([(0.1, 0.5)])
    request(tier, 0.0, puts=keys("a", 9))
    request(tier, 0.05, reads=keys("a", 9))
    assert request(tier, 0.1, puts=["b0"]) == []
    assert request(tier, 0.6) == ["b0"]


def test_a_pass_that_began_late_spares_what_was_leased_before_it_began():
    """The real master's pass set off by b0's put at 0.1 s began at 0.25 (a busy machine) and ended at 0.5: the
    model's pass stands for it, with the segment as the put left it (2 of the 9 completed objects). a0 and a1,
    looked up at 0.2, were leased again by then: a2 and a3 go."""
    tier = segment(ttl=0.3, retries=False)
    tier.follow_eviction_passes([(0.25, 0.5)])
    request(tier, 0.0, puts=keys("a", 9))
    assert request(tier, 0.1, puts=["b0"]) == []
    assert request(tier, 0.2, reads=["a0", "a1"]) == []
    assert request(tier, 0.6) == ["a2", "a3"]


def test_the_real_masters_eviction_passes_from_its_log():
    """The captured log of a master on a busy machine (tests/fixtures/mooncake/PROVENANCE.md): 20 passes, as many
    evicted as the [EVICT-RESULT] lines say, one of them 5 s long."""
    lines = (Path(__file__).parents[1] / "fixtures" / "mooncake" / "master_eviction_log.txt").read_text().splitlines()
    log = EvictionLog(started=datetime.datetime(2026, 12, 5, 2, 0))
    half = next(number for number, line in enumerate(lines) if "[EVICT-TRIGGER]" in line) + 1  # a pass under way
    passes = log.read(lines[:half]) + log.read(lines[half:])  # read as the log grows
    assert len(passes) == 20 and all(p.ended >= p.began for p in passes)
    assert passes[0].evicted == 7 and sum(p.evicted for p in passes) == 213
    slowest = max(passes, key=lambda p: p.ended - p.began)
    assert slowest.ended - slowest.began == pytest.approx(5.006, abs=0.001)
    began = datetime.datetime.fromtimestamp(slowest.began)
    assert (began.month, began.day, began.hour, began.minute, began.second) == (12, 5, 2, 13, 1)


def test_an_eviction_pass_across_new_years_eve_takes_its_year_from_the_masters_start():
    """glog names no year: a master started on 31 December logs January's lines in the next year."""
    log = EvictionLog(started=datetime.datetime(2026, 12, 31, 23, 50))
    lines = [
        "I1231 23:59:59.900000 12 master_service.cpp:100] [EVICT-TRIGGER] used_ratio=0.95",
        "I0101 00:00:00.050000 12 master_service.cpp:101] [EVICT-RESULT] evicted_count=3",
        "I0101 00:00:00.100000 12 master_service.cpp:102] [EVICT-DONE]",
    ]
    [evicted] = log.read(lines)
    assert evicted.ended - evicted.began == pytest.approx(0.2) and evicted.evicted == 3
    assert datetime.datetime.fromtimestamp(evicted.ended).year == 2027
