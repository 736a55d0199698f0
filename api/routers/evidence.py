"""Evidence: the recorded runs and their samples, and the verdicts with the bundles an auditor re-checks.

Read-only over the verifier database. The SQL text is assembled only from fixed fragments, picked by which
filters a request uses; every value a client sends reaches DuckDB as a `?` parameter. Label keys, which go into
a JSON path, must also match `LABEL_KEY` first.
"""

from __future__ import annotations

import csv
import io
import json
import math
import shutil
import tempfile
from pathlib import Path as FilePath
from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, HTTPException, Path, Query, Response, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse
from pydantic import StringConstraints
from starlette.background import BackgroundTask

from kvscope.api.deps import DatabaseDep
from kvscope.api.responses import RunDetail, RunOut, SamplesPage, VerdictDetail, VerdictsPage, errors
from kvscope.verifier.db import Database, canonical_json, run_sql
from kvscope.verifier.evidence import export_bundle

router = APIRouter(prefix="/api/v1", tags=["evidence"])

INT32_MAX = 2**31 - 1  # run and verdict ids are INTEGER: a larger one is a bad id, not an unknown one
MAX_OFFSET = 2**62  # well inside DuckDB's BIGINT, which a huge Python int would overflow
LABEL_KEY = r"[A-Za-z_][A-Za-z0-9_.:-]*"  # no quote or backslash can reach the JSON path `$."key"`

RunId = Annotated[int, Path(ge=1, le=INT32_MAX)]
VerdictId = Annotated[int, Path(ge=1, le=INT32_MAX)]
Offset = Annotated[int, Query(ge=0, le=MAX_OFFSET, description="rows to skip (from the previous `next_offset`)")]
Seconds = Annotated[float | None, Query(allow_inf_nan=False, description="unix seconds")]
LabelMatcher = Annotated[str, StringConstraints(pattern=rf"^{LABEL_KEY}=", max_length=1024)]


class _Where:
    """A WHERE clause of fixed SQL fragments, with the client's values kept apart as parameters."""

    def __init__(self) -> None:
        self.clauses: list[str] = []
        self.params: list[object] = []

    def add(self, clause: str, *params: object) -> _Where:
        self.clauses.append(clause)
        self.params.extend(params)
        return self

    def add_if(self, clause: str, param: object) -> _Where:
        """The clause only when its filter was given (not None)."""
        return self.add(clause, param) if param is not None else self

    @property
    def sql(self) -> str:
        return " WHERE " + " AND ".join(self.clauses) if self.clauses else ""


def _rows(db: Database, sql: str, params: list[object], json_columns: tuple[str, ...] = ()) -> list[dict]:
    """Rows as dicts, with the JSON columns parsed."""
    result = db.con.execute(sql, params)
    columns = [column[0] for column in result.description]
    rows = [dict(zip(columns, row, strict=True)) for row in result.fetchall()]
    for row in rows:
        for column in json_columns:
            row[column] = json.loads(row[column])
    return rows


def _next_offset(fetched: int, offset: int, limit: int) -> int | None:
    """Pages are fetched with one row more than asked: that row says whether another page follows."""
    return offset + limit if fetched > limit else None


def _invalid(field: str, message: str, value: object) -> RequestValidationError:
    """A 422 shaped like FastAPI's own, for checks that involve more than one parameter."""
    return RequestValidationError([{"type": "value_error", "loc": ("query", field), "msg": message, "input": value}])


# ------------------------------------------------------------------------------------------------------ runs

# Sample counts and time range from `batches`: samples are written only in whole batches, each counted there,
# so a listing never scans the samples table.
_RUNS = """
    SELECT r.run_id, r.name, r.arm, r.scenario, r.origin, r.started_at, r.ended_at, r.interrupted_at,
           (SELECT count(*) FROM series s WHERE s.run_id = r.run_id) AS series,
           coalesce(b.samples, 0) AS samples, b.first_ts, b.last_ts
    FROM runs r
    LEFT JOIN (SELECT run_id, sum(rows) AS samples, min(first_ts) AS first_ts, max(last_ts) AS last_ts
               FROM batches GROUP BY run_id) b USING (run_id)
"""


