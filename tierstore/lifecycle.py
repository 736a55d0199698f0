"""Block lifecycle per tier, with the meaning vLLM's `--kv-cache-metrics` gives it (vllm/v1/core/kv_cache_metrics.py):

- lifetime: from a block's store in the tier (vLLM: its allocation) to its eviction;
- idle before eviction: from its last access (its store when it was never accessed) to its eviction;
- reuse gap: between two consecutive accesses of it. An access is a hit the tier served (vLLM: a prefix-cache hit
  touching the block); the store is none, so a block's first hit has no gap.

Times are on the A/B's request clock (kvscope.tierstore.engine.RequestClock), in seconds, counted in vLLM's buckets
(`BOUNDS`).

As vLLM follows a sample of the blocks (`--kv-cache-metrics-sample`, 1% by default), the tiers follow one chain
position in SAMPLE_EVERY: the positions p with (p + phase) % SAMPLE_EVERY == 0, the phase a stable hash of the chain's
head, so that every chain is sampled along its length (short chains too) and a block, whose key fixes its position,
is followed in every chain it is part of. Positions are known where chains pass: a hit's run and the engine's puts
(`follow`); a block moved to another tier stays followed there. A followed block's record (`Followed`: its store
time and last hit) is its entry's value in the tier's index, its size as an int, so a hit looks at every
SAMPLE_EVERY-th block of its run and at nothing else, and an eviction costs nothing more: when the tier drops the
record, its finalizer (CPython frees an object the moment its last reference goes) counts the lifetime and idle time.
Testing every block a hit or an eviction touches against a set of the followed ones cost 15% of a request on the
long-output stream (bench/sim.py); this costs 2-4% of its instructions.

vLLM records a block's last three reuse gaps when it is evicted; here each gap is recorded at the hit that ends it,
so the blocks still stored count too.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import TYPE_CHECKING

from kvscope.tierstore.policies import stable_number

if TYPE_CHECKING:
    from kvscope.tierstore.tier import Tier

Key = Hashable

BOUNDS: tuple[float, ...] = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
    1200.0, 1800.0,
)  # fmt: skip
"""vLLM's KV_CACHE_RESIDENCY_BUCKETS (vllm/v1/metrics/buckets.py): upper bounds in seconds, +Inf implied."""

# The bounds a nanosecond up (vLLM measures in nanoseconds): a gap of one request interval, a difference of two
# float times, lands in the bound's bucket and not the next one
_EDGES = tuple(bound + 1e-9 for bound in BOUNDS)

SAMPLE_EVERY = 256
"""The tiers follow one chain position in this many (vLLM follows 1% of its blocks by default): thousands of
observations in the A/B of a long chat (examples/long_output.yaml: 1,500 evictions of the DRAM-only arm's tier)."""

QUANTITIES = ("lifetime", "idle_before_evict", "reuse_gap")
_PENDING = 4096  # observations kept before they are counted into buckets, per quantity


@dataclass(slots=True)
class Histogram:
    """Observations in BOUNDS' buckets (`buckets[i]`: at most BOUNDS[i], not cumulative; the last one above every
    bound), their number and their sum in seconds."""

    buckets: list[int] = field(default_factory=lambda: [0] * (len(BOUNDS) + 1))
    count: int = 0
    sum: float = 0.0

    def add(self, seconds: Sequence[float]) -> None:
        """Count observations, by C loops (a time before another, from a clock that recorded a request's steps
        overlapping the next one's, counts as 0)."""
        values = list(map(max, seconds, repeat(0.0)))
        self.count += len(values)
        self.sum += sum(values)
        buckets = self.buckets
        for index, blocks in Counter(map(bisect_left, repeat(_EDGES), values)).items():
            buckets[index] += blocks

    def plus(self, seconds: Sequence[float]) -> Histogram:
        """A copy with `seconds` observed too."""
        histogram = Histogram(list(self.buckets), self.count, self.sum)
        histogram.add(seconds)
        return histogram

    def cumulative(self) -> list[int]:
        """Observations at most each bound, as Prometheus buckets count them (the +Inf one is `count`)."""
        total, running = [], 0
        for blocks in self.buckets[:-1]:
            running += blocks
            total.append(running)
        return total

    def as_dict(self) -> dict:
        return {"buckets": self.cumulative(), "count": self.count, "sum": self.sum}


