"""The evidence resource over a database with real content: an embedded A/B recorded through the exporters and
judged with the shipped media criteria (the DRAM-only arm has the planted NoF-write fault, so one verdict fails)."""

from __future__ import annotations

import csv
import io
import json
import math
import zipfile
from pathlib import Path

import duckdb
import pytest
import yaml
from fastapi import FastAPI
from fastapi.testclient import TestClient
from support.criteria import MEDIA_CRITERIA
from typer.testing import CliRunner

from kvscope.api.routers import evidence
from kvscope.cli import app as cli
from kvscope.verifier.db import canonical_json
from kvscope.verifier.evidence import check_bundle

ROOT = Path(__file__).resolve().parents[2]
NOF = {"name": "nof", "capacity": "20GB", "policy": "lru", "read_bandwidth": "400Gb/s"}
SCENARIO = {
    "name": "media",
    "workload": {"kind": "multi_round", "sessions": 8, "rounds": 4, "first_prompt_tokens": 2000, "output_tokens": 1000,
                 "output_cached": True},
    "kv": {"block_tokens": 16, "bytes_per_token": 2000},
    "arms": {
        "dram_only": {"tiers": [{"name": "dram", "capacity": "2GB", "policy": "lru"}, NOF]},  # the planted fault
        "tiered": {"tiers": [{"name": "dram", "capacity": "200MB", "policy": "lru"}, NOF]},
    },
}  # fmt: skip
WRITTEN = "kv.tier.written.bytes"
INJECTIONS = ["x' OR '1'='1", "nof'); DROP TABLE samples; --", '" OR 1=1 --', "%' OR name LIKE '%"]


def record(folder: Path) -> tuple[Path, dict]:
    """The database (the A/B, then `kvscope verify`) and the verify report."""
    runner, db, report = CliRunner(), folder / "kvscope.duckdb", folder / "verdicts.json"
    (folder / "scenario.yaml").write_text(yaml.safe_dump(SCENARIO))
    result = runner.invoke(cli, ["ab", "run", str(folder / "scenario.yaml"), "--db", str(db)])
    assert result.exit_code == 0, result.output
    result = runner.invoke(
        cli, ["verify", "--db", str(db), "--criteria", str(ROOT / "criteria" / "media.yaml"),
              "--run", "media/dram_only", "--run", "media/tiered", "--json", str(report)],
    )  # fmt: skip
    assert result.exit_code == 1, result.output  # nof_delta_zero fails
    return db, json.loads(report.read_text())


def with_evidence(app: FastAPI) -> FastAPI:
    """The evidence router, unless app.py includes it already."""
    if not any(getattr(route, "path", "") == "/api/v1/verdicts" for route in app.routes):
        app.include_router(evidence.router)
    return app


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, app_factory):
    folder = tmp_path_factory.mktemp("evidence")
    db, report = record(folder)
    with TestClient(with_evidence(app_factory(folder, db=db))) as client:
        yield client, report


@pytest.fixture
def client(recorded) -> TestClient:
    return recorded[0]


def query(client: TestClient, sql: str, params: list | None = None) -> list[tuple]:
    """The service's own database, read through a cursor of it (the file is open in this process)."""
    cursor = client.app.state.services.db.cursor()
    try:
        return cursor.con.execute(sql, params or []).fetchall()
    finally:
        cursor.con.close()


def run_id(client: TestClient, name: str) -> int:
    return query(client, "SELECT run_id FROM runs WHERE name = ?", [name])[0][0]


def samples_url(client: TestClient, run: str = "media/dram_only") -> str:
    return f"/api/v1/runs/{run_id(client, run)}/samples"


def get_samples(client: TestClient, run: str = "media/dram_only", **params: object):
    return client.get(samples_url(client, run), params={"metric": WRITTEN, **params})


