"""The verifier's DuckDB schema, as numbered migrations applied in order.

A database records its version in `schema_version`; opening an older file applies the missing migrations in one
transaction each, and a file newer than this kvscope is refused rather than misread. Never edit a migration that
has shipped: add the next one.

Tables:
- runs: one recorded run (an arm of an A/B, a cluster window); `origin` says how it got here; `interrupted_at` when a
  restarted service found it cut off (its last commit; `ended_at` stays NULL).
- targets: what was scraped in a run, with the target's configuration.
- series: one (target, source, name, labels, raw or normalized) time series of a run; labels as canonical JSON.
- samples: (series_id, ts, value); ts is unix seconds. Written only in whole batches (see `batches`).
- batches: one row per committed batch, in the same transaction as its samples: what a crash can lose is the
  batch in flight, never part of one.
- sample_chunks: each batch's samples summarized per series (first, last, min, max, count, reset-adjusted
  increase, resets) with a sha256 of those samples, written with the batch. Consecutive chunks of a series merge
  exactly (criteria.py), so a whole-run verdict reads a few rows per series instead of every sample, as
  Prometheus reads chunk indexes, and its digest chains the chunks' hashes. Samples stay the source of truth: an
  evidence bundle carries them, and checking it recomputes every chunk hash and summary from them.
- verdicts: one evaluated criterion: pass/fail, observed values, threshold, the SQL, and the evidence digest.
- ab_tests, ab_rows: the service's A/B tests (spec, status, arms, verdicts; a deleted one leaves a tombstone) and
  their per-round rows, each written in its round's commit.
- verifications: one judging of a criteria file on bound runs (a `kvscope verify`, an A/B the service ended): its
  manifest (the file and its hash, the runs, every verdict it recorded, every criterion it could not judge) and
  the manifest's digest; each verdict names its verification, so a bundle that leaves a verdict out says so.
"""

from __future__ import annotations

import hashlib

import duckdb
import numpy as np

from kvscope.verifier.errors import SchemaError


def chunk_digest(ts: np.ndarray, values: np.ndarray) -> bytes:
    """sha256 of one chunk's samples in time order: the timestamps, then the values, as little-endian float64."""
    sha = hashlib.sha256(np.asarray(ts, dtype="<f8").tobytes())
    sha.update(np.asarray(values, dtype="<f8").tobytes())
    return sha.digest()


def chunk_rows(source: str) -> str:
    """A SELECT of one `sample_chunks` row per series of `source` (a relation of series_id, ts, value), with
    Prometheus' increase() rule inside the chunk: a sample lower than the one before it is a reset."""
    return f"""
    SELECT series_id, min(ts) AS first_ts, max(ts) AS last_ts,
           arg_min(value, ts) AS first_value, arg_max(value, ts) AS last_value,
           min(value) AS min_value, max(value) AS max_value, count(*) AS samples,
           sum(CASE WHEN prev IS NULL THEN 0 WHEN value < prev THEN value ELSE value - prev END) AS increase,
           count(*) FILTER (WHERE value < prev) AS resets
    FROM (SELECT series_id, ts, value, lag(value) OVER (PARTITION BY series_id ORDER BY ts) AS prev FROM {source})
    GROUP BY series_id"""


