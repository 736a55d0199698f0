"""An A/B's detail is bounded: its rows come a page at a time (whole rounds of every arm, at most 256 rows), the
answer names the `since_round` of the next page, and an arm's tiers are bounded in number and name length, so a
row is too. Once, 200 long-named tiers made a 10-round detail 617 KB from a 19 KB body; a 1 MB body of tiers would
have made each row megabytes and the detail gigabytes."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from support.realservers import wait_for

from kvscope.api.routers.ab import MAX_PAGE_ROWS
from kvscope.api.scenarios import MAX_ARMS, MAX_TIER_NAME, MAX_TIERS

AUTH = {"Authorization": "Bearer test-token"}


def scenario(rounds: int, arms: int, tiers: int = 1, name_length: int = 4) -> dict:
    layout = [{"name": f"t{index}".ljust(name_length, "x"), "capacity": "1MiB"} for index in range(tiers)]
    return {
        "name": "pages",
        "workload": {"kind": "multi_round", "sessions": 1, "rounds": rounds, "first_prompt_tokens": 32,
                     "output_tokens": 16},
        "kv": {"block_tokens": 16, "bytes_per_token": 1024},
        "arms": {f"arm{index}": {"tiers": layout} for index in range(arms)},
    }  # fmt: skip


@pytest.fixture
def client(app_factory, tmp_path):
    with TestClient(app_factory(tmp_path)) as client:
        yield client


def run(client: TestClient, body: dict) -> str:
    started = client.post("/api/v1/ab", json={"scenario": body}, headers=AUTH)
    assert started.status_code == 201, started.text
    ab = started.json()["id"]
    wait_for(lambda: client.get(f"/api/v1/ab/{ab}").json()["status"] != "running", f"{ab} to end", 120)
    return ab


def rounds_of(detail: dict) -> dict[str, list[int]]:
    return {name: [row["round"] for row in arm["rows"]] for name, arm in detail["arms"].items()}


def test_rows_come_a_page_of_whole_rounds_at_a_time_and_the_pages_add_up_to_every_row(client):
    ab = run(client, scenario(rounds=7, arms=2))
    whole = client.get(f"/api/v1/ab/{ab}").json()
    assert whole["status"] == "finished" and whole["next_since_round"] is None
    assert rounds_of(whole) == {"arm0": list(range(1, 8)), "arm1": list(range(1, 8))}

    pages, since = [], -1
    while since is not None:
        page = client.get(f"/api/v1/ab/{ab}", params={"since_round": since, "max_rows": 4}).json()
        pages.append(page)
        since = page["next_since_round"]
    assert [rounds_of(page)["arm0"] for page in pages] == [[1, 2], [3, 4], [5, 6], [7]]  # 4 rows: 2 rounds of 2 arms
    assert [page["next_since_round"] for page in pages] == [2, 4, 6, None]
    for name in ("arm0", "arm1"):
        assert [row for page in pages for row in page["arms"][name]["rows"]] == whole["arms"][name]["rows"]
    assert all(page["arms"]["arm0"]["rounds_done"] == 7 and page["verdicts"] == whole["verdicts"] for page in pages)

    one_round = client.get(f"/api/v1/ab/{ab}", params={"since_round": 0, "max_rows": 1}).json()
    assert rounds_of(one_round) == {"arm0": [1], "arm1": [1]} and one_round["next_since_round"] == 1  # whole rounds
    assert client.get(f"/api/v1/ab/{ab}", params={"since_round": 7}).json()["next_since_round"] is None
    assert client.get(f"/api/v1/ab/{ab}", params={"max_rows": MAX_PAGE_ROWS + 1}).status_code == 422
    documented = client.get("/openapi.json").json()["components"]["schemas"]["ABDetail"]["properties"]
    assert "next_since_round" in documented


def test_at_the_bounds_a_page_is_256_rows_and_under_600_kb(client):
    """16 arms of 8 tiers named in 32 characters, 17 rounds: the first page has the 16 rounds that fit in 256
    rows, the second the last round."""
    ab = run(client, scenario(rounds=17, arms=MAX_ARMS, tiers=MAX_TIERS, name_length=MAX_TIER_NAME))
    first = client.get(f"/api/v1/ab/{ab}")
    page = first.json()
    assert page["status"] == "finished", page["error"]
    assert sum(len(arm["rows"]) for arm in page["arms"].values()) == MAX_PAGE_ROWS
    assert page["next_since_round"] == 16
    assert len(first.content) < 600_000, len(first.content)
    rest = client.get(f"/api/v1/ab/{ab}", params={"since_round": 16}).json()
    assert {tuple(rounds) for rounds in rounds_of(rest).values()} == {(17,)} and rest["next_since_round"] is None


def test_the_list_summarizes_each_test_without_its_predictions_round_by_round(client):
    """At the bounds (16 arms, the rounds the work bound allows) each arm's prediction, round by round, is over
    100 KB of a test's answer: the list names the predicted collapse round, the detail holds the prediction."""
    body = scenario(rounds=155, arms=MAX_ARMS, tiers=MAX_TIERS, name_length=MAX_TIER_NAME)
    started = client.post("/api/v1/ab", json={"scenario": body, "rounds_per_minute": 60}, headers=AUTH)
    assert started.status_code == 201, started.text
    ab = started.json()["id"]
    try:
        listed = client.get("/api/v1/ab")
        detail = client.get(f"/api/v1/ab/{ab}", params={"max_rows": 1}).json()
    finally:
        client.delete(f"/api/v1/ab/{ab}", headers=AUTH)
    (summary,) = listed.json()
    predictions = {name: arm["prediction"] for name, arm in detail["arms"].items()}
    assert all(len(p["footprint_bytes_by_round"]) == 155 for p in predictions.values())
    for name, arm in summary["arms"].items():
        assert "prediction" not in arm and "rows" not in arm
        assert arm["predicted_collapse_round"] == predictions[name]["collapse_round"]
    assert len(json.dumps(predictions)) > 100_000 and len(listed.content) < 25_000, len(listed.content)
