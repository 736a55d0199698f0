"""The `kvscope` command line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvscope import __version__

app = typer.Typer(help="Observability and media verification for tiered LLM KV caches.", no_args_is_help=True)
ab_app = typer.Typer(help="A/B tests of tier layouts on the embedded tiered store.", no_args_is_help=True)
app.add_typer(ab_app, name="ab")
evidence_app = typer.Typer(help="Evidence bundles an auditor re-runs.", no_args_is_help=True)
app.add_typer(evidence_app, name="evidence")
import_app = typer.Typer(help="Import recorded counters into the verifier database.", no_args_is_help=True)
app.add_typer(import_app, name="import")
dashboards_app = typer.Typer(help="Grafana dashboards built from code (dashboards/).", no_args_is_help=True)
app.add_typer(dashboards_app, name="dashboards")

console = Console()
if not console.is_terminal:  # piped or captured: keep the per-round table on one line per round
    console.width = max(console.width, 160)
errors = Console(stderr=True)

ScenarioPath = Annotated[Path, typer.Argument(help="scenario YAML (see examples/)", show_default=False)]
JsonOut = Annotated[Path | None, typer.Option("--json", help="write the result as JSON to this file")]
DbPath = Annotated[Path, typer.Option("--db", help="the verifier's DuckDB file (created when missing)")]


def _fail(message: object) -> typer.Exit:
    """Print an input error (it names the file, field and reason) and return the exit to raise: code 2."""
    errors.print(f"[red]error:[/red] {escape(str(message))}", highlight=False)
    return typer.Exit(2)


def _load(path: Path):
    """The validated scenario, or exit 2 with the error that names the field."""
    from kvscope.tierstore.scenario import ScenarioError, load_scenario

    try:
        return load_scenario(path)
    except ScenarioError as error:
        raise _fail(error) from None


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    console.print(f"wrote {path}")


@app.command()
def version() -> None:
    """Print kvscope's version."""
    console.print(__version__)


@app.command()
def predict(scenario: ScenarioPath, json_out: JsonOut = None) -> None:
    """Predict footprint, ideal hit ratio and collapse round per arm, without simulating."""
    from kvscope.tierstore.planner import plan
    from kvscope.tierstore.report import plan_lines, plan_table
    from kvscope.tierstore.workloads import TraceError

    spec = _load(scenario)
    try:
        the_plan = plan(spec)
    except TraceError as error:
        raise _fail(error) from None
    console.print(plan_table(the_plan))
    for line in plan_lines(the_plan):
        console.print(line, highlight=False)
    if json_out:
        arms = {name: {"prediction": the_plan.arm_json(name)} for name in spec.arms}
        _write_json(json_out, {"scenario": spec.model_dump(mode="json"), "arms": arms})


@app.command()
def scrape(
    config: Annotated[Path, typer.Option("--config", help="exporter configuration (see examples/targets.yaml)")],
    once: Annotated[bool, typer.Option("--once", help="scrape every target once, print, exit")] = False,
    output: Annotated[str, typer.Option("--format", help="with --once: json (JSON lines) or table")] = "table",
) -> None:
    """Scrape the configured targets into the KV-tier model and export them (Prometheus endpoint, OTLP)."""
    import asyncio

    from kvscope.exporters.config import ConfigError, load_config
    from kvscope.exporters.scrape import Scraper

    try:
        settings = load_config(config)
    except ConfigError as error:
        raise _fail(error) from None
    if output not in ("json", "table"):
        raise _fail(f"--format must be json or table, not {output!r}")
    scraper = Scraper(settings.targets)
    if once:
        states = asyncio.run(_scrape_once(scraper))
        _print_scrape(states, output)
        raise typer.Exit(0 if all(state.up for state in states) else 1)
    asyncio.run(_serve_exporter(scraper, settings.exporter))


async def _scrape_once(scraper):
    try:
        return await scraper.scrape_all()
    finally:
        await scraper.close()


