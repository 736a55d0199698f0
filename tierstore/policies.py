"""Eviction policies: the order in which a tier gives up its resident blocks.

A policy owns the tier's index (key -> block size) in eviction order, oldest first, and is told three things:
blocks were admitted, a block was read (`refresh`, called by the tier for each block of a run, head first), and
a request that used a chain finished. Admission and release take a whole chain. Reads are per block so the tier
finds a run and refreshes it in one pass, one probe per block: on CPython 3.11 that made the lookup phase 1.4-1.7x
as fast as finding the run first and refreshing it after (bench/sim.py replays real request streams). A run past
its first blocks is read by a C loop that stops where the refresh raises KeyError (Tier.read_run): for the short
runs of real traces that exception costs more than the Python loop saves, for the long chains of multi-round chats
it takes about 40% off the read.
"""

from __future__ import annotations

import heapq
import math
import random
import zlib
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from itertools import count, repeat
from typing import ClassVar

Key = Hashable


class EvictionPolicy:
    """Base policy: evicts in admission order; subclasses change what a read or a release does."""

    name: ClassVar[str]
    # The system stores a request's new blocks one at a time, each evicting what it needs (LMCache), rather than
    # making room for the whole batch first
    stores_one_at_a_time: ClassVar[bool] = False

    def __init__(self) -> None:
        self._blocks: OrderedDict[Key, int] = OrderedDict()
        # What a read does to each block it reads, head first; None: reads do not reorder (FIFO). A callable
        # per block rather than a method per run, so the tier finds a run and refreshes it in one loop.
        self.refresh: Callable[[Key], object] | None = None

    def __contains__(self, key: Key) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def index(self) -> OrderedDict[Key, int]:
        """Resident blocks, oldest first; read-only by convention (the tier uses it for fast membership)."""
        return self._blocks

    def admit(self, keys: Sequence[Key], nbytes: int) -> None:
        """Newly written blocks join as the most recent, in the order given."""
        self._blocks.update(zip(keys, repeat(nbytes)))

    def release(self, keys: Sequence[Key]) -> None:
        """The request that used these chain blocks (head first) finished. Only chain-aware policies care."""

    def pop_victim(self) -> tuple[Key, int]:
        """Remove and return the next block to evict with its size."""
        return self._blocks.popitem(last=False)

    def discard(self, key: Key) -> int:
        """Forget one block (moved to another tier); returns its size, 0 if it was not here."""
        return self._blocks.pop(key, 0)

    def keys(self) -> Iterable[Key]:
        return self._blocks.keys()


class FifoPolicy(EvictionPolicy):
    """First in, first out: the oldest written block goes first, however often it is read."""

    name = "fifo"


class LruPolicy(EvictionPolicy):
    """Least recently used: a read moves blocks to the recent end in chain order, so a chain's head, read first,
    ends up older than its tail and is evicted first. This is what makes an overfull LRU tier lose whole
    sessions: without its head a chain is useless."""

    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.refresh = self._blocks.move_to_end


class TailFirstPolicy(LruPolicy):
    """Chain-aware LRU, as vLLM's free-block queue: when a request finishes its blocks are released tail first,
    so among one request's blocks the tail is evicted before the head and a chain shrinks from its end
    instead of losing its head."""

    name = "tail_first"

    def release(self, keys: Sequence[Key]) -> None:
        blocks = self._blocks
        for key in reversed(keys):
            if key in blocks:
                blocks.move_to_end(key)


