"""Collapse alerts for live clusters, from what the exporters scrape (the A/B manager watches its own arms).

Two rules, defined in kvscope.api.alerts.RULES with the numbers the shipped Prometheus rules use, evaluated after
every successful scrape of a target, on its normalized samples:
- KVCacheCollapseImminent (predictive), per store system and tier: a least-squares line through the tier's
  allocated bytes over the last `fit_window_s` reaches `watermark` x capacity within `horizon_s` (Prometheus'
  predict_linear) while growing.
- KVCacheHitRateCollapse (live), per engine of each target (every vLLM server calls its first engine "0", as the
  Prometheus rules keep them apart by `target`): the prefix-cache hit ratio over the last `rate_window_s` fell
  below `fraction_of_peak` of its peak of the last `peak_window_s` while the cluster's bytes written over the
  window are at least `writes_floor` of those of the window before: the evict-recompute-rewrite loop.
  Where no engine exports prefix-cache counters, per KV router (NVIDIA Dynamo's) and routing phase of each target:
  its prefix-hit ratio (the cached prefix tokens it expected on the workers it chose over the prompt tokens it
  routed) with the same numbers, the KV events its workers stored (as it applied them) in place of the bytes
  written; not for a frontend one of whose workers (kv.engine.active.blocks' worker_id) exported engine
  prefix-cache query counters under that worker_id within the window: the engines' own ratio is judged there.
Each is pending from the first evaluation that sees it and firing once it has held for `for_s` (Prometheus' `for`);
it resolves when it no longer holds. Ratios are of increases (counter resets count from zero, as increase() does),
never of lifetime counters.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvscope.api.alerts import COLLAPSE, IMMINENT, RULES, AlertBook, State
from kvscope.exporters.scrape import TargetState

_COLLAPSE, _IMMINENT = RULES[COLLAPSE].thresholds, RULES[IMMINENT].thresholds
_ROUTER_PROMPT, _ROUTER_PREFIX = "kv.router.prompt.tokens", "kv.router.prefix.tokens"


def _append(points: deque[tuple[float, float]], ts: float, value: float, keep_s: float) -> None:
    """Append a point and forget those older than `keep_s`, keeping one at or before the cut (the base an increase
    over the last `keep_s` is measured from): the rules only look that far back, so each scrape's work is bounded."""
    points.append((ts, value))
    while len(points) > 1 and points[1][0] <= ts - keep_s:
        points.popleft()


@dataclass
class _Counter:
    """A counter's reset-adjusted running total, sampled at scrape times."""

    points: deque[tuple[float, float]] = field(default_factory=deque)
    last_raw: float | None = None
    total: float = 0.0

    def add(self, ts: float, value: float, keep_s: float) -> None:
        if self.last_raw is not None:
            self.total += value if value < self.last_raw else value - self.last_raw
        self.last_raw = value
        _append(self.points, ts, self.total, keep_s)

    def increase(self, since: float) -> float | None:
        """Increase from the last point at or before `since` to now; None without a point that old."""
        base = next((total for ts, total in reversed(self.points) if ts <= since), None)
        return None if base is None or not self.points else self.points[-1][1] - base


