"""Fabric: the RDMA NICs that carry the tiers' traffic, and the SPDK target behind the NVMe-oF tier.

NIC bytes are grouped by `role`, the tier a NIC serves (DRAM tier vs NoF tier, from the exporter's config), and
the per-NIC byte panels repeat once per role, side by side. A role's utilization against its NICs' line rate sits
next to the TTFT p50 and p90 and the prompt length p50 and p90 of the engines given that role (a vLLM target's
`role` label): KVFabricSaturated is those NICs near line rate while that TTFT rises, and flat prompts meanwhile
say the rise is the fabric's, not longer contexts. RoCE congestion (CNPs sent, handled and ignored, ECN-marked
packets) is shown by role and per NIC, errors per NIC and error (exporters/mappings/rdma.yaml says which counters).
SPDK figures are per bdev and per NVMe-oF subsystem; a subsystem's figures sum only its exported bdevs, so stacked
bdevs (an lvol and its base) are not counted once per layer (exporters/mappings/spdk.yaml). The reactors' busy
share says how much headroom the target's cores have left.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import timeseries
from grafana_foundation_sdk.models import dashboard

from kvscope.dashboards.common import Board, Query, label_variable, metric, timeseries_panel

UID = "kvscope-fabric"

NICS = 'host=~"$host", role=~"$role"'
NIC = "{{role}} {{host}} {{device}}/{{port}}"  # legend of a NIC port
BDEVS = 'bdev=~"$bdev"'
SUBSYSTEMS = 'subsystem=~"$subsystem"'


def _mean_latency(by: str, selector: str) -> str:
    """I/O time per second over operations per second: the mean latency of one operation, a ratio of rates."""
    return (
        f"sum by ({by}) (target_bdev_subsystem_role_op:storage_bdev_latency_seconds:rate5m{{{selector}}})"
        f" / sum by ({by}) (target_bdev_subsystem_role_op:storage_bdev_ops:rate5m{{{selector}}})"
    )


def _io_panels(
    name: str, by: str, selector: str, legend: str, *, throughput: str, iops: str, latency: str
) -> list[timeseries.Panel]:
    """Throughput, IOPS and mean latency of the bdevs `selector` picks summed by `by` (per operation for IOPS and
    latency), side by side; titled "`name` throughput" and so on, described by the three texts."""
    return [
        timeseries_panel(
            f"{name} throughput",
            throughput,
            "Bps",
            [
                Query(
                    f"sum by ({by}) (target_bdev_subsystem_role:storage_bdev_{what}_bytes:rate5m{{{selector}}})",
                    f"{legend} {what}",
                )
                for what in ("read", "written")
            ],
            width=8,
        ),
        timeseries_panel(
            f"{name} IOPS",
            iops,
            "iops",
            [
                Query(
                    f"sum by ({by}, op) (target_bdev_subsystem_role_op:storage_bdev_ops:rate5m{{{selector}}})",
                    legend + " {{op}}",
                )
            ],
            width=8,
        ),
        timeseries_panel(
            f"{name} mean latency",
            latency,
            "s",
            [Query(_mean_latency(f"{by}, op", selector), legend + " {{op}}")],
            width=8,
        ),
    ]


def build() -> dashboard.Dashboard:
    board = Board(
        UID,
        "kvscope / Fabric",
        "RDMA bytes, congestion and errors per NIC by the tier it serves, utilization against line rate next to the "
        "TTFT and prompt length of the engines given each role; SPDK throughput, IOPS and latency per bdev and "
        "NVMe-oF subsystem, and its reactors' busy share.",
        ["fabric", "rdma", "spdk"],
    )
    nic_series = metric("rdma.port.tx.bytes")
    bdev_series = metric("storage.bdev.ops")
    board.variable(
        label_variable("host", "Host", "hosts whose RDMA NICs are scraped", f"label_values({nic_series}, host)"),
        label_variable(
            "role",
            "NIC role",
            "the tier a NIC serves (dram, nof), from the exporter config",
            f"label_values({nic_series}, role)",
        ),
        label_variable("bdev", "SPDK bdev", "SPDK block devices", f"label_values({bdev_series}, bdev)"),
        label_variable(
            "subsystem",
            "NVMe-oF subsystem",
            "NQNs of the subsystems exporting bdevs",
            f'label_values({bdev_series}{{subsystem!=""}}, subsystem)',
            every=".+",  # "All" leaves out the bdevs no subsystem exports
        ),
    )
    board.alert_annotations()

    board.row("RDMA NICs").panels(
        timeseries_panel(
            "NIC bytes per second by role",
            "Bytes sent and received per second by all NICs of each role: the traffic of the DRAM tier "
            "against that of the NoF tier.",
            "Bps",
            [
                Query('role:rdma_port_tx_bytes:rate5m{role=~"$role"}', "{{role}} sent"),
                Query('role:rdma_port_rx_bytes:rate5m{role=~"$role"}', "{{role}} received"),
            ],
            width=24,
        ),
        timeseries_panel(
            "NIC utilization against line rate by role",
            "Bytes per second of all NICs of each role over their summed line rate (rdma_port_rate), each direction "
            "on its own (a link is full duplex): KVFabricSaturated fires above 90 % while the role's TTFT p90 "
            "(next panel) rises.",
            "percentunit",
            [Query('role_direction:rdma_port_utilization:ratio_rate5m{role=~"$role"}', "{{role}} {{direction}}")],
            width=8,
        ),
        timeseries_panel(
            "TTFT p50 and p90 by role",
            "Time to first token of the engines given each role (their vLLM target's `role` label in targets.yaml: "
            "the role of the NICs their KV loads cross), p50 and p90 from their TTFT histogram buckets over 5 min "
            "(role:kv_engine_ttft_seconds:p50_rate5m, p90_rate5m). KVFabricSaturated compares the p90 with its "
            "value 15 minutes earlier: it fires when the p90 is above 1.2 x that while the role's NICs (previous "
            "panel) are above 90 % of line rate. Engines whose target names no role are not in it.",
            "s",
            [
                Query(f'role:kv_engine_ttft_seconds:{quantile}_rate5m{{role=~"$role"}}', "{{role}} " + quantile)
                for quantile in ("p50", "p90")
            ],
            width=8,
        ),
        timeseries_panel(
            "Prompt length p50 and p90 by role",
            "Prompt tokens per request of the engines given each role, p50 and p90 from their prompt-length "
            "histogram buckets over 5 min (role:kv_engine_prompt_tokens:p50_rate5m, p90_rate5m). Context length is "
            "what makes KV loads big: a TTFT that rises with the prompt length is longer prompts (more prefill, "
            "more KV to load), not a fabric problem; a TTFT that rises with flat prompts while the NICs near line "
            "rate is the fabric.",
            "short",
            [
                Query(f'role:kv_engine_prompt_tokens:{quantile}_rate5m{{role=~"$role"}}', "{{role}} " + quantile)
                for quantile in ("p50", "p90")
            ],
            width=8,
            axis_label="tokens",
        ),
        timeseries_panel(
            "NIC bytes per second: $role",
            "Bytes sent and received per second by each NIC port serving this role, one panel per role side by side.",
            "Bps",
            [
                Query(
                    f"host_device_port_role:rdma_port_tx_bytes:rate5m{{{NICS}}}", "{{host}} {{device}}/{{port}} sent"
                ),
                Query(
                    f"host_device_port_role:rdma_port_rx_bytes:rate5m{{{NICS}}}",
                    "{{host}} {{device}}/{{port}} received",
                ),
            ],
            width=24,
            repeat="role",
        ),
    )

    board.row("RDMA congestion and errors").panels(
        timeseries_panel(
            "Congestion events per second by role",
            "RoCE congestion control (DCQCN) of all NICs of each role: CNPs sent for ECN-marked packets received "
            "(cnp_sent, ecn_marked: this side sees congestion) and CNPs received that slowed a sender down or were "
            "ignored (cnp_handled, cnp_ignored). NICs whose driver counts none (mlx4, InfiniBand) are not in it.",
            "pps",
            [Query('role_event:rdma_port_congestion:rate5m{role=~"$role"}', "{{role}} {{event}}")],
        ),
        timeseries_panel(
            "Congestion events per second per NIC",
            "The same events per NIC port: a port with many ECN marks or CNPs while the others have few sits on a "
            "congested path (a switch queue, an incast of transfers towards it).",
            "pps",
            [Query(f"host_device_port_role_event:rdma_port_congestion:rate5m{{{NICS}}}", NIC + " {{event}}")],
        ),
        timeseries_panel(
            "NIC errors per second",
            "Errors per second per NIC port and error, only those that occurred (an empty panel is a clean fabric): "
            "link errors (symbol_error, link_downed, ...), packets discarded or received bad (port_rcv_errors, "
            "port_xmit_discards, ...), and RoCE transport errors: out_of_sequence, packet_seq_err and "
            "local_ack_timeout_err mean lost packets and retransmissions, out_of_buffer packets dropped for lack of "
            "receive buffers. The PMA error counters saturate at their maximum and then read 0 here.",
            "cps",
            [Query(f"host_device_port_role_error:rdma_port_errors:rate5m{{{NICS}}} > 0", NIC + " {{error}}")],
            width=24,
            axis_label="errors/s",
        ),
    )

    board.row("SPDK bdevs").panels(
        *_io_panels(
            "Bdev",
            "target, bdev",
            BDEVS,
            "{{target}} {{bdev}}",
            throughput="Bytes read and written per second per bdev. Stacked bdevs report at each layer: an lvol's "
            "I/O shows again on its base bdev.",
            iops="Operations per second per bdev and operation (read, write, unmap, copy).",
            latency="Mean time one operation spent in the bdev, per operation: SPDK's latency ticks over its "
            "operations, both as 5 min rates.",
        )
    )

    board.row("NVMe-oF subsystems").panels(
        *_io_panels(
            "Subsystem",
            "subsystem",
            SUBSYSTEMS,
            "{{subsystem}}",
            throughput="Bytes read and written per second through each NVMe-oF subsystem (its exported bdevs).",
            iops="Operations per second through each NVMe-oF subsystem, per operation.",
            latency="Mean time one operation spent in the subsystem's bdevs, per operation (I/O time over operations).",
        )
    )

    board.row("SPDK reactors").panels(
        timeseries_panel(
            "Reactor busy share",
            "Share of each reactor's time spent in pollers that found work, per SPDK target and core: busy over "
            "busy + idle (5 min rates). Near 1, I/O waits for the reactor and latency climbs: give the target more "
            "cores (its core mask). Not CPU use: a polling reactor keeps its core at 100 %.",
            "percentunit",
            [Query("target_lcore_role:storage_reactor_busy_ratio:rate5m", "{{target}} lcore {{lcore}}")],
            width=24,
            bounds=(0, 1),
        ),
    )
    return board.build()
