"""The verifier database: schema versions, runs, and the sample writer's batches (whole or nothing)."""

from __future__ import annotations

import duckdb
import numpy as np
import pytest

from kvscope.samples import Sample, labels_of
from kvscope.verifier.db import Database, VerifierError, run_sql
from kvscope.verifier.schema import SCHEMA_VERSION, SchemaError


def sample(name: str, value: float, normalized: bool = False, **labels: str) -> Sample:
    return Sample("vllm", name, labels_of(labels), value, "counter", normalized)


def versions(con: duckdb.DuckDBPyConnection) -> list[int]:
    return [row[0] for row in run_sql(con, "SELECT version FROM schema_version ORDER BY version")]


def count(db: Database, table: str) -> int:
    return run_sql(db.con, f"SELECT count(*) FROM {table}")[0][0]


@pytest.fixture
def db(tmp_path):
    with Database(tmp_path / "verifier.duckdb") as database:
        yield database


# ------------------------------------------------------------------------------------------------ schema


def test_each_migration_is_recorded_once_and_not_reapplied_on_reopen(tmp_path):
    path = tmp_path / "verifier.duckdb"
    with Database(path) as db:
        assert versions(db.con) == list(range(1, SCHEMA_VERSION + 1))
    with Database(path) as db:  # a second open must find the schema current, not apply migration 1 again
        assert versions(db.con) == list(range(1, SCHEMA_VERSION + 1))


def test_a_plain_duckdb_file_is_brought_to_the_current_schema(tmp_path):
    path = tmp_path / "plain.duckdb"
    duckdb.connect(str(path)).close()
    with Database(path) as db:
        assert versions(db.con) == list(range(1, SCHEMA_VERSION + 1))
        assert db.runs() == []


def test_a_file_from_a_newer_kvscope_is_refused_and_left_unlocked_and_unchanged(tmp_path):
    """Misreading a newer layout would corrupt verdicts; the refusal must not keep the file locked either."""
    path = tmp_path / "newer.duckdb"
    with Database(path) as db:
        run_sql(db.con, "INSERT INTO schema_version VALUES (?, 0)", [SCHEMA_VERSION + 1])
    with pytest.raises(SchemaError) as refused:
        Database(path)
    message = str(refused.value)
    assert str(path) in message
    assert f"version {SCHEMA_VERSION + 1} is newer than this kvscope's ({SCHEMA_VERSION})" in message
    # while the error is still held, the file can be opened again (its connection was closed, not leaked)
    with duckdb.connect(str(path), read_only=True) as con:
        assert versions(con) == [*range(1, SCHEMA_VERSION + 1), SCHEMA_VERSION + 1]


def test_a_file_that_is_not_a_duckdb_database_is_named_and_not_overwritten(tmp_path):
    path = tmp_path / "notes.duckdb"
    path.write_bytes(b"these are my notes, not a database\n" * 100)
    with pytest.raises(VerifierError, match=f"{path}: cannot open as a DuckDB database"):
        Database(path)
    assert path.read_bytes() == b"these are my notes, not a database\n" * 100


# ------------------------------------------------------------------------------------------------ runs


def test_a_run_name_is_recorded_once(db):
    db.create_run("baseline", origin="recorder", arm="a", config={"k": 1})
    with pytest.raises(VerifierError, match=r"a run named 'baseline' is already recorded"):
        db.create_run("baseline", origin="ab")
    [run] = db.runs()
    assert (run.name, run.origin, run.arm, run.config, run.ended_at) == ("baseline", "recorder", "a", {"k": 1}, None)


def test_an_unknown_run_lists_the_runs_the_file_holds(db):
    with pytest.raises(VerifierError, match=r"no run named 'tiered' \(runs recorded: none\)"):
        db.run("tiered")
    db.create_run("dram_only", origin="ab")
    db.create_run("nof", origin="ab")
    with pytest.raises(VerifierError, match=r"no run named 'tiered' \(runs recorded: dram_only, nof\)"):
        db.run("tiered")


def test_finish_run_sets_ended_at(db):
    run = db.create_run("r", origin="recorder", started_at=100.0)
    db.finish_run(run, ended_at=160.0)
    assert (db.run("r").started_at, db.run("r").ended_at) == (100.0, 160.0)


# ------------------------------------------------------------------------------------------------ writer


