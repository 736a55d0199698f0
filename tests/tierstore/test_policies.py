"""Eviction order of each policy, checked block by block with pop_victim()."""

from __future__ import annotations

import random

import pytest

from kvscope.tierstore.policies import POLICIES, EvictionPolicy, FifoPolicy, LruPolicy, TailFirstPolicy, make_policy
from kvscope.tierstore.store import TieredStore
from kvscope.tierstore.tier import Tier


def read(policy: EvictionPolicy, keys: list[str]) -> None:
    """What a tier's read does to the policy: refresh each block read, head first (nothing for FIFO), then tell it
    of the whole run."""
    if policy.refresh is not None:
        for key in keys:
            policy.refresh(key)
    if policy.served is not None:
        policy.served(keys, 0, len(keys))


def test_all_policies_evict_in_admission_order_without_reads(drain):
    """Catches a policy that reorders blocks on admit (e.g. admits a chain tail first)."""
    for name in POLICIES:
        policy = make_policy(name)
        policy.admit(["a0", "a1", "a2"], 10)
        policy.admit(["b0"], 20)
        assert drain(policy) == ["a0", "a1", "a2", "b0"], name


def test_lru_read_refreshes_in_chain_order_head_older_than_tail(drain):
    """A read moves the chain to the recent end head first, so the head stays the older of the two."""
    policy = LruPolicy()
    policy.admit(["a0", "a1", "a2"], 10)
    policy.admit(["b0", "b1"], 10)
    read(policy, ["a0", "a1"])  # a2 was not read: it keeps its age
    assert drain(policy) == ["a2", "b0", "b1", "a0", "a1"]


def test_lru_read_of_reversed_chain_would_differ(drain):
    """Pins down head-first semantics: reading [a0, a1] and [a1, a0] must give opposite orders."""
    forward, backward = LruPolicy(), LruPolicy()
    for policy in (forward, backward):
        policy.admit(["a0", "a1"], 10)
    read(forward, ["a0", "a1"])
    read(backward, ["a1", "a0"])
    assert drain(forward) == ["a0", "a1"]
    assert drain(backward) == ["a1", "a0"]


def test_lru_ignores_release(drain):
    """Only tail_first reorders on release; plain LRU keeps read order."""
    policy = LruPolicy()
    policy.admit(["a0", "a1", "a2"], 10)
    policy.release(["a0", "a1", "a2"])
    assert drain(policy) == ["a0", "a1", "a2"]


def test_fifo_reads_do_not_refresh(drain):
    """FIFO evicts the first written block however often it is read (and ignores release)."""
    policy = FifoPolicy()
    policy.admit(["a0", "a1"], 10)
    policy.admit(["b0"], 10)
    read(policy, ["a0", "a1"])
    read(policy, ["a0"])
    policy.release(["a0", "a1"])
    assert drain(policy) == ["a0", "a1", "b0"]


def test_tail_first_release_puts_tail_before_head(drain):
    """After release the chain's tail is the next victim and its head the last of that chain."""
    policy = TailFirstPolicy()
    policy.admit(["a0", "a1", "a2"], 10)
    policy.release(["a0", "a1", "a2"])
    assert drain(policy) == ["a2", "a1", "a0"]


def test_tail_first_is_lru_by_release_time_across_requests(drain):
    """Request A released before B: all of A goes before any of B; re-releasing A makes B the older."""
    policy = TailFirstPolicy()
    policy.admit(["a0", "a1"], 10)
    policy.release(["a0", "a1"])
    policy.admit(["b0", "b1"], 10)
    policy.release(["b0", "b1"])
    read(policy, ["a0", "a1"])  # A is read again (LRU refresh) ...
    policy.release(["a0", "a1"])  # ... and released again
    assert drain(policy) == ["b1", "b0", "a1", "a0"]


