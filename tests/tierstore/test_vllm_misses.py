"""A real vLLM arm's miss causes from its KV events and the store's existence check (kvscope.tierstore.vllm_misses),
worked by hand on event tables: the frames a real vLLM 0.32 published (tests/fixtures/vllm-kv-events), and events
built as vLLM's prefix cache (medium GPU) and Mooncake's connector (medium cpu, one per block put) publish them,
and the wait for a request's events."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from pathlib import Path

import msgpack
import pytest

from kvscope.tierstore.misses import CAUSES
from kvscope.tierstore.vllm_misses import (
    BlockTable,
    EventMissLedger,
    KvEventFollower,
    RequestMisses,
    TableStream,
    look_up,
)

BLOCK = 32
FRAMES = Path(__file__).parents[1] / "fixtures" / "vllm-kv-events" / "frames-0.32.0.json"


def stored(medium: str, hashes: list[bytes], tokens: list[int], parent: bytes | None = None) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BLOCK, "medium": medium}  # fmt: skip


def removed(medium: str, hashes: list[bytes]) -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def missed(ledger: EventMissLedger) -> int:
    causes = ledger.snapshot()
    return sum(causes[cause] for cause in CAUSES)


def test_the_captured_frames_walk_a_prompt_down_its_chain_and_explain_the_prefix_cache_evictions():
    """The capture: three 100-token prompts (3 full blocks each) into 8 usable blocks; the third evicts the first
    prompt's blocks 2 and 1 (vLLM frees a request's blocks tail first). The first prompt again, with the engine
    alone (no store): its prefix cache serves block 0 (32 cached tokens), blocks 1 and 2 were stored and evicted by
    the GPU tier, the 4 tokens past its full blocks are cold: 64 + 4 = 100 - 32."""
    captured = json.loads(FRAMES.read_text())
    stream = TableStream()
    for frame in captured["live"][:3]:  # before the reset
        _, sequence, payload = (base64.b64decode(part) for part in frame)
        stream.add(int.from_bytes(sequence, "big"), payload, 0.0, "live")
    prompt = list(range(100))  # words w0..w99 of the tiny model: token ids 0..99
    hashes = stream.table.chain(prompt, BLOCK, (len(prompt) - 1) // BLOCK)
    assert len(hashes) == 3
    lookup = look_up(stream.table, hashes, 3, [], store_tier=None)
    assert lookup.held == [True, False, False] and lookup.fates == ["gpu", "gpu", "gpu"]
    ledger = EventMissLedger(BLOCK, store_tier=None)
    ledger.classify(lookup, hit_tokens=32, prompt_tokens=100)
    causes = ledger.snapshot()
    assert causes["evicted_by_tier"] == {"gpu": 64} and causes["evicted"] == 64 and causes["cold"] == 4
    assert missed(ledger) == 100 - 32
    assert (
        stream.batches["live"] == 3
        and stream.published_at == msgpack.unpackb(base64.b64decode(captured["live"][2][2]))[0]
    )


def table_of(*events: dict) -> BlockTable:
    table = BlockTable()
    table.apply(events)
    return table


A = [bytes([i]) * 16 for i in range(5)]
TOKENS = list(range(1000, 1000 + 5 * BLOCK))


def test_a_request_behind_a_store_each_block_by_what_the_events_and_the_check_say():
    """Blocks 0-3 computed and in vLLM's prefix cache; the connector saved 0, 1 and 3 (block 2's put was refused:
    no event); vLLM then evicted 0 and 2. The store's check finds 1 only (0 evicted there too). The request's 136
    tokens: 4 blocks a cache may serve, 8 tokens past them. Nothing hits (first miss at block 0):
    block 0 gone from both, saved once: evicted, by the store's tier; block 1 held by the store behind the first
    miss: chain_broken; block 2 vLLM stored, the connector never did: not_admitted; block 3 held by vLLM's cache:
    chain_broken; the 8 tokens past the blocks: cold."""
    table = table_of(
        stored("GPU", A[:4], TOKENS[: 4 * BLOCK]),
        stored("cpu", [A[0]], TOKENS[:BLOCK]),
        stored("cpu", [A[1]], TOKENS[BLOCK : 2 * BLOCK], parent=A[0]),
        stored("cpu", [A[3]], TOKENS[3 * BLOCK : 4 * BLOCK], parent=A[2]),
        removed("GPU", [A[0], A[2]]),
    )
    prompt = TOKENS[: 4 * BLOCK] + [7] * 8
    hashes = table.chain(prompt, BLOCK, 4)
    assert hashes == A[:4]
    lookup = look_up(table, hashes, 4, [False, True, False, False], store_tier="dram")
    assert lookup.held == [False, True, False, True]
    assert lookup.fates == ["dram", "dram", "not_admitted", "dram"]
    ledger = EventMissLedger(BLOCK, store_tier="dram")
    ledger.classify(lookup, hit_tokens=0, prompt_tokens=len(prompt))
    causes = ledger.snapshot()
    assert causes == {"cold": 8, "evicted": 32, "chain_broken": 64, "not_admitted": 32, "elsewhere": 0,
                      "evicted_by_tier": {"gpu": 0, "dram": 32}}  # fmt: skip
    assert missed(ledger) == len(prompt)


def test_hits_end_at_the_first_miss_and_a_held_first_miss_is_explained_by_its_history():
    """Two blocks hit (64 cached tokens). Block 2 is the first miss although the store's check found it (its get
    failed, or it went between the check and the engine's lookup): it is counted by its history, evicted by the
    store's tier, as the Mooncake arms count it; block 3 was never named by an event: cold."""
    table = table_of(stored("GPU", A[:3], TOKENS[: 3 * BLOCK]), stored("cpu", A[:3], TOKENS[: 3 * BLOCK]))
    prompt = [*TOKENS[: 4 * BLOCK], 7]
    hashes = table.chain(prompt, BLOCK, 4)
    assert hashes == A[:3]  # the walk stops at the block no event named
    lookup = look_up(table, hashes, 4, [True, True, True], store_tier="ssd")
    ledger = EventMissLedger(BLOCK, store_tier="ssd")
    ledger.classify(lookup, hit_tokens=2 * BLOCK, prompt_tokens=len(prompt))
    causes = ledger.snapshot()
    assert causes["evicted_by_tier"] == {"gpu": 0, "ssd": 32} and causes["cold"] == 32 + 1
    assert causes["chain_broken"] == causes["not_admitted"] == 0
    assert missed(ledger) == len(prompt) - 2 * BLOCK