def test_series_are_interned_once_across_batches_and_reopened_writers(db):
    """A series row per (target, source, name, labels, raw or normalized), whatever the batch or writer."""
    run = db.create_run("r", origin="recorder")
    scrape = [
        sample("vllm:prefix_cache_queries_total", 1, engine="0", model_name='synthetic/"model"-é'),
        sample("vllm:prefix_cache_queries_total", 2, engine="1", model_name='synthetic/"model"-é'),
        sample("kv.prefix.query.tokens", 3, normalized=True, engine="0"),
        sample("kv.prefix.query.tokens", 4, normalized=False, engine="0"),  # same name, raw: another series
    ]
    writer = db.writer(run)
    writer.append("vllm-a", 1.0, scrape)
    writer.append("vllm-b", 1.0, scrape[:1])  # same sample from another target: another series
    writer.flush()
    writer.append("vllm-a", 2.0, scrape)
    writer.flush()
    ids = [writer.series_id("vllm-a", s) for s in scrape]

    reopened = db.writer(db.run("r"))  # labels come back from their JSON: quotes and UTF-8 must round-trip
    reopened.append("vllm-a", 3.0, scrape)
    reopened.flush()
    assert [reopened.series_id("vllm-a", s) for s in scrape] == ids
    assert count(db, "series") == 5
    assert run_sql(db.con, "SELECT count(DISTINCT ts), count(*) FROM samples") == [(3, 13)]


def test_writers_of_runs_recorded_side_by_side_never_share_a_series_id(db):
    """An A/B records its arms interleaved: each writer's new series must get an id no other writer handed out."""
    first, second = db.create_run("a", origin="ab"), db.create_run("b", origin="ab")
    writer, other = db.writer(first), db.writer(second)
    writer.append("t", 1.0, [sample("m", 1), sample("n", 1)])
    other.append("t", 1.0, [sample("m", 5)])  # the same series key, but another run: another series
    other.flush()
    writer.flush()
    later = db.writer(first)  # reopened after both: continues past every id in the file
    later.append("t", 2.0, [sample("m", 2), sample("o", 2)])
    later.flush()
    rows = run_sql(db.con, "SELECT run_id, name FROM series ORDER BY series_id")
    runs = (first.run_id, second.run_id)
    assert sorted(rows) == sorted([(runs[0], "m"), (runs[0], "n"), (runs[1], "m"), (runs[0], "o")])
    assert run_sql(db.con, "SELECT count(DISTINCT series_id) FROM series") == [(4,)]


def test_a_batch_commits_with_its_batches_row_by_size_and_on_flush(db):
    run = db.create_run("r", origin="recorder")
    writer = db.writer(run, batch_rows=3)
    writer.append("t", 1.0, [sample("m", 1), sample("n", 1)])
    assert count(db, "samples") == 0  # below batch_rows: still buffered
    writer.append("t", 2.0, [sample("m", 2), sample("n", 2)])  # reaches batch_rows: one batch of both scrapes
    writer.append("t", 3.0, [sample("m", 3)])
    assert writer.flush() == 1
    assert writer.flush() == 0  # nothing buffered: no empty batch
    batches = run_sql(db.con, "SELECT run_id, rows, first_ts, last_ts FROM batches ORDER BY batch_id")
    assert batches == [(run.run_id, 4, 1.0, 2.0), (run.run_id, 1, 3.0, 3.0)]
    assert count(db, "samples") == writer.rows_written == 5


def test_append_columns_writes_interned_series_and_refuses_ragged_columns(db):
    run = db.create_run("r", origin="prometheus")
    writer = db.writer(run)
    ids = [writer.series_id("t", sample("m", 0)), writer.series_id("t", sample("n", 0))]
    with pytest.raises(VerifierError, match="series_ids, ts and values must have the same length"):
        writer.append_columns(np.array(ids), np.array([1.0, 2.0]), np.array([1.0]))
    assert count(db, "samples") == 0
    writer.append_columns(np.array(ids * 2, dtype=np.int64), np.array([1, 1, 2, 2]), np.array([1, 2, 3, 4.5]))
    assert writer.flush() == 4  # the ragged call buffered nothing
    rows = run_sql(db.con, "SELECT name, ts, value FROM sample_rows ORDER BY ts, name")
    assert rows == [("m", 1.0, 1.0), ("n", 1.0, 2.0), ("m", 2.0, 3.0), ("n", 2.0, 4.5)]


def test_a_batch_that_fails_mid_transaction_leaves_nothing_and_is_written_once_on_retry(db):
    """The series and samples are inserted before the `batches` row; a failure there must undo them all."""
    run = db.create_run("r", origin="recorder")
    writer = db.writer(run)
    run_sql(db.con, "INSERT INTO batches VALUES (1, 0, 0, NULL, NULL, 0)")  # takes the batch id the writer draws
    writer.append("t", 1.0, [sample("m", 1), sample("n", 1)])
    with pytest.raises(duckdb.ConstraintException) as failed:
        writer.flush()
    assert (count(db, "series"), count(db, "samples"), count(db, "batches")) == (0, 0, 1)

    run_sql(db.con, "DELETE FROM batches")
    writer.append("t", 2.0, [sample("m", 2)])  # the writer still takes samples while the error is held
    assert failed.value is not None
    assert writer.flush() == 3
    assert (count(db, "series"), count(db, "samples"), count(db, "batches")) == (2, 3, 1)
    assert run_sql(db.con, "SELECT rows FROM batches") == [(3,)]
    assert run_sql(db.con, "SELECT count(DISTINCT (series_id, ts)) FROM samples") == [(3,)]