async def _serve_exporter(scraper, settings) -> None:
    """Scrape forever and export; Ctrl-C or SIGTERM stops cleanly."""
    import asyncio
    import signal

    from kvscope.exporters.otel import TelemetryBridge

    bridge = TelemetryBridge(scraper, settings)
    port = bridge.serve()
    console.print(f"exporting on http://{settings.listen_host}:{port}/metrics; {len(scraper.states)} targets")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        await scraper.run(stop)
    finally:
        await scraper.close()
        bridge.shutdown()


def _print_scrape(states, output: str) -> None:
    if output == "json":
        for state in states:
            for sample in [*state.raw, *state.normalized]:
                print(json.dumps(sample.as_json()))
    else:
        from rich.table import Table

        table = Table(title="normalized samples (KV-tier model)")
        for column in ("target", "instrument", "labels", "value"):
            table.add_column(column)
        for state in states:
            for sample in state.normalized:
                labels = ",".join(f"{k}={v}" for k, v in sample.labels)
                table.add_row(state.config.name, sample.name, labels, f"{sample.value:,.6g}")
        console.print(table)
    for state in states:
        if not state.up:
            errors.print(f"[red]down:[/red] {state.last_error}", highlight=False)


@ab_app.command("run")
def ab_run(
    scenario: ScenarioPath,
    json_out: JsonOut = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="draw hit ratio and bytes written per round, PNG")] = None,
    workdir: Annotated[
        Path | None, typer.Option("--workdir", help="folder for file-backend tiers without a path")
    ] = None,
    db: Annotated[
        Path | None, typer.Option("--db", help="record every arm through the exporters into this verifier database")
    ] = None,
) -> None:
    """Run every arm of SCENARIO on the embedded store and print the rounds side by side."""
    from kvscope.tierstore.ab import run_ab
    from kvscope.tierstore.report import plot as draw
    from kvscope.tierstore.report import rounds_table, verdict_lines
    from kvscope.tierstore.workloads import TraceError, make_workload

    spec = _load(scenario)
    try:
        rounds = make_workload(spec).round_count
    except TraceError as error:
        raise _fail(error) from None
    recorder = _ab_recorder(db, spec, scenario) if db else None
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        tasks = {name: progress.add_task(f"arm {name}", total=rounds) for name in spec.arms}

        def round_done(arm: str, row: dict) -> None:
            if recorder:
                recorder.round_done(arm, row)
            progress.advance(tasks[arm])

        result = run_ab(
            spec,
            on_round=round_done,
            workdir=workdir,
            publish=recorder is not None,
            on_start=recorder.arm_started if recorder else None,
        )
    if recorder:
        recorder.finish()
        recorder.db.close()
        console.print(f"recorded runs {', '.join(run.name for run in recorder.runs)} in {db}")
    console.print(rounds_table(result))
    for line in verdict_lines(result):
        console.print(line, highlight=False)
    if json_out:
        _write_json(json_out, result)
    if plot:
        plot.parent.mkdir(parents=True, exist_ok=True)
        draw(result, plot)
        console.print(f"wrote {plot}")


def _ab_recorder(db: Path, spec, scenario: Path):
    from kvscope.verifier.db import Database, VerifierError
    from kvscope.verifier.recorder import ABRecorder

    try:
        return ABRecorder(Database(db), spec, scenario)
    except VerifierError as error:
        raise _fail(error) from None


