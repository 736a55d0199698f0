"""RDMA NICs from sysfs through the collector and its mapping.

The fixture tree (tests/fixtures/rdma/sysfs, from prometheus/procfs) has mlx4, mlx5 (with hw_counters) and hfi1
InfiniBand ports; tests/fixtures/rdma/synthetic/sysfs is SYNTHETIC: its mlx5 port copied under another name with
made-up congestion counters (PROVENANCE.md). Everything else the capture lacks (RoCE ports, symlinked devices with
netdevs, GID netdevs, N/A values, legacy counters_ext, saturated and wrapping counters) is written by the tests in
tmp_path, laid out as a real sysfs is: class/infiniband/<dev> -> devices/.../infiniband/<dev>, <dev>/device -> the
PCI function, whose net/<ifname>/ holds the netdevs.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import os
import re
import shutil
import socket
import sys
import time
import types
from pathlib import Path

import httpx
import pytest
from support.realservers import served_exposition

from kvscope.exporters import rdma_text
from kvscope.exporters.base import CollectError, collectors
from kvscope.exporters.config import parse_config
from kvscope.exporters.normalizer import mapping_for
from kvscope.exporters.otel import TelemetryBridge
from kvscope.exporters.rdma import RdmaCollector, parse_statistic_json
from kvscope.exporters.scrape import Scraper

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "rdma" / "sysfs"
SYNTHETIC = FIXTURE.parent / "synthetic" / "sysfs"  # made-up congestion counters: not a capture
NODE_EXPORTER_FIXTURE = FIXTURE.parent / "node_exporter"  # node_exporter's own tree and golden output (PROVENANCE)
NIC = ("host", "device", "port", "netdev", "role")
# The counters exporters/mappings/rdma.yaml maps to rdma.port.errors, by raw series.
PMA_ERRORS = (
    "symbol_error",
    "link_error_recovery",
    "link_downed",
    "port_rcv_errors",
    "port_rcv_remote_physical_errors",
    "port_rcv_switch_relay_errors",
    "port_xmit_discards",
    "port_xmit_constraint_errors",
    "port_rcv_constraint_errors",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
    "VL15_dropped",
)
HW_ERRORS = ("out_of_sequence", "packet_seq_err", "local_ack_timeout_err", "rnr_nak_retry_err", "out_of_buffer")
# rdma.port.congestion's events, by the mlx5 hw counter each comes from.
CONGESTION = {
    "np_cnp_sent": "cnp_sent",
    "np_ecn_marked_roce_packets": "ecn_marked",
    "rp_cnp_handled": "cnp_handled",
    "rp_cnp_ignored": "cnp_ignored",
}


def config_of(sysfs: Path, **fields):
    target = {"name": "rdma-a", "source": "rdma", "sysfs": str(sysfs), "host": "node-a", **fields}
    return parse_config({"targets": [target]}).targets[0]


def scrape(sysfs: Path, **fields) -> tuple[list, list]:
    config = config_of(sysfs, **fields)
    raw = asyncio.run(collect_once(RdmaCollector(config)))
    return raw, mapping_for("rdma").apply(raw, config.labels)


async def collect_once(collector: RdmaCollector) -> list:
    try:
        return await collector.collect()
    finally:
        await collector.close()


def find(samples, name: str, **labels) -> list:
    return [s for s in samples if s.name == name and all(s.label_map.get(k) == v for k, v in labels.items())]


def value(samples, name: str, **labels) -> float:
    found = find(samples, name, **labels)
    assert len(found) == 1, f"{name} {labels}: {len(found)} samples"
    return found[0].value


def nic(device: str, port: str, netdev: str = "", role: str = "", host: str = "node-a") -> tuple:
    return tuple(sorted({"host": host, "device": device, "port": port, "netdev": netdev, "role": role}.items()))


def bytes_by_port(normalized) -> dict[tuple[str, tuple], float]:
    """rdma.port.tx.bytes and rdma.port.rx.bytes: (instrument, labels) -> value."""
    return {(s.name, s.labels): s.value for s in normalized if s.name.endswith(".bytes")}


def ports_of(normalized) -> list:
    """The port-level model samples (all but rdma.device.info, which has no port or netdev)."""
    return [s for s in normalized if s.name != "rdma.device.info"]


# Model instruments only the drivers' hw_counters/ feed.
HW_INSTRUMENTS = {
    "rdma.port.congestion",
    "rdma.port.completion.errors",
    "rdma.port.transport.events",
    "rdma.port.received.requests",
    "rdma.port.counters.lifespan",
}


def from_hw_counters(sample) -> bool:
    return sample.name in HW_INSTRUMENTS or sample.label_map.get("error") in (*HW_ERRORS, "rx_icrc_encapsulated")


def model(normalized, instrument: str, key: str) -> dict[tuple[str, str, str], float]:
    """One instrument's series: (device, port, the value of label `key`) -> value."""
    found = [s for s in normalized if s.name == instrument]
    return {(s.label_map["device"], s.label_map["port"], s.label_map[key]): s.value for s in found}


# --- synthetic sysfs ---------------------------------------------------------------------------------------------


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{text}\n")


def rdma_device(sysfs: Path, device: str, pci: str = "0000:3b:00.0") -> Path:
    """<sysfs>/devices/pci0000:00/<pci>/infiniband/<device>, linked from class/infiniband, `device` -> the PCI dir."""
    pci_dir = sysfs / "devices" / "pci0000:00" / pci
    device_dir = pci_dir / "infiniband" / device
    device_dir.mkdir(parents=True)
    link = sysfs / "class" / "infiniband" / device
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(device_dir, link.parent))
    (device_dir / "device").symlink_to(os.path.relpath(pci_dir, device_dir))
    write(device_dir / "fw_ver", "22.39.1002")
    return device_dir


def rdma_port(
    device_dir: Path,
    port: str = "1",
    *,
    link_layer: str = "Ethernet",
    rate: str = "100 Gb/sec (2X HDR)",
    counters: dict[str, object] | None = None,
    counters_ext: dict[str, object] | None = None,
    hw: dict[str, object] | None = None,
    ndevs: dict[str, str] | None = None,
) -> Path:
    path = device_dir / "ports" / port
    write(path / "link_layer", link_layer)
    write(path / "rate", rate)
    write(path / "state", "4: ACTIVE")
    write(path / "phys_state", "5: LinkUp")
    for group, files in (("counters", counters), ("counters_ext", counters_ext), ("hw_counters", hw)):
        for name, number in (files or {}).items():
            write(path / group / name, str(number))
    for index, name in (ndevs or {}).items():
        write(path / "gid_attrs" / "ndevs" / index, name)
    return path


def netdev(device_dir: Path, name: str, dev_port: int | None = None, dev_id: str | None = None) -> None:
    """A netdev of the device's PCI function (written through the `device` symlink)."""
    net = device_dir / "device" / "net" / name
    net.mkdir(parents=True)
    if dev_port is not None:
        write(net / "dev_port", str(dev_port))
    if dev_id is not None:
        write(net / "dev_id", dev_id)


def roce_host(sysfs: Path) -> Path:
    """mlx5_0: one RoCE port on ens1f0np0, with mlx5 congestion counters."""
    device = rdma_device(sysfs, "mlx5_0")
    netdev(device, "ens1f0np0", dev_port=0)
    rdma_port(
        device,
        counters={"port_xmit_data": 123456789012, "port_rcv_data": 98765432109, "symbol_error": 0},
        hw={
            "np_cnp_sent": 4242,
            "rp_cnp_handled": 4100,
            "rp_cnp_ignored": 3,
            "np_ecn_marked_roce_packets": 5150,
            "rx_icrc_encapsulated": 0,
            "out_of_buffer": 17,
            "lifespan": 10,
        },
        ndevs={"0": "ens1f0np0", "1": "ens1f0np0", "2": "ens1f0np0.100"},
    )
    return device


# --- the fixture tree --------------------------------------------------------------------------------------------


def test_the_source_is_discovered():
    assert collectors()["rdma"] is RdmaCollector


def test_the_source_is_one_collector_over_its_modules():
    found = {name: cls.__module__ for name, cls in collectors().items()}
    assert [name for name, module in found.items() if module.startswith("kvscope.exporters.rdma")] == ["rdma"]
    assert found["rdma"] == "kvscope.exporters.rdma"


def test_the_parsers_read_captured_attribute_files_alone():
    port = FIXTURE / "class" / "infiniband" / "mlx4_0" / "ports" / "1"
    assert rdma_text.state(rdma_text.text((port / "state").read_bytes())) == (4, "ACTIVE")
    assert rdma_text.state(rdma_text.text((port / "phys_state").read_bytes())) == (5, "LinkUp")
    assert rdma_text.rate_gbps(rdma_text.text((port / "rate").read_bytes())) == 40
    assert rdma_text.counter((port / "counters" / "port_xmit_wait").read_bytes()) == 3599
    no_pma = NODE_EXPORTER_FIXTURE / "sysfs" / "class" / "infiniband" / "i40iw0" / "ports" / "1" / "counters"
    assert rdma_text.counter((no_pma / "symbol_error").read_bytes()) is None  # N/A (no PMA)
    with pytest.raises(rdma_text.BadValue) as bad:
        rdma_text.counter(b"1" * 4301)
    assert bad.value.reason == "out_of_range"


