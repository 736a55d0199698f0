"""The scrape loop: concurrency, timeouts, failures that stay contained, counter resets, the run loop."""

from __future__ import annotations

import asyncio
import time

from kvscope.exporters.config import parse_config
from kvscope.exporters.scrape import Scraper

GOOD = """\
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0"} %s
"""


def scraper_for(targets: list[dict]) -> Scraper:
    return Scraper(parse_config({"targets": targets}).targets)


def target(name: str, url: str, **extra) -> dict:
    return {"name": name, "source": "vllm", "url": url, "timeout_s": 0.5, **extra}


async def scrape_all(scraper: Scraper):
    try:
        return await scraper.scrape_all()
    finally:
        await scraper.close()


def test_dead_slow_and_garbage_targets_do_not_stall_or_break_the_good_one(metrics_server):
    scraper = scraper_for(
        [
            target("good", metrics_server.serve("/good", GOOD % 42)),
            target("slow", metrics_server.serve("/slow", GOOD % 1, delay_s=3.0)),
            target("garbage", metrics_server.serve("/garbage", "\x00\x01 {{{")),
            target("dead", "http://127.0.0.1:9/metrics"),
        ]
    )
    started = time.monotonic()
    states = {s.config.name: s for s in asyncio.run(scrape_all(scraper))}
    elapsed = time.monotonic() - started
    assert elapsed < 2.5, "targets are scraped concurrently, each bounded by its 0.5 s timeout"
    assert states["good"].up and [s.value for s in states["good"].normalized] == [42.0]
    assert not states["slow"].up and "no answer within 0.5 s" in states["slow"].last_error
    assert not states["garbage"].up and "garbage: not a Prometheus text exposition" in states["garbage"].last_error
    assert not states["dead"].up and "dead: GET http://127.0.0.1:9/metrics failed" in states["dead"].last_error
    assert [states[name].errors for name in ("good", "slow", "garbage", "dead")] == [0, 1, 1, 1]


def test_a_target_that_comes_back_is_up_again_and_a_restart_is_a_reset(metrics_server):
    url = metrics_server.serve("/m", GOOD % 1000)
    scraper = scraper_for([target("vllm-a", url)])

    async def three_scrapes():
        try:
            first = await scraper.scrape("vllm-a")
            assert first.up
            metrics_server.serve("/m", "down", status=503)
            second = await scraper.scrape("vllm-a")
            assert not second.up and second.normalized, "the last good snapshot is kept, marked down"
            metrics_server.serve("/m", GOOD % 10)  # the engine restarted: its counter starts again
            return await scraper.scrape("vllm-a")
        finally:
            await scraper.close()

    state = asyncio.run(three_scrapes())
    assert state.up and state.errors == 1 and state.scrapes == 3
    assert state.reset_count == 1
    reset = state.recent_resets[0]
    assert (reset.name, reset.before, reset.after) == ("vllm:prefix_cache_queries_total", 1000.0, 10.0)


def test_a_reset_is_found_whether_the_series_stayed_in_place_or_not(metrics_server):
    """Series in the last scrape's order are compared by position; moved or new ones by name and labels."""
    gauge = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running %s\n"
    url = metrics_server.serve("/m", GOOD % 1000 + gauge % 3)
    scraper = scraper_for([target("vllm-a", url)])

    async def scrapes(*bodies: str) -> list[int]:
        counts = []
        try:
            for body in bodies:
                metrics_server.serve("/m", body)
                counts.append((await scraper.scrape("vllm-a")).reset_count)
        finally:
            await scraper.close()
        return counts

    in_place = GOOD % 10 + gauge % 1  # the counter went back, the gauge down (not a reset)
    moved = gauge % 1 + GOOD % 5  # the counter went back again, on another line
    assert asyncio.run(scrapes(GOOD % 1000 + gauge % 3, in_place, moved, moved)) == [0, 1, 2, 2]


def test_run_scrapes_on_the_interval_until_stopped(metrics_server):
    scraper = scraper_for([target("vllm-a", metrics_server.serve("/m", GOOD % 5), interval_s=0.1)])

    async def run_for(seconds: float):
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(seconds, stop.set)
        try:
            await scraper.run(stop)
        finally:
            await scraper.close()

    asyncio.run(run_for(0.55))
    assert 4 <= scraper.states["vllm-a"].scrapes <= 7


def test_a_part_that_cannot_be_read_is_counted_by_reason_and_logged_when_it_starts_and_ends(caplog):
    """A collector reports a file it could not read and keeps the rest; the loop counts it per reason and logs the
    change, not every scrape."""
    import logging

    from kvscope.exporters.base import Collector
    from kvscope.exporters.scrape import TargetState, _count_read_errors

    class Partial(Collector):  # no `source` of its own: not registered as a source
        async def collect(self):
            return []

    config = parse_config({"targets": [target("t", "http://127.0.0.1:9/")]}).targets[0]
    state, collector = TargetState(config), Partial(config)
    with caplog.at_level(logging.INFO, logger="kvscope.exporters.scrape"):
        for scrape in range(3):
            if scrape < 2:
                collector.read_error("unparseable", "/sys/class/infiniband/mlx5_0/ports/1/rate", "'N/A'")
            _count_read_errors(state, collector.take_read_errors())
    assert state.read_errors == {"unparseable": 2}
    messages = [record.getMessage() for record in caplog.records]
    assert messages == [
        "t: /sys/class/infiniband/mlx5_0/ports/1/rate: 'N/A' (unparseable)",
        "t: /sys/class/infiniband/mlx5_0/ports/1/rate reads again (it was unparseable)",
    ]
