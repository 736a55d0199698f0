"""The verifier at scale: ingest rate, verdict latency, and the same parity verdict computed by Prometheus.

Data. A synthetic A/B recorded on a KV-store cluster, generated with NumPy (vectorized, seeded). The parity
criterion compares two runs, so the default "4 hours, 1-second scrapes, 5,000 series, 72 M samples" is two runs,
arm A then arm B, each 4 hours (14,400 scrapes) of 2,500 series: 2 x 2,500 x 14,400 = 72 M samples in one
database, all of them in the two runs the verdict compares (5,000 series per run would be 144 M; a shorter B
would make the parity meaningless). The arms are recorded one after the other, as kvscope records them: a
database has one writer at a time (verifier/db.py), and an A/B runs its arms in turn. A target is one store node
(`node-NNN`, source mooncake) exporting 10 KV-tier model instruments for each of its two tiers (labels system,
tier = dram | nof): 8 counters (kv.store.put/get bytes and ops, kv.tier written/read bytes, evictions, hits;
Poisson events per second by their normal approximation, times the block size for bytes, rates log-normal per
node and tier) and 2 gauges (kv.tier.allocated.bytes, a slow wave with noise; kv.tier.capacity.bytes). Counters
start where hours of prior uptime left them, and a node restarts now and then (once every 8 hours on average),
which resets all its counters: the resets the criteria must handle. Arm B has arm A's rates and its own events.

1. Ingest through the writer the recorder and the importers use (verifier.db.SampleWriter), file-backed, timed
   from opening the database to closing it (the last flush and DuckDB's checkpoint included, so the samples are
   on disk when the clock stops); generating the data is not timed:
   (a) columnar: `append_columns` once per scrape (2,500 series ids, a ts column, the values), batches of
       200,000 rows (the default), the way bulk imports (Prometheus, benchmarks) arrive; the whole 72 M;
   (b) the recorder's path: `append(target, ts, samples)` with kvscope.samples.Sample objects, once per target
       per scrape as the scrape loop calls it, committed as the recorder's sink commits (a full batch, or a second
       of wall time since the last commit), scrapes fed as fast as it takes them: its capacity; on
       `--recorder-ticks` scrapes per run into a second database.
       The Sample objects are built before the clock starts (the scrape loop hands them over built): this
       measures interning, buffering and commits, and it is Python-object-bound.
   Each run's first scrape is committed alone and timed apart too: it registers the run's series (their rows are
   written with that batch). Reported: samples/s overall and after the first scrape, the database file size,
   and the process' peak RSS (resource.getrusage, a high-water mark).
2. Verdict latency on that database: save_parity from criteria/media.yaml (kv.store.put.bytes summed over the
   series of each run, |B - A| / A <= 0.1%), bound to runs A and B. Each repeat reopens the database (a new
   DuckDB connection: an empty buffer pool, but the OS page cache is not dropped, hence "cold-ish") and times
   evaluate() (input checks + the criterion's SQL), then record_verdict() (reads every sample the verdict covered
   in digest order, sha256 over them, stores the verdict row), then evaluate() again on the same connection
   (warm). Medians of `--repeat`. `kvscope verify` does evaluate + record_verdict.
3. The anchor, PromQL on a real Prometheus: `--anchor-series` series, half per run, each run `--anchor-minutes`
   long (run B ending two minutes ago, run A the hour before it), generated as above and written (a) into a
   kvscope database with the same writer and (b) as OpenMetrics text (counters `# TYPE kv_store_put_bytes
   counter` with samples kv_store_put_bytes_total, the run in a `run` label, `# EOF`) loaded with `promtool tsdb
   create-blocks-from openmetrics`. /usr/bin/prometheus serves that TSDB on 127.0.0.1 (after a check that it
   holds every series and sample) and answers `sum(increase(kv_store_put_bytes_total{run="A"}[W]))` as an
   instant query at A's last scrape, and the same for B at B's, W the run's length: those two queries are the
   PromQL verdict, timed over HTTP on one keep-alive connection (Prometheus' own execTotalTime, from stats=all,
   is printed too). kvscope's verdict is evaluate() on its database, on one warm connection, as Prometheus' blocks
   are warm in the page cache. After a warm-up, rounds alternate which side goes first; the ratio (PromQL
   latency / kvscope latency) is the median of the rounds' ratios, so a busy spell of the machine hits both.
   Prometheus' values are checked against kvscope's: increase() extrapolates to the edges of its window, and the
   first sample lies one scrape after the window's start, so it must return kvscope's increase x W / (W - 1 s);
   the same query over [W - 1 s], a window that starts on the first sample, must return kvscope's value.

Goals (printed, not enforced): ingest >= 1 M samples/s; verdict < 1 s at 72 M samples; faster than PromQL.
The load average is printed at the start and the end: other work on the machine shows in every figure.

Run: .venv/bin/python bench/verify.py [--quick] [--series N] [--hours H] [--dir DIR] [--skip-prometheus]
This is a script, not a test: bench/ is outside pytest's testpaths and nothing here is named test_*.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from statistics import median

import duckdb
import httpx
import numpy as np
from localhost import wait_for

from kvscope.model import INSTRUMENTS, prometheus_name
from kvscope.processes import free_port
from kvscope.samples import Labels, Sample, labels_of
from kvscope.verifier.criteria import CriteriaFile, Outcome, Parity, evaluate, load_criteria
from kvscope.verifier.db import Database, SampleWriter
from kvscope.verifier.evidence import Verification, record_verdict

ROOT = Path(__file__).resolve().parent.parent
CRITERIA = ROOT / "criteria" / "media.yaml"
CRITERION = "save_parity"
COVERAGE_CRITERION = "nof_delta_zero"  # a whole-run delta that must first show its series cover the run
INGEST_GOAL_PER_S = 1e6  # the product's goals: samples ingested a second, seconds to a verdict
RECORDER_FLUSH_S = 1.0  # verifier.recorder.record()'s default flush_s
VERDICT_GOAL_S = 1.0
ANCHOR_GOAL_RATIO = 1.0
ARMS = ("A", "B")
SOURCE = "mooncake"
BLOCK_BYTES = 256 * 88_100  # a 256-token block of the long-output model (88.1 KB per token)
RESTART_EVERY_S = 8 * 3600  # mean time between restarts of a node
CHUNK_TICKS = 300  # ticks generated at a time

# Per tier: (instrument, events per second as a multiple of the tier's rate, bytes per event; 0 for gauges)
TIER_SERIES: tuple[tuple[str, float, int], ...] = (
    ("kv.store.put.bytes", 1.0, BLOCK_BYTES),
    ("kv.store.put.ops", 1.0, 1),
    ("kv.store.get.bytes", 0.6, BLOCK_BYTES),
    ("kv.store.get.ops", 0.6, 1),
    ("kv.tier.written.bytes", 1.0, BLOCK_BYTES),
    ("kv.tier.read.bytes", 0.6, BLOCK_BYTES),
    ("kv.tier.evictions", 0.2, 1),
    ("kv.tier.hits", 0.6, 1),
    ("kv.tier.allocated.bytes", 0.0, 0),
    ("kv.tier.capacity.bytes", 0.0, 0),
)
TIERS = (("dram", 20.0), ("nof", 8.0))  # tier, mean blocks put per second on a node


# --------------------------------------------------------------------------------------------- synthetic data


@dataclass
class Arm:
    """One arm's series (what the recorder sees of its nodes) and the state its generator carries between chunks."""

    name: str
    targets: list[str]  # per series
    names: list[str]
    kinds: list[str]
    labels: list[Labels]
    node: np.ndarray  # per series: index of its node
    rate: np.ndarray  # counters: events per second
    unit: np.ndarray  # counters: bytes (or 1) per event
    capacity: np.ndarray  # gauges: the tier's capacity in bytes
    phase: np.ndarray  # gauges: where the allocation wave starts
    fixed: np.ndarray  # gauges: constant (the capacity)
    value: np.ndarray  # the last values generated
    rng: np.random.Generator
    tick: int = 0

    @property
    def size(self) -> int:
        return len(self.names)

    @property
    def counters(self) -> np.ndarray:
        return self.unit > 0

    def chunk(self, ticks: int) -> np.ndarray:
        """The next `ticks` scrapes as a (ticks, series) matrix: counters with restarts, gauges."""
        counter, rng = self.counters, self.rng
        out = np.empty((ticks, self.size))
        rate = self.rate[counter]  # events per tick: Poisson, by its normal approximation (rates >= ~5)
        events = np.maximum(np.rint(rate + np.sqrt(rate) * rng.standard_normal((ticks, len(rate)))), 0)
        increments = np.cumsum(events * self.unit[counter], axis=0)
        nodes = int(self.node.max()) + 1
        restarted = (rng.random((ticks, nodes)) < 1 / RESTART_EVERY_S)[:, self.node[counter]]
        # A restart at tick r zeroes the counter before r's events: value(t) = events from the last restart to t.
        last_restart = np.maximum.accumulate(np.where(restarted, np.arange(ticks)[:, None], -1), axis=0)
        before = np.vstack([np.zeros((1, increments.shape[1])), increments])
        since_restart = increments - np.take_along_axis(before, np.maximum(last_restart, 0), axis=0)
        out[:, counter] = np.where(last_restart < 0, self.value[counter] + increments, since_restart)
        t = self.tick + np.arange(ticks)[:, None]
        gauge = ~counter
        noise = rng.normal(0, 0.01, (ticks, int(gauge.sum())))
        wave = 0.5 + 0.3 * np.sin(2 * np.pi * t / 3600 + self.phase[gauge]) + noise
        allocated = np.floor(self.capacity[gauge] * np.clip(wave, 0, 1))
        out[:, gauge] = np.where(self.fixed[gauge], self.capacity[gauge], allocated)
        self.value = out[-1].copy()
        self.tick += ticks
        return out


