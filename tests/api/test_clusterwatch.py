"""Collapse alerts on live clusters, from scrapes of normalized samples worked out by hand."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvscope.api.alerts import COLLAPSE, IMMINENT, RULES, AlertBook
from kvscope.api.clusterwatch import ClusterWatch
from kvscope.exporters.base import TargetConfig
from kvscope.exporters.scrape import TargetState
from kvscope.samples import Sample, labels_of

GB = 1e9


def scrape(ts: float, *samples: tuple[str, float, dict], source: str = "mooncake", name: str = "") -> TargetState:
    state = TargetState(TargetConfig(name=name or f"{source}-0", source=source), up=True, scraped_at=ts)
    kind = {"kv.tier.allocated.bytes": "gauge", "kv.tier.capacity.bytes": "gauge", "kv.engine.active.blocks": "gauge"}
    state.normalized = [
        Sample(source, name, labels_of(labels), value, kind.get(name, "counter"), True)
        for name, value, labels in samples
    ]
    return state


def occupancy(ts: float, allocated: float) -> TargetState:
    tier = {"system": "mooncake", "tier": "dram"}
    return scrape(ts, ("kv.tier.allocated.bytes", allocated, tier), ("kv.tier.capacity.bytes", 100 * GB, tier))


def states(book: AlertBook, name: str) -> list[str]:
    return [alert.state for alert in book.list() if alert.name == name]


def test_occupancy_growing_into_capacity_within_the_horizon_fires_imminent():
    book = AlertBook()
    watch = ClusterWatch(book, window_s=300, horizon_s=600, watermark=0.95, for_s=120)
    for minute in range(5):  # 50 GB growing 1 GB a minute: 95 GB in 45 minutes, beyond a 10-minute horizon
        watch(occupancy(minute * 60.0, 50 * GB + minute * GB))
    assert states(book, IMMINENT) == []
    seen = []
    for minute in range(5, 10):  # now 10 GB a minute from 54 GB: 95 GB within 10 minutes
        watch(occupancy(minute * 60.0, 54 * GB + (minute - 4) * 10 * GB))
        seen.append(tuple(states(book, IMMINENT)))
    assert seen[-1] == ("firing",) and seen[-1 - 2] == ("pending",)  # pending for 2 minutes (for_s), then firing
    (alert,) = book.list()
    assert (alert.name, alert.state, alert.labels) == (IMMINENT, "firing", {"system": "mooncake", "tier": "dram"})
    assert alert.value is not None and alert.value < 600
    for minute in range(10, 16):  # eviction holds it flat under the watermark: resolved
        watch(occupancy(minute * 60.0, 90 * GB))
    assert states(book, IMMINENT) == ["resolved"]


def engine_scrape(ts: float, hits: float, queries: float, written: float) -> list[TargetState]:
    engine = {"engine": "vllm-0", "layer": "gpu"}
    vllm = scrape(
        ts, ("kv.prefix.hit.tokens", hits, engine), ("kv.prefix.query.tokens", queries, engine), source="vllm"
    )
    store = scrape(ts, ("kv.tier.written.bytes", written, {"system": "mooncake", "tier": "dram"}))
    return [store, vllm]


def test_a_hit_ratio_falling_while_writes_rise_goes_pending_then_firing_then_resolves():
    book = AlertBook()
    watch = ClusterWatch(book, window_s=120, fraction=0.9, for_s=60)
    steady = [(800.0, 1000.0, 1 * GB)] * 6
    collapse = [(200.0, 1000.0, 3 * GB)] * 4
    watch_states = []
    hits = queries = written = 0.0
    for minute, (dh, dq, dw) in enumerate(steady + collapse + steady * 2):
        hits, queries, written = hits + dh, queries + dq, written + dw
        for state in engine_scrape(minute * 60.0, hits, queries, written):
            watch(state)
        watch_states.append(tuple(states(book, COLLAPSE)))
    assert watch_states[5] == ()  # steady at 0.8
    assert watch_states[6] == ("pending",)  # the first scrape that sees it
    assert watch_states[7] == ("firing",)  # held for for_s (a minute)
    assert watch_states[-1] == ("resolved",)
    (alert,) = [a for a in book.list() if a.name == COLLAPSE]
    assert alert.labels == {"target": "vllm-0", "engine": "vllm-0"} and alert.fired_at is not None


def test_two_servers_engines_0_are_two_engines():
    """Every vLLM server calls its first engine "0": each is judged on its own counters, named by its target, so a
    healthy server neither hides the other's collapse nor reads its counters as resets."""
    book = AlertBook()
    watch = ClusterWatch(book, window_s=120, for_s=60)
    gpu = {"engine": "0", "layer": "gpu"}
    totals = {"vllm-a": [0.0, 0.0], "vllm-b": [0.0, 0.0]}
    written = 0.0
    for minute in range(14):
        written += GB if minute < 6 else 3 * GB
        watch(scrape(minute * 60.0, ("kv.tier.written.bytes", written, {"system": "mooncake", "tier": "dram"})))
        for target, (steady, collapsed) in {"vllm-a": (800.0, 100.0), "vllm-b": (500.0, 500.0)}.items():
            totals[target][0] += steady if minute < 6 else collapsed
            totals[target][1] += 1000.0
            hits, queries = totals[target]
            watch(
                scrape(
                    minute * 60.0,
                    ("kv.prefix.hit.tokens", hits, gpu),
                    ("kv.prefix.query.tokens", queries, gpu),
                    source="vllm",
                    name=target,
                )
            )
    (alert,) = [a for a in book.list() if a.name == COLLAPSE]
    assert (alert.state, alert.labels, alert.value) == ("firing", {"target": "vllm-a", "engine": "0"}, 0.1)


