"""Byte sizes, bandwidths and durations as people write them ("88.1KB", "50GiB", "400Gb/s", "5m").

Decimal units are powers of 1000 and binary units powers of 1024, as docs/design.md ('Units') fixes; a bandwidth in
bits (Gb/s, Gbps) is converted to bytes per second so every cost in kvscope is in bytes.
"""

from __future__ import annotations

import math
import re

MAX_INTEGER = 2**63 - 1  # the most a count or a size may be (a 64-bit counter's range)
_SIZE_UNITS: dict[str, int] = {
    "B": 1,
    "KB": 1000,
    "kB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
    "PB": 1000**5,
    "KiB": 1024,
    "MiB": 1024**2,
    "GiB": 1024**3,
    "TiB": 1024**4,
    "PiB": 1024**5,
}
_BIT_RATE_UNITS: dict[str, float] = {"b": 1 / 8, "Kb": 1e3 / 8, "Mb": 1e6 / 8, "Gb": 1e9 / 8, "Tb": 1e12 / 8}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: str | int | float) -> int:
    """Bytes in `value`: a number of bytes or a string such as "88.1KB" or "50 GiB" (rounded to a byte)."""
    if isinstance(value, bool):
        raise ValueError(f"invalid size {value!r}: expected a number of bytes or a string like '50GiB'")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"invalid size {_shown(value)}: must not be negative")
        return _bytes(_finite(value, "size"), value)
    match = _NUMBER_UNIT.match(value) if isinstance(value, str) else None
    if not match:
        raise ValueError(f"invalid size {_shown(value)}: expected a number and a unit, like '88.1KB' or '50GiB'")
    number, unit = float(match.group(1)), match.group(2) or "B"
    if unit not in _SIZE_UNITS:
        raise ValueError(f"invalid size {_shown(value)}: unit {unit!r} is not one of {', '.join(_SIZE_UNITS)}")
    return _bytes(_finite(number * _SIZE_UNITS[unit], "size", value), value)


def _bytes(number: float, written: object) -> int:
    """A size rounded to a byte, at most 2^63 - 1 (what a 64-bit counter of bytes holds)."""
    if number > MAX_INTEGER:
        raise ValueError(f"invalid size {_shown(written)}: more than 2^63 - 1 bytes")
    return round(number)


def _finite(number: float, what: str, written: object = None) -> float:
    """`number`, unless it is infinite or not a number (1e400GB, JSON's Infinity and NaN): a ValueError naming it."""
    if not math.isfinite(number):
        raise ValueError(f"invalid {what} {_shown(number if written is None else written)}: not a finite number")
    return number


def _shown(value: object) -> str:
    """`value` as an error message quotes it, cut short (a 4,300-digit integer is not repeated in full)."""
    if isinstance(value, int) and abs(value) > MAX_INTEGER:
        return f"(an integer of {digits(value)} digits)"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_bandwidth(value: str | int | float) -> float:
    """Bytes per second in `value`: a number (bytes/s), "50GB/s", "400Gb/s" or "400Gbps"."""
    if isinstance(value, bool):
        raise ValueError(f"invalid bandwidth {value!r}")
    if isinstance(value, int | float):
        return _slowest(_finite(float(value), "bandwidth", value), _shown(value))
    if not isinstance(value, str):
        raise ValueError(f"invalid bandwidth {value!r}: expected a rate like '400Gb/s' or a number of bytes/s")
    text = value.strip()
    for suffix in ("/s", "ps"):
        if text.endswith(suffix):
            text = text[: -len(suffix)]
            break
    else:
        raise ValueError(f"invalid bandwidth {value!r}: expected a rate like '400Gb/s', '400Gbps' or '50GB/s'")
    match = _NUMBER_UNIT.match(text)
    if not match:
        raise ValueError(f"invalid bandwidth {value!r}: expected a rate like '400Gb/s' or '50GB/s'")
    number, unit = float(match.group(1)), match.group(2)
    if unit in _BIT_RATE_UNITS:
        rate = number * _BIT_RATE_UNITS[unit]
    elif unit in _SIZE_UNITS:
        rate = number * _SIZE_UNITS[unit]
    else:
        units = ", ".join([*_BIT_RATE_UNITS, *_SIZE_UNITS])
        raise ValueError(f"invalid bandwidth {value!r}: unit {unit!r} is not one of {units} (per second)")
    return _slowest(_finite(rate, "bandwidth", value), repr(value))


def _slowest(rate: float, shown: str) -> float:
    """A bandwidth of at least 1 B/s: below it a transfer time overflows to infinity (5e-324 B/s)."""
    if rate < 1:
        raise ValueError(f"invalid bandwidth {shown}: must be at least 1 B/s")
    return rate


_DURATION_UNITS: dict[str, float] = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(value: str | int | float) -> float:
    """Seconds in `value`: a number of seconds or a string such as "90s", "5m", "1.5h" (Prometheus' units)."""
    if isinstance(value, bool):
        raise ValueError(f"invalid duration {value!r}: expected seconds or a string like '5m'")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        match = _NUMBER_UNIT.match(value) if isinstance(value, str) else None
        unit = match.group(2) if match else None
        if not match or (unit and unit not in _DURATION_UNITS):
            raise ValueError(f"invalid duration {value!r}: expected a number and one of {', '.join(_DURATION_UNITS)}")
        seconds = float(match.group(1)) * _DURATION_UNITS[unit or "s"]
    if seconds <= 0:
        raise ValueError(f"invalid duration {_shown(value)}: must be positive")
    return _finite(seconds, "duration", value)


def format_bytes(count: float) -> str:
    """A byte count in decimal units with four significant digits, e.g. 449.6 GB."""
    magnitude = abs(count)
    for unit, scale in (("PB", 1000**5), ("TB", 1000**4), ("GB", 1000**3), ("MB", 1000**2), ("KB", 1000)):
        if magnitude >= scale:
            return f"{count / scale:.4g} {unit}"
    return f"{count:.0f} B"


def digits(number: int) -> int:
    """The decimal digits of an integer, counted without writing it out (Python refuses to above 4,300)."""
    count = max(1, int(abs(number).bit_length() * math.log10(2)))
    return count + (abs(number) >= 10**count)
