"""`kvscope scrape --once --format json`: one scrape as JSON lines, raw and normalized."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from typer.testing import CliRunner

from kvscope.cli import app

FIXTURE = (
    Path(__file__).resolve().parent.parent / "fixtures" / "vllm" / "metrics_rendered_v0.33.0_default_SYNTHETIC.txt"
)
runner = CliRunner()


def write_config(tmp_path: Path, targets: list[dict]) -> Path:
    path = tmp_path / "targets.yaml"
    path.write_text(yaml.safe_dump({"targets": targets}))
    return path


def test_once_json_prints_raw_and_normalized_lines(tmp_path, metrics_server):
    url = metrics_server.serve("/metrics", FIXTURE.read_bytes())
    config = write_config(tmp_path, [{"name": "vllm-a", "source": "vllm", "url": url}])
    result = runner.invoke(app, ["scrape", "--config", str(config), "--once", "--format", "json"])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert all(set(line) == {"source", "name", "labels", "value", "kind", "normalized"} for line in lines)
    normalized = {
        (line["name"], line["labels"]["layer"]): line["value"]
        for line in lines
        if line["normalized"] and line["name"].startswith("kv.prefix.") and "layer" in line["labels"]
        and line["name"] != "kv.prefix.capacity.tokens"
    }  # fmt: skip
    assert normalized == {
        ("kv.prefix.query.tokens", "gpu"): 18432.0,
        ("kv.prefix.hit.tokens", "gpu"): 9216.0,
        ("kv.prefix.query.tokens", "external"): 0.0,
        ("kv.prefix.hit.tokens", "external"): 0.0,
    }
    raw = [line for line in lines if not line["normalized"]]
    assert {"name": "vllm:prefix_cache_queries_total", "kind": "counter", "value": 18432.0}.items() <= next(
        line for line in raw if line["name"] == "vllm:prefix_cache_queries_total"
    ).items()


def test_a_down_target_exits_1_and_says_why(tmp_path):
    config = write_config(tmp_path, [{"name": "gone", "source": "vllm", "url": "http://127.0.0.1:9/", "timeout_s": 1}])
    result = runner.invoke(app, ["scrape", "--config", str(config), "--once"])
    assert result.exit_code == 1
    assert "gone: GET http://127.0.0.1:9/ failed" in " ".join(result.output.split())


def test_config_errors_exit_2_naming_the_field(tmp_path):
    config = write_config(tmp_path, [{"name": "a", "source": "vllm", "url": "ftp://x"}])
    result = runner.invoke(app, ["scrape", "--config", str(config), "--once"])
    assert result.exit_code == 2
    assert "targets.0.url" in result.output