def make_arm(name: str, series: int, seed: int) -> Arm:
    """`series` series of nodes node-000, node-001...; the rates come from `seed` alone (equal in both arms)."""
    per_node = len(TIER_SERIES) * len(TIERS)
    nodes = math.ceil(series / per_node)
    rates = np.random.default_rng(seed)
    tier_rate = {tier: mean * rates.lognormal(-0.125, 0.5, nodes) for tier, mean in TIERS}
    capacity = {"dram": 429.5e9 / 8, "nof": 46.09e12 / 64}
    targets, names, kinds, labels, node, rate, unit, cap, phase = [], [], [], [], [], [], [], [], []
    for index in range(nodes):
        for tier, _ in TIERS:
            for instrument, multiple, per_event in TIER_SERIES:
                targets.append(f"node-{index:03d}")
                names.append(instrument)
                kinds.append(INSTRUMENTS[instrument].kind)
                labels.append(labels_of({"system": SOURCE, "tier": tier}))
                node.append(index)
                rate.append(tier_rate[tier][index] * multiple)
                unit.append(per_event)
                cap.append(capacity[tier])
                phase.append(rates.uniform(0, 2 * np.pi))
    keep = slice(0, series)
    arm = Arm(
        name,
        targets[keep],
        names[keep],
        kinds[keep],
        labels[keep],
        np.array(node[keep]),
        np.array(rate[keep]),
        np.array(unit[keep], dtype=np.float64),
        np.array(cap[keep]),
        np.array(phase[keep]),
        np.array([name == "kv.tier.capacity.bytes" for name in names[keep]]),
        np.zeros(series),
        np.random.default_rng([seed, ord(name)]),
    )
    uptime = arm.rng.uniform(3600, 86_400, series)  # counters start where hours of uptime left them
    arm.value = np.where(arm.counters, np.round(arm.rate * uptime) * arm.unit, 0.0)
    return arm