def in_database(client: TestClient, run: str, metric: str, normalized: bool = True) -> list[list]:
    return [
        list(row)
        for row in query(
            client,
            "SELECT p.series_id, p.ts, p.value FROM samples p JOIN series s USING (series_id) JOIN runs r "
            "USING (run_id) WHERE r.name = ? AND s.name = ? AND s.normalized = ? ORDER BY p.series_id, p.ts",
            [run, metric, normalized],
        )
    ]


def assert_named(response, status: int, field: str) -> None:
    """A validation error whose location names `field`."""
    assert response.status_code == status, response.text
    assert any(field in error["loc"] for error in response.json()["detail"]), response.text


# ------------------------------------------------------------------------------------------------------ runs


def test_runs_are_listed_newest_first_with_counts_that_match_the_database(client):
    runs = client.get("/api/v1/runs").json()
    assert {run["name"] for run in runs} == {"media/dram_only", "media/tiered"}
    assert [run["started_at"] for run in runs] == sorted((run["started_at"] for run in runs), reverse=True)
    for run in runs:
        [(series, samples)] = query(
            client,
            "SELECT count(DISTINCT s.series_id), count(p.ts) FROM series s LEFT JOIN samples p USING (series_id) "
            "WHERE s.run_id = ?",
            [run["run_id"]],
        )
        assert (run["series"], run["samples"]) == (series, samples) and samples > 0
        assert run["first_ts"] <= run["last_ts"] and (run["origin"], run["scenario"]) == ("ab", "media")


@pytest.mark.parametrize(
    ("params", "names"),
    [
        ({"origin": "ab"}, {"media/dram_only", "media/tiered"}),
        ({"origin": "prometheus"}, set()),
        ({"arm": "tiered"}, {"media/tiered"}),
        ({"scenario": "media", "name_prefix": "media/dram"}, {"media/dram_only"}),
        ({"scenario": "other"}, set()),
        ({"name_prefix": "%"}, set()),  # a prefix, not a LIKE pattern
        *[({"name_prefix": attempt}, set()) for attempt in INJECTIONS],
    ],
)
def test_run_filters_all_hold(client, params, names):
    response = client.get("/api/v1/runs", params=params)
    assert response.status_code == 200
    assert {run["name"] for run in response.json()} == names


def test_one_run_has_its_targets_config_and_series_summary(client):
    run = client.get(f"/api/v1/runs/{run_id(client, 'media/tiered')}").json()
    assert run["name"] == "media/tiered" and run["config"]["scenario"]["name"] == "media"
    assert [(t["target"], t["source"]) for t in run["targets"]] == [("tierstore-tiered", "tierstore")]
    assert run["targets"][0]["config"]["stores"] == ["media/tiered"]
    summary = {(s["name"], s["normalized"]): s for s in run["series_summary"]}
    assert summary[(WRITTEN, True)]["kind"] == "counter" and summary[(WRITTEN, True)]["count"] == 2  # dram, nof
    assert sum(s["count"] for s in run["series_summary"]) == run["series"]


def test_an_unknown_run_is_404_naming_it(client):
    for url in ("/api/v1/runs/999", "/api/v1/runs/999/samples?metric=x"):
        response = client.get(url)
        assert response.status_code == 404 and "999" in response.json()["detail"]


# ---------------------------------------------------------------------------------------------- verdicts


def test_verdicts_carry_the_evidence_verify_reported(recorded):
    client, report = recorded
    listed = client.get("/api/v1/verdicts").json()
    assert listed["next_offset"] is None and len(listed["verdicts"]) == len(report["verdicts"]) == 5
    for reported in report["verdicts"]:
        verdict = client.get(f"/api/v1/verdicts/{reported['verdict_id']}").json()
        assert verdict["document"] == reported["document"] and verdict["digest"] == reported["digest"]
        assert verdict["runs"] == {"dram_only": "media/dram_only", "tiered": "media/tiered"}
    summaries = {v["criterion"]: v["summary"] for v in listed["verdicts"]}
    assert summaries["nof_delta_zero"].startswith("failed:")


