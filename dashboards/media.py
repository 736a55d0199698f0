"""Media verification: the machine criteria of criteria/media.yaml, watched live for two arms, and the verdicts.

Arm A is the reference (the DRAM-only arm), arm B the candidate (the tiered arm), each a store `system` (an A/B
arm of the service is `tierstore:<ab>/<arm>`). Totals are increases over the dashboard's time range, so parity is
a ratio of increases, as the verifier computes it, never of lifetime counters. An arm's figures are summed over
every target that publishes its system (a real cluster's store clients). The verdicts themselves are the
verifier's, read from the service's REST API through the Infinity datasource (see common.InfinityQuery).
"""

from __future__ import annotations

from grafana_foundation_sdk.models import dashboard

from kvscope.dashboards.common import (
    INFINITY_PLUGIN,
    Board,
    Column,
    InfinityQuery,
    Query,
    datasource_variable,
    infinity_table_panel,
    label_variable,
    metric,
    stat_panel,
    timeseries_panel,
)

UID = "kvscope-media"

# The published tolerances, as criteria/media.yaml states them (a test holds the two together).
SAVE_TOLERANCE = 0.001
LOAD_TOLERANCE = 0.003

ARMS = 'system=~"$reference|$candidate"'
NOF = f'tier="nof", {ARMS}'


def _total(instrument: str, system: str) -> str:
    """The increase of a counter over the dashboard's range, for one arm (`system` a variable reference)."""
    return f'sum(increase({metric(instrument)}{{system="{system}"}}[$__range]))'


def _parity(instrument: str) -> str:
    """(B - A) / A of the increases over the range: criterion `parity` of the verifier."""
    a, b = _total(instrument, "$reference"), _total(instrument, "$candidate")
    return f"({b} - {a}) / {a}"


def _totals_panel(title: str, instrument: str, what: str):
    return stat_panel(
        title,
        f"Bytes of KV blocks the clients {what} in each arm over the dashboard's time range (increase).",
        "decbytes",
        [
            Query(_total(instrument, "$reference"), "A: $reference", instant=True),
            Query(_total(instrument, "$candidate"), "B: $candidate", instant=True),
        ],
    )


def _parity_panel(title: str, instrument: str, what: str, criterion: str, tolerance: float):
    return stat_panel(
        title,
        f"(B - A) / A of the bytes {what} over the range; criterion {criterion} passes within "
        f"±{tolerance:.1%} (green).",
        "percentunit",
        [Query(_parity(instrument), "B vs A", instant=True)],
        steps=(("red", None), ("green", -tolerance), ("red", tolerance)),
    )


def build() -> dashboard.Dashboard:
    board = Board(
        UID,
        "kvscope / Media verification",
        "Save/load parity of two arms, the NoF allocation delta, bytes written per tier, and the latest verdicts.",
        ["verification"],
    )
    systems = f"label_values({metric('kv.store.put.bytes')}, system)"
    board.variable(
        label_variable("reference", "Arm A (reference)", "the DRAM-only arm's store system", systems, every=None),
        label_variable("candidate", "Arm B (candidate)", "the tiered arm's store system", systems, every=None),
        datasource_variable(
            "infinity",
            INFINITY_PLUGIN,
            "REST (Infinity)",
            "an Infinity datasource whose URL is the kvscope service",
        ),
    )
    board.alert_annotations()

    board.row("Store work parity (save_parity, load_parity)").panels(
        _totals_panel("Bytes put per arm", "kv.store.put.bytes", "saved"),
        _parity_panel("Put parity", "kv.store.put.bytes", "saved", "save_parity", SAVE_TOLERANCE),
        _totals_panel("Bytes got per arm", "kv.store.get.bytes", "loaded"),
        _parity_panel("Get parity", "kv.store.get.bytes", "loaded", "load_parity", LOAD_TOLERANCE),
        timeseries_panel(
            "Puts and gets per arm",
            "Logical bytes saved and loaded per second, per arm: the two arms should track each other.",
            "Bps",
            [
                Query(f"sum by (system) (target_system_tier:kv_store_put_bytes:rate5m{{{ARMS}}})", "put {{system}}"),
                Query(f"sum by (system) (target_system_tier:kv_store_get_bytes:rate5m{{{ARMS}}})", "got {{system}}"),
            ],
            width=24,
        ),
    )

    allocated = metric("kv.tier.allocated.bytes")
    board.row("NoF allocation (nof_delta_zero)").panels(
        stat_panel(
            "NoF allocated-bytes delta",
            "Max - min of the NoF tier's allocated bytes over the range, per arm. Criterion nof_delta_zero wants "
            "exactly 0 B for the reference arm (red from 1 B); the candidate's NoF tier is expected to grow.",
            "decbytes",
            [
                Query(
                    f"sum by (system) (max_over_time({allocated}{{{NOF}}}[$__range])"
                    f" - min_over_time({allocated}{{{NOF}}}[$__range]))",
                    "{{system}}",
                    instant=True,
                )
            ],
            width=8,
            steps=(("green", None), ("red", 1)),
        ),
        timeseries_panel(
            "NoF allocated bytes",
            "Bytes allocated on the NoF tier of each arm: flat for the reference arm, rising for the candidate.",
            "decbytes",
            [Query(f"sum by (system) ({allocated}{{{NOF}}})", "{{system}}")],
            width=16,
        ),
    )

    board.row("Bytes written per tier (both_tiers_written)").panels(
        stat_panel(
            "Bytes written per tier over the range",
            "Physical bytes each medium of each arm took over the range. Criterion both_tiers_written wants every "
            "tier of the candidate above 0 and at least its puts.",
            "decbytes",
            [
                Query(
                    f"sum by (system, tier) (increase({metric('kv.tier.written.bytes')}{{{ARMS}}}[$__range]))",
                    "{{system}} {{tier}}",
                    instant=True,
                )
            ],
            width=8,
        ),
        timeseries_panel(
            "Bytes written per tier",
            "Physical bytes written to each medium per second, per arm.",
            "Bps",
            [
                Query(
                    f"sum by (system, tier) (target_system_tier:kv_tier_written_bytes:rate5m{{{ARMS}}})",
                    "{{system}} {{tier}}",
                )
            ],
            width=16,
        ),
    )

    board.row("Verdicts").panels(
        infinity_table_panel(
            "Latest verdicts",
            "The verifier's verdicts, newest first, from the kvscope service (GET /api/v1/verdicts through the "
            "Infinity datasource): each criterion, PASS or FAIL, its one-line summary and the digest of its "
            "evidence. The evidence is GET /api/v1/verdicts/<verdict>; its bundle adds /bundle.",
            InfinityQuery(
                ref_id="A",
                url="/api/v1/verdicts?limit=100",  # relative: Infinity prefixes its datasource URL
                root_selector="verdicts",
                columns=[
                    Column("created_at", "Judged at", "timestamp_epoch_s"),
                    Column("verdict_id", "Verdict", "number"),
                    Column("criterion", "Criterion"),
                    Column("kind", "Kind"),
                    Column("passed", "Passed"),
                    Column("summary", "Summary"),
                    Column("runs", "Runs"),
                    Column("digest", "Evidence digest"),
                ],
            ),
        ),
    )
    return board.build()