def test_a_block_is_found_by_its_parent_and_its_tokens_not_by_its_tokens_alone():
    """The same 32 tokens after a different prefix are another block (another hash): not on this chain."""
    table = table_of(stored("GPU", A[:2], TOKENS[: 2 * BLOCK]), stored("GPU", [A[4]], TOKENS[BLOCK : 2 * BLOCK]))
    assert table.chain(TOKENS[: 2 * BLOCK], BLOCK, 2) == A[:2]
    assert table.chain(TOKENS[BLOCK : 2 * BLOCK], BLOCK, 1) == [A[4]]
    assert table.chain([0] * BLOCK + TOKENS[BLOCK : 2 * BLOCK], BLOCK, 2) == []


def test_a_prefix_cache_reset_and_the_connectors_saves_without_tokens():
    """AllBlocksCleared empties vLLM's cache (the store keeps its copies); a connector save that names no tokens
    (it lost track of them) still marks the block saved."""
    table = table_of(stored("GPU", A[:2], TOKENS[: 2 * BLOCK]), {"type": "AllBlocksCleared"},
                     stored("cpu", [A[1]], [], parent=A[0]))  # fmt: skip
    assert [table.blocks[h].held for h in A[:2]] == [set(), {"cpu"}]
    lookup = look_up(table, table.chain([*TOKENS[: 2 * BLOCK], 7], BLOCK, 2), 2, [False, False], store_tier="dram")
    assert lookup.fates == ["not_admitted", "dram"]


@pytest.mark.parametrize("hit_tokens", [0, 32, 64, 96])
def test_the_causes_add_up_to_the_missed_tokens_wherever_the_hits_end(hit_tokens):
    table = table_of(stored("GPU", A[:3], TOKENS[: 3 * BLOCK]), removed("GPU", [A[1]]))
    prompt = TOKENS[: 3 * BLOCK] + [7] * 5
    lookup = look_up(table, table.chain(prompt, BLOCK, 3), 3, [], store_tier=None)
    ledger = EventMissLedger(BLOCK, store_tier=None)
    ledger.classify(lookup, hit_tokens, len(prompt))
    assert missed(ledger) == len(prompt) - hit_tokens


