"""A/B arms served by a real Mooncake store (PyPI mooncake-transfer-engine-non-cuda, needs libibverbs.so.1).

For each `store: mooncake` arm kvscope starts and owns, on 127.0.0.1 with free ports: an HTTP metadata server, a
`mooncake_master`, and a store client in a process of its own (kvscope.tierstore.mooncake_client). The engine
emulator talks to `MooncakeStore` as it talks to the embedded store; every figure of the arm's rounds comes from
what Mooncake did: hits from its existence checks and verified gets, bytes per medium, evictions and occupancy from
its own /metrics, scraped through kvscope's `mooncake` source and mapped onto the KV-tier model.

How the arm's layout becomes Mooncake's configuration:
- `tiers: [dram]`: the client's global segment (`capacity`), no offload.
- `tiers: [dram, ssd]`: SSD offload into a fresh empty directory, capped at the ssd tier's capacity
  (MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES). `placement: demote` offloads an object when DRAM evicts it
  (-offload_on_evict); `placement: replicate` offloads every object after its put (Mooncake's default), which
  loses the objects DRAM evicts before the offload heartbeat reached them.
- `tiers: [dram]` with `attached: [ssd]`: the SSD is mounted (its capacity and allocation are exported) but out of
  the write path: offload on evict with a cap of 0 objects per cycle and force-evict (-offload_cap_ratio=0).

Mooncake's behaviour that decides an arm's hit ratio (see the README's section on real Mooncake arms):
- eviction starts when the segment is above -eviction_high_watermark_ratio (0.9) and removes
  -eviction_ratio (5%) of the objects at once, those whose lease ran out first;
- `batch_is_exist` and gets lease every object they touch for -default_kv_lease_ttl: a leased object cannot be
  evicted. Requests are paced (`request_interval`) so every earlier request's leases have expired when a put
  evicts, which makes a run reproducible; the lease and pacing are recorded with the run;
- a put refused with -200 (no available handle) while eviction catches up is retried with a bounded backoff;
  the retries and the puts still refused are reported, per arm, with every other return code seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes.util
import datetime
import functools
import importlib.metadata
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvscope.exporters.mooncake import MooncakeTargetConfig
from kvscope.exporters.scrape import Scraper, TargetState
from kvscope.processes import (
    HOST,
    OwnedProcess,
    ProcessError,
    free_port,
    listening_sockets,
    owned_directory,
    wait_until,
)
from kvscope.tierstore import scenario as spec
from kvscope.tierstore.misses import ReportedMissLedger
from kvscope.tierstore.store import Key, PrefixRead
from kvscope.tierstore.tier import Tier

# Mooncake's ErrorCode names (mooncake-store/include/types.h) for the codes an arm can meet.
ERROR_NAMES = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -101: "SEGMENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE",
    -600: "INVALID_PARAMS",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -712: "REPLICA_IS_GONE",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
    -1300: "UNABLE_OFFLOAD",
}
# A glog line's head: severity, month, day, local time of day
_GLOG_TIME = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{6}) ")
_EVICTED_COUNT = re.compile(r"\[EVICT-RESULT\] evicted_count=(\d+)")
BUFFER_BYTES = 32 * 1024**2  # the client's registered buffer: reads and puts go through it in chunks of this size
# KV-tier model instrument -> the tier counter it is (kvscope.tierstore.tier.TierCounters)
_COUNTERS = {
    "kv.store.put.ops": "puts",
    "kv.store.put.bytes": "put_bytes",
    "kv.tier.written.bytes": "written_bytes",
    "kv.tier.read.bytes": "read_bytes",
    "kv.tier.hits": "hits",
    "kv.tier.evictions": "evictions",
    "kv.tier.evicted.bytes": "evicted_bytes",
    "kv.tier.allocated.bytes": "allocated_bytes",
    "kv.tier.capacity.bytes": "capacity_bytes",
}


class MooncakeError(ProcessError):
    """A Mooncake arm that cannot run or went wrong; the message says which process and why."""


MOONCAKE_DISTRIBUTION = "mooncake-transfer-engine-non-cuda"


@functools.cache
def mooncake_missing() -> str | None:
    """Why a real Mooncake cannot run here, or None. The import is tried in a subprocess (it loads the C++ store)."""
    if _binary("mooncake_master") is None:
        return f"mooncake_master not found (pip install {MOONCAKE_DISTRIBUTION}==0.3.13.post1)"
    if ctypes.util.find_library("ibverbs") is None:
        return "libibverbs.so.1 not found (apt-get install libibverbs1)"
    probe = subprocess.run(
        [sys.executable, "-c", "from mooncake.store import MooncakeDistributedStore"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if probe.returncode != 0:
        return f"mooncake.store does not import: {(probe.stderr.strip().splitlines() or ['?'])[-1]}"
    return None


@dataclass(frozen=True, slots=True)
class EvictionPass:
    """One BatchEvict of a Mooncake master, from its log: when it began and ended (seconds since the epoch) and how
    many objects it evicted."""

    began: float
    ended: float
    evicted: int


class EvictionLog:
    """A master's eviction passes as its log grows (`-logtostderr`): `[EVICT-TRIGGER]` when one begins,
    `[EVICT-RESULT] evicted_count=N` (absent when it found nothing completed to evict), `[EVICT-DONE]` when it ended.
    Under CPU contention a pass took from milliseconds to seconds here (its candidates are gathered by 16 threads of
    its own); the store refuses puts that do not fit meanwhile. glog's times are local and name no year: a line is of
    the year the master started in, or of the next once its month and day come before the start's (a run across New
    Year's Eve)."""

    def __init__(self, started: datetime.datetime) -> None:
        self._started = started
        self._began: float | None = None  # the pass under way, begun in lines read earlier or now
        self._evicted = 0

    def read(self, lines: Iterable[str]) -> list[EvictionPass]:
        """The passes these lines, the log's next ones, ended."""
        passes: list[EvictionPass] = []
        for line in lines:
            if "[EVICT-" not in line or not (head := _GLOG_TIME.match(line)):
                continue
            at = self._seconds(*map(int, head.groups()))
            if "[EVICT-TRIGGER]" in line:
                self._began, self._evicted = at, 0
            elif self._began is not None and (count := _EVICTED_COUNT.search(line)):
                self._evicted = int(count.group(1))
            elif self._began is not None and "[EVICT-DONE]" in line:
                passes.append(EvictionPass(self._began, at, self._evicted))
                self._began = None
        return passes

    def _seconds(self, month: int, day: int, hour: int, minute: int, second: int, micros: int) -> float:
        started = self._started
        year = started.year + ((month, day) < (started.month, started.day))
        return datetime.datetime(year, month, day, hour, minute, second, micros).timestamp()


