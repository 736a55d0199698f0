"""Fabric: the RDMA NICs that carry the tiers' traffic, and the SPDK block devices behind the NVMe-oF tier.

NIC bytes are grouped by `role`, the tier a NIC serves (DRAM tier vs NoF tier, from the exporter's config), and
the per-NIC panels repeat once per role, side by side. SPDK figures are per bdev and per NVMe-oF subsystem; a
subsystem's figures sum only its exported bdevs, so stacked bdevs (an lvol and its base) are not counted once
per layer (exporters/mappings/spdk.yaml).

Not here, because the exporter does not publish them yet (only the KV-tier model reaches Prometheus): RDMA
congestion (CNP, ECN) and error counters, and the SPDK reactors' busy share.
"""

from __future__ import annotations

from grafana_foundation_sdk.models import dashboard

from kvscope.dashboards.common import Board, Query, label_variable, metric, timeseries_panel

UID = "kvscope-fabric"

NICS = 'host=~"$host", role=~"$role"'
BDEVS = 'bdev=~"$bdev"'
SUBSYSTEMS = 'subsystem=~"$subsystem"'


def _mean_latency(by: str, selector: str) -> str:
    """I/O time per second over operations per second: the mean latency of one operation, a ratio of rates."""
    return (
        f"sum by ({by}) (bdev_subsystem_role_op:storage_bdev_latency_seconds:rate5m{{{selector}}})"
        f" / sum by ({by}) (bdev_subsystem_role_op:storage_bdev_ops:rate5m{{{selector}}})"
    )


def build() -> dashboard.Dashboard:
    board = Board(
        UID,
        "kvscope / Fabric",
        "RDMA bytes per NIC by the tier it serves; SPDK throughput, IOPS and latency per bdev and NVMe-oF subsystem.",
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

    board.row("SPDK bdevs").panels(
        timeseries_panel(
            "Bdev throughput",
            "Bytes read and written per second per bdev. Stacked bdevs report at each layer: an lvol's "
            "I/O shows again on its base bdev.",
            "Bps",
            [
                Query(
                    f"sum by (bdev) (bdev_subsystem_role:storage_bdev_read_bytes:rate5m{{{BDEVS}}})", "{{bdev}} read"
                ),
                Query(
                    f"sum by (bdev) (bdev_subsystem_role:storage_bdev_written_bytes:rate5m{{{BDEVS}}})",
                    "{{bdev}} written",
                ),
            ],
            width=8,
        ),
        timeseries_panel(
            "Bdev IOPS",
            "Operations per second per bdev and operation (read, write, unmap, copy).",
            "iops",
            [
                Query(
                    f"sum by (bdev, op) (bdev_subsystem_role_op:storage_bdev_ops:rate5m{{{BDEVS}}})", "{{bdev}} {{op}}"
                )
            ],
            width=8,
        ),
        timeseries_panel(
            "Bdev mean latency",
            "Mean time one operation spent in the bdev, per operation: SPDK's latency ticks over its operations, "
            "both as 5 min rates.",
            "s",
            [Query(_mean_latency("bdev, op", BDEVS), "{{bdev}} {{op}}")],
            width=8,
        ),
    )

    board.row("NVMe-oF subsystems").panels(
        timeseries_panel(
            "Subsystem throughput",
            "Bytes read and written per second through each NVMe-oF subsystem (its exported bdevs).",
            "Bps",
            [
                Query(
                    f"sum by (subsystem) (bdev_subsystem_role:storage_bdev_read_bytes:rate5m{{{SUBSYSTEMS}}})",
                    "{{subsystem}} read",
                ),
                Query(
                    f"sum by (subsystem) (bdev_subsystem_role:storage_bdev_written_bytes:rate5m{{{SUBSYSTEMS}}})",
                    "{{subsystem}} written",
                ),
            ],
            width=8,
        ),
        timeseries_panel(
            "Subsystem IOPS",
            "Operations per second through each NVMe-oF subsystem, per operation.",
            "iops",
            [
                Query(
                    f"sum by (subsystem, op) (bdev_subsystem_role_op:storage_bdev_ops:rate5m{{{SUBSYSTEMS}}})",
                    "{{subsystem}} {{op}}",
                )
            ],
            width=8,
        ),
        timeseries_panel(
            "Subsystem mean latency",
            "Mean time one operation spent in the subsystem's bdevs, per operation (I/O time over operations).",
            "s",
            [Query(_mean_latency("subsystem, op", SUBSYSTEMS), "{{subsystem}} {{op}}")],
            width=8,
        ),
    )
    return board.build()
