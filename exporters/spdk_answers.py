"""The SPDK source's parsers: one scrape's JSON-RPC answers to raw samples and read errors.

Pure functions of their input (no socket, no clock, no logging): the collector (exporters/spdk.py) asks the target
through the transport (exporters/spdk_rpc.py) and hands the answers here, with what it remembers between scrapes
(`Memory`). Tests call `samples()` on captures alone. The naming scheme, the labels and the rule for which bad
answers are read errors are in exporters/spdk.py's module docstring.

Answers are decoded by `decode`: an integer literal with more digits than any 64-bit counter (more than 20) is
never handed to int() (Python refuses past 4300 digits, and the work grows with the length): it becomes an
`Oversized` number, which every reader reports as out of range.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvscope.exporters.base import ReadError, ReadErrorReason
from kvscope.samples import Kind, Sample, labels_of

U64_MAX = (1 << 64) - 1
U64_DIGITS = len(str(U64_MAX))  # 20: a longer integer literal is out of range before int() is asked


class Oversized(float):
    """An integer literal with more digits than a 64-bit counter holds: ±inf, with its digit count (the literal
    itself is not kept). A float, so the spdk client can still log the answer it decoded."""

    digits: int

    def __new__(cls, literal: str) -> Oversized:
        number = super().__new__(cls, -math.inf if literal.startswith("-") else math.inf)
        number.digits = len(literal) - literal.startswith("-")
        return number

    def __repr__(self) -> str:
        return f"<{'-' if self < 0 else ''}{self.digits}-digit integer>"


def _parse_int(literal: str) -> int | Oversized:
    if len(literal) - literal.startswith("-") > U64_DIGITS:
        return Oversized(literal)
    return int(literal)


_DECODER = json.JSONDecoder(parse_int=_parse_int)


def decode(text: str, start: int = 0) -> tuple[Any, int]:
    """One JSON value of `text` from `start` (json.JSONDecoder.raw_decode), long integer literals as Oversized."""
    return _DECODER.raw_decode(text, start)


def loads(text: str | bytes) -> Any:
    """A whole JSON document (a capture), decoded as the transport decodes answers."""
    text = text.decode() if isinstance(text, bytes) else text
    value, end = decode(text.lstrip())
    if text.lstrip()[end:].strip():
        raise ValueError(f"extra data after the JSON value at {end}")
    return value


# -- what a scrape hands the parsers ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RpcFailure:
    """A JSON-RPC error answer, code as SPDK sent it ("malformed" when its error member is not an object)."""

    method: str
    code: str
    message: str


@dataclass
class Answers:
    """What one scrape got back: spdk_get_version's result (None if not asked or refused), every iostat answer,
    the other results by method, histograms by bdev, and the JSON-RPC error answers."""

    version: Any = None
    iostat: list[Any] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)
    histograms: dict[str, Any] = field(default_factory=dict)
    failures: list[RpcFailure] = field(default_factory=list)


@dataclass(frozen=True)
class Roles:
    """The target's role configuration (SpdkTargetConfig's role_by_* and its `role` label)."""

    default: str = ""
    by_bdev: dict[str, str] = field(default_factory=dict)
    by_subsystem: dict[str, str] = field(default_factory=dict)
    by_lvstore: dict[str, str] = field(default_factory=dict)


@dataclass
class Memory:
    """What the parsers keep between scrapes of one target: the last iostat counters per bdev (ticks, tick_rate,
    counters), for rates, and the last subsystem membership seen (bdev -> NQNs)."""

    previous: dict[str, tuple[float, float, dict[str, float]]] = field(default_factory=dict)
    membership: dict[str, list[str]] = field(default_factory=dict)


# -- reading values --------------------------------------------------------------------------------------------


class _Reader:
    """Collects the read errors of one scrape; each `what` is the RPC method whose answer held the value."""

    def __init__(self) -> None:
        self.errors: list[ReadError] = []

    def error(self, reason: ReadErrorReason, method: str, detail: str) -> None:
        self.errors.append(ReadError(reason, method, detail))

    def u64(self, method: str, where: str, value: Any) -> float | None:
        """A counter field (SPDK writes them as uint64): its value, or None and a read error."""
        problem = _u64_problem(value)
        if problem is not None:
            self.error(problem[0], method, f"{where}: {problem[1]}")
            return None
        return float(value)

    def number(self, method: str, where: str, value: Any) -> float | None:
        """Any other numeric field: its value; None for a value that is no number (names, masks: not an error)
        and for an Oversized one (an error: no float holds it)."""
        if isinstance(value, Oversized):
            self.error("out_of_range", method, f"{where}: {value!r}")
            return None
        return _number(value)


def _u64_problem(value: Any) -> tuple[ReadErrorReason, str] | None:
    if isinstance(value, Oversized):
        return "out_of_range", f"{value!r} is beyond 2^64-1"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "unparseable", f"{_snippet(value)} is not a number"
    if isinstance(value, float) and math.isnan(value):
        return "unparseable", "NaN is not a count"
    if value < 0 or value > U64_MAX:
        return "out_of_range", f"{value!r} is outside 0..2^64-1"
    return None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _tick_rate(read: _Reader, method: str, top: dict, needed: bool) -> float | None:
    """The answer's tick_rate, when a field in ticks needs it: a read error if it is missing or unusable."""
    if "tick_rate" not in top:
        if needed:
            read.error("unparseable", method, "no tick_rate for the fields in ticks")
        return None
    rate = read.u64(method, "tick_rate", top["tick_rate"])
    if rate == 0:
        read.error("out_of_range", method, "tick_rate 0")
        return None
    return rate


