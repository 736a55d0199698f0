"""The verifier database: runs, targets, and one writer that appends samples in whole batches.

DuckDB allows one writing process per file; kvscope keeps to one `SampleWriter` per database. A batch (the
samples, the series they introduce, and its `batches` row) is committed in one transaction, so a recorder killed
with SIGKILL loses at most the batch it was filling: the file reopens (DuckDB replays its WAL) with no partial
batch and no duplicated sample.
"""

from __future__ import annotations

import json
import threading
import time
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np

from kvscope.samples import Labels, Sample
from kvscope.verifier.errors import VerifierError
from kvscope.verifier.schema import chunk_digest, chunk_rows, migrate


@dataclass(frozen=True, slots=True)
class Run:
    run_id: int
    name: str
    arm: str | None
    scenario: str | None
    origin: str
    started_at: float
    ended_at: float | None
    config: dict


def canonical_json(value: object) -> str:
    """The one JSON spelling kvscope hashes and stores: sorted keys, no spaces, UTF-8 kept as is."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def run_sql(con: duckdb.DuckDBPyConnection, sql: str, params: list | None = None) -> list[tuple]:
    """Execute and fetch everything: DuckDB 2 keeps a connection busy until a statement's result is consumed."""
    return con.execute(sql, params or []).fetchall()


class Database:
    """An open verifier database (created and migrated on first use)."""

    def __init__(self, path: Path | str, read_only: bool = False) -> None:
        self.path = str(path)
        try:
            self.con = duckdb.connect(self.path, read_only=read_only)
        except duckdb.Error as error:
            raise VerifierError(f"{self.path}: cannot open as a DuckDB database: {error}") from None
        if not read_only:
            try:
                migrate(self.con, self.path)
            except BaseException:
                self.con.close()  # a refused file must not stay locked while the error is handled
                raise
        self._series_ids = _SeriesIds(self.con)

    def cursor(self) -> Database:
        """The same database for another thread: its own DuckDB cursor, the same series id allocator."""
        sibling = object.__new__(Database)
        sibling.path, sibling.con, sibling._series_ids = self.path, self.con.cursor(), self._series_ids
        return sibling

    def new_series_id(self) -> int:
        return self._series_ids.next()

    def close(self) -> None:
        self.con.close()

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------ runs

    def create_run(
        self,
        name: str,
        *,
        origin: str,
        arm: str | None = None,
        scenario: str | None = None,
        config: Mapping | None = None,
        started_at: float | None = None,
    ) -> Run:
        self.require_new_run(name)
        started = time.time() if started_at is None else started_at
        run_sql(
            self.con,
            "INSERT INTO runs (name, arm, scenario, origin, started_at, config) VALUES (?, ?, ?, ?, ?, ?)",
            [name, arm, scenario, origin, started, canonical_json(dict(config or {}))],
        )
        return self.run(name)

    def require_new_run(self, name: str) -> None:
        if self.find_run(name) is not None:
            raise VerifierError(f"{self.path}: a run named {name!r} is already recorded; pick another name or file")

    def finish_run(self, run: Run, ended_at: float | None = None) -> None:
        run_sql(
            self.con,
            "UPDATE runs SET ended_at = ? WHERE run_id = ?",
            [time.time() if ended_at is None else ended_at, run.run_id],
        )

    def find_run(self, name: str) -> Run | None:
        rows = run_sql(
            self.con,
            "SELECT run_id, name, arm, scenario, origin, started_at, ended_at, config FROM runs WHERE name = ?",
            [name],
        )
        if not rows:
            return None
        run_id, name, arm, scenario, origin, started, ended, config = rows[0]
        return Run(run_id, name, arm, scenario, origin, started, ended, json.loads(config))

    def run(self, name: str) -> Run:
        """The run called `name`, or an error that lists the runs the file holds."""
        found = self.find_run(name)
        if found is None:
            names = [row[0] for row in run_sql(self.con, "SELECT name FROM runs ORDER BY run_id")]
            known = ", ".join(names) if names else "none"
            raise VerifierError(f"{self.path}: no run named {name!r} (runs recorded: {known})")
        return found

    def runs(self) -> list[Run]:
        return [self.run(row[0]) for row in run_sql(self.con, "SELECT name FROM runs ORDER BY run_id")]

    def add_target(self, run: Run, target: str, source: str, config: Mapping) -> None:
        run_sql(
            self.con,
            "INSERT INTO targets VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING",
            [run.run_id, target, source, canonical_json(dict(config))],
        )

    def writer(self, run: Run, batch_rows: int = 200_000) -> SampleWriter:
        return SampleWriter(self, run, batch_rows)


SeriesKey = tuple[str, str, str, Labels, bool]  # target, source, name, labels, normalized


def chunk_hashes(series_ids: np.ndarray, ts: np.ndarray, values: np.ndarray) -> dict[str, np.ndarray]:
    """chunk_digest() of each series' samples in a batch: the series ids and their hashes, as columns."""
    order = np.lexsort((ts, series_ids))
    ids, ts, values = series_ids[order], ts[order], values[order]
    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]]) if len(ids) else np.empty(0, dtype=np.int64)
    ends = np.r_[starts[1:], len(ids)]
    digests = [chunk_digest(ts[a:b], values[a:b]) for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]
    return {"series_id": ids[starts], "sha256": np.array(digests, dtype=object)}


