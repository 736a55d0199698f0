"""MooncakeCollector against a real Mooncake (PyPI mooncake-transfer-engine-non-cuda, needs libibverbs.so.1).

Each test starts `mooncake_master` and one embedded store client (MooncakeDistributedStore in a subprocess, so a
crash in the C++ store cannot take pytest down) on 127.0.0.1 with free ports, puts and gets known bytes, scrapes
the master's and the client's /metrics through MooncakeCollector, normalizes them with mappings/mooncake.yaml
and checks that the before->after deltas are what the test did.

The client subprocess is this file run as a script: it reads one JSON command per line on stdin and answers one
JSON line on stdout, so the test scrapes between operations while the client (and its metrics server) lives on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvscope.exporters.mooncake import MooncakeCollector
from kvscope.exporters.normalizer import mapping_for
from kvscope.processes import free_port
from kvscope.samples import Sample
from kvscope.tierstore.mooncake import mooncake_missing

MiB = 1 << 20
HOST = "127.0.0.1"
VENV_BIN = Path(sys.executable).parent
OBJECT = 2 * MiB  # SSD test object size


# ---------------------------------------------------------------- helpers
def _wait_for(what: str, predicate, timeout: float, interval: float = 0.1):
    """Poll `predicate` until it returns something truthy; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


Model = dict[tuple[str, str], float]


class Scrape:
    """One scrape of the master and the client: raw samples per role and the normalized model summed over both."""

    def __init__(self, raw: dict[str, list[Sample]]) -> None:
        self.raw = raw
        self.model: Model = {}
        mapping = mapping_for("mooncake")
        for samples in raw.values():
            for sample in mapping.apply(samples, {"system": "mooncake"}):
                labels = sample.label_map
                assert labels["system"] == "mooncake", sample
                key = (sample.name, labels["tier"])
                self.model[key] = self.model.get(key, 0.0) + sample.value

    def value(self, role: str, name: str) -> float | None:
        found = [s.value for s in self.raw[role] if s.name == name]
        return sum(found) if found else None

    def delta(self, before: Scrape) -> Model:
        """Counter/gauge deltas; a series absent before (Mooncake creates many on first use) started at 0."""
        keys = self.model.keys() | before.model.keys()
        return {key: self.model.get(key, 0.0) - before.model.get(key, 0.0) for key in keys}