def _snippet(value: Any, limit: int = 200) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def _key(ref: str) -> str:
    """Lookup key of a bdev reference: UUIDs compare case-insensitively."""
    return ref.lower() if _UUID.fullmatch(ref) else ref


_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


class _Out:
    def __init__(self) -> None:
        self.samples: list[Sample] = []

    def add(self, name: str, labels: dict[str, str], value: float, kind: Kind) -> None:
        self.samples.append(Sample("spdk", name, labels_of(labels), float(value), kind))


# -- the scrape ------------------------------------------------------------------------------------------------


def samples(answers: Answers, roles: Roles, memory: Memory) -> tuple[list[Sample], list[ReadError]]:
    """The raw samples of one scrape's answers, and the parts of them that could not be read. Updates `memory`."""
    out, read = _Out(), _Reader()
    results = answers.results
    bdevs = results.get("bdev_get_bdevs")
    if bdevs is not None and not isinstance(bdevs, list):
        read.error("unparseable", "bdev_get_bdevs", f"not a list: {_snippet(bdevs)}")
    bdevs = bdevs if isinstance(bdevs, list) else []
    iostat, nameless = iostat_entries(answers.iostat, read)
    present = {name for name, _, _ in iostat}
    resolve = resolver(bdevs, present)

    # Which subsystem exports each bdev (kept from the last answer when nvmf_get_subsystems fails).
    namespaces = _subsystems(results.get("nvmf_get_subsystems"), resolve, memory, read)

    default_role = roles.default
    by_bdev = {resolve.get(_key(key)): role for key, role in roles.by_bdev.items()}

    def bdev_labels(name: str) -> dict[str, str]:
        nqns = sorted(set(memory.membership.get(name, [])))
        exported = next(
            (roles.by_subsystem[nqn] for nqn in nqns if nqn in roles.by_subsystem), default_role if nqns else ""
        )
        return {
            "bdev": name,
            "subsystem": ",".join(nqns),
            "role": by_bdev.get(name, default_role),
            "tier": by_bdev.get(name, exported),
        }

    by_name = _iostat_samples(out, read, iostat, nameless, bdev_labels, memory)
    _subsystem_sums(out, namespaces, by_name)
    _bdev_samples(out, read, bdevs, bdev_labels)
    for name, result in answers.histograms.items():
        histogram_samples(out, read, result, bdev_labels(resolve.get(_key(name), name)), name)
    nvmf_stats_samples(out, read, results.get("nvmf_get_stats"))

    def lvstore_tier(lvs: dict[str, str]) -> str:
        return roles.by_lvstore.get(lvs["lvstore"], roles.by_lvstore.get(lvs["uuid"], default_role))

    lvstore_samples(out, read, results.get("bdev_lvol_get_lvstores"), lvstore_tier)
    thread_samples(out, read, results.get("thread_get_stats"))
    reactor_samples(out, read, results.get("framework_get_reactors"))
    _version_samples(out, read, answers.version)

    counts: dict[tuple[str, str, str], int] = {}
    for failure in answers.failures:
        key = (failure.method, failure.code, failure.message)
        counts[key] = counts.get(key, 0) + 1
    for (method, code, message), count in counts.items():
        out.add("spdk_rpc_errors", {"method": method, "code": code, "message": message}, count, "gauge")
    return out.samples, read.errors


