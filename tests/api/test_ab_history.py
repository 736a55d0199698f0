"""A/B history survives the service: a restart lists every past test with its rows and verdicts, a test cut off by a
kill -9 is marked interrupted (and so are its runs), and an ended test can be deleted by token."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
from fastapi.testclient import TestClient
from support.realservers import wait_for
from support.scenarios import SMALL

from kvscope.api.abhistory import ABHistory, ABTest, ArmState
from kvscope.processes import free_port
from kvscope.tierstore.scenario import Scenario
from kvscope.verifier.db import Database, run_sql

AUTH = {"Authorization": "Bearer test-token"}


def _ended(client: TestClient, ab_id: str) -> dict:
    return wait_for(
        lambda: (t := client.get(f"/api/v1/ab/{ab_id}").json())["status"] != "running" and t, f"{ab_id} to end", 30
    )


def test_a_restart_lists_past_tests_with_their_rows_and_a_deleted_one_is_gone(app_factory, tmp_path):
    with TestClient(app_factory(tmp_path)) as client:
        finished = client.post("/api/v1/ab", json={"scenario": SMALL}, headers=AUTH).json()["id"]
        before = _ended(client, finished)
        slow = client.post("/api/v1/ab", json={"scenario": SMALL, "rounds_per_minute": 60}, headers=AUTH).json()["id"]
        stopped = client.delete(f"/api/v1/ab/{slow}", headers=AUTH)  # running: DELETE stops it
        assert stopped.status_code == 200 and stopped.json()["status"] == "stopped", stopped.text
    assert before["status"] == "finished" and len(before["arms"]["a"]["rows"]) == 6 and before["verdicts"]

    with TestClient(app_factory(tmp_path)) as client:
        listed = client.get("/api/v1/ab").json()
        assert [(t["id"], t["status"]) for t in listed] == [(slow, "stopped"), (finished, "finished")]
        again = client.get(f"/api/v1/ab/{finished}").json()
        assert again["arms"]["a"]["rows"] == before["arms"]["a"]["rows"]
        assert again["verdicts"] == before["verdicts"] and again["spec"]["name"] == "small"
        later = client.get(f"/api/v1/ab/{finished}", params={"since_round": 4}).json()["arms"]["a"]["rows"]
        assert [row["round"] for row in later] == [5, 6]
        newest = client.post("/api/v1/ab", json={"scenario": SMALL}, headers=AUTH).json()["id"]
        assert newest not in (finished, slow)
        _ended(client, newest)

        assert client.delete(f"/api/v1/ab/{finished}").status_code == 401
        deleted = client.delete(f"/api/v1/ab/{finished}", headers=AUTH)
        assert deleted.status_code == 200, deleted.text
        # a verdict was judged on its run: the run is evidence and stays re-checkable
        assert deleted.json() == {"id": finished, "deleted_runs": [], "kept_runs": [f"{finished}/a"]}
        unjudged = client.delete(f"/api/v1/ab/{slow}", headers=AUTH).json()  # stopped: no verdict, runs go too
        assert unjudged == {"id": slow, "deleted_runs": [f"{slow}/a"], "kept_runs": []}
        assert client.get(f"/api/v1/ab/{finished}").status_code == 410
        assert client.delete(f"/api/v1/ab/{slow}", headers=AUTH).status_code == 410
        assert [t["id"] for t in client.get("/api/v1/ab").json()] == [newest]
        runs = {run["name"] for run in client.get("/api/v1/runs").json()}
        assert f"{finished}/a" in runs and f"{slow}/a" not in runs

    with Database(tmp_path / "kvscope.duckdb") as db:
        orphans = run_sql(db.con, "SELECT count(*) FROM series WHERE run_id NOT IN (SELECT run_id FROM runs)")
        assert orphans == [(0,)]
        assert run_sql(db.con, "SELECT count(*) FROM ab_rows WHERE ab_id IN (?, ?)", [finished, slow]) == [(0,)]
    with TestClient(app_factory(tmp_path)) as client:  # deleted ids stay taken
        assert client.get(f"/api/v1/ab/{slow}").status_code == 410
        assert client.post("/api/v1/ab", json={"scenario": SMALL}, headers=AUTH).json()["id"] not in (finished, slow)


def test_a_test_cut_off_by_kill_9_is_interrupted_after_the_restart(app_factory, tmp_path):
    port = free_port()
    env = {**os.environ, "KVSCOPE_TOKEN": "test-token", "KVSCOPE_WORKDIR": str(tmp_path / "ab")}
    server = subprocess.Popen(
        [sys.executable, "-m", "kvscope", "serve", "--port", str(port), "--db", str(tmp_path / "kvscope.duckdb")],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            wait_for(lambda: _up(http), "the service to start", 60)
            ab_id = http.post("/api/v1/ab", json={"scenario": SMALL, "rounds_per_minute": 300}, headers=AUTH).json()
            ab_id = ab_id["id"]
            wait_for(lambda: http.get(f"/api/v1/ab/{ab_id}").json()["arms"]["a"]["rounds_done"] >= 2, "2 rounds", 30)
            seen = http.get(f"/api/v1/ab/{ab_id}").json()["arms"]["a"]["rows"]
        server.send_signal(signal.SIGKILL)
        server.wait(10)
    finally:
        if server.poll() is None:
            server.kill()
    killed_at = time.time()

    with TestClient(app_factory(tmp_path)) as client:
        test = client.get(f"/api/v1/ab/{ab_id}").json()
        assert test["status"] == "interrupted"
        assert "the service stopped while this test ran" in test["error"]
        assert test["started_at"] <= test["ended_at"] <= killed_at
        rows = test["arms"]["a"]["rows"]
        assert rows[: len(seen)] == seen and len(rows) < 6  # every round it committed, and no more
        assert test["arms"]["a"]["rounds_done"] == len(rows)
        run = next(r for r in client.get("/api/v1/runs").json() if r["name"] == f"{ab_id}/a")
        assert run["ended_at"] is None and run["interrupted_at"] == test["ended_at"]
        assert client.get("/healthz").json()["ab_running"] == 0
        deleted = client.delete(f"/api/v1/ab/{ab_id}", headers=AUTH).json()
        assert deleted["deleted_runs"] == [f"{ab_id}/a"]


def _up(http: httpx.Client) -> bool:
    try:
        return http.get("/healthz").status_code == 200
    except httpx.HTTPError:
        return False


def test_a_cut_off_tests_progress_is_counted_from_its_rows(tmp_path):
    """Rows are written per round, the test's record only when it starts and ends: the arms' rounds done and
    observed collapse of a test found running come from its rows, with the tolerance of its spec as stored (also
    when this kvscope refuses the spec)."""
    scenario = Scenario.model_validate(SMALL)
    rows = [(1, 0.5), (2, 0.2), (3, 0.1)]  # hit ratio against an ideal of 0.5: below 0.99 x from round 2
    with Database(tmp_path / "kvscope.duckdb") as db:
        history = ABHistory()
        for ab_id in ("ab-1", "ab-2"):
            test = ABTest(ab_id, scenario, None, 6)
            test.arms["a"] = ArmState(f"{ab_id}/a", {"collapse_round": None}, "embedded", "emulator", [])
            history.insert(db, test)
            for number, ratio in rows:
                history.add_row(db, test, "a", {"round": number, "hit_ratio": ratio, "ideal_hit_ratio": 0.5})
        refused = {**scenario.model_dump(mode="json"), "prediction": {"collapse_tolerance": 0.7}, "unknown": 1}
        run_sql(db.con, "UPDATE ab_tests SET spec = ? WHERE ab_id = 'ab-2'", [json.dumps(refused)])
        for test in history.load(db):
            assert test.status == "running" and test.arms["a"].rounds_done == 0
            history.interrupt(db, test)
        cut_off = {test.id: test for test in history.load(db)}
    assert {ab_id: test.status for ab_id, test in cut_off.items()} == {"ab-1": "interrupted", "ab-2": "interrupted"}
    assert cut_off["ab-1"].arms["a"].rounds_done == 3 and cut_off["ab-1"].arms["a"].observed_collapse_round == 2
    assert cut_off["ab-2"].arms["a"].observed_collapse_round == 3  # 0.1 < 0.3 x 0.5, 0.2 is not