def first_sampled(head: Key, position: int) -> int:
    """How far after `position` the first followed position comes in the chain that starts with `head`: the positions
    p with (p + the head's hash) % SAMPLE_EVERY == 0. The hash is the same in every process, and mixed (a tuple's):
    an int hashes as itself, and the small ids of a trace would sample the heads they share."""
    return (-position - hash((head if type(head) is int else stable_number(head),))) % SAMPLE_EVERY


def follow(tiers: Iterable[Tier], head: Key, blocks: Sequence[Key], position: int) -> None:
    """`blocks`, consecutive blocks of the chain that starts with `head` from `position` on, were just saved to
    `tiers`: each follows the sampled ones it stored."""
    first = first_sampled(head, position)
    if first < len(blocks):
        followed = blocks[first::SAMPLE_EVERY]
        for tier in tiers:
            tier.follow(followed)


class Followed(int):
    """A followed block's size (what the tier's index holds for a block) with its lifecycle (`BlockLifecycle.record`):
    when it was stored in the tier and last hit. When the tier drops it, the block was evicted, unless `lifecycle`
    was cleared first (the block moved to another tier)."""

    lifecycle: BlockLifecycle | None
    stored: float
    hit: float | None = None

    def __del__(self) -> None:
        lifecycle = self.lifecycle
        if lifecycle is not None:
            lifecycle.evicted(self.stored, self.hit)


class BlockLifecycle:
    """One tier's followed blocks: what their evictions and hits observed, kept as seconds and counted into the
    histograms a few thousand at a time. The arm's thread serves it; a scrape's thread reads it (`histograms`)."""

    def __init__(self) -> None:
        # The request clock: set by a store whose steps it follows (TieredStore.at), or asked of `time` (set by the
        # engine) when a followed block needs it, so that nothing is done per request
        self._now = 0.0
        self.time: Callable[[], float] | None = None
        self._histograms = {quantity: Histogram() for quantity in QUANTITIES}
        self._pending: dict[str, list[float]] = {quantity: [] for quantity in QUANTITIES}
        # A scrape sees the observations before or after they are counted; reentrant, as a finalizer may count in the
        # middle of anything
        self._counting = threading.RLock()

    @property
    def now(self) -> float:
        return self._now if self.time is None else self.time()

    @now.setter
    def now(self, seconds: float) -> None:
        self._now = seconds

    def record(self, nbytes: int) -> Followed:
        """A block of `nbytes` stored now, followed from now: its index value."""
        record = Followed(nbytes)
        record.lifecycle, record.stored = self, self.now
        return record

    def hit(self, index: Mapping[Key, int], keys: Sequence[Key], first: int, end: int) -> None:
        """The tier (its `index`) served `keys[first:end]`, `first` a followed position: each followed block's gap
        since its previous hit."""
        now, gaps = self.now, self._pending["reuse_gap"]
        for record in map(index.__getitem__, keys[first:end:SAMPLE_EVERY]):
            if type(record) is Followed:
                if record.hit is not None:
                    gaps.append(now - record.hit)
                record.hit = now
        if len(gaps) > _PENDING:
            self._count("reuse_gap")

    def evicted(self, stored: float, hit: float | None) -> None:
        """A followed block stored at `stored` and last hit at `hit` was evicted now."""
        pending, now = self._pending, self.now
        pending["lifetime"].append(now - stored)
        pending["idle_before_evict"].append(now - (stored if hit is None else hit))
        if len(pending["lifetime"]) > _PENDING:
            self._count("lifetime")
            self._count("idle_before_evict")

    @property
    def histograms(self) -> dict[str, Histogram]:
        """Each quantity's histogram with every observation so far (copies: what is kept does not change)."""
        with self._counting:
            return {quantity: counted.plus(self._pending[quantity]) for quantity, counted in self._histograms.items()}

    def snapshot(self) -> dict[str, dict]:
        """Each quantity's histogram: Prometheus-style cumulative buckets (one per bound), count and sum."""
        return {quantity: histogram.as_dict() for quantity, histogram in self.histograms.items()}

    def _count(self, quantity: str) -> None:
        with self._counting:
            pending = self._pending[quantity]
            self._histograms[quantity].add(pending)
            pending.clear()


def lifecycle_report(tiers: Iterable[Tier]) -> dict:
    """The A/B contract's `block_lifecycle` of these tiers (kvscope.tierstore.contract.BlockLifecycle)."""
    return {
        "bounds_s": list(BOUNDS),
        "sampled_every": SAMPLE_EVERY,
        "tiers": {tier.name: tier.lifecycle.snapshot() for tier in tiers},
    }