# -- bdev_get_iostat -------------------------------------------------------------------------------------------


def iostat_entries(results: list[Any], read: _Reader | None = None) -> tuple[list[tuple[str, dict, dict]], bool]:
    """(bdev, stats, the answer's top level) for every bdev of every iostat answer, in both shapes SPDK used; and
    whether some entry named no bdev (its I/O is then in no series)."""
    read = read if read is not None else _Reader()
    entries: list[tuple[str, dict, dict]] = []
    seen: set[str] = set()
    nameless = False
    for result in results:
        if isinstance(result, dict) and isinstance(result.get("bdevs"), list):
            top, items = result, result["bdevs"]
        elif isinstance(result, list):  # before v20: [{"tick_rate": N}, {bdev}, ...]
            top = next((i for i in result if isinstance(i, dict) and "tick_rate" in i), {})
            items = [i for i in result if not (isinstance(i, dict) and "tick_rate" in i and "name" not in i)]
        else:
            read.error("unparseable", "bdev_get_iostat", f"no bdevs list: {_snippet(result)}")
            nameless = True
            continue
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                read.error("unparseable", "bdev_get_iostat", f"a bdev without a name: {_snippet(item)}")
                nameless = True
                continue
            if item["name"] not in seen:
                seen.add(item["name"])  # a bdev asked twice (by name and by alias) is counted once
                entries.append((item["name"], item, top))
    return entries, nameless


def _iostat_kind(key: str) -> Kind:
    if key.startswith(("max_", "min_")) or key.startswith("queue_depth"):
        return "gauge"
    if key.startswith(("bytes_", "num_")) or key.endswith("_latency_ticks") or key in ("io_time", "weighted_io_time"):
        return "counter"
    return "unknown"


def _summable(key: str) -> bool:
    """Counters that add up across a subsystem's namespaces: bytes, ops and latency sums (not max_/min_)."""
    if key.startswith(("max_", "min_")):
        return False
    return key.startswith(("bytes_", "num_")) or key.endswith("_latency_seconds")


@dataclass
class _Bdev:
    """One bdev's iostat, read: its samples (raw name suffix -> value, kind), the counters, and the fields that
    could not be read."""

    name: str
    labels: dict[str, str]
    fields: list[tuple[str, dict[str, str], float, Kind]] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)
    bad: set[str] = field(default_factory=set)