def _binary(name: str) -> str | None:
    beside = Path(sys.executable).parent / name  # the virtualenv's scripts, also when it is not activated
    return str(beside) if beside.exists() else shutil.which(name)


def code_name(operation: str, code: str) -> str:
    """`put -200` -> `put -200 NO_AVAILABLE_HANDLE`."""
    try:
        return f"{operation} {code} {ERROR_NAMES.get(int(code), 'UNKNOWN')}"
    except ValueError:
        return f"{operation} {code}"


class MooncakeArm:
    """The processes of one arm, started in order and stopped in reverse: metadata server, master, store client."""

    def __init__(self, arm: spec.ArmSpec, block_bytes: int, system: str) -> None:
        self.arm, self.settings, self.block_bytes, self.system = arm, arm.mooncake_settings, block_bytes, system
        self.ssd = (arm.tiers[1:] + arm.attached)[:1]
        self.ssd_in_path = len(arm.tiers) > 1
        self.processes: list[OwnedProcess] = []
        self.ports = {role: free_port() for role in ("metadata", "rpc", "metrics", "client_http")}
        self.workdir = owned_directory("kvscope-mooncake-")
        self._answers: queue.Queue[str | None] = queue.Queue()
        self.client: OwnedProcess | None = None
        self.listening: dict[str, list[str]] = {}  # each process's listening sockets once the arm was ready
        self.peak_rss: dict[str, int | None] = {}  # each process's peak resident memory, read before it stops
        self._master: OwnedProcess | None = None
        self._evictions: EvictionLog | None = None  # the master's log, followed from its start

    # --------------------------------------------------------------------------------------------- processes

    def master_argv(self) -> list[str]:
        s = self.settings
        argv = [
            _binary("mooncake_master") or "mooncake_master",
            f"-rpc_address={HOST}",
            f"-rpc_port={self.ports['rpc']}",
            f"-metrics_host={HOST}",
            f"-metrics_port={self.ports['metrics']}",
            "-enable_http_metadata_server=false",  # its built-in one binds every interface; ours binds 127.0.0.1
            f"-default_kv_lease_ttl={round(s.lease_ttl * 1000)}",
            f"-eviction_high_watermark_ratio={s.eviction_high_watermark}",
            f"-eviction_ratio={s.eviction_ratio}",
            "-logtostderr=true",  # into the arm's log, not files in /tmp
        ]
        if self.ssd:
            argv.append("-enable_offload=true")
            if not self.ssd_in_path:  # attached: mounted, never offloaded to
                argv += ["-offload_on_evict=true", "-offload_cap_ratio=0", "-offload_force_evict=true"]
            elif self.arm.placement == "demote":
                argv.append("-offload_on_evict=true")
        return argv

    def client_env(self) -> dict[str, str]:
        """The variables kvscope sets for the client (inherited MC_* and MOONCAKE_* ones are dropped)."""
        env = {"MC_TCP_BIND_ADDRESS": HOST, "MC_STORE_CLIENT_METRIC": "1"}
        if self.ssd:
            env |= {
                "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": str(self.workdir / "ssd"),
                "MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES": str(self.ssd[0].capacity),
                "MOONCAKE_OFFLOAD_LOCAL_BUFFER_SIZE_BYTES": str(self.settings.offload_buffer),
                "MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS": str(self.settings.offload_heartbeat_s),
                "MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES": str(self.settings.offload_bucket),
            }
        return env

    def start(self) -> None:
        timeout = self.settings.start_timeout
        metadata = self._spawn(
            "mooncake metadata server",
            [_binary("mooncake_http_metadata_server") or "mooncake_http_metadata_server", "--host", HOST,
             "--port", str(self.ports["metadata"]), "--log-level", "WARNING"],
        )  # fmt: skip
        metadata.wait_listening(self.ports["metadata"], timeout)
        master = self._master = self._spawn("mooncake_master", self.master_argv())
        self._evictions = EvictionLog(master.started)
        # its metrics listen first: a master whose RPC port is taken serves /metrics for a moment before it exits
        master.wait_listening(self.ports["rpc"], timeout)
        master.wait_listening(self.ports["metrics"], timeout)
        wait_until(lambda: _http_ok(self.master_url), "mooncake_master's /metrics", timeout, [master])
        if self.ssd:
            (self.workdir / "ssd").mkdir()  # always empty: a reused directory would be re-scanned
        config = {
            "host": HOST,
            "metadata": f"http://{HOST}:{self.ports['metadata']}/metadata",
            "master": f"{HOST}:{self.ports['rpc']}",
            "segment_bytes": self.arm.tiers[0].capacity,
            "local_buffer_bytes": self.settings.local_buffer,
            "ssd_path": str(self.workdir / "ssd") if self.ssd else None,
            "http_port": self.ports["client_http"],
            "block_bytes": self.block_bytes,
            "max_blocks": max(1, BUFFER_BYTES // self.block_bytes),
            "retry_budget_s": self.settings.put_retry_budget,
        }
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MC_", "MOONCAKE_"))} | self.client_env()
        self.client = self._spawn(
            "mooncake store client",
            [sys.executable, "-m", "kvscope.tierstore.mooncake_client", json.dumps(config)],
            env=env,
            pipe=True,
        )
        threading.Thread(target=self._read_answers, args=(self.client,), daemon=True).start()
        ready = self._answer(timeout)
        if ready.get("setup") != 0 or ready.get("register") != 0:
            raise MooncakeError(f"the store client's setup failed: {ready}\n{self.client.tail()}")
        self.client.wait_listening(self.ports["client_http"], timeout)
        wait_until(lambda: _http_ok(self.client_url), "the store client's /metrics", timeout, [self.client, master])
        self.listening = {process.name: [str(s) for s in listening_sockets(process.pid)] for process in self.processes}

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None, pipe: bool = False):
        log = self.workdir / f"{len(self.processes)}-{argv[0].rsplit('/', 1)[-1]}.log"
        process = OwnedProcess(name, argv, log, env=env, cwd=self.workdir, pipe_stdin=pipe, pipe_stdout=pipe)
        self.processes.append(process)
        return process

    def request(self, command: dict, timeout_s: float | None = None) -> dict:
        """One command to the store client and its answer; MooncakeError if the client died or went silent."""
        client = self.client
        if client is None or not client.alive():
            raise MooncakeError(f"the store client is not running\n{client.tail() if client else ''}")
        try:
            client.popen.stdin.write((json.dumps(command) + "\n").encode())  # type: ignore[union-attr]
            client.popen.stdin.flush()  # type: ignore[union-attr]
        except OSError as error:
            raise MooncakeError(f"the store client stopped reading: {error}\n{client.tail()}") from None
        return self._answer(timeout_s or self.settings.put_retry_budget + 60)

    def _read_answers(self, process: OwnedProcess) -> None:
        for line in process.popen.stdout:  # type: ignore[union-attr]
            self._answers.put(line.decode())
        self._answers.put(None)

    def _answer(self, timeout_s: float) -> dict:
        client = self.client
        assert client is not None
        try:
            line = self._answers.get(timeout=timeout_s)
        except queue.Empty:
            raise MooncakeError(f"the store client gave no answer within {timeout_s:g} s\n{client.tail()}") from None
        if line is None:
            client.popen.wait(5)
            raise MooncakeError(f"the store client exited ({client.popen.returncode})\n{client.tail()}")
        return json.loads(line)

    def close(self) -> None:
        """Client first (it unmounts its segment from the master), then the master, then the metadata server;
        then the arm's directory (SSD files, logs) goes."""
        self.peak_rss = {process.name: process.peak_rss_bytes() for process in self.processes}
        if self.client is not None and self.client.alive():
            with contextlib.suppress(MooncakeError):
                self.request({"op": "quit"}, timeout_s=15)
        for process in reversed(self.processes):
            process.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    # --------------------------------------------------------------------------------------------- observing

    @property
    def master_url(self) -> str:
        return f"http://{HOST}:{self.ports['metrics']}/metrics"

    @property
    def client_url(self) -> str:
        return f"http://{HOST}:{self.ports['client_http']}/metrics"

    def targets(self) -> list[MooncakeTargetConfig]:
        """The exporter targets that observe this arm, labelled with its store system."""
        labels = {"system": self.system}
        return [
            MooncakeTargetConfig(name=f"{role}-{_safe(self.system)}", source="mooncake", url=url, labels=labels)
            for role, url in (("mooncake-master", self.master_url), ("mooncake-client", self.client_url))
        ]

    def new_eviction_passes(self) -> list[EvictionPass]:
        """The master's eviction passes that ended since the last call, from what its log gained meanwhile."""
        if self._master is None or self._evictions is None:  # not started
            return []
        return self._evictions.read(self._master.new_log_lines())

    def describe(self) -> dict:
        """What a run records of the arm: the settings, the master's flags, the client's environment, every
        process's listening sockets as the kernel showed them once the arm was ready, and (once the arm has
        stopped) each process's peak resident memory."""
        return {
            "version": importlib.metadata.version(MOONCAKE_DISTRIBUTION),
            "settings": self.settings.model_dump(mode="json"),
            "master_argv": self.master_argv()[1:],
            "client_env": {k: v.replace(str(self.workdir), "<arm dir>") for k, v in self.client_env().items()},
            "listening": self.listening,
            "peak_rss_bytes": self.peak_rss,
        }