def test_fixture_raw_samples_keep_the_sysfs_values():
    raw, _ = scrape(FIXTURE)
    assert all(s.source == "rdma" and not s.normalized for s in raw)
    # PMA counters, in the sysfs unit (words for data): hand-read from the files.
    assert value(raw, "rdma_port_counter", device="mlx4_0", port="1", counter="port_xmit_data") == 26509113295
    assert value(raw, "rdma_port_counter", device="mlx4_0", port="2", counter="port_rcv_data") == 2460436784
    assert value(raw, "rdma_port_counter", device="mlx4_0", port="2", counter="port_xmit_wait") == 3846
    assert value(raw, "rdma_port_counter", device="mlx5_0", port="1", counter="unicast_xmit_packets") == 10907922116
    assert value(raw, "rdma_port_counter", device="hfi1_0", port="1", counter="port_rcv_data") == 345091702026
    # Every file of every counters/ directory is a sample: 17 + 17 (mlx4), 21 (mlx5), 17 (hfi1).
    assert len(find(raw, "rdma_port_counter")) == 72
    # mlx5 hw_counters: 24 counters; lifespan is a setting (ms), a gauge of its own.
    hw = find(raw, "rdma_port_hw_counter", device="mlx5_0", port="1")
    assert len(hw) == 24 and "lifespan" not in {s.label_map["counter"] for s in hw}
    assert value(raw, "rdma_port_hw_counter", device="mlx5_0", counter="rx_read_requests") == 175528982
    assert value(raw, "rdma_port_hw_counter", device="mlx5_0", counter="req_cqe_error") == 3481
    assert value(raw, "rdma_port_hw_counters_lifespan_ms", device="mlx5_0", port="1") == 10
    assert {s.kind for s in hw} == {"counter"}


def test_fixture_port_information():
    raw, _ = scrape(FIXTURE)
    rates = {(s.label_map["device"], s.label_map["port"]): s.value for s in find(raw, "rdma_port_rate_gbps")}
    assert rates == {("hfi1_0", "1"): 100.0, ("mlx4_0", "1"): 40.0, ("mlx4_0", "2"): 40.0, ("mlx5_0", "1"): 25.0}
    assert {s.value for s in find(raw, "rdma_port_state")} == {4.0}
    assert value(raw, "rdma_port_phys_state", device="mlx4_0", port="1") == 5
    info = find(raw, "rdma_port_info", device="hfi1_0")[0]
    assert info.kind == "info" and info.value == 1
    assert info.label_map == {
        "host": "node-a",
        "device": "hfi1_0",
        "port": "1",
        "netdev": "",
        "role": "",
        "state": "ACTIVE",
        "phys_state": "LinkUp",
        "link_layer": "InfiniBand",
        "rate": "100 Gb/sec (4X EDR)",
    }
    device = find(raw, "rdma_device_info", device="mlx5_0")[0].label_map
    assert (device["fw_ver"], device["hca_type"], device["node_guid"]) == (
        "14.28.2006",
        "MT4118",
        "0a7f:bc12:45ef:d23b",
    )
    # No counter of the fixture is stuck at its maximum.
    saturated = find(raw, "rdma_port_counter_saturated")
    assert len(saturated) == 4 * 17 and {s.value for s in saturated} == {0.0}


def test_fixture_bytes_are_words_times_four():
    raw, normalized = scrape(FIXTURE)
    assert all(s.normalized for s in normalized) and {s.kind for s in normalized if s.name.endswith(".bytes")} == {
        "counter"
    }
    assert {s.label_map["file"] for s in find(raw, "rdma_port_data_words")} == {
        "counters/port_xmit_data",
        "counters/port_rcv_data",
    }
    assert bytes_by_port(normalized) == {
        ("rdma.port.tx.bytes", nic("mlx4_0", "1")): 26509113295 * 4,
        ("rdma.port.rx.bytes", nic("mlx4_0", "1")): 2221223609 * 4,
        ("rdma.port.tx.bytes", nic("mlx4_0", "2")): 26540356890 * 4,
        ("rdma.port.rx.bytes", nic("mlx4_0", "2")): 2460436784 * 4,
        ("rdma.port.tx.bytes", nic("mlx5_0", "1")): 2880761508848 * 4,  # 11523046035392
        ("rdma.port.rx.bytes", nic("mlx5_0", "1")): 18126345378 * 4,
        ("rdma.port.tx.bytes", nic("hfi1_0", "1")): 273558326543 * 4,
        ("rdma.port.rx.bytes", nic("hfi1_0", "1")): 345091702026 * 4,
    }
    assert bytes_by_port(normalized)[("rdma.port.tx.bytes", nic("mlx5_0", "1"))] == 11523046035392


def test_fixture_errors_are_the_error_counters_as_read():
    raw, normalized = scrape(FIXTURE)
    errors = model(normalized, "rdma.port.errors", "error")
    ports = [("mlx4_0", "1"), ("mlx4_0", "2"), ("mlx5_0", "1"), ("hfi1_0", "1")]
    # Every PMA error counter of every port, and mlx5's five transport error counters: 4 x 12 + 5.
    assert set(errors) == {(d, p, e) for d, p in ports for e in PMA_ERRORS} | {("mlx5_0", "1", e) for e in HW_ERRORS}
    for (device, port, error), number in errors.items():
        name = "rdma_port_counter" if error in PMA_ERRORS else "rdma_port_hw_counter"
        assert number == value(raw, name, device=device, port=port, counter=error), (device, port, error)
    # Hand-read from mlx5_0/ports/1/hw_counters; the captured PMA error counters are all 0.
    assert errors[("mlx5_0", "1", "local_ack_timeout_err")] == 131
    assert errors[("mlx5_0", "1", "out_of_sequence")] == errors[("mlx5_0", "1", "packet_seq_err")] == 1
    assert {errors[(d, p, e)] for d, p in ports for e in PMA_ERRORS} == {0}
    assert {s.kind for s in find(normalized, "rdma.port.errors")} == {"counter"}
    assert set(find(normalized, "rdma.port.errors")[0].label_map) == {*NIC, "error"}
    # Counters that are not errors, or count teardowns too, stay raw.
    assert not {"port_xmit_wait", "duplicate_request", "req_cqe_error", "resp_cqe_flush_error"} & {
        error for _, _, error in errors
    }
    # The capture has no congestion counters: no congestion series.
    assert find(normalized, "rdma.port.congestion") == []


def test_synthetic_congestion_counters_map_to_events():
    # SYNTHETIC tree: the captured mlx5 port as mlx5_1, with made-up np_/rp_ counters (fixtures/rdma/PROVENANCE.md).
    raw, normalized = scrape(SYNTHETIC, roles={"mlx5_1": "nof"})
    congestion = model(normalized, "rdma.port.congestion", "event")
    assert congestion == {
        ("mlx5_1", "1", "cnp_sent"): 18432,
        ("mlx5_1", "1", "ecn_marked"): 20917,
        ("mlx5_1", "1", "cnp_handled"): 9306,
        ("mlx5_1", "1", "cnp_ignored"): 2,
    }
    for counter, event in CONGESTION.items():
        assert congestion[("mlx5_1", "1", event)] == value(raw, "rdma_port_hw_counter", counter=counter)
    (sample,) = find(normalized, "rdma.port.congestion", event="cnp_sent")
    assert sample.label_map == {
        "host": "node-a", "device": "mlx5_1", "port": "1", "netdev": "", "role": "nof", "event": "cnp_sent"
    }  # fmt: skip
    assert sample.kind == "counter" and sample.source == "rdma" and sample.normalized
    # The copied counters map as in the capture: bytes and errors of mlx5_0, under mlx5_1.
    captured = scrape(FIXTURE, devices=["mlx5_0"])[1]
    assert model(normalized, "rdma.port.errors", "error") == {
        ("mlx5_1", p, e): v for (_, p, e), v in model(captured, "rdma.port.errors", "error").items()
    }


def test_each_error_counter_maps_to_its_own_error(tmp_path):
    # Distinct values per counter, each within its width (4, 8 or 16 bits): a rule reading the wrong file shows.
    pma = {name: index + 1 for index, name in enumerate(PMA_ERRORS)}
    hw = {name: 100 + index for index, name in enumerate(HW_ERRORS)}
    rdma_port(rdma_device(tmp_path, "mlx5_0"), counters={**pma, "port_xmit_wait": 999}, hw={**hw, "req_cqe_error": 7})
    _, normalized = scrape(tmp_path, roles={"mlx5_0": "dram"})
    assert model(normalized, "rdma.port.errors", "error") == {("mlx5_0", "1", e): v for e, v in {**pma, **hw}.items()}
    assert {s.label_map["role"] for s in normalized} == {"dram"}


def test_promtool_accepts_the_exported_congestion_and_errors(check_metrics):
    target = {"name": "nics", "source": "rdma", "sysfs": str(SYNTHETIC), "host": "node-a", "roles": {"mlx5_1": "nof"}}
    text = served_exposition(parse_config({"exporter": {"listen_port": 0}, "targets": [target]}))
    assert "\nrdma_port_congestion_total{" in text and "\nrdma_port_errors_total{" in text
    check_metrics(text)


