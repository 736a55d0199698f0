"""The scrape loop: every target on its own interval, concurrently, each scrape bounded by its timeout.

A dead, slow or garbage-speaking target marks itself down and counts an error; it never stalls or crashes the
others. Each successful scrape is normalized with the source's mapping and replaces the target's snapshot, which
is all the OpenTelemetry callbacks ever read. A counter that goes backwards is a reset (a restarted vLLM or
Mooncake): it is counted and reported, and consumers take increases the way Prometheus' increase() does. A part
of a target that could not be read (exporters.base.ReadError) is counted per reason, and logged when it starts
failing and when it reads again, not at every scrape.

Isolation: each scrape is bounded by its target's `timeout_s` (asyncio.timeout); past it the target is down with
`<target>: no answer within N s` and the loop moves on. A source's blocking work (file reads, a blocking RPC
client) runs on threads of its target's own (`Collector.blocking`), never on the event loop's shared executor, so a
read that never returns holds one thread of one target: while it is stuck that target's scrapes fail at once
(`<target>: <what> still blocked after N s`), each counted as a `timeout` read error, and every other target keeps
its threads and its interval. Those threads are daemons, and the loop never waits for them: when `stop` is set a
scrape still in progress gets STOP_GRACE_S, each close() CLOSE_S, so `kvscope scrape` ends on SIGINT or SIGTERM
within a second or two, and `--once` returns, however long a read is stuck.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvscope.exporters.base import CollectError, Collector, ReadError, TargetConfig, collectors
from kvscope.exporters.normalizer import Normalizer, mapping_for
from kvscope.samples import Labels, Sample


@dataclass(frozen=True, slots=True)
class CounterReset:
    target: str
    name: str
    labels: Labels
    before: float
    after: float
    at: float  # unix time of the scrape that saw it


@dataclass
class TargetState:
    """What the loop knows of one target; replaced field by field, read by the exporters' callbacks."""

    config: TargetConfig
    up: bool = False
    scrapes: int = 0
    errors: int = 0
    last_error: str | None = None
    duration_s: float = 0.0
    scraped_at: float = 0.0
    raw: list[Sample] = field(default_factory=list)
    normalized: list[Sample] = field(default_factory=list)
    reset_count: int = 0
    recent_resets: deque[CounterReset] = field(default_factory=lambda: deque(maxlen=100))
    read_errors: Counter[str] = field(default_factory=Counter)  # by reason, since the start
    failing: dict[tuple[str, str], ReadError] = field(default_factory=dict)  # (what, reason) the last scrape hit


log = logging.getLogger(__name__)

STOP_GRACE_S = 0.5  # when stopped, how long a scrape in progress may take to finish before it is abandoned
CLOSE_S = 0.5  # how long a collector's close() may take before it is abandoned (its threads left to end alone)


