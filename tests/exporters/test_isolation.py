"""One stuck target never blinds the rest: a read that never returns holds one thread of its own target.

The stuck reads here are real ones: a FIFO nobody writes to (open() waits for a writer) read through
`Collector.blocking`, and an SPDK target whose RPC server never accepts (its listen queue full: the client's
connect() waits, with no timeout). Both sit in the kernel until the test lets them go.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from kvscope.exporters.base import Collector, TargetConfig
from kvscope.exporters.config import parse_config
from kvscope.exporters.scrape import Scraper
from kvscope.processes import free_port

SYSFS = Path(__file__).resolve().parent.parent / "fixtures" / "rdma" / "sysfs"
KVSCOPE = Path(sys.executable).parent / "kvscope"


class FifoReader(Collector):  # no `source` of its own: not registered as a source
    """Reads a FIFO through the blocking helper: open() returns only when something opens it for writing."""

    def __init__(self, config, fifo: Path) -> None:
        super().__init__(config)
        self.fifo = fifo

    async def collect(self):
        await self.blocking(self.fifo.read_bytes, what=str(self.fifo))
        return []


@contextlib.contextmanager
def wedged_rpc_server(path: Path):
    """A Unix socket whose listen queue is full (backlog 0, one connection never accepted): a client's connect()
    blocks until the listener closes, as on a target whose RPC thread is wedged."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(0)
    filler = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    filler.connect(str(path))
    try:
        yield path
    finally:
        filler.close()
        listener.close()  # a connect() still waiting now fails: the thread it held ends


