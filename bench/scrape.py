"""Scrape cost: one realistic node from the fixtures, and the RDMA collector against node_exporter.

Both parts measure a running exporter as Prometheus uses it: `kvscope scrape` in a process of its own, scraping its
targets every INTERVAL_S, and answering one GET /metrics (gzip, as Prometheus and httpx ask for it) per interval.
The figure per scrape is that process' CPU clock (every thread, to the nanosecond) between consecutive answers: one
scrape of every target, its normalizing, and one rendered, compressed HTTP answer, plus the event loop's idling
between them. Median and mean over N intervals (the mean is total CPU over intervals: exact however scrapes and
requests interleave).

Part 1, a realistic node: 4 vLLM engines and a Mooncake master with 2 clients (the captures, served by
`python -m http.server` in another process, a connection per GET as HTTP/1.0 has it), one SPDK target (a JSON-RPC
peer in another process answering from the live captures) and 8 RDMA NICs (the mlx5 fixture device copied 8 times
into a sysfs tree). The goal: under 25 ms of CPU per scrape. The captures' values do not change between scrapes,
which the exporter makes use of (a line, file or series that did not change is not parsed or rendered again); so
the node is measured a second time with every value of the HTTP captures greater at each GET than at the last
(served by CHANGING_SERVER, a connection per GET as well), the NICs and SPDK as before.

Part 2, the same 8-NIC sysfs tree read by kvscope's RDMA collector and by Debian's node_exporter
(`--collector.disable-defaults --collector.infiniband --path.sysfs=TREE`), measured the same way; node_exporter
collects when asked, so its figure is one GET of its /metrics (collection, HTTP, gzip, and the Go runtime and
process metrics it always serves). kvscope once with every file and once with `hw_counters: false`, the files
node_exporter reads. The goal: ratio node_exporter / kvscope >= 1 (kvscope no costlier).

Then, in this process, where kvscope's time goes: one scrape of every target (Scraper.scrape_all) and one render
of the exposition (TelemetryBridge.metrics_body, no HTTP), each timed alone.

Run: .venv/bin/python bench/scrape.py [--repeat N]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import yaml
from localhost import wait_for
from run_header import print_run_header

from kvscope.exporters.config import ExporterSettings, parse_config
from kvscope.exporters.otel import TelemetryBridge
from kvscope.exporters.scrape import Scraper
from kvscope.processes import free_port

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
NICS = 8
INTERVAL_S = 0.25  # between two scrapes of the exporter, and between two GETs of its /metrics

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


CHANGING_SERVER = textwrap.dedent(
    r"""
    import http.server, itertools, pathlib, re, sys
    value = re.compile(r"(?m)^([^#\n][^\n]*?[} ] ?)([-+0-9.eE]+)$")  # a sample line up to its value, the value

    def pieces(text):  # the text around the values, and the values
        parts = value.split(text)
        around, values = [parts[0]], []
        for head, number, after in zip(parts[1::3], parts[2::3], parts[3::3]):
            around[-1] += head
            around.append(after)
            values.append(float(number))
        return around, values

    texts = {"/" + p.name: pieces(p.read_text()) for p in pathlib.Path(sys.argv[2]).iterdir()}
    gets = itertools.count(1)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            n, (around, values) = next(gets), texts[self.path]
            body = "".join(text + repr(number + n) for text, number in zip(around, values)) + around[-1]
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body.encode())))
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args):
            pass

    http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
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


