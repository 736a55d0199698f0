"""One storage tier: a byte capacity, an eviction policy, a backend, and the counters the KV-tier model exports.

Counters follow the KV-tier model (docs/design.md, 'The KV-tier model'): logical puts (`puts`, `put_bytes`) are what
a client asked this tier to save; `written_bytes` is everything that landed on the medium (puts, promotions,
demotions); `hits` and `read_bytes` are blocks this tier served. A tier that never evicts shows `evictions == 0`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from itertools import compress, count, filterfalse, islice, repeat
from operator import itemgetter, length_hint

from kvscope.tierstore.backends import Backend
from kvscope.tierstore.lifecycle import BlockLifecycle, Followed, first_sampled
from kvscope.tierstore.policies import EvictionPolicy

Key = Hashable
Payload = bytes | memoryview
PayloadSource = Callable[[Key, int], Payload]
LONG_RUN = 16  # blocks of a run read by a Python loop before the rest goes to a C loop (Tier.read_run)


@dataclass(slots=True)
class TierCounters:
    """Monotonic counters of one tier; `allocated_bytes` and `capacity_bytes` are gauges."""

    puts: int = 0
    put_bytes: int = 0
    written_bytes: int = 0
    read_bytes: int = 0
    hits: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    allocated_bytes: int = 0
    capacity_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(slots=True)
class Evicted:
    """A block a tier gave up; `payload` is set when the caller asked to keep its bytes (demotion)."""

    key: Key
    nbytes: int
    payload: Payload | None = None


class Tier:
    """A named tier. Blocks are written and read as runs of one chain so the policy can batch its work."""

    def __init__(
        self,
        name: str,
        capacity: int,
        policy: EvictionPolicy,
        backend: Backend | None = None,
        read_bandwidth: float | None = None,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"tier {name!r}: capacity must be positive, got {capacity}")
        self.name = name
        self.policy = policy
        self.backend = backend or Backend()
        self.read_bandwidth = read_bandwidth
        self.counters = TierCounters(capacity_bytes=capacity)
        self._index = policy.index
        # What a read does to each block it serves: the policy's refresh, else a plain lookup
        self._read = policy.refresh or self._index.__getitem__
        self._served = policy.served
        self._keeps_bytes = self.backend.holds_bytes  # writes store real bytes, reads verify them
        # The size every block written here has had; 0 once two sizes were written (reads then sum the sizes).
        self._block_bytes: int | None = None
        # Where the arm notes what became of each block it gave up (kvscope.tierstore.misses.MissLedger): this
        # tier's name for a block it evicted; None when nobody asks (no bookkeeping at all)
        self.fates: dict[Key, object] | None = None
        # the lifetime, idle time before eviction and reuse gaps of a sample of its blocks, on the request clock
        self.lifecycle = BlockLifecycle()

    @property
    def capacity(self) -> int:
        return self.counters.capacity_bytes

    def __contains__(self, key: Key) -> bool:
        return key in self._index

    def run_length(self, keys: Sequence[Key], start: int = 0, stop: int | None = None) -> int:
        """How many consecutive blocks from `keys[start]` (up to `stop`) this tier holds; no side effects."""
        end = len(keys) if stop is None else min(stop, len(keys))
        index = self._index
        for position in range(start, end):
            if keys[position] not in index:
                return position - start
        return max(end - start, 0)

    def missing(self, keys: Iterable[Key]) -> Iterator[Key]:
        """The keys this tier does not hold, in order (filterfalse tests the index without a call per key)."""
        return filterfalse(self._index.__contains__, keys)

    def first_held(self, keys: Sequence[Key], start: int, end: int) -> int:
        """The position of the first block in `keys[start:end]` this tier holds, `end` when none (the scan runs in
        C: compress() passes on the positions whose key the index holds, no Python step per key)."""
        held = map(self._index.__contains__, islice(keys, start, end))
        return next(compress(count(start), held), end)

    def size_of(self, key: Key) -> int:
        return self._index[key]

    def read_run(self, keys: Sequence[Key], start: int, end: int) -> tuple[int, int]:
        """Serve the run of consecutive blocks this tier holds from `keys[start]` (before `end`, at most
        len(keys)): count hits and bytes, refresh each block as the policy does, verify real bytes. Returns
        (blocks, bytes) read. Finding the run and refreshing it is one pass, one probe per block: every hit's path.
        A Python loop serves a run's first LONG_RUN blocks (most runs of real traces end there), a C loop the rest
        of a longer one (_read_long_run). A policy that does something with the whole run (`served`) is told then.
        """
        end = min(end, len(keys))
        head_end = min(end, start + LONG_RUN)
        read, index, run = self._read, self._index, max(head_end - start, 0)
        for position in range(start, head_end):
            key = keys[position]
            if key not in index:
                run = position - start
                break
            read(key)
        else:
            if head_end < end:
                run += self._read_long_run(keys, head_end, end)
        if not run:
            return 0, 0
        if self._served is not None:
            self._served(keys, start, start + run)
        block_bytes = self._block_bytes
        nbytes = run * block_bytes if block_bytes else sum(map(self._index.__getitem__, keys[start : start + run]))
        counters = self.counters
        counters.hits += run
        counters.read_bytes += nbytes
        first = start + first_sampled(keys[0], start)  # the run's followed blocks: none in most short runs
        if first < start + run:
            self.lifecycle.hit(self._index, keys, first, start + run)
        if self._keeps_bytes:
            for key in keys[start : start + run]:
                self.backend.verify(key)
        return run, nbytes

    def _read_long_run(self, keys: Sequence[Key], start: int, end: int) -> int:
        """The length of the run from `keys[start]` (before `end`), each block read: map() applies the read to
        the blocks until the first absent one raises KeyError, and the iterator's remaining length says where.
        Not for a short run: the exception costs as much as a dozen blocks of the Python loop."""
        rest = iter(keys[start:end] if isinstance(keys, list | tuple) else list(islice(keys, start, end)))
        try:
            deque(map(self._read, rest), maxlen=0)
        except KeyError:
            return end - start - length_hint(rest) - 1
        return end - start

    def write(
        self,
        keys: Sequence[Key],
        nbytes: int,
        payload: PayloadSource | None = None,
        *,
        is_put: bool,
        keep_evicted: bool = False,
    ) -> list[Evicted]:
        """Store blocks of `nbytes` each (all absent here), evicting as the policy says to make room.

        Returns what was evicted, oldest first, with bytes, when `keep_evicted` (for demotion, or a caller that
        looks at the victims); without it the list may leave out what the tier dropped unseen (the counters count
        every eviction). Blocks that cannot fit even in an empty tier land and are evicted at once, as a real tier
        overrun by one request.
        """
        nbytes = int(nbytes)  # a size, not a followed block's record (kvscope.tierstore.lifecycle.Followed)
        if self.policy.stores_one_at_a_time and len(keys) > 1 and not self._evicts_as_one_at_a_time(len(keys), nbytes):
            evicted: list[Evicted] = []
            for key in keys:
                evicted += self.write([key], nbytes, payload, is_put=is_put, keep_evicted=keep_evicted)
            return evicted
        if self._block_bytes is None:
            self._block_bytes = nbytes
        elif nbytes != self._block_bytes:
            self._block_bytes = 0
        counters = self.counters
        total = len(keys) * nbytes
        counters.written_bytes += total
        if is_put:
            counters.puts += len(keys)
            counters.put_bytes += total
        if total <= counters.capacity_bytes:  # every block fits in the tier: most writes
            evicted = self._make_room(total, keep_evicted)
        else:  # the first blocks land and are evicted at once
            fitting = counters.capacity_bytes // nbytes
            overrun, keys = keys[: len(keys) - fitting], keys[len(keys) - fitting :]
            keeps = keep_evicted and payload is not None
            evicted = [Evicted(key, nbytes, payload(key, nbytes) if keeps else None) for key in overrun]
            counters.evictions += len(overrun)
            counters.evicted_bytes += len(overrun) * nbytes
            self._note_evicted(overrun)
            evicted.extend(self._make_room(len(keys) * nbytes, keep_evicted))
        self.policy.admit(keys, nbytes)
        counters.allocated_bytes += len(keys) * nbytes
        if self._keeps_bytes:
            if payload is None:
                raise ValueError(f"tier {self.name!r} keeps real bytes: a write needs a payload source")
            for key in keys:
                self.backend.store(key, payload(key, nbytes))
        return evicted

    def remove(self, key: Key) -> Payload | None:
        """Take a block out (it moved to another tier); returns its bytes if the backend holds them."""
        nbytes = self.policy.discard(key)
        if type(nbytes) is Followed:
            nbytes.lifecycle = None  # moved, not evicted
        self.counters.allocated_bytes -= nbytes
        data = self.backend.load(key) if self.backend.holds_bytes and nbytes else None
        self.backend.drop(key)
        return data

    def follow(self, keys: Iterable[Key]) -> None:
        """`keys`, sampled blocks (kvscope.tierstore.lifecycle.follow) or blocks followed in the tier they moved from,
        were just stored here: each one this tier holds is followed from now, its index value its record."""
        index, record = self._index, self.lifecycle.record
        for key in keys:
            nbytes = index.get(key)
            if nbytes is not None and type(nbytes) is not Followed:
                index[key] = record(nbytes)

    def release(self, keys: Sequence[Key]) -> None:
        """The request using this chain finished (chain-aware policies reorder its blocks)."""
        self.policy.release(keys)

    def at(self, seconds: float, keep_evicted: bool = False) -> list[Evicted]:
        """The clock moves to `seconds`. Only a tier whose evictions go by time (kvscope.tierstore.mooncake_tier)
        does anything, and may evict: what it evicted."""
        return []

    def probe(self, keys: Sequence[Key]) -> None:
        """The client's existence check before a read or a put. Only a tier whose system leases what such a check
        finds (Mooncake) does anything."""

    def _evicts_as_one_at_a_time(self, blocks: int, nbytes: int) -> bool:
        """Whether writing `blocks` blocks of `nbytes` at once evicts what writing them one at a time would (a
        system that stores so, as LMCache): when every block here has that size, they fit in the tier, and the
        victims they need are blocks already here that go before any new one (then none of them is a victim)."""
        counters = self.counters
        if self._block_bytes not in (None, nbytes) or not nbytes or blocks * nbytes > counters.capacity_bytes:
            return False
        excess = counters.allocated_bytes + blocks * nbytes - counters.capacity_bytes
        return excess <= 0 or -(-excess // nbytes) <= self.policy.evictable()

    def _make_room(self, needed: int, keep_evicted: bool) -> list[Evicted]:
        """Evict victims, as the policy orders them, until `needed` more bytes fit."""
        counters = self.counters
        excess = counters.allocated_bytes + needed - counters.capacity_bytes
        if excess <= 0:
            return []
        block_bytes, index = self._block_bytes, self._index
        if not block_bytes:  # blocks of several sizes: victim by victim until the excess is freed
            pop_victim = self.policy.pop_victim

            def victims() -> Iterator[tuple[Key, int]]:
                freed = 0
                while freed < excess and index:
                    key, size = pop_victim()
                    freed += size
                    yield key, size

            return self._drop(victims(), keep_evicted)
        count = min(-(-excess // block_bytes), len(index))
        if self._keeps_bytes or not self.policy.oldest_go_first(count):
            return self._drop(self.policy.pop_victims(count), keep_evicted)
        popitem = index.popitem  # the victims are the index's head, popped in a tight loop
        if keep_evicted:
            return self._count_evicted([Evicted(*popitem(False)) for _ in repeat(None, count)], count * block_bytes)
        self._note_evicted([popitem(False)[0] for _ in repeat(None, count)])  # counted, not kept: no object a victim
        self._count_evictions(count, count * block_bytes)
        return []

    def _drop(self, victims: Iterable[tuple[Key, int]], keep_evicted: bool) -> list[Evicted]:
        """Drop evicted blocks (already out of the policy's index) from the backend, their bytes kept when
        `keep_evicted`, and count them."""
        backend = self.backend if self.backend.holds_bytes else None  # the accounting backend keeps nothing to drop
        if backend is None and not keep_evicted:  # counted, not kept: no object a victim
            victims = list(victims)
            self._note_evicted(list(map(itemgetter(0), victims)))
            self._count_evictions(len(victims), sum(map(itemgetter(1), victims)))
            return []
        evicted: list[Evicted] = []
        freed = 0
        for key, size in victims:
            freed += size
            data = None
            if backend is not None:
                data = backend.load(key) if keep_evicted else None
                backend.drop(key)
            evicted.append(Evicted(key, size, data))
        return self._count_evicted(evicted, freed)

    def _count_evicted(self, evicted: list[Evicted], freed: int) -> list[Evicted]:
        """Count blocks gone from the tier (`freed` bytes of them), noting their fate; returns them."""
        if self.fates is not None:
            self._note_evicted([block.key for block in evicted])
        self._count_evictions(len(evicted), freed)
        return evicted

    def _note_evicted(self, keys: Sequence[Key]) -> None:
        """Note that this tier evicted `keys` last, so a later miss on one of them names this tier."""
        fates = self.fates
        if fates is not None:
            name = self.name
            for key in keys:
                fates[key] = name

    def _count_evictions(self, blocks: int, freed: int) -> None:
        counters = self.counters
        counters.allocated_bytes -= freed
        counters.evictions += blocks
        counters.evicted_bytes += freed