def release(fifo: Path, seconds: float = 1.0) -> None:
    """Open the FIFO for writing and close it again, for `seconds`: every open() waiting on it returns (and reads
    end of file)."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError as error:
            assert error.errno == errno.ENXIO  # no reader waiting at this instant
        time.sleep(0.01)


def test_a_stuck_read_holds_one_thread_and_the_healthy_target_stays_up_every_round(tmp_path):
    fifo = tmp_path / "rate"
    os.mkfifo(fifo)
    targets = parse_config(
        {
            "targets": [
                {"name": "nics", "source": "rdma", "sysfs": str(SYSFS), "host": "node-a", "timeout_s": 1.0},
                {"name": "wedged", "source": "rdma", "sysfs": str(tmp_path), "timeout_s": 0.2},
            ]
        }
    ).targets
    scraper = Scraper(targets)
    stuck = scraper._collectors["wedged"] = FifoReader(targets[1], fifo)
    rounds = 12  # more than the default executor's min(32, CPUs + 4) threads on a small machine

    async def scrape_rounds() -> list[tuple[dict, int]]:
        seen = []
        try:
            for _ in range(rounds):
                states = await scraper.scrape_all()
                seen.append(
                    ({s.config.name: (s.up, s.last_error, s.duration_s) for s in states}, threading.active_count())
                )
            return seen
        finally:
            release(fifo)  # before the loop ends: code that joins its threads at exit would wait for this one
            await scraper.close()

    seen = asyncio.run(scrape_rounds())
    assert [states["nics"][0] for states, _ in seen] == [True] * rounds
    first, *later = [states["wedged"] for states, _ in seen]
    assert first[:2] == (False, "wedged: no answer within 0.2 s")
    for up, error, duration in later:  # the read is still stuck: each later scrape fails at once, starting none
        assert not up and re.fullmatch(rf"wedged: {re.escape(str(fifo))} still blocked after \d+\.\d s; .*", error)
        assert duration < 0.1
    threads = [count for _, count in seen]
    assert max(threads) <= threads[0] + 1, f"threads per round: {threads}"
    assert scraper.states["wedged"].read_errors == {"timeout": rounds}
    assert scraper.states["wedged"].failing.keys() == {(str(fifo), "timeout")}
    assert "timeout" not in scraper.states["nics"].read_errors
    assert stuck._blocking.done.wait(5), "the released read ends and its thread with it"


def test_a_targets_calls_run_on_one_thread_of_its_own_kept_until_its_collector_is_gone():
    collector = FifoReader(TargetConfig(name="own", source="rdma"), Path(os.devnull))

    async def calls(collector: Collector) -> list[str]:
        return [await collector.blocking(lambda: threading.current_thread().name) for _ in range(3)]

    assert asyncio.run(calls(collector)) == ["kvscope own"] * 3
    [thread] = [thread for thread in threading.enumerate() if thread.name == "kvscope own"]
    del collector
    thread.join(5)
    assert not thread.is_alive(), "the thread ends with its collector"


def test_scrape_once_returns_while_a_read_is_stuck_and_reports_the_rest(tmp_path):
    """A FIFO in place of a port's rate (not read: FIFOs are refused) and an SPDK target whose connect() never
    returns: `--once` prints the NICs, says the SPDK target is down, and exits."""
    sysfs = tmp_path / "sysfs"
    shutil.copytree(SYSFS, sysfs, symlinks=True)
    rate = sysfs / "class" / "infiniband" / "mlx5_0" / "ports" / "1" / "rate"
    rate.unlink()
    os.mkfifo(rate)
    with wedged_rpc_server(tmp_path / "spdk.sock") as rpc:
        config = tmp_path / "targets.yaml"
        targets = [
            {"name": "nics", "source": "rdma", "sysfs": str(sysfs), "host": "node-a"},
            {"name": "spdk-wedged", "source": "spdk", "socket": str(rpc), "timeout_s": 1.0},
        ]
        config.write_text(yaml.safe_dump({"targets": targets}))
        started = time.monotonic()
        command = [str(KVSCOPE), "scrape", "--config", str(config), "--once", "--format", "json"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=15)
        elapsed = time.monotonic() - started
    assert elapsed < 6, f"--once took {elapsed:.1f} s"
    assert done.returncode == 1, done.stderr
    stderr = " ".join(done.stderr.split())
    assert f"down: spdk-wedged (unix:{rpc}): no complete answer within 1 s" in stderr
    assert "down: nics" not in stderr
    rates = {
        (line["labels"]["device"], line["labels"]["port"])
        for line in map(json.loads, done.stdout.splitlines())
        if line["name"] == "rdma_port_rate_gbps"
    }
    assert ("mlx5_0", "1") not in rates and ("mlx4_0", "1") in rates


def target_up(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    found = re.findall(r'^kvscope_target_up\{[^}]*target="([^"]+)"[^}]*\} (\S+)$', text, re.MULTILINE)
    return {target: float(value) for target, value in found}


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_the_exporter_stops_on_a_signal_while_a_read_is_stuck(tmp_path, signum):
    with wedged_rpc_server(tmp_path / "spdk.sock") as rpc:
        port = free_port()
        targets = [
            {"name": "nics", "source": "rdma", "sysfs": str(SYSFS), "host": "node-a", "interval_s": 0.2},
            {"name": "spdk-wedged", "source": "spdk", "socket": str(rpc), "interval_s": 0.2, "timeout_s": 0.5},
        ]
        config = tmp_path / "targets.yaml"
        config.write_text(yaml.safe_dump({"exporter": {"listen_port": port}, "targets": targets}))
        log = (tmp_path / "exporter.log").open("w+")
        process = subprocess.Popen(
            [str(KVSCOPE), "scrape", "--config", str(config)], stdout=subprocess.DEVNULL, stderr=log
        )
        try:
            deadline = time.monotonic() + 20
            up: dict[str, float] = {}
            while up != {"nics": 1.0, "spdk-wedged": 0.0}:  # both scraped: the SPDK connect() is now stuck
                assert process.poll() is None and time.monotonic() < deadline, f"exporter: {up}"
                time.sleep(0.1)
                with contextlib.suppress(httpx.TransportError):
                    up = target_up(port)
            time.sleep(1.0)  # some rounds while it is stuck
            assert target_up(port) == {"nics": 1.0, "spdk-wedged": 0.0}
            signalled = time.monotonic()
            process.send_signal(signum)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(5)
            stopped_in = time.monotonic() - signalled
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    log.seek(0)
    output = log.read()
    assert stopped_in < 3, f"{signum.name}: still running {stopped_in:.1f} s later\n{output}"
    assert process.returncode == 0, output
    assert "Traceback" not in output
