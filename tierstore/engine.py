"""An inference engine with a KV connector, as far as the KV cache can tell.

For each request it does what vLLM does with a prefix cache and an external store: find the longest run of
consecutive prompt blocks present (GPU-local cache first, then the store's tiers), never more than the prompt
less one token (the last token is always computed to produce logits), load those blocks, recompute the rest,
and save the blocks the store lacks. TTFT is estimated from a cost model: recomputed tokens over prefill
throughput plus the store's time to load the hits (the embedded store: hit bytes per tier over the bandwidth from
engine to that tier; a real store: the time its gets took); or, given a TTFT model (kvscope.tierstore.ttft), from
the model's FLOPs on its GPUs, the hits' bytes over the links their tiers sit behind, shared by the requests in
flight and overlapping compute as the connector does, and a PD-disaggregated engine's transfer to decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvscope.tierstore.lifecycle import follow
from kvscope.tierstore.store import KVStore, TieredStore
from kvscope.tierstore.tier import Tier
from kvscope.tierstore.ttft import TtftModel, TtftParts
from kvscope.tierstore.workloads import Request


@dataclass(slots=True)
class Served:
    """What one request cost: tokens hit per layer, tokens recomputed, bytes saved, estimated TTFT."""

    prompt_tokens: int
    gpu_hit_tokens: int
    external_hit_tokens: int
    recompute_tokens: int
    put_bytes: int
    ttft_s: float
    ttft_parts: TtftParts | None = None  # what the TTFT is made of: overhead, compute, exposed loading, PD transfer

    @property
    def hit_tokens(self) -> int:
        return self.gpu_hit_tokens + self.external_hit_tokens


class RequestTimes(NamedTuple):
    """When a request's KV work happens, in seconds from the arm's first request: its lookup (sent), the save of
    its prompt's blocks (after its prefill) and the save of the blocks it decoded (answered)."""

    start: float
    saved: float
    ended: float


class RequestClock:
    """When each request of an arm does its KV work: for a store whose evictions go by time (Mooncake's leases), and
    for the lifecycle of every embedded tier's blocks (kvscope.tierstore.lifecycle).

    A paced arm: request n at n x `interval`, its steps at once (the emulator takes no time). The mirror of a real
    vLLM arm: what the real arm's rows recorded (`request_start_s`, `request_saved_s` or `request_first_token_s`,
    `request_s`), so the model's leases run out when the real store's did, whatever the speed of the machine that
    served it: a request saved later leases its chain later, and a chain leased later outlives an eviction. Past
    what the rows hold, the pacing goes on from the last recorded start. `eviction_passes` are the real Mooncake
    master's, (began, ended) on the same clock (`store_eviction_passes`).
    """

    def __init__(self, interval: float, rows: Sequence[dict] = ()) -> None:
        self.interval = interval
        self._recorded = [times for row in rows for times in _recorded_times(row)]
        self.eviction_passes = [
            (began, ended) for row in rows for began, ended, _ in row.get("store_eviction_passes") or ()
        ]

    def __call__(self, number: int) -> RequestTimes:
        recorded = self._recorded
        if number < len(recorded):
            return recorded[number]
        start = (recorded[-1].start if recorded else -self.interval) + (number - len(recorded) + 1) * self.interval
        return RequestTimes(start, start, start)


def _recorded_times(row: dict) -> list[RequestTimes]:
    """A real vLLM arm's round row as request times: the save when the engine's KV events reported it
    (`request_saved_s`), else at the first token (a request that saved nothing still checked its chain then)."""
    starts = row["request_start_s"]
    saves = row.get("request_saved_s") or [None] * len(starts)
    return [
        RequestTimes(start, start + ((first or 0.0) if saved is None else saved), start + wall)
        for start, first, saved, wall in zip(starts, row["request_first_token_s"], saves, row["request_s"], strict=True)
    ]


@dataclass(slots=True)
class EngineCounters:
    """Cumulative, like vLLM's own prefix-cache counters, so the exporters read an emulated engine as a real one."""

    requests: int = 0
    query_tokens: int = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
    external_query_tokens: int = 0  # the part the GPU cache missed, asked of the store (external_prefix_cache_queries)
    gpu_hit_tokens: int = 0
    external_hit_tokens: int = 0
    recompute_tokens: int = 0
    # Set by the A/B runner at the end of each round, so a recording can be cut into rounds and held against the
    # analytic bound (the verifier's ratio_to_bound and no_collapse criteria).
    rounds: int = 0
    bound_hit_tokens: int = 0  # prompt tokens an infinite cache would have hit (planner's ideal)


