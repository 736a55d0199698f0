"""The planner over HTTP: footprint, ideal hit ratio and collapse round per arm, without simulating."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body

from kvscope.api.responses import PredictResponse, errors
from kvscope.api.scenarios import EXAMPLE_SCENARIO, accept
from kvscope.tierstore.planner import plan
from kvscope.tierstore.scenario import Scenario

router = APIRouter(prefix="/api/v1", tags=["predict"])


@router.post("/predict", responses=errors(413, 422))
def predict(
    scenario: Annotated[Scenario, Body(openapi_examples={"small": {"value": EXAMPLE_SCENARIO}})],
) -> PredictResponse:
    """The planner's answer for `scenario` (the same JSON as `kvscope predict --json`)."""
    the_plan = plan(accept(scenario))
    return PredictResponse.model_validate(
        {
            "scenario": scenario.model_dump(mode="json"),
            "arms": {name: {"prediction": the_plan.arm_json(name)} for name in scenario.arms},
            "rounds": [
                {"round": r.round, "query_tokens": r.query_tokens, "ideal_hit_ratio": r.ideal_hit_ratio,
                 "footprint_bytes": r.footprint_bytes}
                for r in the_plan.rounds
            ],
        }
    )  # fmt: skip
