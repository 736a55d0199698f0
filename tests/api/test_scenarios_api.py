"""What the API refuses of a scenario, with a 422 naming the field: files on the server, unbounded work."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient


@pytest.fixture
def client(app_factory, tmp_path):
    with TestClient(app_factory(tmp_path)) as client:
        yield client


def scenario(**workload) -> dict:
    return {
        "workload": {"kind": "multi_round", "sessions": 2, "rounds": 2, "first_prompt_tokens": 512, **workload},
        "kv": {"block_tokens": 16, "bytes_per_token": 100},
        "arms": {"a": {"tiers": [{"name": "dram", "capacity": "1MB"}]}},
    }


def mooncake(dram: str = "16MiB", ssd: str = "64MiB") -> dict:
    """A real-Mooncake arm (predicting it starts nothing)."""
    return {"store": "mooncake", "tiers": [{"name": "dram", "capacity": dram}, {"name": "ssd", "capacity": ssd}]}


def test_a_small_scenario_is_predicted(client):
    answer = client.post("/api/v1/predict", json=scenario())
    assert answer.status_code == 200 and answer.json()["arms"]["a"]["prediction"]["collapse_round"] is None


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda s: s["workload"].update(sessions=10**6, rounds=1000), "workload"),
        (lambda s: s.update(workload={"kind": "trace", "path": "/etc/passwd"}, kv={"bytes_per_token": 100}), "kind"),
        (lambda s: s["arms"]["a"]["tiers"][0].update(backend="file", path="/tmp/x.blocks"), "path"),
        (lambda s: s["arms"]["a"]["tiers"][0].update(backend="memory", capacity="1TB"), "capacity"),
        (lambda s: s["workload"].update(sessions=0), "sessions"),
        (lambda s: s["arms"].update(m=mooncake(dram="2GiB")), "capacity"),
        (lambda s: s["arms"].update(m=mooncake(ssd="64GiB")), "capacity"),
        (lambda s: s["arms"].update(m={**mooncake(), "mooncake": {"request_interval": "10s"}}), "request_interval"),
        (lambda s: (s["arms"].update(m=mooncake()), s["workload"].update(sessions=100, rounds=100)), "workload"),
    ],
    ids=[
        "too-much-work", "trace-file", "file-path", "huge-memory-tier", "no-sessions",
        "huge-mooncake-segment", "huge-mooncake-ssd", "slow-mooncake-pacing", "too-many-mooncake-requests",
    ],
)  # fmt: skip
def test_refused_scenarios_get_422_naming_the_field(client, change, field):
    body = scenario()
    change(body)
    answer = client.post("/api/v1/predict", json=body)
    assert answer.status_code == 422, answer.text
    assert any(field in map(str, problem["loc"]) for problem in answer.json()["detail"])


def test_huge_blocks_do_not_hide_a_huge_number_of_requests(client):
    body = scenario(sessions=10**7, rounds=1, first_prompt_tokens=1)
    body["kv"]["block_tokens"] = 10**9
    answer = client.post("/api/v1/predict", json=body)
    assert answer.status_code == 422 and "requests" in answer.text


def test_a_real_vllm_engine_is_bounded_in_blocks(client):
    body = {
        "workload": {"kind": "multi_round", "sessions": 2, "rounds": 2, "first_prompt_tokens": 64},
        "kv": {"block_tokens": 32, "model": {"layers": 2, "kv_heads": 2, "head_dim": 64, "dtype": "bf16"}},
        "engine": {"kind": "vllm", "vllm": {"gpu_blocks": 10**6}},
        "arms": {"a": {**mooncake(), "placement": "demote", "mooncake": {"lease_ttl": "2s"}}},
    }
    answer = client.post("/api/v1/predict", json=body)
    assert answer.status_code == 422 and "gpu_blocks" in answer.text, answer.text
    body["engine"]["vllm"]["gpu_blocks"] = 64
    assert client.post("/api/v1/predict", json=body).status_code == 200
