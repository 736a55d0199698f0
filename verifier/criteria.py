"""Machine criteria as data: YAML in, one SQL query per criterion out, rows back.

A criteria file names the runs it compares by role (`runs: [dram_only, tiered]`); `kvscope verify --run A --run B`
binds them in order. Each criterion compiles to one self-contained SELECT over the verifier's tables, with every
parameter (run ids, names, tolerances) written into it as a literal, so the evidence carries the exact SQL and an
auditor re-runs it as is. The query returns one row per thing checked (a run pair, a series, a tier, a round) with
a `passed` column; a criterion passes when it returned rows and every row passed.

Counter increases follow Prometheus' increase() across resets: a sample lower than the one before it starts a new
counter, whose value counts from zero; a metric with `counter_bits` (a fixed-width counter) wraps instead, a drop
adding value + 2^bits - previous; result rows count both (`resets`, `wraps`). Unlike increase(),
nothing is extrapolated past the first and last sample: the increase is what the run's samples show, and a counter
series that first appears after its target's first scrape of the run was born during it (Mooncake exports its SSD
counters only once it wrote to the SSD), so it counts from zero too (whole-run criteria). Gauges are measured as
the criterion says (last - first, max - min...). Whole-run criteria read the per-batch chunk summaries (schema.py)
rather than every sample (but for fixed-width counters); per-round and per-reset criteria read the samples.
Before a query runs, every metric it reads must have samples in its run (at least two per series for a delta):
an empty or missing series is an error that names it, never a pass.
"""

from __future__ import annotations

import json
import math
from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvscope.validation import describe, read_yaml
from kvscope.verifier.db import Database, Run, VerifierError, run_sql


class CriteriaError(VerifierError):
    """A criteria file that does not validate, or a criterion whose inputs are missing."""


class _Strict(BaseModel):
    # a tolerance of .inf or .nan would pass everything or nothing (and NaN compares false): numbers are finite
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Metric(_Strict):
    """Which series a criterion reads: a KV-tier model instrument (normalized) or a source's own name (raw)."""

    name: str
    raw: bool = False
    where: dict[str, str] = Field(default_factory=dict, description="label equalities, e.g. {tier: nof}")
    counter_bits: int | None = Field(
        None, ge=8, le=64, description="a counter this wide wraps at 2^bits: a drop is a wrap, not a reset"
    )

    def describe(self) -> str:
        labels = ",".join(f"{k}={v}" for k, v in sorted(self.where.items()))
        wraps = f" (wraps at 2^{self.counter_bits})" if self.counter_bits else ""
        return f"{self.name}{{{labels}}}" + (" (raw)" if self.raw else "") + wraps


def _metric(value: object) -> object:
    """`metric: kv.store.put.bytes` is short for `metric: {name: kv.store.put.bytes}`."""
    return {"name": value} if isinstance(value, str) else value


MetricField = Annotated[Metric, Field(json_schema_extra={"description": "instrument name, or {name, raw, where}"})]
Measure = Literal["increase", "last_minus_first", "max_minus_min"]


