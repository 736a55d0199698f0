"""The OpenTelemetry bridge end to end: the Prometheus endpoint (checked by promtool, scraped by a real
Prometheus) and an OTLP/HTTP receiver inside the test, all on 127.0.0.1."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from prometheus_client.parser import text_string_to_metric_families

from kvscope.exporters.config import parse_config
from kvscope.exporters.otel import TelemetryBridge
from kvscope.exporters.scrape import Scraper

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "vllm"
OFFLOADING = FIXTURE / "metrics_rendered_v0.33.0_offloading_kvcachemetrics_SYNTHETIC.txt"


@pytest.fixture
def bridge_factory(metrics_server):
    """Scrapes the vLLM fixture once (plus a dead target) and builds a bridge over it."""
    bridges: list[TelemetryBridge] = []

    def build(**exporter) -> TelemetryBridge:
        url = metrics_server.serve("/metrics", OFFLOADING.read_bytes())
        config = parse_config(
            {
                "exporter": {"listen_port": 0, **exporter},
                "targets": [
                    {"name": "vllm-a", "source": "vllm", "url": url},
                    {"name": "dead", "source": "vllm", "url": "http://127.0.0.1:9/metrics", "timeout_s": 0.5},
                ],
            }
        )
        scraper = Scraper(config.targets)

        async def once():
            await scraper.scrape_all()
            await scraper.close()

        asyncio.run(once())
        bridge = TelemetryBridge(scraper, config.exporter)
        bridges.append(bridge)
        return bridge

    yield build
    for bridge in bridges:
        bridge.shutdown()


def exposition(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/metrics").text


def series(text: str) -> dict[tuple[str, frozenset], float]:
    return {
        (s.name, frozenset((k, v) for k, v in s.labels.items() if not k.startswith("otel_scope"))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_prometheus_endpoint_serves_the_model_with_targets_and_health(bridge_factory):
    port = bridge_factory().serve()
    found = series(exposition(port))
    assert (
        found[("kv_prefix_query_tokens_total", frozenset({("engine", "0"), ("layer", "gpu"), ("target", "vllm-a")}))]
        == 18432
    )
    put = frozenset({("system", "vllm_offload:0"), ("tier", "dram"), ("target", "vllm-a")})
    assert found[("kv_store_put_bytes_total", put)] == 75497472
    assert found[("kvscope_target_up", frozenset({("target", "vllm-a"), ("source", "vllm")}))] == 1
    assert found[("kvscope_target_up", frozenset({("target", "dead"), ("source", "vllm")}))] == 0
    assert found[("kvscope_scrape_errors_total", frozenset({("target", "dead"), ("source", "vllm")}))] == 1
    assert not any(dict(labels).get("target") == "dead" for name, labels in found if name.startswith("kv_"))


def test_promtool_finds_nothing_to_complain_about(bridge_factory, require_real):
    promtool = shutil.which("promtool")
    require_real(promtool is not None, "promtool is not installed (Debian package prometheus)")
    port = bridge_factory().serve()
    checked = subprocess.run([promtool, "check", "metrics"], input=exposition(port), capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.strip() == "" and checked.stderr.strip() == ""


class _OtlpReceiver:
    """An OTLP/HTTP metrics endpoint: decodes each ExportMetricsServiceRequest it is sent."""

    def __init__(self) -> None:
        self.requests: list[ExportMetricsServiceRequest] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportMetricsServiceRequest()
                request.ParseFromString(body)
                receiver.requests.append(request)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_port}/v1/metrics"

    def points(self) -> dict[tuple[str, frozenset], float]:
        found = {}
        for request in self.requests:
            for resource in request.resource_metrics:
                for scope in resource.scope_metrics:
                    for metric in scope.metrics:
                        data = metric.sum if metric.HasField("sum") else metric.gauge
                        for point in data.data_points:
                            labels = frozenset((a.key, a.value.string_value) for a in point.attributes)
                            value = point.as_double if point.HasField("as_double") else point.as_int
                            found[(metric.name, labels)] = value
        return found


def test_otlp_receiver_gets_the_same_metrics():
    receiver = _OtlpReceiver()
    try:
        from kvscope.exporters.config import ExporterSettings

        settings = ExporterSettings.model_validate({"listen_port": 0, "otlp": {"endpoint": receiver.endpoint}})
        config = parse_config({"targets": [{"name": "vllm-a", "source": "vllm", "url": "http://127.0.0.1:9/"}]})
        scraper = Scraper(config.targets)
        # One known snapshot instead of a scrape: the bridge only ever reads the states.
        from kvscope.exporters.normalizer import mapping_for
        from kvscope.exporters.promtext import parse_exposition

        state = scraper.states["vllm-a"]
        state.raw = parse_exposition("vllm", OFFLOADING.read_text(), "vllm-a")
        state.normalized = mapping_for("vllm").apply(state.raw, {})
        state.up = True
        bridge = TelemetryBridge(scraper, settings)
        assert bridge.provider.force_flush(10_000)
        bridge.shutdown()
        points = receiver.points()
        assert (
            points[("kv.prefix.query.tokens", frozenset({("engine", "0"), ("layer", "gpu"), ("target", "vllm-a")}))]
            == 18432
        )
        assert (
            points[
                (
                    "kv.store.get.bytes",
                    frozenset({("system", "vllm_offload:0"), ("tier", "dram"), ("target", "vllm-a")}),
                )
            ]
            == 37748736
        )
        assert points[("kvscope.target.up", frozenset({("target", "vllm-a"), ("source", "vllm")}))] == 1
    finally:
        receiver.httpd.shutdown()
        receiver.httpd.server_close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_real_prometheus_scrapes_the_exporter(bridge_factory, require_real, tmp_path):
    prometheus = shutil.which("prometheus")
    require_real(prometheus is not None, "prometheus is not installed (Debian package prometheus)")
    exporter_port = bridge_factory().serve()
    prometheus_port = _free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s}\n"
        f"scrape_configs: [{{job_name: kvscope, static_configs: [{{targets: ['127.0.0.1:{exporter_port}']}}]}}]\n"
    )
    process = subprocess.Popen(
        [
            prometheus,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{prometheus_port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        query = 'kv_prefix_query_tokens_total{layer="gpu",target="vllm-a"}'
        deadline, result = time.monotonic() + 30, []
        while time.monotonic() < deadline and not result:
            time.sleep(0.5)
            try:
                answer = httpx.get(f"http://127.0.0.1:{prometheus_port}/api/v1/query", params={"query": query})
                result = answer.json()["data"]["result"]
            except httpx.TransportError:
                continue
        assert result, f"Prometheus never returned {query}"
        assert float(result[0]["value"][1]) == 18432
        assert result[0]["metric"]["job"] == "kvscope"
    finally:
        process.terminate()
        process.wait(10)
