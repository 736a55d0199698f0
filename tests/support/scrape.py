"""One scrape of a source's collector, closed after it: the raw samples a test then maps or compares."""

from __future__ import annotations

import asyncio

from kvscope.exporters.base import Collector
from kvscope.samples import Sample


def collect_once(collector: Collector) -> list[Sample]:
    async def once() -> list[Sample]:
        try:
            return await collector.collect()
        finally:
            await collector.close()

    return asyncio.run(once())