def test_hw_counters_off_reads_only_the_port_counters_and_keeps_the_bytes():
    everything, normalized = scrape(FIXTURE)
    lean, lean_normalized = scrape(FIXTURE, hw_counters=False)
    assert find(everything, "rdma_port_hw_counter") and not find(lean, "rdma_port_hw_counter")
    assert not find(lean, "rdma_device_hw_counter")
    assert {s.name for s in lean} == {s.name for s in everything} - {
        "rdma_port_hw_counter",
        "rdma_device_hw_counter",
        "rdma_port_hw_counters_lifespan_ms",
        "rdma_device_hw_counters_lifespan_ms",
    }
    # Only what the drivers' hw_counters/ count is lost: bytes, packets, state and the PMA error counters stay.
    assert lean_normalized == [s for s in normalized if not from_hw_counters(s)]


def test_devices_filter_reads_only_those():
    raw, normalized = scrape(FIXTURE, devices=["mlx5_0"])
    assert {s.label_map["device"] for s in raw} == {"mlx5_0"}
    assert {s.label_map["device"] for s in normalized} == {"mlx5_0"}
    assert len(bytes_by_port(normalized)) == 2


def test_a_scrape_changes_nothing_in_the_tree(tmp_path):
    roce_host(tmp_path)
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in tmp_path.rglob("*") if p.is_file()}
    scrape(tmp_path)
    after = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before


def test_the_tree_is_walked_in_the_targets_own_thread(monkeypatch):
    import threading

    from kvscope.exporters.base import Collector

    calls = []
    real = Collector.blocking

    async def recording(self, function, *args, **kwargs):
        def noted(*args):
            calls.append((function.__name__, threading.current_thread().name))
            return function(*args)

        return await real(self, noted, *args, **kwargs)

    monkeypatch.setattr(RdmaCollector, "blocking", recording)
    scrape(FIXTURE)
    # close() too: never under a scan that may still be reading
    assert calls == [("_scan", "kvscope rdma-a"), ("_forget", "kvscope rdma-a")]


# --- errors ------------------------------------------------------------------------------------------------------


def test_a_missing_sysfs_path_names_the_target_and_the_path(tmp_path):
    missing = tmp_path / "no-such-sys"
    with pytest.raises(CollectError) as caught:
        scrape(missing)
    assert "rdma-a" in str(caught.value) and str(missing / "class" / "infiniband") in str(caught.value)


def test_a_listed_device_that_is_absent_fails_the_scrape():
    with pytest.raises(CollectError, match=r"rdma-a: RDMA device\(s\) mlx5_9 not found under .*present: hfi1_0"):
        scrape(FIXTURE, devices=["mlx5_0", "mlx5_9"])


def test_an_empty_class_directory_is_no_samples(tmp_path):
    (tmp_path / "class" / "infiniband").mkdir(parents=True)
    assert scrape(tmp_path) == ([], [])


# --- RoCE, netdevs, congestion -------------------------------------------------------------------------------------


def test_roce_port_netdev_from_gid_table_and_congestion_counters(tmp_path):
    roce_host(tmp_path)
    raw, normalized = scrape(tmp_path, roles={"ens1f0np0": "nof"})
    labels = {"device": "mlx5_0", "port": "1", "netdev": "ens1f0np0", "role": "nof"}
    assert value(raw, "rdma_port_hw_counter", counter="np_cnp_sent", **labels) == 4242
    assert value(raw, "rdma_port_hw_counter", counter="rp_cnp_handled", **labels) == 4100
    assert value(raw, "rdma_port_hw_counter", counter="rp_cnp_ignored", **labels) == 3
    assert value(raw, "rdma_port_hw_counter", counter="np_ecn_marked_roce_packets", **labels) == 5150
    assert value(raw, "rdma_port_hw_counter", counter="rx_icrc_encapsulated", **labels) == 0
    assert find(raw, "rdma_port_info", **labels)[0].label_map["link_layer"] == "Ethernet"
    assert value(raw, "rdma_port_rate_gbps", **labels) == 100
    assert bytes_by_port(normalized) == {
        ("rdma.port.tx.bytes", nic("mlx5_0", "1", "ens1f0np0", "nof")): 123456789012 * 4,
        ("rdma.port.rx.bytes", nic("mlx5_0", "1", "ens1f0np0", "nof")): 98765432109 * 4,
    }
    assert model(normalized, "rdma.port.congestion", "event") == {
        ("mlx5_0", "1", "cnp_sent"): 4242,
        ("mlx5_0", "1", "cnp_handled"): 4100,
        ("mlx5_0", "1", "cnp_ignored"): 3,
        ("mlx5_0", "1", "ecn_marked"): 5150,
    }
    assert model(normalized, "rdma.port.errors", "error") == {
        ("mlx5_0", "1", "symbol_error"): 0,
        ("mlx5_0", "1", "out_of_buffer"): 17,
        ("mlx5_0", "1", "rx_icrc_encapsulated"): 0,
    }
    assert {s.label_map["netdev"] + "/" + s.label_map["role"] for s in ports_of(normalized)} == {"ens1f0np0/nof"}
    # Every port-level sample carries all five model labels.
    for sample in raw:
        if "port" in sample.label_map:
            assert set(NIC) <= set(sample.label_map), sample


def test_gid_netdev_is_the_lowest_readable_entry(tmp_path):
    device = rdma_device(tmp_path, "mlx5_0")
    port = rdma_port(device, ndevs={"1": "bond0", "2": "bond0.200", "10": "other"})
    (port / "gid_attrs" / "ndevs" / "0").mkdir()  # reading it fails, as an unused GID entry's EINVAL does
    raw, _ = scrape(tmp_path)
    assert value(raw, "rdma_port_info", device="mlx5_0")
    assert find(raw, "rdma_port_info")[0].label_map["netdev"] == "bond0"


def test_roce_port_without_gid_netdevs_falls_back_to_the_pci_netdev(tmp_path):
    device = rdma_device(tmp_path, "mlx5_1", pci="0000:3b:00.1")
    netdev(device, "ens1f1np1", dev_port=0)
    rdma_port(device, counters={"port_xmit_data": 10, "port_rcv_data": 20})
    _, normalized = scrape(tmp_path)
    assert {s.label_map["netdev"] for s in ports_of(normalized)} == {"ens1f1np1"}


def test_ib_ports_map_to_ipoib_netdevs_by_dev_port(tmp_path):
    device = rdma_device(tmp_path, "mlx4_0")
    netdev(device, "ib0", dev_port=0)
    netdev(device, "ib0.8001", dev_port=0)  # a child interface: the parent is preferred
    netdev(device, "ib1", dev_port=1)
    for port in ("1", "2"):
        rdma_port(device, port, link_layer="InfiniBand", counters={"port_xmit_data": 1, "port_rcv_data": 1})
    raw, _ = scrape(tmp_path)
    netdevs = {s.label_map["port"]: s.label_map["netdev"] for s in find(raw, "rdma_port_info")}
    assert netdevs == {"1": "ib0", "2": "ib1"}


def test_older_kernels_dev_id_and_a_lone_netdev(tmp_path):
    old = rdma_device(tmp_path, "mlx4_0")
    netdev(old, "eth0", dev_id="0x0")
    netdev(old, "eth1", dev_id="0x1")
    rdma_port(old, "1")
    rdma_port(old, "2")
    lone = rdma_device(tmp_path, "rxe0", pci="0000:00:03.0")
    netdev(lone, "enp0s3")  # says nothing about its port: the only netdev is taken
    rdma_port(lone, "1", rate="10 Gb/sec (1X QDR)")
    raw, _ = scrape(tmp_path)
    netdevs = {(s.label_map["device"], s.label_map["port"]): s.label_map["netdev"] for s in find(raw, "rdma_port_info")}
    assert netdevs == {("mlx4_0", "1"): "eth0", ("mlx4_0", "2"): "eth1", ("rxe0", "1"): "enp0s3"}
    assert value(raw, "rdma_port_rate_gbps", device="rxe0") == 10


# --- values that are not numbers, legacy files, saturation and wrap -----------------------------------------------


def test_na_no_pma_values_are_skipped_not_fatal(tmp_path):
    device = rdma_device(tmp_path, "siw0")
    rdma_port(
        device,
        counters={"port_xmit_data": "N/A (no PMA)", "port_rcv_data": "N/A (no PMA)", "symbol_error": "N/A (no PMA)"},
        hw={"tx_bytes": 5000, "broken": ""},
    )
    raw, normalized = scrape(tmp_path)
    assert find(raw, "rdma_port_counter") == [] and find(raw, "rdma_port_counter_saturated") == []
    assert find(raw, "rdma_port_data_words") == [] and bytes_by_port(normalized) == {}
    assert not find(normalized, "rdma.port.errors") and not find(normalized, "rdma.port.saturated")
    assert [s.label_map["counter"] for s in find(raw, "rdma_port_hw_counter")] == ["tx_bytes"]
    assert value(raw, "rdma_port_state", device="siw0") == 4


