"""Live A/B: one A/B test of the kvscope service, its arms side by side while it runs.

The service publishes each arm's emulated engine as `<ab>/<arm>` and its store as `tierstore:<ab>/<arm>`, all from
its one target "tierstore"; the variables pick the A/B (newest first) and its arms from those names. The top row
overlays the arms; below, the per-arm panels repeat once per arm, side by side.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import timeseries
from grafana_foundation_sdk.models import dashboard

from kvscope.dashboards.common import (
    COLLAPSE_WATERMARK,
    Board,
    Query,
    hit_ratio_by_layer,
    ideal_hit_ratio,
    label_variable,
    metric,
    timeseries_panel,
)

UID = "kvscope-live-ab"

ENGINES = 'engine=~"$ab/.+"'
SYSTEMS = 'system=~"tierstore:$ab/.+"'
ENGINE = 'engine="$ab/$arm"'
SYSTEM = 'system="tierstore:$ab/$arm"'


def _per_arm(what: str, description: str, unit: str, queries: list[Query], **options) -> timeseries.Panel:
    """A time series of the arm in $arm, titled "$arm: `what`", repeated once per arm (side by side)."""
    return timeseries_panel(f"$arm: {what}", description, unit, queries, width=24, repeat="arm", **options)


def _per_tier(rule: str) -> list[Query]:
    """One series per tier of the arm in $arm, from the recording rule `target_system_tier:<rule>`."""
    return [Query(f"target_system_tier:{rule}{{{SYSTEM}}}", "{{tier}}")]


def build() -> dashboard.Dashboard:
    board = Board(
        UID,
        "kvscope / Live A/B",
        "A live A/B test of tier layouts on the embedded store: both arms side by side.",
        ["ab"],
    ).refresh("5s", "now-30m")
    stores = metric("kv.tier.capacity.bytes")
    board.variable(
        label_variable(
            "ab",
            "A/B test",
            "A/B tests the service runs or ran (newest first)",
            f'label_values({stores}{{system=~"tierstore:.+"}}, system)',
            regex="/^tierstore:([^/]+)\\//",
            every=None,
            sort=dashboard.VariableSort.NATURAL_DESC,
        ),
        label_variable(
            "arm",
            "Arm",
            "the arms of that A/B test",
            f"label_values({stores}{{{SYSTEMS}}}, system)",
            regex="/^tierstore:[^/]+\\/(.+)$/",
        ),
    )
    board.alert_annotations()

    board.row("Both arms").panels(
        timeseries_panel(
            "Hit ratio",
            "Prefix-cache hits of both layers over every prompt token, per arm (5 min rates): an arm that "
            "collapses falls away from the other.",
            "percentunit",
            [
                Query(f"target_engine:kv_prefix_hit_ratio:rate5m{{{ENGINES}}}", "{{engine}}"),
                *ideal_hit_ratio(ENGINES, "{{engine}} ideal"),
            ],
            bounds=(0, 1),
        ),
        timeseries_panel(
            "Bytes written",
            "Bytes written to all media per second, per arm. A collapsing arm writes more for the same requests.",
            "Bps",
            [Query('ab_arm:kv_tier_written_bytes:rate5m{ab="$ab"}', "{{arm}}")],
        ),
        timeseries_panel(
            "Write amplification",
            "Bytes written to all media per prompt token recomputed, per arm (a ratio of 5 min rates): it jumps "
            "when a collapsing arm rewrites what it evicted.",
            "decbytes",
            [Query('ab_arm:kv_write_amplification_bytes_per_token:rate5m{ab="$ab"}', "{{arm}}")],
            axis_label="bytes per token",
        ),
        timeseries_panel(
            "Evictions",
            "Blocks evicted per second from all tiers, per arm.",
            "eps",
            [Query(f"sum by (system) (target_system_tier:kv_tier_evictions:rate5m{{{SYSTEMS}}})", "{{system}}")],
            axis_label="blocks/s",
        ),
    )

    board.row("Per arm").panels(
        _per_arm(
            "hit ratio by layer",
            "This arm's hits over lookups per layer (gpu: the emulated GPU cache; external: the store's tiers, "
            "over the GPU misses) and overall.",
            "percentunit",
            hit_ratio_by_layer(ENGINE),
            bounds=(0, 1),
        ),
        _per_arm(
            "bytes written per tier",
            "Bytes written to each of this arm's tiers per second.",
            "Bps",
            _per_tier("kv_tier_written_bytes:rate5m"),
        ),
        _per_arm(
            "occupancy per tier",
            f"Allocated over capacity for each of this arm's tiers; the red line is the {COLLAPSE_WATERMARK:.0%} "
            "watermark of KVCacheCollapseImminent.",
            "percentunit",
            _per_tier("kv_tier_occupancy:ratio"),
            bounds=(0, 1),
            watermark=COLLAPSE_WATERMARK,
        ),
        _per_arm(
            "evictions per tier",
            "Blocks evicted per second from each of this arm's tiers.",
            "eps",
            _per_tier("kv_tier_evictions:rate5m"),
            axis_label="blocks/s",
        ),
    )
    return board.build()
