"""The telemetry bridge: the KV-tier model's instruments, and kvscope's own series about each target, over the scrape
snapshots, on a Prometheus endpoint and, when configured, over OTLP.

Both read only the targets' last successful scrape (a target that is down exports nothing rather than stale
values), and every model series carries the `target` it came from, so two servers that both call their engine "0"
stay apart. The Prometheus endpoint on 127.0.0.1 renders the snapshots itself (exporters.exposition: each series'
text kept between scrapes) under the names OpenTelemetry's Prometheus exporter gives the same instruments; OTLP
(HTTP or gRPC) goes through the OpenTelemetry SDK's observable instruments, whose callbacks only read.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from prometheus_client import REGISTRY, generate_latest

from kvscope import __version__
from kvscope.exporters.config import ExporterSettings, OtlpConfig
from kvscope.exporters.exposition import Exposition, Family, MetricsServer, Row
from kvscope.exporters.process_metrics import use_lean_process_collector
from kvscope.exporters.scrape import Scraper, TargetState
from kvscope.model import INSTRUMENTS


@dataclass(frozen=True, slots=True)
class TargetInstrument:
    """One of kvscope's own series about each target (labels `target` and `source`): what it reads of the state."""

    name: str
    kind: str
    unit: str
    description: str
    read: Callable[[TargetState], Iterable[tuple[dict[str, str], float]]]  # extra labels and a value


TARGET_INSTRUMENTS = (
    TargetInstrument(
        "kvscope.target.up", "gauge", "1", "1 if the target's last scrape worked", lambda s: [({}, int(s.up))]
    ),
    TargetInstrument(
        "kvscope.scrape.duration", "gauge", "s", "duration of the last scrape", lambda s: [({}, s.duration_s)]
    ),
    TargetInstrument("kvscope.scrape.errors", "counter", "{scrape}", "scrapes that failed", lambda s: [({}, s.errors)]),
    TargetInstrument(
        "kvscope.source.read_errors",
        "counter",
        "{read}",
        "parts of a target (files, RPC answers) a scrape could not read, by reason",
        lambda s: [({"reason": reason}, count) for reason, count in s.read_errors.items()],
    ),
    TargetInstrument(
        "kvscope.source.resets",
        "counter",
        "{reset}",
        "source counters seen going backwards (a restarted source)",
        lambda s: [({}, s.reset_count)],
    ),
)


class TelemetryBridge:
    def __init__(self, scraper: Scraper, settings: ExporterSettings, readers: Sequence[MetricReader] = ()) -> None:
        """`readers`: OpenTelemetry metric readers besides OTLP's (another exporter of the same instruments)."""
        self.scraper = scraper
        self.settings = settings
        use_lean_process_collector()  # the process_* series of metrics_body, read cheaply
        resource = Resource.create({"service.name": "kvscope-exporter", "service.version": __version__})
        attributes = {key: v if isinstance(v, str) else json.dumps(v) for key, v in resource.attributes.items()}
        self.exposition = Exposition(attributes)
        self._model_families = {i.name: Family.of(i.name, i.kind, i.unit, i.description) for i in INSTRUMENTS.values()}
        self._target_families = [(i, Family.of(i.name, i.kind, i.unit, i.description)) for i in TARGET_INSTRUMENTS]
        if settings.otlp is not None:
            readers = [*readers, _otlp_reader(settings.otlp)]
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
        for own in TARGET_INSTRUMENTS:
            create = meter.create_observable_counter if own.kind == "counter" else meter.create_observable_gauge
            create(own.name, [partial(self._observe_targets, own)], unit=own.unit, description=own.description)
        self._server: MetricsServer | None = None

    def serve(self) -> int:
        """Start the Prometheus endpoint; returns the port it listens on (useful when configured as 0)."""
        self._server = MetricsServer(self.settings.listen_host, self.settings.listen_port, self.metrics_body)
        return self._server.port

    def metrics_body(self) -> bytes:
        """The whole /metrics text: the model and the targets' own series, then the process' registry (process,
        Python runtime, and in the service its own metrics)."""
        return self.prometheus_text().encode() + generate_latest(REGISTRY)

    def prometheus_text(self) -> str:
        """The model's series of every target that is up, and kvscope's own series of every target."""
        model: dict[str, list[Row]] = {name: [] for name in self._model_families}
        states = list(self.scraper.states.values())
        for state in states:
            if state.up:
                target = state.config.name
                for sample in state.normalized:
                    model[sample.name].append((sample.labels, target, sample.value))
        families = [(self._model_families[name], rows) for name, rows in model.items()]
        for own, family in self._target_families:
            families.append((family, [row for state in states for row in _target_rows(own, state)]))
        return self.exposition.render(families)

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        self.provider.shutdown()

    def _observe_model(self, name: str, _options: CallbackOptions) -> Iterable[Observation]:
        for state in self.scraper.states.values():
            if state.up:
                target = state.config.name
                for sample in state.normalized:
                    if sample.name == name:
                        yield Observation(sample.value, {**sample.label_map, "target": target})

    def _observe_targets(self, own: TargetInstrument, _options: CallbackOptions) -> Iterable[Observation]:
        for state in self.scraper.states.values():
            for labels, _, value in _target_rows(own, state):
                yield Observation(value, dict(labels))


def _target_rows(own: TargetInstrument, state: TargetState) -> Iterable[Row]:
    """`own`'s rows for one target: its `target` and `source` labels, and what it reads."""
    for extra, value in own.read(state):
        labels = {"target": state.config.name, "source": state.config.source, **extra}
        yield tuple(sorted(labels.items())), None, value


def _otlp_reader(config: OtlpConfig) -> PeriodicExportingMetricReader:
    if config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcExporter

        exporter = GrpcExporter(endpoint=config.endpoint, insecure=config.insecure)
    else:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpExporter

        exporter = HttpExporter(endpoint=config.endpoint)
    return PeriodicExportingMetricReader(exporter, export_interval_millis=config.interval_s * 1000)