def exporter_cpu(targets: list[dict], repeat: int, workdir: Path) -> list[float]:
    """CPU seconds of a `kvscope scrape` process per interval (one scrape of `targets` and one GET /metrics), over
    `repeat` intervals after a warm-up."""
    port = free_port()
    config = workdir / f"targets-{port}.yaml"
    timed = [{**target, "interval_s": INTERVAL_S} for target in targets]
    config.write_text(yaml.safe_dump({"exporter": {"listen_port": port}, "targets": timed}))
    process = subprocess.Popen(
        [sys.executable, "-m", "kvscope", "scrape", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        wait_for(lambda: _answers(url), "kvscope scrape", 30)
        with httpx.Client() as client:
            for _ in range(4):  # every target scraped, every series rendered once
                time.sleep(INTERVAL_S)
                client.get(url)
            return _cpu_per_interval(process.pid, lambda: client.get(url).raise_for_status(), repeat)
    finally:
        process.terminate()
        process.wait(10)


def _answers(url: str) -> bool:
    try:
        return "kvscope_target_up" in httpx.get(url).text
    except httpx.HTTPError:
        return False


def _cpu_per_interval(pid: int, get: Callable[[], object], repeat: int) -> list[float]:
    """`pid`'s CPU seconds between consecutive answers of `get()`, one every INTERVAL_S."""
    clock = cpu_clock(pid)
    readings = [time.clock_gettime(clock)]
    deadline = time.monotonic()
    for _ in range(repeat):
        deadline += INTERVAL_S
        time.sleep(max(0.0, deadline - time.monotonic()))
        get()
        readings.append(time.clock_gettime(clock))
    return [after - before for before, after in itertools.pairwise(readings)]


def in_process(targets: list[dict], repeat: int) -> tuple[list[float], list[float]]:
    """CPU seconds of Scraper.scrape_all() and of TelemetryBridge.metrics_body(), each timed alone, in this process."""
    config = parse_config({"targets": targets})
    scraper = Scraper(config.targets)
    bridge = TelemetryBridge(scraper, ExporterSettings(listen_port=0))

    async def run() -> tuple[list[float], list[float]]:
        scrapes, renders = [], []
        for index in range(repeat + 1):
            started = time.process_time()
            states = await scraper.scrape_all()
            scraped = time.process_time()
            bridge.metrics_body()
            if index:
                scrapes.append(scraped - started)
                renders.append(time.process_time() - scraped)
            down = [state.last_error for state in states if not state.up]
            if down:
                raise SystemExit(f"targets down: {down}")
        await scraper.close()
        return scrapes, renders

    try:
        return asyncio.run(run())
    finally:
        bridge.shutdown()


def node_exporter_cpu(binary: str, sysfs: Path, repeat: int) -> tuple[list[float], int]:
    """node_exporter's CPU seconds per interval (one GET /metrics) over `repeat` intervals after the one that counts
    its lines, and how many infiniband lines it rendered."""
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
            return _cpu_per_interval(process.pid, lambda: client.get(url).raise_for_status(), repeat), lines
    finally:
        process.terminate()
        process.wait(10)


def realistic_node(base: str, spdk_socket: Path, rdma: dict) -> list[dict]:
    """The node's targets, its HTTP ones served from `base`."""
    return [
        *({"name": f"vllm-{i}", "source": "vllm", "url": f"{base}/vllm.txt"} for i in range(4)),
        {"name": "mooncake-master", "source": "mooncake", "url": f"{base}/master.txt"},
        *({"name": f"mooncake-client-{i}", "source": "mooncake", "url": f"{base}/client.txt"} for i in range(2)),
        {"name": "spdk", "source": "spdk", "socket": str(spdk_socket), "labels": {"role": "nof"}},
        rdma,
    ]


def figures(times: list[float]) -> str:
    return f"{statistics.median(times) * 1e3:.2f} ms, {statistics.mean(times) * 1e3:.2f} ms"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=50, help="scrapes measured per side (default 50)")
    args = parser.parse_args()
    print_run_header()
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
        port, changing_port = free_port(), free_port()
        processes.append(
            subprocess.Popen(
                [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "-d", str(web)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        processes.append(subprocess.Popen([sys.executable, "-c", CHANGING_SERVER, str(changing_port), str(web)]))
        spdk_socket = workdir / "spdk.sock"
        processes.append(
            subprocess.Popen([sys.executable, "-c", SPDK_PEER, str(spdk_socket), str(FIXTURES / "spdk" / "live")])
        )
        base, changing = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{changing_port}"
        wait_for(lambda: httpx.get(f"{base}/vllm.txt").status_code == 200, "the fixture web server", 15)
        wait_for(lambda: httpx.get(f"{changing}/vllm.txt").status_code == 200, "the changing web server", 15)
        wait_for(spdk_socket.exists, "the SPDK peer", 15)
        rdma = {
            "name": "nics",
            "source": "rdma",
            "sysfs": str(sysfs),
            "host": "bench",
            "roles": {f"mlx5_{i}": "dram" if i < NICS // 2 else "nof" for i in range(NICS)},
        }
        node = realistic_node(base, spdk_socket, rdma)
        node_times = exporter_cpu(node, args.repeat, workdir)
        changing_times = exporter_cpu(realistic_node(changing, spdk_socket, rdma), args.repeat, workdir)
        print(
            f"\n1. a realistic node ({len(node)} targets: 4 vLLM, Mooncake master + 2 clients, SPDK, {NICS} NICs), "
            f"exporter CPU per scrape + GET /metrics, {args.repeat} intervals (median, mean)"
        )
        for how, times in (("the captures as they are", node_times), ("every HTTP value changing", changing_times)):
            goal = "met" if statistics.median(times) * 1e3 < 25 else "NOT met"
            print(f"   {how}: {figures(times)} (goal < 25 ms: {goal})")

        binary = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
        every_file = exporter_cpu([rdma], args.repeat, workdir)
        same_files = exporter_cpu([{**rdma, "hw_counters": False}], args.repeat, workdir)
        print(
            f"\n2. RDMA collector against node_exporter on the same {NICS}-NIC sysfs tree ({args.repeat} intervals "
            "each, exporter CPU per scrape + GET /metrics with gzip: median, mean)"
        )
        if binary is None:
            print("   node_exporter is not installed (Debian: prometheus-node-exporter): anchor not measured")
        else:
            node_exporter, lines = node_exporter_cpu(binary, sysfs, args.repeat)
            print(f"   node_exporter ({binary}, {lines} infiniband lines): {figures(node_exporter)}")
        print(f"   kvscope rdma, every file: {figures(every_file)}")
        print(f"   kvscope rdma, hw_counters: false (the files node_exporter reads): {figures(same_files)}")
        if binary is not None:
            for how, average in (("medians", statistics.median), ("means", statistics.mean)):
                every, same = (average(node_exporter) / average(times) for times in (every_file, same_files))
                goal = " (goal >= 1: kvscope no costlier)" if how == "medians" else ""
                print(f"   ratio node_exporter / kvscope, {how}: {every:.2f}x every file, {same:.2f}x same files{goal}")

        print("\n3. in this process, each timed alone (median, mean): scrape_all; metrics_body (render, no HTTP)")
        for name, targets in (("realistic node", node), ("rdma, every file", [rdma])):
            scrapes, renders = in_process(targets, args.repeat)
            print(f"   {name}: scrape {figures(scrapes)}; render {figures(renders)}")
        return 0
    finally:
        for process in processes:
            process.terminate()
            process.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
