"""The verifier's acceptance, end to end through the CLI: embedded A/Bs recorded through the exporters (the
`tierstore` source, its mapping, the scrape loop) into DuckDB, judged with the shipped media criteria."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import yaml
from support.criteria import MEDIA_CRITERIA
from typer.testing import CliRunner

from kvscope.cli import app
from kvscope.tierstore.planner import plan
from kvscope.tierstore.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[2]
MEDIA = ROOT / "criteria" / "media.yaml"
runner = CliRunner()

NOF = {"name": "nof", "capacity": "20GB", "policy": "lru", "read_bandwidth": "400Gb/s"}


def scenario(dram_only: dict, rounds: int = 6, dram: str = "2GB") -> dict:
    """A small multi-round chat; the DRAM-only arm's NoF pool is attached (idle) unless `dram_only` says more."""
    return {
        "name": "media",
        "workload": {
            "kind": "multi_round",
            "sessions": 8,
            "rounds": rounds,
            "first_prompt_tokens": 2000,
            "output_tokens": 1000,
            "output_cached": True,
        },
        "kv": {"block_tokens": 16, "bytes_per_token": 2000},
        "arms": {
            "dram_only": {"tiers": [{"name": "dram", "capacity": dram, "policy": "lru"}], **dram_only},
            "tiered": {"tiers": [{"name": "dram", "capacity": "200MB", "policy": "lru"}, NOF]},
        },
    }


def record(tmp_path: Path, spec: dict) -> Path:
    path, db = tmp_path / "scenario.yaml", tmp_path / "runs.duckdb"
    path.write_text(yaml.safe_dump(spec))
    result = runner.invoke(app, ["ab", "run", str(path), "--db", str(db)])
    assert result.exit_code == 0, result.output
    assert "recorded runs media/dram_only, media/tiered" in result.output
    return db


def verify(db: Path, criteria: Path, tmp_path: Path) -> tuple[int, dict]:
    out = tmp_path / "verdicts.json"
    result = runner.invoke(
        app, ["verify", "--db", str(db), "--criteria", str(criteria), "--run", "media/dram_only",
              "--run", "media/tiered", "--json", str(out)],
    )  # fmt: skip
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(out.read_text())


def by_name(report: dict) -> dict[str, dict]:
    return {v["document"]["criterion"]["name"]: v["document"] for v in report["verdicts"]}


def test_a_load_that_does_not_collapse_passes_every_media_criterion(tmp_path):
    db = record(tmp_path, scenario({"attached": [NOF]}))
    code, report = verify(db, MEDIA, tmp_path)
    verdicts = by_name(report)
    assert code == 0 and report["passed"]
    assert set(verdicts) == MEDIA_CRITERIA
    assert all(v["passed"] for v in verdicts.values())
    save = verdicts["save_parity"]["observed"][0]
    assert save["a_value"] == save["b_value"] > 0  # the same saves, counted once per logical put in both arms
    written = {row["tier"]: row for row in verdicts["both_tiers_written"]["observed"]}
    # the puts are addressed to DRAM only; each tier's writes cover all of them
    assert set(written) == {"dram", "nof"}
    assert written["nof"]["written"] >= written["nof"]["logical"] == written["dram"]["logical"] == save["b_value"]
    nof = verdicts["nof_delta_zero"]["observed"][0]
    # round 0, 6 rounds and the end, all 0 B
    assert (nof["labels"]["tier"], nof["delta"], nof["samples"]) == ("nof", 0, 8)


def test_a_dram_only_store_that_also_writes_nof_fails_zero_delta_naming_the_bytes(tmp_path):
    """The planted fault: the DRAM-only arm's NoF pool is in its write path (a misconfigured store)."""
    db = record(tmp_path, scenario({"tiers": [{"name": "dram", "capacity": "2GB", "policy": "lru"}, NOF]}))
    code, report = verify(db, MEDIA, tmp_path)
    verdicts = by_name(report)
    assert code == 1 and not report["passed"]
    fault = verdicts["nof_delta_zero"]
    assert not fault["passed"]
    grew = fault["observed"][0]["delta"]
    assert grew > 0 and fault["observed"][0]["labels"]["tier"] == "nof"
    assert f"delta={int(grew):,} B" in fault["summary"]
    assert verdicts["save_parity"]["passed"] and verdicts["both_tiers_written"]["passed"]  # only the fault fails


def test_a_collapsing_dram_arm_fails_no_collapse_at_the_round_the_planner_predicted(tmp_path):
    spec = scenario({"attached": [NOF]}, rounds=10, dram="100MB")
    db = record(tmp_path, spec)
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    predicted = plan(load_scenario(tmp_path / "spec.yaml")).arms["dram_only"].collapse_round
    assert predicted is not None and 1 < predicted < 10  # the scenario really collapses, mid-run
    criteria = tmp_path / "collapse.yaml"
    criteria.write_text(
        yaml.safe_dump(
            {
                "runs": ["dram_only", "tiered"],
                "criteria": [
                    {"name": "dram_no_collapse", "kind": "no_collapse", "run": "dram_only"},
                    {"name": "tiered_no_collapse", "kind": "no_collapse", "run": "tiered"},
                    {"name": "tiered_bound", "kind": "ratio_to_bound", "run": "tiered", "threshold": 0.999},
                ],
            }
        )
    )
    code, report = verify(db, criteria, tmp_path)
    verdicts = by_name(report)
    assert code == 1
    dram = verdicts["dram_no_collapse"]
    first_failed = next(row for row in dram["observed"] if not row["passed"])
    assert first_failed["round"] == first_failed["streak_start"] == predicted
    assert dram["summary"].startswith(f"collapsed in round {predicted}:")
    assert [row["round"] for row in dram["observed"]] == list(range(1, 11))
    assert verdicts["tiered_no_collapse"]["passed"] and verdicts["tiered_bound"]["passed"]