def _iostat_samples(
    out: _Out,
    read: _Reader,
    iostat: list[tuple[str, dict, dict]],
    nameless: bool,
    bdev_labels: Callable[[str], dict[str, str]],
    memory: Memory,
) -> dict[str, _Bdev]:
    """Every field of every bdev, ticks to seconds, rates on the answers' own ticks. A field one bdev could not
    read is withheld from its tier this scrape (the other bdevs' samples of it carry tier ""), so the tier's sum
    is absent rather than partial; an entry naming no bdev withholds every tier's."""
    method = "bdev_get_iostat"
    tops: dict[int, tuple[float | None, float | None]] = {}
    bdevs: dict[str, _Bdev] = {}
    for name, entry, top in iostat:
        if id(top) not in tops:
            needed = any(str(key).endswith("_ticks") for _, e, t in iostat if t is top for key in e)
            rate = _tick_rate(read, method, top, needed)
            ticks = read.u64(method, "ticks", top["ticks"]) if "ticks" in top else None
            tops[id(top)] = (rate, ticks)
        rate, ticks = tops[id(top)]
        bdev = bdevs[name] = _Bdev(name, bdev_labels(name))
        if rate is not None:
            bdev.fields.append(("iostat_tick_rate", {}, rate, "gauge"))
        if ticks is not None:
            bdev.fields.append(("iostat_ticks", {}, ticks, "counter"))
        for key, value in entry.items():
            if key == "name":
                continue
            where = f"{name}: {key}"
            if key == "io_error" and isinstance(value, dict):
                for status, count in value.items():
                    number = read.u64(method, f"{where}.{status}", count)
                    if number is None:
                        bdev.bad.add("io_error")
                    else:
                        bdev.fields.append(("io_error", {"status": str(status)}, number, "counter"))
                continue
            if key == "driver_specific" and isinstance(value, dict):
                for path, number in _leaves(read, method, where, value):
                    bdev.fields.append(("driver_specific", {"field": path}, number, "unknown"))
                continue
            if isinstance(value, dict | list):
                continue  # structure SPDK may add (per-channel stats): not a field of this bdev
            kind = _iostat_kind(key)
            if key.endswith("_ticks"):
                key = key[: -len("_ticks")] + "_seconds"
                if rate is None:  # reported once for the answer
                    bdev.bad.add(key)
                    continue
            number = read.u64(method, where, value)
            if number is None:
                bdev.bad.add(key)
                continue
            if key.endswith("_seconds") and rate is not None:
                number /= rate
            bdev.fields.append((key, {}, number, kind))
            if kind == "counter":
                bdev.counters[key] = number

    withheld = {(bdev.labels["tier"], key) for bdev in bdevs.values() for key in bdev.bad}
    previous, memory.previous = memory.previous, {}
    for name, _, top in iostat:
        bdev = bdevs[name]
        tier = bdev.labels["tier"]
        for key, extra, number, kind in bdev.fields:
            labels = {**bdev.labels, **extra}
            if tier and (nameless or (tier, key) in withheld):
                labels["tier"] = ""
            out.add(f"spdk_bdev_{key}", labels, number, kind)
        rate, ticks = tops[id(top)]
        if ticks is not None and rate:
            memory.previous[name] = (ticks, rate, bdev.counters)
            before = previous.get(name)
            if before is not None and before[1] == rate and ticks > before[0]:
                window = (ticks - before[0]) / rate
                out.add("spdk_bdev_iostat_window_seconds", bdev.labels, window, "gauge")
                for key, value in bdev.counters.items():
                    earlier = before[2].get(key)
                    if earlier is not None and value >= earlier and key.startswith(("bytes_", "num_")):
                        out.add(f"spdk_bdev_{key}_per_second", bdev.labels, (value - earlier) / window, "gauge")
    return bdevs


def _leaves(read: _Reader, method: str, where: str, value: Any, prefix: str = "") -> list[tuple[str, float]]:
    found: list[tuple[str, float]] = []
    if isinstance(value, dict):
        for key, item in value.items():
            found += _leaves(read, method, where, item, f"{prefix}.{key}" if prefix else str(key))
    elif (number := read.number(method, f"{where}.{prefix}", value)) is not None:
        found.append((prefix, number))
    return found


# -- nvmf_get_subsystems ---------------------------------------------------------------------------------------


def resolver(bdevs: list, iostat_names: Iterable[str]) -> dict[str, str]:
    """Bdev name, each alias and the UUID -> the bdev's name (names win over aliases of other bdevs)."""
    index: dict[str, str] = {}
    for name in iostat_names:
        index[_key(name)] = name
    for bdev in bdevs:
        if isinstance(bdev, dict) and "name" in bdev:
            index[_key(str(bdev["name"]))] = str(bdev["name"])
    for bdev in bdevs:
        if isinstance(bdev, dict) and "name" in bdev:
            aliases = bdev.get("aliases") or []
            for ref in [*(aliases if isinstance(aliases, list) else []), bdev.get("uuid")]:
                if ref:
                    index.setdefault(_key(str(ref)), str(bdev["name"]))
    return index


