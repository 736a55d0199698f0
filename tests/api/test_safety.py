"""The service's guard rails: loopback by default, a token for mutations, bounded bodies, clean metrics."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from kvscope.api.scenarios import MAX_TIER_NAME, MAX_TIERS
from kvscope.api.settings import Settings

AUTH = {"Authorization": "Bearer test-token"}
SMALL = {
    "workload": {"kind": "multi_round", "sessions": 2, "rounds": 2, "first_prompt_tokens": 64},
    "kv": {"block_tokens": 16, "bytes_per_token": 100},
    "arms": {"a": {"tiers": [{"name": "dram", "capacity": "1MB"}]}},
}


@pytest.fixture
def client(app_factory, tmp_path):
    with TestClient(app_factory(tmp_path, max_body_bytes=4096)) as client:
        yield client


def test_the_service_binds_loopback_and_makes_a_token_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("KVSCOPE_TOKEN", raising=False)
    first, second = Settings(), Settings()
    assert first.host == "127.0.0.1"
    assert len(first.token.get_secret_value()) >= 32 and first.token != second.token and first.token_generated
    monkeypatch.setenv("KVSCOPE_TOKEN", "configured")
    configured = Settings()
    assert configured.token.get_secret_value() == "configured" and not configured.token_generated


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic dGVzdA=="}])
def test_mutations_need_the_bearer_token(client, headers):
    assert client.post("/api/v1/ab", json={"scenario": SMALL}, headers=headers).status_code == 401
    assert client.delete("/api/v1/ab/ab-1", headers=headers).status_code == 401
    assert client.post("/api/v1/dashboards/provision", json={}, headers=headers).status_code == 401


def test_with_the_token_an_ab_starts_and_an_unknown_one_is_404(client):
    auth = {"Authorization": "Bearer test-token"}
    started = client.post("/api/v1/ab", json={"scenario": SMALL}, headers=auth)
    assert started.status_code == 201 and started.json()["id"].startswith("ab-")
    assert client.delete("/api/v1/ab/ab-999", headers=auth).status_code == 404


def test_bodies_over_the_limit_get_413_announced_or_streamed(client):
    big = b'{"scenario": ' + b" " * 5000 + b"}"
    answer = client.post("/api/v1/predict", content=big, headers={"Content-Type": "application/json"})
    assert answer.status_code == 413 and "4096 bytes" in answer.json()["detail"]

    def chunks():
        yield b'{"x": "'
        yield b"y" * 5000
        yield b'"}'

    streamed = client.post("/api/v1/predict", content=chunks(), headers={"Content-Type": "application/json"})
    assert streamed.status_code == 413


def test_bad_input_names_the_field(client):
    answer = client.post("/api/v1/predict", json={**SMALL, "kv": {"block_tokens": -1, "bytes_per_token": 100}})
    assert answer.status_code == 422
    assert ["body", "kv", "block_tokens"] in [problem["loc"] for problem in answer.json()["detail"]]


def test_metrics_are_clean_for_promtool(client, check_metrics):
    client.get("/healthz")
    text = client.get("/metrics").text
    assert "kvscope_http_requests_total" in text and "kvscope_ab_tests" in text
    checked = check_metrics(text)
    assert checked.stdout + checked.stderr == "", checked.stdout + checked.stderr


def test_the_shipped_dashboards_are_served_by_default(tmp_path):
    from kvscope.api.app import create_app

    with TestClient(create_app(Settings(db=tmp_path / "db.duckdb", workdir=tmp_path / "ab"))) as client:
        listed = client.get("/api/v1/dashboards").json()
        assert {d["uid"] for d in listed} >= {"kvscope-kv-tiers", "kvscope-media", "kvscope-fabric", "kvscope-live-ab"}
        one = client.get("/api/v1/dashboards/kvscope-kv-tiers").json()
        assert one["uid"] == "kvscope-kv-tiers" and one["panels"]
        assert client.get("/api/v1/dashboards/nope").status_code == 404


def test_an_ended_ab_is_withdrawn_from_the_exporters_after_its_retention(app_factory, tmp_path):
    """Its final values stay on /metrics for a while, then its stores are let go; the database keeps the runs."""
    import time

    from kvscope.tierstore.live import ENGINES

    with TestClient(app_factory(tmp_path, ab_retain_s=0.3)) as client:
        auth = {"Authorization": "Bearer test-token"}
        ab_id = client.post("/api/v1/ab", json={"scenario": SMALL}, headers=auth).json()["id"]
        deadline = time.monotonic() + 30
        while client.get(f"/api/v1/ab/{ab_id}").json()["status"] == "running":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert f"{ab_id}/a" in ENGINES.snapshot()
        while f"{ab_id}/a" in ENGINES.snapshot():
            assert time.monotonic() < deadline, "the ended A/B's engine was never withdrawn"
            time.sleep(0.05)
        assert [run["name"] for run in client.get("/api/v1/runs").json()] == [f"{ab_id}/a"]


def test_an_arm_named_like_a_path_is_refused_before_any_file_is_opened(client, tmp_path):
    """The file backend stores an arm's tier as `<workdir>/<arm>-<tier>.blocks`: an arm named after another file
    once truncated it. Arm names are plain names now, refused with 422 saying which and why; the file is intact."""
    auth = {"Authorization": "Bearer test-token"}
    victim = tmp_path / "victim"
    victim.write_bytes(b"x" * 100_000)
    for name in (str(victim), "../../victim", "a\nb", 'a"b', "a.b"):
        tiers = [{"name": "dram", "capacity": "1MB", "backend": "file"}]
        scenario = {**SMALL, "arms": {name: {"tiers": tiers}}}
        answer = client.post("/api/v1/ab", json={"scenario": scenario}, headers=auth)
        assert answer.status_code == 422, (name, answer.text)
        messages = [problem["msg"] for problem in answer.json()["detail"]]
        assert any(f"arm name {name!r}: use letters, digits, _ and - only" in message for message in messages)
    assert victim.read_bytes() == b"x" * 100_000


def test_a_file_backed_ab_runs_over_the_api(client, tmp_path):
    """Its work directory is made for it: the blocks land in `<workdir>/<ab>/<arm>-<tier>.blocks`."""
    auth = {"Authorization": "Bearer test-token"}
    scenario = {**SMALL, "arms": {"a": {"tiers": [{"name": "dram", "capacity": "1MB", "backend": "file"}]}}}
    ab_id = client.post("/api/v1/ab", json={"scenario": scenario}, headers=auth).json()["id"]
    for _ in range(600):
        test = client.get(f"/api/v1/ab/{ab_id}").json()
        if test["status"] not in ("pending", "running"):
            break
        time.sleep(0.05)
    assert test["status"] == "finished", test.get("error")
    assert (tmp_path / "ab" / ab_id / "a-dram.blocks").exists()


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ('"capacity": "1MB"', '"capacity": "1e400GB"', "invalid size '1e400GB': not a finite number"),
        ('"bytes_per_token": 100', '"bytes_per_token": Infinity', "invalid size inf: not a finite number"),
        ('"bytes_per_token": 100', '"bytes_per_token": NaN', "invalid size nan: not a finite number"),
        ('"sessions": 2', '"sessions": ' + "9" * 4300, "sessions: an integer of 4300 digits is more than kvscope"),
        ('"capacity": "1MB"', '"capacity": ' + "9" * 4300, "capacity: an integer of 4300 digits"),
        ('"first_prompt_tokens": 64', '"first_prompt_tokens": 64, "seed": 1e999', "finite"),
        # finite, but a time computed from it is not (a TTFT of inf cannot be recorded as JSON)
        ('"capacity": "1MB"', '"capacity": "1MB", "read_bandwidth": 5e-324', "must be at least 1 B/s"),
        (
            '"bytes_per_token": 100',
            '"bytes_per_token": 100}, "engine": {"prefill_tokens_per_s": 5e-324',
            "greater than or equal to 1",
        ),
    ],
)
def test_numbers_json_cannot_carry_are_a_422_naming_the_field_never_a_500(app_factory, tmp_path, field, value, says):
    """1e400GB, JSON's Infinity and NaN, a 4,300-digit integer: refused at validation, and the 422 does not echo
    the input back (it could not be written as JSON)."""
    import json

    with TestClient(app_factory(tmp_path, max_body_bytes=65536)) as client:
        _refused(client, json, field, value, says)


def _refused(client, json, field: str, value: str, says: str) -> None:
    text = json.dumps(SMALL)
    assert field in text
    hostile = text.replace(field, value)
    auth = {"Authorization": "Bearer test-token", "Content-Type": "application/json"}
    for path, body in (("/api/v1/ab", '{"scenario": ' + hostile + "}"), ("/api/v1/predict", hostile)):
        answer = client.post(path, content=body, headers=auth)
        assert answer.status_code == 422, (path, answer.text)
        messages = " ".join(problem["msg"] for problem in answer.json()["detail"])
        assert says in messages and "input" not in answer.json()["detail"][0], (path, messages)


def test_a_small_body_cannot_ask_for_a_huge_answer(client):
    """10 arms x 1,000,000 rounds in about 700 bytes once made the prediction 136 MB: rounds and arms are
    bounded, refused with 422 naming the bound, before anything is planned."""
    arms = {f"a{index}": {"tiers": [{"name": "dram", "capacity": "1MB"}]} for index in range(10)}
    many_rounds = {**SMALL, "workload": {**SMALL["workload"], "sessions": 1, "rounds": 1_000_000}, "arms": arms}
    answer = client.post("/api/v1/predict", json=many_rounds)
    assert answer.status_code == 422 and "1,000,000 rounds is more than the service runs (1,000)" in answer.text
    many_arms = {**SMALL, "arms": {f"a{index}": arms["a0"] for index in range(17)}}
    answer = client.post("/api/v1/predict", json=many_arms)
    assert answer.status_code == 422 and "17 arms is more than the service runs (16)" in answer.text
    assert len(client.post("/api/v1/predict", json=SMALL).content) < 20_000


def tiered(tiers: int, name_length: int = 4) -> dict:
    """SMALL with one arm of `tiers` tiers, each named in `name_length` characters."""
    layout = [{"name": f"t{index}".ljust(name_length, "x"), "capacity": "1MB"} for index in range(tiers)]
    return {**SMALL, "arms": {"a": {"tiers": layout}}}


def test_an_arm_has_at_most_8_tiers_named_in_at_most_32_characters(client):
    """Each tier is a key of four maps in every row of its arm: 200 tiers named in 60 characters once made a
    10-round detail 617 KB from a 19 KB body, and a bigger body holds thousands of tiers."""
    answer = client.post("/api/v1/ab", json={"scenario": tiered(MAX_TIERS + 1)}, headers=AUTH)
    assert answer.status_code == 422
    assert answer.json()["detail"][0]["loc"] == ["body", "scenario", "arms", "a", "tiers"]
    assert "9 tiers (attached ones included) is more than an arm has over the API (8)" in answer.text

    attached = tiered(MAX_TIERS - 1)
    attached["arms"]["a"]["attached"] = [{"name": "nof", "capacity": "1GB"}, {"name": "s3", "capacity": "1GB"}]
    assert client.post("/api/v1/predict", json=attached).status_code == 422

    long_name = tiered(1)
    long_name["arms"]["a"]["attached"] = [{"name": "n" * (MAX_TIER_NAME + 1), "capacity": "1GB"}]
    answer = client.post("/api/v1/predict", json=long_name)
    assert answer.status_code == 422 and "n" * (MAX_TIER_NAME + 1) not in answer.text
    (problem,) = answer.json()["detail"]
    assert problem["loc"] == ["body", "scenario", "arms", "a", "attached", 0, "name"]
    assert problem["msg"] == "a tier's name is at most 32 characters over the API"

    assert client.post("/api/v1/predict", json=tiered(MAX_TIERS, MAX_TIER_NAME)).status_code == 200


def test_provisioning_with_grafana_unreachable_is_a_502_that_names_it(app_factory, tmp_path):
    """A Grafana that does not answer (nothing listens on the port) was a 500 from the HTTP client's error."""
    import socket

    from pydantic import SecretStr

    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    grafana = f"http://127.0.0.1:{port}"
    app = app_factory(tmp_path, grafana_url=grafana, grafana_token=SecretStr("grafana-token"))
    (tmp_path / "dashboards").mkdir()
    (tmp_path / "dashboards" / "one.json").write_text('{"uid": "one", "title": "One", "panels": []}')
    with TestClient(app) as client:
        answer = client.post("/api/v1/dashboards/provision", json={}, headers={"Authorization": "Bearer test-token"})
    assert answer.status_code == 502 and f"Grafana at {grafana} could not be reached" in answer.json()["detail"]