@app.command()
def record(
    config: Annotated[Path, typer.Option("--config", help="exporter configuration (see examples/targets.yaml)")],
    db: DbPath,
    run: Annotated[str, typer.Option("--run", help="name of the new run")],
    arm: Annotated[str | None, typer.Option("--arm", help="the A/B arm this run is")] = None,
    cluster: Annotated[str | None, typer.Option("--cluster", help="the cluster or scenario recorded")] = None,
    duration: Annotated[str | None, typer.Option("--for", help="stop after this long, e.g. 30m (else Ctrl-C)")] = None,
) -> None:
    """Scrape the configured targets into the verifier database, raw and normalized, as run RUN."""
    import asyncio

    from kvscope.exporters.config import ConfigError, load_config
    from kvscope.units import parse_duration
    from kvscope.verifier.db import Database, VerifierError
    from kvscope.verifier.recorder import record as record_run

    try:
        settings = load_config(config)
        seconds = parse_duration(duration) if duration else None
        with Database(db) as database:
            console.print(f"recording {len(settings.targets)} targets into {db} as run {run!r}; Ctrl-C stops")
            recorded = asyncio.run(record_run(database, settings, run, arm, cluster, seconds))
            count = database.con.execute(
                "SELECT count(*) FROM samples JOIN series USING (series_id) WHERE run_id = ?", [recorded.run_id]
            ).fetchone()[0]
    except (ConfigError, VerifierError, ValueError) as error:
        raise _fail(error) from None
    console.print(f"run {run!r}: {count:,} samples recorded")


@app.command()
def verify(
    db: DbPath,
    criteria: Annotated[Path, typer.Option("--criteria", help="criteria YAML (see criteria/media.yaml)")],
    run: Annotated[list[str], typer.Option("--run", help="a recorded run, once per role of the criteria, in order")],
    json_out: JsonOut = None,
) -> None:
    """Judge recorded runs against machine criteria; store each verdict with its evidence.

    Exit 0 when every criterion passed, 1 when one failed, 2 when one could not be judged (missing series...).
    """
    from rich.table import Table

    from kvscope.verifier.criteria import CriteriaError, evaluate, load_criteria
    from kvscope.verifier.db import Database, VerifierError
    from kvscope.verifier.evidence import record_verdict

    if not db.exists():
        raise _fail(f"{db}: no such verifier database")
    try:
        spec = load_criteria(criteria)
        database = Database(db)
        runs = spec.bind(database, run)
    except VerifierError as error:
        raise _fail(error) from None
    table = Table(title=f"{criteria} on {', '.join(f'{role}={r.name}' for role, r in runs.items())}")
    for column in ("criterion", "verdict", "summary", "digest"):
        table.add_column(column, overflow="fold")
    verdicts, problems = [], []
    with database:
        for criterion in spec.criteria:
            try:
                verdict = record_verdict(database, evaluate(database, criterion, runs), runs)
            except CriteriaError as error:
                problems.append(str(error))
                table.add_row(criterion.name, "[yellow]ERROR[/yellow]", str(error), "")
                continue
            verdicts.append(verdict)
            mark = "[green]PASS[/green]" if verdict.passed else "[red]FAIL[/red]"
            table.add_row(verdict.criterion, mark, verdict.summary, verdict.digest[:16])
    console.print(table)
    if json_out:
        documents = [{"verdict_id": v.verdict_id, "digest": v.digest, "document": v.document} for v in verdicts]
        _write_json(json_out, {"passed": not problems and all(v.passed for v in verdicts), "verdicts": documents,
                               "errors": problems})  # fmt: skip
    if problems:
        raise typer.Exit(2)
    raise typer.Exit(0 if all(v.passed for v in verdicts) else 1)


@evidence_app.command("export")
def evidence_export(
    db: DbPath,
    out: Annotated[Path, typer.Option("--out", help="bundle directory to write")],
    verdict: Annotated[
        list[int] | None, typer.Option("--verdict", help="verdict id (repeat); all when omitted")
    ] = None,
) -> None:
    """Write an evidence bundle: evidence.json (documents, digests), samples.parquet and chunks.parquet."""
    from kvscope.verifier.db import Database, VerifierError
    from kvscope.verifier.evidence import export_bundle

    if not db.exists():
        raise _fail(f"{db}: no such verifier database")
    try:
        with Database(db) as database:
            export_bundle(database, verdict or [], out)
    except VerifierError as error:
        raise _fail(error) from None
    console.print(f"wrote {out}/: evidence.json, samples.parquet, chunks.parquet")