def test_legacy_counters_ext_is_preferred_per_port(tmp_path):
    # mlx4_0 (legacy OFED): the 32-bit counters/port_xmit_data is stuck at 2^32-1; counters_ext has the 64-bit one.
    legacy = rdma_device(tmp_path, "mlx4_0")
    rdma_port(
        legacy,
        link_layer="InfiniBand",
        counters={"port_xmit_data": 2**32 - 1, "port_rcv_data": 123},
        counters_ext={"port_xmit_data_64": 5_000_000_000, "port_rcv_data_64": 123, "port_xmit_packets_64": 77},
    )
    # mlx5_0 on the same host has no counters_ext: its counters/ must still be mapped.
    current = rdma_device(tmp_path, "mlx5_0", pci="0000:af:00.0")
    rdma_port(current, link_layer="InfiniBand", counters={"port_xmit_data": 1000, "port_rcv_data": 2000})
    raw, normalized = scrape(tmp_path)
    assert value(raw, "rdma_port_counter_ext", device="mlx4_0", counter="port_xmit_data_64") == 5_000_000_000
    assert value(raw, "rdma_port_counter_ext", device="mlx4_0", counter="port_xmit_packets_64") == 77
    assert value(raw, "rdma_port_counter", device="mlx4_0", counter="port_xmit_data") == 2**32 - 1
    assert value(raw, "rdma_port_counter_saturated", device="mlx4_0", counter="port_xmit_data") == 1
    assert value(raw, "rdma_port_data_words", device="mlx4_0", direction="tx") == 5_000_000_000
    assert find(raw, "rdma_port_data_words", device="mlx4_0", direction="tx")[0].label_map["file"] == (
        "counters_ext/port_xmit_data_64"
    )
    assert bytes_by_port(normalized) == {
        ("rdma.port.tx.bytes", nic("mlx4_0", "1")): 20_000_000_000,  # not 4 x (5e9 + 2^32-1)
        ("rdma.port.rx.bytes", nic("mlx4_0", "1")): 492,
        ("rdma.port.tx.bytes", nic("mlx5_0", "1")): 4000,
        ("rdma.port.rx.bytes", nic("mlx5_0", "1")): 8000,
    }


def test_unreadable_counters_ext_falls_back_to_counters(tmp_path):
    device = rdma_device(tmp_path, "mlx4_0")
    rdma_port(
        device,
        counters={"port_xmit_data": 40, "port_rcv_data": 50},
        counters_ext={"port_xmit_data_64": "N/A (no PMA)"},
    )
    raw, _ = scrape(tmp_path)
    files = {s.label_map["direction"]: s.label_map["file"] for s in find(raw, "rdma_port_data_words")}
    assert files == {"tx": "counters/port_xmit_data", "rx": "counters/port_rcv_data"}


def test_narrow_error_counters_at_their_maximum_are_flagged_saturated(tmp_path):
    device = rdma_device(tmp_path, "mlx5_0")
    narrow = {
        "local_link_integrity_errors": 15,  # 4 bits
        "excessive_buffer_overrun_errors": 14,
        "link_downed": 255,  # 8 bits
        "port_rcv_constraint_errors": 254,
        "symbol_error": 65535,  # 16 bits
        "port_rcv_errors": 65534,
        "VL15_dropped": 65535,
        "port_xmit_wait": 2**32 - 1,  # 32 bits
        "port_xmit_data": 2**32,  # above 2^32-1: a 64-bit (extended) counter, not stuck
    }
    rdma_port(device, link_layer="InfiniBand", counters=narrow)
    raw, _ = scrape(tmp_path)
    flags = {s.label_map["counter"]: s.value for s in find(raw, "rdma_port_counter_saturated")}
    assert flags == {
        "local_link_integrity_errors": 1,
        "excessive_buffer_overrun_errors": 0,
        "link_downed": 1,
        "port_rcv_constraint_errors": 0,
        "symbol_error": 1,
        "port_rcv_errors": 0,
        "VL15_dropped": 1,
        "port_xmit_wait": 1,
        "port_xmit_data": 0,
    }
    # The counters themselves are exported as read.
    assert value(raw, "rdma_port_counter", counter="symbol_error") == 65535


def test_a_32_bit_hw_counter_at_its_maximum_is_exported_raw_and_its_wrap_is_a_reset(tmp_path):
    roce_host(tmp_path)
    counter = tmp_path / "class/infiniband/mlx5_0/ports/1/hw_counters/out_of_buffer"
    write(counter, str(2**32 - 1))
    config = config_of(tmp_path)
    scraper = Scraper([config])

    async def twice():
        first = await scraper.scrape("rdma-a")
        first_raw = list(first.raw)
        write(counter, "6")  # the 32-bit hardware counter wrapped
        second = await scraper.scrape("rdma-a")
        await scraper.close()
        return first_raw, second

    first_raw, second = asyncio.run(twice())
    assert value(first_raw, "rdma_port_hw_counter", counter="out_of_buffer") == 4294967295
    # hw counters wrap, they do not saturate: no saturation flag, no unwrapping.
    assert find(first_raw, "rdma_port_counter_saturated", counter="out_of_buffer") == []
    assert second.up and value(second.raw, "rdma_port_hw_counter", counter="out_of_buffer") == 6
    resets = [r for r in second.recent_resets if r.name == "rdma_port_hw_counter"]
    assert [(dict(r.labels)["counter"], r.before, r.after) for r in resets] == [("out_of_buffer", 4294967295, 6)]


def test_a_file_whose_bytes_did_not_change_keeps_its_samples_and_one_that_did_is_read_again(tmp_path):
    roce_host(tmp_path)
    counters = tmp_path / "class/infiniband/mlx5_0/ports/1/counters"
    write(counters / "symbol_error", "65535")  # 16 bits: saturated
    collector = RdmaCollector(config_of(tmp_path))

    async def scrapes() -> list[tuple[list, list]]:
        seen = []
        try:
            for symbol_error in ("65535", "3", "x", "x"):
                write(counters / "symbol_error", symbol_error)
                seen.append((await collector.collect(), collector.take_read_errors()))
        finally:
            await collector.close()
        return seen

    (first, _), (second, _), (_, errors), (fourth, errors_again) = asyncio.run(scrapes())
    assert value(first, "rdma_port_counter_saturated", counter="symbol_error") == 1
    assert value(second, "rdma_port_counter", counter="symbol_error") == 3
    assert value(second, "rdma_port_counter_saturated", counter="symbol_error") == 0
    unchanged = [s for s in second if s.label_map.get("counter") != "symbol_error"]
    assert unchanged and all(any(s is kept for kept in first) for s in unchanged), "the same sample objects"
    # a file that does not hold a number is a read error every scrape, its bytes the same or not
    assert [e.reason for e in errors] == [e.reason for e in errors_again] == ["unparseable"]
    assert find(fourth, "rdma_port_counter", counter="symbol_error") == []


# --- files kept open between scrapes -----------------------------------------------------------------------------


def open_files(under: Path) -> list[str]:
    """The files under `under` this process holds open (from /proc/self/fd), "... (deleted)" when removed since."""
    root = str(under.resolve())
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the descriptor that listed the directory is closed by now
            if (target := os.readlink(f"/proc/self/fd/{fd}")).startswith(root):
                found.append(target)
    return sorted(found)


def sysfs_pread(monkeypatch) -> None:
    """pread as sysfs answers it: ENODEV on the descriptor of a removed attribute (a removed regular file would
    still read its old bytes)."""
    real = os.pread

    def pread(fd: int, size: int, offset: int) -> bytes:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(" (deleted)"):
            raise OSError(errno.ENODEV, os.strerror(errno.ENODEV))
        return real(fd, size, offset)

    monkeypatch.setattr(os, "pread", pread)


def test_every_scrape_reads_the_current_values_through_the_descriptors_it_keeps(tmp_path, monkeypatch):
    port = roce_host(tmp_path) / "ports" / "1"
    collector = RdmaCollector(config_of(tmp_path))
    first = asyncio.run(collector.collect())
    held = open_files(tmp_path)
    assert str((port / "counters" / "port_xmit_data").resolve()) in held
    write(port / "counters" / "port_xmit_data", "123456789999")
    write(port / "hw_counters" / "np_cnp_sent", "4300")
    write(port / "state", "1: DOWN")
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *args: opened.append(os.fspath(path)) or real_open(path, *args))
    second = asyncio.run(collector.collect())
    monkeypatch.undo()
    assert value(first, "rdma_port_counter", counter="port_xmit_data") == 123456789012
    assert value(second, "rdma_port_counter", counter="port_xmit_data") == 123456789999
    assert value(second, "rdma_port_data_words", direction="tx") == 123456789999
    assert value(second, "rdma_port_hw_counter", counter="np_cnp_sent") == 4300
    assert value(second, "rdma_port_state") == 1 and find(second, "rdma_port_info")[0].label_map["state"] == "DOWN"
    # Read through the same descriptors: no attribute opened again (only the GID netdev, looked up every scrape).
    assert open_files(tmp_path) == held
    assert [os.path.basename(path) for path in opened] == ["0"]
    asyncio.run(collector.close())
    assert open_files(tmp_path) == []