def _namespace_bdev(ns: Any, resolve: dict[str, str]) -> tuple[str, str | None]:
    """(the reference the namespace gives, the bdev it names or None): bdev_name, then name, then uuid."""
    if not isinstance(ns, dict):
        return _snippet(ns), None
    refs = [str(ns[key]) for key in ("bdev_name", "name", "uuid") if ns.get(key)]
    for ref in refs:
        if _key(ref) in resolve:
            return ref, resolve[_key(ref)]
    return (refs[0] if refs else ""), None


def _subsystems(
    subsystems: Any, resolve: dict[str, str], memory: Memory, read: _Reader
) -> dict[str, list[tuple[str, str, str | None]]]:
    """nqn -> [(nsid, ref, bdev or None)]; updates the membership when the answer is a list."""
    method = "nvmf_get_subsystems"
    namespaces: dict[str, list[tuple[str, str, str | None]]] = {}
    if subsystems is None:
        return namespaces
    if not isinstance(subsystems, list):
        read.error("unparseable", method, f"not a list: {_snippet(subsystems)}")
        return namespaces
    membership: dict[str, list[str]] = {}
    for subsystem in subsystems:
        if not isinstance(subsystem, dict) or "nqn" not in subsystem:
            read.error("unparseable", method, f"a subsystem without an nqn: {_snippet(subsystem)}")
            continue
        nqn = str(subsystem["nqn"])
        if subsystem.get("subtype") == "Discovery":
            continue
        rows = namespaces.setdefault(nqn, [])
        listed = subsystem.get("namespaces") or []
        if not isinstance(listed, list):
            read.error("unparseable", method, f"{nqn}: namespaces is not a list: {_snippet(listed)}")
            listed = []
        for ns in listed:
            ref, bdev = _namespace_bdev(ns, resolve)
            rows.append((str(ns.get("nsid", "")) if isinstance(ns, dict) else "", ref, bdev))
            if bdev is not None:
                membership.setdefault(bdev, []).append(nqn)
    memory.membership = membership
    return namespaces


def _subsystem_sums(out: _Out, namespaces: dict[str, list[tuple[str, str, str | None]]], bdevs: dict[str, _Bdev]):
    """Per subsystem: sums of its namespaces' counters, only when every namespace's bdev answered (else
    spdk_nvmf_subsystem_namespaces_unresolved says how many did not), and per field only when every one of them
    could read it: a partial sum would be a wrong number."""
    for nqn, rows in namespaces.items():
        out.add("spdk_nvmf_subsystem_namespaces", {"subsystem": nqn}, len(rows), "gauge")
        missing = [row for row in rows if row[2] not in bdevs]
        out.add("spdk_nvmf_subsystem_namespaces_unresolved", {"subsystem": nqn}, len(missing), "gauge")
        for nsid, ref, bdev in rows:
            info = {"subsystem": nqn, "nsid": nsid, "bdev": bdev or "", "ref": ref}
            out.add("spdk_nvmf_subsystem_namespace", info, 1, "info")
        if missing:
            continue
        members = [bdevs[bdev] for _, _, bdev in rows if bdev is not None]
        bad = set().union(*(member.bad for member in members))
        sums: dict[str, float] = {}
        for member in members:
            for key, number in member.counters.items():
                if _summable(key) and key not in bad:
                    sums[key] = sums.get(key, 0.0) + number
        for key, number in sums.items():
            out.add(f"spdk_nvmf_subsystem_{key}", {"subsystem": nqn}, number, "counter")


# -- bdev_get_bdevs, bdev_get_histogram, spdk_get_version ------------------------------------------------------