@router.get("/runs", responses=errors(422))
def list_runs(
    db: DatabaseDep,
    origin: str | None = None,
    arm: str | None = None,
    scenario: str | None = None,
    name_prefix: str | None = None,
) -> list[RunOut]:
    """Recorded runs, newest first, with their series and sample counts; every filter given must hold."""
    where = (
        _Where()
        .add_if("r.origin = ?", origin)
        .add_if("r.arm = ?", arm)
        .add_if("r.scenario = ?", scenario)
        .add_if("starts_with(r.name, ?)", name_prefix)
    )
    sql = f"{_RUNS}{where.sql} ORDER BY r.started_at DESC, r.run_id DESC"
    return [RunOut(**row) for row in _rows(db, sql, where.params)]


def _run_or_404(db: Database, run_id: int) -> dict:
    rows = _rows(db, f"{_RUNS} WHERE r.run_id = ?", [run_id])
    if not rows:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no run with id {run_id}")
    return rows[0]


@router.get("/runs/{run_id}", responses=errors(404, 422))
def get_run(run_id: RunId, db: DatabaseDep) -> RunDetail:
    """One run with its configuration, what it scraped, and which series it holds: the names `/samples` takes."""
    run = _run_or_404(db, run_id)
    run["config"] = json.loads(run_sql(db.con, "SELECT config FROM runs WHERE run_id = ?", [run_id])[0][0])
    run["targets"] = _rows(
        db, "SELECT target, source, config FROM targets WHERE run_id = ? ORDER BY target", [run_id], ("config",)
    )
    run["series_summary"] = _rows(
        db,
        "SELECT name, normalized, kind, count(*) AS count FROM series WHERE run_id = ? "
        "GROUP BY name, normalized, kind ORDER BY name, normalized, kind",
        [run_id],
    )
    return RunDetail(**run)


# ---------------------------------------------------------------------------------------------- samples

Format = Literal["json", "csv", "parquet"]


def _series_where(run_id: int, metric: str, raw: bool, matchers: list[tuple[str, str]]) -> _Where:
    """The series of the request; an empty matcher value matches a missing label, as in PromQL."""
    where = _Where().add("run_id = ?", run_id).add("name = ?", metric).add("normalized = ?", not raw)
    for key, value in matchers:
        where.add("coalesce(json_extract_string(labels, ?), '') = ?", f'$."{key}"', value)
    return where


def _page_sql(series: _Where, start: float | None, end: float | None, step: float | None) -> tuple[str, list]:
    """The samples of the matched series in (series_id, ts) order; with `step`, the last one of each bucket."""
    where = (
        _Where()
        .add(f"series_id IN (SELECT series_id FROM series{series.sql})", *series.params)
        .add_if("ts >= ?", start)
        .add_if("ts <= ?", end)
    )
    sql, params = f"SELECT series_id, ts, value FROM samples{where.sql}", where.params
    if step is not None:  # buckets aligned to `start` (or the epoch), not to the data, so they stay put as it grows
        sql = (
            f"SELECT series_id, max(ts) AS ts, arg_max(value, ts) AS value FROM ({sql}) "
            "GROUP BY series_id, floor((ts - ?) / ?)"
        )
        params = [*params, start or 0.0, step]
    return f"SELECT series_id, ts, value FROM ({sql}) ORDER BY series_id, ts, value LIMIT ? OFFSET ?", params


