"""What every endpoint answers, as pydantic models: the OpenAPI document is generated from these, so it is the API.

The A/B rows and predictions are the A/B result contract's own models (kvscope.tierstore.contract), the same that
`ab_result.schema.json` is generated from. Error answers share one shape, `Problem` (FastAPI's `{"detail": ...}`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from kvscope.api.abhistory import Status
from kvscope.api.alerts import State
from kvscope.tierstore.backends import BACKENDS
from kvscope.tierstore.contract import Count, Prediction, Ratio, Round, RoundNumber
from kvscope.tierstore.policies import POLICIES

PolicyName = Literal[tuple(POLICIES)]  # type: ignore[valid-type]  # the names the store implements
BackendName = Literal[BACKENDS]  # type: ignore[valid-type]
UnixSeconds = Annotated[float, Field(description="unix seconds")]


class Problem(BaseModel):
    """An error: what was wrong (a sentence, or FastAPI's list of validation problems)."""

    detail: str | list[dict]


_ERRORS = {
    401: "no valid bearer token (`Authorization: Bearer <token>`)",
    404: "no such resource",
    409: "the service cannot do this now (the message says why)",
    410: "it was deleted",
    413: "the request body is larger than the service takes",
    422: "the request is invalid (each problem's place and reason)",
    502: "the upstream service failed or could not be reached",
}


def errors(*codes: int, created: str | None = None) -> dict[int | str, dict]:
    """The OpenAPI `responses` of a route: its error answers (all `Problem`), and its 201 with a Location."""
    documented: dict[int | str, dict] = {code: {"model": Problem, "description": _ERRORS[code]} for code in codes}
    if created:
        documented[201] = {
            "description": created,
            "headers": {"Location": {"description": "the URL of what was created", "schema": {"type": "string"}}},
        }
    return documented


# ----------------------------------------------------------------------------------------------------- A/B tests


class TierLayout(BaseModel):
    name: str
    capacity: Count = Field(description="bytes")
    policy: PolicyName
    backend: BackendName
    read_bandwidth: float | None = Field(None, description="bytes per second from the engine, if modelled")
    attached: bool = Field(False, description="in the arm's cluster but outside its store's path (an idle pool)")


class ArmSummary(BaseModel):
    run: str = Field(description="the arm's recorded run (GET /api/v1/runs?name_prefix=...)")
    store: str = Field(description="embedded, mooncake, none, or 'embedded (mirror of <arm>)'")
    engine: str = Field(description="vllm (a real engine) or the emulator")
    tiers: list[TierLayout] = Field(description="top tier first, then the attached ones")
    placement: str = Field(
        "replicate", description="replicate: every tier holds each block; demote: evictions move down"
    )
    rounds_done: Count
    predicted_collapse_round: RoundNumber | None = Field(
        description="the planner's collapse round; its whole prediction, round by round, is in the test's detail"
    )
    observed_collapse_round: RoundNumber | None


class ArmDetail(ArmSummary):
    prediction: Prediction
    rows: list[Round] = Field(description="the A/B contract's per-round rows (after `since_round`)")


class ABVerdict(BaseModel):
    """A criterion judged when the test ended; `passed` is null when it could not be judged (`error` says why)."""

    criterion: str
    kind: str | None = Field(None, description="the criterion's kind (parity, zero_delta, no_collapse, ...)")
    description: str = Field("", description="what the criterion checks")
    passed: bool | None
    verdict_id: int | None = Field(None, description="its evidence: GET /api/v1/verdicts/{verdict_id}")
    summary: str | None = Field(None, description="what was measured, against the threshold")
    threshold: dict | None = None
    digest: str | None = None
    error: str | None = None


class ABSummary(BaseModel):
    """A test without its per-round figures (rows, predictions by round): what a list carries."""

    id: str
    scenario: str
    status: Status
    rounds_per_minute: float | None
    started_at: UnixSeconds
    ended_at: UnixSeconds | None
    error: str | None = Field(description="why it failed, or how it was interrupted")
    rounds: Count
    arms: dict[str, ArmSummary]
    verdicts: list[ABVerdict]


class ABDetail(ABSummary):
    spec: dict = Field(description="the scenario as accepted")
    arms: dict[str, ArmDetail]  # type: ignore[assignment]  # the summary's arms, with their rows
    next_since_round: RoundNumber | None = Field(
        None,
        description="more rounds are recorded than this answer holds: ask again with since_round set to this; "
        "null when it holds every recorded row after since_round",
    )


class ABDeletion(BaseModel):
    id: str
    deleted_runs: list[str]
    kept_runs: list[str] = Field(description="runs a verdict was judged on: evidence stays re-checkable")


# ----------------------------------------------------------------------------------------------------- predict


class ArmPrediction(BaseModel):
    prediction: Prediction


class PlannedRound(BaseModel):
    round: RoundNumber
    query_tokens: Count
    ideal_hit_ratio: Ratio
    footprint_bytes: Count


class PredictResponse(BaseModel):
    scenario: dict = Field(description="the scenario as accepted, with defaults filled in")
    arms: dict[str, ArmPrediction]
    rounds: list[PlannedRound]


# ----------------------------------------------------------------------------------------------------- alerts


class AlertOut(BaseModel):
    name: str
    labels: dict[str, str]
    state: State
    severity: Literal["critical", "warning"]
    runbook_url: str
    summary: str
    description: str
    value: float | None
    active_at: UnixSeconds = Field(description="when it went pending, or straight to firing")
    fired_at: UnixSeconds | None
    resolved_at: UnixSeconds | None


# ----------------------------------------------------------------------------------------------------- health


class Health(BaseModel):
    status: Literal["ok"]
    version: str
    ab_running: Count
    alerts_active: Count


# ----------------------------------------------------------------------------------------------------- dashboards


class DashboardEntry(BaseModel):
    uid: str
    title: str
    tags: list[str]


class ProvisionedDashboard(BaseModel):
    uid: str
    url: str | None
    version: int | None


class Provisioned(BaseModel):
    grafana: str
    dashboards: list[ProvisionedDashboard]


# ----------------------------------------------------------------------------------------------------- evidence


class RunOut(BaseModel):
    run_id: int
    name: str
    arm: str | None
    scenario: str | None
    origin: str
    started_at: UnixSeconds
    ended_at: UnixSeconds | None = Field(description="null: the run never finished")
    interrupted_at: UnixSeconds | None = Field(description="a restarted service found it cut off: its last commit")
    series: Count
    samples: Count
    first_ts: UnixSeconds | None
    last_ts: UnixSeconds | None


class RunTarget(BaseModel):
    target: str
    source: str
    config: dict


class SeriesCount(BaseModel):
    name: str
    normalized: bool
    kind: str
    count: Count


class RunDetail(RunOut):
    config: dict
    targets: list[RunTarget]
    series_summary: list[SeriesCount]


class SeriesOut(BaseModel):
    series_id: int
    target: str
    labels: dict[str, str]
    kind: str


class SamplesPage(BaseModel):
    run: str
    metric: str
    series: list[SeriesOut]
    samples: list[tuple[int, float, float | None]] = Field(description="[series_id, ts, value]; null: not finite")
    next_offset: int | None


class VerdictOut(BaseModel):
    verdict_id: int
    criterion: str
    kind: str
    runs: dict[str, str] = Field(description="role -> run name")
    passed: bool
    digest: str
    created_at: UnixSeconds


class VerdictListed(VerdictOut):
    summary: str


class VerdictsPage(BaseModel):
    verdicts: list[VerdictListed]
    next_offset: int | None


class VerdictDetail(VerdictOut):
    document: dict = Field(description="the evidence document the digest covers")
