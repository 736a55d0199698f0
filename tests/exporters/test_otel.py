"""The OpenTelemetry bridge end to end: the Prometheus endpoint (checked by promtool, scraped by a real
Prometheus) and an OTLP/HTTP receiver inside the test, all on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support.realservers import PostReceiver, scrape_once, start_prometheus, wait_for

from kvscope.exporters.config import parse_config
from kvscope.exporters.otel import TelemetryBridge
from kvscope.exporters.scrape import Scraper

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "vllm"
OFFLOADING = FIXTURE / "metrics_rendered_v0.33.0_offloading_kvcachemetrics_SYNTHETIC.txt"
RDMA_SYSFS = FIXTURE.parent / "rdma" / "sysfs"


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
        scrape_once(scraper)
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


def test_the_endpoint_serves_what_opentelemetry_s_prometheus_exporter_would(metrics_server):
    """Every family the endpoint renders itself, with its HELP, TYPE, series and values, is the one OpenTelemetry's
    own Prometheus exporter makes of the same instruments over the same snapshots (the vLLM fixture, the RDMA
    fixture tree, a dead target), less the otel_scope_* labels, which were the same on every series."""
    url = metrics_server.serve("/metrics", OFFLOADING.read_bytes())
    targets = [
        {"name": "vllm-a", "source": "vllm", "url": url},
        {"name": "nics", "source": "rdma", "sysfs": str(RDMA_SYSFS), "host": "node-a", "roles": {"mlx5_0": "nof"}},
        {"name": "dead", "source": "vllm", "url": "http://127.0.0.1:9/metrics", "timeout_s": 0.5},
    ]
    config = parse_config({"exporter": {"listen_port": 0}, "targets": targets})
    scraper = Scraper(config.targets)
    scrape_once(scraper)
    registry = CollectorRegistry()
    bridge = TelemetryBridge(scraper, config.exporter, readers=[PrometheusMetricReader(registry=registry)])
    try:
        ours = text_string_to_metric_families(bridge.prometheus_text())
        theirs = text_string_to_metric_families(generate_latest(registry).decode())

        def described(families) -> dict[str, tuple]:
            return {
                f.name: (
                    f.type,
                    f.documentation,
                    sorted((s.name, sorted(s.labels.items()), s.value) for s in f.samples),
                )
                for f in families
            }

        def unscoped(families):
            for family in families:
                for sample in family.samples:
                    for label in [k for k in sample.labels if k.startswith("otel_scope_")]:
                        del sample.labels[label]
                yield family

        ours, theirs = described(ours), described(unscoped(theirs))
        assert {"kv_prefix_query_tokens", "rdma_port_tx_bytes", "kvscope_target_up", "target_info"} <= set(ours)
        assert ours == theirs
    finally:
        bridge.shutdown()


def test_a_render_after_values_or_series_changed_is_what_a_fresh_render_gives(metrics_server):
    """The exposition keeps each family's text while its rows stay the same: a later render, after some values
    changed and after a series went away, is the text a new bridge renders over the same snapshots."""
    text = OFFLOADING.read_text()
    queries = 'vllm:prefix_cache_queries_total{engine="0",model_name="synthetic/model-8b"} %s'
    url = metrics_server.serve("/metrics", text)
    config = parse_config(
        {"exporter": {"listen_port": 0}, "targets": [{"name": "vllm-a", "source": "vllm", "url": url}]}
    )
    scraper = Scraper(config.targets)
    kept = TelemetryBridge(scraper, config.exporter)
    try:
        busier = text.replace(queries % "18432.0", queries % "20000.0")  # a value changed
        for body in (text, busier, "\n".join(line for line in busier.splitlines() if 'engine="1"' not in line)):
            metrics_server.serve("/metrics", body)
            scrape_once(scraper)
            fresh = TelemetryBridge(scraper, config.exporter)
            try:
                assert kept.prometheus_text() == fresh.prometheus_text()
            finally:
                fresh.shutdown()
        assert 'kv_prefix_query_tokens_total{engine="0",layer="gpu",target="vllm-a"} 20000.0' in kept.prometheus_text()
    finally:
        kept.shutdown()


def test_the_endpoint_compresses_when_asked_and_serves_nothing_else(bridge_factory):
    bridge = bridge_factory()
    url = f"http://127.0.0.1:{bridge.serve()}"
    plain = httpx.get(f"{url}/metrics", headers={"Accept-Encoding": "identity"})
    assert "content-encoding" not in plain.headers and int(plain.headers["content-length"]) == len(plain.content)
    compressed = httpx.get(f"{url}/metrics", headers={"Accept-Encoding": "gzip"})
    assert compressed.headers["content-encoding"] == "gzip"
    assert int(compressed.headers["content-length"]) < len(plain.content) / 4
    assert compressed.text.split("# HELP python_")[0] == plain.text.split("# HELP python_")[0]  # the model, unchanged
    assert httpx.get(f"{url}/debug").status_code == 404


def test_promtool_finds_nothing_to_complain_about(bridge_factory, check_metrics):
    port = bridge_factory().serve()
    check_metrics(exposition(port))


class _OtlpReceiver(PostReceiver):
    """An OTLP/HTTP metrics endpoint: decodes each ExportMetricsServiceRequest it is sent."""

    def __init__(self) -> None:
        super().__init__("application/x-protobuf")
        self.endpoint = f"{self.url}/v1/metrics"

    @property
    def requests(self) -> list[ExportMetricsServiceRequest]:
        decoded = []
        for _, body in list(self.posts):
            decoded.append(ExportMetricsServiceRequest())
            decoded[-1].ParseFromString(body)
        return decoded

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
        receiver.stop()


def test_a_real_prometheus_scrapes_the_exporter(bridge_factory, real_binary, tmp_path):
    binary = real_binary("prometheus")
    exporter_port = bridge_factory().serve()
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s}\n"
        f"scrape_configs: [{{job_name: kvscope, static_configs: [{{targets: ['127.0.0.1:{exporter_port}']}}]}}]\n"
    )
    prometheus = start_prometheus(binary, tmp_path / "prometheus.yml", tmp_path / "data", tmp_path / "prometheus.log")
    try:
        prometheus.wait_ready("Prometheus")
        query = 'kv_prefix_query_tokens_total{layer="gpu",target="vllm-a"}'

        def answered() -> list[dict]:
            return httpx.get(f"{prometheus.url}/api/v1/query", params={"query": query}).json()["data"]["result"]

        result = wait_for(answered, f"Prometheus to return {query}", 30, 0.5)
        assert float(result[0]["value"][1]) == 18432
        assert result[0]["metric"]["job"] == "kvscope"
    finally:
        prometheus.stop()
