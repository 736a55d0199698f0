"""Scrape cost: one realistic node from the fixtures, and the RDMA collector against node_exporter.

Part 1, CPU time of one scrape of a realistic node: 4 vLLM engines and a Mooncake master with 2 clients (the
captures, served by `python -m http.server` in another process), one SPDK target (a JSON-RPC peer in another
process answering from the live captures) and 8 RDMA NICs (the mlx5 fixture device copied 8 times into a sysfs
tree). Measured with time.process_time() around Scraper.scrape_all() plus rendering the Prometheus exposition:
everything kvscope does for one scrape, in every thread of this process.

Part 2, the same 8-NIC sysfs tree read by kvscope's RDMA collector and by Debian's node_exporter
(`--collector.disable-defaults --collector.infiniband --path.sysfs=TREE`), side by side, each measured the same way:
CPU time of each of N scrapes in a row after a warm-up one, their median and their mean. node_exporter's is the
anchor: its process's CPU clock (every thread, to the nanosecond; /proc/PID/stat counts 10 ms ticks, 0.2 ms per
scrape over 50) read between consecutive HTTP requests, so it includes answering the request (HTTP, gzip).
kvscope's is collect + normalize + render in its own process (time.process_time()), with no HTTP.

Run: .venv/bin/python bench/scrape.py [--repeat N]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx
from localhost import wait_for
from prometheus_client import REGISTRY, generate_latest

from kvscope.exporters.config import ExporterSettings, parse_config
from kvscope.exporters.otel import TelemetryBridge
from kvscope.exporters.scrape import Scraper
from kvscope.processes import free_port

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
NICS = 8

SPDK_PEER = textwrap.dedent(
    """
    import json, socket, sys, pathlib
    live = pathlib.Path(sys.argv[2])
    server = socket.socket(socket.AF_UNIX); server.bind(sys.argv[1]); server.listen()
    decoder = json.JSONDecoder()
    while True:
        conn, _ = server.accept()
        buffer = ""
        while chunk := conn.recv(65536):
            buffer += chunk.decode()
            while buffer.strip():
                try:
                    request, end = decoder.raw_decode(buffer.lstrip())
                except ValueError:
                    break
                buffer = buffer.lstrip()[end:]
                path = live / (request["method"] + ".json")
                path = path if path.exists() else live / "error.method_not_found.json"
                answer = json.loads(path.read_text())
                answer["id"] = request["id"]
                conn.sendall(json.dumps(answer).encode())
    """
)


def nic_tree(workdir: Path) -> Path:
    """A sysfs root with NICS copies of the fixture's mlx5_0 (symlinks kept)."""
    source = FIXTURES / "rdma" / "sysfs" / "class" / "infiniband" / "mlx5_0"
    root = workdir / "sysfs"
    for index in range(NICS):
        shutil.copytree(source, root / "class" / "infiniband" / f"mlx5_{index}", symlinks=True)
    return root


def cpu_clock(pid: int) -> int:
    """The clock id of the CPU time of process `pid` (every thread), as glibc's clock_getcpuclockid builds it."""
    return ((~pid) << 3) | 2  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)


def measure_kvscope(targets: list[dict], repeat: int) -> list[float]:
    """CPU seconds of each of `repeat` scrapes (scrape_all + render), after one warm-up."""
    config = parse_config({"targets": targets})
    scraper = Scraper(config.targets)
    bridge = TelemetryBridge(scraper, ExporterSettings(listen_port=0))

    async def run() -> list[float]:
        times = []
        for index in range(repeat + 1):
            started = time.process_time()
            states = await scraper.scrape_all()
            generate_latest(REGISTRY)
            if index:
                times.append(time.process_time() - started)
            down = [state.last_error for state in states if not state.up]
            if down:
                raise SystemExit(f"targets down: {down}")
        await scraper.close()
        return times

    try:
        return asyncio.run(run())
    finally:
        bridge.shutdown()