def _bdev_samples(out: _Out, read: _Reader, bdevs: list, bdev_labels: Callable[[str], dict[str, str]]) -> None:
    method = "bdev_get_bdevs"
    for bdev in bdevs:
        if not isinstance(bdev, dict) or "name" not in bdev:
            read.error("unparseable", method, f"a bdev without a name: {_snippet(bdev)}")
            continue
        name = str(bdev["name"])
        labels = bdev_labels(name)
        sizes = []
        for key in ("block_size", "num_blocks"):
            if key not in bdev:
                read.error("unparseable", method, f"{name}: no {key}")
            else:
                sizes.append(read.u64(method, f"{name}: {key}", bdev[key]))
        if len(sizes) == 2 and None not in sizes:
            block_size, num_blocks = sizes
            out.add("spdk_bdev_capacity_bytes", labels, block_size * num_blocks, "gauge")
            out.add("spdk_bdev_block_size", labels, block_size, "gauge")
            out.add("spdk_bdev_num_blocks", labels, num_blocks, "gauge")
        aliases = bdev.get("aliases") or []
        info = {
            **labels,
            "product_name": str(bdev.get("product_name", "")),
            "uuid": str(bdev.get("uuid", "")),
            "aliases": ",".join(str(a) for a in aliases) if isinstance(aliases, list) else _snippet(aliases),
        }
        out.add("spdk_bdev_info", info, 1, "info")


def histogram_samples(out: _Out, read: _Reader, result: Any, labels: dict[str, str], name: str) -> None:
    """Cumulative counts at the end of each power-of-two range of SPDK's histogram (exact bucket boundaries:
    range r ends at 2^(r + granularity) ticks); the last range also holds everything above it, so it is +Inf."""
    try:
        granularity = int(result.get("granularity", result.get("bucket_shift")))
        min_range = int(result.get("min_range", 0))
        max_range = int(result.get("max_range", 64 - granularity))
        tsc_rate = float(result["tsc_rate"])
        data = base64.b64decode(result["histogram"], validate=True)
        per_range = 1 << granularity
        count = (max_range - min_range + 1) * per_range
        if len(data) != 8 * count or not 0 < tsc_rate < math.inf:
            raise ValueError(f"{len(data)} bytes for {count} buckets")
    except (AttributeError, KeyError, TypeError, ValueError, OverflowError, binascii.Error) as error:
        read.error("unparseable", "bdev_get_histogram", f"{name}: {_snippet(str(error))}")
        return
    buckets = struct.unpack(f"<{count}Q", data)  # host order of the target (x86/ARM: little-endian)
    running = 0
    for index, r in enumerate(range(min_range, max_range + 1)):
        running += sum(buckets[index * per_range : (index + 1) * per_range])
        le = "+Inf" if r == max_range else repr((1 << (r + granularity)) / tsc_rate)
        out.add("spdk_bdev_histogram_bucket", {**labels, "le": le}, running, "histogram")
    out.add("spdk_bdev_histogram_count", labels, running, "histogram")


def _version_samples(out: _Out, read: _Reader, version: Any) -> None:
    if version is None:
        return
    if not isinstance(version, dict):
        read.error("unparseable", "spdk_get_version", f"not an object: {_snippet(version)}")
        return
    fields = version.get("fields")
    fields = fields if isinstance(fields, dict) else {}
    info = {"version": str(version.get("version", ""))}
    info.update({key: str(fields.get(key, "")) for key in ("major", "minor", "patch", "suffix")})
    out.add("spdk_version_info", info, 1, "info")


# -- objects of scalars: nvmf_get_stats, bdev_lvol_get_lvstores, thread_get_stats, framework_get_reactors ------


def _scalars(
    out: _Out,
    read: _Reader,
    method: str,
    where: str,
    prefix: str,
    obj: dict,
    labels: dict[str, str],
    *,
    counters: Iterable[str] = (),
    ticks: Iterable[str] = (),
    tick_rate: float | None = None,
    skip: Iterable[str] = (),
    default_kind: Kind = "unknown",
) -> None:
    """The numeric (and boolean) fields of one object: `pending_*`/`current_*`/`*_count`/booleans are gauges,
    `counters` are counters, the rest `default_kind`; `ticks` fields become `<field>_seconds` (counters). Counters
    and ticks are read as uint64 (a read error otherwise); every `ticks` field must be there."""
    counters, ticks, skip = set(counters), set(ticks), set(skip)
    for key in sorted(ticks - obj.keys()):
        read.error("unparseable", method, f"{where}: no {key}")
    for key, value in obj.items():
        if key in skip:
            continue
        if isinstance(value, bool):
            out.add(f"{prefix}_{key}", labels, float(value), "gauge")
            continue
        if key in ticks:
            number = read.u64(method, f"{where}: {key}", value)
            if number is not None and tick_rate:  # a missing tick_rate is reported once for the answer
                out.add(f"{prefix}_{key}_seconds", labels, number / tick_rate, "counter")
            continue
        if key in counters:
            number = read.u64(method, f"{where}: {key}", value)
        else:
            number = read.number(method, f"{where}: {key}", value)
        if number is None:
            continue
        kind: Kind = "counter" if key in counters else default_kind
        if key.startswith(("pending_", "current_")) or key.endswith("_count"):
            kind = "gauge"
        out.add(f"{prefix}_{key}", labels, number, kind)