def test_tail_first_release_skips_blocks_it_does_not_hold(drain):
    """A released chain may have blocks this tier never held (or already evicted): no KeyError, others move."""
    policy = TailFirstPolicy()
    policy.admit(["a1", "a2"], 10)
    policy.admit(["b0"], 10)
    policy.release(["a0", "a1", "a2"])  # a0 is not here
    assert drain(policy) == ["b0", "a2", "a1"]


def test_pop_victim_returns_block_size_and_discard():
    """Sizes travel with blocks: pop_victim returns it, discard returns it (0 when absent)."""
    policy = LruPolicy()
    policy.admit(["a0"], 10)
    policy.admit(["b0"], 25)
    assert "b0" in policy and len(policy) == 2
    assert policy.discard("b0") == 25
    assert policy.discard("b0") == 0
    assert policy.pop_victim() == ("a0", 10)
    assert len(policy) == 0


def test_make_policy_returns_fresh_instances():
    """Two tiers must not share one index."""
    first, second = make_policy("lru"), make_policy("lru")
    first.admit(["x"], 1)
    assert "x" not in second
    assert type(make_policy("fifo")) is FifoPolicy
    assert type(make_policy("tail_first")) is TailFirstPolicy


def test_make_policy_error_lists_known_names():
    """A typo must say what the valid names are."""
    with pytest.raises(ValueError, match=r"unknown eviction policy 'lfu'") as caught:
        make_policy("lfu")
    assert "lru, fifo, tail_first" in str(caught.value)


def lmcache_request(tier: Tier, keys: list[str]) -> int:
    """One request as vLLM's LMCache connector makes it: lookup (and retrieve) of the prefix, store of the chunks
    not found, then the pins go. Returns the chunks found."""
    found, _ = tier.read_run(keys, 0, len(keys))
    tier.write(list(tier.missing(keys)), 10, is_put=True)
    tier.release(keys)
    return found


def test_lmcache_lookup_touches_the_chain_tail_first_so_an_eviction_through_it_keeps_its_head():
    """touch_cache moves the chunks a lookup found to the recent end in reverse: the head is newest. An eviction
    that reaches the chain takes its tail, and the next lookup still finds the head (under lru it finds nothing)."""
    found = {}
    for name in ("lmcache", "lru"):
        tier = Tier("cpu", 40, make_policy(name))
        lmcache_request(tier, ["a0", "a1"])
        lmcache_request(tier, ["b0", "b1"])
        assert lmcache_request(tier, ["a0", "a1", "a2"]) == 2  # evicts b0
        assert lmcache_request(tier, ["c0", "c1"]) == 0  # evicts b1, then a's oldest chunk
        found[name] = (sorted(map(str, tier.policy.keys())), lmcache_request(tier, ["a0", "a1", "a2", "a3"]))
    assert found["lmcache"][0] == ["a0", "a2", "c0", "c1"] and found["lmcache"][1] == 1
    assert found["lru"][0] == ["a1", "a2", "c0", "c1"] and found["lru"][1] == 0


def test_lmcache_store_skips_present_chunks_without_touching_them(drain):
    """The store path's existence check (contains without a pin) leaves a present chunk's age as it was: a store
    of [a0, a1] with a0 present writes a1 alone, and a0 stays older than b0."""
    policy = make_policy("lmcache")
    store = TieredStore([Tier("cpu", 100, policy)], "replicate")
    store.put(["a0"], 10)
    store.put(["b0"], 10)
    assert store.put(["a0", "a1"], 10) == 10
    assert drain(policy) == ["a0", "b0", "a1"]


def test_lmcache_stores_chunk_by_chunk_and_never_evicts_what_its_request_found():
    """Each new chunk evicts the least recent unpinned chunk as it is allocated: the request's found head is
    pinned, so once the other chains are gone its own new chunks go (lru, making room for the batch first, evicts
    the head)."""
    kept = {}
    for name in ("lmcache", "lru"):
        tier = Tier("cpu", 30, make_policy(name))
        lmcache_request(tier, ["a0"])
        lmcache_request(tier, ["b0", "b1"])
        assert lmcache_request(tier, ["a0", "a1", "a2", "a3"]) == 1
        kept[name] = sorted(map(str, tier.policy.keys()))
    assert kept == {"lmcache": ["a0", "a2", "a3"], "lru": ["a1", "a2", "a3"]}


