"""Eviction order of each policy, checked block by block with pop_victim()."""

from __future__ import annotations

import pytest

from kvscope.tierstore.policies import POLICIES, EvictionPolicy, FifoPolicy, LruPolicy, TailFirstPolicy, make_policy


def read(policy: EvictionPolicy, keys: list[str]) -> None:
    """What a tier's read does to the policy: refresh each block read, head first (nothing for FIFO)."""
    if policy.refresh is not None:
        for key in keys:
            policy.refresh(key)


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
