"""vLLM's KV-cache events (`--kv-events-config`, vLLM 0.9 and later; tested against vLLM 0.32 on the CPU): the
blocks its prefix cache stores and removes (medium GPU), the blocks its KV connector saves (Mooncake's connector
reports them with medium cpu), whole-cache clears, and the health of the stream itself: gaps, batches lost, lag.

The wire (vllm/distributed/kv_events.py): the engine's PUB socket sends each batch as three frames, the topic, an
8-byte big-endian sequence number and a msgpack `EventBatch` = [timestamp, events, data-parallel rank]; an event is
a map tagged by its `type` (`BlockStored` and `BlockRemoved` with `block_hashes` and `medium`, `AllBlocksCleared`).
The optional ROUTER replay endpoint answers a request (an empty frame, then a start sequence as 8 bytes) with every
batch it still buffers from there on, each as (empty frame, topic, sequence, payload), then an end marker whose
sequence is -1.

A sequence number that jumps is a gap (the subscriber joined late, or a high-water mark dropped batches): it is asked
of the replay endpoint at once, and what the engine no longer buffers is counted lost. A sequence number that goes
back is a restarted engine: counted, and the stream starts over from 0. The first batch a subscription receives
shows what was published before it (its sequence number): that history is asked of the replay endpoint too, so the
counters cover the engine's life as far as its buffer reaches, from the moment it next publishes.

Binding: vLLM binds its PUB socket only for an endpoint with a wildcard (`tcp://*:5557`) and connects to any other.
To keep every port on 127.0.0.1, let kvscope bind (`bind: true`, endpoint `tcp://127.0.0.1:P`) and give vLLM the same
endpoint, which it then connects to; vLLM binds its replay endpoint as given (`tcp://127.0.0.1:R`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field

import msgpack
import zmq
import zmq.asyncio
from pydantic import Field, model_validator

from kvscope.exporters.base import CollectError, Collector, TargetConfig
from kvscope.samples import Kind, Sample, labels_of

ENDPOINT_PATTERN = r"^(tcp://[A-Za-z0-9.*\[\]:-]+:[0-9]{1,5}|ipc://[A-Za-z0-9_./-]+)$"
END_OF_REPLAY = -1
MAX_MESSAGE_BYTES = 64 << 20  # a frame larger than this is refused by ZeroMQ before it is read


class KvEventsTargetConfig(TargetConfig):
    endpoint: str = Field(
        pattern=ENDPOINT_PATTERN, description="the engine's KV-event endpoint (tcp://HOST:PORT or ipc://PATH)"
    )
    bind: bool = Field(
        False,
        description="bind the endpoint and let the engine connect (vLLM connects to any endpoint without a "
        "wildcard); false: connect to an engine that binds it",
    )
    replay_endpoint: str | None = Field(
        None, pattern=ENDPOINT_PATTERN, description="the engine's replay endpoint; without it gaps are only counted"
    )
    topic: str = Field("", description="the engine's topic (--kv-events-config topic)")
    replay_timeout_s: float = Field(2.0, gt=0, le=60, description="how long one replay may take")
    max_replay_batches: int = Field(10_000, gt=0, le=1_000_000, description="batches one replay reads at most")

    @model_validator(mode="before")
    @classmethod
    def _engine_label(cls, data: object) -> object:
        """The model's `engine` label: the target's own name unless its labels say otherwise."""
        if isinstance(data, dict) and isinstance(data.get("name"), str):
            labels = data.get("labels") or {}
            if isinstance(labels, dict) and "engine" not in labels:
                data = {**data, "labels": {**labels, "engine": data["name"]}}
        return data


class UndecodableBatch(ValueError):
    """A payload that is not a KV-event batch; the message says what was wrong with it."""


@dataclass(frozen=True, slots=True)
class EventBatch:
    timestamp: float
    stored: Counter[str]  # blocks by medium
    removed: Counter[str]
    cleared: int
    unknown: int  # events of a type this version does not know


def decode_events(payload: bytes) -> tuple[float, list]:
    """One msgpack `EventBatch` payload: its timestamp and its events as they came (maps tagged by `type`);
    UndecodableBatch if it is not one."""
    try:
        data = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as error:
        raise UndecodableBatch(f"not msgpack: {error}") from None
    if not isinstance(data, list | tuple) or len(data) < 2:
        raise UndecodableBatch(f"not an [timestamp, events, ...] array: {type(data).__name__}")
    timestamp, events = data[0], data[1]
    if not isinstance(timestamp, int | float) or isinstance(timestamp, bool) or not isinstance(events, list):
        raise UndecodableBatch("the batch's timestamp is not a number or its events not an array")
    return float(timestamp), events


def decode_batch(payload: bytes) -> EventBatch:
    """One msgpack `EventBatch` payload, counted; UndecodableBatch if it is not one."""
    timestamp, events = decode_events(payload)
    stored: Counter[str] = Counter()
    removed: Counter[str] = Counter()
    cleared = unknown = 0
    for event in events:
        kind = event.get("type") if isinstance(event, dict) else None
        if kind in ("BlockStored", "BlockRemoved"):
            hashes = event.get("block_hashes")
            if not isinstance(hashes, list):
                raise UndecodableBatch(f"a {kind} event without a block_hashes array")
            (stored if kind == "BlockStored" else removed)[_medium(event.get("medium"))] += len(hashes)
        elif kind == "AllBlocksCleared":
            cleared += 1
        else:
            unknown += 1
    return EventBatch(timestamp, stored, removed, cleared, unknown)


def _medium(value: object) -> str:
    """vLLM writes GPU for its prefix cache, Mooncake's connector cpu: one spelling, lower case."""
    return value.lower() if isinstance(value, str) and value else "unspecified"


