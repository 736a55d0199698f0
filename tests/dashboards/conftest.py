"""Sources whose counters move, for the live dashboard test: an SPDK target, a sysfs tree of RDMA NICs, a vLLM
engine's request histograms, and a Dynamo frontend with its KV router and two workers.

They replay the fixtures (tests/fixtures/spdk/live, tests/fixtures/rdma/sysfs, plus the SYNTHETIC RoCE port of
tests/fixtures/rdma/synthetic/sysfs and its made-up congestion counters, the TTFT and prompt-length histograms of
tests/fixtures/vllm's rendered default /metrics, and tests/fixtures/dynamo's small-cache captures, taken mid-load)
with their I/O, reactor, data, congestion, error, bucket and Dynamo counters growing over time, so that rates, and
latencies, busy shares, quantiles and ratios from rates, have values. Everything else is answered or read exactly as
in the fixtures.
"""

from __future__ import annotations

import re
import shutil
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from support.spdkpeer import Answer, SpdkPeer, capture

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

# bdev_get_iostat fields that count (bytes, operations, time in ticks since start): scaled by the number of calls.
# Max/min latencies, queue depth and the tick rate are not counters and stay as captured.
_IOSTAT_COUNTER = re.compile(r"^(bytes_\w+|num_\w+_ops|(read|write|unmap|copy)_latency_ticks|ticks)$")
# framework_get_reactors fields scaled the same way: busy and idle ticks (so the busy share stays the captured one).
_REACTOR_COUNTER = re.compile(r"^(busy|idle)$")


class SpdkTarget(SpdkPeer):
    """An SPDK peer on the Unix socket `path` that answers like the captured nvmf_tgt: each method with its capture
    under fixtures/spdk/live/, bdev_get_iostat with its counters times the number of iostat calls so far,
    framework_get_reactors with its reactors' busy and idle ticks times the number of reactor calls so far, an
    unknown method with the captured "method not found" error."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.iostat_calls = 0
        self.reactor_calls = 0
        super().__init__(self.live, path)

    def live(self, method: str, params: object) -> Answer:
        if method == "bdev_get_iostat":
            self.iostat_calls += 1
            result = capture("live/bdev_get_iostat.json")["result"]
            _scale(result, self.iostat_calls, _IOSTAT_COUNTER)
            return {"result": result}
        if method == "framework_get_reactors":
            self.reactor_calls += 1
            result = capture("live/framework_get_reactors.json")["result"]
            _scale(result["reactors"], self.reactor_calls, _REACTOR_COUNTER)
            return {"result": result}
        path = f"live/{method}.json"
        return path if (FIXTURES / "spdk" / path).exists() else "live/error.method_not_found.json"


def _scale(value: object, factor: int, counters: re.Pattern) -> None:
    """Multiply in place the integer fields named by `counters`, at any depth (an iostat result's bdevs and
    per-channel lists, a reactor list)."""
    if isinstance(value, list):
        for item in value:
            _scale(item, factor, counters)
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, int) and not isinstance(item, bool) and counters.match(key):
                value[key] = item * factor
            else:
                _scale(item, factor, counters)


@pytest.fixture
def spdk_target(tmp_path: Path) -> Iterator[SpdkTarget]:
    target = SpdkTarget(tmp_path / "spdk.sock")
    yield target
    target.close()


class RdmaTree:
    """A copy of the RDMA sysfs fixture with the synthetic RoCE port (mlx5_1) added, whose counters grow every
    `period_s`, rewritten in place as sysfs would show them (the exporter keeps them open): every port's data
    counters (port_xmit_data, port_rcv_data, in 4-octet words), mlx5_1's congestion counters but rp_cnp_ignored,
    and one error counter each of its PMA (symbol_error) and its hw counters (out_of_sequence)."""

    def __init__(self, root: Path, period_s: float = 0.5) -> None:
        shutil.copytree(FIXTURES / "rdma" / "sysfs", root)
        shutil.copytree(FIXTURES / "rdma" / "synthetic" / "sysfs", root, dirs_exist_ok=True)
        self.root = root
        # (file, what it grows by each period): ~1-2 MB/s per port and direction, tens of congestion packets and a
        # few errors a second (symbol_error, 16 bits wide, would saturate after hours)
        data = sorted(root.glob("class/infiniband/*/ports/*/counters/port_*_data"))
        self.steps = [(path, 250_000 * (index + 1)) for index, path in enumerate(data)]
        port = root / "class" / "infiniband" / "mlx5_1" / "ports" / "1"
        self.steps += [(port / "hw_counters" / name, 20) for name in ("np_cnp_sent", "rp_cnp_handled")]
        self.steps += [(port / "hw_counters" / "np_ecn_marked_roce_packets", 25)]
        self.steps += [(port / "hw_counters" / "out_of_sequence", 2), (port / "counters" / "symbol_error", 1)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, args=(period_s,), daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _tick(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            for path, step in self.steps:
                count = int(path.read_text().strip()) + step
                with path.open("r+") as file:
                    file.write(f"{count}\n")
                    file.truncate()


@pytest.fixture
def rdma_tree(tmp_path: Path) -> Iterator[RdmaTree]:
    tree = RdmaTree(tmp_path / "sysfs")
    yield tree
    tree.close()


# vLLM's request histograms the fabric dashboard reads (its TTFT and prompt length by role).
_VLLM_HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:request_prompt_tokens")
# One sample line of a Prometheus text exposition: the series (name and labels, whose values may hold spaces) and its
# value.
_SAMPLE = re.compile(r"^(?P<name>[^\s{]+)(?P<labels>\{.*\})? (?P<value>\S+)$")


class MetricsServer:
    """An HTTP server on 127.0.0.1 whose GET /metrics answers `metrics()` (404 elsewhere)."""

    def __init__(self) -> None:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = server.metrics().encode() if self.path == "/metrics" else b"not found"
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self._httpd.server_port}/metrics"

    def metrics(self) -> str:
        raise NotImplementedError

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


class GrowingExposition(MetricsServer):
    """A server whose GET /metrics answers a captured exposition, every sample of the `growing` series times the
    number of GETs so far, the rest as captured: rates keep the captured proportions, so a ratio of two of them,
    or a quantile of a histogram, is the capture's."""

    def __init__(self, lines: list[str], growing: set[str]) -> None:
        self.lines, self.growing = lines, growing
        self.calls = 0
        super().__init__()

    def metrics(self) -> str:
        self.calls += 1
        scaled = []
        for line in self.lines:
            sample = None if line.startswith("#") else _SAMPLE.match(line)
            if sample and sample["name"] in self.growing:
                line = f"{sample['name']}{sample['labels'] or ''} {float(sample['value']) * self.calls}"
            scaled.append(line)
        return "\n".join(scaled) + "\n"