@evidence_app.command("check")
def evidence_check(bundle: Annotated[Path, typer.Argument(help="a bundle directory from `evidence export`")]) -> None:
    """Recompute every digest and verdict from the bundle alone; exit 1 on any mismatch."""
    from kvscope.verifier.db import VerifierError
    from kvscope.verifier.evidence import check_bundle

    try:
        report = check_bundle(bundle)
    except VerifierError as error:
        raise _fail(error) from None
    for problem in report.problems:
        errors.print(f"[red]tampered:[/red] {problem}", highlight=False)
    if report.ok:
        console.print(f"{bundle}: {report.checked} verdict(s) recomputed; digests and verdicts match")
    raise typer.Exit(0 if report.ok else 1)


@import_app.command("prometheus")
def import_prometheus_command(
    url: Annotated[
        str, typer.Option("--url", help="Prometheus, Mimir or Thanos base URL (user:password@ for basic auth)")
    ],
    selectors: Annotated[list[str], typer.Option("--selector", help="PromQL series selector; repeat for more")],
    db: DbPath,
    run: Annotated[str, typer.Option("--run", help="name of the new run")],
    start: Annotated[
        str | None, typer.Option("--start", help="unix seconds or RFC3339 (default: --end minus --last)")
    ] = None,
    end: Annotated[str | None, typer.Option("--end", help="unix seconds or RFC3339 (default: now)")] = None,
    last: Annotated[str, typer.Option("--last", help="window length when --start is not given (30m, 1h, 2d)")] = "1h",
    step: Annotated[str, typer.Option("--step", help="resolution: at or below the scrape interval (15s, 1m)")] = "15s",
    arm: Annotated[str | None, typer.Option("--arm", help="the A/B arm this window is")] = None,
    cluster: Annotated[str | None, typer.Option("--cluster", help="the cluster the data comes from")] = None,
    bearer_token: Annotated[
        str | None, typer.Option("--bearer-token", envvar="KVSCOPE_PROMETHEUS_TOKEN", help="Authorization: Bearer")
    ] = None,
) -> None:
    """Import series from a Prometheus server's HTTP API (query_range) as a new run of the verifier database.

    Exit 1 when the server or its data fail the import, 2 for bad options.
    """
    import time

    from kvscope.units import parse_duration
    from kvscope.verifier.db import Database
    from kvscope.verifier.promimport import PrometheusImportError, import_prometheus, parse_time

    try:
        end_s = time.time() if end is None else parse_time(end)
        start_s = end_s - parse_duration(last) if start is None else parse_time(start)
        step_s = parse_duration(step)
        with Database(db) as database:
            summary = import_prometheus(
                database, url, selectors, start_s, end_s, step_s, run, arm, cluster, bearer_token=bearer_token
            )
    except PrometheusImportError as error:
        errors.print(f"[red]error:[/red] {escape(str(error))}", highlight=False)
        raise typer.Exit(1) from None
    except ValueError as error:  # bad options, an existing --run, an unusable --db (VerifierError is one)
        raise _fail(error) from None
    for selector in summary.empty_selectors:
        errors.print(f"[yellow]warning:[/yellow] {escape(repr(selector))} matched no series", highlight=False)
    for warning in summary.warnings:
        errors.print(f"[yellow]warning:[/yellow] Prometheus: {escape(warning)}", highlight=False)
    console.print(
        f"run {summary.run!r}: {summary.samples:,} samples of {summary.series} series in {summary.requests} requests "
        f"({summary.skipped_nonfinite} NaN/Inf skipped, {summary.duplicate_series} series matched twice)",
        highlight=False,
        markup=False,
    )


ServeHost = Annotated[str | None, typer.Option("--host", help="address to bind (default 127.0.0.1)")]
ServePort = Annotated[int | None, typer.Option("--port", help="port (default 8321)")]
ServeDb = Annotated[Path | None, typer.Option("--db", help="verifier database (default kvscope.duckdb)")]