def chunks(arm: Arm, ticks: int) -> Iterator[tuple[int, np.ndarray]]:
    """(first tick, a (ticks, series) matrix) for the arm, CHUNK_TICKS at a time."""
    for first in range(0, ticks, CHUNK_TICKS):
        yield first, arm.chunk(min(CHUNK_TICKS, ticks - first))


# --------------------------------------------------------------------------------------------- writing


def register(db: Database, arm: Arm, started_at: float) -> tuple[SampleWriter, np.ndarray]:
    """A run for the arm, its targets, its writer, and its series' ids."""
    run = db.create_run(arm.name, origin="recorder", arm=arm.name, scenario="bench/verify.py", started_at=started_at)
    for target in dict.fromkeys(arm.targets):
        db.add_target(run, target, SOURCE, {"name": target, "source": SOURCE})
    writer = db.writer(run)
    ids = [
        writer.series_id(target, Sample(SOURCE, name, labels, 0.0, kind, True))  # type: ignore[arg-type]
        for target, name, kind, labels in zip(arm.targets, arm.names, arm.kinds, arm.labels, strict=True)
    ]
    return writer, np.array(ids, dtype=np.int32)


@dataclass
class Ingest:
    samples: int
    seconds: float  # everything, from opening the database to closing it
    first_seconds: float  # of which each run's first scrape, committed alone: it registers the run's series
    first_samples: int
    file_bytes: int
    peak_rss: int

    @property
    def rate(self) -> float:
        return self.samples / self.seconds

    @property
    def steady_rate(self) -> float:
        """Samples per second after each run's first scrape (the series are known, only samples are written)."""
        return (self.samples - self.first_samples) / (self.seconds - self.first_seconds)


