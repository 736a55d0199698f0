"""RDMA NICs (InfiniBand, RoCE, OPA, iWARP) from sysfs, optionally `rdma -j statistic show` and pyverbs.

One target reads every RDMA device of one host under `<sysfs>/class/infiniband/<device>/` (or the `devices:`
listed), each port under `ports/<port>/`. The tree walk runs in a worker thread (`asyncio.to_thread`); it only
reads files. A file that cannot be read or does not hold a number (`N/A (no PMA)` on a device without a
performance-management agent, EINVAL from a GID entry with no netdev, EIO from a hw counter) is skipped: only a
missing `class/infiniband` directory, or a listed device that is not there, fails the scrape (CollectError naming
the target and the path).

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

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field

from kvscope.exporters.base import CollectError, Collector, TargetConfig
from kvscope.samples import Kind, Sample, labels_of

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
_STATE = re.compile(r"^\s*(\d+)\s*:\s*(.*?)\s*$")
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*Gb/sec")
# ibv_mtu: IBV_MTU_256 = 1 ... IBV_MTU_4096 = 5.
_MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}


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

    def add(self, name: str, labels: dict[str, str], value: float, kind: Kind) -> None:
        self.samples.append(Sample(SOURCE, name, labels_of(labels), float(value), kind))


class RdmaCollector(Collector):
    source = "rdma"
    Config = RdmaTargetConfig

    def __init__(self, config: RdmaTargetConfig) -> None:
        super().__init__(config)
        self.config: RdmaTargetConfig = config
        self._host = config.host or config.labels.get("host") or socket.gethostname()

    async def collect(self) -> list[Sample]:
        scan = await asyncio.to_thread(self._scan)
        if self.config.rdma_tool:
            await self._add_tool_counters(scan)
        return scan.samples

    # --- sysfs -------------------------------------------------------------------------------------------------

    def _scan(self) -> _Scan:
        root = self.config.sysfs / "class" / "infiniband"
        try:
            present = sorted(entry.name for entry in root.iterdir())
        except OSError as error:
            reason = error.strerror or type(error).__name__
            raise CollectError(f"{self.config.name}: cannot list RDMA devices at {root}: {reason}") from None
        if self.config.devices is not None:
            missing = [device for device in self.config.devices if device not in present]
            if missing:
                raise CollectError(
                    f"{self.config.name}: RDMA device(s) {', '.join(missing)} not found under {root} "
                    f"(present: {', '.join(present) or 'none'})"
                )
            present = [device for device in present if device in self.config.devices]
        scan = _Scan()
        for device in present:
            self._scan_device(scan, device, root / device)
        if (context_class := self._verbs_context()) is not None:
            _add_verbs_attributes(scan, context_class)
        return scan

    def _scan_device(self, scan: _Scan, device: str, path: Path) -> None:
        labels = {"host": self._host, "device": device, "role": self._role(device, None, "")}
        info = {name: text for name in _DEVICE_INFO_FILES if (text := _read(path / name))}
        if info:
            scan.add("rdma_device_info", {**labels, **info}, 1, "info")
        if self.config.hw_counters:
            _add_hw_counters(scan, path / "hw_counters", "rdma_device_hw_counter", labels)
        for port_dir in _subdirs(path / "ports"):
            self._scan_port(scan, device, path, port_dir)

    def _scan_port(self, scan: _Scan, device: str, device_path: Path, path: Path) -> None:
        port = path.name
        link_layer = _read(path / "link_layer") or ""
        netdev = _netdev(device_path, port, link_layer) or ""
        labels = {
            "host": self._host,
            "device": device,
            "port": port,
            "netdev": netdev,
            "role": self._role(device, port, netdev),
        }
        record = scan.ports[(device, port)] = _Port(labels)

        read: dict[tuple[str, str], int] = {}
        for group, name in _COUNTER_GROUPS:
            for file_name, file in _files(path / group):
                value = _number(_read(file))
                if value is None:
                    continue
                read[(group, file_name)] = value
                scan.add(name, {**labels, "counter": file_name}, value, "counter")
                bits = PMA_WIDTH_BITS.get(file_name) if group == "counters" else None
                if bits is not None:
                    stuck = value == (1 << bits) - 1
                    scan.add("rdma_port_counter_saturated", {**labels, "counter": file_name}, int(stuck), "gauge")
        for direction, candidates in DATA_FILES.items():
            for group, file_name in candidates:
                if (group, file_name) in read:
                    words = read[(group, file_name)]
                    chosen = {**labels, "direction": direction, "file": f"{group}/{file_name}"}
                    scan.add("rdma_port_data_words", chosen, words, "counter")
                    break
        if self.config.hw_counters:
            record.hw_counters = _add_hw_counters(scan, path / "hw_counters", "rdma_port_hw_counter", labels)

        state, state_name = _state(_read(path / "state"))
        phys, phys_name = _state(_read(path / "phys_state"))
        rate_text = _read(path / "rate") or ""
        if state is not None:
            scan.add("rdma_port_state", labels, state, "gauge")
        if phys is not None:
            scan.add("rdma_port_phys_state", labels, phys, "gauge")
        if (match := _RATE.match(rate_text)) is not None:
            scan.add("rdma_port_rate_gbps", labels, float(match.group(1)), "gauge")
        info = {"state": state_name, "phys_state": phys_name, "link_layer": link_layer, "rate": rate_text}
        scan.add("rdma_port_info", {**labels, **info}, 1, "info")

    def _role(self, device: str, port: str | None, netdev: str) -> str:
        roles = self.config.roles
        for key in (f"{device}/{port}" if port is not None else None, netdev, device):
            if key and key in roles:
                return roles[key]
        return self.config.labels.get("role", "")

    def _verbs_context(self) -> Callable[..., Any] | None:
        if self.config.verbs is False:
            return None
        if self.config.verbs is None and os.path.realpath(self.config.sysfs) != "/sys":
            return None
        return _verbs_context()

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
        binary = shutil.which(self.config.rdma_tool_path)
        if binary is None:
            return None
        try:
            process = await asyncio.create_subprocess_exec(
                binary,
                "-j",
                "statistic",
                "show",
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        except OSError as error:
            log.debug("%s: cannot run %s: %s", self.config.name, binary, error)
            return None
        try:
            out, err = await asyncio.wait_for(process.communicate(), self.config.timeout_s)
        except BaseException as error:  # timeout, or the scrape itself cancelled: do not leave the tool running
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
            if isinstance(error, TimeoutError):
                log.debug("%s: %s gave no answer within %g s", self.config.name, binary, self.config.timeout_s)
                return None
            raise
        if process.returncode != 0:
            log.debug("%s: %s exited %s: %s", self.config.name, binary, process.returncode, err.decode()[:200])
            return None
        return parse_statistic_json(out.decode(errors="replace"))


def parse_statistic_json(text: str) -> list[tuple[str, str, dict[str, int]]] | None:
    """(device, port, counters) per port of `rdma -j statistic show`; None when it is not that JSON."""
    text = text.strip()
    if not text:
        return []
    try:
        data: Any = json.loads(text)
    except ValueError:
        data = []
        for line in text.splitlines():  # older iproute2 printed one JSON object per line
            try:
                data.append(json.loads(line))
            except ValueError:
                if line.strip():
                    return None
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list):
        return None
    result = []
    for entry in data:
        if not isinstance(entry, dict) or not isinstance(entry.get("ifname"), str) or "port" not in entry:
            continue
        counters = {
            key: value
            for key, value in entry.items()
            if key not in ("ifname", "ifindex", "port") and isinstance(value, int) and not isinstance(value, bool)
        }
        result.append((entry["ifname"], str(entry["port"]), counters))
    return result


# --- sysfs helpers ---------------------------------------------------------------------------------------------


def _read(path: Path | str) -> str | None:
    """The file's text, stripped; None when it cannot be read (missing, EINVAL, EIO, EACCES, not text).

    os.open/os.read rather than Path.read_text: a scrape reads ~100 tiny files per NIC, and the io stack's
    buffered text wrapper costs more than the read itself.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            data = os.read(fd, 65536)  # a sysfs attribute is at most one page
        finally:
            os.close(fd)
        return data.decode().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _number(text: str | None) -> int | None:
    """A sysfs counter (unsigned decimal); None for "N/A (no PMA)", empty or anything else."""
    if text is None or _DECIMAL.fullmatch(text) is None:
        return None
    return int(text)