class EngineEmulator:
    def __init__(
        self,
        store: KVStore,
        block_tokens: int,
        block_bytes: int,
        prefill_tokens_per_s: float,
        gpu_cache: Tier | None = None,
        saves_whole_chain: bool = False,
        clock: RequestClock | None = None,
        ttft_model: TtftModel | None = None,
        tier_links: Sequence[tuple[str, float | None]] = (),
        explains_misses: bool = True,
    ) -> None:
        self.store = store
        self.clock = clock  # when each request's lookup and saves happen
        # vLLM's Mooncake connector saves a request's every block (its existence check skips the stored ones, and
        # Mooncake leases them); kvscope's client puts only the blocks after the hit
        self.saves_whole_chain = saves_whole_chain
        self.block_tokens = block_tokens
        self.block_bytes = block_bytes
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.gpu_cache = gpu_cache
        self.counters = EngineCounters()
        # A store whose evictions go by time (a Mooncake segment's model) is told each step (`at`), which times its
        # tiers' block lifecycle too; every other tier asks the clock when a followed block needs a time
        self._steps = clock is not None and isinstance(store, TieredStore) and store.clocked
        if clock is not None:
            for tier in ([gpu_cache] if gpu_cache else []) + ([] if self._steps else [*store.tiers, *store.attached]):
                tier.lifecycle.time = _RequestStart(clock, self.counters)
        # the TTFT model, and for each of the store's tiers (in order) the link its loads cross and its medium's
        # own read bandwidth (None: as fast as the link)
        self.ttft_model = ttft_model
        self.tier_links = list(tier_links)
        # why each token missed (kvscope.tierstore.misses), from the tiers in view or what a real store reports
        self.misses = store.miss_ledger(gpu_cache, block_tokens) if explains_misses else None

    def serve(self, request: Request) -> Served:
        keys, store = request.keys, self.store
        hittable = min(len(keys), (request.prompt_tokens - 1) // self.block_tokens)
        times = self.clock(self.counters.requests) if self._steps else None
        gpu = self.gpu_cache
        gpu_blocks = gpu.read_run(keys, 0, hittable)[0] if gpu else 0
        if times:
            store.at(times.start)
        hit = store.read_prefix(keys, gpu_blocks, hittable)
        hit_blocks = gpu_blocks + hit.blocks
        if self.misses is not None:  # before this request's puts store what it missed
            self.misses.classify(keys, hit_blocks, hittable, request.prompt_tokens)
        if times:
            store.at(times.saved)
        saved = keys[hit_blocks:]
        put_bytes = store.put(keys if self.saves_whole_chain else saved, self.block_bytes)
        head = (keys or request.output_keys or [None])[0]  # of the chain the request's blocks make up
        follow(store.tiers, head, saved, hit_blocks)  # the tiers' block lifecycle: a real store has none here
        if request.output_keys:
            if times:
                store.at(times.ended)
            put_bytes += store.put(request.output_keys, self.block_bytes)
            follow(store.tiers, head, request.output_keys, len(keys))
        if gpu:
            gpu.write(list(gpu.missing(keys[gpu_blocks:])), self.block_bytes, is_put=False)
            follow([gpu], head, keys[gpu_blocks:], gpu_blocks)
            gpu.release(keys)
        store.release(keys)
        block_tokens, prompt_tokens = self.block_tokens, request.prompt_tokens
        gpu_hit, external_hit = gpu_blocks * block_tokens, hit.blocks * block_tokens
        recompute = prompt_tokens - gpu_hit - external_hit
        counters = self.counters
        counters.requests += 1
        counters.query_tokens += prompt_tokens
        counters.external_query_tokens += prompt_tokens - gpu_hit
        counters.gpu_hit_tokens += gpu_hit
        counters.external_hit_tokens += external_hit
        counters.recompute_tokens += recompute
        if self.ttft_model is None:
            parts = TtftParts(0.0, recompute / self.prefill_tokens_per_s, store.load_seconds(hit), 0.0)
        else:
            reads: dict[str, list[tuple[int, float | None]]] = {}
            for nbytes, (link, medium) in zip(hit.read_bytes, self.tier_links, strict=True):
                reads.setdefault(link, []).append((nbytes, medium))
            parts = self.ttft_model.parts(prompt_tokens, gpu_hit + external_hit, reads)
        return Served(prompt_tokens, gpu_hit, external_hit, recompute, put_bytes, parts.total, parts)


class _RequestStart:
    """When the request being served started, on `clock` (vLLM allocates and hits its GPU blocks then): worked out
    once per request that needs it."""

    def __init__(self, clock: RequestClock, counters: EngineCounters) -> None:
        self._clock, self._counters = clock, counters
        self._number, self._start = -1, 0.0

    def __call__(self) -> float:
        number = self._counters.requests
        if number != self._number:
            self._number, self._start = number, self._clock(number).start
        return self._start
