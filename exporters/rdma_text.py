"""The RDMA source's parsers: the bytes of one sysfs attribute, or the text `rdma -j statistic show` printed, to
values. Pure functions of their input (no file, no process), so each is tested from captures alone; the
collector (exporters/rdma.py) reads the files and runs the tool. The rules (which values are errors, which are
normal on real hardware) are in exporters/rdma.py's module docstring.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvscope.exporters.base import ReadErrorReason

# What a PMA counter reads on a device without a performance-management agent (iWARP, some RoCE drivers): the
# kernel's answer, not a fault (node_exporter leaves the series out and counts nothing).
NO_PMA = "N/A (no PMA)"
U64_MAX = (1 << 64) - 1
U64_DIGITS = len(str(U64_MAX))  # 20: a longer run of digits is out of range before int() is asked

_DIGITS = re.compile(r"[0-9]+")
_NEGATIVE = re.compile(r"-[0-9]+")
_STATE = re.compile(r"^\s*(\d+)\s*:\s*(.*?)\s*$")
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*Gb/sec")


class BadValue(ValueError):
    """An attribute whose text is not what the kernel writes there: `reason` says how (a read-error reason)."""

    def __init__(self, reason: ReadErrorReason, detail: str) -> None:
        super().__init__(detail)
        self.reason: ReadErrorReason = reason
        self.detail = detail


def text(data: bytes) -> str:
    """The attribute's text, stripped; BadValue(unparseable) when it is not UTF-8."""
    try:
        return data.decode().strip()
    except UnicodeDecodeError as error:
        raise BadValue("unparseable", f"not UTF-8 ({error.reason} at byte {error.start})") from None


def counter(data: bytes) -> int | None:
    """A sysfs counter: an unsigned decimal of at most 64 bits. None for `N/A (no PMA)`; BadValue for anything
    else that is not a number (unparseable) or a number no u64 holds (out_of_range). The digits are counted
    before int() is asked, so thousands of them cost nothing (and never reach int()'s digit limit)."""
    value = text(data)
    if value == NO_PMA:
        return None
    if _DIGITS.fullmatch(value) is not None:
        if len(value) > U64_DIGITS:
            raise BadValue("out_of_range", f"{len(value)} digits, more than a 64-bit counter has")
        number = int(value)
        if number > U64_MAX:
            raise BadValue("out_of_range", f"{value} is above 2^64-1")
        return number
    if _NEGATIVE.fullmatch(value) is not None:
        raise BadValue("out_of_range", f"{_short(value)} is negative")
    raise BadValue("unparseable", f"not a counter: {_short(value)!r}" if value else "empty")


def state(value: str) -> tuple[int, str]:
    """ "4: ACTIVE" -> (4, "ACTIVE"); "5: LinkUp" -> (5, "LinkUp"); BadValue(unparseable) otherwise."""
    match = _STATE.match(value)
    if match is None:
        raise BadValue("unparseable", f"not a port state: {_short(value)!r}" if value else "empty")
    return int(match.group(1)), match.group(2)


def rate_gbps(value: str) -> float:
    """ "100 Gb/sec (4X EDR)" -> 100.0; BadValue(unparseable) otherwise."""
    match = _RATE.match(value)
    if match is None:
        raise BadValue("unparseable", f"not a port rate: {_short(value)!r}" if value else "empty")
    return float(match.group(1))


def _short(value: str) -> str:
    return value if len(value) <= 40 else f"{value[:40]}... ({len(value)} characters)"


def statistic_json(text: str) -> list[tuple[str, str, dict[str, int]]] | None:
    """(device, port, counters) per port of `rdma -j statistic show`; None when it is not that JSON.

    iproute2 prints one JSON array of port objects (`{"ifname": "mlx5_0", "port": 1, "rx_write_requests": 0,
    ...}`), on one line or, with -p, over several: every version whose source was read (v5.4.0's own JSON writer,
    v6.1.0's common one; tests/fixtures/rdma/PROVENANCE.md). The parser also takes one object per line and a
    single object, shapes no known version prints (a tolerance, not a format). Counters that are not integers
    (booleans, strings, nested objects) are left out."""
    text = text.strip()
    if not text:
        return []
    try:
        data: Any = json.loads(text)
    except ValueError:
        data = []
        for line in text.splitlines():
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