@router.get(
    "/runs/{run_id}/samples",
    response_model=SamplesPage,
    responses={
        200: {"content": {"text/csv": {}, "application/vnd.apache.parquet": {}}, "description": "one page of samples"},
        **errors(404, 422),
    },
)
def get_samples(
    run_id: RunId,
    db: DatabaseDep,
    metric: Annotated[
        str, Query(min_length=1, max_length=1024, description="the series name", examples=["kv.tier.written.bytes"])
    ],
    label: Annotated[list[LabelMatcher], Query(description="`key=value`, repeatable; all must match")] = [],  # noqa: B006 - FastAPI copies defaults per request; default_factory made it re-inspect `list` each time
    raw: Annotated[bool, Query(description="the exporter's raw series instead of the normalized ones")] = False,
    start: Seconds = None,
    end: Seconds = None,
    step: Annotated[
        float | None, Query(gt=0, allow_inf_nan=False, description="seconds: keep the last sample of each step")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
    offset: Offset = 0,
    fmt: Annotated[Format, Query(alias="format")] = "json",
) -> Response | dict:
    """A run's samples of one metric. CSV and Parquet carry the series' target and labels on every row, and the
    next page's offset in the `X-Next-Offset` header."""
    if start is not None and end is not None and end < start:
        raise _invalid("end", f"end ({end}) is before start ({start})", end)
    found = run_sql(db.con, "SELECT name FROM runs WHERE run_id = ?", [run_id])  # not _RUNS: no counts needed
    if not found:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no run with id {run_id}")
    run = {"name": found[0][0]}
    matchers = [(key, value) for key, _, value in (item.partition("=") for item in label)]
    series_where = _series_where(run_id, metric, raw, matchers)
    series = _rows(
        db,
        f"SELECT series_id, target, labels, kind FROM series{series_where.sql} ORDER BY series_id",
        series_where.params,
        json_columns=("labels",),
    )
    if not series and not run_sql(
        db.con,
        "SELECT 1 FROM series WHERE run_id = ? AND name = ? AND normalized = ? LIMIT 1",
        [run_id, metric, not raw],
    ):
        raise HTTPException(status.HTTP_404_NOT_FOUND, _no_metric(run_id, metric, raw))
    sql, params = _page_sql(series_where, start, end, step)
    fetched = db.con.execute(sql, [*params, limit + 1, offset]).fetchnumpy()
    next_offset = _next_offset(len(fetched["ts"]), offset, limit)
    page = {column: values[:limit] for column, values in fetched.items()}
    if fmt == "json":
        return {
            "run": run["name"],
            "metric": metric,
            "series": series,
            "samples": _json_samples(page),
            "next_offset": next_offset,
        }
    headers = {} if next_offset is None else {"X-Next-Offset": str(next_offset)}
    if fmt == "csv":
        return Response(_csv(page, series), media_type="text/csv; charset=utf-8", headers=headers)
    return _parquet(db, page, f"run-{run_id}-samples", headers)


def _no_metric(run_id: int, metric: str, raw: bool) -> str:
    """What a 404 for a name the run does not hold says: where the names are, and how normalized ones are spelled."""
    message = f"run {run_id} has no {'raw' if raw else 'normalized'} series named {metric!r}"
    if not raw and "." not in metric:
        message += (
            " (normalized series carry the KV-tier model's dotted names, e.g. kv.store.put.bytes, not their "
            "Prometheus names such as kv_store_put_bytes_total; raw=true reads a source's own names)"
        )
    return message + f"; GET /api/v1/runs/{run_id} lists the series it holds"


def _json_samples(page: dict[str, np.ndarray]) -> list[list]:
    """[series_id, ts, value] rows; NaN and infinities, which JSON cannot spell, as null."""
    values = [value if math.isfinite(value) else None for value in page["value"].tolist()]
    return [list(row) for row in zip(page["series_id"].tolist(), page["ts"].tolist(), values, strict=True)]


def _csv(page: dict[str, np.ndarray], series: list[dict]) -> str:
    """Self-describing rows: each value beside its series' target and labels; floats spelled to round-trip."""
    by_id = {s["series_id"]: s for s in series}
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["series_id", "target", "labels", "ts", "value"])
    for series_id, ts, value in zip(
        page["series_id"].tolist(), page["ts"].tolist(), page["value"].tolist(), strict=True
    ):
        s = by_id[series_id]
        writer.writerow([series_id, s["target"], canonical_json(s["labels"]), repr(ts), repr(value)])
    return out.getvalue()


