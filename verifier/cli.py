"""The verifier's commands: record, verify, evidence export and check, import prometheus."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from kvscope.terminal import DbPath, JsonOut, console, errors, fail, write_json

evidence_app = typer.Typer(help="Evidence bundles an auditor re-runs.", no_args_is_help=True)
import_app = typer.Typer(help="Import recorded counters into the verifier database.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    for command in (record, verify):
        app.command()(command)
    app.add_typer(evidence_app, name="evidence")
    app.add_typer(import_app, name="import")


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
        raise fail(error) from None
    console.print(f"run {run!r}: {count:,} samples recorded")


def verify(
    db: DbPath,
    criteria: Annotated[Path, typer.Option("--criteria", help="criteria YAML (see criteria/media.yaml)")],
    run: Annotated[list[str], typer.Option("--run", help="a recorded run, once per role of the criteria, in order")],
    param: Annotated[
        list[str] | None, typer.Option("--param", help="NAME=VALUE: bind one of the criteria's params (repeat)")
    ] = None,
    json_out: JsonOut = None,
    allow_unfinished: Annotated[
        bool, typer.Option("--allow-unfinished", help="judge runs whose recording was interrupted (no end)")
    ] = False,
    check_chunks: Annotated[
        bool,
        typer.Option(
            "--check-chunks",
            help="re-derive the runs' chunk summaries from their samples before judging (reads every sample)",
        ),
    ] = False,
) -> None:
    """Judge recorded runs against machine criteria; store each verdict with its evidence.

    Whole-run criteria read the per-batch chunk summaries, whose hashes each verdict's digest chains; --check-chunks
    first holds every chunk of the runs against the samples it summarizes, and an altered one is an input error.

    Exit 0 when every criterion passed, 1 when one failed, 2 when one could not be judged (missing series, a run
    that never finished without --allow-unfinished...).
    """
    from rich.table import Table

    from kvscope.verifier.criteria import CriteriaError, load_criteria
    from kvscope.verifier.db import Database, VerifierError
    from kvscope.verifier.evidence import Verification

    if not db.exists():
        raise fail(f"{db}: no such verifier database")
    try:
        spec = load_criteria(criteria, _params(param or []))
        database = Database(db)
        runs = spec.bind(database, run)
    except VerifierError as error:
        raise fail(error) from None
    unfinished = [r.name for r in runs.values() if r.ended_at is None]
    if unfinished and not allow_unfinished:
        database.close()
        raise fail(
            f"run {unfinished[0]!r} never finished (its recording was interrupted: it has no end), so nothing says "
            "its series cover the run: --allow-unfinished judges what it recorded, and its verdicts say so"
        )
    for name in unfinished:
        errors.print(f"[yellow]warning:[/yellow] run {escape(repr(name))} never finished", highlight=False)
    chunks = _check_chunks(database, runs.values()) if check_chunks else "trusted"
    table = Table(title=f"{criteria} on {', '.join(f'{role}={r.name}' for role, r in runs.items())}")
    for column in ("criterion", "verdict", "summary", "digest"):
        table.add_column(column, overflow="fold")
    with database:
        verification = Verification(database, spec, runs, criteria, chunks)
        for criterion in spec.criteria:
            try:
                verdict = verification.judge(criterion)
            except CriteriaError as error:
                table.add_row(criterion.name, "[yellow]ERROR[/yellow]", str(error), "")
                continue
            mark = "[green]PASS[/green]" if verdict.passed else "[red]FAIL[/red]"
            table.add_row(verdict.criterion, mark, verdict.summary, verdict.digest[:16])
        manifest = verification.finish()
    console.print(table)
    verdicts, problems = verification.verdicts, [error["error"] for error in verification.errors]
    if json_out:
        documents = [{"verdict_id": v.verdict_id, "digest": v.digest, "document": v.document} for v in verdicts]
        write_json(json_out, {"passed": manifest["passed"], "verification_id": verification.verification_id,
                              "verdicts": documents, "errors": problems, "chunk_summaries": chunks})  # fmt: skip
    if problems:
        raise typer.Exit(2)
    raise typer.Exit(0 if all(v.passed for v in verdicts) else 1)


def _check_chunks(database, runs) -> str:
    """Hold the runs' chunk summaries against their samples: "checked", or an input error naming what was altered."""
    from kvscope.verifier.evidence import altered_series

    altered = altered_series(database, "sample_chunks", [run.run_id for run in runs])
    if altered:
        names = dict(database.con.execute(
            "SELECT series_id, target || ' ' || name || ' ' || CAST(labels AS VARCHAR) FROM series WHERE series_id IN "
            f"({', '.join(map(str, altered))})").fetchall())  # fmt: skip
        database.close()
        raise fail("; ".join(f"series {names.get(sid, sid)}: {what}" for sid, what in sorted(altered.items())))
    console.print("chunk summaries checked against the samples they summarize")
    return "checked"