class Scraper:
    def __init__(
        self,
        targets: list[TargetConfig],
        on_scrape: Callable[[TargetState], None] | None = None,
    ) -> None:
        sources = collectors()
        self.states = {target.name: TargetState(target) for target in targets}
        self._collectors: dict[str, Collector] = {t.name: sources[t.source](t) for t in targets}
        self._normalizers = {t.name: Normalizer(mapping_for(t.source), t.labels) for t in targets}
        self._on_scrape = on_scrape

    async def scrape(self, name: str) -> TargetState:
        """One scrape of one target; failures are recorded on its state, never raised."""
        state = self.states[name]
        started = time.monotonic()
        state.scrapes += 1
        collector = self._collectors[name]
        try:
            async with asyncio.timeout(state.config.timeout_s):  # no task of its own, as wait_for makes
                raw = await collector.collect()
        except TimeoutError:
            self._fail(state, f"{name}: no answer within {state.config.timeout_s:g} s")
        except CollectError as error:
            self._fail(state, str(error))
        except Exception as error:  # a bug in a source must not take the loop down; it is reported as an error
            self._fail(state, f"{name}: {type(error).__name__}: {error}")
        else:
            now = time.time()
            resets = _resets(name, state.raw, raw, now)
            state.reset_count += len(resets)
            state.recent_resets.extend(resets)
            state.raw = raw
            state.normalized = self._normalizers[name].apply(raw)
            state.up, state.last_error, state.scraped_at = True, None, now
        _count_read_errors(state, collector.take_read_errors())
        state.duration_s = time.monotonic() - started
        if self._on_scrape:
            self._on_scrape(state)
        return state

    async def scrape_all(self) -> list[TargetState]:
        """One concurrent round over every target."""
        return list(await asyncio.gather(*(self.scrape(name) for name in self.states)))

    async def run(self, stop: asyncio.Event) -> None:
        """Scrape every target on its interval until `stop` is set; a scrape still in progress then gets
        STOP_GRACE_S to finish and is abandoned after it (a thread stuck in a read is never waited for)."""
        stopped = asyncio.ensure_future(stop.wait())
        loops = [asyncio.ensure_future(self._loop(name, stop, stopped)) for name in self.states]
        try:
            done, _ = await asyncio.wait([*loops, stopped], return_when=asyncio.FIRST_COMPLETED)
            if stopped in done and loops:
                await asyncio.wait(loops, timeout=STOP_GRACE_S)
        finally:
            stopped.cancel()
            for task in loops:
                task.cancel()
            outcomes = await asyncio.gather(*loops, return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, Exception):  # an on_scrape callback that failed
                raise outcome

    async def close(self) -> None:
        """Close every collector, each bounded by CLOSE_S: one whose reads are stuck does not hold up the rest."""
        await asyncio.gather(*(self._close(name, collector) for name, collector in self._collectors.items()))

    @staticmethod
    async def _close(name: str, collector: Collector) -> None:
        try:
            await asyncio.wait_for(collector.close(), CLOSE_S)
        except TimeoutError:
            log.warning("%s: close() did not finish within %g s; left to finish on its own", name, CLOSE_S)
        except Exception as error:  # e.g. CollectError: a read of the target is still stuck
            log.warning("%s: not closed cleanly: %s", name, error)

    async def _loop(self, name: str, stop: asyncio.Event, stopped: asyncio.Future) -> None:
        """Scrape `name` every interval until `stop` is set (`stopped`: its wait, shared by every target's loop)."""
        interval = self.states[name].config.interval_s
        next_at = time.monotonic()
        while not stop.is_set():
            await self.scrape(name)
            next_at += interval
            next_at = max(next_at, time.monotonic())  # a scrape that overran its interval is not made up for
            await asyncio.wait([stopped], timeout=next_at - time.monotonic())

    @staticmethod
    def _fail(state: TargetState, message: str) -> None:
        state.up = False
        state.errors += 1
        state.last_error = message


def _count_read_errors(state: TargetState, errors: list[ReadError]) -> None:
    """Count this scrape's read errors by reason; log each (what, reason) when it starts failing and when it stops."""
    state.read_errors.update(error.reason for error in errors)
    now = {(error.what, error.reason): error for error in errors}
    target = state.config.name
    for key in now.keys() - state.failing.keys():
        log.warning("%s: %s: %s (%s)", target, key[0], now[key].detail, key[1])
    for key in state.failing.keys() - now.keys():
        log.info("%s: %s reads again (it was %s)", target, key[0], key[1])
    state.failing = now


def _resets(target: str, before: list[Sample], after: list[Sample], now: float) -> list[CounterReset]:
    """Counters lower than in the previous scrape: each one a restarted source. A scrape with the last one's series
    in the same order is compared position by position (a sample the source kept, the same object, is skipped);
    any other by name and labels."""
    if len(before) == len(after):
        resets = []
        for old, new in zip(before, after, strict=True):
            if old is new:
                continue
            if old.name != new.name or old.labels != new.labels:
                break
            if new.kind == "counter" and old.kind == "counter" and new.value < old.value:
                resets.append(CounterReset(target, new.name, new.labels, old.value, new.value, now))
        else:
            return resets
    last = _counters(before)
    return [
        CounterReset(target, name, labels, last[(name, labels)], value, now)
        for (name, labels), value in _counters(after).items()
        if value < last.get((name, labels), float("-inf"))
    ]


def _counters(samples: list[Sample]) -> dict[tuple[str, Labels], float]:
    return {(s.name, s.labels): s.value for s in samples if s.kind == "counter"}