def test_a_restarted_engine_is_not_a_collapse():
    """Counters back to zero after a restart: increases count from zero, the ratio stays 0.8."""
    book = AlertBook()
    watch = ClusterWatch(book, window_s=120)
    for minute in range(6):
        for state in engine_scrape(minute * 60.0, 800.0 * minute, 1000.0 * minute, GB * minute):
            watch(state)
    for minute in range(6, 12):  # restarted: counters begin again near zero
        n = minute - 5
        for state in engine_scrape(minute * 60.0, 800.0 * n, 1000.0 * n, GB * (minute + 1)):
            watch(state)
    assert states(book, COLLAPSE) == []


ROUTER, WORKER = "1883717788244607475", "16043297272919392144"


def dynamo_scrapes(
    minutes: int, collapse_at: int, stored_after: Callable[[int], float], worker_counters: bool
) -> list[list[TargetState]]:
    """A Dynamo frontend's scrapes, a minute apart: its router routes 7680 prompt tokens a minute and expects 0.7 of
    them cached on the workers it chose until `collapse_at`, then 0.1 (the best eligible worker's prefix stays at
    0.8: not where the requests went), its workers storing 100 KV events a minute, then `stored_after(n)` in the
    n-th minute after; it names one worker, whose own scrape carries engine prefix-cache counters under that
    worker's id if `worker_counters`."""
    scrapes, routed, selected, best, stored = [], 0.0, 0.0, 0.0, 0.0
    route = {"router": ROUTER, "model": "tiny", "phase": "aggregated"}
    for minute in range(minutes):
        after = minute >= collapse_at
        routed, best = routed + 7680, best + 0.8 * 7680
        selected += (0.1 if after else 0.7) * 7680
        stored += stored_after(minute - collapse_at) if after else 100
        frontend = scrape(
            minute * 60.0,
            ("kv.router.prompt.tokens", routed, route),
            ("kv.router.prefix.tokens", selected, {**route, "choice": "selected"}),
            ("kv.router.prefix.tokens", best, {**route, "choice": "best_eligible"}),
            ("kv.router.events", stored, {"router": ROUTER, "event": "stored", "status": "ok"}),
            ("kv.router.events", stored / 2, {"router": ROUTER, "event": "removed", "status": "ok"}),
            ("kv.engine.active.blocks", 8.0, {"engine": "0", "worker_id": WORKER}),
            source="dynamo",
            name="dynamo-frontend",
        )
        engine = {"engine": "0", "layer": "gpu", "worker_id": WORKER}
        counters = [("kv.prefix.hit.tokens", 0.7 * routed, engine), ("kv.prefix.query.tokens", routed, engine)]
        usage = ("kv.engine.cache.usage", 0.5, {"engine": "0", "worker_id": WORKER})
        worker = scrape(minute * 60.0, usage, *(counters if worker_counters else []), source="dynamo", name="w-0")
        scrapes.append([frontend, worker])
    return scrapes


