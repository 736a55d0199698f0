"""Import from a Prometheus server's HTTP API (Prometheus, Mimir, Thanos...) into the verifier database.

The path for clusters whose Prometheus already holds the counters. Each selector's raw samples are read with a
range-vector query (`/api/v1/query` of `selector[D]` at the end of each chunk of the window: every sample
Prometheus holds in (end - D, end], none interpolated), the window cut into chunks of at most 11,000 `step`s, one
flush per chunk: give `step` as the scrape interval so a chunk stays under Prometheus' sample limits.

What lands where:
- Raw samples keep every counter reset and every increase whatever `step` is. `query_range` would return the value
  at each step (the last sample within Prometheus' lookback): a step longer than the scrape interval loses
  increases across resets. A selector that is an expression (`rate(x[5m])`, `sum(...)`) has no raw samples: it is
  read with `query_range` at `step`, and the summary warns that it is step-aligned.
- A series whose name is the Prometheus name of a KV-tier model instrument (kv_store_put_bytes_total) is stored
  under the instrument (kv.store.put.bytes), normalized, with the instrument's model labels only: what kvscope's
  recorder writes for the same data, so criteria compare arms whatever their origin. The other labels are not
  part of the model but of the way to the database (job and instance from the scrape, otel_scope_* from the
  OpenTelemetry exporter, a cluster's external labels); which of job and instance Prometheus added cannot be told
  from the data (honor_labels), so the rule keys on the model, not on guessing where a label came from.
- Any other series is stored raw under its own name with every label but `__name__`: Prometheus' identity of the
  series, so an auditor can query exactly it again. Its kind is a guess from the name (Prometheus' query API does
  not return types): "counter" if it ends in `_total`, else "gauge"; histogram `_bucket`/`_count`/`_sum` and
  counters named without `_total` are therefore stored as "gauge".
- A series' target is its `target` label (kvscope's exporter sets it), else `instance`, else `job`, else the
  selector. A series without a name (the result of an expression such as `rate(x[5m])`) is stored raw under the
  selector's text.
- NaN and ±Inf values are skipped and counted. A series matched by two selectors is imported once; two
  Prometheus series that would land on one database series (HA replicas, two jobs scraping one exporter) are an
  error: narrow the selector.

Failures: a selector matching nothing is reported in the summary; every selector matching nothing, or no finite
sample at all, is an error. The run is created when the first series arrives, so an import that fails before
leaves nothing behind. One that fails later leaves earlier runs untouched and its own run with the chunks written
so far and `ended_at` NULL (a run that finished cleanly has `ended_at` = the end of the window); the exception
says so.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

import httpx
import numpy as np

from kvscope.model import instrument_for_prometheus_name
from kvscope.samples import Kind, Sample, labels_of
from kvscope.verifier.db import Database, SampleWriter, VerifierError

MAX_POINTS = 11_000  # Prometheus' limit of points per series in one query_range answer
SOURCE = "prometheus"


class PrometheusImportError(VerifierError):
    """An import that failed; the message names the selector, the window, the server and what it answered."""


@dataclass
class ImportSummary:
    """What an import did, for the command's report: a selector matching nothing shows here, not as an error."""

    run: str
    series: int = 0
    samples: int = 0
    skipped_nonfinite: int = 0  # NaN and ±Inf values, not stored
    duplicate_series: int = 0  # series an earlier selector already imported
    requests: int = 0
    series_by_selector: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # Prometheus' own (e.g. a partial answer from a store)

    @property
    def empty_selectors(self) -> list[str]:
        return [selector for selector, count in self.series_by_selector.items() if count == 0]