class Store:
    """A store's existence check that holds `held` and records what it was asked."""

    def __init__(self, *held: str) -> None:
        self.held, self.asked = set(held), []

    def exist(self, keys):
        self.asked.append(list(keys))
        return [key in self.held for key in keys]


def batch(timestamp: float, *events: dict) -> bytes:
    return msgpack.packb([timestamp, list(events), 0])


@pytest.fixture
def follower():
    loop = asyncio.new_event_loop()
    events = KvEventFollower("kv-events-test", loop)  # binds 127.0.0.1; no engine connects
    yield events
    events.close()
    loop.close()


def test_a_request_waits_for_the_events_of_the_one_before_it(follower):
    """The previous request's prompt blocks stored by vLLM and saved by the connector: settled at once. Stored by
    vLLM alone (a refused put emits nothing): settled once the engine published nothing for the quiet time. Not
    stored at all: the wait runs out, and is counted. Then the request is looked up: its known blocks asked of the
    store by the connector's keys."""
    requests = RequestMisses(follower, BLOCK, Store("model@" + A[0].hex()), "dram", "model@")
    requests.QUIET_S, requests.TIMEOUT_S = 0.2, 0.5
    prompt = [*TOKENS[: 2 * BLOCK], 7]
    requests.look_up(prompt)  # sent: the next request waits for its blocks
    now = time.time()
    follower.stream.add(0, batch(now, stored("GPU", A[:2], TOKENS[: 2 * BLOCK])), now, "live")
    follower.stream.add(1, batch(now, stored("cpu", A[:2], TOKENS[: 2 * BLOCK])), now, "live")
    started = time.monotonic()
    assert requests.settle() and time.monotonic() - started < 0.1
    requests.look_up([*TOKENS[BLOCK : 3 * BLOCK], 7])  # its blocks (other tokens at the head) stored by vLLM only
    now = time.time()
    follower.stream.add(2, batch(now, stored("GPU", [A[3], A[4]], TOKENS[BLOCK : 3 * BLOCK])), now, "live")
    started = time.monotonic()
    assert requests.settle() and 0.15 < time.monotonic() - started < 0.45
    lookup = requests.look_up([*TOKENS[: 3 * BLOCK], 7])  # nothing will ever be published for it
    assert requests.store.asked[-1] == ["model@" + h.hex() for h in A[:2]]  # the third block: no event named it
    assert lookup.held == [True, True, False] and lookup.fates == ["dram", "dram", "cold"]
    assert not requests.settle() and follower.report()["unsettled_requests"] == 1
    assert follower.report()["batches"] == {"live": 3}


def test_a_requests_save_time_is_the_first_connector_save_of_its_blocks_after_it_was_sent(follower):
    """The first block was saved before the request (held: put again never), the second by its own save, stamped
    by the engine 0.05 s after it was sent; vLLM's own store of a block does not count. A request whose blocks
    were all saved before it has no save time."""
    requests = RequestMisses(follower, BLOCK, Store(), "dram", "model@")
    early = time.time() - 5
    follower.stream.add(0, batch(early, stored("cpu", A[:1], TOKENS[:BLOCK])), early, "live")
    prompt = [*TOKENS[: 2 * BLOCK], 7]
    requests.look_up(prompt)
    sent = time.time()
    follower.stream.add(1, batch(sent + 0.02, stored("GPU", A[:2], TOKENS[: 2 * BLOCK])), sent + 0.02, "live")
    saved = stored("cpu", A[1:2], TOKENS[BLOCK : 2 * BLOCK], parent=A[0])
    follower.stream.add(2, batch(sent + 0.05, saved), sent + 0.05, "live")
    assert requests.saved_after_s() == pytest.approx(0.05, abs=0.02)
    time.sleep(0.06)  # the next request is sent after that save
    requests.look_up(prompt)
    assert requests.saved_after_s() is None
