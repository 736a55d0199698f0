"""A fuzz run of the OpenAPI spec (schemathesis): no server error, and every declared response schema holds.

Every operation gets schemathesis' examples, coverage (boundary values) and fuzzing phases, with positive and
negative data. The requests go in-process through Starlette's TestClient to an app whose lifespan runs for the
whole module (database, A/B manager, scraper), with the bearer token, so the mutating endpoints are exercised past
auth (schemathesis still sends some cases with a token of its own: those get 401). The database is seeded with a
finished A/B of the long-output example, so that small run and verdict ids find real runs, samples and bundles.
Generated A/Bs really start: the service's simulation budget is lowered for the module so that each stays small.
A failure is reported by schemathesis with a curl command that reproduces it; the last test checks that the run
got past validation into every handler that matters.

Why not schemathesis' own ASGI transport (`case.call(app=...)`) and `schemathesis.pytest.from_fixture`: the
first is built on `requests` and fails under the urllib3-future that grafana-client's niquests installs over
urllib3 (`'TrafficPolice' object has no attribute 'keys'`); the second sets a `_nodeid` that pytest 9 no longer
has. So the schema is loaded at import from an app that never starts, and the cases are sent with httpx.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import pytest
import schemathesis
import yaml
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from pydantic import SecretStr

from kvscope.api import scenarios
from kvscope.api.abmanager import ABManager
from kvscope.api.alerts import AlertBook
from kvscope.api.app import create_app
from kvscope.api.settings import Settings
from kvscope.tierstore.scenario import parse_scenario
from kvscope.verifier.db import Database

ROOT = Path(__file__).resolve().parents[2]
CRITERIA = ROOT / "criteria" / "media.yaml"
AUTH = {"Authorization": "Bearer test-token"}  # app_factory's token
# fuzzed cases per operation, on top of the examples and coverage phases; raise it for a longer hunt
MAX_EXAMPLES = int(os.environ.get("KVSCOPE_FUZZ_EXAMPLES", "50"))

schema = schemathesis.openapi.from_dict(create_app(Settings(token=SecretStr("unused"))).openapi())
schema.config.generation.update(modes=["positive", "negative"])
schema.config.checks.update(included_check_names=["not_a_server_error", "response_schema_conformance"])
schema.config.output.sanitization.update(enabled=False)  # whole reproductions: the token is the test's

# statuses answered per operation ("POST /api/v1/ab" -> {201: 12, 422: 30}), for the last test
ANSWERED: defaultdict[str, Counter[int]] = defaultdict(Counter)


@pytest.fixture(scope="module")
def client(app_factory, tmp_path_factory):
    """The running service over a database that holds a finished A/B (two runs, seven verdicts)."""
    folder = tmp_path_factory.mktemp("fuzz")
    long_output = parse_scenario(yaml.safe_load((ROOT / "examples" / "long_output.yaml").read_text()))
    with Database(folder / "kvscope.duckdb") as db:
        seed = ABManager(db, AlertBook(), folder / "ab", [CRITERIA]).start(long_output)
        seed.thread.join(60)
        assert seed.status == "finished" and len(seed.verdicts) == 7
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(scenarios, "MAX_BLOCK_LOOKUPS", 1_000_000)  # a generated A/B: about a second
        patch.setattr(scenarios, "MAX_REAL_BYTES", 64 * 1024**2)
        with TestClient(app_factory(folder, criteria=[CRITERIA]), raise_server_exceptions=False) as running:
            yield running


def send(client: TestClient, case: schemathesis.Case) -> httpx.Response:
    """The case as schemathesis serialises it (requests' keywords), sent with httpx."""
    kwargs = case.as_transport_kwargs(headers=AUTH)
    kwargs.pop("cookies", None)  # the API reads none
    if isinstance(kwargs.get("data"), bytes | str):
        kwargs["content"] = kwargs.pop("data")
    return client.request(**kwargs)


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
def test_fuzzing_the_openapi_spec_finds_no_server_error(case, client):
    response = send(client, case)
    ANSWERED[case.operation.label][response.status_code] += 1
    case.validate_response(response, headers=AUTH)


def test_the_fuzz_run_reached_the_handlers():
    """Not only validation errors: the handlers ran, the mutating ones past auth, the evidence ones on real rows."""
    if not ANSWERED:
        pytest.skip("the fuzz run was not part of this session")
    if any(status >= 500 for statuses in ANSWERED.values() for status in statuses):
        pytest.skip("the fuzz run found a server error, and stopped there: see its failure")
    answered = {operation: dict(statuses) for operation, statuses in ANSWERED.items()}
    past_auth = {"POST /api/v1/ab": 201, "DELETE /api/v1/ab/{ab_id}": 404, "POST /api/v1/dashboards/provision": 409}
    found = {
        "GET /healthz": 200,
        "GET /api/v1/ab": 200,
        "GET /api/v1/alerts": 200,
        "POST /api/v1/predict": 200,
        "GET /api/v1/runs/{run_id}": 200,
        "GET /api/v1/runs/{run_id}/samples": 200,
        "GET /api/v1/verdicts/{verdict_id}": 200,
        "GET /api/v1/verdicts/{verdict_id}/bundle": 200,
    }
    for operation, status in {**past_auth, **found}.items():
        assert ANSWERED[operation][status] > 0, f"{operation} never answered {status}: {answered}"
    seeded = ANSWERED["GET /api/v1/ab/{ab_id}"]
    assert seeded[200] + seeded[410] > 0, f"the seeded A/B was never read (or read deleted): {answered}"


def test_every_operation_declares_what_it_answers():
    """The OpenAPI document is the API: each operation's success has a schema (so response conformance checks
    something), a mutation documents its 401, and an operation with parameters or a body its 422."""
    passthrough = {"GET /api/v1/dashboards/{uid}"}  # a Grafana dashboard model, whatever Grafana's schema holds
    for path, operations in schema.raw_schema["paths"].items():
        for method, operation in operations.items():
            label = f"{method.upper()} {path}"
            success = next(code for code in operation["responses"] if code.startswith("2"))
            content = operation["responses"][success].get("content", {})
            if "application/json" in content and label not in passthrough:
                declared = content["application/json"]["schema"]
                models = declared.get("anyOf") or [declared.get("items", declared)]
                assert all("$ref" in model for model in models), f"{label} answers an untyped {declared}"
            if operation.get("security"):
                assert "401" in operation["responses"], label
            if operation.get("parameters") or operation.get("requestBody"):
                assert "422" in operation["responses"], label
    created = schema.raw_schema["paths"]["/api/v1/ab"]["post"]["responses"]["201"]
    assert "Location" in created["headers"]


def test_no_ab_the_fuzz_run_started_failed(client):
    """Background failures are no 5xx: every A/B the fuzzer started must have run (e.g. no pace it cannot wait)."""
    tests = client.get("/api/v1/ab").json()
    if len(tests) < 2:
        pytest.skip("the fuzz run started no A/B in this session")
    failed = {test["id"]: test["error"] for test in tests if test["status"] == "failed"}
    assert not failed


def test_the_scenario_schema_types_sizes_as_written_and_names_the_choices():
    """Sizes, bandwidths and durations are accepted as strings with units or as numbers; policies and backends are
    enums: the document says so, so a client generated from it can send "50GiB"."""
    components = schema.raw_schema["components"]["schemas"]
    tier = components["TierSpec"]["properties"]
    assert {alternative["type"] for alternative in tier["capacity"]["anyOf"]} == {"integer", "string"}
    assert {alternative["type"] for alternative in tier["read_bandwidth"]["anyOf"]} == {"number", "string", "null"}
    assert tier["policy"]["enum"] == ["lru", "fifo", "tail_first", "mooncake", "lmcache"]
    assert tier["backend"]["enum"] == ["accounting", "memory", "file"]
    lease = components["MooncakeSettings"]["properties"]["lease_ttl"]
    assert {alternative["type"] for alternative in lease["anyOf"]} == {"number", "string"}