def ingest_columns(path: Path, arms: list[Arm], ticks: int, t0: float) -> Ingest:
    """Each arm in turn (one writer at a time), one append_columns per tick; timed without the generator."""
    clock = time.perf_counter
    start = clock()
    db = Database(path)
    timed, first_s = clock() - start, 0.0
    for index, arm in enumerate(arms):
        begin = t0 + index * ticks
        for first, block in chunks(arm, ticks):
            start = clock()
            if first == 0:  # the run's first scrape, committed alone: it registers the run's series
                writer, ids = register(db, arm, begin)
                writer.append_columns(ids, np.full(len(ids), begin), block[0])
                writer.flush()
                first_s += clock() - start
            for row in range(1 if first == 0 else 0, len(block)):
                writer.append_columns(ids, np.full(len(ids), begin + first + row), block[row])
            timed += clock() - start
        start = clock()
        writer.flush()
        db.finish_run(writer.run, begin + ticks - 1)
        timed += clock() - start
    start = clock()
    db.close()
    timed += clock() - start
    total = ticks * sum(arm.size for arm in arms)
    return Ingest(total, timed, first_s, sum(arm.size for arm in arms), file_size(path), peak_rss())


def ingest_samples(path: Path, arms: list[Arm], ticks: int, t0: float) -> Ingest:
    """The recorder's path: append(target, ts, samples) per target per tick with Sample objects built beforehand,
    committed as the recorder's sink does: when a batch is full, and once a second of wall time has passed since
    the last commit (so this is its capacity: ticks arrive as fast as it takes them)."""
    scrapes: list[list[list[tuple[str, float, list[Sample]]]]] = []  # per arm, per tick: (target, ts, samples)
    for index, arm in enumerate(arms):
        scrapes.append([])
        for first, block in chunks(arm, ticks):
            for row, values in enumerate(block.tolist()):
                by_target: dict[str, list[Sample]] = {}
                for target, name, kind, labels, value in zip(
                    arm.targets, arm.names, arm.kinds, arm.labels, values, strict=True
                ):
                    by_target.setdefault(target, []).append(Sample(SOURCE, name, labels, value, kind, True))  # type: ignore[arg-type]
                ts = t0 + index * ticks + first + row
                scrapes[-1].append([(target, ts, samples) for target, samples in by_target.items()])
    clock = time.perf_counter
    start = clock()
    db = Database(path)
    first_s = 0.0
    for arm, arm_scrapes in zip(arms, scrapes, strict=True):
        writer = db.writer(db.create_run(arm.name, origin="recorder", arm=arm.name, started_at=t0))
        flushed_at = clock()
        for tick, tick_scrapes in enumerate(arm_scrapes):
            begin = clock()
            for target, ts, samples in tick_scrapes:
                writer.append(target, ts, samples)
            if not tick or clock() - flushed_at >= RECORDER_FLUSH_S:
                writer.flush()
                flushed_at = clock()
            if not tick:
                first_s += clock() - begin
        writer.flush()
    db.close()
    seconds = clock() - start
    first_samples = sum(arm.size for arm in arms)
    return Ingest(ticks * first_samples, seconds, first_s, first_samples, file_size(path), peak_rss())


def file_size(path: Path) -> int:
    wal = path.with_name(path.name + ".wal")
    return path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# --------------------------------------------------------------------------------------------- verdicts


def parity_criterion() -> tuple[CriteriaFile, Parity]:
    spec, criterion = media_criterion(CRITERION)
    assert isinstance(criterion, Parity)
    return spec, criterion


def media_criterion(name: str):
    """A criterion of criteria/media.yaml, with its file (for binding the runs: arms A and B here, so without the
    file's arm labels)."""
    spec = load_criteria(CRITERIA).model_copy(update={"arms": {}})
    (criterion,) = [c for c in spec.criteria if c.name == name]
    return spec, criterion