def parse_time(text: str) -> float:
    """Unix seconds from "1733011200[.5]" or RFC3339 "2024-12-01T00:00:00Z" (an offset is required: no guessing)."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = _rfc3339(text)
    if not math.isfinite(seconds):
        raise VerifierError(f"invalid time {text!r}: expected unix seconds or RFC3339 (2024-12-01T00:00:00Z)")
    return seconds


def _rfc3339(text: str) -> float:
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise VerifierError(f"invalid time {text!r}: expected unix seconds or RFC3339 (2024-12-01T00:00:00Z)") from None
    if moment.tzinfo is None:
        raise VerifierError(f"invalid time {text!r}: give its offset (Z or +02:00), as RFC3339 requires")
    return moment.timestamp()


def chunk_windows(start: float, end: float, step: float, max_points: int = MAX_POINTS) -> list[tuple[float, float]]:
    """[start, end] cut into windows of at most `max_points` evaluation times, none shared between windows.

    In milliseconds, as Prometheus evaluates, so the chunks' steps line up exactly with a single query's.
    """
    start_ms, end_ms, step_ms = round(start * 1000), round(end * 1000), round(step * 1000)
    if step_ms <= 0:
        raise VerifierError(f"step must be at least 1 ms, not {step!r}")
    if end_ms < start_ms:
        raise VerifierError(f"the window ends ({_when(end)}) before it starts ({_when(start)})")
    if max_points < 1:
        raise VerifierError(f"max_points must be at least 1, not {max_points!r}")
    span_ms = max_points * step_ms
    return [
        (first / 1000, min(first + span_ms - step_ms, end_ms) / 1000) for first in range(start_ms, end_ms + 1, span_ms)
    ]


def import_prometheus(
    db: Database,
    url: str,
    selectors: Sequence[str],
    start: float,
    end: float,
    step: float,
    run_name: str,
    arm: str | None = None,
    cluster: str | None = None,
    client: httpx.Client | None = None,
    *,
    bearer_token: str | None = None,
    timeout_s: float = 60.0,
    max_points: int = MAX_POINTS,
) -> ImportSummary:
    """Import `selectors` over [start, end] (unix seconds) every `step` seconds into a new run `run_name`.

    Basic auth comes from the URL (http://user:password@host/); `bearer_token` sets an Authorization header.
    A `client` given is used as is (its own auth, headers such as Mimir's X-Scope-OrgID, timeout).
    """
    selectors = list(dict.fromkeys(selectors))  # a selector given twice would import its series twice
    if not selectors:
        raise VerifierError("no selector to import: give at least one PromQL selector")
    windows = chunk_windows(start, end, step, max_points)
    db.require_new_run(run_name)  # before any request, not after the first answer
    public_url = _public_url(url)
    config = {
        "url": public_url,
        "selectors": selectors,
        "start": start,
        "end": end,
        "step": step,
        "imported_at": time.time(),
    }
    importer = _Importer(db, _RunSpec(run_name, arm, cluster, config, start), public_url)
    http = client or _client(bearer_token, timeout_s)
    try:
        for selector in selectors:
            importer.summary.series_by_selector.setdefault(selector, 0)
            raw = True
            for window in windows:
                if raw:
                    try:
                        result, warnings = _query_raw(http, url, public_url, selector, window, step, start)
                    except _NotASeriesSelector:
                        raw = False
                        importer.summary.warnings.append(
                            f"{selector!r} is an expression, not a series selector: it has no raw samples, so it was "
                            f"read every {step:g} s (query_range), and increases between those points may be lost"
                        )
                if not raw:
                    result, warnings = _query_range(http, url, public_url, selector, window, step)
                importer.summary.requests += 1
                importer.summary.warnings.extend(warnings)
                importer.add(selector, result)
        return importer.finish(end)
    except Exception as error:
        if importer.writer is None:
            raise
        raise PrometheusImportError(f"{error}; {importer.unfinished()}") from error
    finally:
        if client is None:
            http.close()


def _public_url(url: str) -> str:
    """`url` without its credentials: what the run's config and the messages show."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as error:
        raise VerifierError(f"invalid Prometheus URL {url!r}: {error}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise VerifierError(f"invalid Prometheus URL {url!r}: expected http://host:port or https://host/path")
    return str(parsed.copy_with(username=None, password=None))


def _client(bearer_token: str | None, timeout_s: float) -> httpx.Client:
    headers = {"Authorization": f"Bearer {bearer_token}"} if bearer_token else {}
    return httpx.Client(timeout=timeout_s, headers=headers)


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class _NotASeriesSelector(Exception):
    """Prometheus refused a range over the selector: it is an expression."""


def _query_raw(
    http: httpx.Client,
    url: str,
    public_url: str,
    selector: str,
    window: tuple[float, float],
    step: float,
    start: float,
) -> tuple[list[dict], list[str]]:
    """The raw samples of `selector` in the window's chunk (its first evaluation time less one step, its last],
    those before the import's `start` left out; raises _NotASeriesSelector for an expression."""
    first_ms, last_ms, step_ms = round(window[0] * 1000), round(window[1] * 1000), round(step * 1000)
    query = f"{selector}[{last_ms - first_ms + step_ms}ms]"
    what = f"query {query!r} at {_when(window[1])} at {public_url}"
    form = {"query": query, "time": f"{window[1]:.3f}"}
    result, warnings = _matrix(http, url.rstrip("/") + "/api/v1/query", form, what, refused_range=True)
    for series in result:
        series["values"] = [point for point in series.get("values") or [] if float(point[0]) >= start]
    return result, warnings


def _query_range(
    http: httpx.Client,
    url: str,
    public_url: str,
    selector: str,
    window: tuple[float, float],
    step: float,
) -> tuple[list[dict], list[str]]:
    """One query_range request: the result series and Prometheus' warnings, or an error that says what failed."""
    endpoint = url.rstrip("/") + "/api/v1/query_range"
    what = f"query_range {selector!r} from {_when(window[0])} to {_when(window[1])} at {public_url}"
    form = {"query": selector, "start": f"{window[0]:.3f}", "end": f"{window[1]:.3f}", "step": f"{step:.3f}"}
    return _matrix(http, endpoint, form, what)


def _matrix(
    http: httpx.Client, endpoint: str, form: dict[str, str], what: str, refused_range: bool = False
) -> tuple[list[dict], list[str]]:
    """One API request answered with a matrix: its series and Prometheus' warnings, or an error that says what
    failed. With `refused_range`, Prometheus refusing a range over the query raises _NotASeriesSelector."""
    try:
        response = http.post(endpoint, data=form)
    except httpx.TimeoutException as error:
        raise PrometheusImportError(f"{what}: no answer in time ({type(error).__name__})") from error
    except httpx.TransportError as error:
        raise PrometheusImportError(f"{what}: cannot reach the server: {error}") from error
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict) or response.status_code != 200 or body.get("status") != "success":
        answer = body if isinstance(body, dict) else {}
        if refused_range and answer.get("errorType") == "bad_data" and "range" in str(answer.get("error")):
            raise _NotASeriesSelector
        raise PrometheusImportError(f"{what}: {_failure(response, body)}")
    data = body.get("data") or {}
    if data.get("resultType") != "matrix":
        raise PrometheusImportError(f"{what}: expected a matrix, got resultType {data.get('resultType')!r}")
    return data.get("result") or [], body.get("warnings") or []


def _failure(response: httpx.Response, body: object) -> str:
    """HTTP status with Prometheus' errorType and error, or the start of a body that is not Prometheus' JSON."""
    status = f"HTTP {response.status_code} {response.reason_phrase}".rstrip()
    if isinstance(body, dict) and "error" in body:
        return f"{status}: {body.get('errorType', 'error')}: {body['error']}"
    text = " ".join(response.text.split())[:200]
    return f"{status}: {text}" if text else status


@dataclass(frozen=True, slots=True)
class _RunSpec:
    name: str
    arm: str | None
    cluster: str | None
    config: dict
    started_at: float


class _Importer:
    """The state of one import: the run (created with its first series), the series seen, the summary."""

    def __init__(self, db: Database, spec: _RunSpec, public_url: str) -> None:
        self.db, self.spec, self.public_url = db, spec, public_url
        self.summary = ImportSummary(spec.name)
        self.writer: SampleWriter | None = None
        self._series: dict[frozenset, tuple[str, int]] = {}  # Prometheus series -> (its selector, database id)
        self._origin: dict[int, frozenset] = {}  # database series id -> the Prometheus series stored in it
        self._duplicates: set[tuple[frozenset, str]] = set()

    def add(self, selector: str, result: list[dict]) -> None:
        """One chunk's series, appended as columns and flushed as one batch."""
        ids, ts, values = [], [], []
        for series in result:
            series_id = self._series_id(selector, series.get("metric") or {})
            if series_id is None:
                continue
            points = series.get("values") or []
            ids.append(np.full(len(points), series_id, dtype=np.int32))
            ts.append(np.fromiter((point[0] for point in points), dtype=np.float64, count=len(points)))
            values.append(np.array([point[1] for point in points], dtype=str).astype(np.float64))
        if ids:
            self._append(np.concatenate(ids), np.concatenate(ts), np.concatenate(values))

    def _append(self, ids: np.ndarray, ts: np.ndarray, values: np.ndarray) -> None:
        finite = np.isfinite(values)
        kept = int(finite.sum())
        self.summary.samples += kept
        self.summary.skipped_nonfinite += len(values) - kept
        writer = self._writer()
        writer.append_columns(ids[finite], ts[finite], values[finite])
        writer.flush()

    def _series_id(self, selector: str, metric: dict[str, str]) -> int | None:
        """The database series of a Prometheus series; None if an earlier selector already imported it."""
        identity = frozenset(metric.items())
        if identity in self._series:
            owner, series_id = self._series[identity]
            if owner == selector:
                return series_id
            self._duplicates.add((identity, selector))
            self.summary.duplicate_series = len(self._duplicates)
            return None
        target, sample = _sample(selector, metric)
        writer = self._writer()
        series_id = writer.series_id(target, sample)
        first = self._origin.setdefault(series_id, identity)
        if first != identity:
            raise PrometheusImportError(
                f"{_show(first)} and {_show(identity)} would both be stored as {sample.name} "
                f"{dict(sample.labels)} of target {target!r}: narrow the selector {selector!r} to one of them"
            )
        self._series[identity] = (selector, series_id)
        self.summary.series += 1
        self.summary.series_by_selector[selector] += 1
        self.db.add_target(writer.run, target, SOURCE, {"prometheus": self.public_url, **_scrape_labels(metric)})
        return series_id

    def _writer(self) -> SampleWriter:
        """The run's writer, creating the run on first use."""
        if self.writer is None:
            spec = self.spec
            run = self.db.create_run(
                spec.name,
                origin=SOURCE,
                arm=spec.arm,
                scenario=spec.cluster,
                config=spec.config,
                started_at=spec.started_at,
            )
            self.writer = self.db.writer(run)
        return self.writer

    def finish(self, end: float) -> ImportSummary:
        """Mark the run finished, or fail if nothing usable came back."""
        summary, window = self.summary, f"{_when(self.spec.started_at)} to {_when(end)}"
        if not summary.series:
            raise PrometheusImportError(
                f"no selector matched any series from {window} at {self.public_url} "
                f"({', '.join(map(repr, summary.series_by_selector))}): check the names, labels and window"
            )
        if not summary.samples:
            raise PrometheusImportError(
                f"{summary.series} series matched from {window} at {self.public_url}, "
                f"but every value was NaN or Inf ({summary.skipped_nonfinite} skipped)"
            )
        assert self.writer is not None  # series were stored
        self.db.finish_run(self.writer.run, ended_at=end)
        return summary

    def unfinished(self) -> str:
        """What a failure leaves behind, for the exception's message."""
        assert self.writer is not None  # only asked once the run exists
        return (
            f"run {self.spec.name!r} is left unfinished (ended_at NULL) with the {self.writer.rows_written} samples "
            "committed before the failure; import again under another --run name"
        )


def _sample(selector: str, metric: dict[str, str]) -> tuple[str, Sample]:
    """The target and the (value-less) sample that names the database series of a Prometheus series."""
    name = metric.get("__name__")
    target = metric.get("target") or metric.get("instance") or metric.get("job") or selector
    instrument = instrument_for_prometheus_name(name) if name else None
    if instrument is not None:
        labels = {key: metric[key] for key in instrument.labels if key in metric}
        return target, Sample(SOURCE, instrument.name, labels_of(labels), 0.0, instrument.kind, normalized=True)
    labels = {key: value for key, value in metric.items() if key != "__name__"}
    kind: Kind = "counter" if name and name.endswith("_total") else "gauge"
    return target, Sample(SOURCE, name or selector, labels_of(labels), 0.0, kind)


def _scrape_labels(metric: dict[str, str]) -> dict[str, str]:
    return {key: metric[key] for key in ("job", "instance") if key in metric}


def _show(identity: frozenset) -> str:
    labels = dict(identity)
    name = labels.pop("__name__", "")
    return name + "{" + ",".join(f'{key}="{value}"' for key, value in sorted(labels.items())) + "}"
