"""The depth of a collapse: each round's hit ratio as one tier's eviction order leaves it, followed over runs.

Which blocks a full tier still holds depends on the order its policy keeps them in, and that order on every request
before. The planner follows the order over runs, not blocks: a run is a stretch of one chain's consecutive blocks
(a session's own, or the shared prefix) that sits in one place of the eviction order, so a round leaves a few runs
a session whatever the chains' lengths. These are the policies as the README states them, written over runs and
sharing no code with the store, which is what lets the simulation be held against them:

- lru: a hit moves its run to the recent end head first (the head goes first); a put evicts the oldest blocks, then
  appends the new ones in chain order. A chain's remnant behind a lost head was not read, so not touched: a loser's
  rewrite evicts its own remnant first;
- fifo: only puts append; tail_first: lru, and a finished request moves its blocks to the recent end tail first;
- lmcache: a hit moves its run to the recent end tail first (its head newest) and pins it till the request ends;
- mooncake: a request leases the blocks of its chain it finds till now + lease_ttl, in an order as random as their
  shards; new blocks get a lease of now, in chain order; at a request's start and after a put, above the watermark
  or after a refused allocation, the eviction thread evicts ceil(blocks x max(ratio, used - watermark + ratio))
  expired leases, the earliest first, and a refused put is retried after it. So an owner's rewritten blocks go
  first, from the lowest (where its held run from the head ended), then its leased ones at random: of L that lost
  x, the first j are whole with probability C(L - j, x) / C(L, x). The prediction is the expectation over that
  order; where the held run ends is itself an expectation, carried into the owner's next turn as a fractional
  position, and the part of a put refused until an eviction is placed as if the rewritten blocks were contiguous.

It assumes one tier (several are modelled as the planner's one of their capacity), no GPU cache in front, and a
tier that holds a request's whole chain (one smaller evicts what the request itself wrote).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from itertools import count
from typing import Literal

from kvscope.tierstore import scenario as spec
from kvscope.tierstore.workloads import MultiRoundWorkload

SHARED = -1  # the owner of the shared prefix's runs
Interval = tuple[int, int, int]  # (owner, first block, end)


@dataclass(slots=True)
class _Run:
    """Blocks lo..hi-1 of one owner's chain, together in the eviction order, `held` of them still there. `first`:
    the end evicted first, or `any` for blocks in random order, which lose blocks from anywhere (Mooncake's leased
    blocks: `size` of them, the lowest of which stretch whole from lo to hi, an expected position)."""

    owner: int
    lo: float
    hi: float
    first: Literal["head", "tail", "any"]
    rank: tuple[float, int]  # the eviction order: lease timeout (mooncake; else 0), then when it was placed
    held: int
    size: int = 0
    pinned: bool = False

    def take(self, blocks: int) -> None:
        """Evict `blocks` of it."""
        self.held -= blocks
        if self.first == "head":
            self.lo += blocks
        elif self.first == "tail":
            self.hi -= blocks

    def split(self, blocks: int) -> _Run:
        """The first `blocks` to be placed of a run not yet placed; this run keeps the rest."""
        first = replace(self, hi=self.lo + blocks if self.first == "head" else self.hi, held=blocks, size=blocks)
        self.take(blocks)
        return first


@dataclass(slots=True)
class _LookedUp:
    """Blocks the lookups found (`hit`), found held past the end of their hit run (`held_past_hit`), and found
    refused by the chain's last put (`refused`), summed over requests."""

    hit: float = 0.0
    held_past_hit: float = 0.0
    refused: float = 0.0


@dataclass(frozen=True, slots=True)
class FollowedRound:
    """One round as the tier model follows it, in tokens: prompt tokens, the hits, the tokens held past the end of
    a request's hit run (missed as `chain_broken`) and the tokens a put had refused (`not_admitted`)."""

    query_tokens: int
    hit_tokens: float
    held_past_hit_tokens: float
    refused_tokens: float

    @property
    def hit_ratio(self) -> float:
        return self.hit_tokens / self.query_tokens