def test_a_collector_dropped_without_close_leaves_no_descriptor(tmp_path):
    roce_host(tmp_path)
    collector = RdmaCollector(config_of(tmp_path))
    asyncio.run(collector.collect())
    assert open_files(tmp_path)
    del collector
    gc.collect()
    assert open_files(tmp_path) == []


def test_a_removed_device_is_dropped_and_its_files_closed(tmp_path):
    roce_host(tmp_path)
    other = rdma_device(tmp_path, "mlx5_1", pci="0000:3b:00.1")
    rdma_port(other, counters={"port_xmit_data": 10, "port_rcv_data": 20})
    collector = RdmaCollector(config_of(tmp_path))
    first = asyncio.run(collector.collect())
    assert {s.label_map["device"] for s in first} == {"mlx5_0", "mlx5_1"}
    assert [path for path in open_files(tmp_path) if "/mlx5_1/" in path]
    (tmp_path / "class" / "infiniband" / "mlx5_1").unlink()
    shutil.rmtree(other)
    second = asyncio.run(collector.collect())
    assert {s.label_map["device"] for s in second} == {"mlx5_0"}
    assert not [path for path in open_files(tmp_path) if "/mlx5_1/" in path]
    assert len(second) == len(asyncio.run(collect_once(RdmaCollector(config_of(tmp_path)))))
    asyncio.run(collector.close())


def two_port_device(sysfs: Path) -> tuple[Path, RdmaCollector, list]:
    """An InfiniBand mlx4_0 with ports 1 and 2 under `sysfs`, a collector of it and that collector's first scrape."""
    device = rdma_device(sysfs, "mlx4_0")
    for port in ("1", "2"):
        rdma_port(device, port, link_layer="InfiniBand", counters={"port_xmit_data": 1, "port_rcv_data": 2})
    collector = RdmaCollector(config_of(sysfs))
    return device, collector, asyncio.run(collector.collect())


def test_a_device_registered_again_under_its_name_is_listed_again(tmp_path):
    device, collector, first = two_port_device(tmp_path)
    assert {s.label_map["port"] for s in find(first, "rdma_port_info")} == {"1", "2"}
    # The driver unregisters mlx4_0 and registers it again with one port: a new class/infiniband entry, same name.
    again = rdma_device(tmp_path / "again", "mlx4_0", pci="0000:3b:00.0")
    rdma_port(again, link_layer="InfiniBand", counters={"port_xmit_data": 5, "port_rcv_data": 6})
    link = tmp_path / "class" / "infiniband" / "mlx4_0"
    (tmp_path / "new-link").symlink_to(os.path.relpath(again, link.parent))
    os.replace(tmp_path / "new-link", link)
    shutil.rmtree(device)
    second = asyncio.run(collector.collect())
    assert {s.label_map["port"] for s in find(second, "rdma_port_info")} == {"1"}
    assert value(second, "rdma_port_data_words", direction="tx") == 5
    assert open_files(tmp_path) and not [path for path in open_files(tmp_path) if path.endswith(" (deleted)")]
    asyncio.run(collector.close())


def test_a_removed_port_whose_files_answer_enodev_is_dropped(tmp_path, monkeypatch):
    device, collector, first = two_port_device(tmp_path)
    assert {s.label_map["port"] for s in find(first, "rdma_port_info")} == {"1", "2"}
    sysfs_pread(monkeypatch)
    shutil.rmtree(device / "ports" / "2")  # the same class/infiniband entry: only the descriptors can tell
    second = asyncio.run(collector.collect())
    assert {s.label_map["port"] for s in second if "port" in s.label_map} == {"1"}
    assert open_files(tmp_path) and not [path for path in open_files(tmp_path) if path.endswith(" (deleted)")]
    asyncio.run(collector.close())


def test_a_renamed_netdev_gives_new_labels_at_the_next_scrape(tmp_path):
    device = roce_host(tmp_path)
    config = config_of(tmp_path, roles={"ens1f0np0": "nof", "eth9": "dram"})
    collector = RdmaCollector(config)
    first = asyncio.run(collector.collect())
    write(device / "ports" / "1" / "gid_attrs" / "ndevs" / "0", "eth9")
    second = asyncio.run(collector.collect())
    asyncio.run(collector.close())
    normalized = [mapping_for("rdma").apply(raw, config.labels) for raw in (first, second)]
    assert {s.label_map["netdev"] + "/" + s.label_map["role"] for s in ports_of(normalized[0])} == {"ens1f0np0/nof"}
    assert {s.label_map["netdev"] + "/" + s.label_map["role"] for s in ports_of(normalized[1])} == {"eth9/dram"}
    assert {s.label_map["netdev"] for s in second if "port" in s.label_map} == {"eth9"}


def test_the_tree_is_listed_again_every_rescan_interval(tmp_path, monkeypatch):
    import kvscope.exporters.rdma as module

    monkeypatch.setattr(module, "RESCAN_S", 0.0)
    port = roce_host(tmp_path) / "ports" / "1"
    collector = RdmaCollector(config_of(tmp_path))
    asyncio.run(collector.collect())
    held = len(open_files(tmp_path))
    write(port / "hw_counters" / "rx_new_counter", "7")  # a file the last listing did not see
    for _ in range(3):
        raw = asyncio.run(collector.collect())
    assert value(raw, "rdma_port_hw_counter", counter="rx_new_counter") == 7
    assert len(open_files(tmp_path)) == held + 1  # each listing closed the previous one's descriptors
    asyncio.run(collector.close())


def test_past_the_descriptor_budget_files_are_opened_on_every_read(tmp_path, monkeypatch):
    import kvscope.exporters.rdma as module

    port = roce_host(tmp_path) / "ports" / "1"
    expected, _ = scrape(tmp_path)
    monkeypatch.setattr(module, "FD_SHARE", 0.0)
    collector = RdmaCollector(config_of(tmp_path))
    assert asyncio.run(collector.collect()) == expected
    assert open_files(tmp_path) == []
    write(port / "counters" / "port_rcv_data", "5")
    raw = asyncio.run(collector.collect())
    assert value(raw, "rdma_port_data_words", direction="rx") == 5
    asyncio.run(collector.close())


# --- roles and host ---------------------------------------------------------------------------------------------


def test_roles_by_device_by_port_and_by_netdev(tmp_path):
    nof = rdma_device(tmp_path, "mlx5_0")
    netdev(nof, "ens1f0np0", dev_port=0)
    netdev(nof, "ens1f1np1", dev_port=1)
    for port in ("1", "2"):
        rdma_port(nof, port, counters={"port_xmit_data": 1, "port_rcv_data": 1})
    other = rdma_device(tmp_path, "mlx5_2", pci="0000:af:00.0")
    netdev(other, "ens2f0np0", dev_port=0)
    rdma_port(other, counters={"port_xmit_data": 1, "port_rcv_data": 1})
    gpu = rdma_device(tmp_path, "mlx5_3", pci="0000:d8:00.0")
    rdma_port(gpu, counters={"port_xmit_data": 1, "port_rcv_data": 1})
    roles = {"mlx5_0": "nof", "mlx5_0/2": "dram", "ens1f1np1": "gpu", "ens2f0np0": "dram", "mlx5_2": "nof"}
    raw, normalized = scrape(tmp_path, roles=roles, labels={"role": "unassigned"})
    by_port = {(s.label_map["device"], s.label_map["port"]): s.label_map["role"] for s in ports_of(normalized)}
    assert by_port == {
        ("mlx5_0", "1"): "nof",  # by device
        ("mlx5_0", "2"): "dram",  # device/port beats its netdev (gpu) and its device (nof)
        ("mlx5_2", "1"): "dram",  # netdev beats device
        ("mlx5_3", "1"): "unassigned",  # the target's role label
    }
    assert find(raw, "rdma_device_info", device="mlx5_0")[0].label_map["role"] == "nof"


def test_host_label_defaults(tmp_path):
    roce_host(tmp_path)
    config = parse_config({"targets": [{"name": "r", "source": "rdma", "sysfs": str(tmp_path)}]}).targets[0]
    raw = asyncio.run(collect_once(RdmaCollector(config)))
    assert {s.label_map["host"] for s in raw} == {socket.gethostname()}
    config = parse_config(
        {"targets": [{"name": "r", "source": "rdma", "sysfs": str(tmp_path), "labels": {"host": "gpu-07"}}]}
    ).targets[0]
    raw = asyncio.run(collect_once(RdmaCollector(config)))
    normalized = mapping_for("rdma").apply(raw, config.labels)
    assert {s.label_map["host"] for s in raw + normalized} == {"gpu-07"}


# --- rdma -j statistic show -----------------------------------------------------------------------------------------

# Hand-written, not a capture: the shape iproute2 6.1.0's source prints (PROVENANCE.md, "rdma-tool/").
STATISTIC_JSON = """[{"ifname":"mlx5_0","port":1,"out_of_buffer":17,"np_cnp_sent":4242,"rdma_tx_bytes":777000,\
"rdma_rx_bytes":888000,"cc_rx_ce_pkts":12},{"ifname":"mlx5_7","port":1,"rdma_tx_bytes":1}]
"""


