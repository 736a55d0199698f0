"""The embedded model of a Mooncake segment: a tier whose evictions are Mooncake's, on a clock of the requests.

A real Mooncake store decides what to evict by time: the leases its lookups grant and the eviction thread's
batches (kvscope.tierstore.policies.MooncakePolicy says what each does, after Mooncake's master). This tier runs
that policy on a simulated clock that its engine moves (`at`: when each request's lookup and saves happen, a
kvscope.tierstore.engine.RequestClock), with the eviction thread's passes in between, and follows the client's path
to a put: an existence check that leases what it finds (`probe`), a batch allocation that refuses what does not
fit, the eviction thread after it; a client that retries a refused put (kvscope's own Mooncake client, within its
budget) retries once the thread has evicted, one that does not (vLLM's connector) loses those blocks (`refused`).

What it leaves out: the offload of an evicted block to the SSD tier is immediate (Mooncake frees the memory once the
offload heartbeat wrote it), and soft pins, replicas and several segments do not exist here.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from itertools import repeat

from kvscope.tierstore.backends import Backend
from kvscope.tierstore.misses import NOT_ADMITTED
from kvscope.tierstore.policies import Key, MooncakePolicy
from kvscope.tierstore.tier import Evicted, PayloadSource, Tier

SLOW_PASS_S = 0.02  # a real master's eviction pass that took longer held its eviction thread up (passes take ms)
PASS_SLACK_S = 0.05  # how far a model's pass may come before the real one it stands for (the clocks' alignment)


class MooncakeTier(Tier):
    def __init__(
        self,
        name: str,
        capacity: int,
        policy: MooncakePolicy,
        retries_refused: bool,
        backend: Backend | None = None,
        read_bandwidth: float | None = None,
    ) -> None:
        super().__init__(name, capacity, policy, backend, read_bandwidth)
        self.retries_refused = retries_refused
        self.refused = 0  # blocks whose put was refused for good
        self._flagged = False  # an allocation failed: the eviction thread evicts even below the watermark
        # a real master's slow passes: (began less the slack, ended, began)
        self._slow_passes: list[tuple[float, float, float]] = []
        self._put_off: tuple[float, float] | None = None  # the slow pass a model's pass stands for: (ended, began)

    @property
    def mooncake(self) -> MooncakePolicy:
        return self.policy  # type: ignore[return-value]  # the constructor takes only a MooncakePolicy

    def follow_slow_passes(self, passes: Sequence[tuple[float, float]]) -> None:
        """The (began, ended) times of the real master's eviction passes that took long, on this tier's clock (a
        mirror of a real arm): while one ran, the thread started no other, and the puts that did not fit were
        refused. A pass the model would run meanwhile (or up to PASS_SLACK_S before one) stands for it: it evicts
        when that one ended, what had run out when it began (BatchEvict judges leases by the time it started, and
        spares a candidate leased again since)."""
        self._slow_passes = sorted((began - PASS_SLACK_S, ended, began) for began, ended in passes)

    def at(self, seconds: float, keep_evicted: bool = False) -> list[Evicted]:
        """The clock moves to `seconds` (never back). Mooncake's eviction thread wakes every 10 ms: while the
        segment stands above its watermark (or a put was refused) it evicts leases the moment they run out, a batch
        each time, so the passes run at each lease timeout on the way (and when a slow pass it waited for ended),
        not once at the end."""
        policy, evicted = self.mooncake, []  # the pass at the current time ran after the last write
        while self._needs_eviction() and (wake := self._next_wake(seconds)) is not None:
            policy.now = wake
            evicted += self._evict(keep_evicted)
        policy.now = max(policy.now, seconds)
        return evicted + self._evict(keep_evicted)

    def _next_wake(self, until: float) -> float | None:
        """The first moment up to `until` the eviction thread finds work: a lease running out, or the end of the
        slow pass it put a pass off for."""
        timeouts = self.mooncake.lease_timeouts(until)
        put_off = self._put_off
        wakes = timeouts[:1] + ([put_off[0]] if put_off is not None and put_off[0] <= until else [])
        return min(wakes) if wakes else None

    def _slow_pass_at(self, seconds: float) -> tuple[float, float] | None:
        """(ended, began) of the real master's slow pass under way at `seconds`; None when none was."""
        passes = self._slow_passes
        index = bisect_right(passes, (seconds, float("inf"), float("inf"))) - 1
        if index < 0 or seconds >= passes[index][1]:
            return None
        return passes[index][1], passes[index][2]

    def probe(self, keys: Sequence[Key]) -> None:
        """The client's existence check over `keys`: one batch, which leases every present block. The get that
        follows it (TieredStore.read_prefix probes, then reads) comes at the same moment and reads only blocks the
        check leased, so its own leases change nothing: a read here grants none."""
        self.mooncake.grant_batch(list(filter(self._index.__contains__, keys)))

    def write(
        self,
        keys: Sequence[Key],
        nbytes: int,
        payload: PayloadSource | None = None,
        *,
        is_put: bool,
        keep_evicted: bool = False,
    ) -> list[Evicted]:
        """Allocate the blocks that fit, in order; refused ones are retried after an eviction if the client
        retries. The eviction thread runs after each allocation (`_passes`)."""
        refused = self._allocate(keys, nbytes, payload, is_put)
        writing = keys[: len(keys) - len(refused)]
        evicted: list[Evicted] = []
        while refused:
            self._flagged = True
            if not self.retries_refused:
                break
            before = self.counters.evictions
            evicted += self._passes(keep_evicted, writing)
            if self.counters.evictions == before:
                break
            retried, refused = refused, self._allocate(refused, nbytes, payload, is_put)
            writing = retried[: len(retried) - len(refused)]
        self.refused += len(refused)
        if refused and self.fates is not None:  # a later miss on one of them was never admitted
            self.fates.update(zip(refused, repeat(NOT_ADMITTED)))
        return evicted + self._passes(keep_evicted, writing)

    def _allocate(self, keys: Sequence[Key], nbytes: int, payload: PayloadSource | None, is_put: bool) -> list[Key]:
        """Store the blocks that fit in the free space, in order; the refused rest."""
        counters = self.counters
        fitting = max(0, min(len(keys), (counters.capacity_bytes - counters.allocated_bytes) // nbytes))
        if fitting:
            super().write(keys[:fitting], nbytes, payload, is_put=is_put)
        return list(keys[fitting:])

    def _used(self) -> float:
        counters = self.counters
        return counters.allocated_bytes / counters.capacity_bytes

    def _needs_eviction(self) -> bool:
        return self._flagged or self._used() > self.mooncake.high_watermark

    def _passes(self, keep_evicted: bool, writing: Sequence[Key]) -> list[Evicted]:
        """The eviction thread's passes after an allocation: the one it sets off, which finds the blocks allocated
        still `writing` (not the master's to evict yet), then, if the segment still needs it, the next one 10 ms
        on, once they were written (with their lease of 0, the next pass may take them)."""
        evicted = self._evict(keep_evicted, writing)
        if writing and self._needs_eviction():
            evicted += self._evict(keep_evicted)
        return evicted

    def _evict(self, keep_evicted: bool, writing: Sequence[Key] = ()) -> list[Evicted]:
        """One pass of Mooncake's eviction thread, with the blocks of a put still `writing`. A refused allocation's
        flag stays up until a pass evicts, or finds no completed object to evict (BatchEvict's eviction base 0)."""
        now, judged_at = self.mooncake.now, None
        if self._put_off is not None and self._put_off[0] <= now:
            judged_at, self._put_off = self._put_off[1], None
        if self._slow_passes and (slow := self._slow_pass_at(now)) is not None:
            self._put_off = slow
            return []
        victims = self.mooncake.pop_batch(self._used(), self._flagged, writing, judged_at)
        if not victims:
            if len(self.mooncake) == len(writing):
                self._flagged = False
            return []
        self._flagged = False
        return self._drop(victims, keep_evicted)
