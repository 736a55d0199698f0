"""RDMA NICs (InfiniBand, RoCE, OPA, iWARP) from sysfs, optionally `rdma -j statistic show` and pyverbs.

One target reads every RDMA device of one host under `<sysfs>/class/infiniband/<device>/` (or the `devices:`
listed), each port under `ports/<port>/`. The tree walk runs in a worker thread; it only reads files. Only a
missing `class/infiniband` directory, or a listed device that is not there, fails the scrape (CollectError naming
the target and the path). Anything else that cannot be read is one read error (exporters/base.py: counted in
`kvscope_source_read_errors_total{target, source, reason}`, logged when it starts and ends, the path as `what`),
its series left out and the rest of the target exported:
- unreadable: a listed file (counter, hw counter, state, rate, link_layer, device info) whose open or read fails
  (EACCES, EIO from a hw counter, ENOENT: a dangling link, a file removed since the tree was listed); a device
  entry that cannot be listed (a dangling class/infiniband link); a port or counter directory that cannot be
  listed (the port is then left out whole, not exported as an empty info series).
- not_a_file: an entry that is not a regular file (a FIFO, a device): opened with O_NONBLOCK and fstat'ed, never
  read (its read could block the worker for good).
- unparseable: a counter holding text, `N/A`, nothing or bytes that are not UTF-8; a state or rate that is not
  "N: NAME" or "N Gb/sec".
- out_of_range: a counter that is negative, above 2^64-1 or longer than 20 digits (counted before int() is asked,
  so 4,301 digits never reach it).
Normal on real hardware, so neither a series nor an error (as node_exporter, through procfs, leaves them out
without failing): a counter reading exactly `N/A (no PMA)` (a device without a performance-management agent,
e.g. iWARP's i40iw in node_exporter's fixture); an optional attribute or directory that does not exist
(counters_ext/, hw_counters/, board_id on hfi1, ...); a GID entry answering EINVAL (no netdev behind it: only
the netdev lookup reads them); a device or port removed whole between scrapes (the tree is listed again). Where
node_exporter fails its whole infiniband collector (an unparseable state, a failed read), kvscope counts the one
file and keeps the rest.

Modules: this one (the collector: what to list and read, the layout and labels, the samples); rdma_files.py
(the transport: descriptors kept open and re-read with pread, directory listings); rdma_text.py (pure parsers:
an attribute's bytes or the tool's stdout to values, tested from captures alone); rdma_tool.py (`rdma -j
statistic show`); rdma_verbs.py (pyverbs). Only this module defines the source's Collector.

Files are kept open between scrapes. The tree is listed once: its attribute files opened and every sample's labels
built. Each scrape then re-reads every file with pread at offset 0 (sysfs regenerates an attribute's text on such a
read, so values are always current): one syscall per file instead of three. Each scrape still lists
`class/infiniband` and looks up each port's netdev, and the tree is listed again (the old descriptors closed)
when a device comes or goes, or comes back under the same name (a new directory entry); when a file that was read
before answers ENODEV or ENOENT (what sysfs answers on a descriptor once its device is unregistered); when a port's
netdev changed; and at least every RESCAN_S seconds (a file that could not be opened, a tree that is not sysfs,
whose removed files stay readable through an open descriptor). A collector holds at most FD_SHARE of the soft
RLIMIT_NOFILE and opens any further file on every read; close() closes them all.

Raw naming scheme: one name per sysfs group, the file name in the `counter` label, the value exactly as sysfs
prints it (port data counters stay in 4-octet words; the mapping multiplies by 4).

Counters (kind "counter"), each with the port labels (below) and `counter` = the file name:
- rdma_port_counter: ports/P/counters/* (PMA PortCounters / PortCountersExtended)
- rdma_port_counter_ext: ports/P/counters_ext/* (legacy MLNX_OFED: port_xmit_data_64, ...)
- rdma_port_hw_counter: ports/P/hw_counters/* (driver counters: mlx5 q-counters, congestion counters, ...)
- rdma_device_hw_counter: <device>/hw_counters/* (device-level driver counters; device labels)
- rdma_port_stat: `rdma -j statistic show` counters that the port's hw_counters/ does not have (optional
  counters such as mlx5's rdma_tx_bytes, cc_rx_ce_pkts)
- rdma_port_data_words{direction=tx|rx, file}: the port's data counter in 4-octet words, the one file chosen
  per port and direction (see "Which file counts bytes"); what the mapping reads (no `counter` label)
Gauges, with the port labels:
- rdma_port_counter_saturated{counter}: 1 when a fixed-width PMA counter reads 2^bits-1 (stuck), else 0
- rdma_port_rate_gbps: ports/P/rate, "100 Gb/sec (4X EDR)" -> 100
- rdma_port_state, rdma_port_phys_state: "4: ACTIVE" -> 4, "5: LinkUp" -> 5
- rdma_port_hw_counters_lifespan_ms (rdma_device_hw_counters_lifespan_ms): hw_counters/lifespan, how long the
  kernel caches hw counter values (a setting, not a counter)
- rdma_stat_tool_up (host label only): with `rdma_tool: true`, 1 when the tool answered with JSON, else 0
- from pyverbs (optional): rdma_port_active_mtu_bytes, rdma_port_max_mtu_bytes, rdma_port_gid_table_size,
  rdma_port_pkey_table_size, rdma_port_max_message_bytes
Info samples (kind "info", value 1):
- rdma_port_info{state, phys_state, link_layer, rate}: the names and text, with the port labels
- rdma_device_info{fw_ver, hca_type, board_id, node_type, node_guid (those present)}: with the device labels

Device labels: host, device, role. Port labels: host, device, port, netdev, role. Every label is always present
("" when unknown), so a series keeps one identity.

- host: the config's `host`, else the target's `host` label, else socket.gethostname().
- netdev: for a port whose link layer is not InfiniBand (RoCE), the netdev of its lowest readable GID entry
  (`ports/P/gid_attrs/ndevs/<index>`, index 0 is the default GID of the port's own netdev or bond); else the
  netdevs of the PCI function (`<device>/device/net/<ifname>`) whose `dev_port` (older kernels: `dev_id`) is
  P - 1, or the only netdev when there is one and it does not say its port; among several matches the shortest
  name (ib0 before its child ib0.8001). "" when none (OPA, a port without IPoIB).
- role: which tier's traffic the NIC carries, from `roles`, most specific key first: "<device>/<port>", then the
  port's netdev, then "<device>"; else the target's `role` label; else "". Device-level samples use "<device>".

Which file counts bytes (rdma_port_data_words). `port_xmit_data` / `port_rcv_data` count octets divided by 4.
On current kernels `counters/port_xmit_data` is the 64-bit PortCountersExtended value whenever the HCA reports
extended width (else the 32-bit PortCounters one, which saturates at 2^32-1 words = 16 GiB); legacy MLNX_OFED
drivers instead add `counters_ext/port_xmit_data_64`. Per port, the collector picks
`counters_ext/port_{xmit,rcv}_data_64` when it is readable, else `counters/port_{xmit,rcv}_data`, and emits that
value once more as rdma_port_data_words{direction, file=<the file it read>}, which is what the mapping reads.
The choice has to be per port: the normalizer's `match` precedence is per scrape, so `match:
[rdma_port_counter_ext, rdma_port_counter]` would drop every port without counters_ext as soon as one port of the
host has it, and two rules would count ports that have both twice.
Caveat, not corrected: hfi1 (Omni-Path) fills these attributes from its flit counters (C_DC_XMIT_FLITS /
C_DC_RCV_FLITS, 8-byte flits) without converting to 4-octet words, so on hfi1 ports x4 likely reads half the
bytes. The model's x4 is applied to every driver.

Wrap and saturation (the exporter never unwraps; it exports what sysfs says):
- PMA PortCounters saturate: they stop at 2^bits-1 and stay there until cleared (IBA). Widths: 4 bits
  (local_link_integrity_errors, excessive_buffer_overrun_errors), 8 (link_error_recovery, link_downed,
  port_xmit_constraint_errors, port_rcv_constraint_errors), 16 (symbol_error, port_rcv_errors,
  port_rcv_remote_physical_errors, port_rcv_switch_relay_errors, port_xmit_discards, VL15_dropped), 32
  (port_xmit_wait, and the data and packet counters on an HCA without extended width). A saturated counter no
  longer counts, which increase() cannot see, so rdma_port_counter_saturated says it: 1 when the value is
  2^bits-1. For data/packet counters that are 64-bit on most HCAs, a value of exactly 2^32-1 is flagged too (a
  64-bit counter sitting on that value is a one-scrape false positive; a 32-bit one stuck there is the case to see).
- PortCountersExtended (64-bit: data, packets, unicast_*, multicast_*) and counters_ext/*_64 do not wrap in practice.
- hw_counters are u64 in the kernel but some are read from 32-bit hardware fields and wrap at 2^32 (mlx5
  q-counters: out_of_buffer, out_of_sequence, duplicate_request, rnr_nak_retry_err, packet_seq_err,
  implied_nak_seq_err, local_ack_timeout_err, rx_*_requests, ...); mlx5 congestion counters (np_cnp_sent,
  np_ecn_marked_roce_packets, rp_cnp_handled, rp_cnp_ignored) are 64-bit. A wrap reads as a counter reset: the
  scrape loop reports it and increase() loses what was counted between the last scrape and the wrap. Scrape more
  often than the fastest such counter can wrap.
- Values go through float: exact up to 2^53 (32 PiB of words).

`rdma -j statistic show` (`rdma_tool: true`, off by default): the netlink view of the same hw counters plus the
optional counters sysfs never shows (enabled with `rdma statistic set link DEV/PORT optional-counters ...`). It
reports the running kernel whatever `sysfs` says; only ports found in the sysfs tree get its counters, and
counters the port's hw_counters/ already gave are not repeated. A missing binary, a non-zero exit (no
NETLINK_RDMA, an old kernel), output that is not JSON or no answer within `timeout_s` skips it
(rdma_stat_tool_up 0); the scrape goes on.

pyverbs (optional, never a hard dependency): when importable and `verbs` allows it, each port is queried with
`pyverbs.device.Context(name=device).query_port(port)`. `verbs: null` (default) uses it only when `sysfs` is
the live /sys (otherwise the tree and the devices pyverbs opens could be different machines); `true` uses it
whenever importable (an exporter in a container with the host's /sys mounted elsewhere); `false` never.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field

from kvscope.exporters import rdma_text, rdma_tool, rdma_verbs
from kvscope.exporters.base import CollectError, Collector, ReadErrorReason, TargetConfig
from kvscope.exporters.rdma_files import Attr as _Attr
from kvscope.exporters.rdma_files import Files as _Files
from kvscope.exporters.rdma_files import Stale as _Stale
from kvscope.exporters.rdma_files import by_index as _by_index
from kvscope.exporters.rdma_files import list_files as _files
from kvscope.exporters.rdma_files import read_text as _read
from kvscope.exporters.rdma_files import subdirs as _subdirs
from kvscope.exporters.rdma_files import unlistable as _unlistable
from kvscope.exporters.rdma_text import BadValue
from kvscope.samples import Kind, Labels, Sample, labels_of

log = logging.getLogger(__name__)

SOURCE = "rdma"

# Widths of the PMA PortCounters attributes as the kernel reads them (drivers/infiniband/core/sysfs.c).
PMA_WIDTH_BITS: dict[str, int] = {
    "symbol_error": 16,
    "link_error_recovery": 8,
    "link_downed": 8,
    "port_rcv_errors": 16,
    "port_rcv_remote_physical_errors": 16,
    "port_rcv_switch_relay_errors": 16,
    "port_xmit_discards": 16,
    "port_xmit_constraint_errors": 8,
    "port_rcv_constraint_errors": 8,
    "local_link_integrity_errors": 4,
    "excessive_buffer_overrun_errors": 4,
    "VL15_dropped": 16,
    "port_xmit_wait": 32,
    "port_xmit_data": 32,
    "port_rcv_data": 32,
    "port_xmit_packets": 32,
    "port_rcv_packets": 32,
}

# Per direction: the files that count the port's data in 4-octet words, preferred first.
DATA_FILES: dict[str, tuple[tuple[str, str], ...]] = {
    "tx": (("counters_ext", "port_xmit_data_64"), ("counters", "port_xmit_data")),
    "rx": (("counters_ext", "port_rcv_data_64"), ("counters", "port_rcv_data")),
}

_COUNTER_GROUPS = (("counters", "rdma_port_counter"), ("counters_ext", "rdma_port_counter_ext"))
_DEVICE_INFO_FILES = ("fw_ver", "hca_type", "board_id", "node_type", "node_guid")
_DECIMAL = re.compile(r"[0-9]+")


# The tree is listed again at least this often, even when no device came or went (see the module docstring).
RESCAN_S = 60.0
# The share of the soft descriptor limit one collector keeps open; past it, files are opened on every read.
FD_SHARE = 0.25
# DATA_FILES as "group/file", the form of rdma_port_data_words' `file` label.
_DATA_PATHS = {direction: tuple(f"{g}/{f}" for g, f in candidates) for direction, candidates in DATA_FILES.items()}
_DATA_FILE_SET = {path for paths in _DATA_PATHS.values() for path in paths}


class RdmaTargetConfig(TargetConfig):
    sysfs: Path = Field(Path("/sys"), description="sysfs root holding class/infiniband (e.g. /host/sys in a container)")
    host: str | None = Field(None, description="host label; default: the target's host label, else the hostname")
    roles: dict[str, str] = Field(
        default_factory=dict,
        description='role per NIC; keys "<device>/<port>", a netdev name or "<device>", most specific first; '
        "default: the target's role label",
    )
    devices: list[str] | None = Field(
        None, min_length=1, description="read these RDMA devices only (each must exist); default: every device"
    )
    hw_counters: bool = Field(
        True,
        description="read the drivers' hw_counters/ (congestion, retransmits, ...); false reads what node_exporter's "
        "infiniband collector reads: counters/, counters_ext/ and the port attributes",
    )
    rdma_tool: bool = Field(False, description="add `rdma -j statistic show` counters when the tool answers")
    rdma_tool_path: str = Field("rdma", description="the iproute2 rdma binary (a name looked up on PATH, or a path)")
    verbs: bool | None = Field(
        None, description="pyverbs port attributes: null = when importable and sysfs is /sys, true = when importable"
    )


@dataclass
class _Port:
    labels: dict[str, str]
    hw_counters: set[str] = field(default_factory=set)


@dataclass
class _Scan:
    samples: list[Sample] = field(default_factory=list)
    ports: dict[tuple[str, str], _Port] = field(default_factory=dict)

    errors: list[tuple[ReadErrorReason, str, str]] = field(default_factory=list)  # (reason, path, detail)

    def add(self, name: str, labels: dict[str, str], value: float, kind: Kind) -> None:
        self.samples.append(Sample(SOURCE, name, labels_of(labels), float(value), kind))

    def error(self, reason: ReadErrorReason, path: str, detail: str) -> None:
        self.errors.append((reason, path, detail))


@dataclass(slots=True)
class _Number:
    """A numeric attribute and the samples it gives, its labels built once. What the last read made of the file's
    bytes is kept: the same bytes (most counters of a port, scrape after scrape) give the same samples, the same
    objects, without parsing them again."""

    attr: _Attr
    name: str
    labels: Labels
    kind: Kind
    max_value: int | None = None  # a PMA counter of fixed width: the value at which it is stuck
    data: str | None = None  # "group/file" of a file that can count the port's data (DATA_FILES)
    hw_counter: str | None = None  # a hw counter's file name (`rdma -j statistic show` does not repeat it)
    last: bytes | None = None  # the bytes of the last read that gave a value
    value: int = 0  # that value
    samples: tuple[Sample, ...] = ()  # and its samples: the value's, and for a PMA counter its saturation flag

    def sample(self, scan: _Scan) -> int | None:
        """Read the file and add its samples to `scan`; returns the value (None: N/A or a read error of `scan`)."""
        data = self.attr.read(scan)
        if data is None or data != self.last:
            value = _number(self.attr, data, scan)
            if value is None:
                self.last = None
                return None
            samples = [Sample(SOURCE, self.name, self.labels, float(value), self.kind)]
            if self.max_value is not None:
                stuck = float(value == self.max_value)
                samples.append(Sample(SOURCE, "rdma_port_counter_saturated", self.labels, stuck, "gauge"))
            self.last, self.value, self.samples = data, value, tuple(samples)
        scan.samples.extend(self.samples)
        return self.value


@dataclass(slots=True)
class _PortFiles:
    """A port as listed: its files, open, and the labels of its samples."""

    device: str
    port: str
    labels: dict[str, str]
    labels_key: Labels
    link_layer: _Attr | None
    state: _Attr | None
    phys_state: _Attr | None
    rate: _Attr | None
    counters: list[_Number]  # counters/ then counters_ext/, by name
    data_words: list[list[tuple[str, Labels]]]  # per direction: ("group/file", the sample's labels), preferred first
    hw: list[_Number]
    ndevs: list[str]  # gid_attrs/ndevs/* by index, and the PCI function's net/: where the netdev is looked up
    net: str
    # What the last scrape made of the port (see _Number): its data words' samples by file, and the texts of its
    # link layer, state, physical state and rate with the samples they gave (None: they gave a read error)
    words: dict[str, Sample] = field(default_factory=dict)
    texts: tuple[str | None, ...] | None = None
    attributes: tuple[Sample, ...] = ()


@dataclass(slots=True)
class _DeviceFiles:
    """A device as listed: its files, open, its labels and its ports."""

    labels: dict[str, str]
    info: list[tuple[str, _Attr]]
    hw: list[_Number]
    ports: list[_PortFiles]
    texts: tuple[str | None, ...] | None = None  # the info files' texts last read, and the sample they gave
    info_samples: tuple[Sample, ...] = ()


@dataclass(slots=True)
class _Layout:
    """The tree as listed: what to read and every sample's labels, reused until the tree changes."""

    devices: dict[str, int]  # name -> inode of its class/infiniband entry
    found: list[_DeviceFiles]
    rescan_at: float  # time.monotonic() after which the tree is listed again anyway
    # What the listing could not read (a device or port directory, a counter directory): reported every scrape.
    broken: list[tuple[ReadErrorReason, str, str]] = field(default_factory=list)


