"""Why a real vLLM arm's prompt tokens missed, from what the engine and the store report: vLLM's KV events
(`--kv-events-config`) for its prefix cache and the Mooncake connector's saves, and the store's existence check.

The events (kvscope.exporters.vllm_kv_events: the wire, gaps and replay) build a block table: each block hash with
its parent, its token ids and the media that hold it now and ever held it. vLLM reports its prefix cache with
medium GPU, stored and removed. Mooncake's connector reports a save with medium cpu, one BlockStored per block and
only once the put of that block succeeded (vLLM 0.32 `KVCacheStoreSendingThread._handle_request`): a refused put
(`-200` no available handle, or any error) and a request the connector skips while the store is under pressure
emit nothing, blocks the store already holds are not put again and emit nothing, and Mooncake's evictions are never
reported. A request's blocks are found by walking its prompt's token ids down the table by (parent hash, the
block's token ids), so kvscope needs neither vLLM's hash seed nor its hash function.

Each missed block of a request (from its first miss, the response's cached tokens over the block size, to its last
block a cache may serve) is classified as it stood just before the request was sent:

- `chain_broken`: behind the first miss and held, by vLLM's prefix cache (its events) or by the store (an existence
  check kvscope's own store client makes just before sending, over the blocks the connector's lookup checks a few
  milliseconds later; it leases what it finds as that lookup does, a few milliseconds earlier);
- `evicted`: stored once and gone; credited to the store's tier when the connector ever stored it (the store
  reports no eviction, and its copy is the one behind vLLM's), else to `gpu`;
- `not_admitted`: vLLM's prefix cache stored it but the connector never did: its put was refused or skipped;
- `cold`: never stored (no event names it), and the tokens no cache serves.

Not told apart: a block the store held once and whose later put was refused counts as evicted (the refusal emits
nothing, and vLLM's store of a block it loaded from the store looks like one it recomputed); with an SSD tier the
store's evictions are credited to the tier that ends its write path, as for the Mooncake arms
(kvscope.tierstore.misses.ReportedMissLedger).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvscope.exporters.base import CollectError
from kvscope.exporters.vllm_kv_events import (
    EventStream,
    KvEventsTargetConfig,
    UndecodableBatch,
    VllmKvEventsCollector,
    decode_events,
)
from kvscope.processes import free_port
from kvscope.tierstore.misses import CAUSES, causes_snapshot

BlockHash = bytes | int
GPU, STORE = "gpu", "cpu"  # the media of vLLM's prefix cache and of the Mooncake connector's saves
NOT_ADMITTED, COLD = "not_admitted", "cold"


@dataclass(slots=True)
class Block:
    parent: BlockHash | None
    tokens: tuple[int, ...]
    held: set[str] = field(default_factory=set)  # the media that hold it now
    ever: set[str] = field(default_factory=set)  # the media that ever stored it
    saved_at: float = 0.0  # the engine's timestamp of the batch that last reported the connector's save of it


class BlockTable:
    """The blocks vLLM's KV events named, by hash, and by (parent hash, token ids) to walk a prompt down."""

    def __init__(self) -> None:
        self.blocks: dict[BlockHash, Block] = {}
        self._children: dict[tuple[BlockHash | None, tuple[int, ...]], BlockHash] = {}

    def apply(self, events: Iterable[object], published_at: float = 0.0) -> None:
        """One batch's events, in order (events of a type this table does not know are skipped), published at the
        engine's `published_at` (seconds since the epoch)."""
        for event in events:
            if not isinstance(event, dict):
                continue
            kind, medium = event.get("type"), str(event.get("medium") or "").lower()
            if kind == "BlockStored":
                self._stored(event, medium, published_at)
            elif kind == "BlockRemoved":
                for block_hash in event.get("block_hashes") or ():
                    if block := self.blocks.get(block_hash):
                        block.held.discard(medium)
            elif kind == "AllBlocksCleared":  # a prefix-cache reset
                for block in self.blocks.values():
                    block.held.discard(GPU)

    def _stored(self, event: dict, medium: str, published_at: float) -> None:
        size, tokens = event.get("block_size") or 0, event.get("token_ids") or []
        parent = event.get("parent_block_hash")
        for index, block_hash in enumerate(event.get("block_hashes") or ()):
            block_tokens = tuple(tokens[index * size : (index + 1) * size])
            block = self.blocks.get(block_hash)
            if block is None:
                block = self.blocks[block_hash] = Block(parent, block_tokens)
            if size and len(block_tokens) == size:  # the connector names no tokens when it lost track of them
                self._children[(parent, block_tokens)] = block_hash
            block.held.add(medium)
            block.ever.add(medium)
            if medium == STORE:
                block.saved_at = published_at
            parent = block_hash

    def chain(self, token_ids: Sequence[int], block_tokens: int, blocks: int) -> list[BlockHash]:
        """The hashes of the first `blocks` full blocks of `token_ids`, as far as the table knows them: the walk
        stops at the first block no event named."""
        hashes: list[BlockHash] = []
        parent: BlockHash | None = None
        for index in range(min(blocks, len(token_ids) // block_tokens)):
            found = self._children.get((parent, tuple(token_ids[index * block_tokens : (index + 1) * block_tokens])))
            if found is None:
                break
            hashes.append(found)
            parent = found
        return hashes


@dataclass(frozen=True, slots=True)
class Lookup:
    """A request's blocks a cache may serve, as they stood just before it was sent: whether a cache held each, and
    what explains a miss of it otherwise (`cold`, `not_admitted`, or the tier that evicted it)."""

    held: list[bool]
    fates: list[str]


def look_up(table: BlockTable, hashes: Sequence[BlockHash], blocks: int, store_held: Sequence[bool],
            store_tier: str | None) -> Lookup:  # fmt: skip
    """The Lookup of `blocks` blocks whose known hashes are `hashes` (the rest no event named), vLLM's prefix cache
    as the table holds it and the store as its existence check (`store_held`, per known hash) found it;
    `store_tier` is None for an arm without a store (vLLM alone)."""
    held, fates = [], []
    for index in range(blocks):
        block = table.blocks[hashes[index]] if index < len(hashes) else None
        if block is None:
            held.append(False)
            fates.append(COLD)
            continue
        held.append(GPU in block.held or (index < len(store_held) and store_held[index]))
        if STORE in block.ever and store_tier is not None:
            fates.append(store_tier)
        elif GPU in block.ever:
            fates.append(NOT_ADMITTED if store_tier is not None else GPU)
        else:
            fates.append(COLD)
    return Lookup(held, fates)


class EventMissLedger:
    """The miss causes of a real vLLM arm, in tokens, cumulative (as kvscope.tierstore.misses.MissLedger)."""

    def __init__(self, block_tokens: int, store_tier: str | None) -> None:
        self.block_tokens = block_tokens
        self.tokens = dict.fromkeys(CAUSES, 0)
        self.evicted_tokens = {GPU: 0, **({store_tier: 0} if store_tier else {})}

    def classify(self, lookup: Lookup, hit_tokens: int, prompt_tokens: int) -> None:
        """Give a cause to each of a request's `prompt_tokens - hit_tokens` missed tokens: from its first miss (its
        hits end there) to the blocks of `lookup`; the tokens past them are `cold` (no cache serves them)."""
        block, tokens = self.block_tokens, self.tokens
        first_miss = hit_tokens // block
        tokens[COLD] += prompt_tokens - max(len(lookup.held), first_miss) * block
        for index in range(first_miss, len(lookup.held)):
            fate = lookup.fates[index]
            if index > first_miss and lookup.held[index]:
                tokens["chain_broken"] += block
            elif fate in (COLD, NOT_ADMITTED):
                tokens[fate] += block
            else:
                self.evicted_tokens[fate] += block

    def snapshot(self) -> dict:
        return causes_snapshot(self.tokens, self.evicted_tokens)


@dataclass
class TableStream(EventStream):
    """The stream's own counters (gaps, replays, losses), with every batch applied to a block table."""

    table: BlockTable = field(default_factory=BlockTable)
    published_at: float = 0.0  # the engine's timestamp of the latest batch applied

    def add(self, sequence: int, payload: bytes, received_at: float, via: str) -> None:
        super().add(sequence, payload, received_at, via)
        try:
            timestamp, events = decode_events(payload)
        except UndecodableBatch:
            return  # counted by the stream
        self.table.apply(events, timestamp)
        self.published_at = max(self.published_at, timestamp)


class _TableCollector(VllmKvEventsCollector):
    def __init__(self, config: KvEventsTargetConfig) -> None:
        super().__init__(config)
        self.stream = TableStream()


_BIND_ATTEMPTS = 5


class KvEventFollower:
    """kvscope's subscription to one vLLM server's KV events, on 127.0.0.1 (kvscope binds the endpoint, vLLM
    connects to it and binds its replay endpoint), read on `loop` whenever the caller waits for it to settle."""

    def __init__(self, name: str, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.unsettled = 0  # waits that ran out before the events they waited for arrived
        # bound and subscribed before the engine starts; a free port can be taken before it is bound (Mooncake's
        # processes bind ports of their own meanwhile), so a port in use is given up for another, a few times
        for attempt in range(_BIND_ATTEMPTS):
            self.endpoint, self.replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
            config = {"name": name, "source": "vllm_kv_events", "endpoint": self.endpoint, "bind": True,
                      "replay_endpoint": self.replay}  # fmt: skip
            self.collector = _TableCollector(KvEventsTargetConfig(**config))
            try:
                loop.run_until_complete(self.collector.collect())
                break
            except CollectError as error:
                loop.run_until_complete(self.collector.close())
                if "Address already in use" not in str(error) or attempt == _BIND_ATTEMPTS - 1:
                    raise
        self.stream: TableStream = self.collector.stream  # type: ignore[assignment]

    def server_args(self) -> tuple[tuple[str, ...], dict[str, str]]:
        """vLLM's arguments and environment: events on, published to the endpoint, block hashes as the bytes the
        Mooncake connector names its keys by (not vLLM's default 64-bit integers)."""
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.endpoint,
                  "replay_endpoint": self.replay}  # fmt: skip
        return ("--kv-events-config", json.dumps(config)), {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"}

    def settle(self, complete: Callable[[BlockTable], bool], known: Callable[[BlockTable], bool], quiet_s: float,
               timeout_s: float) -> bool:  # fmt: skip
        """Read the events until `complete` holds of the table, or `known` holds and the engine published nothing
        for `quiet_s` (what is still missing may never come: a refused put emits nothing); False, and counted, when
        `timeout_s` ran out first."""
        settled = self._loop.run_until_complete(self._settle(complete, known, quiet_s, timeout_s))
        self.unsettled += not settled
        return settled

    async def _settle(self, complete: Callable[[BlockTable], bool], known: Callable[[BlockTable], bool],
                      quiet_s: float, timeout_s: float) -> bool:  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while True:
            await self.collector.collect()  # raises if the subscription ended
            table = self.stream.table
            if complete(table) or (known(table) and time.time() - self.stream.published_at >= quiet_s):
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)

    def report(self) -> dict:
        """What the stream did: batches by how they arrived, gaps, batches lost, waits that ran out."""
        stream = self.stream
        return {"batches": dict(stream.batches), "gaps": stream.gaps, "lost_batches": sum(stream.lost.values()),
                "undecodable_batches": stream.undecodable, "unsettled_requests": self.unsettled}  # fmt: skip

    def close(self) -> None:
        self._loop.run_until_complete(self.collector.close())


class Existence(Protocol):
    """A store's existence check (kvscope.tierstore.mooncake.MooncakeStore.exist)."""

    def exist(self, keys: Sequence[str]) -> list[bool]: ...


class RequestMisses:
    """The miss causes of one vLLM arm, request by request: before a request, the events of those before it (read
    until they settled); just before it is sent, its blocks looked up in the table and in the store; after its
    answer, its missed tokens classified from its cached tokens."""

    QUIET_S = 0.3  # a save's events came within 0.1 s of the answer here
    TIMEOUT_S = 2.0

    def __init__(self, events: KvEventFollower, block_tokens: int, store: Existence | None, store_tier: str | None,
                 key_prefix: str) -> None:  # fmt: skip
        self.events, self.block_tokens, self.store, self.key_prefix = events, block_tokens, store, key_prefix
        self._store_tier = store_tier if store is not None else None
        self.ledger = EventMissLedger(block_tokens, self._store_tier)
        self._previous: list[int] = []  # the token ids of the request sent last
        self._sent_at = 0.0  # when it was looked up, just before it was sent (seconds since the epoch)

    def settle(self) -> bool:
        """Wait for the events of the requests sent so far: every full block of the last one's prompt stored by
        vLLM's prefix cache, and by the connector (or, as a refused put emits nothing, no event for a while)."""
        blocks = len(self._previous) // self.block_tokens

        def known(table: BlockTable) -> bool:
            return len(table.chain(self._previous, self.block_tokens, blocks)) == blocks

        def complete(table: BlockTable) -> bool:
            hashes = table.chain(self._previous, self.block_tokens, blocks)
            saved = self.store is None or all(STORE in table.blocks[h].ever for h in hashes)
            return len(hashes) == blocks and saved

        return self.events.settle(complete, known, self.QUIET_S, self.TIMEOUT_S)

    def look_up(self, token_ids: list[int]) -> Lookup:
        """The request's blocks a cache may serve (all but the one holding its last token, which vLLM computes),
        from the table and from the store's existence check, now: call it just before sending the request."""
        blocks = (len(token_ids) - 1) // self.block_tokens
        table = self.events.stream.table
        hashes = table.chain(token_ids, self.block_tokens, blocks)
        held = self.store.exist([self.key_prefix + _hex(h) for h in hashes]) if self.store and hashes else []
        self._previous, self._sent_at = token_ids, time.time()
        return look_up(table, hashes, blocks, held, self._store_tier)

    def saved_after_s(self) -> float | None:
        """Seconds from the last request's look-up (just before it was sent) to the connector's first save of its
        blocks, as the engine stamped the batch that reported it; None when it saved none (every block held
        already, or its puts refused). Call once its events settled. The save, with the existence check that
        leases the request's chain and the allocation that sets the store's eviction off, runs on a thread of its
        own: on a busy machine it came up to a second after the first token, and after the answer."""
        table = self.events.stream.table
        hashes = table.chain(self._previous, self.block_tokens, len(self._previous) // self.block_tokens)
        saves = [stamp for h in hashes if (stamp := table.blocks[h].saved_at) >= self._sent_at]
        return round(min(saves) - self._sent_at, 4) if saves else None


def _hex(block_hash: BlockHash) -> str:
    """A block hash as the connector's keys spell it (a bytes hash: vLLM's events give ints unless told not to)."""
    if not isinstance(block_hash, bytes):
        kind = type(block_hash).__name__
        raise TypeError(f"a block hash of {kind}: run vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0")
    return block_hash.hex()