def fake_rdma(tmp_path: Path, body: str, exit_code: int = 0) -> str:
    script = tmp_path / "bin" / "rdma"
    script.parent.mkdir()
    script.write_text(
        "#!/bin/sh\n"
        '[ "$*" = "-j statistic show" ] || { echo "unexpected arguments: $*" >&2; exit 2; }\n'
        f"cat <<'EOF'\n{body}\nEOF\nexit {exit_code}\n"
    )
    script.chmod(0o755)
    return str(script)


def test_rdma_tool_adds_the_counters_sysfs_does_not_have(tmp_path):
    roce_host(tmp_path / "sys")
    raw, _ = scrape(tmp_path / "sys", rdma_tool=True, rdma_tool_path=fake_rdma(tmp_path, STATISTIC_JSON))
    stats = {s.label_map["counter"]: s.value for s in find(raw, "rdma_port_stat")}
    # out_of_buffer and np_cnp_sent are already rdma_port_hw_counter; mlx5_7 is not in the tree.
    assert stats == {"rdma_tx_bytes": 777000, "rdma_rx_bytes": 888000, "cc_rx_ce_pkts": 12}
    assert find(raw, "rdma_port_stat")[0].label_map["netdev"] == "ens1f0np0"
    assert value(raw, "rdma_stat_tool_up") == 1


@pytest.mark.parametrize(
    "tool",
    [
        pytest.param(lambda tmp_path: str(tmp_path / "absent" / "rdma"), id="absent"),
        pytest.param(lambda tmp_path: fake_rdma(tmp_path, "Failed to open NETLINK_RDMA socket", 1), id="fails"),
        pytest.param(lambda tmp_path: fake_rdma(tmp_path, "link mlx5_0/1 out_of_buffer 17"), id="not-json"),
    ],
)
def test_rdma_tool_unavailable_is_skipped_cleanly(tmp_path, tool):
    roce_host(tmp_path / "sys")
    raw, normalized = scrape(tmp_path / "sys", rdma_tool=True, rdma_tool_path=tool(tmp_path))
    assert value(raw, "rdma_stat_tool_up") == 0 and find(raw, "rdma_port_stat") == []
    assert len(bytes_by_port(normalized)) == 2


def test_rdma_tool_that_hangs_is_killed_and_skipped(tmp_path):
    roce_host(tmp_path / "sys")
    script = tmp_path / "rdma"
    pid_file = tmp_path / "tool.pid"
    script.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec sleep 30\n")
    script.chmod(0o755)
    started = time.monotonic()
    raw, normalized = scrape(tmp_path / "sys", rdma_tool=True, rdma_tool_path=str(script), timeout_s=0.5)
    assert time.monotonic() - started < 10
    assert value(raw, "rdma_stat_tool_up") == 0 and len(bytes_by_port(normalized)) == 2
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):  # killed and reaped, not left running
        os.kill(pid, 0)


def test_rdma_tool_is_off_by_default(tmp_path):
    roce_host(tmp_path)
    raw, _ = scrape(tmp_path)
    assert find(raw, "rdma_stat_tool_up") == []


def test_statistic_json_forms():
    # Hand-written: iproute2's sources print one array (tests/fixtures/rdma/PROVENANCE.md, "rdma-tool/"); a single
    # object and one object per line are tolerated shapes no known iproute2 version prints.
    assert parse_statistic_json("") == []
    assert parse_statistic_json('{"ifname": "m", "port": 2, "a": 1, "flag": true, "s": "x"}') == [("m", "2", {"a": 1})]
    lines = '{"ifname": "m", "port": 1, "a": 1}\n{"ifname": "m", "port": 2, "a": 2}'
    assert parse_statistic_json(lines) == [("m", "1", {"a": 1}), ("m", "2", {"a": 2})]
    assert parse_statistic_json("garbage") is None
    pretty = '[ {\n    "ifname": "m",\n    "port": 1,\n    "a": 3\n} ]\n'  # `rdma -j -p`: one array over lines
    assert parse_statistic_json(pretty) == [("m", "1", {"a": 3})]


RDMA_TOOL = FIXTURE.parent / "rdma-tool"  # real captures of iproute2 6.1.0's rdma on a machine without devices


def replay_rdma(tmp_path: Path, capture: str) -> str:
    """An `rdma` that answers `-j statistic show` with a capture's stdout, stderr and exit code, byte for byte."""
    script = tmp_path / "bin" / "rdma"
    script.parent.mkdir()
    files = {part: RDMA_TOOL / f"{capture}.{part}" for part in ("stdout", "stderr")}
    script.write_text(
        "#!/bin/sh\n"
        '[ "$*" = "-j statistic show" ] || exit 2\n'
        f"cat '{files['stdout']}'\ncat '{files['stderr']}' >&2\n"
        f"exit {int((RDMA_TOOL / f'{capture}.rc').read_text())}\n"
    )
    script.chmod(0o755)
    return str(script)


def test_the_captured_answer_without_rdma_devices_parses_and_is_tool_down(tmp_path):
    assert parse_statistic_json((RDMA_TOOL / "statistic-show.stdout").read_text()) == []  # nothing on stdout
    assert (RDMA_TOOL / "statistic-show.stderr").read_text() == "Failed to open NETLINK_RDMA socket\n"
    roce_host(tmp_path / "sys")
    tool = replay_rdma(tmp_path, "statistic-show")
    raw, normalized = scrape(tmp_path / "sys", rdma_tool=True, rdma_tool_path=tool)
    assert value(raw, "rdma_stat_tool_up") == 0 and find(raw, "rdma_port_stat") == []
    assert len(bytes_by_port(normalized)) == 2  # the sysfs counters still export


@pytest.mark.skipif(shutil.which("rdma") is None, reason="iproute2's rdma is not installed")
@pytest.mark.skipif(os.path.exists("/sys/class/infiniband"), reason="this machine has RDMA devices")
def test_the_real_rdma_tool_on_a_machine_without_devices_is_tool_down(tmp_path):
    roce_host(tmp_path / "sys")
    raw, _ = scrape(tmp_path / "sys", rdma_tool=True, rdma_tool_path="rdma")
    assert value(raw, "rdma_stat_tool_up") == 0 and find(raw, "rdma_port_stat") == []


# --- pyverbs (optional) ---------------------------------------------------------------------------------------------


class FakePortAttr:
    active_mtu = 5  # IBV_MTU_4096
    max_mtu = 5
    gid_tbl_len = 256
    pkey_tbl_len = 1
    max_msg_sz = 1073741824


def fake_pyverbs(monkeypatch, opened: list) -> None:
    class Context:
        def __init__(self, name):
            if name != "mlx5_0":
                raise RuntimeError(f"no device {name}")
            opened.append(name)

        def query_port(self, port):
            return FakePortAttr()

        def close(self):
            opened.append("closed")

    package = types.ModuleType("pyverbs")
    device = types.ModuleType("pyverbs.device")
    device.Context = Context
    package.device = device
    monkeypatch.setitem(sys.modules, "pyverbs", package)
    monkeypatch.setitem(sys.modules, "pyverbs.device", device)


def test_pyverbs_port_attributes_when_present(tmp_path, monkeypatch):
    roce_host(tmp_path)
    rdma_port(rdma_device(tmp_path, "mlx5_1", pci="0000:3b:00.1"))
    opened: list = []
    fake_pyverbs(monkeypatch, opened)
    raw, _ = scrape(tmp_path, verbs=True)
    assert value(raw, "rdma_port_active_mtu_bytes", device="mlx5_0", port="1", netdev="ens1f0np0") == 4096
    assert value(raw, "rdma_port_max_mtu_bytes", device="mlx5_0") == 4096
    assert value(raw, "rdma_port_gid_table_size", device="mlx5_0") == 256
    assert value(raw, "rdma_port_pkey_table_size", device="mlx5_0") == 1
    assert value(raw, "rdma_port_max_message_bytes", device="mlx5_0") == 1073741824
    assert find(raw, "rdma_port_active_mtu_bytes", device="mlx5_1") == []  # pyverbs could not open it
    assert opened == ["mlx5_0", "closed"]
    # verbs: null (default) keeps pyverbs away from a tree that is not the live /sys.
    raw, _ = scrape(tmp_path)
    assert find(raw, "rdma_port_active_mtu_bytes") == []


