"""Live A/B tests of tier layouts, on the embedded store or a real Mooncake."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, HTTPException, Path, Query, Response, status
from pydantic import BaseModel, ConfigDict, Field

from kvscope.api.abhistory import ABTest, ArmState
from kvscope.api.abmanager import Busy
from kvscope.api.deps import Authorized, DatabaseDep, ServicesDep, TokenFirst
from kvscope.api.responses import (
    ABDeletion,
    ABDetail,
    ABSummary,
    ABVerdict,
    ArmDetail,
    ArmSummary,
    errors,
)
from kvscope.api.scenarios import EXAMPLE_SCENARIO, MAX_ROUNDS, accept
from kvscope.tierstore.scenario import Scenario
from kvscope.verifier.db import Database

router = APIRouter(prefix="/api/v1/ab", tags=["ab"], route_class=TokenFirst)
MAX_LISTED = 1000
# A detail holds whole rounds of every arm, at most this many rows (at least one round). With an arm's tiers bounded
# (api/scenarios.py) a page is at most about 0.6 MB: 622 KB for 16 arms of 8 tiers with names at their bounds, whose
# 2,480 rows (155 rounds, the most the work bound allows) made a 4.8 MB detail in one answer
MAX_PAGE_ROWS = 256
ABId = Annotated[str, Path(max_length=64, openapi_examples={"first": {"value": "ab-1"}})]


class ABRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scenario: Scenario
    rounds_per_minute: float | None = Field(
        None,
        ge=0.01,  # a pause of at most 100 minutes: a tinier rate's pause overflows the thread's wait
        le=60_000,
        description="pace rounds in wall-clock time so people can watch; as fast as possible when omitted",
    )


def _arm(state: ArmState) -> ArmSummary:
    return ArmSummary(
        run=state.run,
        store=state.store,
        engine=state.engine,
        tiers=state.tiers,
        placement=state.placement,
        rounds_done=state.rounds_done,
        predicted_collapse_round=state.prediction.get("collapse_round"),
        observed_collapse_round=state.observed_collapse_round,
    )


def _summary(test: ABTest) -> ABSummary:
    return ABSummary(
        id=test.id,
        scenario=test.scenario.name,
        status=test.status,
        rounds_per_minute=test.rounds_per_minute,
        started_at=test.started_at,
        ended_at=test.ended_at,
        error=test.error,
        rounds=test.rounds,
        arms={name: _arm(state) for name, state in test.arms.items()},
        verdicts=[ABVerdict(**verdict) for verdict in test.verdicts],
    )


def _test_or_error(services: ServicesDep, db: Database, ab_id: str) -> ABTest:
    """The test, or 404 (never was) or 410 (deleted)."""
    test = services.ab.get(ab_id)
    if test is not None:
        return test
    deleted = services.ab.deleted(db, ab_id)
    if deleted is not None:
        raise HTTPException(status.HTTP_410_GONE, f"A/B test {ab_id!r} was deleted (at {deleted:.0f}, unix seconds)")
    raise HTTPException(status.HTTP_404_NOT_FOUND, f"no A/B test {ab_id!r}")


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    dependencies=[Authorized],
    responses=errors(401, 409, 413, 422, created="the test, started; `Location` is its URL"),
)
def start_ab(
    body: Annotated[ABRequest, Body(openapi_examples={"small": {"value": {"scenario": EXAMPLE_SCENARIO}}})],
    services: ServicesDep,
    response: Response,
) -> ABSummary:
    """Start every arm of the scenario in the background; recorded into the database, exported live."""
    try:
        test = services.ab.start(accept(body.scenario), body.rounds_per_minute)
    except Busy as busy:
        raise HTTPException(status.HTTP_409_CONFLICT, str(busy)) from None
    response.headers["Location"] = f"{router.prefix}/{test.id}"
    return _summary(test)


@router.get("", responses=errors(422))
def list_ab(
    services: ServicesDep,
    limit: Annotated[int, Query(ge=1, le=MAX_LISTED, description="the newest this many")] = 100,
    offset: Annotated[int, Query(ge=0, le=2**31, description="skip the newest this many")] = 0,
) -> list[ABSummary]:
    """The tests, newest first, summarized: without their rows and their arms' predictions round by round (a test's
    detail has both); those of earlier runs of the service too."""
    newest = sorted(services.ab.list(), key=lambda test: (test.started_at, test.id), reverse=True)
    return [_summary(test) for test in newest[offset : offset + limit]]


@router.get("/{ab_id}", responses=errors(404, 410, 422))
def get_ab(
    ab_id: ABId,
    services: ServicesDep,
    db: DatabaseDep,
    since_round: Annotated[
        int,
        Query(ge=-1, le=MAX_ROUNDS, description="only the rows of rounds after this one (-1 or 0: from the first)"),
    ] = -1,
    max_rows: Annotated[
        int,
        Query(
            ge=1,
            le=MAX_PAGE_ROWS,
            description="at most this many rows, in whole rounds of every arm (at least one round); "
            "`next_since_round` says where the rest begin",
        ),
    ] = MAX_PAGE_ROWS,
) -> ABDetail:
    """Progress, the per-round rows of every arm (the A/B contract's rows), and the verdicts once it ended. Rows
    come a page at a time: the rounds after `since_round` that fit in `max_rows` (at most 256); when more rounds
    are recorded, `next_since_round` is the `since_round` of the next page."""
    test = _test_or_error(services, db, ab_id)
    summary = _summary(test)  # before the rows: a running test's rows only grow, so none is missed
    recorded = max((arm.rounds_done for arm in summary.arms.values()), default=0)
    since = max(since_round, 0)
    until = since + max(1, max_rows // max(1, len(test.arms)))
    rows = services.ab.rows(db, test, since, until)
    return ABDetail(
        **summary.model_dump(exclude={"arms"}),
        spec=test.scenario.model_dump(mode="json"),
        arms={
            name: ArmDetail(**summary.arms[name].model_dump(), prediction=state.prediction, rows=rows[name])
            for name, state in test.arms.items()
        },
        next_since_round=until if recorded > until else None,
    )


@router.delete("/{ab_id}", dependencies=[Authorized], responses=errors(401, 404, 410, 422))
def stop_or_delete_ab(ab_id: ABId, services: ServicesDep, db: DatabaseDep) -> ABSummary | ABDeletion:
    """A running test stops after the round in progress (everything recorded so far stays) and is answered as it
    is then; an ended test is deleted: its record, rows and alerts, and its runs that no verdict was judged on."""
    test = _test_or_error(services, db, ab_id)
    if test.status == "running":
        return _summary(services.ab.stop(ab_id) or test)
    deletion = services.ab.delete(db, ab_id)
    if deletion is None:  # it was running a moment ago, or another request deleted it meanwhile
        raise HTTPException(status.HTTP_409_CONFLICT, f"A/B test {ab_id!r} changed meanwhile; ask again")
    return ABDeletion(id=deletion.ab_id, deleted_runs=deletion.deleted_runs, kept_runs=deletion.kept_runs)