def _shape(method: str, result: Any, key: str | None, read: _Reader) -> tuple[dict, list] | None:
    """(top level, list under `key`) of a result, or None (and a read error) when it is not that shape."""
    if result is None:
        return None
    if key is None:
        if isinstance(result, list):
            return {}, result
    elif isinstance(result, dict) and isinstance(result.get(key, []), list):
        return result, result.get(key, [])
    read.error("unparseable", method, f"not the shape SPDK answers: {_snippet(result)}")
    return None


def _objects(read: _Reader, method: str, what: str, items: Any) -> list[dict]:
    """The objects of a list in an answer; anything else in it is a read error."""
    if not isinstance(items, list):
        read.error("unparseable", method, f"{what} is not a list: {_snippet(items)}")
        return []
    found = []
    for item in items:
        if isinstance(item, dict):
            found.append(item)
        else:
            read.error("unparseable", method, f"{what}: not an object: {_snippet(item)}")
    return found


_POLL_GROUP_COUNTERS = ("admin_qpairs", "io_qpairs", "completed_nvme_io")
_DEVICE_COUNTERS = (
    "polls",
    "idle_polls",
    "completions",
    "requests",
    "total_send_wrs",
    "send_doorbell_updates",
    "total_recv_wrs",
    "recv_doorbell_updates",
)


def nvmf_stats_samples(out: _Out, read: _Reader, result: Any) -> None:
    method = "nvmf_get_stats"
    shaped = _shape(method, result, "poll_groups", read)
    if shaped is None:
        return
    top, groups = shaped
    groups = _objects(read, method, "poll_groups", groups)
    needed = any(
        "request_latency" in device
        for group in groups
        for transport in group.get("transports") or []
        if isinstance(transport, dict)
        for device in transport.get("devices") or []
        if isinstance(device, dict)
    )
    tick_rate = _tick_rate(read, method, top, needed)
    for group in groups:
        name = str(group.get("name", ""))
        labels = {"poll_group": name}
        _scalars(out, read, method, name, "spdk_nvmf_poll_group", group, labels, counters=_POLL_GROUP_COUNTERS)
        for transport in _objects(read, method, f"{name}: transports", group.get("transports") or []):
            tlabels = {**labels, "trtype": str(transport.get("trtype", ""))}
            out.add("spdk_nvmf_poll_group_transport", tlabels, 1, "info")
            where = f"{name}: {tlabels['trtype']}"
            _scalars(out, read, method, where, "spdk_nvmf_transport", transport, tlabels)
            for device in _objects(read, method, f"{where}: devices", transport.get("devices") or []):
                dlabels = {**tlabels, "device": str(device.get("name", ""))}
                _scalars(
                    out,
                    read,
                    method,
                    f"{where}: {dlabels['device']}",
                    "spdk_nvmf_transport_device",
                    device,
                    dlabels,
                    counters=_DEVICE_COUNTERS,
                    ticks=("request_latency",) if "request_latency" in device else (),
                    tick_rate=tick_rate,
                )