def test_without_pyverbs_nothing_is_added(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyverbs", None)  # import pyverbs raises ImportError
    roce_host(tmp_path)
    raw, normalized = scrape(tmp_path, verbs=True)
    assert not [s for s in raw if s.name.endswith(("_mtu_bytes", "_table_size", "_message_bytes"))]
    assert len(bytes_by_port(normalized)) == 2


# --- files that cannot be read or do not hold a counter: read errors, the rest of the target exported -----------


def served_after(sysfs: Path, scrapes: int = 1, between=None, **fields) -> str:
    """The Prometheus exposition after `scrapes` scrapes of one rdma target of `sysfs` (`between()` runs before
    each scrape after the first)."""
    target = {"name": "rdma-a", "source": "rdma", "sysfs": str(sysfs), "host": "node-a", **fields}
    config = parse_config({"exporter": {"listen_port": 0}, "targets": [target]})
    scraper = Scraper(config.targets)

    async def run() -> None:
        for index in range(scrapes):
            if index and between is not None:
                between()
            await scraper.scrape_all()
        await scraper.close()

    asyncio.run(run())
    bridge = TelemetryBridge(scraper, config.exporter)
    try:
        return httpx.get(f"http://127.0.0.1:{bridge.serve()}/metrics").text
    finally:
        bridge.shutdown()


def exposed(text: str, name: str) -> dict[frozenset, float]:
    """The samples of the series `name` in an exposition: their labels (as (name, value) pairs) -> value."""
    found = {}
    for line in text.splitlines():
        if line.startswith(f"{name}{{"):
            labels, _, number = line[len(name) + 1 :].rpartition("} ")
            found[frozenset(re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"', labels))] = float(number)
    return found


def read_errors(text: str) -> dict[str, float]:
    """kvscope_source_read_errors_total of the rdma-a target, by reason."""
    return {
        dict(labels)["reason"]: number
        for labels, number in exposed(text, "kvscope_source_read_errors_total").items()
        if dict(labels)["target"] == "rdma-a" and dict(labels)["source"] == "rdma"
    }


def port_errors(text: str) -> dict[str, float]:
    return {dict(labels)["error"]: number for labels, number in exposed(text, "rdma_port_errors_total").items()}


OTHER_ERRORS = {"out_of_buffer": 17, "rx_icrc_encapsulated": 0}  # roce_host's error counters besides symbol_error


def test_each_error_is_one_read_error_of_its_collector_naming_the_file(tmp_path):
    rdma_port(rdma_device(tmp_path, "mlx5_0"), counters={"symbol_error": "-1", "link_downed": "N/A"})
    port = tmp_path / "class" / "infiniband" / "mlx5_0" / "ports" / "1"  # the path as listed
    collector = RdmaCollector(config_of(tmp_path))
    asyncio.run(collect_once(collector))
    errors = sorted((e.reason, e.what) for e in collector.take_read_errors())
    assert errors == [
        ("out_of_range", str(port / "counters" / "symbol_error")),
        ("unparseable", str(port / "counters" / "link_downed")),
    ]


BAD_COUNTERS = {
    "N/A": (b"N/A\n", "unparseable"),
    "text": (b"fast\n", "unparseable"),
    "empty": (b"", "unparseable"),
    "not UTF-8": (b"\xff\xfe12\n", "unparseable"),
    "negative": (b"-1\n", "out_of_range"),
    "4301 digits": (b"9" * 4301 + b"\n", "out_of_range"),
    "above 2^64-1": (b"18446744073709551616\n", "out_of_range"),
}


@pytest.mark.parametrize("case", BAD_COUNTERS)
def test_a_counter_file_that_holds_no_counter_is_a_read_error_and_the_rest_exports(tmp_path, case):
    data, reason = BAD_COUNTERS[case]
    port = roce_host(tmp_path) / "ports" / "1"
    write(port / "counters" / "link_downed", "3")
    (port / "counters" / "symbol_error").write_bytes(data)
    text = served_after(tmp_path)
    assert read_errors(text) == {reason: 1}
    assert port_errors(text) == {
        "link_downed": 3,
        "out_of_buffer": 17,
        "rx_icrc_encapsulated": 0,
    }  # symbol_error is absent
    assert exposed(text, "rdma_port_tx_bytes_total") and exposed(text, "rdma_port_congestion_total")


def test_n_a_no_pma_is_no_series_and_no_read_error(tmp_path):
    # What the kernel answers for a device without a performance-management agent (node_exporter's fixture
    # i40iw0 has it): normal, so not counted.
    port = roce_host(tmp_path) / "ports" / "1"
    write(port / "counters" / "symbol_error", "N/A (no PMA)")
    text = served_after(tmp_path)
    assert read_errors(text) == {} and "symbol_error" not in port_errors(text)


def test_a_fifo_is_never_read_and_is_a_read_error(tmp_path):
    port = roce_host(tmp_path) / "ports" / "1"
    (port / "counters" / "symbol_error").unlink()
    os.mkfifo(port / "counters" / "symbol_error")  # a read would block forever: no writer
    text = served_after(tmp_path, timeout_s=1.0)
    assert read_errors(text) == {"not_a_file": 1}
    assert port_errors(text) == {"out_of_buffer": 17, "rx_icrc_encapsulated": 0} and exposed(
        text, "rdma_port_tx_bytes_total"
    )


def test_a_dangling_counter_link_is_a_read_error(tmp_path):
    port = roce_host(tmp_path) / "ports" / "1"
    (port / "counters" / "symbol_error").unlink()
    (port / "counters" / "symbol_error").symlink_to("nowhere")
    text = served_after(tmp_path)
    assert read_errors(text) == {"unreadable": 1}
    assert port_errors(text) == {"out_of_buffer": 17, "rx_icrc_encapsulated": 0} and exposed(
        text, "rdma_port_tx_bytes_total"
    )


def test_a_counter_file_removed_between_scrapes_is_a_read_error(tmp_path, monkeypatch):
    port = roce_host(tmp_path) / "ports" / "1"
    sysfs_pread(monkeypatch)
    text = served_after(tmp_path, scrapes=2, between=(port / "counters" / "symbol_error").unlink)
    assert read_errors(text) == {"unreadable": 1}
    assert port_errors(text) == {"out_of_buffer": 17, "rx_icrc_encapsulated": 0} and exposed(
        text, "rdma_port_tx_bytes_total"
    )


def test_a_dangling_device_link_is_a_read_error_and_the_other_devices_export(tmp_path):
    roce_host(tmp_path)
    (tmp_path / "class" / "infiniband" / "mlx5_9").symlink_to("../../devices/pci0000:00/gone/infiniband/mlx5_9")
    text = served_after(tmp_path)
    assert read_errors(text) == {"unreadable": 1}
    assert {dict(labels)["device"] for labels in exposed(text, "rdma_port_tx_bytes_total")} == {"mlx5_0"}


def test_an_unreadable_port_directory_is_a_read_error_not_an_empty_port(tmp_path, monkeypatch):
    device = roce_host(tmp_path)
    rdma_port(device, "2", counters={"port_xmit_data": 1, "port_rcv_data": 2})
    unreadable = str(tmp_path / "class" / "infiniband" / "mlx5_0" / "ports" / "2")
    real = os.scandir

    def scandir(path="."):  # EACCES, as for a non-root exporter on a port directory of mode 0700
        if os.fspath(path).startswith(unreadable):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    raw, _ = scrape(tmp_path)
    assert {s.label_map["port"] for s in raw if "port" in s.label_map} == {"1"}  # no info series for port 2
    text = served_after(tmp_path)
    assert read_errors(text) == {"unreadable": 1}
    assert {dict(labels)["port"] for labels in exposed(text, "rdma_port_tx_bytes_total")} == {"1"}


# --- parity with node_exporter's infiniband collector, over the served exposition ------------------------------

# node_exporter's node_infiniband_<name> -> (the kvscope series serving it, the labels that pick it), as README.md's
# "RDMA series" table says; the labels device and port (and info's) are compared as they are.
_TX, _RX = {"direction": "tx"}, {"direction": "rx"}
NODE_EXPORTER_SERIES: dict[str, tuple[str, dict[str, str]]] = {
    "info": ("rdma_device_info", {}),
    "state_id": ("rdma_port_state", {}),
    "physical_state_id": ("rdma_port_physical_state", {}),
    "rate_bytes_per_second": ("rdma_port_rate_bytes_per_second", {}),
    "port_data_transmitted_bytes_total": ("rdma_port_data_bytes_total", _TX),
    "port_data_received_bytes_total": ("rdma_port_data_bytes_total", _RX),
    "port_packets_transmitted_total": ("rdma_port_packets_total", _TX),
    "port_packets_received_total": ("rdma_port_packets_total", _RX),
    "unicast_packets_transmitted_total": ("rdma_port_unicast_packets_total", _TX),
    "unicast_packets_received_total": ("rdma_port_unicast_packets_total", _RX),
    "multicast_packets_transmitted_total": ("rdma_port_multicast_packets_total", _TX),
    "multicast_packets_received_total": ("rdma_port_multicast_packets_total", _RX),
    "legacy_data_transmitted_bytes_total": ("rdma_port_legacy_data_bytes_total", _TX),
    "legacy_data_received_bytes_total": ("rdma_port_legacy_data_bytes_total", _RX),
    "legacy_packets_transmitted_total": ("rdma_port_legacy_packets_total", _TX),
    "legacy_packets_received_total": ("rdma_port_legacy_packets_total", _RX),
    "legacy_unicast_packets_transmitted_total": ("rdma_port_legacy_unicast_packets_total", _TX),
    "legacy_unicast_packets_received_total": ("rdma_port_legacy_unicast_packets_total", _RX),
    "legacy_multicast_packets_transmitted_total": ("rdma_port_legacy_multicast_packets_total", _TX),
    "legacy_multicast_packets_received_total": ("rdma_port_legacy_multicast_packets_total", _RX),
    "port_transmit_wait_total": ("rdma_port_transmit_wait_total", {}),
    **{
        f"{name}_total": ("rdma_port_errors_total", {"error": error})
        for name, error in (
            ("symbol_error", "symbol_error"),
            ("link_downed", "link_downed"),
            ("link_error_recovery", "link_error_recovery"),
            ("port_errors_received", "port_rcv_errors"),
            ("port_receive_remote_physical_errors", "port_rcv_remote_physical_errors"),
            ("port_receive_switch_relay_errors", "port_rcv_switch_relay_errors"),
            ("port_discards_transmitted", "port_xmit_discards"),
            ("port_discards_received", "port_rcv_discards"),
            ("port_constraint_errors_transmitted", "port_xmit_constraint_errors"),
            ("port_constraint_errors_received", "port_rcv_constraint_errors"),
            ("local_link_integrity_errors", "local_link_integrity_errors"),
            ("excessive_buffer_overrun_errors", "excessive_buffer_overrun_errors"),
            ("vl15_dropped", "VL15_dropped"),
            ("out_of_buffer_drops", "out_of_buffer"),
            ("out_of_sequence_packets_received", "out_of_sequence"),
            ("packet_sequence_errors", "packet_seq_err"),
            ("local_ack_timeout_errors", "local_ack_timeout_err"),
            ("rnr_nak_retry_packets_received", "rnr_nak_retry_err"),
            ("rx_icrc_encapsulated_errors", "rx_icrc_encapsulated"),
        )
    },
    **{
        f"{name}_total": ("rdma_port_completion_errors_total", {"error": error})
        for name, error in (
            ("req_cqes_errors", "req_cqe_error"),
            ("req_cqes_flush_errors", "req_cqe_flush_error"),
            ("req_remote_access_errors", "req_remote_access_errors"),
            ("req_remote_invalid_request_errors", "req_remote_invalid_request"),
            ("resp_cqes_errors", "resp_cqe_error"),
            ("resp_cqes_flush_errors", "resp_cqe_flush_error"),
            ("resp_local_length_errors", "resp_local_length_error"),
            ("resp_remote_access_errors", "resp_remote_access_errors"),
        )
    },
    **{
        f"{name}_total": ("rdma_port_transport_events_total", {"event": event})
        for name, event in (
            ("duplicate_requests_packets", "duplicate_request"),
            ("implied_nak_seq_errors", "implied_nak_seq_err"),
            ("roce_adp_retransmits", "roce_adp_retrans"),
            ("roce_adp_retransmits_timeout", "roce_adp_retrans_to"),
            ("roce_slow_restart_used", "roce_slow_restart"),
            ("roce_slow_restart_cnps", "roce_slow_restart_cnps"),
            ("roce_slow_restart", "roce_slow_restart_trans"),
        )
    },
    "np_cnp_packets_sent_total": ("rdma_port_congestion_total", {"event": "cnp_sent"}),
    "np_ecn_marked_roce_packets_received_total": ("rdma_port_congestion_total", {"event": "ecn_marked"}),
    "rp_cnp_packets_handled_total": ("rdma_port_congestion_total", {"event": "cnp_handled"}),
    "rp_cnp_ignored_packets_received_total": ("rdma_port_congestion_total", {"event": "cnp_ignored"}),
    "rx_read_requests_total": ("rdma_port_received_requests_total", {"op": "read"}),
    "rx_write_requests_total": ("rdma_port_received_requests_total", {"op": "write"}),
    "rx_atomic_requests_total": ("rdma_port_received_requests_total", {"op": "atomic"}),
    "rx_dct_connect_requests_total": ("rdma_port_received_requests_total", {"op": "dct_connect"}),
    "lifespan_seconds": ("rdma_port_counters_lifespan_seconds", {}),
}
# node_exporter's hw counter series (its fixture has no hw_counters/, so its golden output has none): by file.
NODE_EXPORTER_HW = {
    "duplicate_requests_packets_total": "duplicate_request",
    "implied_nak_seq_errors_total": "implied_nak_seq_err",
    "local_ack_timeout_errors_total": "local_ack_timeout_err",
    "out_of_buffer_drops_total": "out_of_buffer",
    "out_of_sequence_packets_received_total": "out_of_sequence",
    "packet_sequence_errors_total": "packet_seq_err",
    "req_cqes_errors_total": "req_cqe_error",
    "req_cqes_flush_errors_total": "req_cqe_flush_error",
    "req_remote_access_errors_total": "req_remote_access_errors",
    "req_remote_invalid_request_errors_total": "req_remote_invalid_request",
    "resp_cqes_errors_total": "resp_cqe_error",
    "resp_cqes_flush_errors_total": "resp_cqe_flush_error",
    "resp_local_length_errors_total": "resp_local_length_error",
    "resp_remote_access_errors_total": "resp_remote_access_errors",
    "rnr_nak_retry_packets_received_total": "rnr_nak_retry_err",
    "roce_adp_retransmits_total": "roce_adp_retrans",
    "roce_adp_retransmits_timeout_total": "roce_adp_retrans_to",
    "roce_slow_restart_used_total": "roce_slow_restart",
    "roce_slow_restart_cnps_total": "roce_slow_restart_cnps",
    "roce_slow_restart_total": "roce_slow_restart_trans",
    "rx_atomic_requests_total": "rx_atomic_requests",
    "rx_dct_connect_requests_total": "rx_dct_connect",
    "rx_read_requests_total": "rx_read_requests",
    "rx_write_requests_total": "rx_write_requests",
}


def node_exporter_golden() -> dict[tuple[str, frozenset], float]:
    """node_exporter's golden infiniband samples: (name without node_infiniband_, labels) -> value."""
    golden = {}
    for line in (NODE_EXPORTER_FIXTURE / "e2e-output-infiniband.txt").read_text().splitlines():
        if line.startswith("node_infiniband_"):
            name, _, rest = line.removeprefix("node_infiniband_").partition("{")
            labels, _, number = rest.rpartition("} ")
            golden[(name, frozenset(re.findall(r'(\w+)="([^"]*)"', labels)))] = float(number)
    return golden


def served_as_node_exporter(text: str) -> dict[tuple[str, frozenset], float]:
    """The served exposition read back through NODE_EXPORTER_SERIES: what node_exporter would call each series."""
    found = {}
    for name, (series, picked) in NODE_EXPORTER_SERIES.items():
        for labels, number in exposed(text, series).items():
            label_map = dict(labels)
            if all(label_map.get(key) == wanted for key, wanted in picked.items()):
                kept = ("device", "port") if name != "info" else ("device", "board_id", "firmware_version", "hca_type")
                found[(name, frozenset((key, label_map[key]) for key in kept))] = number
    return found


def test_the_served_exposition_has_every_series_node_exporter_serves_for_its_own_fixture(check_metrics):
    golden = node_exporter_golden()
    assert len(golden) == 51 and {name for name, _ in golden} <= set(NODE_EXPORTER_SERIES)
    text = served_after(NODE_EXPORTER_FIXTURE / "sysfs")
    assert served_as_node_exporter(text) == golden  # no series missing, none more, every value node_exporter's
    check_metrics(text)


def test_the_served_hw_counters_are_node_exporters_with_their_sysfs_values():
    # node_exporter's golden output has no hw counters: held against the mlx5_0 files of the procfs capture instead.
    text = served_after(FIXTURE)
    served = served_as_node_exporter(text)
    hw = FIXTURE / "class" / "infiniband" / "mlx5_0" / "ports" / "1" / "hw_counters"
    port = frozenset({("device", "mlx5_0"), ("port", "1")})
    for name, file in NODE_EXPORTER_HW.items():
        assert served[(name, port)] == int((hw / file).read_text()), name
    assert served[("lifespan_seconds", port)] == int((hw / "lifespan").read_text()) / 1000  # ms; not truncated
    assert {name for name, labels in served if labels == port} >= set(NODE_EXPORTER_HW)


# --- the golden exposition ------------------------------------------------------------------------------------

# The RDMA part of /metrics for the procfs capture, sorted. Regenerate after a deliberate change with
# `KVSCOPE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q tests/exporters/test_rdma.py -k golden` (README.md) and
# review the diff.
GOLDEN = FIXTURE.parent / "rdma-e2e-output.txt"


def rdma_exposition(text: str) -> list[str]:
    """The lines of an exposition about the rdma_* series (samples, HELP and TYPE), sorted."""
    return sorted(line for line in text.splitlines() if re.match(r"(# (HELP|TYPE) )?rdma_", line))


def test_golden_exposition_of_the_fixture_tree():
    text = served_after(FIXTURE, roles={"mlx5_0": "nof", "mlx4_0/2": "dram"})
    lines = rdma_exposition(text)
    if os.environ.get("KVSCOPE_UPDATE_GOLDEN"):
        GOLDEN.write_text("".join(f"{line}\n" for line in lines))
    golden = GOLDEN.read_text().splitlines()
    missing, extra = sorted(set(golden) - set(lines)), sorted(set(lines) - set(golden))
    assert (missing, extra) == ([], []), "served differs from rdma-e2e-output.txt (missing, extra)"
    assert lines == golden
    assert 'host="node-a"' in text and socket.gethostname() not in {
        label for line in lines for label in re.findall(r'host="([^"]*)"', line)
    }