def _files(directory: Path) -> list[tuple[str, str]]:
    """(name, path) of the regular files in `directory`, by name (plain strings: a scrape lists ~10 directories
    of ~40 files per NIC, and pathlib's parsing would cost more than the reads)."""
    try:
        with os.scandir(directory) as entries:  # DirEntry.is_file needs no stat for regular files
            return sorted((entry.name, entry.path) for entry in entries if entry.is_file())
    except OSError:
        return []


def _subdirs(directory: Path) -> list[Path]:
    try:
        entries = [entry for entry in directory.iterdir() if entry.is_dir()]
    except OSError:
        return []
    return sorted(entries, key=lambda entry: (not entry.name.isdigit(), int(entry.name) if entry.name.isdigit() else 0))


def _add_hw_counters(scan: _Scan, directory: Path, name: str, labels: dict[str, str]) -> set[str]:
    """hw_counters/*: every counter as `name`, and `lifespan` (a setting in ms, not a counter) as
    `<name>s_lifespan_ms`; returns the counters' names."""
    seen = set()
    for file_name, file in _files(directory):
        value = _number(_read(file))
        if value is None:
            continue
        if file_name == "lifespan":
            scan.add(f"{name}s_lifespan_ms", labels, value, "gauge")
            continue
        seen.add(file_name)
        scan.add(name, {**labels, "counter": file_name}, value, "counter")
    return seen


