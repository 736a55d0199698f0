"""The service's acceptance over real HTTP: uvicorn on 127.0.0.1, an A/B of the long-output example, the DRAM-only
arm's KVCacheCollapseImminent firing the round before the predicted one and its KVCacheHitRateCollapse at it, the
verdict, its evidence and its bundle."""

from __future__ import annotations

import io
import time
import zipfile
from pathlib import Path

import pytest
import yaml
from support.realservers import TOKEN, Service

from kvscope.verifier.db import Database, run_sql
from kvscope.verifier.evidence import check_bundle

ROOT = Path(__file__).resolve().parents[2]
LONG_OUTPUT = yaml.safe_load((ROOT / "examples" / "long_output.yaml").read_text())
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def service(tmp_path):
    """The real server in a thread; `stop()` is a clean shutdown (the lifespan's teardown runs)."""
    running = Service(tmp_path, criteria=[ROOT / "criteria" / "media.yaml"], scrape_interval_s=0.5)
    yield running
    if running.thread.is_alive():
        running.stop()


def test_an_ab_over_http_collapses_at_the_predicted_round_and_its_evidence_checks_out(service, tmp_path):
    client = service.client
    predicted = client.post("/api/v1/predict", json=LONG_OUTPUT).json()["arms"]["dram_only"]["prediction"]
    collapse_round = predicted["collapse_round"]
    assert collapse_round == 8

    started = client.post("/api/v1/ab", json={"scenario": LONG_OUTPUT, "rounds_per_minute": 1200}, headers=AUTH)
    assert started.status_code == 201, started.text
    ab_id = started.json()["id"]

    seen: list[tuple[str, str, str]] = []  # (alert, state, summary) of the DRAM-only arm's alerts, as they changed
    deadline = time.monotonic() + 120
    while True:
        for alert in client.get("/api/v1/alerts").json():
            ours = alert["name"] != "KVCacheCollapsePredicted" and alert["labels"]["arm"] == "dram_only"
            change = (alert["name"], alert["state"], alert["summary"])
            if ours and change[:2] not in [s[:2] for s in seen]:
                seen.append(change)
        test = client.get(f"/api/v1/ab/{ab_id}").json()
        if test["status"] != "running":
            break
        assert time.monotonic() < deadline, f"the A/B did not finish: {test['arms']['dram_only']['rounds_done']} rounds"
        time.sleep(0.02)

    assert test["status"] == "finished"
    assert [name_state for *name_state, _ in seen][:3] == [
        ["KVCacheCollapseImminent", "firing"],
        ["KVCacheHitRateCollapse", "firing"],
        ["KVCacheCollapseImminent", "resolved"],  # inhibited by the collapse in Alertmanager; over here
    ]
    # the A/B is over, and so is its collapse: resolved, not firing on (and re-sent) for ever
    ours = [a for a in client.get("/api/v1/alerts").json() if a["labels"].get("ab") == ab_id]
    assert ours and {a["state"] for a in ours} == {"resolved"}, ours
    assert seen[0][2].startswith(f"round {collapse_round - 1}:")  # the tier fills within one round: imminent
    assert seen[1][2].startswith(f"round {collapse_round}:")  # the collapse itself
    assert test["arms"]["dram_only"]["observed_collapse_round"] == collapse_round
    assert test["arms"]["tiered"]["observed_collapse_round"] is None

    # each arm says its layout; a poller asks only for the rows it has not seen
    assert [(t["name"], t["policy"]) for t in test["arms"]["tiered"]["tiers"]] == [("dram", "lru"), ("nof", "lru")]
    later = client.get(f"/api/v1/ab/{ab_id}", params={"since_round": 7}).json()["arms"]["dram_only"]["rows"]
    assert [row["round"] for row in later] == [row["round"] for row in test["arms"]["dram_only"]["rows"][7:]]
    assert later[0]["round"] == 8

    verdicts = {v["criterion"]: v for v in test["verdicts"]}
    assert verdicts["save_parity"]["description"].startswith("both arms saved the same bytes")
    assert verdicts["save_parity"]["threshold"] == {"relative_tolerance": 0.001}
    assert verdicts["dram_only_no_collapse"]["passed"] is False
    assert verdicts["tiered_no_collapse"]["passed"] is True
    assert verdicts["nof_delta_zero"]["passed"] is True and verdicts["both_tiers_written"]["passed"] is True

    verdict_id = verdicts["dram_only_no_collapse"]["verdict_id"]
    evidence = client.get(f"/api/v1/verdicts/{verdict_id}").json()
    assert evidence["digest"] == verdicts["dram_only_no_collapse"]["digest"]
    assert evidence["document"]["summary"].startswith(f"collapsed in round {collapse_round}:")
    bundle = client.get(f"/api/v1/verdicts/{verdict_id}/bundle")
    assert bundle.status_code == 200
    zipfile.ZipFile(io.BytesIO(bundle.content)).extractall(tmp_path / "bundle")
    report = check_bundle(tmp_path / "bundle")
    assert report.ok and report.checked == 1


def test_stopping_the_service_mid_ab_keeps_every_recorded_round_and_a_consistent_database(service):
    client = service.client
    ab_id = client.post("/api/v1/ab", json={"scenario": LONG_OUTPUT, "rounds_per_minute": 300}, headers=AUTH).json()[
        "id"
    ]
    deadline = time.monotonic() + 60
    while client.get(f"/api/v1/ab/{ab_id}").json()["arms"]["dram_only"]["rounds_done"] < 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    service.stop()
    with Database(service.db) as db:
        runs = {run.name: run for run in db.runs()}
        assert set(runs) == {f"{ab_id}/dram_only", f"{ab_id}/tiered"}
        assert all(run.ended_at is not None for run in runs.values())  # closed cleanly by the shutdown
        (samples, batched) = run_sql(db.con, "SELECT (SELECT count(*) FROM samples), (SELECT sum(rows) FROM batches)")[
            0
        ]
        assert samples == batched > 0
        rounds = run_sql(
            db.con,
            "SELECT r.name, max(p.value) FROM samples p JOIN series s USING (series_id) JOIN runs r USING (run_id) "
            "WHERE s.name = 'tierstore_engine_rounds_total' GROUP BY r.name",
        )
        assert all(3 <= done < 20 for _, done in rounds)  # stopped part way, every finished round recorded
