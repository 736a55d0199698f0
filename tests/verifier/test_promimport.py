"""Import from a real Prometheus (Debian package prometheus) whose TSDB promtool pre-filled with known samples."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from opentelemetry.exporter.prometheus._mapping import map_unit, sanitize_full_name
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily
from support.realservers import start_prometheus

from kvscope.model import INSTRUMENTS, instrument_for_prometheus_name, prometheus_name
from kvscope.processes import free_port
from kvscope.verifier.db import Database, VerifierError, run_sql
from kvscope.verifier.promimport import (
    PrometheusImportError,
    chunk_windows,
    import_prometheus,
    parse_time,
)

STEP = 60
PUT = "kv_store_put_bytes_total"
ALLOCATED = "kv_tier_allocated_bytes"
QUERIES = "vllm:prefix_cache_queries_total"
SEGMENT = "mooncake_segment_used_bytes"
GET = "kv_store_get_bytes_total"
EXPORTER = 'job="kvscope",instance="127.0.0.1:9464"'

# name, labels, six values one STEP apart: a counter reset after 300, NaN and +Inf in a gauge, two raw series,
# and two series that differ only in their scrape labels (they would land on one database series)
SERIES = (
    (PUT, f'system="s",tier="dram",target="t",otel_scope_name="kvscope",{EXPORTER}', (100, 200, 300, 10, 20, 30)),
    (ALLOCATED, f'system="s",tier="nof",{EXPORTER}', (0, "NaN", 4096, "+Inf", 4096, 8192)),
    (QUERIES, 'engine="0",job="vllm"', (1000, 2000, 3000, 4000, 5000, 6000)),
    (SEGMENT, 'segment="seg0",job="mooncake",instance="10.0.0.2:9003"', (5, 6, 7, 8, 9, 10)),
    (GET, 'system="s",tier="ssd",target="t",job="a"', (1, 2, 3, 4, 5, 6)),
    (GET, 'system="s",tier="ssd",target="t",job="b"', (1, 2, 3, 4, 5, 6)),
)
FAMILIES = {PUT: "counter", ALLOCATED: "gauge", QUERIES: "counter", SEGMENT: "gauge", GET: "counter"}


def openmetrics(t0: int) -> str:
    """The OpenMetrics text of SERIES from t0: families grouped, counters declared without `_total`, `# EOF`."""
    lines = []
    for family, kind in FAMILIES.items():
        lines.append(f"# TYPE {family.removesuffix('_total')} {kind}")
        for name, labels, values in SERIES:
            if name == family:
                lines += [f"{name}{{{labels}}} {value} {t0 + i * STEP}" for i, value in enumerate(values)]
    return "\n".join([*lines, "# EOF", ""])


@dataclass
class Server:
    url: str
    t0: int  # the first sample's time, a whole minute within the last two hours


@pytest.fixture(scope="module")
def prometheus_server(tmp_path_factory):
    """A Prometheus on 127.0.0.1 serving SERIES, started once for the module; None when not installed."""
    prometheus, promtool = shutil.which("prometheus"), shutil.which("promtool")
    if prometheus is None or promtool is None:
        yield None
        return
    folder = tmp_path_factory.mktemp("prometheus")
    t0 = int(time.time()) // 60 * 60 - 3600
    (folder / "samples.om").write_text(openmetrics(t0))
    subprocess.run(
        [promtool, "tsdb", "create-blocks-from", "openmetrics", str(folder / "samples.om"), str(folder / "data")],
        check=True,
        capture_output=True,
    )
    (folder / "prometheus.yml").write_text("scrape_configs: []\n")
    process = start_prometheus(prometheus, folder / "prometheus.yml", folder / "data", folder / "prometheus.log")
    try:
        process.wait_ready("Prometheus")
        yield Server(process.url, t0)
    finally:
        process.stop()


@pytest.fixture
def prom(prometheus_server, require_real) -> Server:
    require_real(prometheus_server is not None, "prometheus/promtool are not installed (Debian package prometheus)")
    return prometheus_server


@pytest.fixture
def db(tmp_path):
    with Database(tmp_path / "kv.duckdb") as database:
        yield database


def rows(db: Database, run: str) -> dict[tuple, list[tuple[float, float]]]:
    """(target, source, name, kind, normalized, labels) -> [(ts, value)] of a run."""
    found: dict[tuple, list[tuple[float, float]]] = {}
    for target, source, name, kind, normalized, labels, ts, value in run_sql(
        db.con,
        "SELECT target, source, name, kind, normalized, labels, ts, value FROM sample_rows WHERE run = ? "
        "ORDER BY name, labels, ts",
        [run],
    ):
        key = (target, source, name, kind, normalized, tuple(sorted(json.loads(labels).items())))
        found.setdefault(key, []).append((ts, value))
    return found


def window(prom: Server, start: int = 0, end: int = 5) -> dict[str, float]:
    return {"start": prom.t0 + start * STEP, "end": prom.t0 + end * STEP, "step": STEP}


# ------------------------------------------------------------------------------------- the name mapping


def test_prometheus_names_are_what_the_opentelemetry_exporter_writes():
    for instrument in INSTRUMENTS.values():
        family = CounterMetricFamily if instrument.kind == "counter" else GaugeMetricFamily
        exported = family(sanitize_full_name(instrument.name), "", unit=map_unit(instrument.unit))
        exported.add_metric([], 1)
        assert prometheus_name(instrument) == exported.samples[0].name
        assert instrument_for_prometheus_name(exported.samples[0].name) is instrument
    assert prometheus_name(INSTRUMENTS["kv.store.put.bytes"]) == "kv_store_put_bytes_total"
    assert prometheus_name(INSTRUMENTS["kv.tier.allocated.bytes"]) == "kv_tier_allocated_bytes"
    assert prometheus_name(INSTRUMENTS["kv.tier.evictions"]) == "kv_tier_evictions_total"
    assert prometheus_name(INSTRUMENTS["storage.bdev.latency"]) == "storage_bdev_latency_seconds_total"
    assert instrument_for_prometheus_name("kv_store_put_bytes") is None  # a counter is only ever seen with _total
    assert instrument_for_prometheus_name(QUERIES) is None


def test_chunks_never_exceed_the_points_limit_nor_share_a_step():
    assert chunk_windows(0, 10, 1, max_points=4) == [(0, 3), (4, 7), (8, 10)]
    assert chunk_windows(100, 100, 15) == [(100, 100)]
    assert chunk_windows(0, 10999 * 15, 15) == [(0, 10999 * 15)]
    assert chunk_windows(0, 11000 * 15, 15) == [(0, 10999 * 15), (11000 * 15, 11000 * 15)]


def test_times_as_unix_seconds_or_rfc3339():
    assert parse_time("1733011200") == parse_time("2024-12-01T00:00:00Z") == 1733011200
    assert parse_time("2024-12-01T02:00:00.5+02:00") == parse_time("1733011200.5") == 1733011200.5
    for bad in ("2024-12-01T00:00:00", "yesterday", "nan"):
        with pytest.raises(VerifierError, match="invalid time"):
            parse_time(bad)


# ------------------------------------------------------------------------------------- imports


def test_import_stores_model_series_normalized_and_the_rest_raw(prom, db):
    selectors = [PUT, ALLOCATED, QUERIES, SEGMENT, "kv_tier_evictions_total"]
    summary = import_prometheus(
        db, prom.url, selectors, **window(prom), run_name="cluster-a", arm="dram_only", cluster="prod-1"
    )

    assert (summary.series, summary.samples, summary.skipped_nonfinite) == (4, 22, 2)
    assert summary.empty_selectors == ["kv_tier_evictions_total"]
    assert summary.requests == 5 and summary.duplicate_series == 0
    run = db.run("cluster-a")
    assert (run.origin, run.arm, run.scenario) == ("prometheus", "dram_only", "prod-1")
    assert (run.started_at, run.ended_at) == (prom.t0, prom.t0 + 300)
    assert {key: run.config[key] for key in ("url", "selectors", "start", "end", "step")} == {
        "url": prom.url,
        "selectors": selectors,
        **window(prom),
    }
    ts = [prom.t0 + i * STEP for i in range(6)]
    assert rows(db, "cluster-a") == {
        key("t", "kv.store.put.bytes", "counter", True, system="s", tier="dram"): list(
            zip(ts, [100, 200, 300, 10, 20, 30], strict=True)
        ),
        key("127.0.0.1:9464", "kv.tier.allocated.bytes", "gauge", True, system="s", tier="nof"): [
            (ts[0], 0),
            (ts[2], 4096),
            (ts[4], 4096),
            (ts[5], 8192),
        ],
        key("10.0.0.2:9003", SEGMENT, "gauge", False, instance="10.0.0.2:9003", job="mooncake", segment="seg0"): list(
            zip(ts, [5, 6, 7, 8, 9, 10], strict=True)
        ),
        key("vllm", QUERIES, "counter", False, engine="0", job="vllm"): list(
            zip(ts, [1000, 2000, 3000, 4000, 5000, 6000], strict=True)
        ),
    }
    targets = run_sql(db.con, "SELECT target, source, config FROM targets WHERE run_id = ?", [run.run_id])
    exporter = {"prometheus": prom.url, "job": "kvscope", "instance": "127.0.0.1:9464"}
    assert {target: (source, json.loads(config)) for target, source, config in targets} == {
        "t": ("prometheus", exporter),
        "127.0.0.1:9464": ("prometheus", exporter),
        "10.0.0.2:9003": ("prometheus", {"prometheus": prom.url, "job": "mooncake", "instance": "10.0.0.2:9003"}),
        "vllm": ("prometheus", {"prometheus": prom.url, "job": "vllm"}),
    }


def key(target: str, name: str, kind: str, normalized: bool, **labels: str) -> tuple:
    return (target, "prometheus", name, kind, normalized, tuple(sorted(labels.items())))


def test_a_window_prometheus_refuses_whole_is_imported_in_chunks_of_raw_samples(prom, db):
    """At a 10 ms step the window is 30,001 steps: query_range refuses it whole (11,000 points at most) and would
    return 30,001 step-aligned points; the import asks three chunks for their raw samples: the six there are."""
    start, end, step = prom.t0, prom.t0 + 300, 0.01
    whole = httpx.post(f"{prom.url}/api/v1/query_range", data={"query": PUT, "start": start, "end": end, "step": step})
    assert whole.status_code == 400 and "11,000 points" in whole.json()["error"]

    summary = import_prometheus(db, prom.url, [PUT], start, end, step, run_name="fine")

    assert summary.requests == 3 and not summary.warnings
    points = next(iter(rows(db, "fine").values()))
    assert points == [(prom.t0 + i * STEP, value) for i, value in enumerate((100, 200, 300, 10, 20, 30))]
    batches = run_sql(db.con, "SELECT count(*) FROM batches WHERE run_id = ?", [db.run("fine").run_id])
    assert batches == [(3,)]  # one flush per chunk


def test_a_step_longer_than_the_scrape_interval_loses_no_increase(prom, db):
    """Samples 60 s apart with a reset after 300: at a 180 s step query_range sees 100, 10 and misses 200 -> 300 and
    20 -> 30 (an increase of 10 instead of 230); the raw samples give all of it."""
    summary = import_prometheus(db, prom.url, [PUT], prom.t0, prom.t0 + 5 * STEP, 3 * STEP, run_name="coarse")
    points = next(iter(rows(db, "coarse").values()))
    assert summary.samples == 6 and [value for _, value in points] == [100, 200, 300, 10, 20, 30]
    form = {"query": PUT, "start": prom.t0, "end": prom.t0 + 5 * STEP, "step": 3 * STEP}
    stepped = httpx.post(f"{prom.url}/api/v1/query_range", data=form).json()
    assert [float(v) for _, v in stepped["data"]["result"][0]["values"]] == [100, 10]


def test_an_expression_is_read_step_aligned_and_the_summary_says_so(prom, db):
    summary = import_prometheus(db, prom.url, [f"sum({PUT})"], **window(prom), run_name="expression")
    assert summary.samples == 6
    assert any("is an expression, not a series selector" in warning for warning in summary.warnings)


def test_a_series_two_selectors_match_is_imported_once(prom, db):
    both = '{__name__=~"kv_store_put_bytes_total|kv_tier_allocated_bytes"}'
    summary = import_prometheus(db, prom.url, [PUT, both], **window(prom), run_name="twice")

    assert (summary.series, summary.duplicate_series, summary.samples) == (2, 1, 6 + 4)
    assert summary.series_by_selector == {PUT: 1, both: 1}


def test_basic_auth_and_bearer_token_reach_the_server(prom, db):
    with _AuthProxy(prom.url) as proxy:
        with pytest.raises(PrometheusImportError, match="HTTP 401 Unauthorized: no entry"):
            import_prometheus(db, proxy.url, [PUT], **window(prom), run_name="anonymous")
        import_prometheus(db, proxy.url, [PUT], **window(prom), run_name="bearer", bearer_token="sekret")
        user_url = proxy.url.replace("http://", "http://kv:sekret@")
        import_prometheus(db, user_url, [PUT], **window(prom), run_name="basic")

    assert db.find_run("anonymous") is None
    assert db.run("basic").config["url"] == proxy.url  # the password is not recorded
    assert rows(db, "basic") == rows(db, "bearer") != {}


class _AuthProxy:
    """A real HTTP server in front of Prometheus that lets through only Bearer sekret or basic kv:sekret."""

    ACCEPTED = ("Bearer sekret", "Basic " + base64.b64encode(b"kv:sekret").decode())

    def __init__(self, upstream: str) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Authorization") not in _AuthProxy.ACCEPTED:
                    status, content = 401, b"no entry"
                else:
                    headers = {"Content-Type": self.headers["Content-Type"]}
                    answer = httpx.post(upstream + self.path, content=body, headers=headers)
                    status, content = answer.status_code, answer.content
                self.send_response(status)
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            def log_message(self, *args) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_port}"

    def __enter__(self) -> _AuthProxy:
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


# ------------------------------------------------------------------------------------- failures


def test_prometheus_error_is_reported_and_no_run_is_left(prom, db):
    with pytest.raises(PrometheusImportError) as failure:
        import_prometheus(db, prom.url, ["kv_store_put_bytes_total{"], **window(prom), run_name="bad")
    message = str(failure.value)
    assert "query 'kv_store_put_bytes_total{" in message and prom.url in message
    assert "HTTP 400 Bad Request: bad_data:" in message and "parse error" in message
    assert db.find_run("bad") is None


def test_a_failure_mid_import_leaves_the_run_unfinished_and_earlier_runs_intact(prom, db):
    import_prometheus(db, prom.url, [PUT], **window(prom), run_name="before")
    before = rows(db, "before")

    unfinished = r"run 'partial' is left unfinished \(ended_at NULL\) with the 6 samples committed"
    with pytest.raises(PrometheusImportError, match=unfinished):
        import_prometheus(db, prom.url, [PUT, "rate(kv_store_put_bytes_total[1m]"], **window(prom), run_name="partial")

    assert db.run("partial").ended_at is None and len(next(iter(rows(db, "partial").values()))) == 6
    assert rows(db, "before") == before and db.run("before").ended_at == prom.t0 + 300


def test_series_that_would_merge_are_refused(prom, db):
    with pytest.raises(PrometheusImportError) as failure:
        import_prometheus(db, prom.url, [GET], **window(prom), run_name="merged")
    message = str(failure.value)
    assert 'job="a"' in message and 'job="b"' in message and "kv.store.get.bytes" in message
    assert "narrow the selector" in message and "left unfinished" in message


def test_every_selector_matching_nothing_is_an_error(prom, db):
    with pytest.raises(PrometheusImportError, match=r"no selector matched any series .*'nothing_here', 'nor_here'"):
        import_prometheus(db, prom.url, ["nothing_here", "nor_here"], **window(prom), run_name="empty")
    assert db.find_run("empty") is None


def test_unreachable_servers_are_named(db):
    closed = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(PrometheusImportError, match=f"at {closed}: cannot reach the server"):
        import_prometheus(db, closed, [PUT], 0, 60, 15, run_name="closed", timeout_s=5)
    with pytest.raises(PrometheusImportError, match=r"kvscope-no-such-host\.invalid.*cannot reach the server"):
        import_prometheus(db, "http://kvscope-no-such-host.invalid:9090", [PUT], 0, 60, 15, run_name="dns", timeout_s=5)
    assert db.runs() == []


def test_the_cli_imports_a_window_and_exits_1_on_a_server_error(prom, tmp_path):
    from typer.testing import CliRunner

    from kvscope.cli import app

    runner, path = CliRunner(), tmp_path / "cli.duckdb"
    span = window(prom)
    common = ["--url", prom.url, "--db", str(path), "--start", str(span["start"]), "--end", str(span["end"])]
    done = runner.invoke(app, ["import", "prometheus", *common, "--selector", PUT, "--run", "w", "--step", "60s"])
    assert done.exit_code == 0, done.output
    assert "run 'w':" in done.output
    bad = runner.invoke(app, ["import", "prometheus", *common, "--selector", "sum(", "--run", "x", "--step", "60s"])
    assert bad.exit_code == 1 and "bad_data" in " ".join(bad.output.split())
    with Database(path) as database:
        assert [run.name for run in database.runs()] == ["w"]