@dataclass
class EventStream:
    """What the batches of one engine's stream add up to, kept apart from the sockets that carry them."""

    stored: Counter[str] = field(default_factory=Counter)
    removed: Counter[str] = field(default_factory=Counter)
    cleared: int = 0
    unknown_events: int = 0
    batches: Counter[str] = field(default_factory=Counter)  # by how they arrived: live, replay
    gaps: int = 0
    lost: Counter[str] = field(default_factory=Counter)  # by phase: history (before the first batch), live
    restarts: int = 0
    undecodable: int = 0
    lag_s: float | None = None
    next_sequence: int = 0  # the first sequence number not yet accounted for

    def missing_before(self, sequence: int) -> range:
        """The sequence numbers a live batch numbered `sequence` shows were not accounted for; a number that went
        back is a restarted engine, whose stream starts over from 0."""
        if sequence < self.next_sequence:
            self.restarts += 1
            self.next_sequence = 0
        missing = range(self.next_sequence, sequence)
        if missing:
            self.gaps += 1
        return missing

    def add(self, sequence: int, payload: bytes, received_at: float, via: str) -> None:
        """Count one batch: `via` is live or replay."""
        self.next_sequence = sequence + 1
        try:
            batch = decode_batch(payload)
        except UndecodableBatch:
            self.undecodable += 1
            return
        self.batches[via] += 1
        self.stored.update(batch.stored)
        self.removed.update(batch.removed)
        self.cleared += batch.cleared
        self.unknown_events += batch.unknown
        if via == "live":
            self.lag_s = max(0.0, received_at - batch.timestamp)

    def fill(self, missing: range, replayed: list[tuple[int, bytes]], received_at: float) -> None:
        """Count what the replay endpoint gave of `missing` (in order, within it); the rest is lost: history when
        no live batch came before it, else dropped while subscribed."""
        history = self.batches["live"] == 0
        for sequence, payload in replayed:
            self.add(sequence, payload, received_at, "replay")
        self.lost["history" if history else "live"] += len(missing) - len(replayed)

    def samples(self, source: str) -> list[Sample]:
        """The stream's raw samples, under kvscope's own names (vLLM exports none for its events)."""

        def sample(name: str, value: float, kind: Kind = "counter", **labels: str) -> Sample:
            return Sample(source, f"vllm_kv_events_{name}", labels_of(labels), float(value), kind)

        samples = [sample("blocks_stored_total", count, medium=medium) for medium, count in self.stored.items()]
        samples += [sample("blocks_removed_total", count, medium=medium) for medium, count in self.removed.items()]
        samples += [sample("batches_total", self.batches[via], via=via) for via in ("live", "replay")]
        samples += [sample("lost_batches_total", self.lost[phase], phase=phase) for phase in ("history", "live")]
        samples += [
            sample("all_blocks_cleared_total", self.cleared),
            sample("unknown_events_total", self.unknown_events),
            sample("gaps_total", self.gaps),
            sample("restarts_total", self.restarts),
            sample("undecodable_batches_total", self.undecodable),
            sample("next_sequence", self.next_sequence, "gauge"),
        ]
        if self.lag_s is not None:
            samples.append(sample("lag_seconds", self.lag_s, "gauge"))
        return samples