class RdmaCollector(Collector):
    source = "rdma"
    Config = RdmaTargetConfig

    def __init__(self, config: RdmaTargetConfig) -> None:
        super().__init__(config)
        self.config: RdmaTargetConfig = config
        self._host = config.host or config.labels.get("host") or socket.gethostname()
        self._root = config.sysfs / "class" / "infiniband"
        self._live_sysfs = os.path.realpath(config.sysfs) == "/sys"
        self._files = _Files(FD_SHARE)
        self._layout: _Layout | None = None
        self._lock = threading.Lock()  # a scan that outlived its timeout may still be reading when the next starts
        weakref.finalize(self, self._files.close)  # a collector dropped without close() leaves no descriptor open

    async def collect(self) -> list[Sample]:
        scan = await self.blocking(self._scan, what=str(self._root))
        if self.config.rdma_tool:
            await self._add_tool_counters(scan)
        return scan.samples

    async def close(self) -> None:
        """Closes the attribute files on the target's thread (never under a scan still reading them: while one is
        stuck this fails, and the finalizer closes them once it has ended)."""
        await self.blocking(self._forget)

    # --- sysfs -------------------------------------------------------------------------------------------------

    def _scan(self) -> _Scan:
        with self._lock:
            devices = self._devices()
            layout = self._layout
            fresh = layout is None or layout.devices != devices or time.monotonic() >= layout.rescan_at
            if fresh:
                layout = self._discover(devices)
            try:
                scan = self._read(layout, fresh)
            except _Stale as stale:
                log.debug("%s: %s; listing the tree again", self.config.name, stale)
                scan = self._read(self._discover(devices), fresh=True)
                gone = stale.path
                # The file is gone but its directory is not: one attribute removed (not a device or port).
                if gone is not None and gone not in self._files.paths and os.path.isdir(os.path.dirname(gone)):
                    scan.error("unreadable", stale.path, f"{stale}: removed since the last scrape")
        if (context_class := self._verbs_context()) is not None:
            ports = ((device, port, record.labels) for (device, port), record in scan.ports.items())
            rdma_verbs.add_attributes(
                ports, lambda name, labels, value: scan.add(name, labels, value, "gauge"), context_class
            )
        for reason, path, detail in scan.errors:
            self.read_error(reason, path, detail)
        return scan

    def _forget(self) -> None:
        with self._lock:
            self._layout = None
            self._files.close()

    def _devices(self) -> dict[str, int]:
        """The devices to read, by name, with the inode of their class/infiniband entry: a device unregistered and
        registered again under the same name between two scrapes is a new entry."""
        root = self._root
        try:
            with os.scandir(root) as entries:
                present = {entry.name: entry.inode() for entry in entries}
        except OSError as error:
            reason = error.strerror or type(error).__name__
            raise CollectError(f"{self.config.name}: cannot list RDMA devices at {root}: {reason}") from None
        if self.config.devices is not None:
            missing = [device for device in self.config.devices if device not in present]
            if missing:
                raise CollectError(
                    f"{self.config.name}: RDMA device(s) {', '.join(missing)} not found under {root} "
                    f"(present: {', '.join(sorted(present)) or 'none'})"
                )
            present = {device: inode for device, inode in present.items() if device in self.config.devices}
        return dict(sorted(present.items()))

    def _discover(self, devices: dict[str, int]) -> _Layout:
        """Lists the tree and opens its files; the descriptors of the previous listing are closed first."""
        self._files.close()
        broken: list[tuple[ReadErrorReason, str, str]] = []
        found = []
        for device in devices:
            path = os.path.join(self._root, device)
            if (problem := _unlistable(path)) is not None:  # a dangling class/infiniband link, EACCES, ...
                broken.append(("unreadable", path, problem))
            else:
                found.append(self._discover_device(device, path, broken))
        self._layout = _Layout(devices, found, time.monotonic() + RESCAN_S, broken)
        return self._layout

    def _discover_device(self, device: str, path: str, broken: list) -> _DeviceFiles:
        labels = {"host": self._host, "device": device, "role": self._role(device, None, "")}
        info = []
        for name in _DEVICE_INFO_FILES:
            if (attr := self._files.open(os.path.join(path, name), listed=False)) is not None:
                info.append((name, attr))
        hw = self._discover_hw_counters(os.path.join(path, "hw_counters"), "rdma_device_hw_counter", labels, broken)
        ports = []
        for port in _subdirs(os.path.join(path, "ports"), broken):
            port_path = os.path.join(path, "ports", port)
            if (problem := _unlistable(port_path)) is not None:
                broken.append(("unreadable", port_path, problem))
            else:
                ports.append(self._discover_port(device, path, port, broken))
        return _DeviceFiles(labels, info, hw, ports)

    def _discover_port(self, device: str, device_path: str, port: str, broken: list) -> _PortFiles:
        path = os.path.join(device_path, "ports", port)
        ndevs = _by_index(os.path.join(path, "gid_attrs", "ndevs"))
        net = os.path.join(device_path, "device", "net")
        netdev = _netdev(ndevs, net, port, _read(os.path.join(path, "link_layer")) or "")
        labels = {"host": self._host, "device": device, "port": port, "netdev": netdev}
        labels["role"] = self._role(device, port, netdev)
        data_words = [
            [(data, labels_of({**labels, "direction": direction, "file": data})) for data in paths]
            for direction, paths in _DATA_PATHS.items()
        ]
        return _PortFiles(
            device=device,
            port=port,
            labels=labels,
            labels_key=labels_of(labels),
            link_layer=self._files.open(os.path.join(path, "link_layer"), listed=False),
            state=self._files.open(os.path.join(path, "state"), listed=False),
            phys_state=self._files.open(os.path.join(path, "phys_state"), listed=False),
            rate=self._files.open(os.path.join(path, "rate"), listed=False),
            counters=self._discover_counters(path, labels, broken),
            data_words=data_words,
            hw=self._discover_hw_counters(os.path.join(path, "hw_counters"), "rdma_port_hw_counter", labels, broken),
            ndevs=ndevs,
            net=net,
        )

    def _discover_counters(self, path: str, labels: dict[str, str], broken: list) -> list[_Number]:
        """counters/ and counters_ext/ of a port."""
        counters = []
        for group, name in _COUNTER_GROUPS:
            for file_name, file in _files(os.path.join(path, group), broken):
                if (attr := self._files.open(file)) is None:
                    continue
                bits = PMA_WIDTH_BITS.get(file_name) if group == "counters" else None
                data = f"{group}/{file_name}"
                counter = _Number(
                    attr,
                    name,
                    labels_of({**labels, "counter": file_name}),
                    "counter",
                    max_value=None if bits is None else (1 << bits) - 1,
                    data=data if data in _DATA_FILE_SET else None,
                )
                counters.append(counter)
        return counters

    def _discover_hw_counters(self, directory: str, name: str, labels: dict[str, str], broken: list) -> list[_Number]:
        """hw_counters/*: every counter as `name`, and `lifespan` (a setting in ms, not a counter) as
        `<name>s_lifespan_ms`; none when the config leaves them out."""
        if not self.config.hw_counters:
            return []
        numbers = []
        for file_name, file in _files(directory, broken):
            if (attr := self._files.open(file)) is None:
                continue
            if file_name == "lifespan":
                numbers.append(_Number(attr, f"{name}s_lifespan_ms", labels_of(labels), "gauge"))
            else:
                counter_labels = labels_of({**labels, "counter": file_name})
                numbers.append(_Number(attr, name, counter_labels, "counter", hw_counter=file_name))
        return numbers

    def _read(self, layout: _Layout, fresh: bool) -> _Scan:
        """One scrape: every file of the layout read now. A `fresh` layout (listed by this scrape) is never stale:
        each of its files is read for the first time, and a netdev that changed since the listing is not checked."""
        scan = _Scan(errors=list(layout.broken))
        for device in layout.found:
            texts = tuple(_text(attr, scan) for _, attr in device.info)
            if texts != device.texts:
                info = {name: text for (name, _), text in zip(device.info, texts, strict=True) if text}
                labels = labels_of({**device.labels, **info})
                device.info_samples = (Sample(SOURCE, "rdma_device_info", labels, 1.0, "info"),) if info else ()
                device.texts = texts
            scan.samples.extend(device.info_samples)
            _read_hw_counters(scan, device.hw)
            for port in device.ports:
                _read_port(scan, port, fresh)
        return scan

    def _role(self, device: str, port: str | None, netdev: str) -> str:
        roles = self.config.roles
        for key in (f"{device}/{port}" if port is not None else None, netdev, device):
            if key and key in roles:
                return roles[key]
        return self.config.labels.get("role", "")

    def _verbs_context(self) -> Callable[..., Any] | None:
        if self.config.verbs is False:
            return None
        if self.config.verbs is None and not self._live_sysfs:
            return None
        return rdma_verbs.context_class()

    # --- rdma -j statistic show ----------------------------------------------------------------------------------

    async def _add_tool_counters(self, scan: _Scan) -> None:
        entries = await self._run_tool()
        scan.add("rdma_stat_tool_up", {"host": self._host}, int(entries is not None), "gauge")
        for device, port, counters in entries or ():
            record = scan.ports.get((device, port))
            if record is None:  # filtered out, or a device the sysfs tree does not have
                continue
            for counter, value in counters.items():
                if counter not in record.hw_counters:
                    scan.add("rdma_port_stat", {**record.labels, "counter": counter}, value, "counter")

    async def _run_tool(self) -> list[tuple[str, str, dict[str, int]]] | None:
        return await rdma_tool.statistic_show(self.config.rdma_tool_path, self.config.timeout_s, self.config.name)