def test_a_routers_prefix_hit_ratio_collapses_where_no_engine_exports_prefix_counters():
    """Mocker workers export no prefix-cache counters: the router's ratio falls from 0.7 to 0.1 while its workers
    store four times as many KV events (recomputed prefixes stored again): pending, then firing after for_s, per
    router and phase; resolved once its ratio is back."""
    book = AlertBook()
    watch = ClusterWatch(book, window_s=120, for_s=60)
    seen = []
    for scrapes in dynamo_scrapes(12, collapse_at=6, stored_after=lambda n: 400.0, worker_counters=False):
        for state in scrapes:
            watch(state)
        seen.append(tuple(states(book, COLLAPSE)))
    assert seen[:7] == [()] * 7  # the 2-minute ratio is 0.4 at minute 7, above half of 0.7
    assert seen[7:] == [("pending",), ("firing",), ("firing",), ("firing",), ("firing",)]
    (alert,) = book.list()
    assert alert.labels == {"target": "dynamo-frontend", "router": ROUTER, "phase": "aggregated"}
    assert alert.value == pytest.approx(0.1)


def test_a_routers_collapse_is_left_to_the_engines_where_its_worker_exports_prefix_counters():
    """The same router series, its worker exporting engine prefix-cache counters under the id the frontend names it
    by (a Dynamo vLLM worker): the router is not judged, and the engine, which holds 0.7, raises nothing."""
    book = AlertBook()
    watch = ClusterWatch(book, window_s=120, for_s=60)
    for scrapes in dynamo_scrapes(12, collapse_at=6, stored_after=lambda n: 400.0, worker_counters=True):
        for state in scrapes:
            watch(state)
    assert book.list() == []


def test_a_routers_ratio_falling_while_its_workers_store_less_is_not_a_collapse():
    """The traffic drains: the workers store 0.6 x as many KV events each minute as the minute before."""
    book = AlertBook()
    watch = ClusterWatch(book, window_s=120, for_s=60)
    for scrapes in dynamo_scrapes(
        12, collapse_at=6, stored_after=lambda n: 100 * 0.6 ** (n + 1), worker_counters=False
    ):
        for state in scrapes:
            watch(state)
    assert book.list() == []


def test_the_embedded_stores_are_left_to_the_ab_manager():
    book = AlertBook()
    watch = ClusterWatch(book)
    for minute in range(10):
        watch(
            scrape(minute * 60.0, ("kv.tier.allocated.bytes", minute * 20 * GB, {"tier": "dram"}), source="tierstore")
        )
    assert book.list() == []


def test_the_watch_follows_the_alert_definitions():
    """Its defaults are the numbers of alerts.RULES, which the shipped Prometheus rules use."""
    watch = ClusterWatch(AlertBook())
    collapse, imminent = RULES[COLLAPSE].thresholds, RULES[IMMINENT].thresholds
    assert (watch.fraction, watch.peak_s, watch.window_s, watch.writes_floor, watch.for_s) == (
        collapse["fraction_of_peak"], collapse["peak_window_s"], collapse["rate_window_s"], collapse["writes_floor"],
        collapse["for_s"],
    )  # fmt: skip
    assert (watch.watermark, watch.horizon_s, watch.window_s, watch.for_s) == (
        imminent["watermark"], imminent["horizon_s"], imminent["fit_window_s"], imminent["for_s"],
    )  # fmt: skip
