"""Latency of the service's alert and evidence endpoints under a constant load while an A/B runs.

The service runs as `kvscope serve` in a process of its own (uvicorn, one worker, 127.0.0.1, the default settings
but a fresh database and workdir), so the load generator, in this process, does not share its GIL. An A/B of
examples/long_output.yaml is started over HTTP, paced at --rounds-per-minute, and runs through the whole
measurement: each round its thread simulates both arms, records them into DuckDB and evaluates the alert rules,
yielding to the requests in flight (kvscope.api.yielding); the service's scraper reads the published engines every
5 s.

Load: open loop at a constant --rate. Request i is due at t0 + i / rate and is queued then, whatever the earlier
ones are doing; 32 keep-alive HTTP/1.1 connections take requests from that queue. A request's latency runs from its
due time to the last byte of its response, so a stall of the server counts against every request it held up, not
only the one in flight (no coordinated omission), and so does any wait for a free connection. The connections are
plain asyncio streams: a request costs the generator some tens of microseconds and nothing grows with a backlog.
(httpx.AsyncClient was the first choice, but its pool does work quadratic in its connections per request: under a
backlog the generator itself fell behind, seconds of "latency" with the service mostly idle.)

Two loads, the same rate, in alternating slices of --slice seconds after --warmup seconds of both (not counted),
--seconds of each in all, so that both see the same A/B rounds:
  - anchor: all of it on GET /healthz, which reads memory only and is answered by the event loop: the floor of the
    stack (uvicorn, Starlette, FastAPI, the loopback) on this machine, with the A/B running;
  - target: GET /api/v1/alerts (memory only, answered by the event loop too) and an evidence query,
    GET /api/v1/runs/{id}/samples of the A/B's dram_only run (metric=kv.tier.written.bytes, limit=1000: three
    DuckDB queries in a thread of FastAPI's pool), alternating, so each gets half the rate.
Printed per endpoint: p50, p90, p99 and max latency over every measured request, requests sent, failures
(transport errors or a status other than 200), the achieved rate (answered requests over the measured seconds);
per load, the CPU of the server process and of the generator (100% = one core), and the generator's worst lag
behind a due time (its own health: a few ms).

Goal: p99 under 50 ms for both target endpoints at 200 requests/s, on this 2-core machine.

Run: .venv/bin/python bench/api.py [--rate R] [--seconds S] [--slice S] [--warmup S] [--rounds-per-minute N]
     [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml
from localhost import wait_for
from run_header import print_run_header

from kvscope.processes import free_port

ROOT = Path(__file__).resolve().parent.parent
LONG_OUTPUT = ROOT / "examples" / "long_output.yaml"
CRITERIA = ROOT / "criteria" / "media.yaml"
TOKEN = "bench-token"
GOAL_P99_MS = 50.0
GOAL_RATE = 200.0
EVIDENCE_METRIC = "kv.tier.written.bytes"
CONNECTIONS = 32  # 160 ms of backlog at 200 requests/s before requests wait for a connection (counted too)


@dataclass
class Endpoint:
    label: str
    path: str
    latencies: list[float] = field(default_factory=list)  # seconds, from the due time to the response's last byte
    failures: int = 0

    @property
    def sent(self) -> int:
        return len(self.latencies) + self.failures


@dataclass
class Load:
    name: str
    endpoints: list[Endpoint]
    seconds: float = 0.0  # measured, summed over its slices
    server_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    late_s: float = 0.0  # the generator's worst lag behind a due time


# ------------------------------------------------------------------------------------------------- service


def start_service(workdir: Path, port: int) -> subprocess.Popen:
    """`kvscope serve` on 127.0.0.1:port over a fresh database; its output goes to workdir/service.log."""
    script = Path(sys.executable).with_name("kvscope")
    command = [str(script)] if script.exists() else [sys.executable, "-c", "from kvscope.cli import app; app()"]
    command += ["serve", "--host", "127.0.0.1", "--port", str(port), "--db", str(workdir / "bench.duckdb")]
    command += ["--criteria", str(CRITERIA)]
    env = {
        **os.environ,
        "KVSCOPE_TOKEN": TOKEN,
        "KVSCOPE_WORKDIR": str(workdir / "ab"),
        "KVSCOPE_DASHBOARDS_DIR": str(workdir / "dashboards"),
    }
    with (workdir / "service.log").open("w") as log:
        return subprocess.Popen(command, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_until_up(base: str, service: subprocess.Popen, seconds: float = 30) -> None:
    def up() -> bool:
        if service.poll() is not None:
            raise SystemExit(f"the service exited with {service.returncode}")
        return httpx.get(f"{base}/healthz", timeout=1).status_code == 200

    wait_for(up, "the service (/healthz)", seconds)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid`, every thread."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ab_progress(base: str, ab_id: str) -> tuple[int, str]:
    """(rounds the dram_only arm has done, the test's status)."""
    test = httpx.get(f"{base}/api/v1/ab/{ab_id}", timeout=10).json()
    return test["arms"]["dram_only"]["rounds_done"], test["status"]


# ---------------------------------------------------------------------------------------------------- load


class Connections:
    """`size` keep-alive HTTP/1.1 connections to the service, each sending GETs one after another, fed from one
    queue of (endpoint, due time)."""

    def __init__(self, port: int, size: int) -> None:
        self.port, self.size = port, size
        self.queue: asyncio.Queue[tuple[Endpoint, float] | None] = asyncio.Queue()
        self.workers: list[asyncio.Task] = []

    async def __aenter__(self) -> Connections:
        self.workers = [asyncio.create_task(self._worker()) for _ in range(self.size)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for _ in self.workers:
            self.queue.put_nowait(None)
        await asyncio.gather(*self.workers)

    async def _worker(self) -> None:
        loop = asyncio.get_running_loop()
        streams = await asyncio.open_connection("127.0.0.1", self.port)
        while (item := await self.queue.get()) is not None:
            endpoint, due = item
            ok, streams = await self._get(streams, endpoint.path)
            if ok:
                endpoint.latencies.append(loop.time() - due)
            else:
                endpoint.failures += 1
            self.queue.task_done()
        streams[1].close()

    async def _get(self, streams: tuple, path: str, retry: bool = True) -> tuple[bool, tuple]:
        """(whether the answer was a 200, the streams to go on with). A connection the service closed while idle
        (its keep-alive timeout) is opened again and the request sent again, once."""
        reader, writer = streams
        try:
            writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n\r\n".encode())
            head = await reader.readuntil(b"\r\n\r\n")
        except (OSError, asyncio.IncompleteReadError) as error:
            writer.close()
            streams = await asyncio.open_connection("127.0.0.1", self.port)
            unanswered = isinstance(error, OSError) or not error.partial
            return await self._get(streams, path, retry=False) if retry and unanswered else (False, streams)
        lines = head.lower().split(b"\r\n")
        length = next(int(line.split(b":")[1]) for line in lines if line.startswith(b"content-length:"))
        await reader.readexactly(length)
        return head.startswith(b"HTTP/1.1 200 "), streams

    async def drive(self, endpoints: list[Endpoint], rate: float, seconds: float) -> float:
        """Requests at `rate` for `seconds`, round-robin over `endpoints`, each queued at its due time, until all
        are answered. Returns the generator's worst lag behind a due time."""
        loop = asyncio.get_running_loop()
        late, start = 0.0, loop.time() + 0.01
        for index in range(round(rate * seconds)):
            due = start + index / rate
            if (wait := due - loop.time()) > 0:
                await asyncio.sleep(wait)
            late = max(late, loop.time() - due)
            self.queue.put_nowait((endpoints[index % len(endpoints)], due))
        await self.queue.join()
        return late


async def measure(port: int, loads: list[Load], args: argparse.Namespace, server_pid: int) -> None:
    """The warm-up, then the loads in alternating slices until each has had `args.seconds`."""
    async with Connections(port, CONNECTIONS) as connections:
        everything = [Endpoint(e.label, e.path) for load in loads for e in load.endpoints]
        await connections.drive(everything, args.rate, args.warmup)
        for _ in range(math.ceil(args.seconds / args.slice)):
            for load in loads:
                server, own, wall = cpu_seconds(server_pid), time.process_time(), time.monotonic()
                late = await connections.drive(load.endpoints, args.rate, args.slice)
                load.seconds += time.monotonic() - wall
                load.server_cpu_s += cpu_seconds(server_pid) - server
                load.client_cpu_s += time.process_time() - own
                load.late_s = max(load.late_s, late)


# ------------------------------------------------------------------------------------------------- figures


def percentile(values: list[float], p: float) -> float:
    """Nearest rank: the smallest value with at least p% of them at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def report(load: Load) -> None:
    print(
        f"\n{load.name}: {load.seconds:.1f} s measured; server CPU {load.server_cpu_s / load.seconds:.0%} of a core, "
        f"load generator {load.client_cpu_s / load.seconds:.0%}; the generator's worst lag {load.late_s * 1e3:.1f} ms"
    )
    columns = "".join(f"{name:>7}" for name in ("p50", "p90", "p99", "max", "sent", "failed", "req/s"))
    print(f"   {'endpoint (latency in ms)':<32}{columns}")
    for e in load.endpoints:
        ms = [percentile(e.latencies, p) * 1e3 for p in (50, 90, 99, 100)] if e.latencies else [math.nan] * 4
        figures = "".join(f"{value:7.1f}" for value in ms)
        print(f"   {e.label:<32}{figures}{e.sent:>7}{e.failures:>7}{len(e.latencies) / load.seconds:>7.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=GOAL_RATE, help="requests per second (default 200)")
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds of each load (default 8)")
    parser.add_argument("--slice", type=float, default=1.0, help="seconds of one load before the other (default 1)")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of load not counted (default 1)")
    parser.add_argument(
        "--rounds-per-minute", type=float, default=60.0,
        help="pace of the A/B (default 60; lowered when needed to keep it running through the measurement)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="smoke run: 3 s of each load, 0.5 s warm-up")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.warmup = 3.0, 0.5
    print_run_header()

    scenario = yaml.safe_load(LONG_OUTPUT.read_text())
    rounds = scenario["workload"]["rounds"]
    needed_s = args.warmup + 2 * math.ceil(args.seconds / args.slice) * args.slice + 2  # and a margin
    pace = min(args.rounds_per_minute, 60 * rounds / needed_s)

    workdir = Path(tempfile.mkdtemp(prefix="kvscope-api-bench-"))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    service = start_service(workdir, port)
    try:
        wait_until_up(base, service)
        started = httpx.post(
            f"{base}/api/v1/ab",
            json={"scenario": scenario, "rounds_per_minute": pace},
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=30,
        )
        started.raise_for_status()
        ab_id = started.json()["id"]
        runs = httpx.get(f"{base}/api/v1/runs", params={"name_prefix": f"{ab_id}/dram_only"}, timeout=10).json()
        samples = f"/api/v1/runs/{runs[0]['run_id']}/samples?metric={EVIDENCE_METRIC}&limit=1000"
        print(
            f"service: kvscope serve (pid {service.pid}) on {base}; A/B {ab_id} of {LONG_OUTPUT.name}, {rounds} "
            f"rounds at {pace:.0f} a minute\nload: {args.rate:.0f} requests/s, open loop, {CONNECTIONS} connections; "
            f"{args.warmup:g} s warm-up, then {args.seconds:g} s of each load in {args.slice:g} s slices\n"
            f"evidence query: GET {samples}"
        )
        loads = [
            Load("anchor, GET /healthz only", [Endpoint("GET /healthz", "/healthz")]),
            Load(
                "target, alerts and evidence alternating",
                [Endpoint("GET /api/v1/alerts", "/api/v1/alerts"), Endpoint("GET /api/v1/runs/{id}/samples", samples)],
            ),
        ]
        before, _ = ab_progress(base, ab_id)
        asyncio.run(measure(port, loads, args, service.pid))
        after, status = ab_progress(base, ab_id)
        for load in loads:
            report(load)
        alerts = httpx.get(f"{base}/api/v1/alerts", timeout=10)
        page = httpx.get(f"{base}{samples}", timeout=10)
        print(
            f"\nA/B rounds {before} -> {after} during the measurement ({status} at its end); at the end /alerts "
            f"answers {len(alerts.json())} alerts ({len(alerts.content):,} B), the evidence query "
            f"{len(page.json()['samples'])} samples ({len(page.content):,} B)"
        )

        target = loads[1].endpoints
        worst = max(percentile(e.latencies, 99) * 1e3 if e.latencies else math.inf for e in target)
        failed = sum(e.failures for e in target)
        met = worst < GOAL_P99_MS and not failed and args.rate >= GOAL_RATE and status == "running"
        print(
            f"goal: p99 < {GOAL_P99_MS:.0f} ms for alerts and evidence at {GOAL_RATE:.0f} requests/s while an A/B "
            f"runs: {'met' if met else 'NOT met'} (worst p99 {worst:.1f} ms at {args.rate:.0f} requests/s, "
            f"{failed} failed{'' if status == 'running' else ', the A/B ended before the measurement did'})"
        )
        return 0
    finally:
        service.terminate()
        try:
            service.wait(30)
        except subprocess.TimeoutExpired:
            service.kill()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
