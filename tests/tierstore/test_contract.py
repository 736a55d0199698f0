"""The A/B result contract: the JSON Schema file is the one generated from the models, and real output fits both."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
from pydantic import ValidationError

from kvscope.tierstore.ab import run_ab
from kvscope.tierstore.contract import ABResult, json_schema
from kvscope.tierstore.scenario import load_scenario

EXAMPLES = Path(__file__).parents[2] / "examples"
SHIPPED = json.loads(resources.files("kvscope.tierstore").joinpath("ab_result.schema.json").read_text())


def test_the_shipped_schema_is_generated_from_the_models():
    regenerate = "python -m kvscope.tierstore.contract > tierstore/ab_result.schema.json"
    assert json_schema() == SHIPPED, f"the shipped schema is stale: {regenerate}"


def test_an_ab_result_fits_the_models_and_the_schema():
    result = json.loads(json.dumps(run_ab(load_scenario(EXAMPLES / "long_output.yaml"))))
    jsonschema.validate(result, SHIPPED)
    parsed = ABResult.model_validate(result)
    assert parsed.arms["dram_only"].prediction.collapse_round == 8
    result["arms"]["dram_only"]["rounds"][0]["hit_ratio"] = 1.5  # a ratio above 1 is refused by both
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(result, SHIPPED)
    with pytest.raises(ValidationError, match="hit_ratio"):
        ABResult.model_validate(result)
