"""The OpenTelemetry bridge: the KV-tier model's instruments as observable instruments over the scrape snapshots.

Callbacks only read the targets' last successful scrape (a target that is down exports nothing rather than
stale values). Readers: a Prometheus endpoint on 127.0.0.1 (PrometheusMetricReader behind prometheus_client's
HTTP server) and, when configured, an OTLP exporter over HTTP or gRPC. Every series carries the `target` it came
from, so two servers that both call their engine "0" stay apart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from prometheus_client import REGISTRY, start_http_server

from kvscope import __version__
from kvscope.exporters.config import ExporterSettings, OtlpConfig
from kvscope.exporters.scrape import Scraper, TargetState
from kvscope.model import INSTRUMENTS


class TelemetryBridge:
    def __init__(self, scraper: Scraper, settings: ExporterSettings) -> None:
        self.scraper = scraper
        self.settings = settings
        self.prometheus_reader = PrometheusMetricReader()
        readers: list[MetricReader] = [self.prometheus_reader]
        if settings.otlp is not None:
            readers.append(_otlp_reader(settings.otlp))
        resource = Resource.create({"service.name": "kvscope-exporter", "service.version": __version__})
        self.provider = MeterProvider(metric_readers=readers, resource=resource)
        meter = self.provider.get_meter("kvscope.exporters", __version__)
        for instrument in INSTRUMENTS.values():
            create = meter.create_observable_counter if instrument.kind == "counter" else meter.create_observable_gauge
            create(
                instrument.name,
                callbacks=[partial(self._observe_model, instrument.name)],
                unit=instrument.unit,
                description=instrument.description,
            )
        meter.create_observable_gauge(
            "kvscope.target.up",
            [partial(self._observe_targets, lambda state: int(state.up))],
            unit="1",
            description="1 if the target's last scrape worked",
        )
        meter.create_observable_gauge(
            "kvscope.scrape.duration",
            [partial(self._observe_targets, lambda state: state.duration_s)],
            unit="s",
            description="duration of the last scrape",
        )
        meter.create_observable_counter(
            "kvscope.scrape.errors",
            [partial(self._observe_targets, lambda state: state.errors)],
            unit="{scrape}",
            description="scrapes that failed",
        )
        meter.create_observable_counter(
            "kvscope.source.read_errors",
            [self._observe_read_errors],
            unit="{read}",
            description="parts of a target (files, RPC answers) a scrape could not read, by reason",
        )
        meter.create_observable_counter(
            "kvscope.source.resets",
            [partial(self._observe_targets, lambda state: state.reset_count)],
            unit="{reset}",
            description="source counters seen going backwards (a restarted source)",
        )
        self._server = None

    def serve(self) -> int:
        """Start the Prometheus endpoint; returns the port it listens on (useful when configured as 0)."""
        self._server, _thread = start_http_server(
            self.settings.listen_port, addr=self.settings.listen_host, registry=REGISTRY
        )
        return self._server.server_port

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        self.provider.shutdown()

    def _observe_model(self, name: str, _options: CallbackOptions) -> Iterable[Observation]:
        for state in self.scraper.states.values():
            if state.up:
                target = state.config.name
                for sample in state.normalized:
                    if sample.name == name:
                        yield Observation(sample.value, {**sample.label_map, "target": target})

    def _observe_targets(
        self, read: Callable[[TargetState], float], _options: CallbackOptions
    ) -> Iterable[Observation]:
        """One observation per target of `read(state)`: up, last duration, errors, resets."""
        for name, state in self.scraper.states.items():
            yield Observation(read(state), {"target": name, "source": state.config.source})

    def _observe_read_errors(self, _options: CallbackOptions) -> Iterable[Observation]:
        for name, state in self.scraper.states.items():
            for reason, count in state.read_errors.items():
                yield Observation(count, {"target": name, "source": state.config.source, "reason": reason})


def _otlp_reader(config: OtlpConfig) -> PeriodicExportingMetricReader:
    if config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcExporter

        exporter = GrpcExporter(endpoint=config.endpoint, insecure=config.insecure)
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpExporter

        exporter = HttpExporter(endpoint=config.endpoint)
    return PeriodicExportingMetricReader(exporter, export_interval_millis=config.interval_s * 1000)