class _SeriesIds:
    """Series ids for every writer of one database (writers of concurrent runs must not hand out the same id)."""

    def __init__(self, con: duckdb.DuckDBPyConnection) -> None:
        (self._last,) = run_sql(con, "SELECT coalesce(max(series_id), 0) FROM series")[0]
        self._lock = threading.Lock()

    def next(self) -> int:
        with self._lock:
            self._last += 1
            return self._last


class SampleWriter:
    """Appends a run's samples in batches of `batch_rows` (and on `flush()`), never row at a time.

    Series are interned in memory (one id per target, source, name, labels, raw-or-normalized) and a series row
    is written in the same transaction as the first batch that uses it. Buffers are `array`s handed to DuckDB as
    NumPy views without a copy.
    """

    def __init__(self, db: Database, run: Run, batch_rows: int) -> None:
        self.db, self.run, self.batch_rows = db, run, batch_rows
        self._series: dict[SeriesKey, int] = dict(self._known_series())
        self._new_series: list[tuple] = []
        self._ids, self._ts, self._values = array("i"), array("d"), array("d")
        self.rows_written = 0

    def _known_series(self) -> Iterable[tuple[SeriesKey, int]]:
        rows = run_sql(
            self.db.con,
            "SELECT series_id, target, source, name, labels, normalized FROM series WHERE run_id = ?",
            [self.run.run_id],
        )
        for series_id, target, source, name, labels, normalized in rows:
            yield (target, source, name, tuple(sorted(json.loads(labels).items())), normalized), series_id

    def series_id(self, target: str, sample: Sample) -> int:
        """The id of the series `sample` belongs to, registering a new series on first sight."""
        key = (target, sample.source, sample.name, sample.labels, sample.normalized)
        found = self._series.get(key)
        if found is None:
            found = self._series[key] = self.db.new_series_id()
            labels = canonical_json(dict(sample.labels))
            self._new_series.append(
                (found, self.run.run_id, target, sample.source, sample.name, sample.kind, sample.normalized, labels)
            )
        return found

    def append(self, target: str, ts: float, samples: Sequence[Sample]) -> None:
        """One scrape of one target: its samples, all stamped `ts` (unix seconds)."""
        series_id = self.series_id
        ids = [series_id(target, sample) for sample in samples]
        self._ids.extend(ids)
        self._ts.extend([ts] * len(ids))
        self._values.extend([sample.value for sample in samples])
        if len(self._ids) >= self.batch_rows:
            self.flush()

    def append_columns(self, series_ids: np.ndarray, ts: np.ndarray, values: np.ndarray) -> None:
        """Samples of already-interned series as columns (bulk import: Prometheus, benchmarks)."""
        if not (len(series_ids) == len(ts) == len(values)):
            raise VerifierError("append_columns: series_ids, ts and values must have the same length")
        self._ids.frombytes(np.ascontiguousarray(series_ids, dtype=np.int32).tobytes())
        self._ts.frombytes(np.ascontiguousarray(ts, dtype=np.float64).tobytes())
        self._values.frombytes(np.ascontiguousarray(values, dtype=np.float64).tobytes())
        if len(self._ids) >= self.batch_rows:
            self.flush()

    def _insert_series(self, con: duckdb.DuckDBPyConnection) -> None:
        """The batch's new series as columns (row-at-a-time inserts cost a second per few thousand series)."""
        columns = list(zip(*self._new_series, strict=True))
        names = ("series_id", "run_id", "target", "source", "name", "kind", "normalized", "labels")
        con.register("pending_series", {name: np.array(column) for name, column in zip(names, columns, strict=True)})
        try:
            run_sql(
                con,
                "INSERT INTO series SELECT series_id, run_id, target, source, name, kind, normalized, "
                "json(labels::VARCHAR) FROM pending_series",
            )
        finally:
            con.unregister("pending_series")

    def flush(self) -> int:
        """Commit what is buffered as one batch (samples, their chunk summaries, new series); returns the rows."""
        rows = len(self._ids)
        if not rows and not self._new_series:
            return 0
        con = self.db.con
        ts = np.frombuffer(self._ts, dtype=np.float64)
        pending = {
            "series_id": np.frombuffer(self._ids, dtype=np.int32),
            "ts": ts,
            "value": np.frombuffer(self._values, dtype=np.float64),
        }
        con.begin()
        try:
            if self._new_series:
                self._insert_series(con)
            con.register("pending_samples", pending)
            con.register("pending_hashes", chunk_hashes(pending["series_id"], ts, pending["value"]))
            try:
                run_sql(con, "INSERT INTO samples SELECT series_id, ts, value FROM pending_samples")
                run_sql(
                    con,
                    f"INSERT INTO sample_chunks SELECT c.*, h.sha256 FROM ({chunk_rows('pending_samples')}) c "
                    "JOIN pending_hashes h USING (series_id)",
                )
            finally:
                con.unregister("pending_samples")
                con.unregister("pending_hashes")
            run_sql(
                con,
                "INSERT INTO batches VALUES (nextval('batch_ids'), ?, ?, ?, ?, epoch(now()))",
                [self.run.run_id, rows, float(ts.min()) if rows else None, float(ts.max()) if rows else None],
            )
            con.commit()
        except BaseException:
            con.rollback()
            del pending, ts  # a traceback kept by the caller must not pin the buffers: append() could not grow them
            raise
        del pending, ts
        self._new_series.clear()
        self._ids, self._ts, self._values = array("i"), array("d"), array("d")
        self.rows_written += rows
        return rows