@pytest.mark.parametrize(
    ("params", "criteria"),
    [
        ({"passed": "false"}, {"nof_delta_zero"}),
        ({"passed": "true", "kind": "parity"}, {"save_parity", "load_parity"}),
        ({"criterion": "both_tiers_written"}, {"both_tiers_written"}),
        (
            {"run": "media/tiered"},
            MEDIA_CRITERIA,
        ),
        ({"run": "nope"}, set()),
        (
            {"since": 0},
            MEDIA_CRITERIA,
        ),
        ({"since": 4e9}, set()),
        *[({"criterion": attempt}, set()) for attempt in INJECTIONS],
        *[({"run": attempt}, set()) for attempt in INJECTIONS],
    ],
)
def test_verdict_filters_all_hold(client, params, criteria):
    response = client.get("/api/v1/verdicts", params=params)
    assert response.status_code == 200
    assert {v["criterion"] for v in response.json()["verdicts"]} == criteria


def test_verdict_pages_cover_every_verdict_once_newest_first(client):
    everything = [v["verdict_id"] for v in client.get("/api/v1/verdicts").json()["verdicts"]]
    first = client.get("/api/v1/verdicts", params={"limit": 3}).json()
    assert first["next_offset"] == 3
    rest = client.get("/api/v1/verdicts", params={"limit": 3, "offset": 3}).json()
    assert rest["next_offset"] is None
    assert [v["verdict_id"] for v in first["verdicts"] + rest["verdicts"]] == everything
    assert everything == sorted(everything, reverse=True)  # recorded one after the other


def test_a_bundle_download_checks_out_unzipped(client, tmp_path):
    verdict_id = client.get("/api/v1/verdicts", params={"criterion": "both_tiers_written"}).json()["verdicts"][0]
    response = client.get(f"/api/v1/verdicts/{verdict_id['verdict_id']}/bundle")
    assert response.status_code == 200 and response.headers["content-type"] == "application/zip"
    with zipfile.ZipFile(io.BytesIO(response.content)) as archive:
        members = ["README.md", "chunks.parquet", "evidence.json", "rerun.sql", "samples.parquet"]
        assert sorted(archive.namelist()) == members
        archive.extractall(tmp_path)
    report = check_bundle(tmp_path)
    assert (report.ok, report.checked, report.problems) == (True, 1, [])
    exported = json.loads((tmp_path / "evidence.json").read_text())["verdicts"][0]
    assert exported["digest"] == verdict_id["digest"]


def test_an_unknown_verdict_is_404_naming_it(client):
    for url in ("/api/v1/verdicts/999", "/api/v1/verdicts/999/bundle"):
        response = client.get(url)
        assert response.status_code == 404 and "999" in response.json()["detail"]


# ---------------------------------------------------------------------------------------------- samples


def parquet_rows(content: bytes, folder: Path) -> list[tuple]:
    path = folder / "page.parquet"
    path.write_bytes(content)
    with duckdb.connect() as con:
        return con.execute(
            "SELECT series_id, target, labels::VARCHAR, ts, value FROM read_parquet(?)", [str(path)]
        ).fetchall()


def test_json_csv_and_parquet_agree_with_each_other_and_the_database(client, tmp_path):
    as_json = get_samples(client).json()
    assert as_json["run"] == "media/dram_only" and as_json["metric"] == WRITTEN and as_json["next_offset"] is None
    assert as_json["samples"] == in_database(client, "media/dram_only", WRITTEN) != []
    series = {s["series_id"]: s for s in as_json["series"]}
    assert {s["labels"]["tier"] for s in series.values()} == {"dram", "nof"}
    assert {s["target"] for s in series.values()} == {"tierstore-dram_only"}
    expected = [
        (sid, series[sid]["target"], canonical_json(series[sid]["labels"]), ts, v) for sid, ts, v in as_json["samples"]
    ]
    as_csv = get_samples(client, format="csv")
    assert as_csv.headers["content-type"].startswith("text/csv") and "x-next-offset" not in as_csv.headers
    rows = list(csv.reader(io.StringIO(as_csv.text)))
    assert rows[0] == ["series_id", "target", "labels", "ts", "value"]
    assert [(int(a), b, c, float(d), float(e)) for a, b, c, d, e in rows[1:]] == expected
    as_parquet = get_samples(client, format="parquet")
    assert as_parquet.headers["content-type"] == "application/vnd.apache.parquet"
    assert parquet_rows(as_parquet.content, tmp_path) == expected