def _params(pairs: list[str]) -> dict[str, str]:
    """`--param NAME=VALUE` options as a mapping; a malformed one is an input error naming it."""
    params = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise fail(f"--param {pair!r}: expected NAME=VALUE, e.g. lower_tier=ssd")
        params[name] = value
    return params


@evidence_app.command("export")
def evidence_export(
    db: DbPath,
    out: Annotated[Path, typer.Option("--out", help="bundle directory to write")],
    verdict: Annotated[
        list[int] | None, typer.Option("--verdict", help="verdict id (repeat); all when omitted")
    ] = None,
) -> None:
    """Write an evidence bundle: evidence.json (documents, digests), samples.parquet, chunks.parquet, and rerun.sql
    and README.md, which re-run every verdict with plain DuckDB."""
    from kvscope.verifier.db import Database, VerifierError
    from kvscope.verifier.evidence import export_bundle

    if not db.exists():
        raise fail(f"{db}: no such verifier database")
    try:
        with Database(db) as database:
            export_bundle(database, verdict or [], out)
    except VerifierError as error:
        raise fail(error) from None
    console.print(f"wrote {out}/: evidence.json, samples.parquet, chunks.parquet, rerun.sql, README.md")


@evidence_app.command("sign")
def evidence_sign(
    bundle: Annotated[Path, typer.Argument(help="a bundle directory from `evidence export`")],
    key: Annotated[Path, typer.Option("--key", help="Ed25519 private key, PEM (openssl genpkey -algorithm ed25519)")],
) -> None:
    """Sign the bundle's digest with an Ed25519 key: writes evidence.sig beside evidence.json."""
    from kvscope.verifier.db import VerifierError
    from kvscope.verifier.evidence import sign_bundle

    try:
        signed = sign_bundle(bundle, key)
    except VerifierError as error:
        raise fail(error) from None
    console.print(f"{bundle}: signed digest {signed} (evidence.sig)", highlight=False)


@evidence_app.command("check")
def evidence_check(
    bundle: Annotated[Path, typer.Argument(help="a bundle directory from `evidence export`, or the service's zip")],
    expect_digest: Annotated[
        str | None, typer.Option("--expect-digest", help="the bundle digest you were given beside the bundle")
    ] = None,
    public_key: Annotated[
        Path | None, typer.Option("--public-key", help="Ed25519 public key, PEM: the bundle must be signed by it")
    ] = None,
) -> None:
    """Recompute every digest and verdict from the bundle alone; exit 1 on any mismatch.

    A bundle's own hashes only show it is consistent: what anchors it is a digest you got out of band
    (--expect-digest) or a signature by a key you trust (--public-key)."""
    from kvscope.verifier.db import VerifierError
    from kvscope.verifier.evidence import check_bundle

    try:
        report = check_bundle(bundle, expect_digest, public_key)
    except VerifierError as error:
        raise fail(error) from None
    for problem in report.problems:
        errors.print(f"[red]tampered:[/red] {problem}", highlight=False)
    for manifest in report.verifications:
        criteria = manifest["criteria"]
        console.print(
            f"verification {manifest['verification_id']}: {criteria['file']} (sha256 {criteria['sha256']}) on "
            + ", ".join(f"{role}={run['name']}" for role, run in manifest["runs"].items())
            + f": {'passed' if manifest['passed'] else 'FAILED'}, {len(manifest['verdicts'])} verdict(s)"
            + "".join(f"; not judged: {e['criterion']} ({e['error']})" for e in manifest["errors"]),
            highlight=False,
        )
    for entry in report.left_out:
        console.print(
            f"  left out of this bundle: verdict {entry['verdict_id']} {entry['criterion']} "
            f"{'PASS' if entry['passed'] else 'FAIL'} (verification {entry['verification_id']})",
            highlight=False,
        )
    if report.ok:
        anchored = (
            "signature verified" if report.signed
            else "digest as expected" if expect_digest
            else "not anchored: give --expect-digest or --public-key"
        )  # fmt: skip
        console.print(
            f"{bundle}: {report.checked} verdict(s) recomputed; digests and verdicts match; bundle digest "
            f"{report.digest} ({anchored})",
            highlight=False,
        )
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
    step: Annotated[str, typer.Option("--step", help="the scrape interval: sizes the requests (15s, 1m)")] = "15s",
    arm: Annotated[str | None, typer.Option("--arm", help="the A/B arm this window is")] = None,
    cluster: Annotated[str | None, typer.Option("--cluster", help="the cluster the data comes from")] = None,
    bearer_token: Annotated[
        str | None, typer.Option("--bearer-token", envvar="KVSCOPE_PROMETHEUS_TOKEN", help="Authorization: Bearer")
    ] = None,
) -> None:
    """Import series' raw samples from a Prometheus server's HTTP API as a new run of the verifier database.

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
        raise fail(error) from None
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
