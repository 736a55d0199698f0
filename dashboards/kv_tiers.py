"""KV tiers: where prefix-cache hits come from, what each medium stores, how full it is, and the collapse signs.

Read top to bottom it follows the phenomenon of docs/design.md, 'The hit-rate collapse': the hit ratio per engine
and layer (against its ideal where the model knows it), the tokens each layer serves, per engine where its prompt
tokens came from (stacked by source) and why the computed ones missed (by cause), the bytes put, written and
read per tier, occupancy against capacity with the headroom left before a tier must evict, evictions and how long
blocks lived before them, and write amplification, which jumps when evicted chain heads are recomputed and rewritten.

Engines and store systems are shown per `target` (the kvscope target that published them), as the recording rules
keep them: two vLLM servers both call their first engine "0" and its offload "vllm_offload:0".

A last row shows a KV router in front of the engines (NVIDIA Dynamo), per router and routing phase: the cached
prefix it expected on the workers it chose against the best eligible worker's and what the workers then served, its
prefix-hit ratio (which KVCacheHitRateCollapse judges where no engine exports prefix-cache counters), the KV events
it applied from the workers, and the workers' own KV cache usage and preemptions.
"""

from __future__ import annotations

from grafana_foundation_sdk.models import dashboard

from kvscope.api.alerts import ROUTER_OVERESTIMATES, RULES
from kvscope.dashboards.common import (
    COLLAPSE_WATERMARK,
    Board,
    Query,
    hit_ratio_by_layer,
    ideal_hit_ratio,
    label_variable,
    metric,
    stat_panel,
    timeseries_panel,
)

UID = "kvscope-kv-tiers"
_OVERESTIMATES = RULES[ROUTER_OVERESTIMATES].thresholds  # the alert's one definition

ENGINES = 'engine=~"$engine"'
MEDIA = 'system=~"$system", tier=~"$tier"'
ALLOCATED = f"sum by (target, system, tier) ({metric('kv.tier.allocated.bytes')}{{{MEDIA}}})"
CAPACITY = f"sum by (target, system, tier) ({metric('kv.tier.capacity.bytes')}{{{MEDIA}}})"
MEDIA_SERIES = '__name__=~"kv_(store|tier)_.+"'  # every store and tier series carries system and tier
ROUTERS = 'router=~"$router"'
# The frontends (targets) of the chosen routers: the frontend's own series (served cached tokens) have no router.
FRONTENDS = f"on (target) group by (target) (target_router_phase:kv_router_prompt_tokens:rate5m{{{ROUTERS}}})"
# Legends: an engine or a medium is named with the target it came from.
ENGINE = "{{target}} {{engine}}"
MEDIUM = "{{target}} {{system}} {{tier}}"
ROUTER = "{{target}} {{router}} {{phase}}"
WORKER = "{{target}} {{worker_id}} {{engine}}"


def _median(buckets: str) -> str:
    """The median of a lifecycle instrument's buckets per medium (a bucket's bound is its `upper_bound` label,
    handed to histogram_quantile as `le`, as the recording rules do for TTFT)."""
    rate = f"rate({metric(buckets)}{{{MEDIA}}}[$__rate_interval])"
    return (
        "histogram_quantile(0.5, sum by (target, system, tier, le) (label_replace("
        f'{rate}, "le", "$1", "upper_bound", "(.+)")))'
    )