def test_recording_refuses_a_run_name_already_in_the_file_before_simulating(tmp_path):
    db = record(tmp_path, scenario({"attached": [NOF]}, rounds=2))
    again = tmp_path / "again.yaml"
    again.write_text(yaml.safe_dump(scenario({"attached": [NOF]}, rounds=2)))
    result = runner.invoke(app, ["ab", "run", str(again), "--db", str(db)])
    assert result.exit_code == 2
    assert "a run named 'media/dram_only' is already recorded" in " ".join(result.output.split())


def test_a_run_that_never_finished_is_refused_unless_allowed_and_then_its_verdicts_say_so(tmp_path):
    """A recording killed mid-run has no end: nothing says its series cover the run. verify refuses it (exit 2)
    unless told to judge what it recorded; then every verdict names the run and its document says unfinished."""
    db = record(tmp_path, scenario({"attached": [NOF]}))
    with duckdb.connect(str(db)) as con:  # as a SIGKILLed recorder leaves it
        con.execute("UPDATE runs SET ended_at = NULL WHERE name = 'media/tiered'")
    arguments = ["verify", "--db", str(db), "--criteria", str(MEDIA), "--run", "media/dram_only",
                 "--run", "media/tiered", "--json", str(tmp_path / "verdicts.json")]  # fmt: skip
    refused = runner.invoke(app, arguments)
    assert refused.exit_code == 2 and "'media/tiered' never finished" in " ".join(refused.output.split())
    allowed = runner.invoke(app, [*arguments, "--allow-unfinished"])
    assert allowed.exit_code == 0, allowed.output
    verdicts = by_name(json.loads((tmp_path / "verdicts.json").read_text()))
    save = verdicts["save_parity"]
    assert "run 'media/tiered' never finished" in save["summary"]
    assert save["runs"]["tiered"]["finished"] is False and save["runs"]["dram_only"]["finished"] is True
    assert save["runs"]["dram_only"]["origin"] == "ab" and len(save["runs"]["dram_only"]["config_sha256"]) == 64


def test_runs_given_in_the_wrong_order_are_refused_by_their_arm_labels(tmp_path):
    """media.yaml's roles must be bound to runs of those arms: swapped --run arguments would make save parity
    compare the right numbers the wrong way round and nof_delta_zero judge the tiered arm's NoF."""
    db = record(tmp_path, scenario({"attached": [NOF]}))
    swapped = runner.invoke(app, ["verify", "--db", str(db), "--criteria", str(MEDIA),
                                  "--run", "media/tiered", "--run", "media/dram_only"])  # fmt: skip
    assert swapped.exit_code == 2
    assert "role dram_only needs a run of arm 'dram_only'; run 'media/tiered' is of arm 'tiered'" in " ".join(
        swapped.output.split()
    )


def test_check_chunks_holds_the_chunk_summaries_against_the_samples_and_names_an_altered_series(tmp_path):
    """Whole-run verdicts read chunk summaries. By default verify says it trusted them; --check-chunks re-derives
    them from the samples first, passes on a clean recording and refuses (exit 2) one whose samples were edited
    under their chunks, naming the series, before any verdict is stored."""
    db = record(tmp_path, scenario({"attached": [NOF]}))
    out = tmp_path / "verdicts.json"
    arguments = ["verify", "--db", str(db), "--criteria", str(MEDIA), "--run", "media/dram_only",
                 "--run", "media/tiered", "--json", str(out)]  # fmt: skip
    trusted = runner.invoke(app, arguments)
    assert trusted.exit_code == 0 and json.loads(out.read_text())["chunk_summaries"] == "trusted"
    checked = runner.invoke(app, [*arguments, "--check-chunks"])
    assert checked.exit_code == 0, checked.output
    assert json.loads(out.read_text())["chunk_summaries"] == "checked"
    with duckdb.connect(str(db)) as con:  # one sample of the tiered arm's NoF writes, edited in place
        series_id, name = con.execute(
            "SELECT s.series_id, s.name FROM series s JOIN runs r USING (run_id) JOIN samples USING (series_id) "
            "WHERE r.name = 'media/tiered' AND s.name = 'kv.tier.written.bytes' AND s.labels LIKE '%nof%' LIMIT 1"
        ).fetchone()
        verdicts_before = con.execute("SELECT count(*) FROM verdicts").fetchone()[0]
        con.execute(f"UPDATE samples SET value = value + 1 WHERE series_id = {series_id} AND ts = "
                    f"(SELECT max(ts) FROM samples WHERE series_id = {series_id})")  # fmt: skip
    altered = runner.invoke(app, [*arguments, "--check-chunks"])
    assert altered.exit_code == 2
    message = " ".join(altered.output.split())
    assert name in message and "do not match their hash" in message, message
    with duckdb.connect(str(db)) as con:
        assert con.execute("SELECT count(*) FROM verdicts").fetchone()[0] == verdicts_before