def _state(text: str | None) -> tuple[int | None, str]:
    """ "4: ACTIVE" -> (4, "ACTIVE"); "5: LinkUp" -> (5, "LinkUp")."""
    match = _STATE.match(text or "")
    if match is None:
        return None, text or ""
    return int(match.group(1)), match.group(2)


def _netdev(device_path: Path, port: str, link_layer: str) -> str | None:
    if link_layer != "InfiniBand":
        ndevs = device_path / "ports" / port / "gid_attrs" / "ndevs"
        for entry in _by_index(ndevs):
            if name := _read(entry):
                return name
    return _pci_netdev(device_path / "device" / "net", port)


def _by_index(directory: Path) -> list[Path]:
    try:
        entries = [entry for entry in directory.iterdir() if entry.name.isdigit()]
    except OSError:
        return []
    return sorted(entries, key=lambda entry: int(entry.name))


def _pci_netdev(net: Path, port: str) -> str | None:
    try:
        names = sorted(entry.name for entry in net.iterdir())
    except OSError:
        return None
    if not port.isdigit():
        return None
    wanted = int(port) - 1
    matches, unknown = [], []
    for name in names:
        index = _number(_read(net / name / "dev_port"))
        if index is None:
            dev_id = _read(net / name / "dev_id") or ""
            index = int(dev_id, 16) if re.fullmatch(r"0x[0-9a-fA-F]+", dev_id) else None
        if index is None:
            unknown.append(name)
        elif index == wanted:
            matches.append(name)
    if not matches and len(names) == 1 and unknown:
        matches = unknown
    return min(matches, key=lambda name: (len(name), name)) if matches else None


# --- pyverbs (optional) ----------------------------------------------------------------------------------------


def _verbs_context() -> Callable[..., Any] | None:
    """pyverbs' Context class, or None when pyverbs (or the libibverbs under it) cannot be imported."""
    try:
        from pyverbs.device import Context  # type: ignore[import-not-found]
    except Exception:  # ImportError, or a build whose shared libraries are missing
        return None
    return Context


def _add_verbs_attributes(scan: _Scan, context_class: Callable[..., Any]) -> None:
    by_device: dict[str, list[tuple[str, _Port]]] = {}
    for (device, port), record in scan.ports.items():
        by_device.setdefault(device, []).append((port, record))
    for device, ports in by_device.items():
        try:
            context = context_class(name=device)
        except Exception as error:  # no such device for libibverbs, no permission, ...
            log.debug("pyverbs cannot open %s: %s", device, error)
            continue
        try:
            for port, record in ports:
                if not port.isdigit():
                    continue
                try:
                    attr = context.query_port(int(port))
                except Exception as error:
                    log.debug("pyverbs cannot query %s/%s: %s", device, port, error)
                    continue
                for name, value in _verbs_gauges(attr):
                    scan.add(name, record.labels, value, "gauge")
        finally:
            close = getattr(context, "close", None)
            if close is not None:
                try:
                    close()
                except Exception as error:
                    log.debug("pyverbs close of %s failed: %s", device, error)


def _verbs_gauges(attr: Any) -> Iterable[tuple[str, int]]:
    for name, field_name in (("rdma_port_active_mtu_bytes", "active_mtu"), ("rdma_port_max_mtu_bytes", "max_mtu")):
        mtu = _MTU_BYTES.get(_int_attr(attr, field_name) or 0)
        if mtu is not None:
            yield name, mtu
    for name, field_name in (
        ("rdma_port_gid_table_size", "gid_tbl_len"),
        ("rdma_port_pkey_table_size", "pkey_tbl_len"),
        ("rdma_port_max_message_bytes", "max_msg_sz"),
    ):
        value = _int_attr(attr, field_name)
        if value is not None:
            yield name, value


def _int_attr(attr: Any, name: str) -> int | None:
    try:
        value = getattr(attr, name)
    except Exception:
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
