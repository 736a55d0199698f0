"""TieredStore: ordered tiers behind one put/get interface, with `replicate` or `demote` placement.

- replicate: a put lands in every tier; an upper tier's eviction just drops its copy, a lower tier may still
  hold the block (Mooncake with an SSD/NoF offload behaves so). The put is one logical save, counted by the top
  tier (where a client addresses it, as Mooncake's memory pool); the copies below are written bytes.
- demote: tiers are exclusive; a block evicted from tier i moves to tier i+1, the last tier's evictions are gone.
- promote_on_hit: a block served by a lower tier is copied (replicate) or moved (demote) into the tiers above.

A lookup finds the longest run of consecutive chain blocks present in the union of the tiers, each block served
by the highest tier that holds it: a chain is only as good as its first missing block.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from operator import truediv
from typing import Literal, Protocol

from kvscope.tierstore.lifecycle import Followed
from kvscope.tierstore.misses import MissLedger, ReportedMissLedger
from kvscope.tierstore.policies import EvictionPolicy
from kvscope.tierstore.tier import Evicted, Payload, Tier

Key = Hashable
Placement = Literal["replicate", "demote"]
PLACEMENTS: tuple[Placement, ...] = ("replicate", "demote")


def synthetic_payload(key: Key, nbytes: int) -> bytes:
    """Deterministic bytes for a block the emulator never computed: a digest of the key, repeated.

    Real-bytes backends need content; deriving it from the key makes a misdirected read fail its check too.
    """
    seed = hashlib.blake2b(repr(key).encode(), digest_size=32).digest()
    repeats, rest = divmod(nbytes, len(seed))
    return seed * repeats + seed[:rest]


Segment = tuple[int, int, int, int]  # (tier index, begin, end, bytes read)


@dataclass(slots=True)
class PrefixRead:
    """What a prefix read served: `blocks` consecutive blocks, `read_bytes` from each tier (in tier order), and for
    a real store the seconds its gets took."""

    blocks: int
    read_bytes: list[int]
    seconds: float = 0.0


class KVStore(Protocol):
    """What the engine emulator asks of a store: the embedded TieredStore, or a real one behind a connector
    (kvscope.tierstore.mooncake.MooncakeStore)."""

    tiers: list[Tier]  # the embedded tiers (a real store has none: its media are observed through its metrics)
    attached: list[Tier]
    observed: list  # a real store's latest scrape (exporter target states) behind counters(); empty when embedded

    def at(self, seconds: float) -> None: ...

    def read_prefix(self, keys: Sequence[Key], start: int = 0, stop: int | None = None) -> PrefixRead: ...

    def put(self, keys: Sequence[Key], nbytes: int) -> int: ...

    def release(self, keys: Sequence[Key]) -> None: ...

    def load_seconds(self, read: PrefixRead) -> float: ...

    def miss_ledger(self, gpu_cache: Tier | None, block_tokens: int) -> MissLedger | ReportedMissLedger:
        """What explains the misses of an engine in front of this store (kvscope.tierstore.misses)."""
        ...

    def counters(self) -> dict[str, dict[str, int]]: ...

    def settled_counters(self) -> dict[str, dict[str, int]]: ...

    def report(self) -> dict: ...

    def close(self) -> None: ...


class NoStore:
    """No store behind the engine (vLLM alone): nothing to read, nothing kept, no tiers to count."""

    tiers: list[Tier] = []  # noqa: RUF012 - there are none
    attached: list[Tier] = []  # noqa: RUF012
    observed: list = []  # noqa: RUF012

    def at(self, seconds: float) -> None:
        """No clock to move."""

    def read_prefix(self, keys: Sequence[Key], start: int = 0, stop: int | None = None) -> PrefixRead:
        return PrefixRead(0, [])

    def put(self, keys: Sequence[Key], nbytes: int) -> int:
        return 0

    def release(self, keys: Sequence[Key]) -> None:
        """Nothing to release."""

    def load_seconds(self, read: PrefixRead) -> float:
        return 0.0

    def miss_ledger(self, gpu_cache: Tier | None, block_tokens: int) -> MissLedger:
        return MissLedger([gpu_cache] if gpu_cache else [], block_tokens)

    def counters(self) -> dict[str, dict[str, int]]:
        return {}

    def settled_counters(self) -> dict[str, dict[str, int]]:
        return {}

    def report(self) -> dict:
        return {"kind": "none"}

    def close(self) -> None:
        """Nothing to close."""


@dataclass(slots=True)
class PrefixHit:
    """The longest present run of a chain starting at `start`: `blocks` long, in (tier, begin, end) segments."""

    start: int
    blocks: int = 0
    segments: list[tuple[int, int, int]] = field(default_factory=list)


class TieredStore:
    def __init__(
        self,
        tiers: Sequence[Tier],
        placement: Placement = "replicate",
        promote_on_hit: bool = False,
        attached: Sequence[Tier] = (),
    ) -> None:
        if not tiers:
            raise ValueError("a tiered store needs at least one tier")
        names = [tier.name for tier in [*tiers, *attached]]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        if placement not in PLACEMENTS:
            raise ValueError(f"unknown placement {placement!r}: expected one of {', '.join(PLACEMENTS)}")
        self.tiers = list(tiers)
        self.attached = list(attached)  # present but unused: counted and exported, never read or written
        self.observed: list = []  # counters are read from the tiers themselves, not scraped
        self.placement = placement
        self.promote_on_hit = promote_on_hit
        self._keeps_bytes = any(tier.backend.holds_bytes for tier in self.tiers)
        # tiers of a system whose lookups and clock change what it keeps (Mooncake's leases): told of each lookup
        self._clocked = [(index, tier) for index, tier in enumerate(self.tiers) if type(tier).probe is not Tier.probe]
        self._only_tier = self.tiers[0] if len(self.tiers) == 1 else None
        # each tier's read bandwidth for the cost model (a tier without one loads in no time), and the tiers whose
        # policy reorders a chain when its request finishes
        self._bandwidths = [tier.read_bandwidth or math.inf for tier in self.tiers]
        self._chain_aware = [tier for tier in self.tiers if type(tier.policy).release is not EvictionPolicy.release]

    def __contains__(self, key: Key) -> bool:
        return any(key in tier for tier in self.tiers)

    def prefix(self, keys: Sequence[Key], start: int = 0, stop: int | None = None) -> PrefixHit:
        """Find (without side effects) the run of consecutive blocks from `start` present in some tier.

        Works a segment at a time: the highest tier holding the block at `position` serves it, and keeps serving
        the blocks after it for as long as it holds them and no tier above it does.
        """
        end = len(keys) if stop is None or stop > len(keys) else stop
        segments = [segment[:3] for segment in self._segments(keys, start, end, read=False)]
        return PrefixHit(start, segments[-1][2] - start if segments else 0, segments)

    @property
    def clocked(self) -> bool:
        """Whether a tier's evictions go by time (Mooncake's leases): its engine then says when each request's
        steps happen (`at`)."""
        return bool(self._clocked)

    def at(self, seconds: float) -> None:
        """The clock moves to `seconds`: the time-driven tiers' background eviction has run meanwhile (what it
        evicts moves down when demoting), and every tier times its blocks' lifecycle on it (the evictions of that
        background pass count as at `seconds`)."""
        for tier in self.tiers:
            tier.lifecycle.now = seconds
        for index, tier in self._clocked:
            demotes = self._demotes(index)
            evicted = tier.at(seconds, demotes)
            if demotes:
                self._demote(evicted, index + 1)

    def read_prefix(self, keys: Sequence[Key], start: int = 0, stop: int | None = None) -> PrefixRead:
        """Load the run of consecutive blocks from `start` present in some tier, as a connector's load does: the
        same segments prefix() finds, each served by its tier (hits, bytes, recency, checksums) as it is found."""
        end = len(keys) if stop is None or stop > len(keys) else stop
        for _, tier in self._clocked:  # the client's lookup first: it leases what it finds
            tier.probe(keys[start:end])
        if self._only_tier:  # one segment, found and read in one pass
            blocks, nbytes = self._only_tier.read_run(keys, start, end)
            return PrefixRead(blocks, [nbytes])
        read = [0] * len(self.tiers)
        position = start
        promoted: list[tuple[int, int, int]] = []
        for tier_index, begin, position, nbytes in self._segments(keys, start, end, read=True):
            read[tier_index] += nbytes
            if tier_index and self.promote_on_hit:
                promoted.append((tier_index, begin, position))
        for tier_index, begin, until in promoted:  # only once every segment is read: a promotion may evict one
            self._promote([key for key in keys[begin:until] if key in self.tiers[tier_index]], tier_index)
        return PrefixRead(position - start, read)

    def put(self, keys: Sequence[Key], nbytes: int) -> int:
        """Save the blocks of `keys` that no tier holds (a connector checks existence first); returns bytes put
        (a tier that refuses what does not fit, as Mooncake's segment, may put fewer)."""
        for _, tier in self._clocked:
            tier.probe(keys)
        missing = self._missing(keys)
        if not missing:
            return 0
        payload = synthetic_payload if self._keeps_bytes else None
        top = self.tiers[0].counters
        before = top.put_bytes
        if self.placement == "replicate":
            for position, tier in enumerate(self.tiers):
                tier.write(missing, nbytes, payload, is_put=position == 0)
        else:
            evicted = self.tiers[0].write(missing, nbytes, payload, is_put=True, keep_evicted=self._demotes(0))
            self._demote(evicted, 1)
        return top.put_bytes - before

    def release(self, keys: Sequence[Key]) -> None:
        """The request that used this chain finished."""
        for tier in self._chain_aware:
            tier.release(keys)

    def load_seconds(self, read: PrefixRead) -> float:
        """The cost model's time to load a prefix read: each tier's bytes over its read bandwidth (0 without one)."""
        return sum(map(truediv, read.read_bytes, self._bandwidths))

    def miss_ledger(self, gpu_cache: Tier | None, block_tokens: int) -> MissLedger:
        """Every tier is in view: each notes what it gave up."""
        return MissLedger([*([gpu_cache] if gpu_cache else []), *self.tiers], block_tokens)

    def counters(self) -> dict[str, dict[str, int]]:
        """A snapshot of every tier's counters, by tier name."""
        return {tier.name: tier.counters.as_dict() for tier in self.tiers + self.attached}

    def settled_counters(self) -> dict[str, dict[str, int]]:
        """The counters at the end of a run: nothing works in the background here, so the current ones."""
        return self.counters()

    def report(self) -> dict:
        """What the A/B contract says of the store besides its counters."""
        return {"kind": "embedded"}

    def close(self) -> None:
        for tier in self.tiers + self.attached:
            tier.backend.close()

    def _segments(self, keys: Sequence[Key], start: int, end: int, *, read: bool) -> Iterator[Segment]:
        """The present run from `start` as (tier index, begin, end, bytes read) segments, each tier's run found by
        one scan; `read` serves each segment from its tier as it goes, otherwise the walk only looks."""
        tiers = self.tiers
        position = start
        while position < end:
            serving, bound = 0, end  # most blocks are served by the top tier
            run, nbytes = self._run(tiers[0], keys, position, end, read)
            if not run:
                key = keys[position]
                serving = next((index for index in range(1, len(tiers)) if key in tiers[index]), 0)
                if not serving:
                    return
                for tier in tiers[:serving]:  # the segment ends where a tier above holds a block again
                    bound = tier.first_held(keys, position, bound)
                run, nbytes = self._run(tiers[serving], keys, position, bound, read)
            yield serving, position, position + run, nbytes
            position += run

    @staticmethod
    def _run(tier: Tier, keys: Sequence[Key], start: int, end: int, read: bool) -> tuple[int, int]:
        """(blocks, bytes read) of the run `tier` holds from `start`: served when `read`, else only measured."""
        return tier.read_run(keys, start, end) if read else (tier.run_length(keys, start, end), 0)

    def _missing(self, keys: Sequence[Key]) -> list[Key]:
        """The keys no tier holds, in order."""
        missing: Iterable[Key] = keys
        for tier in self.tiers:
            missing = tier.missing(missing)
        return list(missing)

    def _demotes(self, tier_index: int) -> bool:
        return self.placement == "demote" and tier_index + 1 < len(self.tiers)

    def _demote(self, evicted: list[Evicted], tier_index: int) -> None:
        """Move blocks evicted from tier `tier_index - 1` down, cascading what that evicts in turn."""
        while evicted and tier_index < len(self.tiers):
            tier = self.tiers[tier_index]
            by_size: dict[int, list[Evicted]] = {}
            for block in evicted:
                if block.key not in tier:
                    by_size.setdefault(block.nbytes, []).append(block)
            cascaded: list[Evicted] = []
            for nbytes, blocks in by_size.items():
                payloads = {block.key: block.payload for block in blocks}
                cascaded += tier.write(
                    [block.key for block in blocks],
                    nbytes,
                    _from_mapping(payloads) if self._keeps_bytes else None,
                    is_put=False,
                    keep_evicted=self._demotes(tier_index),
                )
                tier.follow([block.key for block in blocks if type(block.nbytes) is Followed])
            evicted, tier_index = cascaded, tier_index + 1

    def _promote(self, keys: Sequence[Key], source_index: int) -> None:
        """Copy (replicate) or move (demote) blocks served by a lower tier into the tiers above it."""
        source = self.tiers[source_index]
        for key in keys:
            nbytes = source.size_of(key)
            data: Payload | None = None
            if self.placement == "demote":
                data = source.remove(key)
                targets = self.tiers[:1]
            else:
                data = source.backend.load(key) if source.backend.holds_bytes else None
                targets = [tier for tier in self.tiers[:source_index] if key not in tier]
            payload = _from_mapping({key: data}) if self._keeps_bytes else None
            for target in targets:
                evicted = target.write([key], nbytes, payload, is_put=False, keep_evicted=self._demotes(0))
                if type(nbytes) is Followed:
                    target.follow([key])
                if self.placement == "demote":
                    self._demote(evicted, 1)


def _from_mapping(payloads: dict[Key, Payload | None]):
    """A payload source that returns known bytes, or synthesizes them for a block that had none."""

    def source(key: Key, nbytes: int) -> Payload:
        data = payloads.get(key)
        return data if data is not None else synthetic_payload(key, nbytes)

    return source