parse_statistic_json = rdma_text.statistic_json  # the import path tests and tools use


# --- sysfs helpers ---------------------------------------------------------------------------------------------


def _read_port(scan: _Scan, port: _PortFiles, fresh: bool) -> None:
    link_layer = _text(port.link_layer, scan) or ""
    netdev = _netdev(port.ndevs, port.net, port.port, link_layer)
    if netdev != port.labels["netdev"] and not fresh:
        raise _Stale(f"{port.device}/{port.port}: netdev {port.labels['netdev']!r} is now {netdev!r}")
    words = _read_counters(scan, port.counters)
    for candidates in port.data_words:
        for data, labels in candidates:
            if data in words:
                value, kept = float(words[data]), port.words.get(data)
                if kept is None or kept.value != value:
                    kept = port.words[data] = Sample(SOURCE, "rdma_port_data_words", labels, value, "counter")
                scan.samples.append(kept)
                break
    scan.ports[(port.device, port.port)] = _Port(port.labels, _read_hw_counters(scan, port.hw))
    texts = (link_layer, _text(port.state, scan), _text(port.phys_state, scan), _text(port.rate, scan))
    if texts != port.texts:
        errors = len(scan.errors)
        port.attributes = _attribute_samples(scan, port, *texts)
        port.texts = texts if len(scan.errors) == errors else None  # a text that is no state is reported again
    scan.samples.extend(port.attributes)