def node_exporter_cpu(binary: str, sysfs: Path, repeat: int) -> tuple[list[float], int]:
    """node_exporter's CPU seconds of each of `repeat` scrapes of the tree (after the one that counts its lines), and
    how many infiniband lines it rendered."""
    port = free_port()
    process = subprocess.Popen(
        [
            binary,
            "--collector.disable-defaults",
            "--collector.infiniband",
            f"--path.sysfs={sysfs}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        wait_for(lambda: httpx.get(url).status_code == 200, "node_exporter", 15)
        with httpx.Client() as client:
            lines = sum(line.startswith("node_infiniband") for line in client.get(url).text.splitlines())
            clock = cpu_clock(process.pid)
            readings = [time.clock_gettime(clock)]
            for _ in range(repeat):
                client.get(url)
                readings.append(time.clock_gettime(clock))
            return [after - before for before, after in itertools.pairwise(readings)], lines
    finally:
        process.terminate()
        process.wait(10)


def figures(times: list[float]) -> str:
    return f"{statistics.median(times) * 1e3:.2f} ms, {statistics.mean(times) * 1e3:.2f} ms"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=50, help="scrapes measured per side (default 50)")
    args = parser.parse_args()
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(f"python {sys.version.split()[0]} on {os.cpu_count()} CPUs; {time.strftime('%Y-%m-%d %H:%M:%S')}")
    workdir = Path(tempfile.mkdtemp(prefix="kvscope-scrape-bench-"))
    processes: list[subprocess.Popen] = []
    try:
        sysfs = nic_tree(workdir)
        web = workdir / "web"
        web.mkdir()
        for name in ("metrics_rendered_v0.33.0_offloading_kvcachemetrics_SYNTHETIC.txt",):
            shutil.copy(FIXTURES / "vllm" / name, web / "vllm.txt")
        shutil.copy(FIXTURES / "mooncake" / "master_metrics_after.txt", web / "master.txt")
        shutil.copy(FIXTURES / "mooncake" / "client_metrics_user_after.txt", web / "client.txt")
        port = free_port()
        processes.append(
            subprocess.Popen(
                [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "-d", str(web)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        spdk_socket = workdir / "spdk.sock"
        processes.append(
            subprocess.Popen([sys.executable, "-c", SPDK_PEER, str(spdk_socket), str(FIXTURES / "spdk" / "live")])
        )
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: httpx.get(f"{base}/vllm.txt").status_code == 200, "the fixture web server", 15)
        wait_for(spdk_socket.exists, "the SPDK peer", 15)
        rdma = {
            "name": "nics",
            "source": "rdma",
            "sysfs": str(sysfs),
            "host": "bench",
            "roles": {f"mlx5_{i}": "dram" if i < NICS // 2 else "nof" for i in range(NICS)},
        }
        node = [
            *({"name": f"vllm-{i}", "source": "vllm", "url": f"{base}/vllm.txt"} for i in range(4)),
            {"name": "mooncake-master", "source": "mooncake", "url": f"{base}/master.txt"},
            *({"name": f"mooncake-client-{i}", "source": "mooncake", "url": f"{base}/client.txt"} for i in range(2)),
            {"name": "spdk", "source": "spdk", "socket": str(spdk_socket), "labels": {"role": "nof"}},
            rdma,
        ]
        node_times = measure_kvscope(node, args.repeat)
        median_ms = statistics.median(node_times) * 1e3
        p90_ms = statistics.quantiles(node_times, n=10)[-1] * 1e3
        print(
            f"\n1. one scrape of a realistic node ({len(node)} targets: 4 vLLM, Mooncake master + 2 clients, SPDK, "
            f"{NICS} NICs), CPU time in kvscope's process, median of {args.repeat}: {median_ms:.1f} ms "
            f"(p90 {p90_ms:.1f} ms)"
        )

        binary = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
        every_file = measure_kvscope([rdma], args.repeat)
        same_files = measure_kvscope([{**rdma, "hw_counters": False}], args.repeat)
        print(
            f"\n2. RDMA collector against node_exporter on the same {NICS}-NIC sysfs tree ({args.repeat} scrapes each, "
            "CPU time per scrape: median, mean)"
        )
        if binary is None:
            print("   node_exporter is not installed (Debian: prometheus-node-exporter): anchor not measured")
        else:
            node_exporter, lines = node_exporter_cpu(binary, sysfs, args.repeat)
            print(f"   node_exporter ({binary}, {lines} infiniband lines): {figures(node_exporter)}")
        print(f"   kvscope rdma, every file (collect + normalize + render): {figures(every_file)}")
        print(f"   kvscope rdma, hw_counters: false (the files node_exporter reads): {figures(same_files)}")
        if binary is not None:
            for how, average in (("medians", statistics.median), ("means", statistics.mean)):
                every, same = (average(node_exporter) / average(times) for times in (every_file, same_files))
                goal = " (goal >= 1: kvscope no slower)" if how == "medians" else ""
                print(f"   ratio node_exporter / kvscope, {how}: {every:.2f}x every file, {same:.2f}x same files{goal}")
        return 0
    finally:
        for process in processes:
            process.terminate()
            process.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