@pytest.mark.parametrize("seed", range(6))
def test_lmcache_batch_write_evicts_what_chunk_by_chunk_writes_do(seed, drain):
    """A batch whose victims are all unpinned chunks already there is written at once; one that would reach a
    pinned or a new chunk goes chunk by chunk: random chats on a small tier end with the same chunks, in the same
    order, and the same counters as writing every chunk alone."""
    rng = random.Random(seed)
    batched, alone = Tier("cpu", 24 * 10, make_policy("lmcache")), Tier("cpu", 24 * 10, make_policy("lmcache"))
    chains = {name: [f"{name}{index}" for index in range(rng.randint(3, 30))] for name in "abcdefgh"}
    for _ in range(60):
        keys = chains[rng.choice("abcdefgh")][: rng.randint(1, 30)]
        assert batched.read_run(keys, 0, len(keys)) == alone.read_run(keys, 0, len(keys))
        missing = list(batched.missing(keys))
        assert missing == list(alone.missing(keys))
        batched.write(missing, 10, is_put=True)
        for key in missing:
            alone.write([key], 10, is_put=True)
        batched.release(keys)
        alone.release(keys)
    assert batched.counters == alone.counters and batched.counters.evictions > 100
    assert drain(batched.policy) == drain(alone.policy)


@pytest.mark.parametrize("seed", range(6))
def test_lmcache_says_its_oldest_chunks_go_first_only_when_none_of_them_is_pinned(seed):
    """oldest_go_first answers without a look while the oldest chunks come before all that moved since no chunk
    was pinned; held against the pins themselves over random lookups, stores and releases, some requests never
    releasing theirs (then the pins pile up and the answer must still be exact)."""
    rng = random.Random(seed)
    policy = make_policy("lmcache")
    pinned: set[str] = set()
    fresh = iter(range(10**9))
    policy.admit([f"k{next(fresh)}" for _ in range(40)], 10)
    yes = 0
    for _ in range(400):
        present = list(policy.keys())
        step = rng.random()
        if step < 0.35:  # a lookup finds a run of present chunks
            run = rng.sample(present, min(len(present), rng.randint(1, 6)))
            policy.served(run, 0, len(run))
            pinned.update(run)
        elif step < 0.7:  # a store of new chunks, after the oldest victims went
            policy.pop_victims(rng.randint(0, 5))
            policy.admit([f"k{next(fresh)}" for _ in range(rng.randint(1, 6))], 10)
        elif step < 0.85 and rng.random() < 0.7:  # the request ends (some never release)
            policy.release(list(pinned))
            pinned.clear()
        count = rng.randint(1, len(policy) or 1)
        exact = pinned.isdisjoint(list(policy.keys())[:count])
        answer = policy.oldest_go_first(count)
        assert answer == exact, (count, sorted(pinned))
        yes += answer
    assert 0 < yes < 400


@pytest.mark.parametrize("found", [4, 40])  # a short lookup's touch, and a long one's (a C loop until the gap)
def test_lmcache_touch_skips_a_chunk_that_left_since_its_lookup(drain, found):
    """A chunk found by the lookup can move to another tier before the touch: the touch moves the others, tail
    first, around it."""
    chain = [f"a{index}" for index in range(found)]
    gone = chain[found // 2]
    policy = make_policy("lmcache")
    policy.admit([*chain, "b0"], 10)
    policy.served(chain, 0, found)
    assert policy.discard(gone) == 10
    policy.admit(["c0"], 10)  # the touch: the chain but `gone`, tail first, to the recent end; then c0
    policy.release(chain)
    assert drain(policy) == ["b0", *[key for key in reversed(chain) if key != gone], "c0"]
