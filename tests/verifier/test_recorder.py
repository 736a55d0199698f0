"""`kvscope record`: real recorder processes scraping real HTTP endpoints (vLLM /metrics fixtures) into DuckDB,
stopped by their duration, by SIGTERM, and killed with SIGKILL."""

from __future__ import annotations

import asyncio
import itertools
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from kvscope.cli import app
from kvscope.exporters.config import parse_config
from kvscope.verifier.db import Database, SampleWriter, run_sql
from kvscope.verifier.recorder import record
from kvscope.verifier.schema import SCHEMA_VERSION

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm"
DEFAULT = FIXTURES / "metrics_rendered_v0.33.0_default_SYNTHETIC.txt"
OFFLOADING = FIXTURES / "metrics_rendered_v0.33.0_offloading_kvcachemetrics_SYNTHETIC.txt"
FLUSH_S = 1.0  # record()'s default flush age, which `kvscope record` uses
DEADLINE_S = 60.0  # generous: a slow, busy CI machine must not fail these tests, only a broken recorder
runner = CliRunner()


def kvscope() -> list[str]:
    """The installed `kvscope` script next to this interpreter (the venv's), or the same app through -c."""
    script = Path(sys.executable).with_name("kvscope")
    return [str(script)] if script.exists() else [sys.executable, "-c", "from kvscope.cli import app; app()"]


class RequestLog(dict):
    """`metrics_server.answers` that also notes when each path was asked for (server side, wall clock)."""

    def __init__(self, answers: dict) -> None:
        super().__init__(answers)
        self.times: dict[str, list[float]] = {path: [] for path in answers}

    def get(self, path, default=None):
        self.times.setdefault(path, []).append(time.time())
        return super().get(path, default)


def serve_vllm(tmp_path: Path, metrics_server, targets: dict[str, Path | int]) -> tuple[Path, RequestLog]:
    """A targets.yaml of vLLM targets scraped every 50 ms: a fixture body each, or an HTTP status (a down one)."""
    config = []
    for name, answer in targets.items():
        if isinstance(answer, Path):
            url = metrics_server.serve(f"/{name}", answer.read_bytes())
        else:
            url = metrics_server.serve(f"/{name}", f"{name} is down", status=answer)
        config.append({"name": name, "source": "vllm", "url": url, "interval_s": 0.05, "timeout_s": 10})
    path = tmp_path / "targets.yaml"
    path.write_text(yaml.safe_dump({"targets": config}))
    metrics_server.answers = log = RequestLog(metrics_server.answers)
    return path, log


def wait_for(condition, process: subprocess.Popen | None = None, what: str = "") -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if process is not None and process.poll() is not None:
            pytest.fail(f"the recorder exited ({process.returncode}) before {what}: {process.communicate()[0]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {DEADLINE_S:g} s")
        time.sleep(0.02)


def committed_flushes(requests: list[float]) -> int:
    """Age flushes that certainly committed, judged from one target's requests alone.

    The recorder's sink exists before the first request and flushes in the scrape callback once FLUSH_S passed
    since its last flush, before the target's next request goes out. So a scrape requested FLUSH_S after the
    previous known flush (or the first request), and followed by another request, proves one more commit.
    """
    flushes, due = 0, requests[0] + FLUSH_S + 0.05 if requests else 0.0
    for at, following in itertools.pairwise(requests):
        if at >= due:
            flushes, due = flushes + 1, following + FLUSH_S + 0.05
    return flushes


def scrape_sizes(db: Database, run: str) -> dict[str, set[int]]:
    """For each target of `run`, the distinct numbers of samples its recorded scrapes hold."""
    rows = run_sql(
        db.con,
        "SELECT target, count(*) FROM samples JOIN series USING (series_id) WHERE run_id = ? GROUP BY target, ts",
        [db.run(run).run_id],
    )
    sizes: dict[str, set[int]] = {}
    for target, size in rows:
        sizes.setdefault(target, set()).add(size)
    return sizes


def series_per_target(db: Database, run: str) -> dict[str, int]:
    return dict(
        run_sql(db.con, "SELECT target, count(*) FROM series WHERE run_id = ? GROUP BY 1", [db.run(run).run_id])
    )