class _Criterion(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    summary_columns: ClassVar[tuple[str, ...]] = ()  # what a failure message shows of each failed row

    @model_validator(mode="before")
    @classmethod
    def _short_metrics(cls, data: object) -> object:
        if isinstance(data, dict):
            return {k: _short(v) if k in _METRIC_FIELDS else v for k, v in data.items()}
        return data

    @abstractmethod
    def roles(self) -> list[str]:
        """The run roles this criterion judges (each must be one of the file's `runs`)."""

    @abstractmethod
    def reads(self) -> list[tuple[str, Metric, bool]]:
        """(run role, metric, needs a delta) for every series set the query reads."""

    @abstractmethod
    def sql(self, runs: Mapping[str, Run]) -> str:
        """The self-contained SELECT, every parameter a literal, returning rows with a `passed` column."""

    @abstractmethod
    def threshold(self) -> dict:
        """What the rows are held against, as the evidence shows it."""

    def failure_columns(self) -> tuple[str, ...]:
        """The columns a failure message shows of each failed row."""
        return self.summary_columns

    def failure(self, failed: list[dict]) -> str | None:
        """A failure message of this kind's own, when the generic list of failed rows would say it worse."""
        return None


_METRIC_FIELDS = {"metric", "other", "hits", "queries", "bound", "rounds", "consistent_with", "total", "parts"}


def _short(value: object) -> object:
    """A metric field's value, or each of a list of them (`parts`), with the short form expanded."""
    return [_metric(item) for item in value] if isinstance(value, list) else _metric(value)


class Parity(_Criterion):
    """Two runs did the same work: |increase_B - increase_A| / increase_A <= tolerance (summed over series)."""

    kind: Literal["parity"]
    summary_columns = ("run_a", "a_value", "run_b", "b_value", "relative_difference")
    metric: MetricField
    runs: tuple[str, str] = Field(description="the two run roles, A (the reference) then B")
    tolerance: float = Field(ge=0)
    measure: Measure = "increase"

    def roles(self) -> list[str]:
        return list(self.runs)

    def reads(self) -> list[tuple[str, Metric, bool]]:
        return [(role, self.metric, True) for role in self.runs]

    def sql(self, runs: Mapping[str, Run]) -> str:
        a, b = self.runs
        tol = _number(self.tolerance)
        return f"""WITH
a AS ({_per_series(runs[a], self.metric)}),
b AS ({_per_series(runs[b], self.metric)}),
totals AS (
    SELECT (SELECT sum({_MEASURES[self.measure]}) FROM a) AS a_value,
           (SELECT sum({_MEASURES[self.measure]}) FROM b) AS b_value,
           (SELECT sum(samples) FROM a) + (SELECT sum(samples) FROM b) AS samples,
           (SELECT sum(resets) FROM a) + (SELECT sum(resets) FROM b) AS resets,
           (SELECT sum(wraps) FROM a) + (SELECT sum(wraps) FROM b) AS wraps
)
SELECT {_text(runs[a].name)} AS run_a, a_value, {_text(runs[b].name)} AS run_b, b_value,
       (b_value - a_value) / nullif(a_value, 0) AS relative_difference, {tol} AS tolerance, samples, resets, wraps,
       coalesce(a_value > 0 AND abs(b_value - a_value) / a_value <= {tol}, false) AS passed
FROM totals"""

    def threshold(self) -> dict:
        return {"relative_tolerance": self.tolerance}


class _CoveredDelta(_Criterion):
    """A delta judged over a whole run, which means something only if its series were scraped over the whole run:
    `evaluate` checks their coverage first (_check_coverage)."""

    max_missed_scrapes: int = Field(
        1,
        ge=0,
        description="coverage: how many scrapes of its target in a row a series may miss, and how many of the run's "
        "scrape intervals its target may start late or stop early",
    )


class ZeroDelta(_CoveredDelta):
    """A metric did not move in one run: every series' delta is exactly zero (per series, so the evidence names
    which one moved and by how much). Counters default to their increase, gauges to max - min ("never changed")."""

    kind: Literal["zero_delta"]
    summary_columns = ("target", "labels", "delta", "first_ts", "last_ts")
    metric: MetricField
    run: str
    measure: Measure | None = None

    def roles(self) -> list[str]:
        return [self.run]

    def reads(self) -> list[tuple[str, Metric, bool]]:
        return [(self.run, self.metric, True)]

    def sql(self, runs: Mapping[str, Run]) -> str:
        measure = self.measure
        delta = (
            _MEASURES[measure] if measure else "CASE WHEN kind = 'counter' THEN increase ELSE max_value - min_value END"
        )
        return f"""WITH x AS ({_per_series(runs[self.run], self.metric)})
SELECT target, labels, kind, samples, first_ts, last_ts, first_value, last_value, min_value, max_value, resets,
       wraps, {delta} AS delta, {delta} = 0 AS passed
FROM x ORDER BY target, labels"""

    def threshold(self) -> dict:
        return {"delta": 0, "measure": self.measure or "increase for counters, max - min for gauges",
                "max_missed_scrapes": self.max_missed_scrapes}  # fmt: skip


class PositiveDelta(_CoveredDelta):
    """Every tier (or other `group_by` label) of a run shows bytes written: increase > 0, and with
    `consistent_with` at least that metric's increase (physical writes cover the logical puts): the group's own
    (`consistent_scope: group`), or all groups' (`all`: a tiered arm that writes every save to every tier, whose
    puts are addressed to its top tier only)."""

    kind: Literal["positive_delta"]
    summary_columns = ("written", "logical")
    metric: MetricField = Metric(name="kv.tier.written.bytes")
    run: str
    group_by: str = "tier"
    expect: list[str] | None = Field(None, description="values of group_by that must all be present and positive")
    consistent_with: MetricField | None = None
    consistent_scope: Literal["group", "all"] = "group"

    def roles(self) -> list[str]:
        return [self.run]

    def reads(self) -> list[tuple[str, Metric, bool]]:
        found = [(self.run, self.metric, True)]
        return found + ([(self.run, self.consistent_with, True)] if self.consistent_with else [])

    def sql(self, runs: Mapping[str, Run]) -> str:
        run, group = runs[self.run], _label(self.group_by)
        groups = (
            f"SELECT unnest([{', '.join(map(_text, self.expect))}]) AS grp"
            if self.expect
            else "SELECT DISTINCT grp FROM written"
        )
        consistent, check, logical, join = "", "w.increase > 0", "NULL", ""
        if self.consistent_with:
            puts = _per_series(run, self.consistent_with)
            if self.consistent_scope == "all":
                consistent = f""",
logical AS (SELECT coalesce(sum(increase), 0) AS increase FROM ({puts}))"""
                join = " CROSS JOIN logical l"
            else:
                consistent = f""",
logical AS (SELECT {group} AS grp, sum(increase) AS increase FROM ({puts}) GROUP BY grp)"""
                join = " LEFT JOIN logical l USING (grp)"
            check += " AND w.increase >= coalesce(l.increase, 0)"
            logical = "l.increase"
        return f"""WITH
written AS (
    SELECT {group} AS grp, sum(increase) AS increase, sum(samples) AS samples, sum(resets) AS resets,
           sum(wraps) AS wraps
    FROM ({_per_series(run, self.metric)}) GROUP BY grp
){consistent},
expected AS ({groups})
SELECT e.grp AS {_ident(self.group_by)}, w.increase AS written, {logical} AS logical,
       w.samples, w.resets, w.wraps, coalesce({check}, false) AS passed
FROM expected e LEFT JOIN written w USING (grp){join}
ORDER BY 1"""

    def threshold(self) -> dict:
        at_least = self.consistent_with.describe() if self.consistent_with else None
        if at_least and self.consistent_scope == "all":
            at_least = f"{at_least}, summed over every {self.group_by}"
        return {"increase": "> 0", "at_least": at_least, "max_missed_scrapes": self.max_missed_scrapes}

    def failure_columns(self) -> tuple[str, ...]:
        return (self.group_by, *self.summary_columns)


class _Rounds(_Criterion):
    """Per-round hits against the analytic bound, cut at the samples where the round counter advanced.

    Round r spans from the first sample with rounds >= r-1 to the first with rounds >= r (a recording needs a
    sample before round 1). Counters are summed over their series (engines, layers) at each cut.
    """

    run: str
    hits: MetricField = Metric(name="kv.prefix.hit.tokens")
    queries: MetricField = Metric(name="kv.prefix.query.tokens", where={"layer": "gpu"})
    bound: MetricField = Metric(name="tierstore_engine_bound_hit_tokens_total", raw=True)
    rounds: MetricField = Metric(name="tierstore_engine_rounds_total", raw=True)

    def roles(self) -> list[str]:
        return [self.run]

    def reads(self) -> list[tuple[str, Metric, bool]]:
        return [(self.run, metric, True) for metric in (self.hits, self.queries, self.bound, self.rounds)]

    def _per_round(self, run: Run) -> str:
        inputs = {"hit_tokens": self.hits, "query_tokens": self.queries, "bound_tokens": self.bound}
        return per_round_ctes(run, inputs, self.rounds)


def per_round_ctes(run: Run, inputs: Mapping[str, Metric], rounds: Metric, prefix: str = "") -> str:
    """WITH clauses ending in `{prefix}per_round`: one row per round of `run`, each input's increase in that round
    as a column of the input's name, and the resets and wraps of all inputs' series in it (`resets`, `wraps`).
    Counters are summed over their series, reset-adjusted, at each cut."""
    counters = " UNION ALL ".join(
        f"SELECT {_text(column)} AS metric, series_id, {_wrap(metric)} AS wrap FROM series "
        f"WHERE {_series_filter(run, metric)}"
        for column, metric in inputs.items()
    )
    pivoted = ", ".join(f"sum(total) FILTER (WHERE metric = {_text(c)}) AS {_ident(c)}" for c in inputs)
    increases = ", ".join(f"{_ident(c)} - lag({_ident(c)}) OVER w AS {_ident(c)}" for c in [*inputs, "resets", "wraps"])
    p = prefix
    return f"""{p}inputs AS ({counters}),
{p}running AS (  -- each series' running total, past resets (or wraps, for a fixed-width counter)
    SELECT metric, series_id, ts,
           sum({_step("value", "prev", "wrap")}) OVER s AS total,
           count(*) FILTER (WHERE value < prev AND wrap IS NULL) OVER s AS resets,
           count(*) FILTER (WHERE value < prev AND wrap IS NOT NULL) OVER s AS wraps
    FROM (SELECT i.metric, i.wrap, p.series_id, p.ts, p.value,
                 lag(p.value) OVER (PARTITION BY p.series_id ORDER BY p.ts) AS prev
          FROM samples p JOIN {p}inputs i USING (series_id))
    WINDOW s AS (PARTITION BY series_id ORDER BY ts)
),
{p}cuts AS (  -- the first sample at which the round counter reached each value
    SELECT CAST(value AS BIGINT) AS round, min(ts) AS ts
    FROM samples WHERE series_id IN (SELECT series_id FROM series WHERE {_series_filter(run, rounds)})
    GROUP BY 1
),
{p}at_cut AS (
    SELECT c.round, r.metric, sum(r.total) AS total, sum(r.resets) AS resets, sum(r.wraps) AS wraps
    FROM (SELECT c.round, c.ts, i.metric, i.series_id FROM {p}cuts c CROSS JOIN {p}inputs i) c
    ASOF JOIN {p}running r ON c.series_id = r.series_id AND c.ts >= r.ts
    GROUP BY c.round, r.metric
),
{p}pivoted AS (SELECT round, {pivoted}, sum(resets) AS resets, sum(wraps) AS wraps FROM {p}at_cut GROUP BY round),
{p}per_round AS (  -- a round's increase, from the cut before it to its own
    SELECT round, {increases}
    FROM {p}pivoted WINDOW w AS (ORDER BY round)
    QUALIFY lag(round) OVER w IS NOT NULL
)"""


class RatioToBound(_Rounds):
    """Measured hits over the analytic bound, per round, at least `threshold` (hits >= threshold x bound)."""

    kind: Literal["ratio_to_bound"]
    summary_columns = ("round", "hit_tokens", "bound_tokens", "ratio_to_bound")
    threshold_ratio: float = Field(alias="threshold", gt=0, le=1)

    def sql(self, runs: Mapping[str, Run]) -> str:
        t = _number(self.threshold_ratio)
        return f"""WITH
{self._per_round(runs[self.run])}
SELECT round, hit_tokens, query_tokens, bound_tokens,
       hit_tokens / nullif(query_tokens, 0) AS hit_ratio, bound_tokens / nullif(query_tokens, 0) AS ideal_hit_ratio,
       hit_tokens / nullif(bound_tokens, 0) AS ratio_to_bound, {t} AS threshold, resets, wraps,
       hit_tokens >= {t} * bound_tokens AS passed
FROM per_round ORDER BY round"""

    def threshold(self) -> dict:
        return {"ratio_to_bound": f">= {self.threshold_ratio}"}


class NoCollapse(_Rounds):
    """The hit ratio never stays below `fraction` of its ideal for `consecutive` rounds in a row. With the
    defaults (0.99, 1) a round fails exactly when kvscope's planner and A/B runner call it collapsed."""

    kind: Literal["no_collapse"]
    fraction: float = Field(0.99, gt=0, le=1)
    consecutive: int = Field(1, ge=1)

    def sql(self, runs: Mapping[str, Run]) -> str:
        f = _number(self.fraction)
        return f"""WITH
{self._per_round(runs[self.run])},
flagged AS (SELECT *, coalesce(hit_tokens < {f} * bound_tokens, false) AS below FROM per_round),
islands AS (
    SELECT *, row_number() OVER (ORDER BY round) - row_number() OVER (PARTITION BY below ORDER BY round) AS island
    FROM flagged
)
SELECT round, hit_tokens, query_tokens, bound_tokens,
       hit_tokens / nullif(query_tokens, 0) AS hit_ratio, bound_tokens / nullif(query_tokens, 0) AS ideal_hit_ratio,
       resets, wraps, below,
       CASE WHEN below THEN row_number() OVER (PARTITION BY below, island ORDER BY round) ELSE 0 END AS streak,
       CASE WHEN below THEN min(round) OVER (PARTITION BY below, island) END AS streak_start,
       NOT below OR row_number() OVER (PARTITION BY below, island ORDER BY round) < {self.consecutive} AS passed
FROM islands ORDER BY round"""

    def threshold(self) -> dict:
        return {"fraction_of_ideal": self.fraction, "consecutive_rounds": self.consecutive}

    def failure(self, failed: list[dict]) -> str | None:
        """Where the collapse began, and the first round that failed."""
        first = failed[0]
        rounds = f"{self.consecutive} rounds in a row" if self.consecutive > 1 else "the hit ratio"
        return (
            f"collapsed in round {first['streak_start']}: {rounds} below {self.fraction:g} x the ideal "
            f"(round {first['round']}: hit ratio {first['hit_ratio']:.4f}, ideal {first['ideal_hit_ratio']:.4f})"
        )


class Balance(_Criterion):
    """Parts that add up to a whole, in every round of every run: |sum(parts) - total| <= tolerance (default 0:
    exactly). Prompt tokens conserved: recomputed + the engine's cache hits + the store's hits = prompt tokens."""

    kind: Literal["balance"]
    summary_columns = ("run", "round", "parts_sum", "total", "difference")
    runs: list[str] = Field(min_length=1)
    parts: list[MetricField] = Field(min_length=1)
    total: MetricField
    tolerance: float = Field(0.0, ge=0, description="the absolute difference allowed")
    rounds: MetricField = Metric(name="tierstore_engine_rounds_total", raw=True)

    def roles(self) -> list[str]:
        return self.runs

    def reads(self) -> list[tuple[str, Metric, bool]]:
        return [(role, metric, True) for role in self.runs for metric in (*self.parts, self.total, self.rounds)]

    def sql(self, runs: Mapping[str, Run]) -> str:
        columns = {f"part_{index}": part for index, part in enumerate(self.parts)} | {"total": self.total}
        ctes = ",\n".join(
            per_round_ctes(runs[role], columns, self.rounds, f"r{n}_") for n, role in enumerate(self.runs)
        )
        parts = " + ".join(_ident(column) for column in columns if column != "total")
        tol = _number(self.tolerance)
        selects = "\nUNION ALL\n".join(
            f"SELECT {_text(runs[role].name)} AS run, round, {parts} AS parts_sum, total, "
            f"{parts} - total AS difference, {tol} AS tolerance, resets, wraps, "
            f"coalesce(abs({parts} - total) <= {tol}, false) AS passed FROM r{n}_per_round"
            for n, role in enumerate(self.runs)
        )
        return f"WITH\n{ctes}\n{selects}\nORDER BY run, round"

    def threshold(self) -> dict:
        return {
            "parts": [part.describe() for part in self.parts],
            "total": self.total.describe(),
            "absolute_tolerance": self.tolerance,
        }


class SourcesSum(_Criterion):
    """Token accounting: per group of one run (`group_by`, by default each engine), the increases of `metric`'s
    series for each of `sources` (values of its `source_label`) add up to `total`'s increase: |sum - total| <=
    tolerance x total (default 0: exactly), and the total moved. Series of a group and source are summed. A listed
    source without series in the run, or in one group, is an input error naming it, never a pass."""

    kind: Literal["sources_sum"]
    summary_columns = ("group", "parts_sum", "total", "difference", "sources")
    run: str
    metric: MetricField = Metric(name="kv.prompt.tokens")
    source_label: str = "source"
    sources: list[str] = Field(min_length=1, description="the sources that must add up, or one comma-separated string")
    total: MetricField = Metric(name="kv.engine.prompt.tokens")
    group_by: str = "engine"
    tolerance: float = Field(0.0, ge=0, description="the difference allowed, relative to the total")

    @model_validator(mode="before")
    @classmethod
    def _comma_separated_sources(cls, data: object) -> object:
        """`sources: computed,gpu` (a criteria file's {param}) is the list [computed, gpu]."""
        if isinstance(data, dict) and isinstance(data.get("sources"), str):
            return {**data, "sources": [part.strip() for part in data["sources"].split(",") if part.strip()]}
        return data

    def roles(self) -> list[str]:
        return [self.run]

    def _source_metric(self, source: str) -> Metric:
        return self.metric.model_copy(update={"where": {**self.metric.where, self.source_label: source}})

    def reads(self) -> list[tuple[str, Metric, bool]]:
        return [(self.run, self._source_metric(source), True) for source in self.sources] + [
            (self.run, self.total, True)
        ]

    def check_groups(self, db: Database, runs: Mapping[str, Run]) -> None:
        """Every group the total names has series of every listed source: a missing one is named."""
        run = runs[self.run]
        group = _label(self.group_by)
        totals = {
            row[0]
            for row in run_sql(db.con, f"SELECT DISTINCT {group} FROM series WHERE {_series_filter(run, self.total)}")
        }
        present: dict[str, set[str]] = {}
        source = _label(self.source_label)
        for grp, name in run_sql(
            db.con, f"SELECT DISTINCT {group}, {source} FROM series WHERE {_series_filter(run, self.metric)}"
        ):
            present.setdefault(grp, set()).add(name)
        for grp in sorted(totals, key=str):
            missing = [source for source in self.sources if source not in present.get(grp, set())]
            if missing:
                raise CriteriaError(
                    f"criterion {self.name!r}: run {run.name!r}: {self.group_by} {grp!r} has no series "
                    f"{self._source_metric(missing[0]).describe()}: its {self.source_label} {missing[0]!r} is "
                    "missing, so its tokens cannot be accounted for"
                )

    def sql(self, runs: Mapping[str, Run]) -> str:
        run, tol = runs[self.run], _number(self.tolerance)
        sources = ", ".join(_text(source) for source in self.sources)
        return f"""WITH
m AS ({_per_series(run, self.metric)}),
parts AS (
    SELECT {_label(self.group_by)} AS grp, {_label(self.source_label)} AS source, sum(increase) AS increase,
           sum(resets) AS resets
    FROM m WHERE {_label(self.source_label)} IN ({sources}) GROUP BY 1, 2
),
t AS ({_per_series(run, self.total)}),
totals AS (SELECT {_label(self.group_by)} AS grp, sum(increase) AS total, sum(resets) AS resets FROM t GROUP BY 1),
joined AS (
    SELECT totals.grp, totals.total, totals.resets + coalesce(sum(parts.resets), 0) AS resets,
           sum(parts.increase) AS parts_sum,
           string_agg(parts.source || '=' || CAST(parts.increase AS VARCHAR), ', ' ORDER BY parts.source) AS sources
    FROM totals LEFT JOIN parts USING (grp) GROUP BY totals.grp, totals.total, totals.resets
)
SELECT {_text(run.name)} AS run, grp AS "group", sources, parts_sum, total, parts_sum - total AS difference,
       {tol} AS tolerance, resets,
       coalesce(total > 0 AND abs(parts_sum - total) <= {tol} * total, false) AS passed
FROM joined ORDER BY grp"""

    def threshold(self) -> dict:
        return {
            "sources": [self._source_metric(source).describe() for source in self.sources],
            "total": self.total.describe(),
            "per": self.group_by,
            "relative_tolerance": self.tolerance,
        }


class CrossSource(_Criterion):
    """Two sources that must agree: the increases of `metric` and `other` in one run (summed over their series)
    differ by at most `tolerance` of `metric`'s, e.g. NoF tier bytes written against bytes sent on the NoF NICs."""

    kind: Literal["cross_source"]
    summary_columns = ("value", "other_value", "relative_difference")
    run: str
    metric: MetricField
    other: MetricField
    tolerance: float = Field(ge=0)

    def roles(self) -> list[str]:
        return [self.run]

    def reads(self) -> list[tuple[str, Metric, bool]]:
        return [(self.run, self.metric, True), (self.run, self.other, True)]

    def sql(self, runs: Mapping[str, Run]) -> str:
        run, tol = runs[self.run], _number(self.tolerance)
        return f"""WITH
m AS ({_per_series(run, self.metric)}),
o AS ({_per_series(run, self.other)}),
totals AS (SELECT (SELECT sum(increase) FROM m) AS value, (SELECT sum(increase) FROM o) AS other_value,
                  (SELECT sum(resets) FROM m) + (SELECT sum(resets) FROM o) AS resets,
                  (SELECT sum(wraps) FROM m) + (SELECT sum(wraps) FROM o) AS wraps)
SELECT {_text(self.metric.describe())} AS metric, value, {_text(self.other.describe())} AS other, other_value,
       (other_value - value) / nullif(value, 0) AS relative_difference, {tol} AS tolerance, resets, wraps,
       coalesce(abs(other_value - value) <= {tol} * abs(value), false) AS passed
FROM totals"""

    def threshold(self) -> dict:
        return {"relative_tolerance": self.tolerance}


class CounterResets(_Criterion):
    """Counter resets (a restarted engine or store) in a run's counters: each listed with its time and target.
    `allow: true` reports them without failing; by default any reset fails the criterion."""

    kind: Literal["counter_resets"]
    summary_columns = ("target", "name", "labels", "ts", "before", "after")
    run: str
    metric: MetricField | None = Field(None, description="one metric; all counters of the run when omitted")
    allow: bool = False

    def roles(self) -> list[str]:
        return [self.run]

    def reads(self) -> list[tuple[str, Metric, bool]]:
        return [(self.run, self.metric, False)] if self.metric else []

    def sql(self, runs: Mapping[str, Run]) -> str:
        run = runs[self.run]
        chosen = _series_filter(run, self.metric) if self.metric else f"run_id = {run.run_id} AND kind = 'counter'"
        return f"""WITH
points AS (
    SELECT s.target, s.name, s.labels, p.ts, p.value,
           lag(p.value) OVER (PARTITION BY p.series_id ORDER BY p.ts) AS prev
    FROM samples p JOIN series s USING (series_id)
    WHERE p.series_id IN (SELECT series_id FROM series WHERE {chosen})
),
resets AS (SELECT target, name, labels, ts, prev AS before, value AS after FROM points WHERE value < prev),
checked AS (SELECT count(*) AS series_samples FROM points)
SELECT r.target, r.name, r.labels, r.ts, r.before, r.after, {_sql_bool(self.allow)} AS passed
FROM resets r
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL, NULL, series_samples > 0 FROM checked WHERE NOT EXISTS (SELECT 1 FROM resets)
ORDER BY 4 NULLS LAST"""

    def threshold(self) -> dict:
        return {"resets": "any, listed" if self.allow else 0}


Criterion = Annotated[
    Parity | ZeroDelta | PositiveDelta | RatioToBound | NoCollapse | Balance | SourcesSum | CrossSource | CounterResets,
    Field(discriminator="kind"),
]


class CriteriaFile(_Strict):
    runs: list[str] = Field(min_length=1, description="roles, bound in order to `kvscope verify --run` arguments")
    params: dict[str, str] = Field(
        default_factory=dict,
        description="names a criterion's strings refer to as {name} (e.g. a tier), with their defaults; "
        "`kvscope verify --param name=value` binds another value. Holds the values bound.",
    )
    arms: dict[str, str] = Field(
        default_factory=dict,
        description="role -> the arm label its run must carry (`kvscope ab run` labels each run with its arm, "
        "`kvscope record --arm` a cluster's): runs bound to the wrong roles are refused",
    )
    criteria: list[Criterion] = Field(min_length=1)

    @model_validator(mode="after")
    def _known_roles(self) -> CriteriaFile:
        names = [criterion.name for criterion in self.criteria]
        if len(set(names)) != len(names):
            raise ValueError(f"criterion names must be unique, got {names}")
        unknown_arms = [role for role in self.arms if role not in self.runs]
        if unknown_arms:
            raise ValueError(f"arms names role {unknown_arms[0]!r}, not one of {self.runs}")
        for criterion in self.criteria:
            unknown = [role for role in criterion.roles() if role not in self.runs]
            if unknown:
                raise ValueError(f"criterion {criterion.name!r} names run {unknown[0]!r}, not one of {self.runs}")
        return self

    def bind(self, db: Database, run_names: list[str]) -> dict[str, Run]:
        """Roles to recorded runs, in order; errors name the roles and the runs that are missing."""
        if len(run_names) != len(self.runs):
            raise CriteriaError(
                f"the criteria compare {len(self.runs)} run(s) ({', '.join(self.runs)}): "
                f"pass --run {len(self.runs)} time(s), got {len(run_names)}"
            )
        repeated = sorted({name for name in run_names if run_names.count(name) > 1})
        if repeated:  # a run compared with itself passes every parity
            roles = [role for role, name in zip(self.runs, run_names, strict=True) if name == repeated[0]]
            raise CriteriaError(
                f"run {repeated[0]!r} is bound to roles {' and '.join(roles)}: each role needs a run of its own"
            )
        runs = {role: db.run(name) for role, name in zip(self.runs, run_names, strict=True)}
        for role, arm in self.arms.items():
            if runs[role].arm != arm:
                raise CriteriaError(
                    f"role {role} needs a run of arm {arm!r}; run {runs[role].name!r} is of arm {runs[role].arm!r} "
                    "(are the --run arguments in the criteria's order?)"
                )
        return runs


def load_criteria(path: Path, params: Mapping[str, str] | None = None) -> CriteriaFile:
    """A criteria file with its `params` bound: the file's defaults, overridden by `params` (names the file does
    not declare are an error), written into every string of its criteria before they are validated."""
    data = read_yaml(path, "criteria", CriteriaError)
    if isinstance(data, dict) and isinstance(data.get("params", {}), dict):
        declared = {str(k): str(v) for k, v in data.get("params", {}).items()}
        unknown = sorted(set(params or {}) - set(declared))
        if unknown:
            known = ", ".join(declared) or "none"
            raise CriteriaError(f"{path}: no parameter {unknown[0]!r} to bind (the file declares: {known})")
        bound = declared | dict(params or {})
        data = {**data, "params": bound, "criteria": _substitute(data.get("criteria"), bound)}
    try:
        return CriteriaFile.model_validate(data)
    except ValidationError as error:
        raise CriteriaError("\n".join(describe(error, str(path), "criteria"))) from None


def _substitute(value: object, params: Mapping[str, str]) -> object:
    """`{name}` replaced by its bound value in every string of a parsed YAML tree."""
    if isinstance(value, str):
        for name, bound in params.items():
            value = value.replace("{" + name + "}", bound)
        return value
    if isinstance(value, list):
        return [_substitute(item, params) for item in value]
    if isinstance(value, dict):
        return {key: _substitute(item, params) for key, item in value.items()}
    return value


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one criterion's query returned; `passed` needs at least one row and every row passing."""

    criterion: _Criterion
    sql: str
    columns: list[str]
    rows: list[dict]
    series_ids: list[int]

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(row["passed"] for row in self.rows)


def evaluate(db: Database, criterion: _Criterion, runs: Mapping[str, Run]) -> Outcome:
    """Check the criterion's inputs exist, run its SQL, and return the rows with the series it read."""
    series_ids: list[int] = []
    for role, metric, needs_delta in criterion.reads():
        found = _check_input(db, criterion, runs[role], metric, needs_delta)
        if isinstance(criterion, _CoveredDelta):
            _check_coverage(db, criterion, runs[role], found)
        series_ids += found
    if isinstance(criterion, SourcesSum):
        criterion.check_groups(db, runs)
    if isinstance(criterion, CounterResets) and criterion.metric is None:
        series_ids = [
            row[0]
            for row in run_sql(
                db.con,
                "SELECT series_id FROM series WHERE run_id = ? AND kind = 'counter'",
                [runs[criterion.run].run_id],
            )
        ]
        if not series_ids:
            raise CriteriaError(f"criterion {criterion.name!r}: run {runs[criterion.run].name!r} has no counters")
    sql = criterion.sql(runs)
    result = db.con.execute(sql)
    columns = [column[0] for column in result.description]
    rows = [plain_row(dict(zip(columns, row, strict=True))) for row in result.fetchall()]
    return Outcome(criterion, sql, columns, rows, sorted(set(series_ids)))


def _check_input(db: Database, criterion: _Criterion, run: Run, metric: Metric, needs_delta: bool) -> list[int]:
    rows = run_sql(
        db.con,
        f"SELECT s.series_id, coalesce(sum(c.samples), 0) FROM series s LEFT JOIN sample_chunks c USING (series_id) "
        f"WHERE {_series_filter(run, metric, 's.')} GROUP BY s.series_id",
    )
    where = f"criterion {criterion.name!r}: run {run.name!r}"
    if not rows:
        raise CriteriaError(f"{where} has no series {metric.describe()}: nothing to judge (is the name right?)")
    thin = [count for _, count in rows if count < (2 if needs_delta else 1)]
    if thin:
        raise CriteriaError(
            f"{where}: {len(thin)} series of {metric.describe()} have fewer than 2 samples: no delta can be measured"
        )
    return [series_id for series_id, _ in rows]


def _check_coverage(db: Database, criterion: _CoveredDelta, run: Run, series_ids: list[int]) -> None:
    """Each series spans the run, or the criterion cannot judge it (an input error naming the series and the gap).

    A scrape is a time at which the series' target answered: a recorder stamps every series of a scrape with one
    time, so the target's series with the most samples has them all, and only its samples and those of the
    checked series that have fewer are read (a checked series with as many has every scrape). Misses count
    scrapes, not seconds (an A/B is scraped per round, however long a round takes); the run's scrape interval,
    for the targets' ends, is the median interval between them. A series misses at most `max_missed_scrapes` of
    its target's scrapes in a row, between its target's first and last; a gauge also from its target's first
    scrape (a counter may be born during the run: it counts from zero) and to its last; and the target starts
    and stops within `max_missed_scrapes` + 1 of the run's intervals of the run's own first and last scrape (a
    target that went silent mid-run, or joined late, covers only part of it)."""
    allowed = criterion.max_missed_scrapes
    ids = ", ".join(map(str, series_ids))
    counts = f"""counts AS (
    SELECT s.target, s.series_id, sum(c.samples) AS samples
    FROM sample_chunks c JOIN series s USING (series_id)
    WHERE s.run_id = {run.run_id} AND s.target IN (SELECT DISTINCT target FROM series WHERE series_id IN ({ids}))
    GROUP BY s.target, s.series_id
)"""
    # A series with as many samples as its target has scrapes has them all (its samples are at scrapes of its
    # target): only the others' samples are read to find their gaps (-1: no series, as NOT IN (NULL) is never true).
    short = run_sql(
        db.con,
        f"""WITH {counts}
SELECT series_id FROM counts c WHERE series_id IN ({ids})
    AND samples < (SELECT max(samples) FROM counts t WHERE t.target = c.target)""",
    )
    gapped = ", ".join(str(series_id) for (series_id,) in short) or "-1"
    rows = run_sql(
        db.con,
        f"""WITH
{counts},
reference AS (  -- per target, the series with the most samples: its times are the target's scrapes
    SELECT target, arg_max(series_id, samples) AS series_id FROM counts GROUP BY target
),
ranked AS (
    SELECT r.target, x.ts, row_number() OVER (PARTITION BY r.target ORDER BY x.ts) AS k,
           x.ts - lag(x.ts) OVER (PARTITION BY r.target ORDER BY x.ts) AS step
    FROM samples x JOIN reference r USING (series_id)
),
targets AS (SELECT target, min(ts) AS first_ts, max(ts) AS last_ts, count(*) AS scrapes FROM ranked GROUP BY target),
run_span AS (  -- the run's first and last scrape, of any target, from the chunk summaries
    SELECT min(c.first_ts) AS first_ts, max(c.last_ts) AS last_ts, (SELECT median(step) FROM ranked) AS interval
    FROM sample_chunks c JOIN series s USING (series_id) WHERE s.run_id = {run.run_id}
),
present AS (
    SELECT x.series_id, r.k, r.ts, lag(r.k) OVER (PARTITION BY x.series_id ORDER BY r.k) AS prev_k,
           lag(r.ts) OVER (PARTITION BY x.series_id ORDER BY r.k) AS prev_ts
    FROM samples x JOIN series s USING (series_id) JOIN ranked r ON r.target = s.target AND r.ts = x.ts
    WHERE x.series_id IN ({gapped})
),
per_series AS (
    SELECT series_id, min(k) AS first_k, max(k) AS last_k, max(k - prev_k - 1) AS missed,
           arg_max(prev_ts, k - prev_k) AS gap_from, arg_max(ts, k - prev_k) AS gap_to
    FROM present GROUP BY series_id
    UNION ALL
    SELECT c.series_id, 1, t.scrapes, 0, NULL, NULL
    FROM counts c JOIN targets t USING (target) WHERE c.series_id IN ({ids}) AND c.series_id NOT IN ({gapped})
)
SELECT s.series_id, s.target, s.kind, s.labels, p.first_k, p.last_k, coalesce(p.missed, 0), p.gap_from, p.gap_to,
       t.scrapes, t.first_ts - r.first_ts, r.last_ts - t.last_ts, r.interval
FROM series s JOIN per_series p USING (series_id) JOIN targets t USING (target), run_span r
ORDER BY s.series_id""",
    )
    where = f"criterion {criterion.name!r}: run {run.name!r}"
    for (_, target, kind, labels, first_k, last_k, missed, gap_from, gap_to, scrapes, late, early,
         interval) in rows:  # fmt: skip
        series = f"series {target} {labels}"
        if missed > allowed:
            raise CriteriaError(
                f"{where}: {series} has no samples for {missed} scrapes of its target in a row "
                f"(from {gap_from:.3f} to {gap_to:.3f}): it does not cover the run (at most {allowed} may be missed)"
            )
        if kind != "counter" and first_k - 1 > allowed:
            raise CriteriaError(
                f"{where}: {series} first appears at scrape {first_k} of its target: a gauge that joined the run late "
                "says nothing of what happened before it"
            )
        if scrapes - last_k > allowed:
            raise CriteriaError(f"{where}: {series} stops {scrapes - last_k} scrapes before its target's last one")
        if interval and max(late, early) > (allowed + 1) * interval:
            edge = "starts" if late >= early else "stops"
            raise CriteriaError(
                f"{where}: target {target} {edge} {max(late, early):.3f} s {'after' if edge == 'starts' else 'before'}"
                f" the run's {'first' if edge == 'starts' else 'last'} scrape ({interval:.3f} s apart): it covers "
                "only part of the run"
            )


# --------------------------------------------------------------------------------------------- SQL pieces

_MEASURES: dict[str, str] = {
    "increase": "increase",
    "last_minus_first": "last_value - first_value",
    "max_minus_min": "max_value - min_value",
}


def _per_series(run: Run, metric: Metric) -> str:
    """One row per series of `metric` in `run`, merged from its chunks (schema.py): increases inside each chunk,
    plus the step from one chunk's last sample to the next one's first by the same reset rule; first, last, min,
    max, resets. The same numbers a scan of every sample gives, from a few rows per series. A fixed-width counter
    (`counter_bits`) is read from its samples instead: the chunks summed its drops as resets."""
    if metric.counter_bits:
        return _per_series_wrapping(run, metric)
    return f"""
    SELECT s.series_id, s.target, s.labels, s.kind, sum(c.samples) AS samples,
           min(c.first_ts) AS first_ts, max(c.last_ts) AS last_ts,
           sum(c.increase + CASE WHEN c.prev_last IS NULL THEN 0 WHEN c.first_value < c.prev_last THEN c.first_value
                                 ELSE c.first_value - c.prev_last END)
           + CASE WHEN s.kind = 'counter' AND min(c.first_ts) > any_value(t.target_first_ts)
                  THEN arg_min(c.first_value, c.first_ts) ELSE 0 END AS increase,
           sum(c.resets + CASE WHEN c.first_value < c.prev_last THEN 1 ELSE 0 END) AS resets, 0 AS wraps,
           arg_min(c.first_value, c.first_ts) AS first_value, arg_max(c.last_value, c.last_ts) AS last_value,
           min(c.min_value) AS min_value, max(c.max_value) AS max_value
    FROM series s
    JOIN (SELECT *, lag(last_value) OVER (PARTITION BY series_id ORDER BY first_ts) AS prev_last FROM sample_chunks
          WHERE series_id IN (SELECT series_id FROM series WHERE {_series_filter(run, metric)})) c USING (series_id)
    JOIN ({_target_starts(run)}) t ON t.target = s.target
    GROUP BY s.series_id, s.target, s.labels, s.kind"""


def _per_series_wrapping(run: Run, metric: Metric) -> str:
    """_per_series' rows for a fixed-width counter, from every sample: each drop a wrap (_step)."""
    return f"""
    SELECT s.series_id, s.target, s.labels, s.kind, count(*) AS samples, min(p.ts) AS first_ts, max(p.ts) AS last_ts,
           sum({_step("p.value", "p.prev", _wrap(metric))})
           + CASE WHEN s.kind = 'counter' AND min(p.ts) > any_value(t.target_first_ts)
                  THEN arg_min(p.value, p.ts) ELSE 0 END AS increase,
           0 AS resets, count(*) FILTER (WHERE p.value < p.prev) AS wraps,
           arg_min(p.value, p.ts) AS first_value, arg_max(p.value, p.ts) AS last_value,
           min(p.value) AS min_value, max(p.value) AS max_value
    FROM series s
    JOIN (SELECT series_id, ts, value, lag(value) OVER (PARTITION BY series_id ORDER BY ts) AS prev FROM samples
          WHERE series_id IN (SELECT series_id FROM series WHERE {_series_filter(run, metric)})) p USING (series_id)
    JOIN ({_target_starts(run)}) t ON t.target = s.target
    GROUP BY s.series_id, s.target, s.labels, s.kind"""


def _target_starts(run: Run) -> str:
    """Each target's first scrape in `run`: a counter first seen after it was born during the run."""
    return f"""SELECT ts.target, min(tc.first_ts) AS target_first_ts
          FROM series ts JOIN sample_chunks tc USING (series_id) WHERE ts.run_id = {run.run_id} GROUP BY ts.target"""


def _step(value: str, prev: str, wrap: str) -> str:
    """SQL: what a sample adds to its counter after `prev`: its rise, or after a drop its value (a reset), or value +
    `wrap` - prev where `wrap` (2^bits, a column or a literal; NULL for a counter that resets) is not NULL."""
    return (
        f"CASE WHEN {prev} IS NULL THEN 0 WHEN {value} < {prev} THEN {value} + coalesce({wrap} - {prev}, 0) "
        f"ELSE {value} - {prev} END"
    )


def _wrap(metric: Metric) -> str:
    """SQL: 2^bits for a fixed-width counter, NULL for one whose drops are resets."""
    return _number(2.0**metric.counter_bits) if metric.counter_bits else "NULL"


def _series_filter(run: Run, metric: Metric, prefix: str = "") -> str:
    parts = [
        f"{prefix}run_id = {run.run_id}",
        f"{prefix}name = {_text(metric.name)}",
        f"{'NOT ' if metric.raw else ''}{prefix}normalized",
    ]
    parts += [f"{_label(label, prefix)} = {_text(value)}" for label, value in sorted(metric.where.items())]
    return " AND ".join(parts)


def _label(label: str, prefix: str = "") -> str:
    return f"json_extract_string({prefix}labels, {_text('$.' + json.dumps(label))})"


def _text(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _number(value: float) -> str:
    return repr(float(value))


def _sql_bool(value: bool) -> str:
    return "true" if value else "false"


def plain_row(row: dict) -> dict:
    """A result row as the evidence stores it: `labels` (JSON text in DuckDB) parsed, DuckDB's wide integer sums
    (Decimal) as int, and NaN or infinities (no JSON spelling) as None."""
    for key, value in row.items():
        if key == "labels" and isinstance(value, str):
            row[key] = json.loads(value)
        elif isinstance(value, Decimal):
            row[key] = int(value) if value == value.to_integral_value() else float(value)
        elif isinstance(value, float) and not math.isfinite(value):
            row[key] = None
    return row