MIGRATIONS: tuple[str, ...] = (
    # 1: the first schema
    """
    CREATE SEQUENCE run_ids START 1;
    CREATE TABLE runs (
        run_id      INTEGER PRIMARY KEY DEFAULT nextval('run_ids'),
        name        VARCHAR NOT NULL UNIQUE,
        arm         VARCHAR,
        scenario    VARCHAR,              -- the A/B scenario, or the cluster a recording came from
        origin      VARCHAR NOT NULL,     -- recorder | ab | prometheus
        started_at  DOUBLE NOT NULL,      -- unix seconds
        ended_at    DOUBLE,               -- set when the run finishes cleanly
        config      JSON NOT NULL
    );
    CREATE TABLE targets (
        run_id  INTEGER NOT NULL REFERENCES runs (run_id),
        target  VARCHAR NOT NULL,
        source  VARCHAR NOT NULL,
        config  JSON NOT NULL,
        PRIMARY KEY (run_id, target)
    );
    CREATE SEQUENCE series_ids START 1;
    CREATE TABLE series (
        series_id   INTEGER PRIMARY KEY,
        run_id      INTEGER NOT NULL REFERENCES runs (run_id),
        target      VARCHAR NOT NULL,
        source      VARCHAR NOT NULL,
        name        VARCHAR NOT NULL,
        kind        VARCHAR NOT NULL,
        normalized  BOOLEAN NOT NULL,
        labels      JSON NOT NULL         -- canonical: keys sorted, no spaces
    );
    CREATE TABLE samples (
        series_id  INTEGER NOT NULL,
        ts         DOUBLE NOT NULL,
        value      DOUBLE NOT NULL
    );
    CREATE TABLE sample_chunks (
        series_id    INTEGER NOT NULL,
        first_ts     DOUBLE NOT NULL,
        last_ts      DOUBLE NOT NULL,
        first_value  DOUBLE NOT NULL,
        last_value   DOUBLE NOT NULL,
        min_value    DOUBLE NOT NULL,
        max_value    DOUBLE NOT NULL,
        samples      BIGINT NOT NULL,
        increase     DOUBLE NOT NULL,
        resets       BIGINT NOT NULL,
        sha256       BLOB NOT NULL         -- chunk_digest() of the chunk's samples
    );
    CREATE SEQUENCE batch_ids START 1;
    CREATE TABLE batches (
        batch_id      INTEGER PRIMARY KEY,
        run_id        INTEGER NOT NULL,
        rows          BIGINT NOT NULL,
        first_ts      DOUBLE,
        last_ts       DOUBLE,
        committed_at  DOUBLE NOT NULL
    );
    CREATE SEQUENCE verdict_ids START 1;
    CREATE TABLE verdicts (
        verdict_id    INTEGER PRIMARY KEY DEFAULT nextval('verdict_ids'),
        criterion     VARCHAR NOT NULL,
        kind          VARCHAR NOT NULL,
        runs          JSON NOT NULL,       -- role -> run name, as bound on the command line
        passed        BOOLEAN NOT NULL,
        evidence      JSON NOT NULL,       -- the canonical document the digest covers (see evidence.py)
        digest        VARCHAR NOT NULL,    -- sha256 over the evidence document and the samples it read
        created_at    DOUBLE NOT NULL
    );
    CREATE VIEW sample_rows AS
        SELECT r.name AS run, r.arm, s.target, s.source, s.name, s.kind, s.normalized, s.labels,
               p.ts, p.value
        FROM samples p JOIN series s USING (series_id) JOIN runs r USING (run_id);
    """,
    # 2: what each verify judged, so a verdict left out of a bundle is seen
    """
    CREATE SEQUENCE verification_ids START 1;
    CREATE TABLE verifications (
        verification_id  INTEGER PRIMARY KEY,
        manifest         JSON NOT NULL,     -- criteria file and hash, runs, every verdict, every error
        digest           VARCHAR NOT NULL,  -- sha256 over the manifest's RFC 8785 canonical JSON
        created_at       DOUBLE NOT NULL
    );
    ALTER TABLE verdicts ADD COLUMN verification_id INTEGER;
    """,
    # 3: the service's A/B tests, so a restart lists them; runs a restart found cut off
    """
    CREATE TABLE ab_tests (
        ab_id              VARCHAR PRIMARY KEY,
        spec               JSON NOT NULL,     -- the scenario as accepted
        scenario           VARCHAR NOT NULL,
        rounds_per_minute  DOUBLE,
        rounds             INTEGER NOT NULL,
        status             VARCHAR NOT NULL,  -- running | finished | stopped | failed | interrupted
        started_at         DOUBLE NOT NULL,
        ended_at           DOUBLE,
        error              VARCHAR,
        arms               JSON NOT NULL,     -- per arm: run, store, engine, tiers, prediction, progress
        verdicts           JSON,
        deleted_at         DOUBLE             -- a tombstone: the id stays taken
    );
    CREATE TABLE ab_rows (
        ab_id  VARCHAR NOT NULL,
        arm    VARCHAR NOT NULL,
        round  INTEGER NOT NULL,
        row    JSON NOT NULL,                 -- the A/B contract's per-round row
        PRIMARY KEY (ab_id, arm, round)
    );
    ALTER TABLE runs ADD COLUMN interrupted_at DOUBLE;  -- a restart found it unfinished: its last commit
    """,
)

SCHEMA_VERSION = len(MIGRATIONS)


def migrate(con: duckdb.DuckDBPyConnection, where: str) -> int:
    """Bring `con` to SCHEMA_VERSION; returns the version it had before (0 for a new database)."""
    con.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL, applied_at DOUBLE NOT NULL)")
    found = con.execute("SELECT coalesce(max(version), 0) FROM schema_version").fetchone()[0]
    if found > SCHEMA_VERSION:
        raise SchemaError(
            f"{where}: database schema version {found} is newer than this kvscope's ({SCHEMA_VERSION}); upgrade kvscope"
        )
    for version in range(found + 1, SCHEMA_VERSION + 1):
        con.execute("BEGIN TRANSACTION")
        try:
            con.execute(MIGRATIONS[version - 1])
            con.execute("INSERT INTO schema_version VALUES (?, epoch(now()))", [version])
            con.execute("COMMIT")
        except Exception:
            con.execute("ROLLBACK")
            raise
    return found