def assert_whole_batches_without_duplicates(db: Database, run: str) -> int:
    """Every committed sample is in a `batches` row's count and no (series, ts) appears twice; returns the count."""
    run_id = db.run(run).run_id
    (in_batches,) = run_sql(db.con, "SELECT coalesce(sum(rows), 0) FROM batches WHERE run_id = ?", [run_id])[0]
    (samples, distinct) = run_sql(
        db.con,
        "SELECT count(*), count(DISTINCT (series_id, ts)) FROM samples JOIN series USING (series_id) WHERE run_id = ?",
        [run_id],
    )[0]
    assert samples == in_batches
    assert distinct == samples
    return samples


def test_a_recorder_killed_with_sigkill_loses_only_its_unflushed_tail(tmp_path, metrics_server):
    """The acceptance point: after SIGKILL the file opens, holds whole batches of whole scrapes, none twice, every
    recorded scrape is one the server answered in order (only the tail is lost), and another run can append."""
    config, log = serve_vllm(tmp_path, metrics_server, {"vllm-a": DEFAULT, "vllm-b": OFFLOADING})
    db = tmp_path / "runs.duckdb"
    command = [*kvscope(), "record", "--config", str(config), "--db", str(db), "--run", "killed"]
    recorder = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: committed_flushes(list(log.times["/vllm-a"])) >= 2, recorder, "two committed batches")
    finally:
        recorder.send_signal(signal.SIGKILL)  # unlike os.kill, a no-op once the process was reaped
        recorder.communicate(timeout=DEADLINE_S)
    assert recorder.returncode == -signal.SIGKILL
    requests = {f"vllm-{x}": list(log.times[f"/vllm-{x}"]) for x in "ab"}

    with Database(db) as database:
        run = database.run("killed")
        assert run.ended_at is None  # it never finished
        assert run_sql(database.con, "SELECT count(*) FROM batches WHERE run_id = ?", [run.run_id])[0][0] >= 2
        killed_samples = assert_whole_batches_without_duplicates(database, "killed")
        series = series_per_target(database, "killed")
        assert scrape_sizes(database, "killed") == {target: {size} for target, size in series.items()}
        assert set(series) == {"vllm-a", "vllm-b"}
        for target, asked in requests.items():
            query = "SELECT DISTINCT ts FROM sample_rows WHERE run = 'killed' AND target = ? ORDER BY ts"
            recorded = [row[0] for row in run_sql(database.con, query, [target])]
            assert 0 < len(recorded) <= len(asked)
            # scrape j is stamped after its request and before the next one: the recording is the first scrapes
            for j, stamped in enumerate(recorded):
                assert asked[j] < stamped, (target, j)
                assert j + 1 == len(asked) or stamped < asked[j + 1], (target, j)
        max_killed_series = run_sql(database.con, "SELECT max(series_id) FROM series")[0][0]

    again = [*kvscope(), "record", "--config", str(config), "--db", str(db), "--run", "after", "--for", "0.3s"]
    second = subprocess.run(again, capture_output=True, text=True, timeout=DEADLINE_S)
    assert second.returncode == 0, second.stdout + second.stderr
    with Database(db) as database:
        assert [run.name for run in database.runs()] == ["killed", "after"]
        assert database.run("after").ended_at is not None
        assert assert_whole_batches_without_duplicates(database, "killed") == killed_samples
        assert assert_whole_batches_without_duplicates(database, "after") > 0
        (lowest_new,) = run_sql(
            database.con, "SELECT min(series_id) FROM series JOIN runs USING (run_id) WHERE runs.name = 'after'"
        )[0]
        assert lowest_new > max_killed_series


def test_a_timed_recording_finishes_the_run_with_raw_and_normalized_series_despite_a_down_target(
    tmp_path, metrics_server
):
    config, log = serve_vllm(tmp_path, metrics_server, {"vllm-a": DEFAULT, "vllm-down": 503})
    db = tmp_path / "runs.duckdb"
    command = [*kvscope(), "record", "--config", str(config), "--db", str(db), "--run", "r1", "--arm", "tiered",
               "--for", "1s"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=DEADLINE_S)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "samples recorded" in result.stdout
    assert len(log.times["/vllm-down"]) > 1  # it was scraped (and failed) all along

    with Database(db) as database:
        run = database.run("r1")
        assert (run.origin, run.arm, run.config["duration_s"]) == ("recorder", "tiered", 1.0)
        assert run.ended_at is not None and run.ended_at - run.started_at >= 0.95
        targets = run_sql(database.con, "SELECT target, source FROM targets WHERE run_id = ? ORDER BY 1", [run.run_id])
        assert targets == [("vllm-a", "vllm"), ("vllm-down", "vllm")]
        assert series_per_target(database, "r1").keys() == {"vllm-a"}  # failed scrapes record nothing
        assert_whole_batches_without_duplicates(database, "r1")
        assert scrape_sizes(database, "r1") == {"vllm-a": {series_per_target(database, "r1")["vllm-a"]}}
        names = dict(run_sql(database.con, "SELECT name, bool_and(normalized) FROM series GROUP BY name"))
        assert names["vllm:prefix_cache_queries_total"] is False
        assert names["kv.prefix.query.tokens"] is True
        assert names["kv.prefix.hit.tokens"] is True
        layers = run_sql(
            database.con,
            "SELECT DISTINCT labels->>'layer' FROM series WHERE name = 'kv.prefix.query.tokens' ORDER BY 1",
        )
        assert layers == [("external",), ("gpu",)]