@pytest.mark.parametrize("body", [b"{not json", b'{"scenario": 1}', b""])
def test_without_the_token_any_body_is_a_401_before_it_is_read(client, body):
    """A stranger learns nothing of how a body would be judged: malformed JSON was a 422 before the 401."""
    for path in ("/api/v1/ab", "/api/v1/dashboards/provision"):
        answer = client.post(path, content=body, headers={"Content-Type": "application/json"})
        assert answer.status_code == 401, (path, answer.text)
    with_token = {"Content-Type": "application/json", "Authorization": "Bearer test-token"}
    assert client.post("/api/v1/ab", content=b"{not json", headers=with_token).status_code == 422


def test_an_ab_error_names_the_failure_without_server_paths_or_pydantic_internals():
    from pydantic import BaseModel, ValidationError

    from kvscope.api.abmanager import public_error

    missing = FileNotFoundError(2, "No such file or directory", "/srv/kvscope/out/ab/ab-3/tiered-nof.blocks")
    assert public_error(missing) == "FileNotFoundError: [Errno 2] No such file or directory: '.../tiered-nof.blocks'"

    class Arm(BaseModel):
        rounds: int

    try:
        Arm(rounds="many")
    except ValidationError as error:
        said = public_error(error)
    assert said.startswith("ValidationError: 1 validation error for Arm\nrounds\n  Input should be a valid integer")
    assert "input_value" not in said and "errors.pydantic.dev" not in said
    assert public_error(ValueError("ratio 1/2 of a/b")) == "ValueError: ratio 1/2 of a/b"  # not a path