@dataclass
class ClusterWatch:
    book: AlertBook
    window_s: float = _COLLAPSE["rate_window_s"]  # the collapse's rate window and the imminent fit's
    horizon_s: float = _IMMINENT["horizon_s"]
    watermark: float = _IMMINENT["watermark"]
    fraction: float = _COLLAPSE["fraction_of_peak"]
    peak_s: float = _COLLAPSE["peak_window_s"]
    writes_floor: float = _COLLAPSE["writes_floor"]
    for_s: float = _COLLAPSE["for_s"]  # the same for both rules
    _allocated: dict[tuple, deque] = field(default_factory=lambda: defaultdict(deque))
    _capacity: dict[tuple, float] = field(default_factory=dict)
    _counters: dict[tuple, _Counter] = field(default_factory=lambda: defaultdict(_Counter))
    _ratios: dict[tuple, deque] = field(default_factory=lambda: defaultdict(deque))
    _holding_since: dict[tuple, float] = field(default_factory=dict)  # alert key -> when its condition began
    _engine_workers: dict[str, float] = field(default_factory=dict)  # worker_id -> last seen with prefix counters
    _router_workers: dict[str, set[str]] = field(default_factory=dict)  # a frontend's target -> the workers it names

    def __call__(self, state: TargetState) -> None:
        """The scrape loop's callback: fold in a successful scrape, then evaluate both rules."""
        if not state.up or state.config.source == "tierstore":
            return
        now, target = state.scraped_at, state.config.name
        engines, stores, routers, workers = set(), set(), set(), set()
        for sample in state.normalized:
            labels = dict(sample.labels)
            if sample.name in ("kv.tier.allocated.bytes", "kv.tier.capacity.bytes"):
                key = (labels.get("system", ""), labels.get("tier", ""))
                stores.add(key)
                if sample.name == "kv.tier.capacity.bytes":
                    self._capacity[key] = sample.value
                else:
                    _append(self._allocated[key], now, sample.value, self.window_s)
            elif sample.name in ("kv.prefix.hit.tokens", "kv.prefix.query.tokens"):
                if sample.name == "kv.prefix.query.tokens" and labels.get("worker_id"):
                    self._engine_workers[labels["worker_id"]] = now  # a Dynamo worker with engine counters
                if sample.name == "kv.prefix.query.tokens" and labels.get("layer") != "gpu":
                    continue  # the external queries are the GPU misses: counting them too would double count
                engine = (state.config.name, labels.get("engine", state.config.name))
                engines.add(engine)
                self._counters[(sample.name, *engine, labels.get("layer"))].add(now, sample.value, self.window_s)
            elif sample.name == "kv.tier.written.bytes":
                self._counters[("written", target, labels.get("system"), labels.get("tier"))].add(
                    now, sample.value, 2 * self.window_s
                )
            elif sample.name in (_ROUTER_PROMPT, _ROUTER_PREFIX):
                if sample.name == _ROUTER_PREFIX and labels.get("choice") != "selected":
                    continue  # the best eligible worker's prefix: not where the request went
                router = (target, labels.get("router", ""), labels.get("phase", ""))
                routers.add(router)
                self._counters[(sample.name, *router, labels.get("model"))].add(now, sample.value, self.window_s)
            elif sample.name == "kv.router.events" and labels.get("event") == "stored":
                self._counters[("stored", target, labels.get("router", ""), labels.get("status"))].add(
                    now, sample.value, 2 * self.window_s
                )
            elif sample.name == "kv.engine.active.blocks" and labels.get("worker_id"):
                workers.add(labels["worker_id"])  # a frontend's per-worker series: the workers it routes to
        if routers or workers:
            self._router_workers[target] = workers
        for key in stores:
            self._imminent(key, now)
        writes_rising = self._writes_not_falling(now, lambda key: key[0] == "written")
        for engine in engines:
            self._hit_rate(engine, now, writes_rising)
        for router in routers:
            self._router_hit_rate(router, now)

    def _imminent(self, key: tuple[str, str], now: float) -> None:
        capacity = self._capacity.get(key)
        points = [(ts, value) for ts, value in self._allocated[key] if ts >= now - self.window_s]
        labels = {"system": key[0], "tier": key[1]}
        if not capacity or len(points) < 3:
            return
        slope, latest = _slope(points), points[-1][1]
        limit = self.watermark * capacity
        reaches = latest + slope * self.horizon_s >= limit and slope > 0
        seconds = (limit - latest) / slope if slope > 0 else float("inf")
        self.book.set(
            IMMINENT,
            labels,
            self._held(IMMINENT, labels, reaches, now),
            f"{key[1]} of {key[0]} reaches {self.watermark:.0%} of capacity in {max(seconds, 0):.0f} s "
            f"at {slope:,.0f} B/s",
            value=max(seconds, 0.0),
            description="occupancy growth extrapolated over the window: eviction of chain heads is about to start",
        )

    def _held(self, name: str, labels: dict[str, str], holds: bool, now: float) -> State | None:
        """Prometheus' `for`: pending from the first evaluation that sees the condition, firing once it has held
        for `for_s`."""
        key = (name, tuple(sorted(labels.items())))
        if not holds:
            self._holding_since.pop(key, None)
            return None
        since = self._holding_since.setdefault(key, now)  # scrape time: the clock the rules are evaluated on
        return "firing" if now - since >= self.for_s else "pending"

    def _writes_not_falling(self, now: float, writes: Callable[[tuple], bool]) -> bool:
        """Whether the counters whose keys `writes` selects (the tiers' bytes written, a router's stored KV events)
        grew over the window by at least `writes_floor` x their growth over the window before."""
        recent = self._increase_between(writes, now - self.window_s, now)
        before = self._increase_between(writes, now - 2 * self.window_s, now - self.window_s)
        if recent is None:
            return False
        return before is None or recent >= self.writes_floor * before

    def _increase_between(self, writes: Callable[[tuple], bool], start: float, end: float) -> float | None:
        total, seen = 0.0, False
        for key, counter in self._counters.items():
            if not writes(key):
                continue
            at_end = next((t for ts, t in reversed(counter.points) if ts <= end), None)
            at_start = next((t for ts, t in reversed(counter.points) if ts <= start), None)
            if at_end is not None and at_start is not None:
                total, seen = total + at_end - at_start, True
        return total if seen else None

    def _engine_increase(self, name: str, engine: tuple[str, str], now: float) -> float | None:
        """An engine's (target, engine) increase of `name` over the window, summed over layers; None until the window
        is covered."""
        since = now - self.window_s
        return _sum_or_none(
            [c.increase(since) for (n, *key), c in self._counters.items() if n == name and tuple(key[:2]) == engine]
        )

    def _hit_rate(self, engine: tuple[str, str], now: float, writes_not_falling: bool) -> None:
        hits, queries = (
            self._engine_increase("kv.prefix.hit.tokens", engine, now),
            self._engine_increase("kv.prefix.query.tokens", engine, now),
        )
        if hits is None or not queries:
            return
        ratio = hits / queries
        peak = self._trailing_peak(engine, ratio, now)
        collapsed = peak > 0 and ratio < self.fraction * peak and writes_not_falling
        labels = {"target": engine[0], "engine": engine[1]}
        self.book.set(
            COLLAPSE,
            labels,
            self._held(COLLAPSE, labels, collapsed, now),
            f"engine {engine[1]} ({engine[0]}): hit ratio {ratio:.3f} over {self.window_s:.0f} s < "
            f"{self.fraction:g} x its trailing peak {peak:.3f} while bytes written are not falling",
            value=ratio,
            description="evict, recompute, rewrite: the prefix cache is losing chain heads",
        )

    def _trailing_peak(self, key: tuple, ratio: float, now: float) -> float:
        """The highest hit ratio of `key` (an engine, or a router) over the last `peak_s`, `ratio` now included."""
        history = self._ratios[key]
        _append(history, now, ratio, self.peak_s)
        return max(r for ts, r in history if ts >= now - self.peak_s)

    def _router_hit_rate(self, router: tuple[str, str, str], now: float) -> None:
        """A router's (target, router, phase) collapse: its prefix-hit ratio below `fraction` x its trailing peak
        while its workers' stored KV events are not falling, unless a worker it names has engine prefix counters."""
        target, router_id, phase = router
        since = now - self.window_s

        def increase(name: str) -> float | None:
            return _sum_or_none(
                [c.increase(since) for (n, *key), c in self._counters.items() if n == name and tuple(key[:3]) == router]
            )

        expected, routed = increase(_ROUTER_PREFIX), increase(_ROUTER_PROMPT)
        if expected is None or not routed:
            return
        ratio = expected / routed
        peak = self._trailing_peak(("router", *router), ratio, now)
        stored_not_falling = self._writes_not_falling(now, lambda key: key[:3] == ("stored", target, router_id))
        engines_judged = any(self._engine_workers.get(w, -1.0) >= since for w in self._router_workers.get(target, ()))
        collapsed = not engines_judged and peak > 0 and ratio < self.fraction * peak and stored_not_falling
        labels = {"target": target, "router": router_id, "phase": phase}
        self.book.set(
            COLLAPSE,
            labels,
            self._held(COLLAPSE, labels, collapsed, now),
            f"KV router {router_id} ({target}, {phase}): prefix-hit ratio {ratio:.3f} over {self.window_s:.0f} s < "
            f"{self.fraction:g} x its trailing peak {peak:.3f} while its workers' stored KV events are not falling",
            value=ratio,
            description="evict, recompute, store again: the workers' KV caches are losing the prefixes the router "
            "routes to them (no worker of this router exports prefix-cache counters)",
        )


def _sum_or_none(values: list[float | None]) -> float | None:
    return None if not values or None in values else sum(values)  # type: ignore[arg-type]


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of value over time (what predict_linear fits)."""
    n = len(points)
    mean_t = sum(ts for ts, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((ts - mean_t) ** 2 for ts, _ in points)
    return sum((ts - mean_t) * (v - mean_v) for ts, v in points) / var if var else 0.0
