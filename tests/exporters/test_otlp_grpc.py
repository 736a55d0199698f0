"""The bridge's OTLP export over gRPC, to a real OTLP/gRPC metrics receiver inside the test process: a grpc.server
on 127.0.0.1 implementing opentelemetry-proto's MetricsService, sent what one scrape of the vLLM fixture (served
over HTTP by the test's metrics server) gives the KV-tier model."""

from __future__ import annotations

import threading
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from support.realservers import scrape_once

from kvscope.exporters.config import parse_config
from kvscope.exporters.otel import TelemetryBridge
from kvscope.exporters.scrape import Scraper

OFFLOADING = (
    Path(__file__).resolve().parent.parent
    / "fixtures"
    / "vllm"
    / "metrics_rendered_v0.33.0_offloading_kvcachemetrics_SYNTHETIC.txt"
)


class _Receiver(metrics_service_pb2_grpc.MetricsServiceServicer):
    """Keeps every ExportMetricsServiceRequest it is sent; answers success."""

    def __init__(self) -> None:
        self.requests: list[metrics_service_pb2.ExportMetricsServiceRequest] = []
        self._lock = threading.Lock()

    def Export(self, request, context):  # the generated servicer's method name
        with self._lock:
            self.requests.append(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


@pytest.fixture
def receiver():
    servicer = _Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")  # 0: a free port, chosen by the kernel
    assert port
    server.start()
    servicer.port = port
    yield servicer
    server.stop(None)


def _metrics(requests) -> dict[str, tuple]:
    """name -> (the metric, its resource's attributes), from the last request that carried it."""
    found = {}
    for request in requests:
        for resource in request.resource_metrics:
            attributes = {a.key: a.value.string_value for a in resource.resource.attributes}
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    found[metric.name] = (metric, attributes)
    return found


def _points(metric) -> dict[frozenset, float]:
    data = metric.sum if metric.HasField("sum") else metric.gauge
    return {
        frozenset((a.key, a.value.string_value) for a in point.attributes): (
            point.as_double if point.HasField("as_double") else point.as_int
        )
        for point in data.data_points
    }


def test_otlp_grpc_receiver_gets_the_models_metrics_with_names_units_values_and_target(receiver, metrics_server):
    url = metrics_server.serve("/metrics", OFFLOADING.read_bytes())
    otlp = {"protocol": "grpc", "endpoint": f"127.0.0.1:{receiver.port}", "insecure": True, "interval_s": 0.2}
    config = parse_config(
        {
            "exporter": {"listen_port": 0, "otlp": otlp},
            "targets": [{"name": "vllm-a", "source": "vllm", "url": url}],
        }
    )
    scraper = Scraper(config.targets)
    scrape_once(scraper)  # a real scrape of the fixture over HTTP, through the vLLM mapping
    assert scraper.states["vllm-a"].up, scraper.states["vllm-a"].last_error
    bridge = TelemetryBridge(scraper, config.exporter)
    try:
        assert bridge.provider.force_flush(10_000)  # an export now, not after the interval
    finally:
        bridge.shutdown()
    assert receiver.requests, "the receiver was sent nothing"
    metrics = _metrics(receiver.requests)

    query, resource = metrics["kv.prefix.query.tokens"]
    assert resource["service.name"] == "kvscope-exporter"
    assert query.unit == "{token}"
    assert query.HasField("sum") and query.sum.is_monotonic  # a counter is a monotonic cumulative sum
    assert query.sum.aggregation_temporality == 2  # AGGREGATION_TEMPORALITY_CUMULATIVE
    assert _points(query)[frozenset({("engine", "0"), ("layer", "gpu"), ("target", "vllm-a")})] == 18432

    dram = frozenset({("system", "vllm_offload:0"), ("tier", "dram"), ("target", "vllm-a")})
    put, _ = metrics["kv.store.put.bytes"]
    get, _ = metrics["kv.store.get.bytes"]
    assert put.unit == get.unit == "By"
    assert _points(put)[dram] == 75497472
    assert _points(get)[dram] == 37748736

    up, _ = metrics["kvscope.target.up"]
    assert up.HasField("gauge") and up.unit == "1"
    assert _points(up) == {frozenset({("target", "vllm-a"), ("source", "vllm")}): 1}
    # every model point names the target it came from
    for name, (metric, _) in metrics.items():
        if name.startswith("kv."):
            assert all(dict(labels).get("target") == "vllm-a" for labels in _points(metric)), name
