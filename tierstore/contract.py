"""The A/B result contract (`kvscope ab run --json`) as pydantic models: the one definition of its shape.

`ab_result.schema.json` is generated from `ABResult` (`python -m kvscope.tierstore.contract > ...`, held to the
file by a test), and the service's A/B responses reuse `Round` and `Prediction`, so the JSON file, the CLI's output
and the OpenAPI document describe the same rows. Objects accept extra keys (a newer kvscope may add some); what is
listed is what a consumer may rely on.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

Count = Annotated[int, Field(ge=0)]
Ratio = Annotated[float, Field(ge=0, le=1)]
Seconds = Annotated[float, Field(ge=0)]
RoundNumber = Annotated[int, Field(ge=1)]
MissCause = Literal["cold", "evicted", "chain_broken", "not_admitted", "elsewhere"]
PerTier = Annotated[dict[str, Count], Field(min_length=1, description="by tier name")]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class TtftSummary(_Open):
    mean: Seconds
    p50: Seconds
    p90: Seconds | None = None
    p99: Seconds


class TtftShare(_Open):
    """The share of a round's TTFT (summed over its requests) spent on each part; they add up to 1."""

    compute: Ratio = Field(description="prefill of the tokens not hit")
    load: Ratio = Field(description="loading the hits, the part compute did not hide")
    pd_transfer: Ratio = Field(0.0, description="PD-disaggregated: the prompt's KV sent from prefill to decode")
    overhead: Ratio = Field(0.0, description="the fixed time of every request")


class MissCauses(_Open):
    """Why the prompt tokens that were not hits missed, in tokens; the five causes add up to the misses (prompt
    tokens less hit tokens). Embedded stores from their tiers; real Mooncake arms from the store's answers; real
    vLLM arms from the engine's KV events and the store's existence check (README: what each cannot tell apart)."""

    cold: Count = Field(description="the block was never stored in any tier of the arm, or no cache serves the "
                        "token (the prompt's incomplete last block, or its last token)")  # fmt: skip
    evicted: Count = Field(description="stored, then evicted before this use: the sum of evicted_by_tier")
    chain_broken: Count = Field(
        description="still stored, but the prefix lookup stopped before it: an earlier block of its chain is gone"
    )
    not_admitted: Count = Field(description="a put of it was refused (no room, no retry) and nothing stored it since")
    elsewhere: Count = Field(description="held by another engine's cache (one engine per arm: always 0)")
    evicted_by_tier: dict[str, Count] = Field(
        description="evicted tokens by the tier that evicted the block last (tiers that evicted none left out)"
    )


class Round(_Open):
    """One round of one arm."""

    round: RoundNumber
    requests: Count
    query_tokens: Count
    hit_tokens: Count
    gpu_hit_tokens: Count | None = None
    hit_ratio: Ratio
    ideal_hit_ratio: Ratio
    recompute_tokens_per_request: Seconds = Field(description="every prompt token recomputed, per request")
    ideal_hit_tokens: Count | None = None
    excess_recompute_tokens_per_request: float = Field(
        description="tokens recomputed per request beyond what an infinite cache would have: (ideal hits - hits) / "
        "requests"
    )
    put_bytes: Count
    written_bytes: PerTier
    read_bytes: PerTier | None = None
    evictions: PerTier
    allocated_bytes: PerTier | None = None
    late_s: Seconds | None = Field(None, description="paced arms: the most a request started after its slot")
    request_start_s: list[Seconds] | None = Field(
        None, description="real vLLM arms: when each request was sent, seconds from the arm's first"
    )
    request_s: list[Seconds] | None = Field(
        None, description="real vLLM arms: each request's wall time, sent to answered, in seconds"
    )
    request_first_token_s: list[Seconds | None] | None = Field(
        None,
        description="real vLLM arms: each request's engine queue time plus its time to first token (when its "
        "prefill was saved), in seconds; null where the engine did not say",
    )
    request_saved_s: list[Seconds | None] | None = Field(
        None,
        description="real vLLM arms: seconds from sending each request to the connector's first save of its "
        "blocks, as the engine's KV events stamped it; null where it saved none",
    )
    store_eviction_passes: list[Annotated[list[float], Field(min_length=3, max_length=3)]] | None = Field(
        None,
        description="real vLLM arms on Mooncake: the master's eviction passes that began in the round, from its "
        "log: [began, ended] in seconds from the arm's first request, and the objects evicted",
    )
    hit_ratio_range: list[Ratio] | None = Field(
        None,
        min_length=2,
        max_length=2,
        description="mirrors of Mooncake arms: the lowest and highest hit ratio of the model on its seeds",
    )
    request_hit_tokens: list[Count] | None = Field(
        None, description="vLLM arms and their mirrors: each request's hit tokens, in order"
    )
    ttft_s: TtftSummary | None = None
    ttft_share: TtftShare | None = None
    miss_causes: MissCauses | None = None