@dataclass
class VerdictTimes:
    evaluate_cold: list[float]
    record: list[float]
    evaluate_warm: list[float]
    outcome: Outcome
    sample_count: int
    passed: bool


def verdict_times(path: Path, repeat: int, name: str = CRITERION) -> VerdictTimes:
    spec, criterion = media_criterion(name)
    cold, record, warm = [], [], []
    clock = time.perf_counter
    for _ in range(repeat):
        with Database(path) as db:
            runs = spec.bind(db, list(ARMS))
            start = clock()
            outcome = evaluate(db, criterion, runs)
            evaluated = clock()
            verdict = record_verdict(db, outcome, runs, Verification(db, spec, runs, None).verification_id)
            recorded = clock()
            evaluate(db, criterion, runs)
            warm.append(clock() - recorded)
            cold.append(evaluated - start)
            record.append(recorded - evaluated)
    return VerdictTimes(cold, record, warm, outcome, verdict.document["sample_count"], verdict.passed)


# --------------------------------------------------------------------------------------------- Prometheus


def write_openmetrics(path: Path, arms: list[Arm], blocks: list[np.ndarray], starts: list[int]) -> int:
    """The arms' samples as OpenMetrics text, one metric family at a time, each series' points in time order."""
    stamps = [[str(t0 + tick) for tick in range(len(block))] for block, t0 in zip(blocks, starts, strict=True)]
    lines = 0
    with path.open("w") as out:
        for instrument in dict.fromkeys(arms[0].names):
            sample_name = prometheus_name(INSTRUMENTS[instrument])
            kind = INSTRUMENTS[instrument].kind
            family = sample_name.removesuffix("_total") if kind == "counter" else sample_name
            out.write(f"# TYPE {family} {kind}\n")
            for arm, block, ts in zip(arms, blocks, stamps, strict=True):
                for column, name in enumerate(arm.names):
                    if name != instrument:
                        continue
                    labels = {"run": arm.name, "target": arm.targets[column], **dict(arm.labels[column])}
                    prefix = sample_name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "} "
                    values = block[:, column].astype(np.int64).tolist()  # every value is a whole number
                    out.write("".join(f"{prefix}{v} {t}\n" for v, t in zip(values, ts, strict=True)))
                    lines += len(values)
        out.write("# EOF\n")
    return lines


class Prometheus:
    """A real Prometheus serving a TSDB directory on 127.0.0.1 (scraping nothing), stopped on exit."""

    def __init__(self, binary: str, tsdb: Path, workdir: Path) -> None:
        config = workdir / "prometheus.yml"
        config.write_text("global: {}\nscrape_configs: []\n")
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = (workdir / "prometheus.log").open("w")
        self.process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tsdb}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.client = httpx.Client(base_url=self.url, timeout=120)

    def __enter__(self) -> Prometheus:
        wait_for(
            lambda: self.process.poll() is None and self.client.get("/-/ready").status_code == 200, "Prometheus", 60
        )
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()
        self.process.terminate()
        self.process.wait(30)
        self.log.close()

    def query(self, promql: str, at: int) -> tuple[float, float | None]:
        """An instant query's single value, and Prometheus' own execTotalTime for it (stats=all), if reported."""
        answer = self.client.get("/api/v1/query", params={"query": promql, "time": at, "stats": "all"})
        if answer.status_code != 200:
            raise SystemExit(f"Prometheus answered {promql} with {answer.status_code}: {answer.text}")
        data = answer.json()["data"]
        if len(data["result"]) != 1:
            raise SystemExit(f"{promql}: expected one series, Prometheus answered {data['result']}")
        exec_s = data.get("stats", {}).get("timings", {}).get("execTotalTime")
        return float(data["result"][0]["value"][1]), exec_s


def promql(run: str, window_s: int) -> str:
    return f'sum(increase(kv_store_put_bytes_total{{run="{run}"}}[{window_s}s]))'


