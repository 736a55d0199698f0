"""The exporter configuration: every bad field is named with its place in the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvscope.exporters.config import ConfigError, load_config, parse_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "targets.yaml"


def test_the_shipped_example_is_valid():
    config = load_config(EXAMPLE)
    sources = [target.source for target in config.targets]
    assert sources.count("vllm") == 4
    assert config.exporter.listen_host == "127.0.0.1"


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        ([{"name": "a", "source": "nope"}], "targets.0.source: 'nope' is not one of"),
        ([{"name": "a", "source": "vllm", "url": "not a url"}], "targets.0.url: Input should be a valid URL"),
        ([{"name": "a", "source": "vllm"}], "targets.0.url: Field required"),
        ([{"name": "a", "source": "vllm", "url": "http://127.0.0.1/", "intervall_s": 1}], "targets.0.intervall_s"),
        ([{"name": "a", "source": "vllm", "url": "http://127.0.0.1/", "timeout_s": 0}], "targets.0.timeout_s"),
        (
            [{"name": "a", "source": "vllm", "url": "http://127.0.0.1/"}] * 2,
            "targets: names must be unique, repeated: a",
        ),
    ],
)
def test_bad_targets_are_named(targets, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_config({"targets": targets})


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="cannot read configuration"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("targets: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