@pytest.mark.parametrize("fmt", ["json", "csv", "parquet"])
def test_pages_joined_are_the_whole_answer_in_every_format(client, tmp_path, fmt):
    whole = get_samples(client).json()["samples"]
    pages, offset = [], 0
    while offset is not None:
        response = get_samples(client, format=fmt, limit=3, offset=offset)
        if fmt == "json":
            pages += response.json()["samples"]
            offset = response.json()["next_offset"]
            continue
        if fmt == "csv":
            rows = [(int(r[0]), float(r[3]), float(r[4])) for r in list(csv.reader(io.StringIO(response.text)))[1:]]
        else:
            rows = [(r[0], r[3], r[4]) for r in parquet_rows(response.content, tmp_path)]
        pages += [list(row) for row in rows]
        offset = int(response.headers["x-next-offset"]) if "x-next-offset" in response.headers else None
    assert pages == whole and len(whole) > 3


def test_label_matchers_select_series_and_an_empty_value_matches_a_missing_label(client):
    nof = get_samples(client, label="tier=nof").json()
    assert [s["labels"]["tier"] for s in nof["series"]] == ["nof"]
    assert {row[0] for row in nof["samples"]} == {nof["series"][0]["series_id"]}
    both = get_samples(client, label=["tier=nof", "system=tierstore:media/dram_only"]).json()
    assert both["series"] == nof["series"] and both["samples"] == nof["samples"]
    assert get_samples(client, label=["tier=nof", "tier=dram"]).json()["series"] == []
    raw = {"metric": "tierstore_engine_requests_total", "raw": "true"}
    assert len(get_samples(client, **raw, label="tier=").json()["series"]) == 1  # has no tier label
    assert get_samples(client, **raw, label="tier=dram").json()["series"] == []
    assert get_samples(client, label="k8s.io:pod-name_1=x").json()["series"] == []  # a valid key, absent


def test_raw_selects_the_exporters_series(client):
    missing = get_samples(client, raw="true")
    assert missing.status_code == 404 and "no raw series named 'kv.tier.written.bytes'" in missing.json()["detail"]
    raw = get_samples(client, metric="tierstore_tier_written_bytes_total", raw="true").json()
    assert raw["samples"] == in_database(
        client, "media/dram_only", "tierstore_tier_written_bytes_total", normalized=False
    )


def test_start_and_end_bound_the_samples_inclusively(client):
    whole = get_samples(client).json()["samples"]
    times = sorted({ts for _, ts, _ in whole})
    start, end = times[1], times[-2]
    bounded = get_samples(client, start=start, end=end).json()["samples"]
    assert bounded == [row for row in whole if start <= row[1] <= end] and len(bounded) < len(whole)


def last_per_bucket(rows: list[list], origin: float, step: float) -> list[list]:
    """The downsampling worked out in Python: the last sample of each (series, step bucket)."""
    kept: dict[tuple, list] = {}
    for row in sorted(rows, key=lambda row: (row[0], row[1])):
        kept[(row[0], math.floor((row[1] - origin) / step))] = row
    return sorted(kept.values(), key=lambda row: (row[0], row[1]))


