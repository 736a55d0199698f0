"""The A/B tests the service ran, kept in its database: a restarted service lists every past test, marks the one it
was running as interrupted (and closes that test's runs as interrupted), and serves each test's rows from the file.

Tables `ab_tests` and `ab_rows` (verifier.schema, migration 3) hold a test's spec, status, arms, verdicts and
per-round rows; a row is written in the round's own commit, so a kill -9 loses at most the round in flight, as it
does for the samples. The test's record is written when it starts and when it ends, not per round (its arms carry
every round's prediction: 124 KB for 16 arms over 155 rounds): a test cut off counts its arms' progress from its
rows. A deleted test leaves a tombstone (its id and when it was deleted, nothing else), so its id is never given to
another test and a request for it is told it was deleted.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

from pydantic import ValidationError

from kvscope.tierstore.ab import observed_collapse_round
from kvscope.tierstore.scenario import PredictionSpec, Scenario
from kvscope.verifier.db import Database, canonical_json, run_sql

Status = Literal["running", "finished", "stopped", "failed", "interrupted"]


@dataclass
class ArmState:
    run: str
    prediction: dict
    store: str  # which store serves the arm: embedded, mooncake, or "embedded (mirror of <arm>)"
    engine: str  # which engine: vllm (a real server), or the emulator (of vLLM's prefix cache, for a vLLM mirror)
    tiers: list[dict]  # the arm's layout, top first: name, capacity (bytes), policy, backend, read_bandwidth, attached
    placement: str = "replicate"
    rows: list[dict] = field(default_factory=list)  # kept in memory while the test runs; the database has them all
    rounds_done: int = 0
    observed_collapse_round: int | None = None

    def as_record(self) -> dict:
        return {
            "run": self.run,
            "prediction": self.prediction,
            "store": self.store,
            "engine": self.engine,
            "tiers": self.tiers,
            "placement": self.placement,
            "rounds_done": self.rounds_done,
            "observed_collapse_round": self.observed_collapse_round,
        }


@dataclass
class ABTest:
    id: str
    scenario: Scenario
    rounds_per_minute: float | None
    rounds: int  # every arm's, from the plan
    status: Status = "running"
    started_at: float = field(default_factory=time.time)
    ended_at: float | None = None
    error: str | None = None
    arms: dict[str, ArmState] = field(default_factory=dict)
    verdicts: list[dict] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None


@dataclass(frozen=True)
class Deletion:
    """What deleting an ended test removed, and the runs it kept because verdicts were judged on them."""

    ab_id: str
    deleted_runs: list[str]
    kept_runs: list[str]


class ABHistory:
    """Reads and writes the `ab_tests` and `ab_rows` tables; every method takes the cursor of the calling thread."""

    def insert(self, db: Database, test: ABTest) -> None:
        run_sql(
            db.con,
            "INSERT INTO ab_tests (ab_id, spec, scenario, rounds_per_minute, rounds, status, started_at, arms) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            [test.id, canonical_json(test.scenario.model_dump(mode="json")), test.scenario.name,
             test.rounds_per_minute, test.rounds, test.status, test.started_at, _arms_json(test)],
        )  # fmt: skip

    def add_row(self, db: Database, test: ABTest, arm: str, row: dict) -> None:
        """One arm's round (the arm's progress is counted from its rows if the test is cut off)."""
        run_sql(db.con, "INSERT INTO ab_rows VALUES (?, ?, ?, ?)", [test.id, arm, row["round"], canonical_json(row)])

    def update(self, db: Database, test: ABTest) -> None:
        """The test's status, end, error, arms and verdicts as they are now."""
        run_sql(
            db.con,
            "UPDATE ab_tests SET status = ?, ended_at = ?, error = ?, arms = ?, verdicts = ? WHERE ab_id = ?",
            [test.status, test.ended_at, test.error, _arms_json(test), canonical_json(test.verdicts), test.id],
        )

    def load(self, db: Database) -> list[ABTest]:
        """Every test not deleted, oldest first, without rows (`rows` reads them)."""
        records = run_sql(
            db.con,
            "SELECT ab_id, spec, rounds_per_minute, rounds, status, started_at, ended_at, error, arms, verdicts "
            "FROM ab_tests WHERE deleted_at IS NULL ORDER BY started_at, ab_id",
        )
        tests = []
        for ab_id, spec, pace, rounds, status, started, ended, error, arms, verdicts in records:
            test = ABTest(ab_id, _scenario(json.loads(spec)), pace, rounds, status, started, ended, error)
            test.arms = {name: ArmState(**record) for name, record in json.loads(arms).items()}
            test.verdicts = json.loads(verdicts) if verdicts else []
            test.stop.set()
            tests.append(test)
        return tests

    def rows(self, db: Database, ab_id: str, since_round: int, until_round: int) -> dict[str, list[dict]]:
        """Each arm's rows of rounds after `since_round` up to `until_round`, in round order."""
        found: dict[str, list[dict]] = {}
        for arm, row in run_sql(
            db.con,
            "SELECT arm, row FROM ab_rows WHERE ab_id = ? AND round > ? AND round <= ? ORDER BY arm, round",
            [ab_id, since_round, until_round],
        ):
            found.setdefault(arm, []).append(json.loads(row))
        return found

    def taken_ids(self, db: Database) -> list[str]:
        """Every id ever given, deleted ones included."""
        return [row[0] for row in run_sql(db.con, "SELECT ab_id FROM ab_tests")]

    def deleted(self, db: Database, ab_id: str) -> float | None:
        """When test `ab_id` was deleted, if it was."""
        rows = run_sql(db.con, "SELECT deleted_at FROM ab_tests WHERE ab_id = ? AND deleted_at IS NOT NULL", [ab_id])
        return rows[0][0] if rows else None

    def interrupt(self, db: Database, test: ABTest) -> None:
        """A test found running by a service that just started was cut off when the last one stopped: it ended with
        its last recorded round, and so did its runs (`runs.interrupted_at`; their `ended_at` stays NULL, as they
        never finished). Its arms' progress is counted from the rows it committed."""
        rows = self.rows(db, test.id, -1, 2**31 - 1)
        tolerance = _collapse_tolerance(test.scenario)
        for name, arm in test.arms.items():
            arm.rounds_done = len(rows.get(name, []))
            arm.observed_collapse_round = observed_collapse_round(rows.get(name, []), tolerance)
        names = [arm.run for arm in test.arms.values()]
        last = run_sql(
            db.con,
            "SELECT max(b.committed_at) FROM batches b JOIN runs r USING (run_id) WHERE list_contains(?, r.name)",
            [names],
        )[0][0]
        test.status, test.ended_at = "interrupted", max(last or test.started_at, test.started_at)
        done = {arm: state.rounds_done for arm, state in test.arms.items()}
        test.error = (
            "the service stopped while this test ran; what it recorded up to then is kept (rounds done per arm: "
            + ", ".join(f"{arm} {rounds}" for arm, rounds in done.items())
            + ")"
        )
        db.con.execute("BEGIN TRANSACTION")
        try:
            self.update(db, test)
            run_sql(
                db.con,
                "UPDATE runs SET interrupted_at = ? WHERE list_contains(?, name) AND ended_at IS NULL",
                [test.ended_at, names],
            )
            db.con.execute("COMMIT")
        except BaseException:
            db.con.execute("ROLLBACK")
            raise

    def delete(self, db: Database, test: ABTest) -> Deletion:
        """Remove an ended test: its record and rows, and its runs unless a verdict was judged on them (a verdict's
        evidence must stay re-checkable). The tombstone is written first, so a crash part-way leaves a deletion the
        next `finish_deletions` completes."""
        names = [arm.run for arm in test.arms.values()]
        judged = {
            name
            for (name,) in run_sql(
                db.con,
                "SELECT DISTINCT unnest(json_extract_string(runs, '$.*')) AS name FROM verdicts",
            )
        }
        kept = [name for name in names if name in judged]
        db.con.execute("BEGIN TRANSACTION")
        try:
            run_sql(
                db.con,
                "UPDATE ab_tests SET deleted_at = ?, spec = '{}', arms = ?, verdicts = NULL, error = NULL "
                "WHERE ab_id = ?",
                [time.time(), canonical_json({"deleting": [n for n in names if n not in judged]}), test.id],
            )
            run_sql(db.con, "DELETE FROM ab_rows WHERE ab_id = ?", [test.id])
            db.con.execute("COMMIT")
        except BaseException:
            db.con.execute("ROLLBACK")
            raise
        deleted = self.finish_deletions(db)
        return Deletion(test.id, [name for name in names if name in deleted], kept)

    def finish_deletions(self, db: Database) -> list[str]:
        """Delete the runs that deleted tests still leave, and return their names: their samples first, then the
        runs (DuckDB checks a foreign key against rows deleted in the same transaction, so a run goes in a second
        one)."""
        pending = [
            name
            for (arms,) in run_sql(db.con, "SELECT arms FROM ab_tests WHERE deleted_at IS NOT NULL")
            for name in json.loads(arms).get("deleting", [])
        ]
        found = run_sql(db.con, "SELECT run_id, name FROM runs WHERE list_contains(?, name)", [pending])
        if not found:
            return []
        ids = [run_id for run_id, _ in found]
        series = "SELECT series_id FROM series WHERE list_contains(?, run_id)"
        db.con.execute("BEGIN TRANSACTION")
        try:
            for sql in (
                f"DELETE FROM samples WHERE series_id IN ({series})",
                f"DELETE FROM sample_chunks WHERE series_id IN ({series})",
                "DELETE FROM series WHERE list_contains(?, run_id)",
                "DELETE FROM batches WHERE list_contains(?, run_id)",
                "DELETE FROM targets WHERE list_contains(?, run_id)",
            ):
                run_sql(db.con, sql, [ids])
            db.con.execute("COMMIT")
        except BaseException:
            db.con.execute("ROLLBACK")
            raise
        run_sql(db.con, "DELETE FROM runs WHERE list_contains(?, run_id)", [ids])
        return [name for _, name in found]


def _arms_json(test: ABTest) -> str:
    return canonical_json({name: arm.as_record() for name, arm in test.arms.items()})


def _collapse_tolerance(scenario: Scenario) -> float:
    """The scenario's collapse tolerance; a stored spec this kvscope refuses keeps its prediction settings as they
    were recorded, a dict."""
    prediction = scenario.prediction
    if isinstance(prediction, dict):
        return float(prediction.get("collapse_tolerance", PredictionSpec().collapse_tolerance))
    return prediction.collapse_tolerance


def _scenario(spec: dict) -> Scenario:
    """The stored spec as a scenario; one a newer kvscope would refuse is still listed, as it was recorded."""
    try:
        return Scenario.model_validate(spec)
    except ValidationError:
        return Scenario.model_construct(**spec)
