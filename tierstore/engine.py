"""An inference engine with a KV connector, as far as the KV cache can tell.

For each request it does what vLLM does with a prefix cache and an external store: find the longest run of
consecutive prompt blocks present (GPU-local cache first, then the store's tiers), never more than the prompt
less one token (the last token is always computed to produce logits), load those blocks, recompute the rest,
and save the blocks the store lacks. TTFT is estimated from a cost model: recomputed tokens over prefill
throughput plus the store's time to load the hits (the embedded store: hit bytes per tier over the bandwidth from
engine to that tier; a real store: the time its gets took).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvscope.tierstore.store import KVStore
from kvscope.tierstore.tier import Tier
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

    @property
    def hit_tokens(self) -> int:
        return self.gpu_hit_tokens + self.external_hit_tokens


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
    ) -> None:
        self.store = store
        # vLLM's Mooncake connector saves a request's every block (its existence check skips the stored ones, and
        # Mooncake leases them); kvscope's client puts only the blocks after the hit
        self.saves_whole_chain = saves_whole_chain
        self.block_tokens = block_tokens
        self.block_bytes = block_bytes
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.gpu_cache = gpu_cache
        self.counters = EngineCounters()

    def serve(self, request: Request) -> Served:
        keys = request.keys
        hittable = min(len(keys), (request.prompt_tokens - 1) // self.block_tokens)
        gpu = self.gpu_cache
        gpu_blocks = gpu.read_run(keys, 0, hittable)[0] if gpu else 0
        hit = self.store.read_prefix(keys, gpu_blocks, hittable)
        hit_blocks = gpu_blocks + hit.blocks
        put_bytes = self.store.put(keys if self.saves_whole_chain else keys[hit_blocks:], self.block_bytes)
        if request.output_keys:
            put_bytes += self.store.put(request.output_keys, self.block_bytes)
        if gpu:
            gpu.write(list(gpu.missing(keys[gpu_blocks:])), self.block_bytes, is_put=False)
            gpu.release(keys)
        self.store.release(keys)
        recompute = request.prompt_tokens - hit_blocks * self.block_tokens
        counters = self.counters
        counters.requests += 1
        counters.query_tokens += request.prompt_tokens
        counters.external_query_tokens += request.prompt_tokens - gpu_blocks * self.block_tokens
        counters.gpu_hit_tokens += gpu_blocks * self.block_tokens
        counters.external_hit_tokens += hit.blocks * self.block_tokens
        counters.recompute_tokens += recompute
        ttft = recompute / self.prefill_tokens_per_s + self.store.load_seconds(hit)
        return Served(
            request.prompt_tokens,
            gpu_blocks * self.block_tokens,
            hit.blocks * self.block_tokens,
            recompute,
            put_bytes,
            ttft,
        )
