"""Eviction policies: the order in which a tier gives up its resident blocks.

A policy owns the tier's index (key -> block size) in eviction order, oldest first, and is told three things:
blocks were admitted, a block was read (`refresh`, called by the tier for each block of a run, head first, or
`served`, once with a whole run), and a request that used a chain finished. Admission and release take a whole
chain. Reads are per block so the tier finds a run and refreshes it in one pass, one probe per block: on CPython
3.11 that made the lookup phase 1.4-1.7x as fast as finding the run first and refreshing it after (bench/sim.py
replays real request streams). A run past its first blocks is read by a C loop that stops where the refresh raises
KeyError (Tier.read_run): for the short runs of real traces that exception costs more than the Python loop saves,
for the long chains of multi-round chats it takes about 40% off the read.
"""

from __future__ import annotations

import math
import random
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Sequence
from contextlib import suppress
from itertools import compress, filterfalse, islice, repeat
from operator import mod, sub
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
        # per block rather than a method per run, so the tier finds a run and refreshes it in one loop. It must
        # raise KeyError on a block the tier lacks (as the index's own lookup, used without one): a long run is
        # read by a C loop that stops there (Tier.read_run).
        self.refresh: Callable[[Key], object] | None = None
        # What a read does to a whole run once the tier served it, keys[start:end] (LMCache pins it); None: nothing
        self.served: Callable[[Sequence[Key], int, int], object] | None = None

    def __contains__(self, key: Key) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def index(self) -> OrderedDict[Key, int]:
        """Resident blocks, oldest first; read-only by convention (the tier uses it for fast membership)."""
        return self._blocks

    def admit(self, keys: Sequence[Key], nbytes: int) -> None:
        """Newly written blocks join as the most recent, in the order given. (A loop of stores: an OrderedDict
        takes them faster one by one than through update(), which pays a method call per block.)"""
        blocks = self._blocks
        for key in keys:
            blocks[key] = nbytes

    def release(self, keys: Sequence[Key]) -> None:
        """The request that used these chain blocks (head first) finished. Only chain-aware policies care."""

    def pop_victim(self) -> tuple[Key, int]:
        """Remove and return the next block to evict with its size."""
        return self._blocks.popitem(last=False)

    def pop_victims(self, count: int) -> list[tuple[Key, int]]:
        """The next `count` victims with their sizes (fewer if the index runs out), removed: what `count` calls of
        pop_victim give, in one call a policy may make cheaper."""
        return [self.pop_victim() for _ in repeat(None, min(count, len(self._blocks)))]

    def oldest_go_first(self, count: int) -> bool:
        """Whether the next `count` victims are the index's `count` oldest blocks, so that the tier may pop them
        itself, in a tight loop; a policy that orders its victims otherwise says no."""
        return True

    def evictable(self) -> int:
        """How many resident blocks are victims before any block admitted from now on (all of them, but for
        blocks the policy protects, as LMCache's pinned chunks)."""
        return len(self._blocks)

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
      `ceil(objects x max(eviction_ratio, used - watermark + eviction_ratio))` of them at once, where `objects` (the
      master's eviction base) counts only objects whose put has completed. The pass a put's allocation sets off
      finds that put's blocks still being written (`writing`): their memory counts in `used`, they are neither
      counted nor evicted. (The master's log shows it: `[EVICT-RESULT] ... eviction_base=109` while the segment
      holds 118 objects, 9 of them the put that crossed the watermark; counting them evicts a block more in many
      passes, and a chain's holes come sooner.)

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
        self._shard_bits = shards.bit_length()
        self._int_keys = True  # every key admitted so far is an int (hashed as it is, by C loops)
        self._now = 0.0
        # The index keeps the blocks whose lease has run out in the eviction thread's order, the order of their
        # timeouts: a put's lease is its own time, so a put joins the end at once; a lookup moves what it leases to
        # the end, where the eviction's scan from the head comes to it last, and again when the clock passes its
        # timeout, behind what ran out meanwhile. One dict carries the order and the blocks (a block cycled in and out
        # of the segment costs four dict operations, not the six of a separate order). Each block's lease timeout,
        # and the blocks leased now, by timeout (each a batch in grant order, earliest first):
        self._lease: dict[Key, float] = {}
        self._leased: dict[float, dict[Key, None]] = {}
        self._random = random.Random(seed)
        self._salt = self._random.getrandbits(64)  # a key's shard, as a real run's keys hash to shards at random

    @property
    def now(self) -> float:
        """The master's clock, moved by its MooncakeTier (kvscope.tierstore.mooncake_tier)."""
        return self._now

    @now.setter
    def now(self, seconds: float) -> None:
        """The clock moves on (never back): the leases it passes run out, and their blocks join the end of the eviction
        order in the order of their timeouts."""
        if seconds < self._now:
            raise ValueError(f"the Mooncake model's clock goes forward only: {seconds} s after {self._now} s")
        self._now = float(seconds)
        leased, to_end = self._leased, self._blocks.move_to_end
        while leased:
            timeout = next(iter(leased))
            if timeout > seconds:
                break
            for key in leased.pop(timeout):
                to_end(key)

    def shard(self, key: Key) -> int:
        """The metadata shard of `key`, a function of the key and the seed that is the same in every process
        (Python salts the hash of bytes and str: a vLLM block hash is read as the integer it is)."""
        return hash((self._salt, stable_number(key))) % self.shards

    def grant(self, keys: Sequence[Key]) -> None:
        """Read leases for present `keys` (exist or get), in this order:
        `lease_timeout = max(lease_timeout, now + lease_ttl)`; a block leased at this moment already keeps its
        place."""
        self._lease_now(self._extended(keys))

    def grant_batch(self, keys: Sequence[Key]) -> None:
        """One batch call's leases over present `keys`, in the order the master visits them: shard by shard from
        a random start downwards (a block leased at this very moment keeps its place, whatever the order)."""
        shards, draw = self.shards, self._random.getrandbits
        start = draw(self._shard_bits)  # the start shard, drawn as random.randrange(shards) draws it on CPython
        while start >= shards:
            start = draw(self._shard_bits)
        fresh = self._extended(keys)
        if len(fresh) > 1 and shards > 1:
            numbers = fresh if self._int_keys else map(stable_number, fresh)
            # each block's rank in the visit, (start - shard) % shards, its shard the hash's remainder
            ranks = list(map(mod, map(sub, repeat(start), map(hash, zip(repeat(self._salt), numbers))), repeat(shards)))
            fresh = list(map(fresh.__getitem__, sorted(range(len(fresh)), key=ranks.__getitem__)))  # stable
        self._lease_now(fresh)

    def _extended(self, keys: Sequence[Key]) -> Sequence[Key]:
        """The `keys` whose lease a grant now extends: all but those leased at this very moment (as the clock only
        moves forward, a lease granted now outlasts every earlier one)."""
        now = self._now
        timeout = now + self.lease_ttl
        if timeout <= now:  # no lease to speak of: a block put or looked up at this moment keeps its place
            return [key for key in keys if self._lease[key] < timeout]
        same = self._leased.get(timeout)
        return list(filterfalse(same.__contains__, keys)) if same else keys

    def _lease_now(self, keys: Sequence[Key]) -> None:
        """Lease `keys` until now + lease_ttl, in this order: they leave the batch of any earlier lease and go to
        the end of the index. (Stores in a plain loop: on CPython 3.11 they beat update() and map() over bound
        methods at every batch size.)"""
        if not keys:
            return
        now, lease, leased = self._now, self._lease, self._leased
        timeout = now + self.lease_ttl
        if leased:  # the blocks still leased by an earlier lookup leave its batch
            for key in compress(keys, map(now.__lt__, map(lease.__getitem__, keys))):
                leased[lease[key]].pop(key, None)
        to_end = self._blocks.move_to_end
        for key in keys:
            to_end(key)
            lease[key] = timeout
        if timeout > now:
            batch = leased.get(timeout)
            if batch is None:
                leased[timeout] = dict.fromkeys(keys)
            else:
                batch.update(dict.fromkeys(keys))

    def admit(self, keys: Sequence[Key], nbytes: int) -> None:
        blocks, lease, now = self._blocks, self._lease, self._now
        for key in keys:
            blocks[key] = nbytes
            lease[key] = now
        if self._int_keys and not set(map(type, keys)) <= {int}:
            self._int_keys = False  # from now on keys go through stable_number (Python salts the hash of bytes)

    def lease_timeouts(self, until: float) -> list[float]:
        """The lease timeouts ahead of the clock, up to `until`, earliest first: when the eviction thread finds
        more to evict."""
        return [timeout for timeout, batch in self._leased.items() if batch and timeout <= until]

    def oldest_go_first(self, count: int) -> bool:
        return False  # the earliest leases run out go first, leased blocks last

    def pop_victim(self) -> tuple[Key, int]:
        """The object with the earliest lease timeout (a tier overrun by one request evicts block by block)."""
        return self.pop_victims(1)[0]

    def pop_victims(self, count: int) -> list[tuple[Key, int]]:
        victims = self._take_run_out(count)
        for batch in self._leased.values():  # an overrun past every run-out lease: the earliest leased ones
            if len(victims) == count:
                break
            victims += [(key, self.discard(key)) for key in list(islice(batch, count - len(victims)))]
        return victims

    def discard(self, key: Key) -> int:
        timeout = self._lease.pop(key, None)
        if timeout is not None and timeout > self._now:
            del self._leased[timeout][key]
        return super().discard(key)

    def pop_batch(
        self,
        used_ratio: float,
        flagged: bool,
        writing: Collection[Key] = (),
        judged_at: float | None = None,
        completed: int | None = None,
    ) -> list[tuple[Key, int]]:
        """What one BatchEvict removes now, with sizes (nothing below the watermark unless an allocation failed):
        of the leases run out, the earliest first; the blocks of a put still `writing` are neither counted nor
        taken. A pass that began earlier (and ends now) takes only leases run out by `judged_at`, as many as the
        `used_ratio` and the `completed` objects it found then called for."""
        if completed is None:
            completed = len(self._blocks) - len(writing)
        if completed <= 0 or (used_ratio <= self.high_watermark and not flagged):
            return []
        target = max(self.eviction_ratio, used_ratio - self.high_watermark + self.eviction_ratio)
        return self._take_run_out(math.ceil(completed * target), writing, judged_at)

    def _take_run_out(
        self, count: int, writing: Collection[Key] = (), by: float | None = None
    ) -> list[tuple[Key, int]]:
        """Remove up to `count` blocks whose lease had run out by `by` (the clock when None), earliest first,
        none of them `writing`; (key, size) of each. Most often they are the index's first `count` blocks, popped
        in a tight loop; otherwise the index is walked past what is leased or writing."""
        lease, blocks = self._lease, self._blocks
        by = self._now if by is None else by
        head = list(islice(blocks, count))
        if head and max(map(lease.__getitem__, head)) <= by and (not writing or set(writing).isdisjoint(head)):
            popitem = blocks.popitem
            victims = [popitem(False) for _ in head]
            for key in head:
                del lease[key]
            return victims
        if writing:
            keys = list(islice(filterfalse(set(writing).__contains__, self._run_out(by)), count))
        else:
            keys = list(islice(self._run_out(by), count))
        for key in keys:
            del lease[key]
        return list(zip(keys, map(blocks.pop, keys), strict=True))

    def _run_out(self, by: float) -> Iterator[Key]:
        """The blocks whose lease had run out by `by`, earliest first: the index in its order, past the blocks
        leased now, up to the first lease that ran out after `by` (every one after it ran out later)."""
        lease, now = self._lease, self._now
        for key in self._blocks:
            timeout = lease[key]
            if timeout <= by:
                yield key
            elif timeout <= now:
                return


def stable_number(key: Key) -> Key:
    """What a key is hashed as where the result must be the same in every process (Mooncake's shard of a key, the
    block lifecycle's sample of a chain): bytes and str as numbers (Python salts their hashes)."""
    if isinstance(key, bytes):
        return int.from_bytes(key[:8], "big")
    if isinstance(key, str):
        return zlib.crc32(key.encode())
    return key


LONG_TOUCH = 16  # chunks a touch moves one by one before a C loop is worth building (LmcachePolicy._end_lookup)


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
        # The pins, as the runs the lookups found, each with the chain it came from: a request that releases its
        # own chain unpins them all without a look at each chunk, and only an eviction that reaches the recent end
        # needs them as a set (`_pinned`). `_pin_count` counts them (a chunk pinned twice, twice).
        self._pins: list[tuple[Sequence[Key], Sequence[Key]]] = []
        self._pin_count = 0
        # Chunks admitted since no chunk was pinned. Since then only they and the pinned chunks (touched after
        # their lookup) moved to the recent end, so every pinned chunk is among the last _pin_count + _admitted.
        self._admitted = 0
        self.served = self._found

    def _found(self, keys: Sequence[Key], start: int, end: int) -> None:
        """The chunks of a run the lookup found, each `contains(key, pin=True)`: pinned and noted."""
        run = keys[start:end]  # a copy: the pins do not change with the caller's list
        self._looked_up += run
        self._pins.append((keys, run))
        self._pin_count += len(run)

    def _pinned(self) -> set[Key]:
        """The chunks pinned now."""
        pinned: set[Key] = set()
        for _, run in self._pins:
            pinned.update(run)
        return pinned

    def _end_lookup(self) -> None:
        """touch_cache, once a lookup found chunks (`_looked_up`; every caller tests it first, as most calls find
        nothing to do): those chunks, tail first, to the recent end. A long lookup's are moved by a C loop until
        one is gone (moved to another tier since its lookup); the rest one by one, past the gone ones."""
        blocks = self._blocks
        found = reversed(self._looked_up)
        if len(self._looked_up) > LONG_TOUCH:
            with suppress(KeyError):
                deque(map(blocks.move_to_end, found), maxlen=0)
        for key in found:
            if key in blocks:
                blocks.move_to_end(key)
        self._looked_up.clear()

    def admit(self, keys: Sequence[Key], nbytes: int) -> None:
        if self._looked_up:
            self._end_lookup()
        super().admit(keys, nbytes)
        self._admitted += len(keys)

    def pop_victim(self) -> tuple[Key, int]:
        """The least recent chunk not pinned (pinned chunks sit at the recent end, so the scan is short)."""
        return self.pop_victims(1)[0]

    def pop_victims(self, count: int) -> list[tuple[Key, int]]:
        """The `count` least recent chunks not pinned, then (a tier smaller than a request's prefix) the oldest
        pinned ones."""
        if self._looked_up:
            self._end_lookup()
        blocks = self._blocks
        unpinned = list(islice(filterfalse(self._pinned().__contains__, blocks), count))
        victims = list(zip(unpinned, map(blocks.pop, unpinned), strict=True))
        while len(victims) < count and blocks:
            victims.append(blocks.popitem(last=False))
        return victims

    def oldest_go_first(self, count: int) -> bool:
        """Most often the oldest chunks are not pinned: then they go first. Known without a look when they come
        before every chunk that moved since no chunk was pinned (`_admitted`)."""
        if self._looked_up:
            self._end_lookup()
        if count <= len(self._blocks) - self._pin_count - self._admitted:
            return True
        return self._pinned().isdisjoint(islice(self._blocks, count))

    def evictable(self) -> int:
        return max(0, len(self._blocks) - self._pin_count)  # pins of chunks gone already make it an underestimate

    def release(self, keys: Sequence[Key]) -> None:
        """lookup_unpin: the chunks of `keys` are unpinned (all of them at once when every pin came from this
        chain, as a request releases its own)."""
        if self._looked_up:
            self._end_lookup()
        pins = self._pins
        if pins:
            if pins[0][0] is keys and all(chain is keys for chain, _ in pins):
                self._pins.clear()
                self._pin_count = 0
            else:
                left = list(self._pinned().difference(keys))
                self._pins = [(left, left)] if left else []
                self._pin_count = len(left)
        if not self._pins:
            self._admitted = 0

    def keys(self) -> Iterable[Key]:
        if self._looked_up:
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