def anchor(args: argparse.Namespace, workdir: Path) -> None:
    """Part 3: the anchor's data in both stores, Prometheus' values checked against kvscope's, the latencies."""
    series, ticks = args.anchor_series, args.anchor_minutes * 60
    print(
        f"\n3. The same parity verdict by PromQL on a real Prometheus: {series:,} series x {ticks:,} s = "
        f"{series * ticks / 1e6:.2f} M samples"
    )
    prometheus, promtool = shutil.which("prometheus"), shutil.which("promtool")
    if args.skip_prometheus or not (prometheus and promtool):
        why = "--skip-prometheus" if args.skip_prometheus else "prometheus and promtool are not both installed"
        print(f"   ANCHOR SKIPPED ({why}): no ratio to PromQL measured in this run")
        return
    version = subprocess.run([prometheus, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    print(f"   {version} ({prometheus})")
    end = int(time.time()) - 120  # B's last scrape, a whole second; A's recording ends one tick before B's starts
    ends = {"A": end - ticks, "B": end}
    starts = [ends[arm] - ticks + 1 for arm in ARMS]
    arms = [make_arm(arm, series // 2, args.seed + 1) for arm in ARMS]
    blocks = [arm.chunk(ticks) for arm in arms]
    path = workdir / "anchor.duckdb"
    with Database(path) as db:
        for arm, block, t0 in zip(arms, blocks, starts, strict=True):
            writer, ids = register(db, arm, t0)
            stamps = np.repeat(t0 + np.arange(ticks, dtype=np.float64), len(ids))
            writer.append_columns(np.tile(ids, ticks), stamps, block.ravel())
            writer.flush()
    text, tsdb = workdir / "anchor.om.txt", workdir / "tsdb"
    lines = write_openmetrics(text, arms, blocks, starts)
    start = time.perf_counter()
    subprocess.run(
        [promtool, "tsdb", "create-blocks-from", "openmetrics", str(text), str(tsdb)], check=True, capture_output=True
    )
    print(
        f"   promtool tsdb create-blocks-from openmetrics: {lines:,} lines ({text.stat().st_size / 1e6:.0f} MB) "
        f"in {time.perf_counter() - start:.1f} s"
    )
    text.unlink()

    spec, criterion = parity_criterion()
    with Prometheus(prometheus, tsdb, workdir) as server, Database(path) as db:
        loaded = [0.0, 0.0]  # series and samples in Prometheus, family by family (*_over_time drops the name)
        for instrument in dict.fromkeys(arms[0].names):
            selector = f"{prometheus_name(INSTRUMENTS[instrument])}[{2 * ticks}s]"
            for index, aggregate in enumerate(("count", "sum")):
                loaded[index] += server.query(f"{aggregate}(count_over_time({selector}))", end)[0]
        if loaded != [series, lines]:
            raise SystemExit(
                f"Prometheus holds {loaded[0]:.0f} series, {loaded[1]:.0f} samples; loaded were {series}, {lines}"
            )
        exact = {run: server.query(promql(run, ticks - 1), ends[run])[0] for run in ARMS}
        runs = spec.bind(db, list(ARMS))
        kv_times, prom_times, exec_times, ratios = [], [], [], []
        for attempt in range(args.anchor_repeat + 1):  # the first is the warm-up; the order flips every round
            timed = {}
            for side in ("kvscope", "promql") if attempt % 2 else ("promql", "kvscope"):
                start = time.perf_counter()
                if side == "kvscope":
                    outcome = evaluate(db, criterion, runs)
                else:
                    answers = {run: server.query(promql(run, ticks), ends[run]) for run in ARMS}
                timed[side] = time.perf_counter() - start
            if attempt:
                kv_times.append(timed["kvscope"])
                prom_times.append(timed["promql"])
                ratios.append(timed["promql"] / timed["kvscope"])
                if all(e is not None for _, e in answers.values()):
                    exec_times.append(sum(e for _, e in answers.values()))  # type: ignore[misc]
    (row,) = outcome.rows
    kv = {"A": row["a_value"], "B": row["b_value"]}
    prom = {run: value for run, (value, _) in answers.items()}
    factor = ticks / (ticks - 1)
    print(
        f"   {'run':<4} {'kvscope increase (B)':>22} {'PromQL [' + str(ticks) + 's]':>22} {'/ kvscope':>13} "
        f"{'expected':>13} {'PromQL [' + str(ticks - 1) + 's]':>22} {'/ kvscope':>13}"
    )
    agree = True
    for run in ARMS:
        ratio, exact_ratio = prom[run] / kv[run], exact[run] / kv[run]
        agree &= math.isclose(ratio, factor, rel_tol=1e-9) and math.isclose(exact_ratio, 1, rel_tol=1e-9)
        print(
            f"   {run:<4} {kv[run]:>22,.0f} {prom[run]:>22,.0f} {ratio:>13.9f} {factor:>13.9f} {exact[run]:>22,.0f} "
            f"{exact_ratio:>13.9f}"
        )
    prom_rel = (prom["B"] - prom["A"]) / prom["A"]
    print(
        f"   relative difference B/A - 1: kvscope {row['relative_difference']:+.9f}, PromQL {prom_rel:+.9f}; "
        f"verdict (tolerance {row['tolerance']:g}): kvscope {'pass' if outcome.passed else 'FAIL'}, "
        f"PromQL {'pass' if abs(prom_rel) <= row['tolerance'] else 'FAIL'}"
    )
    print(
        f"   agreement: {'yes' if agree else 'NO'}: increase() extrapolates from the first sample to the window "
        f"start, 1 s earlier: x {ticks}/{ticks - 1}; over [{ticks - 1}s] the window starts on the first sample, "
        "nothing is extrapolated and the values are equal (rel. 1e-9)"
    )
    prom_s, kv_s, ratio = median(prom_times), median(kv_times), median(ratios)
    exec_note = f" (Prometheus' own execTotalTime {median(exec_times) * 1e3:.1f} ms)" if exec_times else ""
    print(
        f"   latency, medians of {args.anchor_repeat} interleaved rounds after a warm-up: PromQL, 2 instant queries "
        f"over HTTP, {prom_s * 1e3:.1f} ms{exec_note}; kvscope evaluate() {kv_s * 1e3:.1f} ms"
    )
    flag = "" if ratio > ANCHOR_GOAL_RATIO else "  (goal missed)"
    print(
        f"   ratio PromQL / kvscope = {ratio:.2f}x, median of the rounds' ratios (goal > {ANCHOR_GOAL_RATIO:g}: "
        f"kvscope faster){flag}"
    )
    if not agree:
        raise SystemExit("Prometheus and kvscope disagree beyond the extrapolation explained above")


# --------------------------------------------------------------------------------------------- main


def load() -> str:
    """The 1, 5 and 15-minute load averages: other work on the machine shows in every figure."""
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def mb(size: int) -> str:
    return f"{size / 1e6:,.0f} MB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--series", type=int, default=5000, help="series, half in each of the 2 runs (default 5000)")
    parser.add_argument("--hours", type=float, default=4.0, help="length of each run (default 4)")
    parser.add_argument("--recorder-ticks", type=int, default=400, help="scrapes per run through append() (400)")
    parser.add_argument("--repeat", type=int, default=5, help="repeats of each verdict timing (default 5)")
    parser.add_argument("--anchor-series", type=int, default=1000, help="the PromQL anchor's series, both runs (1000)")
    parser.add_argument("--anchor-minutes", type=int, default=60, help="length of each anchor run (default 60)")
    parser.add_argument("--anchor-repeat", type=int, default=20, help="interleaved anchor rounds (default 20)")
    parser.add_argument("--skip-prometheus", action="store_true", help="do not measure the PromQL anchor")
    parser.add_argument("--quick", action="store_true", help="smoke run: 500 series x 15 min, anchor 200 x 10 min")
    parser.add_argument("--dir", help="where the databases and the TSDB go (a temp dir inside it, removed after)")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (its path is printed)")
    parser.add_argument("--seed", type=int, default=4)
    args = parser.parse_args(argv)
    if args.quick:
        args.series, args.hours, args.recorder_ticks, args.repeat = 500, 0.25, 20, 3
        args.anchor_series, args.anchor_minutes = 200, 10
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(
        f"python {sys.version.split()[0]}, duckdb {duckdb.__version__}, numpy {np.__version__} on "
        f"{os.cpu_count()} CPUs; {time.strftime('%Y-%m-%d %H:%M:%S')}; load average {load()}"
    )
    began = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="kvscope-verify-bench-", dir=args.dir))
    try:
        ticks = round(args.hours * 3600)
        per_arm = args.series // 2
        t0 = float(int(time.time()) - 2 * ticks)  # run A, then run B ending now
        arms = [make_arm(arm, per_arm, args.seed) for arm in ARMS]
        total = ticks * per_arm * 2
        print(
            f"data: 2 runs (arms A, B) x {per_arm:,} series x {ticks:,} 1-second scrapes = {total / 1e6:.1f} M "
            f"samples; {arms[0].counters.sum() / per_arm:.0%} counters; temp dir {workdir}"
        )

        big = workdir / "verify.duckdb"
        columns = ingest_columns(big, arms, ticks, t0)
        recorder_ticks = min(args.recorder_ticks, ticks)
        samples = ingest_samples(
            workdir / "recorder.duckdb", [make_arm(a, per_arm, args.seed) for a in ARMS], recorder_ticks, t0
        )
        print("\n1. Ingest through SampleWriter into a file-backed database, timed from open to close")
        print(
            f"   {'path':<64} {'samples':>9} {'seconds':>8} {'M/s':>6}  {'first scrape of each run':>26} "
            f"{'then M/s':>8}"
        )
        for label, result in (
            (f"append_columns per tick ({per_arm:,} series), 200,000-row batches", columns),
            (f"append(Sample...) per target, committed as the recorder does, {recorder_ticks} ticks", samples),
        ):
            flag = "" if result.rate >= INGEST_GOAL_PER_S else "  (below goal)"
            print(
                f"   {label:<64} {result.samples / 1e6:>7.2f} M {result.seconds:>8.2f} {result.rate / 1e6:>6.2f}  "
                f"{result.first_seconds / 2 * 1e3:>7.0f} ms for {result.first_samples // 2:,} series "
                f"{result.steady_rate / 1e6:>8.2f}{flag}"
            )
        print(
            f"   database {mb(columns.file_bytes)} ({columns.file_bytes / columns.samples:.1f} B per sample); "
            f"peak RSS after the columnar ingest {mb(columns.peak_rss)}, after the recorder's {mb(samples.peak_rss)}"
        )
        print(
            "   the first scrape of a run is committed alone and timed apart: it registers the run's series (their\n"
            "   rows go in with that batch); 'then' is the rate over the rest of the run.\n"
            f"   goal: >= {INGEST_GOAL_PER_S / 1e6:g} M samples/s (M/s column)"
        )

        times = verdict_times(big, args.repeat)
        (row,) = times.outcome.rows
        total_s = [e + r for e, r in zip(times.evaluate_cold, times.record, strict=True)]
        print(
            f"\n2. Verdict latency: {CRITERION} (kv.store.put.bytes, A vs B) on {total / 1e6:.1f} M samples, "
            f"medians of {args.repeat}, each on a reopened database"
        )
        print(
            f"   A {row['a_value']:,.0f} B, B {row['b_value']:,.0f} B, relative difference "
            f"{row['relative_difference']:+.6f} (tolerance {row['tolerance']:g}): "
            f"{'passed' if times.passed else 'FAILED'}; the verdict read {times.sample_count:,} samples"
        )
        for label, values, judged in (
            ("evaluate(), new connection", times.evaluate_cold, True),
            ("record_verdict() (read + digest + store)", times.record, False),
            ("evaluate() + record_verdict() = kvscope verify", total_s, True),
            ("evaluate() again, same connection", times.evaluate_warm, False),
        ):
            goal = ""
            if judged and total >= 72e6:  # the goal is set for 72 M samples
                goal = "  goal met" if median(values) < VERDICT_GOAL_S else "  (goal missed)"
            print(
                f"   {label:<48} {median(values) * 1e3:>8.0f} ms  (min {min(values) * 1e3:>5.0f}, "
                f"max {max(values) * 1e3:>5.0f}){goal}"
            )
        coverage = verdict_times(big, args.repeat, COVERAGE_CRITERION)
        coverage_s = [e + r for e, r in zip(coverage.evaluate_cold, coverage.record, strict=True)]
        met = "  goal met" if median(coverage_s) < VERDICT_GOAL_S else "  (goal missed)"
        print(
            f"   {COVERAGE_CRITERION} (zero_delta with its coverage check over the whole run, arm A's NoF allocation; "
            f"the synthetic wave moves, so it fails):\n"
            f"   {'evaluate() + record_verdict() = kvscope verify':<48} {median(coverage_s) * 1e3:>8.0f} ms  "
            f"(min {min(coverage_s) * 1e3:>5.0f}, max {max(coverage_s) * 1e3:>5.0f}){met if total >= 72e6 else ''}"
        )
        print(f"   goal: verdict < {VERDICT_GOAL_S:g} s at 72 M samples; peak RSS so far {mb(peak_rss())}")

        anchor(args, workdir)
    finally:
        if args.keep:
            print(f"\nkept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"\ntotal {time.perf_counter() - began:.0f} s; load average at the end {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
