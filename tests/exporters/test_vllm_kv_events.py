"""The vLLM KV-event source from frames a real vLLM 0.32 published (tests/fixtures/vllm-kv-events, PROVENANCE.md):
decoding, the stream's accounting of gaps, replays, losses and restarts, hostile payloads and configurations. The
source against a real engine, joining late and replaying what it missed: tests/exporters/test_vllm_real.py."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import msgpack
import pytest

from kvscope.exporters.config import ConfigError, parse_config
from kvscope.exporters.normalizer import mapping_for
from kvscope.exporters.vllm_kv_events import EventStream, UndecodableBatch, decode_batch

FIXTURE = Path(__file__).parents[1] / "fixtures" / "vllm-kv-events" / "frames-0.32.0.json"


@pytest.fixture(scope="module")
def captured() -> dict:
    return json.loads(FIXTURE.read_text())


def live_batches(captured: dict) -> list[tuple[int, bytes]]:
    """(sequence, payload) of each live frame."""
    frames = [[base64.b64decode(part) for part in frame] for frame in captured["live"]]
    assert all(topic == b"kv" for topic, _, _ in frames)
    return [(int.from_bytes(sequence, "big"), payload) for _, sequence, payload in frames]


def test_the_captured_batches_decode_to_what_the_engine_did(captured):
    """Three requests of 3 blocks each (the third evicting 2 of the 8 usable blocks), a reset, a fourth request."""
    batches = [decode_batch(payload) for _, payload in live_batches(captured)]
    assert [sum(b.stored.values()) for b in batches] == [3, 3, 3, 3]
    assert [b.removed["gpu"] for b in batches] == [0, 0, 2, 0]
    assert [b.cleared for b in batches] == [0, 0, 0, 1]
    assert {medium for b in batches for medium in b.stored} == {"gpu"}  # vLLM spells it GPU
    assert all(b.unknown == 0 for b in batches)
    assert [b.timestamp for b in batches] == sorted(b.timestamp for b in batches)


def test_the_replay_answer_holds_the_same_batches_and_an_end_marker(captured):
    replies = [[base64.b64decode(part) for part in frame] for frame in captured["replay"]]
    assert [(empty, topic) for empty, topic, _, _ in replies[:-1]] == [(b"", b"kv")] * 4
    assert int.from_bytes(replies[-1][2], "big", signed=True) == -1
    assert [(int.from_bytes(s, "big"), p) for _, _, s, p in replies[:-1]] == live_batches(captured)


def stream_of(batches: list[tuple[int, bytes]], replay_has: dict[int, bytes], order: list[int]) -> EventStream:
    """The stream live batches arriving in `order` make, gaps filled from `replay_has` (as the collector does)."""
    stream = EventStream()
    payloads = dict(batches)
    for sequence in order:
        if missing := stream.missing_before(sequence):
            stream.fill(missing, [(s, replay_has[s]) for s in missing if s in replay_has], 0.0)
        stream.add(sequence, payloads[sequence], 0.0, "live")
    return stream


def test_a_gap_filled_from_the_replay_buffer_counts_every_block_once(captured):
    batches = live_batches(captured)
    stream = stream_of(batches, replay_has={1: batches[1][1], 2: batches[2][1]}, order=[0, 3])
    assert stream.gaps == 1 and stream.batches == {"live": 2, "replay": 2} and not +stream.lost
    assert stream.stored == {"gpu": 12} and stream.removed == {"gpu": 2} and stream.cleared == 1


def test_what_the_replay_buffer_no_longer_holds_is_lost_and_said_to_be(captured):
    batches = live_batches(captured)
    joined_late = stream_of(batches, replay_has={2: batches[2][1]}, order=[3])  # history: 0 and 1 gone
    assert joined_late.lost == {"history": 2} and joined_late.stored == {"gpu": 6}
    dropped = stream_of(batches, replay_has={}, order=[0, 2, 3])  # batch 1 dropped while subscribed
    assert dropped.lost == {"live": 1} and dropped.gaps == 1 and dropped.stored == {"gpu": 9}


def test_a_sequence_that_goes_back_is_a_restarted_engine(captured):
    batches = live_batches(captured)
    stream = stream_of(batches, replay_has={}, order=[0, 1, 2, 0, 1])
    assert stream.restarts == 1 and stream.gaps == 0 and stream.batches["live"] == 5
    assert stream.next_sequence == 2


@pytest.mark.parametrize(
    ("payload", "complaint"),
    [
        (b"\xc1", "not msgpack"),
        (b"\x93\x01", "not msgpack"),  # truncated
        (msgpack.packb({"ts": 1.0}), "not an [timestamp, events"),
        (msgpack.packb(["yesterday", []]), "timestamp is not a number"),
        (msgpack.packb([1.0, {"type": "BlockStored"}]), "events not an array"),
        (msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": 7}]]), "without a block_hashes array"),
        (b"\x91" * 100_000, "not msgpack"),  # nested past the decoder's stack
    ],
)
def test_a_payload_that_is_not_a_batch_is_named_and_counted_without_losing_the_count(captured, payload, complaint):
    with pytest.raises(UndecodableBatch, match=re.escape(complaint)):
        decode_batch(payload)
    stream = EventStream()
    first, good = live_batches(captured)[0]
    stream.add(first, good, 0.0, "live")
    stream.add(first + 1, payload, 0.0, "live")
    assert stream.undecodable == 1 and stream.stored == {"gpu": 3} and stream.next_sequence == first + 2


def test_events_of_a_type_this_version_does_not_know_are_counted_apart():
    batch = decode_batch(
        msgpack.packb([1.0, [{"type": "BlockMoved", "block_hashes": [1]}, {"type": "AllBlocksCleared"}]])
    )
    assert batch.unknown == 1 and batch.cleared == 1 and not batch.stored


@pytest.mark.parametrize(
    "endpoint", ["tcp://127.0.0.1:5557; rm -rf /", "tcp://127.0.0.1", "http://127.0.0.1:5557", "ipc://../$(id)"]
)
def test_an_endpoint_that_is_not_a_zeromq_address_is_refused_by_field(endpoint):
    config = {"targets": [{"name": "events", "source": "vllm_kv_events", "endpoint": endpoint}]}
    with pytest.raises(ConfigError, match=r"targets\.0\.endpoint"):
        parse_config(config)


def test_the_stream_maps_onto_the_kv_tier_model_under_the_targets_engine(captured):
    target = parse_config(
        {"targets": [{"name": "vllm-0", "source": "vllm_kv_events", "endpoint": "tcp://127.0.0.1:1"}]}
    )
    labels = target.targets[0].labels
    assert labels == {"engine": "vllm-0"}
    stream = stream_of(live_batches(captured), replay_has={}, order=[0, 2, 3])
    stream.lag_s = 0.25
    model = {(s.name, tuple(sorted(s.label_map.items()))): s.value for s in mapping_for("vllm_kv_events").apply(
        stream.samples("vllm_kv_events"), labels)}  # fmt: skip
    engine = ("engine", "vllm-0")
    assert model[("kv.events.blocks", (engine, ("event", "stored"), ("medium", "gpu")))] == 9
    assert model[("kv.events.blocks", (engine, ("event", "removed"), ("medium", "gpu")))] == 2
    assert model[("kv.events.cleared", (engine,))] == 1
    assert model[("kv.events.gaps", (engine,))] == 1
    assert model[("kv.events.lost.batches", (engine, ("phase", "live")))] == 1
    assert model[("kv.events.lag", (engine,))] == 0.25
