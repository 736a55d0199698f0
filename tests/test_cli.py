"""The simulation contract end to end through the `kvscope` CLI, on the shipped examples."""

import json
import subprocess
import sys
from importlib import resources
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest
from support.criteria import MEDIA_CRITERIA
from typer.testing import CliRunner

from kvscope.api import cli as service_cli
from kvscope.cli import app
from kvscope.verifier.criteria import load_criteria

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
runner = CliRunner()


@pytest.fixture(scope="module")
def schema() -> dict:
    return json.loads(resources.files("kvscope.tierstore").joinpath("ab_result.schema.json").read_text())


@pytest.fixture(scope="module")
def long_output(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ab") / "long_output.json"
    plot = out.with_suffix(".png")
    scenario = str(EXAMPLES / "long_output.yaml")
    result = runner.invoke(app, ["ab", "run", scenario, "--json", str(out), "--plot", str(plot)])
    assert result.exit_code == 0, result.output
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads(out.read_text())


def test_ab_json_validates_against_the_contract_schema(long_output, schema):
    jsonschema.validate(long_output, schema)
    assert set(long_output["arms"]) == {"dram_only", "tiered"}
    assert len(long_output["arms"]["dram_only"]["rounds"]) == 20


def test_dram_only_arm_collapses_at_the_predicted_round(long_output):
    arm = long_output["arms"]["dram_only"]
    assert arm["prediction"]["collapse_round"] == 8
    assert arm["observed_collapse_round"] == 8
    rounds = arm["rounds"]
    assert all(r["hit_ratio"] == r["ideal_hit_ratio"] for r in rounds[:7])
    assert rounds[-1]["hit_ratio"] == 0.0
    # the loop: once hits are lost, bytes written per round climb far above the steady ~50 GB
    assert rounds[-1]["written_bytes"]["dram"] > 10 * rounds[6]["written_bytes"]["dram"]


def test_tiered_arm_tracks_its_ideal_and_nof_never_evicts(long_output):
    arm = long_output["arms"]["tiered"]
    assert arm["prediction"]["collapse_round"] is None
    assert arm["observed_collapse_round"] is None
    assert [r["hit_ratio"] for r in arm["rounds"]] == [r["ideal_hit_ratio"] for r in arm["rounds"]]
    assert arm["totals"]["evictions"]["nof"] == 0
    assert arm["totals"]["evictions"]["dram"] > 0
    # replicate: both tiers wrote every put
    assert arm["totals"]["written_bytes"]["nof"] == arm["totals"]["written_bytes"]["dram"] == arm["totals"]["put_bytes"]


def test_predict_writes_the_prediction_alone(tmp_path, long_output):
    out = tmp_path / "prediction.json"
    result = runner.invoke(app, ["predict", str(EXAMPLES / "long_output.yaml"), "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "round 8 is the first to lose hits" in " ".join(result.output.split())
    prediction = json.loads(out.read_text())
    assert set(prediction["arms"]["dram_only"]) == {"prediction"}
    assert prediction["arms"]["dram_only"]["prediction"] == long_output["arms"]["dram_only"]["prediction"]


SCENARIOS = sorted(p.name for p in EXAMPLES.glob("*.yaml") if "workload:" in p.read_text())


def test_the_examples_include_every_scenario_the_readme_names():
    assert {"long_output.yaml", "long_output_50_rounds.yaml", "shared_prompt.yaml", "trace.yaml"} <= set(SCENARIOS)


@pytest.mark.parametrize("example", SCENARIOS)
def test_every_shipped_example_predicts(example):
    result = runner.invoke(app, ["predict", str(EXAMPLES / example)])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda s: s.replace("sessions: 112", "sessions: -1"),
            "workload.multi_round.sessions: Input should be greater",
        ),
        (lambda s: s.replace("capacity: 429.5GB", "capacity: 429.5QB"), "arms.dram_only.tiers.0.capacity: invalid"),
        (lambda s: s.replace("policy: lru", "policy: lfu", 1), "policy 'lfu' is not one of lru, fifo, tail_first"),
        (lambda s: s.replace("bytes_per_token: 88.1KB", "bytes_per_tokn: 88.1KB"), "kv.bytes_per_tokn: Extra inputs"),
        (lambda s: s + "\n  : [", "not valid YAML"),
    ],
)
def test_bad_scenarios_name_the_field_and_reason(tmp_path, edit, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text(edit((EXAMPLES / "long_output.yaml").read_text()))
    result = runner.invoke(app, ["ab", "run", str(bad)])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


def test_missing_scenario_file_is_a_clear_error(tmp_path):
    result = runner.invoke(app, ["predict", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2
    assert "cannot read scenario" in result.output


def test_excess_recompute_is_what_the_cache_lost_of_the_ideal_per_request(long_output):
    """All recomputed tokens (`recompute_tokens_per_request`) include the ones no cache could have served (each
    session's new turn); the excess is only what eviction cost: 0 while an arm tracks its ideal, the lost ideal hits
    per request once it collapsed."""
    for name in ("dram_only", "tiered"):
        rounds = long_output["arms"][name]["rounds"]
        for row in rounds:
            lost = row["ideal_hit_tokens"] - row["hit_tokens"]
            assert row["excess_recompute_tokens_per_request"] == pytest.approx(lost / row["requests"])
            assert row["recompute_tokens_per_request"] >= row["excess_recompute_tokens_per_request"]
        totals = long_output["arms"][name]["totals"]
        lost = sum(r["ideal_hit_tokens"] - r["hit_tokens"] for r in rounds)
        assert totals["excess_recompute_tokens_per_request"] == pytest.approx(lost / totals["requests"])
    tiered, dram_only = long_output["arms"]["tiered"]["rounds"], long_output["arms"]["dram_only"]["rounds"]
    assert all(r["excess_recompute_tokens_per_request"] == 0 for r in tiered)
    assert all(r["recompute_tokens_per_request"] > 0 for r in tiered)  # the new turns: recomputed by any cache
    assert dram_only[-1]["excess_recompute_tokens_per_request"] > 0


def test_ab_run_prints_the_curves_of_lru_mooncake_and_lmcache_side_by_side(tmp_path, schema):
    """examples/policies.yaml: one tier under three policies; each collapses in its own way (README, Policies), as
    deep as the planner predicts, which is printed beside what was observed."""
    out = tmp_path / "result.json"
    result = runner.invoke(app, ["ab", "run", str(EXAMPLES / "policies.yaml"), "--json", str(out)])
    assert result.exit_code == 0, result.output
    jsonschema.validate(json.loads(out.read_text()), schema)
    curves = {name: [round(row["hit_ratio"], 3) for row in arm["rounds"]]
              for name, arm in json.loads(out.read_text())["arms"].items()}  # fmt: skip
    assert curves["mooncake"][4:6] == [0.219, 0.0]  # at once
    assert curves["lru"][5:8] == [0.722, 0.575, 0.0]  # over three rounds
    assert curves["lmcache"][5:] == [0.681, 0.512, 0.375, 0.26, 0.163]  # slowly, keeping the chains' heads
    printed = " ".join(result.output.split())
    for name, (rounds, depth) in {"lru": ("6-7", "0.722, 0.575"), "mooncake": ("5-6", "0.219, 0.000"),
                                  "lmcache": ("6-7", "0.681, 0.512")}.items():  # fmt: skip
        collapse = rounds.split("-")[0]
        assert (f"{name}: collapse predicted at round {collapse}, observed at round {collapse}; hit ratio in rounds "
                f"{rounds} predicted {depth}, observed {depth}") in printed  # fmt: skip


def _verify_media(tmp_path, example: str) -> tuple[int, dict[str, bool]]:
    """Record the example's arms, then judge them by criteria/media.yaml: the exit code and each verdict."""
    db, verdicts = tmp_path / "runs.duckdb", tmp_path / "verdicts.json"
    name = example.removesuffix(".yaml")
    recorded = runner.invoke(app, ["ab", "run", str(EXAMPLES / example), "--db", str(db)])
    assert recorded.exit_code == 0, recorded.output
    arguments = ["verify", "--db", str(db), "--criteria", str(EXAMPLES.parent / "criteria" / "media.yaml"),
                 "--run", f"{name}/dram_only", "--run", f"{name}/tiered", "--json", str(verdicts)]  # fmt: skip
    verified = runner.invoke(app, arguments)
    documents = [verdict["document"] for verdict in json.loads(verdicts.read_text())["verdicts"]]
    return verified.exit_code, {document["criterion"]["name"]: document["passed"] for document in documents}


def test_the_media_verification_example_passes_every_media_criterion(tmp_path):
    """The published regime: neither arm collapses, both save and load the same, NoF idle in the DRAM-only arm."""
    code, passed = _verify_media(tmp_path, "media_verification.yaml")
    assert code == 0 and set(passed) == MEDIA_CRITERIA and all(passed.values()), passed


def test_the_long_output_example_fails_save_and_load_parity_as_it_should(tmp_path):
    """Its DRAM-only arm collapses from round 8 and saves its chains again: it saved and loaded other bytes than
    the tiered arm, and the verifier says so (exit 1) while the NoF and the conservation criteria still pass."""
    code, passed = _verify_media(tmp_path, "long_output.yaml")
    assert code == 1
    assert not passed["save_parity"] and not passed["load_parity"]
    assert passed["nof_delta_zero"] and passed["both_tiers_written"] and passed["prompt_tokens_conserved"]


def test_python_dash_m_kvscope_runs_the_command_line():
    """`python -m kvscope` is the `kvscope` script (a `python -m kvscope.cli` would import the app and do nothing)."""
    done = subprocess.run([sys.executable, "-m", "kvscope", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Usage: kvscope" in done.stdout and " ab " in done.stdout, done.stdout


@pytest.fixture
def served(monkeypatch) -> dict:
    """`kvscope demo` and `kvscope serve` set up without serving: what they hand to uvicorn's start, instead."""
    handed: dict = {}

    def serve(settings, on_started=None) -> None:
        handed.update(settings=settings, on_started=on_started)

    monkeypatch.setattr(service_cli, "_serve", serve)
    return handed


def test_demo_runs_from_any_directory_on_the_scenario_and_criteria_kvscope_ships(tmp_path, monkeypatch, served):
    monkeypatch.chdir(tmp_path)  # no examples/ and no criteria/ here
    result = runner.invoke(app, ["demo"])
    assert result.exit_code == 0, result.output
    criteria = served["settings"].criteria
    assert [path.name for path in criteria] == ["media.yaml"] and criteria[0].is_absolute()
    assert (
        criteria[0].read_bytes() == (EXAMPLES.parent / "criteria" / "media.yaml").read_bytes()
    )  # the repository's file
    assert {criterion.name for criterion in load_criteria(criteria[0]).criteria} == MEDIA_CRITERIA
    started = []

    def start(spec, rounds_per_minute):
        started.append((spec.name, rounds_per_minute))
        return SimpleNamespace(id="ab-1")

    served["on_started"](SimpleNamespace(ab=SimpleNamespace(start=start)))
    assert started == [("long_output", 12.0)]


@pytest.mark.parametrize(("command", "by"), [("demo", "option"), ("serve", "option"), ("serve", "environment")])
def test_a_configured_criteria_file_that_is_missing_is_an_error_naming_it(tmp_path, monkeypatch, served, command, by):
    missing = tmp_path / "nowhere" / "media.yaml"
    if by == "environment":
        monkeypatch.setenv("KVSCOPE_CRITERIA", json.dumps([str(missing)]))
    result = runner.invoke(app, [command, *(["--criteria", str(missing)] if by == "option" else [])])
    assert result.exit_code == 2, result.output
    assert str(missing) in "".join(result.output.split()) and "nosuchcriteriafile" in "".join(result.output.split())
    assert not served, "the service started without its criteria"
