"""One scrape of a source's collector, closed after it: the raw samples a test then maps or compares."""

from __future__ import annotations

import asyncio
import threading

from kvscope.exporters.base import Collector
from kvscope.samples import Sample


def raw_value(raw: list[Sample], name: str, **labels: str) -> float:
    """The sum of the raw samples named `name` whose labels include `labels`: what a mapped series adds up. None
    matching is a mistake in the test (a name or label that is not there), not 0."""
    matching = [s.value for s in raw if s.name == name and all(s.label_map.get(k) == v for k, v in labels.items())]
    assert matching, (name, labels)
    return sum(matching)


def collect_once(collector: Collector) -> list[Sample]:
    async def once() -> list[Sample]:
        try:
            return await collector.collect()
        finally:
            await collector.close()

    return asyncio.run(once())


class CollectorThread:
    """A collector whose scrapes run on an event loop of its own thread, kept between scrapes: for sources that
    hold a subscription (vLLM's KV events) and must keep reading it while a test does other things."""

    def __init__(self, collector: Collector) -> None:
        self.collector = collector
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="collector")
        self._thread.start()

    def collect(self) -> list[Sample]:
        return asyncio.run_coroutine_threadsafe(self.collector.collect(), self._loop).result(30)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.collector.close(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
