"""criteria/tokens.yaml's tokens_conserved on recordings of real vLLM 0.32 engines: `kvscope record` scrapes a peer
answering with a capture (tests/fixtures/vllm/real-cpu-0.32/), through the vllm collector, its mapping and the
recorder, and `kvscope verify` judges what was recorded. The engine before its first request is the capture with
every value 0 (DERIVED: vLLM's counters start at 0); then it answers the capture itself."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from kvscope.cli import app

ROOT = Path(__file__).resolve().parents[2]
REAL = ROOT / "tests" / "fixtures" / "vllm" / "real-cpu-0.32"
TOKENS = ROOT / "criteria" / "tokens.yaml"
CAPTURES = sorted(p.name for p in REAL.glob("vllm_*.prom"))
# The prompt tokens of each capture (vllm:prompt_tokens_total) and its tokens loaded through the Mooncake connector.
PROMPT_TOKENS = {"vllm_0.32_cpu_mooncake_connector.prom": 16_128, "vllm_0.32_cpu_preemptions.prom": 43_776}
runner = CliRunner()


def before_first_request(text: str) -> str:
    """The exposition with every sample's value 0 (DERIVED): the engine's counters when it has served nothing."""
    return re.sub(r"^([^#\s][^ ]*(?:\{.*\})?) \S+$", r"\1 0.0", text, flags=re.MULTILINE)


def without_source(text: str, vllm_source: str) -> str:
    """The exposition without vllm:prompt_tokens_by_source_total's series of one source (DERIVED)."""
    line = re.compile(rf'^vllm:prompt_tokens_by_source_total\{{.*source="{vllm_source}".*$\n', re.MULTILINE)
    return line.sub("", text)


def record(metrics_server, tmp_path: Path, run: str, text: str) -> Path:
    """`kvscope record` of a vLLM engine for 1.5 s, 4 scrapes a second: zeros for its first two scrapes, then
    `text`."""
    db = tmp_path / "engines.duckdb"
    path = f"/{run}/metrics"
    url = metrics_server.serve(path, before_first_request(text))

    def after_two_scrapes() -> None:
        deadline = time.monotonic() + 10
        while metrics_server.served.get(path, 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        metrics_server.serve(path, text)

    later = threading.Thread(target=after_two_scrapes, daemon=True)
    later.start()
    config = tmp_path / f"{run}.yaml"
    target = {"name": "vllm-0", "source": "vllm", "url": url, "interval_s": 0.25}
    config.write_text(yaml.safe_dump({"exporter": {"listen_port": 0}, "targets": [target]}))
    result = runner.invoke(app, ["record", "--config", str(config), "--db", str(db), "--run", run, "--for", "1.5s"])
    later.join()
    assert result.exit_code == 0, result.output
    return db


def verify(db: Path, run: str, out: Path, *params: str) -> tuple[int, dict]:
    args = ["verify", "--db", str(db), "--criteria", str(TOKENS), "--run", run, "--json", str(out)]
    result = runner.invoke(app, [*args, *(arg for param in params for arg in ("--param", param))])
    assert result.exit_code in (0, 1, 2), result.output
    return result.exit_code, json.loads(out.read_text())


@pytest.mark.parametrize("capture", CAPTURES)
def test_a_real_vllm_engine_s_prompt_tokens_are_its_sources_exactly(metrics_server, tmp_path, capture):
    db = record(metrics_server, tmp_path, "engine", (REAL / capture).read_text())
    code, answer = verify(db, "engine", tmp_path / "verdict.json")
    (verdict,) = answer["verdicts"]
    (row,) = verdict["document"]["observed"]
    assert code == 0 and answer["errors"] == []
    assert (row["group"], row["parts_sum"], row["total"], row["difference"]) == ("0", *[PROMPT_TOKENS[capture]] * 2, 0)
    assert row["sources"].startswith("computed=") and "external=" in row["sources"] and "gpu=" in row["sources"]


def test_a_source_left_out_of_the_sum_fails_by_its_tokens(metrics_server, tmp_path):
    """The Mooncake capture loaded 3,136 prompt tokens through its connector: without `external` the sum is short."""
    capture = "vllm_0.32_cpu_mooncake_connector.prom"
    db = record(metrics_server, tmp_path, "engine", (REAL / capture).read_text())
    code, answer = verify(db, "engine", tmp_path / "verdict.json", "sources=computed,gpu")
    (row,) = answer["verdicts"][0]["document"]["observed"]
    external = PROMPT_TOKENS[capture] - row["parts_sum"]
    assert code == 1 and not row["passed"] and external > 0 and row["difference"] == -external
    assert "external" not in row["sources"]


def test_a_source_the_engine_did_not_export_is_an_input_error_naming_it(metrics_server, tmp_path):
    text = without_source((REAL / "vllm_0.32_cpu_mooncake_connector.prom").read_text(), "external_kv_transfer")
    db = record(metrics_server, tmp_path, "engine", text)
    code, answer = verify(db, "engine", tmp_path / "verdict.json")
    assert code == 2 and answer["verdicts"] == []
    (error,) = answer["errors"]
    assert "kv.prompt.tokens{source=external}" in error and "tokens_conserved" in error
