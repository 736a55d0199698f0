"""A Mooncake-backed A/B over the API: real processes per arm, recorded, judged on Mooncake's metrics with the lower
tier bound to its SSD tier, and one such A/B at a time. Needs the real Mooncake (skipped without it, failed under
KVSCOPE_REQUIRE_REAL=1)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from support.criteria import MEDIA_CRITERIA

from kvscope.api.abmanager import _engine_of
from kvscope.tierstore.mooncake import mooncake_missing
from kvscope.tierstore.scenario import load_scenario

TOKEN = {"Authorization": "Bearer test-token"}
CRITERIA = Path(__file__).parents[2] / "criteria" / "media.yaml"
# Nothing is evicted, so the lease need not run out between requests; it must outlast a get on a busy machine: with
# a 10 ms lease a get that took longer failed with -707 (LEASE_EXPIRED) and the request missed its whole chain.
PACED = {"lease_ttl": "1s", "request_interval": "30ms"}


def scenario() -> dict:
    """4 sessions x 4 rounds of 256 KiB blocks, 10 MiB at most: neither arm evicts."""
    return {
        "name": "api_mooncake",
        "workload": {"kind": "multi_round", "sessions": 4, "rounds": 4, "first_prompt_tokens": 256,
                     "user_tokens": 64, "output_tokens": 64},
        "kv": {"block_tokens": 64, "bytes_per_token": "4KiB"},
        "arms": {
            "dram_only": {"store": "mooncake", "mooncake": PACED, "tiers": [{"name": "dram", "capacity": "16MiB"}],
                          "attached": [{"name": "ssd", "capacity": "64MiB"}]},
            "tiered": {"store": "mooncake", "mooncake": PACED, "mirror": True,
                       "tiers": [{"name": "dram", "capacity": "16MiB"}, {"name": "ssd", "capacity": "64MiB"}]},
        },
    }  # fmt: skip


@pytest.fixture
def client(require_real, app_factory, tmp_path):
    missing = mooncake_missing()
    require_real(missing is None, missing or "")
    with TestClient(app_factory(tmp_path, criteria=[CRITERIA])) as client:
        yield client


def test_a_mooncake_ab_runs_one_at_a_time_and_is_judged_on_its_ssd_tier(client):
    started = client.post("/api/v1/ab", json={"scenario": scenario()}, headers=TOKEN)
    assert started.status_code == 201, started.text
    ab = started.json()
    assert {name: arm["store"] for name, arm in ab["arms"].items()} == {
        "dram_only": "mooncake",
        "tiered": "mooncake",
        "tiered_sim": "embedded (mirror of tiered)",
    }
    assert {arm["engine"] for arm in ab["arms"].values()} == {"emulator"}
    second = client.post("/api/v1/ab", json={"scenario": scenario()}, headers=TOKEN)
    assert second.status_code == 409 and "at a time" in second.text

    deadline = time.monotonic() + 90
    while (state := client.get(f"/api/v1/ab/{ab['id']}").json())["status"] == "running":
        assert time.monotonic() < deadline, state
        time.sleep(0.5)
    assert state["status"] == "finished", state["error"]
    verdicts = {verdict["criterion"]: verdict for verdict in state["verdicts"]}
    no_collapse = {"dram_only_no_collapse", "tiered_no_collapse", "tiered_sim_no_collapse"}
    hits = {name: [row["hit_ratio"] for row in arm["rows"]] for name, arm in state["arms"].items()}
    failed = {name: v for name, v in verdicts.items() if not v["passed"]}
    assert {name for name, v in verdicts.items() if v["passed"]} == no_collapse | MEDIA_CRITERIA, (hits, failed)
    real, simulated = state["arms"]["tiered"]["rows"], state["arms"]["tiered_sim"]["rows"]
    assert [row["hit_ratio"] for row in real] == [row["hit_ratio"] for row in simulated]  # nothing evicted

    runs = {run["name"]: run for run in client.get("/api/v1/runs").json()}
    run_id = runs[f"{ab['id']}/tiered"]["run_id"]
    recorded = client.get(f"/api/v1/runs/{run_id}").json()
    assert recorded["config"]["store"]["settings"]["lease_ttl"] == 1.0  # the lease and pacing stay with the run
    assert recorded["config"]["store"]["settings"]["request_interval"] == 0.03


def test_the_page_names_a_real_vllm_engine_and_the_emulator_of_its_mirror():
    scenario = load_scenario(Path(__file__).parents[2] / "examples" / "vllm_mooncake_dram_vs_ssd.yaml")
    engines = {name: _engine_of(name, scenario) for name in scenario.runnable_arms}
    assert engines == {
        "dram_only": "vllm",
        "dram_only_sim": "emulator (vLLM's prefix cache modelled)",
        "tiered": "vllm",
        "tiered_sim": "emulator (vLLM's prefix cache modelled)",
    }