class VllmEngine(GrowingExposition):
    """A vLLM server answering the TTFT and prompt-length histograms of the rendered vLLM 0.33 exposition
    (tests/fixtures/vllm, default config), every bucket, _count and _sum growing with the requests."""

    def __init__(self) -> None:
        text = (FIXTURES / "vllm" / "metrics_rendered_v0.33.0_default_SYNTHETIC.txt").read_text()
        growing = {f"{family}{suffix}" for family in _VLLM_HISTOGRAMS for suffix in ("_bucket", "_count", "_sum")}
        super().__init__([line for line in text.splitlines() if _histogram_line(line, growing)], growing)


def _histogram_line(line: str, samples: set[str]) -> bool:
    """Whether a line of the exposition belongs to one of _VLLM_HISTOGRAMS: its HELP and TYPE, or one of its
    `samples` (buckets, _count and _sum; not the _created gauge vLLM writes beside it)."""
    if line.startswith("#"):
        words = line.split()
        return len(words) > 2 and words[1] in ("HELP", "TYPE") and words[2] in _VLLM_HISTOGRAMS
    return line.split("{", 1)[0] in samples


@pytest.fixture
def vllm_engine() -> Iterator[VllmEngine]:
    engine = VllmEngine()
    yield engine
    engine.close()


class DynamoProcess(GrowingExposition):
    """A Dynamo process (the frontend with its KV router, or a worker) answering its capture in tests/fixtures/dynamo
    whole, its counter and histogram families growing with the requests, its gauges as captured."""

    def __init__(self, capture: str) -> None:
        lines = (FIXTURES / "dynamo" / capture).read_text().splitlines()
        kinds = {words[2]: words[3] for words in map(str.split, lines) if words[:2] == ["#", "TYPE"]}
        growing = {name for name, kind in kinds.items() if kind == "counter"}
        growing |= {f"{name}{suffix}" for name, kind in kinds.items() if kind == "histogram"
                    for suffix in ("_bucket", "_count", "_sum")}  # fmt: skip
        super().__init__(lines, growing)


@pytest.fixture
def dynamo_stack() -> Iterator[dict[str, DynamoProcess]]:
    """A frontend with its KV router and its two mocker workers, replaying the small-cache run's captures taken
    mid-load (tests/fixtures/dynamo/PROVENANCE.md), by target name."""
    stack = {
        "dynamo-frontend": DynamoProcess("small_blocks_midload_frontend.prom"),
        "dynamo-worker-0": DynamoProcess("small_blocks_midload_worker0.prom"),
        "dynamo-worker-1": DynamoProcess("small_blocks_midload_worker1.prom"),
    }
    yield stack
    for process in stack.values():
        process.close()