@pytest.mark.parametrize("with_start", [False, True])
def test_step_keeps_the_last_sample_of_each_bucket(client, with_start):
    whole = get_samples(client).json()["samples"]
    times = sorted({ts for _, ts, _ in whole})
    step = (times[-1] - times[1]) / 1.5  # times[1:] fall in 2 or 3 buckets: some share one, none has all
    params = {"step": step, **({"start": times[1]} if with_start else {})}
    origin = times[1] if with_start else 0.0
    expected = last_per_bucket([row for row in whole if row[1] >= origin], origin, step)
    stepped = get_samples(client, **params).json()["samples"]
    assert stepped == expected and 4 <= len(stepped) < len(whole)  # 2 series, at least 2 buckets each
    paged = get_samples(client, **params, limit=1, offset=1).json()
    assert paged["samples"] == expected[1:2] and paged["next_offset"] == 2


@pytest.mark.parametrize("attempt", INJECTIONS)
def test_injection_attempts_in_metric_and_label_values_find_nothing(client, tmp_path, attempt):
    for fmt in ("json", "csv", "parquet"):
        answer = get_samples(client, metric=attempt, format=fmt)
        assert answer.status_code == 404 and f"no normalized series named {attempt!r}" in answer.json()["detail"]
    for labels in ([f"tier={attempt}"], ["tier=nof", f"system={attempt}"]):
        response = get_samples(client, label=labels)
        assert response.status_code == 200 and response.json()["samples"] == []
    assert query(client, "SELECT count(*) FROM samples")[0][0] > 0  # nothing was dropped


def test_a_metric_the_run_does_not_hold_is_a_404_that_says_how_names_are_spelled(client):
    """The Prometheus name of a normalized series is not its stored name: the answer says which is which, and
    where the run's names are listed; a name the run holds but no series of it matches the labels is an empty 200."""
    answer = get_samples(client, metric="kv_tier_written_bytes_total")
    detail = answer.json()["detail"]
    assert answer.status_code == 404 and "dotted names, e.g. kv.store.put.bytes" in detail and "/api/v1/runs/" in detail
    empty = get_samples(client, label=["tier=none"])
    assert empty.status_code == 200 and empty.json()["samples"] == []


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"label": "tier"}, "label"),
        ({"label": "=nof"}, "label"),
        ({"label": "1tier=nof"}, "label"),
        ({"label": 'ti"er=nof'}, "label"),
        ({"label": "tier') OR 1=1 --=x"}, "label"),
        ({"limit": 100_001}, "limit"),
        ({"limit": 0}, "limit"),
        ({"offset": -1}, "offset"),
        ({"offset": 2**70}, "offset"),
        ({"format": "xml"}, "format"),
        ({"step": 0}, "step"),
        ({"step": "nan"}, "step"),
        ({"start": "inf"}, "start"),
        ({"start": 10, "end": 5}, "end"),
        ({"metric": ""}, "metric"),
        ({"raw": "maybe"}, "raw"),
    ],
)
def test_bad_sample_parameters_are_422_naming_the_parameter(client, params, field):
    assert_named(get_samples(client, **params), 422, field)


def test_a_missing_metric_is_422_naming_it(client):
    assert_named(client.get(samples_url(client)), 422, "metric")


@pytest.mark.parametrize(
    ("url", "field"),
    [
        ("/api/v1/runs/abc", "run_id"),
        ("/api/v1/runs/99999999999999999999999/samples?metric=x", "run_id"),
        ("/api/v1/verdicts/0", "verdict_id"),
        ("/api/v1/verdicts/99999999999999999999999/bundle", "verdict_id"),
        ("/api/v1/verdicts?limit=1001", "limit"),
        ("/api/v1/verdicts?passed=maybe", "passed"),
        ("/api/v1/verdicts?since=nan", "since"),
        ("/api/v1/verdicts?offset=-1", "offset"),
    ],
)
def test_bad_ids_and_verdict_parameters_are_422_naming_them(client, url, field):
    assert_named(client.get(url), 422, field)
