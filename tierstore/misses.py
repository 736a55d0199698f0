"""Why a prompt token missed: every token an arm's engine recomputed gets one cause, found when its request looked
its block up (before the request's own puts change anything):

- `cold`: its block was never stored in any tier of the arm; so are the prompt's tokens no cache can serve (its
  incomplete last block, and its last block when the prompt ends on a block boundary: the engine always computes
  the last token), which an infinite cache misses too;
- `evicted`: stored, then evicted before this use; counted by the tier that evicted it last (with `demote`, the
  tier it fell out of; with `replicate`, the last tier to drop its copy);
- `chain_broken`: the block is still stored, but the lookup stopped before it because an earlier block of its chain
  is gone: a prefix lookup (vLLM's, the connector's) stops at the first miss, so the blocks after it are recomputed
  and rewritten even though the store holds them, the mechanism of the hit-rate collapse;
- `not_admitted`: a put of it was refused and nothing stored it since (a Mooncake segment's allocation that found no
  room, "no available handle", from a client that does not retry: vLLM's connector). The model of LMCache never
  refuses a chunk (it evicts its oldest pinned one instead), so its misses are never `not_admitted`;
- `elsewhere`: held by another engine's cache. Every scenario serves an arm with one engine, so it is always 0.

An embedded store's tiers are all in view (MissLedger). A real store is classified from what it reports
(ReportedMissLedger): which of a request's blocks its existence check found, and what became of each block the
engine put (stored, or refused with a return code); see that class for what can and cannot be told apart there.

Only the misses are looked at, from the first missing block of a request's chain on: a hit costs nothing more. The
tiers note each block they evict or refuse in one dict (`fates`, the last thing that happened to it, one entry per
block ever given up, set on the eviction paths); a block neither held nor noted was never stored.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from itertools import filterfalse, repeat
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvscope.tierstore.tier import Tier

Key = Hashable
CAUSES = ("cold", "evicted", "chain_broken", "not_admitted", "elsewhere")


class _NotAdmitted:
    """The fate of a block a tier refused to store (a tier's name is the fate of one it evicted)."""

    def __repr__(self) -> str:
        return "NOT_ADMITTED"


NOT_ADMITTED = _NotAdmitted()


class MissLedger:
    """The miss causes of one arm's engine, in tokens, cumulative like its other counters (the A/B runner takes
    each round's as a difference, the exporter publishes them as they are)."""

    def __init__(self, tiers: Sequence[Tier], block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.fates: dict[Key, object] = {}
        for tier in tiers:
            tier.fates = self.fates
        self._holds = [tier.policy.index.__contains__ for tier in tiers]  # bound once: a request's test of each
        self.tokens = dict.fromkeys(CAUSES, 0)  # `evicted` is the sum of evicted_tokens
        self.evicted_tokens = {tier.name: 0 for tier in tiers}  # by the tier that evicted them last

    def classify(self, keys: Sequence[Key], first_miss: int, hittable: int, prompt_tokens: int) -> None:
        """Give a cause to each prompt token of a request from block `first_miss` on (its hits end there); blocks
        past `hittable` and the tokens past its full blocks are `cold`: no cache serves them. Each step is a C loop
        over the missed blocks (membership, the fates, their tally): no Python step per block."""
        block, tokens = self.block_tokens, self.tokens
        if first_miss >= hittable:
            tokens["cold"] += prompt_tokens - first_miss * block
            return
        missed = keys[first_miss:hittable]
        absent: Iterable[Key] = missed
        for holds in self._holds:
            absent = filterfalse(holds, absent)
        fates = list(map(self.fates.get, absent))
        cold = fates.count(None)
        tokens["cold"] += prompt_tokens - (hittable - cold) * block
        tokens["chain_broken"] += (len(missed) - len(fates)) * block
        if len(fates) > cold:  # some were stored once: refused, or evicted (a tier's name, one object each)
            refused = fates.count(NOT_ADMITTED)
            tokens["not_admitted"] += refused * block
            if len(fates) > cold + refused:
                evicted = self.evicted_tokens
                for tier in evicted:
                    evicted[tier] += fates.count(tier) * block

    def snapshot(self) -> dict:
        """The causes so far, in tokens: each cause, and `evicted_by_tier`."""
        return causes_snapshot(self.tokens, self.evicted_tokens)


class ReportedMissLedger:
    """The miss causes of an arm served by a real store (a Mooncake arm), from what the store reported: the
    existence check of each lookup (which blocks it held at that moment) and each put's outcome per block. The
    engine's own GPU tier, when it has one, is kvscope's model and in view as in MissLedger.

    What the store's answers tell apart exactly: `cold` (never put), `not_admitted` (its last put was refused:
    `-200` no available handle once the retries ran out), `chain_broken` (the existence check found it, but the
    lookup stopped earlier). Not told apart: the store does not say when or why an object went, so `evicted` is
    every block that was stored and is gone, credited to the last tier of the write path (with an SSD tier, an
    object DRAM dropped before its offload and one the SSD evicted look the same), and an object removed by another
    client would count as evicted too (no other client writes an arm's store). A block whose get failed after the
    check found it is counted as not held (its lookup stopped there)."""

    def __init__(self, gpu_cache: Tier | None, store_tier: str, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.store_tier = store_tier
        self.gpu_fates: dict[Key, object] = {}
        self._gpu_index = gpu_cache.policy.index if gpu_cache is not None else None
        if gpu_cache is not None:
            gpu_cache.fates = self.gpu_fates
        self.stored: dict[Key, object] = {}  # each block the engine put: True once stored, NOT_ADMITTED if refused
        self._checked_from = 0
        self._held: Sequence[bool] = ()
        self.tokens = dict.fromkeys(CAUSES, 0)
        self.evicted_tokens = {**({"gpu": 0} if gpu_cache is not None else {}), store_tier: 0}

    def checked(self, start: int, held: Sequence[bool]) -> None:
        """The lookup's existence check: held[i] says whether the store served (or could serve) block start + i."""
        self._checked_from, self._held = start, held

    def put(self, keys: Sequence[Key], refused: Iterable[int]) -> None:
        """A put's outcome: every block of `keys` is stored but those at the indexes `refused`."""
        self.stored.update(zip(keys, repeat(True)))
        self.stored.update((keys[index], NOT_ADMITTED) for index in refused)

    def classify(self, keys: Sequence[Key], first_miss: int, hittable: int, prompt_tokens: int) -> None:
        """As MissLedger.classify, from the last existence check (a store held block i if the check found it)."""
        block, tokens = self.block_tokens, self.tokens
        tokens["cold"] += prompt_tokens - max(hittable, first_miss) * block
        start, held, gpu = self._checked_from, self._held, self._gpu_index
        for index in range(first_miss, hittable):
            key, at = keys[index], index - start
            if index > first_miss and ((0 <= at < len(held) and held[at]) or (gpu is not None and key in gpu)):
                tokens["chain_broken"] += block
                continue
            fate = self.stored.get(key)
            if fate is True:
                self.evicted_tokens[self.store_tier] += block
            elif fate is NOT_ADMITTED:
                tokens["not_admitted"] += block
            elif self.gpu_fates.get(key) is not None:
                self.evicted_tokens["gpu"] += block
            else:
                tokens["cold"] += block
        self._held = ()

    def snapshot(self) -> dict:
        return causes_snapshot(self.tokens, self.evicted_tokens)


def causes_snapshot(tokens: dict[str, int], evicted_tokens: dict[str, int]) -> dict:
    """A ledger's causes so far as the A/B rows and the exporter read them: each cause in tokens (`evicted` the sum
    of `evicted_tokens`), and `evicted_by_tier`."""
    return {**tokens, "evicted": sum(evicted_tokens.values()), "evicted_by_tier": dict(evicted_tokens)}


def causes_between(before: dict, after: dict) -> dict:
    """The miss causes of what was served between two snapshots (a round's, a run's); `evicted_by_tier` names only
    the tiers that evicted some (a row stays small however many tiers an arm has)."""
    delta = {cause: after[cause] - before[cause] for cause in CAUSES}
    earlier = before["evicted_by_tier"]
    by_tier = {tier: tokens - earlier[tier] for tier, tokens in after["evicted_by_tier"].items()}
    delta["evicted_by_tier"] = {tier: tokens for tier, tokens in by_tier.items() if tokens}
    return delta


def dominant_cause(causes: dict) -> str | None:
    """The cause with the most tokens (the first of CAUSES on a tie); None when nothing missed."""
    cause = max(CAUSES, key=causes.__getitem__)
    return cause if causes[cause] else None


def lost_hit_causes(causes: dict) -> dict:
    """The causes of the hits lost against the ideal: every cause but `cold`, which an infinite cache misses too. A
    collapse shows here: the new tokens every round brings can outnumber the hits its first round loses."""
    return causes | {"cold": 0}