class Cluster:
    """A real mooncake_master and one embedded store client (subprocess), all on 127.0.0.1."""

    def __init__(self, workdir: Path, *, segment: int, buffer: int, ssd: bool) -> None:
        self.workdir = workdir
        self.ssd = ssd
        self.processes: list[subprocess.Popen] = []
        self.rpc_port, self.metrics_port, self.metadata_port, self.client_port = (free_port() for _ in range(4))
        self.master_url = f"http://{HOST}:{self.metrics_port}/metrics"
        self.client_url = f"http://{HOST}:{self.client_port}/metrics"
        self.segment = segment
        self.buffer = buffer
        self._lines: queue.Queue[str | None] = queue.Queue()

    # -- processes
    def start(self) -> None:
        master = [
            shutil.which("mooncake_master", path=str(VENV_BIN)) or "mooncake_master",
            f"-rpc_address={HOST}",
            f"-rpc_port={self.rpc_port}",
            f"-metrics_host={HOST}",
            f"-metrics_port={self.metrics_port}",
            "-enable_http_metadata_server=true",
            f"-http_metadata_server_host={HOST}",
            f"-http_metadata_server_port={self.metadata_port}",
        ]
        if self.ssd:
            # PROVENANCE.md (ssd_offload): offload on, and a 1 s kv lease so offloaded objects become evictable.
            master += ["-enable_offload=true", "-default_kv_lease_ttl=1000"]
        self._spawn(master, "master.log")
        _wait_for("the master's /metrics", lambda: _http_ok(self.master_url), 30, 0.05)

        env = {**os.environ, "MC_TCP_BIND_ADDRESS": HOST, "MC_STORE_CLIENT_METRIC": "1"}
        config = {
            "metadata": f"http://{HOST}:{self.metadata_port}/metadata",
            "master": f"{HOST}:{self.rpc_port}",
            "segment": self.segment,
            "buffer": self.buffer,
            "http_port": self.client_port,
        }
        if self.ssd:
            ssd_dir = self.workdir / "ssd"
            ssd_dir.mkdir()
            config["ssd_path"] = str(ssd_dir)
            env |= {
                "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": str(ssd_dir),
                # offload every second, in buckets of two objects (the default 256 MiB bucket would keep
                # everything in the ungrouped pool: PROVENANCE.md)
                "MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS": "1",
                "MOONCAKE_OFFLOAD_BUCKET_SIZE_LIMIT_BYTES": str(2 * OBJECT),
            }
        client = self._spawn(
            [sys.executable, __file__, json.dumps(config)], "client.log", env=env, stdin=subprocess.PIPE
        )
        threading.Thread(target=self._read, args=(client,), daemon=True).start()
        self.client = client
        assert self._receive(60) == {"setup": 0}, f"store client setup failed\n{_tail(self.workdir / 'client.log')}"
        _wait_for("the client's /metrics", lambda: _http_ok(self.client_url), 30, 0.05)

    def _spawn(self, argv: list, log: str, **kwargs) -> subprocess.Popen:
        handle = open(self.workdir / log, "wb")  # noqa: SIM115 - closed with the process in close()
        process = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE if "stdin" in kwargs else handle,
            stderr=handle,
            cwd=self.workdir,
            start_new_session=True,
            **kwargs,
        )
        process.log = handle  # type: ignore[attr-defined]
        self.processes.append(process)
        return process

    def _read(self, process: subprocess.Popen) -> None:
        for line in process.stdout:  # type: ignore[union-attr]
            self._lines.put(line.decode())
        self._lines.put(None)

    def _receive(self, timeout: float) -> dict:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"store client silent for {timeout} s\n{_tail(self.workdir / 'client.log')}") from None
        if line is None:
            raise AssertionError(f"store client exited\n{_tail(self.workdir / 'client.log')}")
        return json.loads(line)

    def do(self, op: str, timeout: float = 60, **arguments):
        """One store operation in the client; its result."""
        self.client.stdin.write((json.dumps({"op": op, **arguments}) + "\n").encode())  # type: ignore[union-attr]
        self.client.stdin.flush()  # type: ignore[union-attr]
        answer = self._receive(timeout)
        assert answer.get("op") == op, answer
        return answer["result"]

    def close(self) -> None:
        if getattr(self, "client", None) is not None and self.client.poll() is None:
            with contextlib.suppress(AssertionError, OSError, ValueError):  # it is stopped below anyway
                self.do("quit", timeout=10)
        for process in reversed(self.processes):
            if process.poll() is None:
                process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
            process.log.close()  # type: ignore[attr-defined]

    # -- metrics
    def scrape(self) -> Scrape:
        async def both() -> dict[str, list[Sample]]:
            raw = {}
            for role, url in (("master", self.master_url), ("client", self.client_url)):
                collector = MooncakeCollector(
                    MooncakeCollector.Config(name=f"mooncake-{role}", source="mooncake", url=url)
                )
                try:
                    raw[role] = await collector.collect()
                finally:
                    await collector.close()
            return raw

        return Scrape(asyncio.run(both()))

    def settled(self, gap: float, timeout: float) -> Scrape:
        """A scrape equal to the one `gap` seconds before it: background work (offload, eviction) has stopped."""
        previous = self.scrape()

        def same():
            nonlocal previous
            time.sleep(gap)
            current = self.scrape()
            stable = current.model == previous.model
            previous = current
            return current if stable else None

        return _wait_for("the counters to settle", same, timeout, 0)


@pytest.fixture
def mooncake(require_real, tmp_path):
    """`mooncake(segment=..., buffer=..., ssd=...)` starts a master and a client; both are stopped afterwards."""
    reason = mooncake_missing()
    require_real(reason is None, reason or "")
    clusters: list[Cluster] = []

    def start(*, segment: int, buffer: int, ssd: bool = False) -> Cluster:
        cluster = Cluster(tmp_path, segment=segment, buffer=buffer, ssd=ssd)
        clusters.append(cluster)
        cluster.start()
        return cluster

    yield start
    for cluster in clusters:
        cluster.close()