def build() -> dashboard.Dashboard:
    board = Board(
        UID,
        "kvscope / KV tiers",
        "Prefix-cache hit ratio, tokens and bytes per tier, occupancy and collapse headroom, write amplification; a "
        "KV router's cached prefix chosen, best and served, its KV events, its workers' KV usage and preemptions.",
        ["kv-cache"],
    )
    board.variable(
        label_variable(
            "engine",
            "Engine",
            "vLLM engines and emulated A/B engines (<ab>/<arm>)",
            f"label_values({metric('kv.prefix.query.tokens')}, engine)",
        ),
        label_variable(
            "system",
            "Store system",
            "Mooncake, vLLM offload, tierstore:<ab>/<arm>",
            f"label_values({{{MEDIA_SERIES}}}, system)",
        ),
        label_variable(
            "tier",
            "Tier",
            "gpu, dram, ssd, nof",
            f'label_values({{{MEDIA_SERIES}, system=~"$system"}}, tier)',
        ),
        label_variable(
            "router",
            "KV router",
            "KV routers in front of the engines (Dynamo: the frontend's instance id)",
            f"label_values({metric('kv.router.prompt.tokens')}, router)",
        ),
    )
    board.alert_annotations()

    board.row("Prefix cache").panels(
        timeseries_panel(
            "Hit ratio by engine and layer",
            "Prompt tokens found over prompt tokens looked up (5 min rates). gpu: vLLM's own cache; external: the "
            "connector's tiers, over the tokens the GPU missed; overall: hits of both layers over every prompt token"
            + (", against the analytic bound (ideal)" if ideal_hit_ratio(ENGINES, "") else "")
            + ". A cliff in overall while bytes written jump is the evict-recompute-rewrite collapse.",
            "percentunit",
            hit_ratio_by_layer(ENGINES, ENGINE),
            bounds=(0, 1),
        ),
        timeseries_panel(
            "Prompt tokens served per layer",
            "Prompt tokens per second hit in each layer, stacked on those no layer held (recomputed by prefill): "
            "the stack is every prompt token. Recomputed tokens are the work a collapse adds.",
            "short",
            [
                Query(f"target_engine_layer:kv_prefix_hit_tokens:rate5m{{{ENGINES}}}", ENGINE + " hit {{layer}}"),
                Query(f"target_engine:kv_prefix_miss_tokens:rate5m{{{ENGINES}}}", f"{ENGINE} recomputed"),
            ],
            axis_label="tokens/s",
            stacked=True,
        ),
    )

    board.row("Where prompt tokens came from and why they missed").panels(
        timeseries_panel(
            "$engine: where prompt tokens came from",
            "Prompt tokens per second by where their KV came from (kv.prompt.tokens, 5 min rates): computed "
            "(prefilled), gpu (the engine's own prefix cache), host, storage or external (the tiers behind it, as "
            "the engine names them), cached (a hit the engine does not attribute). The stack is every prompt token; "
            "a tier whose band stays thin while it is written (Bytes written per tier) is not paying off "
            "(KVOffloadNotPayingOff). One panel per engine.",
            "short",
            [Query(f"target_engine_source:kv_prompt_tokens:rate5m{{{ENGINES}}}", "{{target}} {{source}}")],
            axis_label="tokens/s",
            stacked=True,
            repeat="engine",
        ),
        timeseries_panel(
            "$engine: why tokens missed",
            "The computed prompt tokens per second by why they missed (kv.miss.tokens, 5 min rates): cold (never "
            "stored), evicted (stored, then evicted: split by the tier that evicted the block last), chain_broken "
            "(stored, but behind a block of its chain that is gone), not_admitted (a put the store refused), "
            "elsewhere (held by another engine). The stack is the computed band of the panel beside it. Evicted and "
            "chain_broken growing while cold does not is the collapse; a real engine does not classify its misses "
            "(the embedded store's A/B arms do).",
            "short",
            [Query(f"target_engine_cause_tier:kv_miss_tokens:rate5m{{{ENGINES}}}", "{{target}} {{cause}} {{tier}}")],
            axis_label="tokens/s",
            stacked=True,
            repeat="engine",
        ),
    )

    board.row("Bytes per tier").panels(
        timeseries_panel(
            "Bytes put and got per tier",
            "Logical saves and loads clients asked of each store (kv.store.put/get.bytes), per second. With "
            "replicated placement a put counts once, at the top tier.",
            "Bps",
            [
                Query(f"target_system_tier:kv_store_put_bytes:rate5m{{{MEDIA}}}", f"put {MEDIUM}"),
                Query(f"target_system_tier:kv_store_get_bytes:rate5m{{{MEDIA}}}", f"got {MEDIUM}"),
            ],
            width=8,
        ),
        timeseries_panel(
            "Bytes written per tier",
            "Physical bytes written to each medium per second: puts, replicas, promotions and rewrites of evicted "
            "blocks. A jump with no more puts is rewriting.",
            "Bps",
            [Query(f"target_system_tier:kv_tier_written_bytes:rate5m{{{MEDIA}}}", MEDIUM)],
            width=8,
        ),
        timeseries_panel(
            "Bytes read per tier",
            "Physical bytes each medium served per second (prefix hits loaded from it).",
            "Bps",
            [Query(f"target_system_tier:kv_tier_read_bytes:rate5m{{{MEDIA}}}", MEDIUM)],
            width=8,
        ),
    )

    board.row("Capacity and collapse headroom").panels(
        timeseries_panel(
            "Allocated vs capacity per tier",
            "Bytes allocated on each medium and its capacity. A tier whose allocation meets its "
            "capacity evicts from then on; for an LRU DRAM tier that is where the collapse starts.",
            "decbytes",
            [
                Query(ALLOCATED, f"{MEDIUM} allocated"),
                Query(CAPACITY, f"{MEDIUM} capacity"),
            ],
        ),
        timeseries_panel(
            "Occupancy per tier",
            f"Allocated over capacity. The red line is the {COLLAPSE_WATERMARK:.0%} watermark of the "
            "KVCacheCollapseImminent alert.",
            "percentunit",
            [Query(f"target_system_tier:kv_tier_occupancy:ratio{{{MEDIA}}}", MEDIUM)],
            bounds=(0, 1),
            watermark=COLLAPSE_WATERMARK,
        ),
        stat_panel(
            "Collapse headroom",
            "Bytes each tier can still take before it must evict (capacity - allocated), now.",
            "decbytes",
            [Query(f"{CAPACITY} - {ALLOCATED}", MEDIUM, instant=True)],
            width=12,
        ),
        timeseries_panel(
            "Time until full at the current fill rate",
            "Headroom over the growth of the allocation (deriv over 5 min), for tiers that are filling: how long "
            "before they start evicting.",
            "s",
            [
                Query(
                    f"({CAPACITY} - {ALLOCATED})"
                    f" / sum by (target, system, tier) (deriv({metric('kv.tier.allocated.bytes')}{{{MEDIA}}}[5m]))"
                    " > 0",
                    MEDIUM,
                )
            ],
        ),
        timeseries_panel(
            "Evictions per tier",
            "Blocks (objects) evicted from each medium per second. A tier that never evicts shows nothing here.",
            "eps",
            [Query(f"target_system_tier:kv_tier_evictions:rate5m{{{MEDIA}}}", MEDIUM)],
            axis_label="blocks/s",
        ),
        timeseries_panel(
            "Block lifecycle per tier (median)",
            "Of the blocks each medium evicted, the median time from their store to their eviction (lifetime) and "
            "from their last access to it (idle); of the accesses, the median gap since the block's previous one "
            "(reuse gap), with the meaning vLLM's --kv-cache-metrics gives them (over 5 min; the sources follow a "
            "sample of the blocks). A reuse gap longer than the idle time means blocks go before they are reused: "
            "the tier is too small for the workload's reuse.",
            "s",
            [
                Query(_median(instrument), f"{MEDIUM} {name}")
                for name, instrument in (
                    ("lifetime", "kv.block.lifetime.blocks"),
                    ("idle", "kv.block.idle.blocks"),
                    ("reuse gap", "kv.block.reuse.accesses"),
                )
            ],
        ),
        timeseries_panel(
            "Lookups served per tier",
            "Lookups each medium answered per second (kv.tier.hits; Mooncake's DRAM figure includes its offload "
            "worker's reads, see exporters/mappings/mooncake.yaml).",
            "ops",
            [
                Query(
                    f"sum by (target, system, tier) (rate({metric('kv.tier.hits')}{{{MEDIA}}}[$__rate_interval]))",
                    MEDIUM,
                )
            ],
        ),
    )

    board.row("Write amplification and alerts").panels(
        timeseries_panel(
            "Write amplification",
            "Bytes written to all media per prompt token that had to be computed (missed by every layer), whole "
            "cluster: the KV bytes per token times the copies kept while healthy; it rises when evicted blocks are "
            "rewritten.",
            "decbytes",
            [Query("cluster:kv_write_amplification_bytes_per_token:rate5m", "cluster")],
            axis_label="bytes per token",
        ),
        stat_panel(
            "Collapse alerts now",
            "Alerts the kvscope service holds pending or firing (KVCacheCollapsePredicted, KVCacheHitRateCollapse, "
            "KVCacheCollapseImminent); their details are on the service's /api/v1/alerts.",
            "short",
            [
                Query(
                    'sum by (alertname, state) (kvscope_alerts{state=~"pending|firing"})',
                    "{{alertname}} {{state}}",
                    instant=True,
                )
            ],
            width=12,
            steps=(("green", None), ("red", 1)),
            no_value="0",
        ),
    )

    board.row("KV router and its workers").panels(
        timeseries_panel(
            "Cached prefix chosen, best eligible and served",
            "Prompt tokens per second the KV router expected cached on the workers it chose (chosen) and on the best "
            "eligible worker (best), per router and routing phase, and the cached tokens the workers then served, "
            "as the frontend's responses report them (served, per model). Best above chosen is what routing for load "
            "costs in hits; served below chosen is blocks the workers evicted while the router still counted on them.",
            "short",
            [
                Query(
                    f'target_router_phase_choice:kv_router_prefix_tokens:rate5m{{{ROUTERS}, choice="selected"}}',
                    f"{ROUTER} chosen",
                ),
                Query(
                    f'target_router_phase_choice:kv_router_prefix_tokens:rate5m{{{ROUTERS}, choice="best_eligible"}}',
                    f"{ROUTER} best",
                ),
                Query(f"target_model:kv_frontend_cached_tokens:rate5m and {FRONTENDS}", "{{target}} {{model}} served"),
            ],
            width=8,
            axis_label="tokens/s",
        ),
        timeseries_panel(
            "Router prefix-hit ratio and served over expected",
            "Cached prefix tokens the router expected on the workers it chose over the prompt tokens it routed (5 min "
            "rates): where no engine exports prefix-cache counters, KVCacheHitRateCollapse fires when it falls below "
            "half its peak of the last hour while the workers' stored KV events do not fall. Served over expected: "
            "the cached tokens the workers served over what the router expected on them (1 while its index holds; "
            f"KVRouterOverestimates fires below {_OVERESTIMATES['served_over_expected']:g} for "
            f"{_OVERESTIMATES['for_s'] / 60:g} minutes).",
            "percentunit",
            [
                Query(f"target_router_phase:kv_router_prefix_hit_ratio:rate5m{{{ROUTERS}}}", f"{ROUTER} hit ratio"),
                Query(
                    f"target_model_phase:kv_router_prefix_served:ratio_rate5m and {FRONTENDS}",
                    "{{target}} {{model}} {{phase}} served over expected",
                ),
            ],
            width=8,
        ),
        timeseries_panel(
            "KV events applied per router",
            "KV events from the workers the router applied to its index, per second: blocks stored, removed (evicted) "
            "and caches cleared; rejected ones (a status other than ok: the index out of step with the workers) "
            "summed apart. Removed close behind stored is a cache at its capacity.",
            "eps",
            [
                Query(
                    f'target_router_event_status:kv_router_events:rate5m{{{ROUTERS}, status="ok"}}',
                    "{{target}} {{router}} {{event}}",
                ),
                Query(
                    "sum by (target, router, event) "
                    f'(target_router_event_status:kv_router_events:rate5m{{{ROUTERS}, status!="ok"}})',
                    "{{target}} {{router}} {{event}} rejected",
                ),
            ],
            width=8,
            axis_label="events/s",
        ),
        timeseries_panel(
            "Worker KV cache usage",
            "Fraction of each worker's KV cache blocks in use (kv.engine.cache.usage; Dynamo's workers, named by the "
            "worker id the frontend gives them, and their data-parallel rank as engine). Near 1 the worker evicts "
            "prefixes and preempts requests; 0 when idle.",
            "percentunit",
            [Query(metric("kv.engine.cache.usage"), WORKER)],
            bounds=(0, 1),
        ),
        timeseries_panel(
            "Preemptions per worker",
            "Requests each engine preempted per second (their KV freed, to be recomputed): its KV cache was too small "
            "for the requests running on it.",
            "short",
            [
                Query(
                    f"sum by (target, worker_id, engine) (rate({metric('kv.engine.preemptions')}[$__rate_interval]))",
                    WORKER,
                )
            ],
            axis_label="preemptions/s",
        ),
    )
    return board.build()