def _attribute_samples(
    scan: _Scan, port: _PortFiles, link_layer: str, state_text: str | None, phys_text: str | None, rate: str | None
) -> tuple[Sample, ...]:
    """The port's state, physical state, rate and info samples, from the texts of its attributes."""
    samples = []
    state, state_name = _state(port.state, state_text, scan)
    phys, phys_name = _state(port.phys_state, phys_text, scan)
    if state is not None:
        samples.append(Sample(SOURCE, "rdma_port_state", port.labels_key, float(state), "gauge"))
    if phys is not None:
        samples.append(Sample(SOURCE, "rdma_port_phys_state", port.labels_key, float(phys), "gauge"))
    if rate is not None and port.rate is not None:
        try:
            gbps = rdma_text.rate_gbps(rate)
        except BadValue as bad:
            scan.error(bad.reason, port.rate.path, bad.detail)
        else:
            samples.append(Sample(SOURCE, "rdma_port_rate_gbps", port.labels_key, gbps, "gauge"))
    info = {"state": state_name, "phys_state": phys_name, "link_layer": link_layer, "rate": rate or ""}
    samples.append(Sample(SOURCE, "rdma_port_info", labels_of({**port.labels, **info}), 1.0, "info"))
    return tuple(samples)


def _read_counters(scan: _Scan, counters: list[_Number]) -> dict[str, int]:
    """counters/ and counters_ext/, with the saturation flag of the PMA counters; returns the values of the files
    that can count the port's data."""
    words = {}
    for counter in counters:
        value = counter.sample(scan)
        if value is not None and counter.data is not None:
            words[counter.data] = value
    return words