class VllmKvEventsCollector(Collector):
    """Subscribes on the first scrape and keeps the subscription: every scrape returns the stream's counters."""

    source = "vllm_kv_events"
    Config = KvEventsTargetConfig
    config: KvEventsTargetConfig

    def __init__(self, config: KvEventsTargetConfig) -> None:
        super().__init__(config)
        self.stream = EventStream()
        self._context = zmq.asyncio.Context()
        self._subscriber: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None

    async def collect(self) -> list[Sample]:
        if self._task is None:
            self._subscribe()
            self._task = asyncio.create_task(self._follow(), name=f"{self.config.name} KV events")
        elif self._task.done():
            error = self._task.exception()
            raise CollectError(f"{self.config.name}: the KV-event subscription ended: {error!r}")
        return self.stream.samples(self.source)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._subscriber is not None:
            self._subscriber.close(linger=0)
        self._context.destroy(linger=0)

    def _subscribe(self) -> None:
        subscriber = self._context.socket(zmq.SUB)
        subscriber.setsockopt(zmq.LINGER, 0)
        subscriber.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        subscriber.setsockopt(zmq.SUBSCRIBE, self.config.topic.encode())
        try:
            (subscriber.bind if self.config.bind else subscriber.connect)(self.config.endpoint)
        except zmq.ZMQError as error:
            subscriber.close(linger=0)
            verb = "bind" if self.config.bind else "connect to"
            raise CollectError(f"{self.config.name}: cannot {verb} {self.config.endpoint}: {error}") from None
        self._subscriber = subscriber

    async def _follow(self) -> None:
        """Count live batches, filling every gap from the replay buffer. The SUB socket is read all the time: it
        tells a connecting engine its subscription only when it is used, and until then the engine drops batches."""
        assert self._subscriber is not None
        while True:
            frames = await self._subscriber.recv_multipart()
            received_at = time.time()
            if len(frames) != 3 or len(frames[1]) != 8:
                self.stream.undecodable += 1
                continue
            sequence = int.from_bytes(frames[1], "big", signed=True)
            missing = self.stream.missing_before(sequence)
            if missing:
                replayed = await self._replay(missing) if self.config.replay_endpoint else []
                self.stream.fill(missing, replayed, time.time())
            self.stream.add(sequence, frames[2], received_at, "live")

    async def _replay(self, missing: range) -> list[tuple[int, bytes]]:
        """The buffered batches of `missing`, in order, within the replay's time and batch bounds."""
        start, stop = missing.start, missing.stop
        assert self.config.replay_endpoint
        requester = self._context.socket(zmq.DEALER)
        requester.setsockopt(zmq.LINGER, 0)
        requester.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        got: list[tuple[int, bytes]] = []
        try:
            requester.connect(self.config.replay_endpoint)
            await requester.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self.config.replay_timeout_s
            for _ in range(min(stop - start, self.config.max_replay_batches) + 1):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not await requester.poll(remaining * 1000):
                    break
                frames = await requester.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    self.stream.undecodable += 1
                    continue
                sequence = int.from_bytes(frames[2], "big", signed=True)
                if sequence == END_OF_REPLAY or sequence >= stop:
                    break
                if sequence >= start and (not got or sequence > got[-1][0]):
                    got.append((sequence, frames[3]))
        except zmq.ZMQError:
            pass  # a replay endpoint that is not there: what it would have given is counted lost
        finally:
            requester.close(linger=0)
        return got