class MooncakePolicy(EvictionPolicy):
    """Mooncake's master, as mooncake-store/src/master_service.cpp has it (the store client's segment, the DRAM tier).

    - exist and get (BatchExistKey, BatchGetReplicaList) grant every object they find a read lease:
      `lease_timeout = max(lease_timeout, now + lease_ttl)` (ObjectMetadata::GrantReadLease). A batch visits its
      keys shard by shard (a key's shard is its hash modulo 1024, kNumShards), from a random shard downwards, and
      in batch order within a shard: the nanoseconds between grants order a chain's blocks at random, so an
      eviction that cuts through a chain leaves it holes, not a shorter tail (`grant_batch`, its shards and its
      starts drawn from `seed`);
    - a put of a new object ends with a lease of 0 (PutEnd: `lease_timeout = now`); a put of a present key is a no-op
      (the client's existence check skips it, and leases it);
    - nothing is evicted on the way to a put: an allocation that does not fit is refused (-200, NO_AVAILABLE_HANDLE)
      and flags the eviction thread (`need_mem_eviction_`);
    - the eviction thread (EvictionThreadFunc, every 10 ms) runs BatchEvict when the segment is above the high
      watermark or flagged: of the objects whose lease has expired it evicts the earliest lease timeouts first,
      `ceil(objects x max(eviction_ratio, used - watermark + eviction_ratio))` of them at once.

    `now` is the tier's clock, moved by its MooncakeTier (kvscope.tierstore.mooncake_tier).
    """

    name = "mooncake"

    def __init__(
        self,
        lease_ttl: float = 0.05,
        high_watermark: float = 0.9,
        eviction_ratio: float = 0.05,
        seed: int = 0,
        shards: int = 1024,  # kNumShards, master_service.h (1: a batch grants in its own order)
    ) -> None:
        super().__init__()
        self.lease_ttl, self.high_watermark, self.eviction_ratio = lease_ttl, high_watermark, eviction_ratio
        self.shards = shards
        self.now = 0.0
        self._lease: dict[Key, tuple[float, int]] = {}  # lease timeout, then the grant's order (its nanoseconds)
        self._grants = count()
        self._random = random.Random(seed)
        self._salt = self._random.getrandbits(64)  # a key's shard, as a real run's keys hash to shards at random
        self.refresh = self.grant

    def shard(self, key: Key) -> int:
        """The metadata shard of `key`, a function of the key and the seed that is the same in every process
        (Python salts the hash of bytes and str: a vLLM block hash is read as the integer it is)."""
        if isinstance(key, bytes):
            key = int.from_bytes(key[:8], "big")
        elif isinstance(key, str):
            key = zlib.crc32(key.encode())
        return hash((self._salt, key)) % self.shards

    def grant(self, key: Key) -> None:
        """A read lease for a present block (exist or get)."""
        timeout = self.now + self.lease_ttl
        if self._lease[key][0] < timeout:
            self._lease[key] = (timeout, next(self._grants))

    def grant_batch(self, keys: Sequence[Key]) -> None:
        """One batch call's leases over present `keys`, in the order the master visits them."""
        start, shards = self._random.randrange(self.shards), self.shards
        for key in sorted(keys, key=lambda key: (start - self.shard(key)) % shards):
            self.grant(key)

    def admit(self, keys: Sequence[Key], nbytes: int) -> None:
        super().admit(keys, nbytes)
        for key in keys:
            self._lease[key] = (self.now, next(self._grants))

    def lease_timeouts(self, after: float, until: float) -> list[float]:
        """The distinct lease timeouts in (after, until], earliest first: when the eviction thread finds more to
        evict."""
        return sorted({lease for lease, _ in self._lease.values() if after < lease <= until})

    def pop_victim(self) -> tuple[Key, int]:
        """The object with the earliest lease timeout (a tier overrun by one request evicts block by block)."""
        key = min(self._lease, key=self._lease.__getitem__)
        del self._lease[key]
        return key, self._blocks.pop(key)

    def discard(self, key: Key) -> int:
        self._lease.pop(key, None)
        return super().discard(key)

    def batch_victims(self, used_ratio: float, flagged: bool) -> list[Key]:
        """What one BatchEvict removes now (nothing below the watermark unless an allocation failed), oldest
        lease first; the caller drops them."""
        if not self._blocks or (used_ratio <= self.high_watermark and not flagged):
            return []
        target = max(self.eviction_ratio, used_ratio - self.high_watermark + self.eviction_ratio)
        wanted = math.ceil(len(self._blocks) * target)
        now = self.now
        expired = [(lease, key) for key, lease in self._lease.items() if lease[0] <= now]
        return [key for _, key in heapq.nsmallest(wanted, expired, key=lambda item: item[0])]


class LmcachePolicy(EvictionPolicy):
    """LMCache's CPU backend under vLLM's connector, as lmcache/v1/storage_backend/local_cpu_backend.py,
    cache_policy/lru.py and lmcache/v1/cache_engine.py have it (the store's chunks are its blocks):

    - lookup (`contains(key, pin=True)` chunk by chunk from the head, up to the first missing one): every chunk found
      is pinned and noted (`keys_in_request`); when the lookup ends they are touched in reverse (`touch_cache`, the
      LRU's `move_to_end`), so a looked-up chain becomes the most recent with its head newest;
    - retrieve (`batched_get_non_blocking`) reorders nothing;
    - store: a present chunk is skipped (`contains` without a pin: no touch), a new one is allocated chunk by chunk,
      each evicting as needed the least recent chunk that can be evicted (`get_evict_candidates` skips pinned
      ones), and enters as the most recent;
    - the pins go when the request's save is done (`lookup_unpin`): a request never evicts the chunks it found.

    What it leaves out: a store that finds every chunk pinned would fail its allocation and keep the rest of the
    chain unstored; here the oldest pinned chunk goes (only a tier smaller than one request's prefix gets there).
    """

    name = "lmcache"
    stores_one_at_a_time = True

    def __init__(self) -> None:
        super().__init__()
        self._looked_up: list[Key] = []  # keys_in_request: found by the lookup in progress, head first
        self._pinned: set[Key] = set()
        self.refresh = self._found

    def _found(self, key: Key) -> None:
        self._looked_up.append(key)
        self._pinned.add(key)

    def _end_lookup(self) -> None:
        """touch_cache: the chunks the lookup found, tail first, to the recent end."""
        if self._looked_up:
            blocks = self._blocks
            for key in reversed(self._looked_up):
                if key in blocks:
                    blocks.move_to_end(key)
            self._looked_up.clear()

    def admit(self, keys: Sequence[Key], nbytes: int) -> None:
        self._end_lookup()
        super().admit(keys, nbytes)

    def pop_victim(self) -> tuple[Key, int]:
        """The least recent chunk not pinned (pinned chunks sit at the recent end, so the scan is short)."""
        self._end_lookup()
        blocks, pinned = self._blocks, self._pinned
        for key in blocks:
            if key not in pinned:
                return key, blocks.pop(key)
        return blocks.popitem(last=False)

    def release(self, keys: Sequence[Key]) -> None:
        self._end_lookup()
        self._pinned.difference_update(keys)

    def keys(self) -> Iterable[Key]:
        self._end_lookup()
        return super().keys()


POLICIES: dict[str, type[EvictionPolicy]] = {
    policy.name: policy for policy in (LruPolicy, FifoPolicy, TailFirstPolicy, MooncakePolicy, LmcachePolicy)
}


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy by name, with an error that lists the known ones."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}: expected one of {', '.join(POLICIES)}") from None