# ---------------------------------------------------------------- tests
def test_dram_puts_and_gets_reach_the_model(mooncake):
    """Puts and gets of known sizes, single and batched: the normalized deltas are exactly what was done."""
    cluster = mooncake(segment=64 * MiB, buffer=32 * MiB)
    before = cluster.scrape()
    assert before.model[("kv.tier.capacity.bytes", "dram")] == 64 * MiB  # the client's segment is mounted
    # Quirk: the client creates its operation series on first use; before any put they are absent.
    assert ("kv.store.put.bytes", "dram") not in before.model

    singles = {"a": 1 * MiB, "b": 2 * MiB, "c": 4 * MiB}
    batch = [f"d{i}" for i in range(4)]
    for key, size in singles.items():
        assert cluster.do("put", key=key, size=size) == 0
    assert cluster.do("put_batch", keys=batch, size=1 * MiB) == 0
    for key, size in singles.items():
        assert cluster.do("get", key=key, size=size) == {"len": size, "ok": True}
    assert cluster.do("get_batch", keys=batch, size=1 * MiB) == {"len": 4 * MiB, "ok": True}
    assert cluster.do("get", key="no_such_key")["len"] == 0  # a miss: no get, no hit
    after = cluster.scrape()

    stored = sum(singles.values()) + len(batch) * MiB  # 11 MiB
    delta = after.delta(before)
    assert delta == {
        ("kv.store.put.bytes", "dram"): stored,
        ("kv.store.put.ops", "dram"): len(singles) + 1,  # API calls: the batch is one
        ("kv.store.get.bytes", "dram"): stored,
        ("kv.store.get.ops", "dram"): len(singles) + 1,
        ("kv.tier.written.bytes", "dram"): stored,  # one replica, local memcpy into the segment
        ("kv.tier.read.bytes", "dram"): stored,
        ("kv.tier.allocated.bytes", "dram"): stored,
        ("kv.tier.capacity.bytes", "dram"): 0,
        ("kv.tier.hits", "dram"): len(singles) + len(batch),  # lookups: one per key
        ("kv.tier.hits", "ssd"): 0,
        ("kv.tier.evictions", "dram"): 0,
        ("kv.tier.evicted.bytes", "dram"): 0,
        ("kv.tier.allocated.bytes", "ssd"): 0,
        ("kv.tier.capacity.bytes", "ssd"): 0,
        ("kv.tier.allocated.bytes", "nof"): 0,
        ("kv.tier.capacity.bytes", "nof"): 0,
    }
    # Raw samples keep Mooncake's wire names (prometheus_client would have said mem_cache_hit_nums__total).
    assert after.value("master", "mem_cache_hit_nums_") == len(singles) + len(batch)
    assert after.value("client", "mooncake_transfer_read_bytes") == stored