class _TierModel:
    def __init__(
        self, policy: str, capacity: int, block_bytes: int, shared: int, mooncake: spec.MooncakeSettings
    ) -> None:
        self.policy, self.capacity, self.block_bytes, self.shared = policy, capacity, block_bytes, shared
        self.mooncake = mooncake
        self.runs: list[_Run] = []
        self.used = 0  # blocks held
        self.now = 0.0
        self.flagged = False  # an allocation was refused: the eviction thread evicts even below the watermark
        self._requests = 0
        self._placed = count()
        self.refused: dict[int, int] = {}  # each owner's blocks its last put had refused (Mooncake, no retry left)
        self.looked_up = _LookedUp()  # what the lookups found, over the requests served so far

    def serve(self, session: int, prompt: int, hittable: int, stored: int) -> float:
        """One request of `session` (`prompt` blocks, `stored` with its output): its expected hit blocks."""
        if self.policy == "mooncake":
            return self._serve_leased(session, prompt, hittable, stored)
        hit = int(self._prefix(session, hittable))
        self._note_lookup(session, hittable, hit)
        if self.policy in ("lru", "tail_first"):
            self._place(self._cut(session, 0, hit), "head")
        elif self.policy == "lmcache":
            self._place(self._cut(session, 0, hit)[::-1], "tail", pinned=True)
        self._put(session, hit, prompt)
        self._put(session, prompt, stored)
        if self.policy == "tail_first":
            self._place(self._cut(session, 0, prompt)[::-1], "tail")
        for run in self.runs:
            run.pinned = False
        return hit

    def _serve_leased(self, session: int, prompt: int, hittable: int, stored: int) -> float:
        """Mooncake: the clock moves and the eviction thread runs; the lookup leases every block of the chain it
        finds, in random order, and the put rewrites the missing ones in chain order. Of an owner's blocks, then,
        the rewritten go first, from the lowest (where its held run from the head ended), then the leased ones."""
        settings = self.mooncake
        self.now = self._requests * settings.request_interval
        self._requests += 1
        self._batch_evict()
        hit = self._prefix(session, hittable)
        self._note_lookup(session, hittable, hit)
        fresh: list[_Run] = []
        for owner, lo, hi in self._parts(session, 0, prompt):
            whole = self._held_run(owner, lo, hi)
            held = sum(run.held for run in self.runs if run.owner == owner)
            self.runs = [run for run in self.runs if run.owner != owner]
            leased = _Run(owner, lo, whole, "any", (self.now + settings.lease_ttl, next(self._placed)), held, held)
            self.runs += [leased] if held else []
            fresh.append(_Run(owner, whole, hi, "head", (0.0, 0), hi - lo - held))
        self._allocate(fresh)
        self._allocate([_Run(session, prompt, stored, "head", (0.0, 0), stored - prompt)])
        return hit

    def _allocate(self, pieces: list[_Run]) -> None:
        """Mooncake's put: what fits is stored in order, the rest refused, which flags the eviction thread, and
        retried once it evicted (if the client retries); then the thread runs."""
        pieces = [piece for piece in pieces if piece.held]
        while pieces:
            room = self.capacity // self.block_bytes - self.used
            while pieces and room > 0:
                stored = pieces[0].split(min(room, pieces[0].held))
                room -= stored.held
                self.used += stored.held
                stored.rank = (self.now, next(self._placed))
                self.runs.append(stored)
                if not pieces[0].held:
                    pieces.pop(0)
            if not pieces:
                break
            self.flagged = True
            if self.mooncake.put_retry_budget <= 0 or not self._batch_evict():
                for piece in pieces:
                    self.refused[piece.owner] = self.refused.get(piece.owner, 0) + piece.held
                break
        self._batch_evict()

    def _batch_evict(self) -> int:
        """One pass of Mooncake's eviction thread: how many blocks it evicted."""
        settings = self.mooncake
        used = self.used * self.block_bytes / self.capacity
        if not self.used or (used <= settings.eviction_high_watermark and not self.flagged):
            return 0
        target = max(settings.eviction_ratio, used - settings.eviction_high_watermark + settings.eviction_ratio)
        gone = self._evict(math.ceil(self.used * target))
        if gone:
            self.flagged = False
        return gone

    def _put(self, session: int, lo: int, hi: int) -> None:
        """Store the chain's missing blocks lo..hi-1, evicting the oldest first to make room."""
        missing = self._missing(session, lo, hi)
        blocks = sum(end - first for _, first, end in missing)
        excess = (self.used + blocks) * self.block_bytes - self.capacity
        if excess > 0:
            self._evict(-(-excess // self.block_bytes))
        self._place(missing, "head")
        self.used += blocks

    def _evict(self, blocks: int) -> int:
        """Evict up to `blocks`, the oldest first of those that may go (not pinned, lease run out)."""
        gone = 0
        for run in sorted(self.runs, key=lambda run: run.rank):
            if gone == blocks:
                break
            if not run.pinned and run.rank[0] <= self.now:
                taken = min(blocks - gone, run.held)
                run.take(taken)
                gone += taken
        self.runs = [run for run in self.runs if run.held]
        self.used -= gone
        return gone

    def _note_lookup(self, session: int, hittable: int, hit: float) -> None:
        """Count what a lookup of the chain's first `hittable` blocks found: its `hit` run, the blocks held past it
        (randomly ordered runs hold each of their blocks with the same probability) and those its last put had
        refused (not stored since: the put of this request tries them again)."""
        held = 0.0
        for owner, lo, hi in self._parts(session, 0, hittable):
            for run in self.runs:
                overlap = min(run.hi, hi) - max(run.lo, lo)
                if run.owner == owner and overlap > 0:
                    held += overlap * (run.held / run.size if run.first == "any" and run.size else 1.0)
        looked_up = self.looked_up
        looked_up.hit += hit
        looked_up.held_past_hit += max(0.0, held - hit)
        looked_up.refused += self.refused.pop(session, 0)

    def _parts(self, session: int, lo: int, hi: int) -> list[Interval]:
        """The chain's blocks lo..hi-1 by owner: the shared prefix's, then the session's own."""
        parts = ((SHARED, lo, min(hi, self.shared)), (session, max(lo, self.shared), hi))
        return [(owner, first, end) for owner, first, end in parts if first < end]

    def _prefix(self, session: int, limit: int) -> float:
        """The expected length of the chain's held run from its head, at most `limit` blocks."""
        for owner, lo, hi in self._parts(session, 0, limit):
            held = self._held_run(owner, lo, hi)
            if held < hi:
                return held
        return limit

    def _held_run(self, owner: int, lo: float, hi: float) -> float:
        """Where the owner's held run from `lo` is expected to end, at most `hi`. Randomly ordered blocks that lost
        x of their L leave the first j whole with probability C(L - j, x) / C(L, x)."""
        runs = [run for run in self.runs if run.owner == owner]
        position = lo
        while position < hi:
            run = next((run for run in runs if run.lo <= position < run.hi), None)
            if run is None:
                return position
            if run.first == "any" and run.held < run.size:
                whole, expected, j = 1.0, 0.0, 0
                while j < min(run.hi, hi) - run.lo:
                    whole *= (run.held - j) / (run.size - j)
                    expected += whole * min(1.0, min(run.hi, hi) - run.lo - j)
                    j += 1
                return run.lo + expected
            position = min(run.hi, hi)
        return position

    def _missing(self, session: int, lo: int, hi: int) -> list[Interval]:
        """The chain's blocks lo..hi-1 no run holds, as intervals in chain order."""
        missing: list[Interval] = []
        for owner, first, end in self._parts(session, lo, hi):
            position = first
            for run in sorted((run for run in self.runs if run.owner == owner), key=lambda run: run.lo):
                if run.hi > position and run.lo < end:
                    if run.lo > position:
                        missing.append((owner, position, run.lo))
                    position = run.hi
            if position < end:
                missing.append((owner, position, end))
        return missing

    def _cut(self, session: int, lo: int, hi: int) -> list[Interval]:
        """Take the chain's held blocks lo..hi-1 out of their runs, to be placed again: they, in chain order."""
        bounds = {owner: (first, end) for owner, first, end in self._parts(session, lo, hi)}
        taken: list[Interval] = []
        kept: list[_Run] = []
        for run in self.runs:
            first, end = bounds.get(run.owner, (0, 0))
            start, stop = max(first, run.lo), min(end, run.hi)
            if start >= stop:
                kept.append(run)
                continue
            taken.append((run.owner, start, stop))
            kept += [
                replace(run, lo=a, hi=b, held=b - a, size=b - a) for a, b in ((run.lo, start), (stop, run.hi)) if a < b
            ]
        self.runs = kept
        merged: list[Interval] = []
        for owner, first, end in sorted(taken, key=lambda interval: interval[1]):
            if merged and merged[-1][0] == owner and merged[-1][2] == first:
                first = merged.pop()[1]
            merged.append((owner, first, end))
        return merged

    def _place(
        self,
        intervals: list[Interval],
        first: Literal["head", "tail"],
        *,
        pinned: bool = False,
    ) -> None:
        """Append runs at the recent end, in the order given."""
        for owner, lo, hi in intervals:
            self.runs.append(_Run(owner, lo, hi, first, (0.0, next(self._placed)), hi - lo, hi - lo, pinned))


def follow_rounds(
    workload: MultiRoundWorkload,
    policy: str,
    capacity: int,
    block_bytes: int,
    rounds: int,
    mooncake: spec.MooncakeSettings,
) -> list[FollowedRound]:
    """Rounds 1..`rounds` on one tier of `capacity` bytes evicting by `policy`: what each one's lookups found."""
    w, block = workload.spec, workload.block_tokens
    tier = _TierModel(policy, capacity, block_bytes, w.shared_prefix_tokens // block, mooncake)
    followed: list[FollowedRound] = []
    for number, order in zip(range(1, rounds + 1), workload.session_orders(), strict=False):
        tokens = workload.prompt_tokens(number)
        prompt = tokens // block
        stored = (tokens + w.output_tokens) // block if w.output_cached else prompt
        hittable = min(prompt, (tokens - 1) // block)
        tier.looked_up = _LookedUp()
        for session in order:
            tier.serve(session, prompt, hittable, stored)
        found = tier.looked_up
        followed.append(
            FollowedRound(len(order) * tokens, found.hit * block, found.held_past_hit * block, found.refused * block)
        )
    return followed
