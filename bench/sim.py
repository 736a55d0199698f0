"""kvscope's embedded tier store against simple anchors; every ratio is measured in one run of this script.

Part 1, block lookups per second. A *block lookup* is one block key checked for presence while matching a
request's prefix: a request whose prompt has `h` hittable blocks, of which the first `n` are present, costs
`min(n + 1, h)` lookups (the blocks that hit, plus the first miss that ends the match). The count depends on the
request stream only, so both implementations below are charged the same number of lookups.
  - kvscope: the store's prefix read (`TieredStore.read_prefix`: finds the run, counts the hits and refreshes
    the LRU order, what the engine calls), timed per request; the save of the missed blocks (`put`) runs
    untimed in between. The whole request path (`EngineEmulator.serve`: match, read, save, evict, release) is
    timed in a second replay.
  - naive (the anchor): the LRU cache people write first, an OrderedDict per tier behind `get(key)` and
    `put(key)` called once per block (`get`: `if key in od: od.move_to_end(key)`; `put`: insert, then
    `popitem(last=False)` while over capacity), replaying the same requests with the same capacity.
  - inlined: the same OrderedDicts with the anchor's per-block loop written inline in the replay (no method
    call per block), printed as a second, stricter anchor.
  - ceiling: the inlined loop stripped of the refresh (membership probes only, the tightest loop Python
    allows), timed on the same states: not an LRU, but the least any per-block Python loop over these dicts
    costs, so the best ratio against the anchor that such a loop could reach.
  Streams: the long-output scenario (examples/long_output.yaml, both arms) and Mooncake's conversation trace
  replayed on one LRU tier small enough to evict; then the same streams with the first tier under the policies
  that model real systems, `mooncake` (on the arm's request pacing, as `kvscope ab run` runs it) and `lmcache`.
  Both implementations must report the same hits per request and the same evictions (checked and printed); under
  mooncake and lmcache the anchor stays the naive LRU, which keeps other blocks, so kvscope's two replays are
  checked against each other instead.

Part 2, the `file` backend against `dd` on the same file system with the same block size: writes (page cache,
then fsync; and O_DIRECT), reads from disk (the file's pages dropped from the page cache first, with
FileBackend.drop_page_cache), reads from the page cache (right after a read), and O_DIRECT reads. kvscope goes
through FileBackend.store and FileBackend.verify (what serving a hit does), so every block pays its XXH3-64
checksum (computed on store, verified on every read; buffered reads check the file's mapped pages in place).

Run: .venv/bin/python bench/sim.py [--repeat N] [--io-repeat N] [--quick] [--part all|lookups|file] [--dir DIR]
This is a script, not a test: bench/ is outside pytest's testpaths and nothing here is named test_*.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

from run_header import print_run_header

from kvscope.tierstore.ab import build_engine, build_store, request_clock
from kvscope.tierstore.backends import FileBackend
from kvscope.tierstore.engine import EngineEmulator
from kvscope.tierstore.scenario import Scenario, load_scenario, parse_scenario
from kvscope.tierstore.workloads import Request, make_workload
from kvscope.units import parse_size

ROOT = Path(__file__).resolve().parent.parent
LONG_OUTPUT = ROOT / "examples" / "long_output.yaml"
TRACE = ROOT / "examples" / "traces" / "conversation_trace.jsonl"
LOOKUP_GOAL_PER_S = 1e6  # the goals: >= 1 M lookups/s in the lookup phase, whole requests >= 1.2x the naive LRU
REQUEST_GOAL_RATIO = 1.2  # (2x in the lookup phase is out of reach of any Python loop: see the ceiling column)
FILE_GOAL_RATIO = 0.8  # kvscope's file backend >= 0.8x dd


# --------------------------------------------------------------------------------------------- part 1: lookups


@dataclass
class Stream:
    """A request stream, materialized once, and the arm of its scenario it is replayed on."""

    label: str
    scenario: Scenario
    arm: str
    requests: list[Request]

    @property
    def lru(self) -> bool:
        """Whether every tier is an LRU, as the naive anchor (then both must hit the same blocks)."""
        return all(tier.policy == "lru" for tier in self.scenario.arms[self.arm].tiers)

    def under(self, policy: str) -> Stream:
        """The same requests with the arm's first tier under `policy` (mooncake models a first tier only)."""
        arm = self.scenario.arms[self.arm]
        tiers = [arm.tiers[0].model_copy(update={"policy": policy}), *arm.tiers[1:]]
        arms = {**self.scenario.arms, self.arm: arm.model_copy(update={"tiers": tiers})}
        label = self.label.replace("/lru", "") + f"/{policy}"
        return Stream(label, self.scenario.model_copy(update={"arms": arms}), self.arm, self.requests)

    @property
    def block_bytes(self) -> int:
        return self.scenario.block_bytes

    def hittable(self, request: Request) -> int:
        """Blocks a request may hit: never the prompt's last token (as EngineEmulator.serve)."""
        return min(len(request.keys), (request.prompt_tokens - 1) // self.scenario.block_tokens)

    def capacities(self) -> list[int]:
        """Each tier's capacity in blocks (all blocks have the same size)."""
        return [tier.capacity // self.block_bytes for tier in self.scenario.arms[self.arm].tiers]


@dataclass
class Replay:
    """What one replay of a stream measured; hits per request are kept for the cross-check."""

    hits: list[int] = field(default_factory=list)
    lookups: int = 0
    evictions: int = 0
    lookup_s: float = 0.0  # prefix match + refresh only
    total_s: float = 0.0  # whole requests


class NaiveLru:
    """The anchor: an OrderedDict per tier (top first) behind a per-block get/put, as a first LRU cache is written.

    Same semantics as the store's `replicate` placement with LRU tiers: a block is served by the highest tier that
    holds it and refreshed there; blocks no tier holds are written to every tier, each evicting its oldest.
    """

    def __init__(self, capacities: Sequence[int]) -> None:
        self.tiers: list[OrderedDict] = [OrderedDict() for _ in capacities]
        self.capacities = list(capacities)
        self.evictions = 0

    def get(self, key) -> bool:
        """Whether some tier holds `key`; refreshes it in the highest one that does."""
        for od in self.tiers:
            if key in od:
                od.move_to_end(key)
                return True
        return False

    def put(self, key) -> None:
        """Write `key` to every tier, evicting each tier's oldest block while it is over capacity."""
        for od, capacity in zip(self.tiers, self.capacities, strict=True):
            od[key] = None
            while len(od) > capacity:
                od.popitem(last=False)
                self.evictions += 1

    def missing(self, keys: Sequence) -> list:
        """The keys no tier holds (checked before any is written, as the store does)."""
        return [key for key in keys if not any(key in od for od in self.tiers)]


def lookup_inlined(naive: NaiveLru, keys: Sequence, hittable: int) -> int:
    """NaiveLru.get's loop written inline: one probe per tier and one move_to_end per block, no method call."""
    hits = 0
    tiers = naive.tiers
    for key in keys[:hittable]:
        for od in tiers:
            if key in od:
                od.move_to_end(key)
                break
        else:
            break
        hits += 1
    return hits


def probe_only(naive: NaiveLru, keys: Sequence, hittable: int) -> int:
    """The run found with membership probes alone, as tight a loop as Python allows: no refresh, no counting.

    Not an LRU (nothing is refreshed); timed only for the ceiling: the least any per-block Python loop over
    these dicts costs, so the best ratio a pure-Python LRU could reach against the anchor.
    """
    tiers = naive.tiers
    if len(tiers) == 1:
        (od,) = tiers
        for position in range(hittable):
            if keys[position] not in od:
                return position
        return hittable
    for position in range(hittable):
        key = keys[position]
        for od in tiers:
            if key in od:
                break
        else:
            return position
    return hittable


def lookup_per_block(naive: NaiveLru, keys: Sequence, hittable: int) -> int:
    """The anchor's lookup: one get() per block until the first miss."""
    hits = 0
    get = naive.get
    for key in keys[:hittable]:
        if not get(key):
            break
        hits += 1
    return hits


Lookup = Callable[[NaiveLru, Sequence, int], int]


def replay_naive(stream: Stream, lookup: Lookup, timed_probe: Lookup | None = None) -> Replay:
    """Replays the stream on NaiveLru; the lookup phase times `lookup`, or `timed_probe` alone when given (the
    lookup then runs untimed after it, so the cache state evolves exactly as in the other replays)."""
    naive = NaiveLru(stream.capacities())
    result = Replay()
    clock = time.perf_counter_ns
    lookup_ns = total_ns = 0
    for request in stream.requests:
        keys, hittable = request.keys, stream.hittable(request)
        start = clock()
        if timed_probe:
            probed = timed_probe(naive, keys, hittable)
            looked_up = clock()
            hits = lookup(naive, keys, hittable)
            if probed != hits:
                raise AssertionError(f"the probe found {probed} blocks, the lookup {hits}")
        else:
            hits = lookup(naive, keys, hittable)
            looked_up = clock()
        for missing_keys in (keys[hits:], request.output_keys):
            for key in naive.missing(missing_keys):
                naive.put(key)
        done = clock()
        lookup_ns += looked_up - start
        total_ns += done - start
        result.hits.append(hits)
        result.lookups += min(hits + 1, hittable)
    result.evictions = naive.evictions
    result.lookup_s, result.total_s = lookup_ns / 1e9, total_ns / 1e9
    return result


def replay_store(stream: Stream) -> Replay:
    """kvscope's lookup phase: TieredStore.read_prefix timed per request; put and release run untimed, and so does
    the clock of a store whose evictions go by time, moved as the engine moves it."""
    arm = stream.scenario.arms[stream.arm]
    store = build_store(arm, stream.block_bytes, stream.arm, None)
    times = request_clock(arm, store)
    result = Replay()
    clock = time.perf_counter_ns
    lookup_ns = 0
    for number, request in enumerate(stream.requests):
        keys, hittable = request.keys, stream.hittable(request)
        when = times(number) if times else None
        if when:
            store.at(when.start)
        start = clock()
        hit = store.read_prefix(keys, 0, hittable)
        lookup_ns += clock() - start
        if when:
            store.at(when.saved)
        store.put(keys[hit.blocks :], stream.block_bytes)
        if request.output_keys:
            if when:
                store.at(when.ended)
            store.put(request.output_keys, stream.block_bytes)
        store.release(keys)
        result.hits.append(hit.blocks)
        result.lookups += min(hit.blocks + 1, hittable)
    result.evictions = sum(tier.counters.evictions for tier in store.tiers)
    result.lookup_s = lookup_ns / 1e9
    return result


def stream_engine(stream: Stream, explains_misses: bool = True) -> EngineEmulator:
    """The engine `kvscope ab run` would serve the stream's arm with, on a fresh store and the arm's clock."""
    arm = stream.scenario.arms[stream.arm]
    store = build_store(arm, stream.block_bytes, stream.arm, None)
    return build_engine(stream.scenario, store, request_clock(arm, store), explains_misses=explains_misses)


def replay_engine(stream: Stream) -> Replay:
    """kvscope's whole request path: EngineEmulator.serve over the stream (on the arm's clock), timed as one loop."""
    engine = stream_engine(stream)
    store = engine.store
    start = time.perf_counter()
    served = list(map(engine.serve, stream.requests))
    elapsed = time.perf_counter() - start
    block_tokens = stream.scenario.block_tokens
    result = Replay(hits=[s.external_hit_tokens // block_tokens for s in served], total_s=elapsed)
    result.lookups = sum(min(h + 1, stream.hittable(r)) for h, r in zip(result.hits, stream.requests, strict=True))
    result.evictions = sum(tier.counters.evictions for tier in store.tiers)
    return result


def long_output_streams() -> list[Stream]:
    scenario = load_scenario(LONG_OUTPUT)
    if scenario.engine.gpu_cache is not None:
        raise SystemExit(f"{LONG_OUTPUT}: the bench replays the tiers only; remove engine.gpu_cache")
    requests = [request for round_requests in make_workload(scenario).rounds() for request in round_requests]
    return [Stream(f"long_output/{arm}", scenario, arm, requests) for arm in scenario.arms]


def trace_stream(capacity_blocks: int) -> Stream:
    block_tokens, bytes_per_token = 512, 64  # the trace's block size; the byte size only scales capacities
    block_bytes = block_tokens * bytes_per_token
    scenario = parse_scenario(
        {
            "name": "conversation_trace",
            "workload": {"kind": "trace", "path": str(TRACE), "block_tokens": block_tokens},
            "kv": {"bytes_per_token": bytes_per_token},
            "arms": {"lru": {"tiers": [{"name": "dram", "capacity": capacity_blocks * block_bytes, "policy": "lru"}]}},
        }
    )
    requests = [request for round_requests in make_workload(scenario).rounds() for request in round_requests]
    return Stream(f"trace/lru {capacity_blocks} blocks", scenario, "lru", requests)


def timer_overhead_ns() -> float:
    """What the two clock reads around a request's lookup phase cost (median of back-to-back pairs)."""
    clock = time.perf_counter_ns
    return median([-(clock() - clock()) for _ in range(10_000)])


def lookup_bench(streams: list[Stream], repeat: int) -> bool:
    """Prints the lookup table; returns whether every cross-check held (the goals are reported, not enforced)."""
    print(f"\n1. Block lookups: kvscope's store vs naive OrderedDict LRUs on the same requests (medians of {repeat})")
    print(
        f"   {'':<27}|{'lookups':^11}|{'lookup phase: M lookups/s':^52}|{'whole requests: seconds':^28}|\n"
        f"   {'stream':<26} | {'count':>9} | {'kvscope':>7} {'naive':>7} {'ratio':>6} {'inlined':>7} {'ratio':>6} "
        f"{'ceiling':>7}  | "
        f"{'kvscope':>7} {'naive':>7} {'ratio':>7}  | {'hit blocks':>10} {'evictions':>9}  cross-check"
    )
    all_same = True
    for stream in streams:
        rows = []
        for _ in range(repeat):
            # Interleaved, and each ratio taken within one round, so a slow spell of the machine hits every side.
            naive = replay_naive(stream, lookup_per_block)
            inlined = replay_naive(stream, lookup_inlined)
            probed = replay_naive(stream, lookup_inlined, timed_probe=probe_only)
            store, engine = replay_store(stream), replay_engine(stream)
            replays = (naive, inlined, probed, store, engine) if stream.lru else (store, engine)
            same = all(
                (r.hits, r.lookups, r.evictions) == (store.hits, store.lookups, store.evictions) for r in replays
            )
            all_same &= same
            rate = store.lookups / store.lookup_s
            rows.append(
                (
                    rate,
                    naive.lookups / naive.lookup_s,
                    inlined.lookups / inlined.lookup_s,
                    rate / (naive.lookups / naive.lookup_s),
                    rate / (inlined.lookups / inlined.lookup_s),
                    naive.lookup_s / probed.lookup_s,
                    engine.total_s,
                    naive.total_s,
                    naive.total_s / engine.total_s,
                )
            )
        columns = [median(column) for column in zip(*rows, strict=True)]
        kv, nv, inl, ratio, inl_ratio, ceiling, serve_s, naive_s, serve_ratio = columns
        goal = kv >= LOOKUP_GOAL_PER_S and serve_ratio >= REQUEST_GOAL_RATIO
        print(
            f"   {stream.label:<26} | {store.lookups:>9,} | {kv / 1e6:>7.2f} {nv / 1e6:>7.2f} {ratio:>5.2f}x "
            f"{inl / 1e6:>7.2f} {inl_ratio:>5.2f}x {ceiling:>6.2f}x  | "
            f"{serve_s:>7.3f} {naive_s:>7.3f} {serve_ratio:>6.2f}x  | "
            f"{sum(store.hits):>10,} {store.evictions:>9,}  {'same' if same else 'DIFFERENT'}"
            f"{'' if stream.lru else ' (kvscope x2)'}"
            f"{'' if goal else '  (goal missed)'}"
        )
    print(
        "   lookup phase: kvscope = TieredStore.read_prefix; naive = NaiveLru.get per block; inlined = the same loop\n"
        "   without a call per block. ratio = kvscope rate / anchor rate. ceiling = naive time / the time of the\n"
        "   inlined loop with neither refresh nor counting (probes only): the best ratio any per-block Python loop\n"
        "   over these dicts could reach.\n"
        "   whole requests: kvscope = EngineEmulator.serve, naive = get + put per block; ratio = naive s / kvscope s.\n"
        f"   goal: lookup phase >= {LOOKUP_GOAL_PER_S / 1e6:.0f} M lookups/s, "
        f"whole requests >= {REQUEST_GOAL_RATIO:g}x naive.\n"
        "   cross-check: hits of every request, lookups and evictions equal in all five replays; (kvscope x2):\n"
        "   under mooncake or lmcache, in kvscope's two (the naive LRU keeps other blocks).\n"
        f"   timing: per request, {timer_overhead_ns():.0f} ns of clock reads are in every lookup-phase time; GC on."
    )
    return all_same


# --------------------------------------------------------------------------------------------- part 2: file I/O

DD_SECONDS = re.compile(r"copied, ([0-9.e+-]+) s")


def dd(*args: str) -> float:
    """Run dd (C locale) and return the copy time it reports itself, which excludes starting the process."""
    done = subprocess.run(["dd", *args], capture_output=True, text=True, check=True, env={**os.environ, "LC_ALL": "C"})
    match = DD_SECONDS.search(done.stderr)
    if not match:
        raise RuntimeError(f"cannot read dd's timing from: {done.stderr.strip()}")
    return float(match.group(1))


def fsync_file(path: Path) -> None:
    """fsync through a second descriptor: on Linux it flushes the file's dirty pages whoever wrote them."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def kv_write(path: Path, size: int, block: int, direct: bool, payload: bytes) -> tuple[float, FileBackend]:
    """Fill a fresh FileBackend with size // block blocks (each checksummed on store); fsync unless O_DIRECT."""
    path.unlink(missing_ok=True)
    start = time.perf_counter()
    backend = FileBackend(size, block, path, direct=direct)
    for key in range(backend.slots):
        backend.store(key, payload)
    if not direct:
        fsync_file(path)
    return time.perf_counter() - start, backend


def dd_write(path: Path, block: int, count: int, direct: bool) -> float:
    """dd from /dev/zero into a fresh file, fdatasync'd (or O_DIRECT); the file is removed after."""
    path.unlink(missing_ok=True)
    sync = "oflag=direct" if direct else "conv=fdatasync"
    seconds = dd("if=/dev/zero", f"of={path}", f"bs={block}", f"count={count}", sync)
    path.unlink()
    return seconds


def kv_read(backend: FileBackend, cold: bool) -> float:
    """Read every block back and verify its checksum, as a hit does; `cold` drops the file's cached pages first."""
    if cold:
        backend.drop_page_cache()
    start = time.perf_counter()
    for key in range(backend.slots):
        backend.verify(key)
    return time.perf_counter() - start


def dd_read(backend: FileBackend, block: int, count: int, direct: bool, cold: bool) -> float:
    """dd the backend's file to /dev/null; `cold` drops its cached pages first (through the backend, whose read
    mapping would otherwise keep them)."""
    if cold:
        backend.drop_page_cache()
    path = backend.path
    return dd(f"if={path}", "of=/dev/null", f"bs={block}", f"count={count}", *(["iflag=direct"] if direct else []))


def io_pass(workdir: Path, size: int, block: int, direct: bool, flip: bool) -> dict[str, tuple[float, float]]:
    """One measurement of each operation at one block size, buffered or O_DIRECT: {operation: (kvscope s, dd s)}.

    Each side writes its own fresh file; both then read kvscope's file. `flip` makes dd go first.
    """
    kv_file, dd_file = workdir / "kvscope.blocks", workdir / "dd.blocks"
    count = size // block

    def pair(kv: Callable[[], float], other: Callable[[], float]) -> tuple[float, float]:
        if flip:
            other_s = other()
            return kv(), other_s
        return kv(), other()

    measured: dict[str, tuple[float, float]] = {}
    backend: FileBackend | None = None
    try:
        dd_s = dd_write(dd_file, block, count, direct) if flip else None
        kv_s, backend = kv_write(kv_file, size, block, direct, os.urandom(block))
        dd_s = dd_s if flip else dd_write(dd_file, block, count, direct)
        reader = backend
        if direct:
            measured["write O_DIRECT"] = kv_s, dd_s
            measured["read O_DIRECT"] = pair(
                lambda: kv_read(reader, cold=False), lambda: dd_read(reader, block, count, True, cold=False)
            )
        else:
            measured["write + fsync"] = kv_s, dd_s
            measured["read, page cache dropped"] = pair(
                lambda: kv_read(reader, cold=True), lambda: dd_read(reader, block, count, False, cold=True)
            )
            measured["read, from page cache"] = pair(
                lambda: kv_read(reader, cold=False), lambda: dd_read(reader, block, count, False, cold=False)
            )
    finally:
        if backend is not None:
            backend.close()
        kv_file.unlink(missing_ok=True)
        dd_file.unlink(missing_ok=True)
    return measured


def describe_fs(path: Path) -> str:
    """File system type and device of `path` (its longest mount point), and whether the project is on it too."""
    real = os.path.realpath(path)
    fs_type, device, mount_point = "?", "?", ""
    with open("/proc/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            inside = real == fields[1] or real.startswith(fields[1].rstrip("/") + "/")
            if inside and len(fields[1]) > len(mount_point):
                device, mount_point, fs_type = fields[:3]
    same = os.stat(path).st_dev == os.stat(ROOT).st_dev
    return f"{fs_type} on {device}, {'the same' if same else 'NOT the same'} file system as the project ({ROOT})"


def file_bench(size: int, blocks: list[int], repeat: int, directory: str | None) -> None:
    if shutil.which("dd") is None:
        print("\n2. file backend vs dd: skipped, dd is not installed")
        return
    workdir = Path(tempfile.mkdtemp(prefix="kvscope-bench-", dir=directory))
    try:
        print(
            f"\n2. file backend vs dd: {format_size(size)} file, temp dir {workdir}\n"
            f"   ({describe_fs(workdir)}; medians of {repeat}; MB = 10^6 B)"
        )
        runs: dict[tuple[int, str], list[tuple[float, float]]] = {}  # (block, operation) -> [(kvscope s, dd s)]
        direct_error = None
        for round_number in range(repeat):
            for block in blocks:
                for direct in (False, True):
                    if direct and direct_error:
                        continue
                    try:
                        measured = io_pass(workdir, size, block, direct, flip=bool(round_number % 2))
                    except OSError as error:  # e.g. a file system without O_DIRECT (tmpfs)
                        if not direct:
                            raise
                        direct_error = str(error)
                        continue
                    for operation, seconds in measured.items():
                        runs.setdefault((block, operation), []).append(seconds)
        print(f"   {'block':>7}  {'operation':<26} {'kvscope MB/s':>12} {'dd MB/s':>9} {'ratio':>7}")
        for (block, operation), pairs in runs.items():
            moved = size // block * block
            kv_mb_s = moved / median([kv for kv, _ in pairs]) / 1e6
            dd_mb_s = moved / median([other for _, other in pairs]) / 1e6
            ratio = median([other / kv for kv, other in pairs])  # per pass: kvscope MB/s over dd MB/s
            flag = "" if ratio >= FILE_GOAL_RATIO else "  (below goal)"
            print(f"   {format_size(block):>7}  {operation:<26} {kv_mb_s:>12.0f} {dd_mb_s:>9.0f} {ratio:>6.2f}x{flag}")
        if direct_error:
            print(f"   O_DIRECT not measured: {direct_error}")
        print(
            "   kvscope = FileBackend.store (XXH3-64 + pwrite) then fsync, / FileBackend.verify (XXH3 check of the\n"
            "   file's mapped pages; O_DIRECT: pread into an aligned buffer, then the check);\n"
            "   dd = dd if=/dev/zero conv=fdatasync / oflag=direct, and dd of=/dev/null of kvscope's own file.\n"
            "   'page cache dropped' = unmapped and posix_fadvise(DONTNEED) before each read; 'from page cache' reads\n"
            f"   right after that read, so it measures memory (dd: a copy, kvscope: the checksum), not the disk. goal: "
            f"ratio >= "
            f"{FILE_GOAL_RATIO}"
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def format_size(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


# --------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="replays of each request stream (default 5)")
    parser.add_argument("--io-repeat", type=int, default=3, help="passes over the file benchmark (default 3)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 replay, 1 I/O pass, 256 MiB file")
    parser.add_argument("--part", choices=("all", "lookups", "file"), default="all")
    parser.add_argument("--file-size", default="1GiB", help="bytes per file run (default 1GiB)")
    parser.add_argument("--block-sizes", default="1MiB,4MiB", help="comma-separated (default 1MiB,4MiB)")
    parser.add_argument("--dir", help="directory for the temporary files (default: the system temp dir)")
    parser.add_argument(
        "--trace-blocks", type=int, default=20_000, help="LRU tier size for the trace replay, in blocks (20000)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.repeat, args.io_repeat, args.file_size = 1, 1, "256MiB"
    print_run_header()
    started = time.perf_counter()
    ok = True
    if args.part in ("all", "lookups"):
        lru = [*long_output_streams(), trace_stream(args.trace_blocks)]
        streams = lru + [stream.under(policy) for policy in ("mooncake", "lmcache") for stream in lru]
        ok = lookup_bench(streams, args.repeat)
    if args.part in ("all", "file"):
        blocks = [parse_size(text) for text in args.block_sizes.split(",")]
        file_bench(parse_size(args.file_size), blocks, args.io_repeat, args.dir)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
