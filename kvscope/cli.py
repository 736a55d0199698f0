"""The `kvscope` command line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvscope import __version__

app = typer.Typer(help="Observability and media verification for tiered LLM KV caches.", no_args_is_help=True)
ab_app = typer.Typer(help="A/B tests of tier layouts on the embedded tiered store.", no_args_is_help=True)
app.add_typer(ab_app, name="ab")

console = Console()
if not console.is_terminal:  # piped or captured: keep the per-round table on one line per round
    console.width = max(console.width, 160)
errors = Console(stderr=True)

ScenarioPath = Annotated[Path, typer.Argument(help="scenario YAML (see examples/)", show_default=False)]
JsonOut = Annotated[Path | None, typer.Option("--json", help="write the result as JSON to this file")]


def _fail(message: object) -> typer.Exit:
    """Print an input error (it names the file, field and reason) and return the exit to raise: code 2."""
    errors.print(f"[red]error:[/red] {message}", highlight=False)
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
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        tasks = {name: progress.add_task(f"arm {name}", total=rounds) for name in spec.arms}
        result = run_ab(spec, on_round=lambda arm, row: progress.advance(tasks[arm]), workdir=workdir)
    console.print(rounds_table(result))
    for line in verdict_lines(result):
        console.print(line, highlight=False)
    if json_out:
        _write_json(json_out, result)
    if plot:
        plot.parent.mkdir(parents=True, exist_ok=True)
        draw(result, plot)
        console.print(f"wrote {plot}")