def test_ssd_offload_bytes_reach_the_ssd_tier(mooncake):
    """With SSD offload on, objects are written to local disk, DRAM evicts, and gets are served from the disk."""
    cluster = mooncake(segment=8 * OBJECT, buffer=4 * OBJECT, ssd=True)
    _wait_for(
        "the local-disk segment to register",
        lambda: cluster.scrape().model.get(("kv.tier.capacity.bytes", "ssd"), 0) > 0,
        30,
        0.2,
    )
    before = cluster.scrape()

    def put_all(keys: list[str], timeout: float) -> None:
        # A put can fail while DRAM is full and eviction has not run yet (-200); retry until it lands.
        for key in keys:
            _wait_for(f"put {key}", lambda key=key: cluster.do("put", key=key, size=OBJECT) == 0, timeout, 0.2)

    first = [f"blk_{i:02d}" for i in range(6)]  # 75% of DRAM: no eviction yet
    put_all(first, 20)
    _wait_for(
        "the first objects to be offloaded",
        lambda: cluster.scrape().delta(before)[("kv.tier.allocated.bytes", "ssd")] >= len(first) * OBJECT,
        30,
        0.2,
    )
    second = [f"blk_{i:02d}" for i in range(6, 12)]  # 150% of DRAM in all: DRAM must evict
    put_all(second, 30)
    _wait_for(
        "a DRAM eviction",
        lambda: cluster.scrape().model.get(("kv.tier.evictions", "dram"), 0) > 0,
        30,
        0.2,
    )
    settled = cluster.settled(gap=1.5, timeout=30)
    results = [cluster.do("get", key=key, size=OBJECT) for key in first + second]
    after = cluster.settled(gap=1.5, timeout=30)

    served = [r for r in results if r["len"]]
    assert all(r["ok"] for r in served), results
    assert len(served) >= len(first), results  # offloaded before any eviction: on disk if not in DRAM
    d = after.delta(before)
    got = len(served) * OBJECT
    offloaded = d[("kv.tier.written.bytes", "ssd")]
    # Logical work is exactly what the test did.
    assert d[("kv.store.put.bytes", "dram")] == 12 * OBJECT
    assert d[("kv.store.put.ops", "dram")] == 12
    assert d[("kv.tier.written.bytes", "dram")] == 12 * OBJECT
    assert d[("kv.store.get.bytes", "dram")] == got
    assert d[("kv.store.get.ops", "dram")] == len(served)
    # Bytes reached the SSD medium: written by the offload worker, allocated on the master, whole objects.
    assert offloaded >= len(first) * OBJECT
    assert offloaded % OBJECT == 0
    assert d[("kv.tier.allocated.bytes", "ssd")] == offloaded
    assert sum(1 for f in (cluster.workdir / "ssd").rglob("*") if f.is_file()) > 0
    # DRAM evicted whole objects, and what is left in DRAM is what was put minus what was evicted.
    assert d[("kv.tier.evictions", "dram")] > 0
    assert d[("kv.tier.evicted.bytes", "dram")] == d[("kv.tier.evictions", "dram")] * OBJECT
    assert d[("kv.tier.allocated.bytes", "dram")] == 12 * OBJECT - d[("kv.tier.evicted.bytes", "dram")]
    # Every get was served by exactly one medium; some came from the SSD.
    ssd_read = d[("kv.tier.read.bytes", "ssd")]
    assert ssd_read > 0
    assert d[("kv.tier.read.bytes", "dram")] + ssd_read == got
    assert d[("kv.tier.hits", "ssd")] == ssd_read / OBJECT
    # Quirk: the offload worker's own reads count as DRAM hits on the master, one per object offloaded.
    assert d[("kv.tier.hits", "dram")] == d[("kv.tier.read.bytes", "dram")] / OBJECT + offloaded / OBJECT
    # (before any get, the DRAM hits were the offload worker's alone)
    before_gets = settled.delta(before)
    assert before_gets[("kv.tier.hits", "dram")] == before_gets[("kv.tier.written.bytes", "ssd")] / OBJECT


# ---------------------------------------------------------------- the client subprocess (this file as a script)
def _client_main(config: dict) -> None:
    """Runs in the subprocess: set the store up, then serve commands from stdin until EOF."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    code = store.setup(
        HOST,
        config["metadata"],
        config["segment"],
        config["buffer"],
        "tcp",
        "",
        config["master"],
        None,
        config.get("ssd_path") is not None,
        config.get("ssd_path") or "",
        "default",
        True,
        config["http_port"],
    )
    _answer({"setup": code})
    if code != 0:
        return

    def payload(key: str, size: int) -> bytes:
        return (key.encode() * (size // max(len(key), 1) + 1))[:size]

    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "put":
            result = store.put(command["key"], payload(command["key"], command["size"]))
        elif op == "put_batch":
            keys = command["keys"]
            result = store.put_batch(keys, [payload(key, command["size"]) for key in keys])
        elif op == "get":
            data = store.get(command["key"])
            expected = payload(command["key"], command["size"]) if command.get("size") else b""
            result = {"len": len(data), "ok": data == expected}
        elif op == "get_batch":
            values = store.get_batch(command["keys"])
            result = {
                "len": sum(len(v) for v in values),
                "ok": all(v == payload(k, command["size"]) for k, v in zip(command["keys"], values, strict=True)),
            }
        elif op == "quit":
            _answer({"bye": True})
            break
        else:
            result = f"unknown op {op}"
        _answer({"op": op, "result": result})
    store.close()


def _answer(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    _client_main(json.loads(sys.argv[1]))
    sys.exit(0)
