"""Live A/B tests of tier layouts, on the embedded store or a real Mooncake."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, HTTPException, Query, status
from pydantic import BaseModel, ConfigDict, Field

from kvscope.api.abmanager import Busy
from kvscope.api.deps import Authorized, ServicesDep, TokenFirst
from kvscope.api.scenarios import EXAMPLE_SCENARIO, MAX_ROUNDS, accept
from kvscope.tierstore.scenario import Scenario

router = APIRouter(prefix="/api/v1/ab", tags=["ab"], route_class=TokenFirst)


class ABRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scenario: Scenario
    rounds_per_minute: float | None = Field(
        None,
        ge=0.01,  # a pause of at most 100 minutes: a tinier rate's pause overflows the thread's wait
        le=60_000,
        description="pace rounds in wall-clock time so people can watch; as fast as possible when omitted",
    )


@router.post("", status_code=status.HTTP_201_CREATED, dependencies=[Authorized])
def start_ab(
    body: Annotated[ABRequest, Body(openapi_examples={"small": {"value": {"scenario": EXAMPLE_SCENARIO}}})],
    services: ServicesDep,
) -> dict:
    """Start every arm of the scenario in the background; recorded into the database, exported live."""
    try:
        test = services.ab.start(accept(body.scenario), body.rounds_per_minute)
    except Busy as busy:
        raise HTTPException(status.HTTP_409_CONFLICT, str(busy)) from None
    return test.as_json(rows=False)


@router.get("")
def list_ab(services: ServicesDep) -> list[dict]:
    return [test.as_json(rows=False) for test in services.ab.list()]


@router.get("/{ab_id}")
def get_ab(
    ab_id: str,
    services: ServicesDep,
    since_round: Annotated[
        int, Query(ge=-1, le=MAX_ROUNDS, description="only the rows of rounds after this one (-1: every row)")
    ] = -1,
) -> dict:
    """Progress, the per-round rows of every arm (the A/B contract's rows), and the verdicts once it ended."""
    test = services.ab.get(ab_id)
    if test is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no A/B test {ab_id!r}")
    return test.as_json(since_round=since_round)


@router.delete("/{ab_id}", dependencies=[Authorized])
def stop_ab(ab_id: str, services: ServicesDep) -> dict:
    """Stop after the round in progress; everything recorded so far stays."""
    test = services.ab.stop(ab_id)
    if test is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no A/B test {ab_id!r}")
    return test.as_json(rows=False)
