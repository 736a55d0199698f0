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

from collections import deque
from collections.abc import Sequence
from itertools import repeat
from typing import NamedTuple

from kvscope.tierstore.backends import Backend
from kvscope.tierstore.misses import NOT_ADMITTED
from kvscope.tierstore.policies import Key, MooncakePolicy
from kvscope.tierstore.tier import Evicted, PayloadSource, Tier

PASS_SLACK_S = 0.05  # how far a model's pass may come after the real one it stands for began (clocks' alignment)
PASS_WAKE_S = 0.25  # how long after a put a real master's pass began, at most, on a busy machine (0.17 s seen)


class _PutOffPass(NamedTuple):
    """A model's pass that waits for the real pass it stands for to end, with the segment as that pass found it."""

    ends: float
    began: float
    used: float  # the share of the segment in use
    completed: int  # the objects the master counted (its eviction base)


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
        self._real_passes: list[tuple[float, float]] = []  # (began, ended) of the real master's passes, a mirror's
        self._next_real = 0  # the first of them no model pass stood for yet
        self._put_off: _PutOffPass | None = None

    @property
    def mooncake(self) -> MooncakePolicy:
        return self.policy  # type: ignore[return-value]  # the constructor takes only a MooncakePolicy

    def follow_eviction_passes(self, passes: Sequence[tuple[float, float]]) -> None:
        """The (began, ended) times of the real master's eviction passes, on this tier's clock (a mirror of a real
        arm). On a busy machine a pass began up to a few tenths of a second after the put that set it off and ran
        up to seconds; meanwhile the puts that did not fit were refused. So a pass the model would run stands for
        the real pass under way or beginning within PASS_WAKE_S (one no earlier model pass stood for): it evicts
        when that one ended as many as the segment called for when it began, of what had run out then (BatchEvict
        reads the memory in use and counts the objects when it starts, judges leases by that time, and spares a
        candidate leased again since). With no real pass near, it runs at once."""
        self._real_passes, self._next_real = sorted(passes), 0

    def at(self, seconds: float, keep_evicted: bool = False) -> list[Evicted]:
        """The clock moves to `seconds` (never back). Mooncake's eviction thread wakes every 10 ms: while the
        segment stands above its watermark (or a put was refused) it evicts leases the moment they run out, a batch
        each time, so the passes run at each lease timeout on the way (and when a real pass it waited for ended),
        not once at the end."""
        policy, evicted = self.mooncake, []  # the pass at the current time ran after the last write
        if not self._needs_eviction():  # nothing for the thread to do on the way (moving the clock changes no need)
            policy.now = max(policy.now, seconds)
            return evicted
        timeouts = deque(policy.lease_timeouts(seconds))  # the leases that run out on the way (no grants meanwhile)
        while self._needs_eviction() and (wake := self._next_wake(timeouts, seconds)) is not None:
            policy.now = wake
            evicted += self._evict(keep_evicted)
        policy.now = max(policy.now, seconds)
        return evicted + self._evict(keep_evicted)

    def _next_wake(self, timeouts: deque[float], until: float) -> float | None:
        """The first moment up to `until` the eviction thread finds work: the next of the lease `timeouts` (taken
        from them), or the end of the real pass it put a pass off for."""
        put_off = self._put_off.ends if self._put_off is not None and self._put_off.ends <= until else None
        if timeouts and (put_off is None or timeouts[0] <= put_off):
            return timeouts.popleft()
        return put_off

    def _real_pass_for(self, seconds: float) -> tuple[float, float] | None:
        """(began, ended) of the real pass a model's pass at `seconds` stands for: the first one not stood for yet
        that was under way then (begun up to PASS_SLACK_S earlier, or ending later) or began within PASS_WAKE_S;
        None when there is none."""
        passes, index = self._real_passes, self._next_real
        while index < len(passes) and passes[index][1] < seconds and passes[index][0] < seconds - PASS_SLACK_S:
            index += 1  # over before this pass: one the model did not need
        self._next_real = index
        if index == len(passes) or passes[index][0] > seconds + PASS_WAKE_S:
            return None
        self._next_real = index + 1
        return passes[index]

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
        if not self._needs_eviction():
            return []
        policy = self.mooncake
        now, used, completed, judged_at = policy.now, self._used(), len(policy) - len(writing), None
        if self._put_off is not None:
            if self._put_off.ends > now:
                return []  # the thread is in (or waking for) the real pass this one stands for
            _, judged_at, used, completed = self._put_off
            self._put_off = None
        elif self._real_passes and (real := self._real_pass_for(now)) is not None:
            began, ended = real
            if ended > now:
                self._put_off = _PutOffPass(ended, began, used, completed)
                return []
            judged_at = min(began, now)
        victims = policy.pop_batch(used, self._flagged, writing, judged_at, completed)
        if not victims:
            if completed <= 0:
                self._flagged = False
            return []
        self._flagged = False
        return self._drop(victims, keep_evicted)