def _read_hw_counters(scan: _Scan, numbers: list[_Number]) -> set[str]:
    """hw_counters/*; returns the names of the counters read."""
    seen = set()
    for number in numbers:
        if number.sample(scan) is not None and number.hw_counter is not None:
            seen.add(number.hw_counter)
    return seen


def _number(attr: _Attr, data: bytes | None, scan: _Scan) -> int | None:
    """A sysfs counter's bytes read from `attr` (unsigned decimal, at most 64 bits); None for "N/A (no PMA)" and,
    reported as a read error of `scan`, for a file that could not be read (`data` None, reported by the read) or
    does not hold such a number."""
    if data is None:
        return None
    try:
        return rdma_text.counter(data)
    except BadValue as bad:
        scan.error(bad.reason, attr.path, bad.detail)
        return None


def _text(attr: _Attr | None, scan: _Scan) -> str | None:
    """The attribute's text, stripped; None when it is absent, or (a read error of `scan`) cannot be read or is
    not text."""
    data = attr.read(scan) if attr is not None else None
    if attr is None or data is None:
        return None
    try:
        return rdma_text.text(data)
    except BadValue as bad:
        scan.error(bad.reason, attr.path, bad.detail)
        return None


def _state(attr: _Attr | None, value: str | None, scan: _Scan) -> tuple[int | None, str]:
    """A port state attribute's text: "4: ACTIVE" -> (4, "ACTIVE"); (None, "") when absent, (None, the text) when
    not a state (reported)."""
    if attr is None or value is None:
        return None, ""
    try:
        return rdma_text.state(value)
    except BadValue as bad:
        scan.error(bad.reason, attr.path, bad.detail)
        return None, value