def lvstore_samples(out: _Out, read: _Reader, result: Any, tier_of: Callable[[dict[str, str]], str]) -> None:
    """Each lvstore's fields and its allocated/capacity/free bytes. An lvstore whose clusters cannot be read
    withholds its tier's bytes this scrape (the other lvstores of the tier carry tier ""): a partial sum would be
    a wrong occupancy."""
    method = "bdev_lvol_get_lvstores"
    shaped = _shape(method, result, None, read)
    if shaped is None:
        return
    sized: list[tuple[dict[str, str], float, float, float]] = []
    withheld: set[str] = set()
    for lvs in _objects(read, method, "lvstores", shaped[1]):
        labels = {
            "lvstore": str(lvs.get("name", "")),
            "uuid": str(lvs.get("uuid", "")),
            "base_bdev": str(lvs.get("base_bdev", "")),
        }
        labels["tier"] = tier_of(labels)
        clusters = ("total_data_clusters", "free_clusters", "cluster_size")
        _scalars(out, read, method, labels["lvstore"], "spdk_lvstore", lvs, labels, default_kind="gauge", skip=clusters)
        numbers = []
        for key in clusters:
            if key not in lvs:
                read.error("unparseable", method, f"{labels['lvstore']}: no {key}")
                numbers.append(None)
            else:
                numbers.append(read.u64(method, f"{labels['lvstore']}: {key}", lvs[key]))
        for key, number in zip(clusters, numbers, strict=True):
            if number is not None:
                out.add(f"spdk_lvstore_{key}", labels, number, "gauge")
        total, free, cluster = numbers
        if total is None or free is None or cluster is None or free > total:
            if total is not None and free is not None and free > total:
                read.error("out_of_range", method, f"{labels['lvstore']}: {free:.0f} free of {total:.0f} clusters")
            withheld.add(labels["tier"])
            continue
        sized.append((labels, total, free, cluster))
    for labels, total, free, cluster in sized:
        if labels["tier"] in withheld:
            labels = {**labels, "tier": ""}
        out.add("spdk_lvstore_allocated_bytes", labels, (total - free) * cluster, "gauge")
        out.add("spdk_lvstore_capacity_bytes", labels, total * cluster, "gauge")
        out.add("spdk_lvstore_free_bytes", labels, free * cluster, "gauge")


def thread_samples(out: _Out, read: _Reader, result: Any) -> None:
    method = "thread_get_stats"
    shaped = _shape(method, result, "threads", read)
    if shaped is None:
        return
    top, threads = shaped
    threads = _objects(read, method, "threads", threads)
    tick_rate = _tick_rate(read, method, top, bool(threads))
    for thread in threads:
        labels = {"thread": str(thread.get("name", "")), "id": str(thread.get("id", ""))}
        _scalars(
            out,
            read,
            method,
            labels["thread"],
            "spdk_thread",
            thread,
            labels,
            ticks=("busy", "idle"),
            tick_rate=tick_rate,
            skip=("id",),
        )


def reactor_samples(out: _Out, read: _Reader, result: Any) -> None:
    method = "framework_get_reactors"
    shaped = _shape(method, result, "reactors", read)
    if shaped is None:
        return
    top, reactors = shaped
    reactors = _objects(read, method, "reactors", reactors)
    tick_rate = _tick_rate(read, method, top, bool(reactors))
    for reactor in reactors:
        labels = {"lcore": str(reactor.get("lcore", ""))}
        where = f"lcore {labels['lcore']}"
        _scalars(
            out,
            read,
            method,
            where,
            "spdk_reactor",
            reactor,
            labels,
            counters=("irq", "sys", "usr"),
            ticks=("busy", "idle"),
            tick_rate=tick_rate,
            skip=("lcore", "tid", "numa_id"),
        )
        for thread in _objects(read, method, f"{where}: lw_threads", reactor.get("lw_threads") or []):
            tname = str(thread.get("name", ""))
            if "elapsed" not in thread:
                read.error("unparseable", method, f"{where}: {tname}: no elapsed")
                continue
            elapsed = read.u64(method, f"{where}: {tname}: elapsed", thread["elapsed"])
            if elapsed is not None and tick_rate:
                tlabels = {**labels, "thread": tname, "id": str(thread.get("id", ""))}
                out.add("spdk_reactor_thread_elapsed_seconds", tlabels, elapsed / tick_rate, "counter")