class Pacer:
    """Requests at least `interval` seconds apart, start to start: the lease a request's lookups grant has run out
    when the next ones evict. `late_s` is the most a request started after its slot (a server slower than the
    pacing: the run's timing then is the server's, not the scenario's). `starts` are the requests' start times, in
    seconds from the first one's: evidence of when the real arm sent what (the rows' `request_start_s`)."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.late_s = 0.0
        self.starts: list[float] = []
        self.first_wall: float | None = None  # when the first request started, in seconds since the epoch
        self._next_at: float | None = None
        self._first_at: float | None = None

    def wait(self) -> None:
        now = time.monotonic()
        if self._next_at is not None:
            if self._next_at > now:
                time.sleep(self._next_at - now)
                now = self._next_at
            else:
                self.late_s = max(self.late_s, now - self._next_at)
        self._next_at = now + self.interval
        if self._first_at is None:
            self._first_at, self.first_wall = now, time.time()
        self.starts.append(now - self._first_at)

    def take_late_s(self) -> float:
        """The most a request started late since the last call."""
        late, self.late_s = self.late_s, 0.0
        return late


class MooncakeStore:
    """The engine emulator's store for a Mooncake arm: reads and puts go to the real client, counters come from
    Mooncake's metrics. Requests are paced by `request_interval` (measured from one request's start to the next)."""

    tiers: list = []  # noqa: RUF012 - no embedded tiers: the media are Mooncake's
    attached: list = []  # noqa: RUF012

    def __init__(self, arm: spec.ArmSpec, block_bytes: int, system: str) -> None:
        self.block_bytes = block_bytes
        self.media = [tier.name for tier in arm.tiers + arm.attached]
        self.write_path = [tier.name for tier in arm.tiers]
        self.misses: ReportedMissLedger | None = None  # set when an engine asks what explains its misses
        self.codes: Counter[str] = Counter()
        self.put_retries = self.not_admitted = 0
        self.pacer = Pacer(arm.mooncake_settings.request_interval)
        self.processes = MooncakeArm(arm, block_bytes, system)
        self._loop = asyncio.new_event_loop()
        self._scraper: Scraper | None = None
        try:
            self.processes.start()
            self._scraper = Scraper(list(self.processes.targets()))
        except BaseException:
            self.close()
            raise
        self.observed: list[TargetState] = []

    def at(self, seconds: float) -> None:
        """Nothing to move: the real store runs on real time (the requests are paced instead)."""

    def read_prefix(self, keys: Sequence[Key], start: int = 0, stop: int | None = None) -> PrefixRead:
        self.pacer.wait()
        end = len(keys) if stop is None or stop > len(keys) else stop
        if end <= start:
            return PrefixRead(0, [], 0.0)
        answer = self.processes.request({"op": "read", "keys": [object_key(k) for k in keys[start:end]]})
        self._count(answer)
        if self.misses is not None:
            held = [True] * (end - start)
            for index in answer["absent"]:
                held[index] = False
            self.misses.checked(start, held)
        return PrefixRead(answer["blocks"], [], answer["seconds"])

    def put(self, keys: Sequence[Key], nbytes: int) -> int:
        if not keys:
            return 0
        if nbytes != self.block_bytes:
            raise MooncakeError(f"the arm stores blocks of {self.block_bytes:,} B, not {nbytes:,} B")
        answer = self.processes.request({"op": "put", "keys": [object_key(k) for k in keys]})
        self._count(answer)
        self.put_retries += answer["retries"]
        self.not_admitted += answer["not_admitted"]
        if self.misses is not None:
            self.misses.put(keys, answer["refused"])
        return answer["stored"] * nbytes

    def exist(self, keys: Sequence[str]) -> list[bool]:
        """Which of `keys` the store holds now: a `batch_is_exist` alone (it leases what it finds, as every
        existence check does)."""
        if not keys:
            return []
        answer = self.processes.request({"op": "exist", "keys": list(keys)})
        self._count(answer)
        return answer["held"]

    def release(self, keys: Sequence[Key]) -> None:
        """Nothing to do: Mooncake's leases run out by themselves."""

    def load_seconds(self, read: PrefixRead) -> float:
        return read.seconds

    def miss_ledger(self, gpu_cache: Tier | None, block_tokens: int) -> ReportedMissLedger:
        """Misses explained from Mooncake's answers (kvscope.tierstore.misses.ReportedMissLedger); an evicted block
        is credited to the last tier of the write path, as Mooncake does not say which medium dropped it."""
        self.misses = ReportedMissLedger(gpu_cache, self.write_path[-1], block_tokens)
        return self.misses

    def counters(self) -> dict[str, dict[str, int]]:
        """Scrape the master and the client now: the arm's media counters by tier, as the KV-tier model maps
        Mooncake's metrics (kvscope.exporters.mappings/mooncake.yaml). The scrape is kept in `observed`."""
        assert self._scraper is not None
        for process in self.processes.processes:  # a dead one's ports are anyone's: end the run with its log
            process.check_alive()
        states = self._loop.run_until_complete(self._scraper.scrape_all())
        down = [state.last_error for state in states if not state.up]
        if down:
            raise MooncakeError(f"scraping the arm's Mooncake failed: {'; '.join(map(str, down))}")
        self.observed = states
        counters = {tier: dict.fromkeys(_COUNTERS.values(), 0) for tier in self.media}
        for state in states:
            for sample in state.normalized:
                field, tier = _COUNTERS.get(sample.name), sample.label_map.get("tier")
                if field and tier in counters:
                    counters[tier][field] += int(sample.value)
        return counters

    def settled_counters(self, timeout_s: float = 30.0) -> dict[str, dict[str, int]]:
        """Counters once background work (offload, eviction) has stopped: two scrapes one offload heartbeat apart
        that agree, or the last one after `timeout_s`."""
        gap = 1.1 * self.processes.settings.offload_heartbeat_s if self.processes.ssd else 0.2
        deadline = time.monotonic() + timeout_s
        previous = self.counters()
        while time.monotonic() < deadline:
            time.sleep(gap)
            current = self.counters()
            if current == previous:
                return current
            previous = current
        return previous

    def report(self) -> dict:
        """What the arm's real store did besides its counters: return codes, retries, processes and settings."""
        return {
            "kind": "mooncake",
            "codes": dict(sorted(self.codes.items())),
            "put_retries": self.put_retries,
            "not_admitted": self.not_admitted,
            **self.processes.describe(),
        }

    def close(self) -> None:
        if self._scraper is not None:
            self._loop.run_until_complete(self._scraper.close())
        self._loop.close()
        self.processes.close()

    def _count(self, answer: dict) -> None:
        for label, count in answer["codes"].items():
            operation, code = label.split(" ", 1)
            self.codes[code_name(operation, code)] += count


def connector_key_prefix(model: str) -> str:
    """What vLLM's Mooncake connector puts before a block's hash on one rank (PoolKey.to_string: the model's name,
    the last part of its path, then the namespace, ranks and KV group)."""
    return f"{model}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@"


CONNECTOR_KEY_PREFIX = connector_key_prefix("kvscope")
"""The prefix of the engine emulator's vLLM block hashes (`keys: vllm`): a model named kvscope."""


def object_key(key: Key) -> str:
    """Mooncake object keys are strings: an integer chain key as 16 hex digits; a vLLM block hash (`keys: vllm`)
    as vLLM's Mooncake connector names it, CONNECTOR_KEY_PREFIX and the hash in hex."""
    if isinstance(key, int):
        return f"{key & 0xFFFF_FFFF_FFFF_FFFF:016x}"
    if isinstance(key, bytes):
        return CONNECTOR_KEY_PREFIX + key.hex()
    return str(key)


def _safe(name: str) -> str:
    """A target name (letters, digits, _.:-) from a system name such as `scenario/arm`."""
    return "".join(c if c.isalnum() or c in "_.:-" else "-" for c in name)


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False