def _netdev(ndevs: list[str], net: str, port: str, link_layer: str) -> str:
    """The port's netdev (the module docstring says how); "" when it has none. Looked up on every scrape: a
    netdev can be renamed, or a bond made, while the device stays."""
    if link_layer != "InfiniBand":
        for path in ndevs:
            if name := _read(path):
                return name
    return _pci_netdev(net, port) or ""


def _pci_netdev(net: str, port: str) -> str | None:
    try:
        names = sorted(os.listdir(net))
    except OSError:
        return None
    if not port.isdigit():
        return None
    wanted = int(port) - 1
    matches, unknown = [], []
    for name in names:
        index = _decimal(_read(os.path.join(net, name, "dev_port")))
        if index is None:
            dev_id = _read(os.path.join(net, name, "dev_id")) or ""
            index = int(dev_id, 16) if re.fullmatch(r"0x[0-9a-fA-F]+", dev_id) else None
        if index is None:
            unknown.append(name)
        elif index == wanted:
            matches.append(name)
    if not matches and len(names) == 1 and unknown:
        matches = unknown
    return min(matches, key=lambda name: (len(name), name)) if matches else None


def _decimal(text: str | None) -> int | None:
    if text is None or _DECIMAL.fullmatch(text) is None:
        return None
    return int(text)