class LifecycleHistogram(_Open):
    """One quantity of a tier's followed blocks, in seconds on the arm's request clock."""

    buckets: list[Count] = Field(description="cumulative, one per bound of bounds_s: observations at most that bound")
    count: Count = Field(description="every observation (the +Inf bucket)")
    sum: Seconds


class TierLifecycle(_Open):
    """A tier's block lifecycle, with the meaning vLLM's --kv-cache-metrics gives it."""

    lifetime: LifecycleHistogram = Field(description="from a block's store in the tier to its eviction")
    idle_before_evict: LifecycleHistogram = Field(
        description="from a block's last hit (its store, when it was never hit) to its eviction"
    )
    reuse_gap: LifecycleHistogram = Field(
        description="between two consecutive hits of a block (the store is no hit), counted at the second"
    )


class BlockLifecycle(_Open):
    """Embedded stores: each tier's block lifecycle over the run (kvscope.tierstore.lifecycle)."""

    bounds_s: list[Seconds] = Field(description="the buckets' upper bounds in seconds, vLLM's (+Inf implied)")
    sampled_every: int = Field(ge=1, description="the blocks followed: one chain position in this many")
    tiers: dict[str, TierLifecycle] = Field(description="by tier name")


class Totals(_Open):
    """The arm's whole run."""

    query_tokens: Count
    hit_tokens: Count
    hit_ratio: Ratio
    excess_recompute_tokens_per_request: float
    put_bytes: Count
    requests: Count | None = None
    ttft_s_mean: Seconds | None = None
    written_bytes: PerTier
    evictions: PerTier
    tiers: dict[str, dict[str, Count]] | None = Field(None, description="each tier's counters at the end")
    miss_causes: MissCauses | None = None
    block_lifecycle: BlockLifecycle | None = None


class DepthPoint(BaseModel):
    round: RoundNumber
    hit_ratio: Ratio


class Prediction(_Open):
    """The planner's prediction for one arm, made before it runs."""

    collapse_round: RoundNumber | None
    collapse_depth: list[DepthPoint] = Field(
        default_factory=list,
        max_length=2,
        description="the predicted hit ratio of the collapse round and of the round after (empty: no collapse)",
    )
    overflow_round: RoundNumber | None = None
    capacity_bytes: Count | None = None
    footprint_bytes_by_round: list[Count]
    ideal_hit_ratio_by_round: list[Ratio] = Field(default_factory=list)
    dominant_miss_cause_by_round: list[MissCause | None] = Field(
        default_factory=list,
        description="the miss cause expected to dominate each round (null: none expected, or no prediction)",
    )
    dominant_lost_hit_cause_by_round: list[MissCause | None] = Field(
        default_factory=list,
        description="the cause expected to dominate the hits lost against the ideal each round, every cause but "
        "cold (null: none expected to be lost, or no prediction)",
    )
    explanation: list[str] = Field(default_factory=list)


class StoreReport(_Open):
    kind: Literal["embedded", "mooncake", "none"] = Field(description="none: the engine alone (vLLM alone)")
    codes: dict[str, Count] | None = Field(
        None, description="return codes other than success, as '<operation> <code> <name>', with their counts"
    )
    put_retries: Count | None = None
    not_admitted: Count | None = None
    settings: dict | None = None
    master_argv: list[str] | None = None
    client_env: dict[str, str] | None = None
    listening: dict[str, list[str]] | None = None
    peak_rss_bytes: dict[str, Count | None] | None = None


class WallTime(_Open):
    """Wall time: the store's start-up, and serving the rounds."""

    start: Seconds | None = None
    rounds: Seconds | None = None


class ArmResult(_Open):
    rounds: list[Round] = Field(min_length=1)
    totals: Totals
    prediction: Prediction
    observed_collapse_round: RoundNumber | None = None
    store: StoreReport | None = None
    wall_s: WallTime | None = None
    mirror_of: str | None = Field(None, description="the real-store arm this embedded arm simulates")


class ScenarioEcho(_Open):
    """The scenario as run (see `kvscope ab run --help` for its keys)."""

    name: str
    workload: dict
    kv: dict
    arms: dict


class ABResult(_Open):
    """kvscope A/B result (`kvscope ab run --json`), the simulation contract."""

    kvscope_version: str | None = None
    scenario: ScenarioEcho
    arms: dict[str, ArmResult] = Field(min_length=1)


def json_schema() -> dict:
    """The contract as a JSON Schema document (draft 2020-12), what `ab_result.schema.json` holds."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://kvscope.dev/schemas/ab_result.schema.json",
        **ABResult.model_json_schema(mode="serialization"),
    }


if __name__ == "__main__":
    print(json.dumps(json_schema(), indent=2))