def test_the_bounds_hold_for_a_whole_scenario_and_the_whole_service(app_factory, tmp_path):
    """Limits per tier let two 1.5 GiB memory tiers through (2.96 GiB peak), any number of A/Bs run at once, and
    1 session x 1,000 rounds pass the lookup bound while its per-round commits take minutes."""
    memory = {"name": "dram", "capacity": "1.5GiB", "backend": "memory"}
    two_tiers = {**SMALL, "arms": {"a": {"tiers": [memory]}, "b": {"tiers": [memory]}}}
    slow = {**SMALL, "workload": {**SMALL["workload"], "rounds": 50}}
    with TestClient(app_factory(tmp_path, max_running_ab=1, max_real_bytes=64 * 1024**2)) as client:
        answer = client.post("/api/v1/predict", json=two_tiers)
        assert answer.status_code == 422
        assert "tiers hold 3,221,225,472 B of real bytes in all; at most 2,147,483,648 B" in answer.text
        long = {**SMALL, "workload": {**SMALL["workload"], "sessions": 1, "rounds": 1000}}
        arms = {f"a{index}": SMALL["arms"]["a"] for index in range(16)}
        answer = client.post("/api/v1/predict", json={**long, "arms": arms})
        assert answer.status_code == 422 and "each recorded round counts 20,000" in answer.text
        assert client.post("/api/v1/predict", json=long).status_code == 200  # one arm: 20 M, within the bound

        first = client.post("/api/v1/ab", json={"scenario": slow, "rounds_per_minute": 60}, headers=AUTH)
        assert first.status_code == 201, first.text
        second = client.post("/api/v1/ab", json={"scenario": SMALL}, headers=AUTH)
        assert second.status_code == 409 and "the service runs 1 at a time" in second.text
        client.delete(f"/api/v1/ab/{first.json()['id']}", headers=AUTH)  # stopped: room for the next

        big = {**SMALL, "arms": {"a": {"tiers": [{**memory, "capacity": "65MiB"}]}}}
        refused = client.post("/api/v1/ab", json={"scenario": big}, headers=AUTH)
        assert refused.status_code == 409 and "more than the service holds at once (67,108,864 B)" in refused.text
        assert client.post("/api/v1/ab", json={"scenario": SMALL}, headers=AUTH).status_code == 201