def _settings(host: str | None, port: int | None, db: Path | None, **more):
    """Settings from the environment (KVSCOPE_*), overridden by the options given."""
    from pydantic import ValidationError

    from kvscope.api.settings import Settings

    given = {"host": host, "port": port, "db": db, **more}
    try:
        return Settings(**{key: value for key, value in given.items() if value is not None})
    except ValidationError as error:
        raise _fail(error) from None


def _serve(settings, on_started=None) -> None:
    import sys

    import uvicorn

    from kvscope.api.app import create_app

    base = f"http://{settings.host}:{settings.port}"
    token = (
        f"bearer token for POST/DELETE (made up for this start): {settings.token.get_secret_value()}"
        if settings.token_generated
        else "bearer token for POST/DELETE: the configured KVSCOPE_TOKEN"
    )
    console.print(
        f"kvscope service on {base}/ (API docs {base}/docs, metrics {base}/metrics)\n{token}\ndatabase: {settings.db}",
        highlight=False,
        markup=False,
    )
    # A/B tests simulate in threads of this process: switching threads every 1 ms instead of 5 keeps a round's
    # burst of CPU from holding API requests (p99 under load, bench/api.py)
    sys.setswitchinterval(0.001)
    uvicorn.run(create_app(settings, on_started), host=settings.host, port=settings.port, log_level="warning")


@app.command()
def serve(
    host: ServeHost = None,
    port: ServePort = None,
    db: ServeDb = None,
    criteria: Annotated[
        list[Path] | None, typer.Option("--criteria", help="criteria files judged when an A/B ends (repeat)")
    ] = None,
    targets: Annotated[Path | None, typer.Option("--targets", help="exporter config of clusters to watch")] = None,
) -> None:
    """Run the service: live A/B tests, collapse alerts, evidence REST, the built-in page."""
    _serve(_settings(host, port, db, criteria=criteria, targets=targets))


@app.command()
def demo(
    scenario: Annotated[Path, typer.Option("--scenario", help="the A/B to run live")] = Path(
        "examples/long_output.yaml"
    ),
    rounds_per_minute: Annotated[float, typer.Option("--rounds-per-minute", help="pace of the live A/B")] = 12.0,
    host: ServeHost = None,
    port: ServePort = None,
    db: Annotated[Path, typer.Option("--db", help="verifier database")] = Path("out/demo.duckdb"),
) -> None:
    """The service with a live A/B already running (`make run`): watch the DRAM-only arm collapse on the page."""
    spec = _load(scenario)
    criteria = [path for path in [Path("criteria/media.yaml")] if path.exists()]
    settings = _settings(host, port, db, criteria=criteria, scrape_interval_s=2.0)

    def start_ab(services) -> None:
        test = services.ab.start(spec, rounds_per_minute)
        console.print(f"started A/B {test.id}: {scenario} at {rounds_per_minute:g} rounds a minute", highlight=False)

    _serve(settings, start_ab)


@dashboards_app.command("build")
def dashboards_build(
    out: Annotated[
        Path | None, typer.Option("--out", help="folder to write to; default: the package's dashboards/")
    ] = None,
    check: Annotated[bool, typer.Option("--check", help="write nothing; exit 1 if the JSON there is stale")] = False,
) -> None:
    """Write every dashboard's JSON (<uid>.json) from the builders, or check that the committed JSON is current."""
    from kvscope.dashboards.build import FOLDER, stale, write_all

    folder = out or FOLDER
    if check:
        problems = stale(folder)
        for problem in problems:
            errors.print(f"stale: {escape(problem)}", highlight=False)
        if problems:
            errors.print("run `kvscope dashboards build` and commit the JSON")
        raise typer.Exit(1 if problems else 0)
    for path in write_all(folder):
        console.print(f"wrote {path}", highlight=False, markup=False)