def test_sigterm_stops_a_recording_cleanly(tmp_path, metrics_server):
    """A terminated recorder (systemd, Kubernetes) flushes what it buffered and finishes its run."""
    config, log = serve_vllm(tmp_path, metrics_server, {"vllm-a": DEFAULT})
    db = tmp_path / "runs.duckdb"
    command = [*kvscope(), "record", "--config", str(config), "--db", str(db), "--run", "r"]
    recorder = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:  # the scrape loop starts after the signal handlers are in place
        wait_for(lambda: len(log.times["/vllm-a"]) >= 3, recorder, "three scrapes")
        recorder.send_signal(signal.SIGTERM)
        output = recorder.communicate(timeout=DEADLINE_S)[0]
    finally:
        if recorder.poll() is None:
            recorder.kill()
            recorder.communicate()
    assert recorder.returncode == 0, output
    asked = len(log.times["/vllm-a"])
    with Database(db) as database:
        assert database.run("r").ended_at is not None
        assert assert_whole_batches_without_duplicates(database, "r") > 0
        (scrapes,) = run_sql(database.con, "SELECT count(DISTINCT ts) FROM sample_rows WHERE run = 'r'")[0]
        assert scrapes == asked  # a scrape in flight when the signal came completes and is recorded too


def test_a_batch_boundary_never_splits_a_scrape(tmp_path, metrics_server, monkeypatch):
    """With batches smaller than one scrape, each scrape still commits whole: raw and normalized together."""
    config, log = serve_vllm(tmp_path, metrics_server, {"vllm-a": DEFAULT})
    monkeypatch.setattr(Database, "writer", lambda self, run, batch_rows=0: SampleWriter(self, run, 100))

    async def three_scrapes(database: Database) -> None:
        stop = asyncio.Event()
        recording = asyncio.create_task(
            record(database, parse_config(yaml.safe_load(config.read_text())), "r", stop=stop)
        )
        while len(log.times["/vllm-a"]) < 3 and not recording.done():
            await asyncio.sleep(0.01)
        stop.set()
        await recording

    with Database(tmp_path / "runs.duckdb") as database:
        asyncio.run(three_scrapes(database))
        batches = run_sql(database.con, "SELECT first_ts, last_ts FROM batches ORDER BY batch_id")
        assert len(batches) >= 3
        for (_, last), (first, _) in itertools.pairwise(batches):
            assert last < first  # no scrape timestamp in two batches
        assert scrape_sizes(database, "r") == {"vllm-a": {series_per_target(database, "r")["vllm-a"]}}


def test_record_refuses_a_taken_run_name_and_a_newer_database_with_exit_2(tmp_path, metrics_server):
    config, _ = serve_vllm(tmp_path, metrics_server, {"vllm-a": DEFAULT})
    db = tmp_path / "runs.duckdb"
    with Database(db) as database:
        database.create_run("baseline", origin="recorder")
    result = runner.invoke(app, ["record", "--config", str(config), "--db", str(db), "--run", "baseline"])
    assert result.exit_code == 2
    assert "a run named 'baseline' is already recorded" in " ".join(result.output.split())

    with Database(db) as database:
        run_sql(database.con, "INSERT INTO schema_version VALUES (?, 0)", [SCHEMA_VERSION + 1])
    result = runner.invoke(app, ["record", "--config", str(config), "--db", str(db), "--run", "new"])
    assert result.exit_code == 2, result.output
    assert "is newer than this kvscope's" in " ".join(result.output.split())