def _parquet(db: Database, page: dict[str, np.ndarray], stem: str, headers: dict[str, str]) -> FileResponse:
    """The page written by DuckDB to a temporary file, streamed, and removed once sent."""
    folder = FilePath(tempfile.mkdtemp(prefix="kvscope-samples-"))
    path = folder / "samples.parquet"
    db.con.register("page", {"row": np.arange(len(page["ts"])), **page})
    try:
        run_sql(
            db.con,
            "COPY (SELECT p.series_id, s.target, s.labels, p.ts, p.value FROM page p JOIN series s USING (series_id) "
            "ORDER BY p.row) TO ? (FORMAT parquet)",
            [str(path)],
        )
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    finally:
        db.con.unregister("page")
    return FileResponse(
        path,
        media_type="application/vnd.apache.parquet",
        filename=f"{stem}.parquet",
        headers=headers,
        background=BackgroundTask(shutil.rmtree, folder, ignore_errors=True),
    )


# --------------------------------------------------------------------------------------------- verdicts

_VERDICT_COLUMNS = "verdict_id, criterion, kind, runs, passed, digest, created_at"


@router.get("/verdicts", responses=errors(422))
def list_verdicts(
    db: DatabaseDep,
    criterion: str | None = None,
    passed: bool | None = None,
    run: Annotated[str | None, Query(description="a run name bound to any role")] = None,
    kind: str | None = None,
    since: Annotated[float | None, Query(allow_inf_nan=False, description="created at or after, unix seconds")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Offset = 0,
) -> VerdictsPage:
    """Verdicts newest first, with their one-line summary; the evidence itself is on `/verdicts/{id}`."""
    where = (
        _Where()
        .add_if("criterion = ?", criterion)
        .add_if("passed = ?", passed)
        .add_if("list_contains(json_extract_string(runs, '$.*'), ?)", run)
        .add_if("kind = ?", kind)
        .add_if("created_at >= ?", since)
    )
    sql = (
        f"SELECT {_VERDICT_COLUMNS}, evidence ->> 'summary' AS summary FROM verdicts{where.sql} "
        "ORDER BY created_at DESC, verdict_id DESC LIMIT ? OFFSET ?"
    )
    verdicts = _rows(db, sql, [*where.params, limit + 1, offset], json_columns=("runs",))
    return VerdictsPage(verdicts=verdicts[:limit], next_offset=_next_offset(len(verdicts), offset, limit))


def _verdict_or_404(db: Database, verdict_id: int) -> dict:
    sql = f"SELECT {_VERDICT_COLUMNS}, evidence AS document FROM verdicts WHERE verdict_id = ?"
    rows = _rows(db, sql, [verdict_id], json_columns=("runs", "document"))
    if not rows:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no verdict with id {verdict_id}")
    return rows[0]


@router.get("/verdicts/{verdict_id}", responses=errors(404, 422))
def get_verdict(verdict_id: VerdictId, db: DatabaseDep) -> VerdictDetail:
    """The verdict with its whole evidence document and the digest over it and the samples it read."""
    return VerdictDetail(**_verdict_or_404(db, verdict_id))


@router.get(
    "/verdicts/{verdict_id}/bundle",
    response_class=FileResponse,
    responses={200: {"content": {"application/zip": {}}, "description": "the bundle, zipped"}, **errors(404, 422)},
)
def get_bundle(verdict_id: VerdictId, db: DatabaseDep) -> FileResponse:
    """The verdict's evidence bundle (evidence.json, samples.parquet, chunks.parquet, rerun.sql, README.md), zipped;
    unzipped, `kvscope evidence check` recomputes it, and DuckDB alone re-runs it (rerun.sql)."""
    _verdict_or_404(db, verdict_id)
    folder = FilePath(tempfile.mkdtemp(prefix="kvscope-bundle-"))
    try:
        bundle = export_bundle(db, [verdict_id], folder / "bundle")
        archive = shutil.make_archive(str(folder / "bundle"), "zip", root_dir=bundle)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return FileResponse(
        archive,
        media_type="application/zip",
        filename=f"kvscope-verdict-{verdict_id}.zip",
        background=BackgroundTask(shutil.rmtree, folder, ignore_errors=True),
    )
