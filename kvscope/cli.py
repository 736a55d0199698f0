"""The `kvscope` command line: the store and exporter commands here; each package adds its own (register())."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvscope import __version__
from kvscope.api.cli import register as register_service
from kvscope.dashboards.cli import register as register_dashboards
from kvscope.terminal import JsonOut, ScenarioPath, console, errors, fail, load_scenario, write_json
from kvscope.verifier.cli import register as register_verifier

app = typer.Typer(help="Observability and media verification for tiered LLM KV caches.", no_args_is_help=True)
ab_app = typer.Typer(help="A/B tests of tier layouts on the embedded tiered store.", no_args_is_help=True)
app.add_typer(ab_app, name="ab")


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

    spec = load_scenario(scenario)
    try:
        the_plan = plan(spec)
    except TraceError as error:
        raise fail(error) from None
    console.print(plan_table(the_plan))
    for line in plan_lines(the_plan):
        console.print(line, highlight=False)
    if json_out:
        arms = {name: {"prediction": the_plan.arm_json(name)} for name in spec.arms}
        write_json(json_out, {"scenario": spec.model_dump(mode="json"), "arms": arms})


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
        raise fail(error) from None
    if output not in ("json", "table"):
        raise fail(f"--format must be json or table, not {output!r}")
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
        Path | None,
        typer.Option(
            "--db", help="record every arm through the exporters into this verifier database, as runs <scenario>/<arm>"
        ),
    ] = None,
) -> None:
    """Run every arm of SCENARIO on its store (embedded, or a real Mooncake) and print the rounds side by side."""
    from kvscope.processes import ProcessError
    from kvscope.tierstore.ab import run_ab
    from kvscope.tierstore.report import lifecycle_lines, rounds_table, store_lines, verdict_lines
    from kvscope.tierstore.report import plot as draw
    from kvscope.tierstore.workloads import TraceError, make_workload

    spec = load_scenario(scenario)
    try:
        rounds = make_workload(spec).round_count
    except TraceError as error:
        raise fail(error) from None
    if any(arm.store == "mooncake" for arm in spec.arms.values()):
        from kvscope.tierstore.mooncake import mooncake_missing

        if missing := mooncake_missing():
            raise fail(f"{scenario}: an arm needs a real Mooncake store, which cannot run here: {missing}")
    if spec.engine.kind == "vllm":
        from kvscope.tierstore.vllm import vllm_missing

        if missing := vllm_missing():
            raise fail(f"{scenario}: the arms need a real vLLM engine, which cannot run here: {missing}")
    recorder = _ab_recorder(db, spec, scenario) if db else None
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        listener = _ArmProgress(progress, {name: progress.add_task(f"arm {name}", total=rounds)
                                           for name in spec.runnable_arms}, recorder)  # fmt: skip
        try:
            result = run_ab(spec, listener, workdir=workdir, publish=recorder is not None)
        except ProcessError as error:  # a real store that did not start or died: its log says why
            raise fail(error) from None
        finally:
            if recorder:
                recorder.finish()
                recorder.db.close()
    if json_out:  # first: what was measured is kept whatever the printing below does
        write_json(json_out, result)
    if recorder:
        console.print(f"recorded runs {', '.join(run.name for run in recorder.runs)} in {db}")
    console.print(rounds_table(result))
    for line in verdict_lines(result) + lifecycle_lines(result) + store_lines(result):
        console.print(line, highlight=False)
    if plot:
        plot.parent.mkdir(parents=True, exist_ok=True)
        draw(result, plot)
        console.print(f"wrote {plot}")


@app.command()
def whatif(
    scenario: ScenarioPath,
    vary: Annotated[
        list[str],
        typer.Option(
            "--vary",
            help="KEY=VALUE[,VALUE...]: a dotted scenario key and the values it takes (repeat for a grid), e.g. "
            "fabric.east_west=400Gb/s,1.6Tb/s or workload.first_prompt_tokens=10000,100000",
        ),
    ],
    from_round: Annotated[
        int, typer.Option("--from-round", min=1, help="count the requests of this round on (earlier ones warm up)")
    ] = 1,
    arm: Annotated[list[str] | None, typer.Option("--arm", help="serve only this arm (repeat for more)")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="draw TTFT p50/p90 and its parts, PNG")] = None,
) -> None:
    """Serve SCENARIO once per setting of the swept keys; print TTFT p50 and p90 per setting and arm, with the
    share spent on compute, on loading (what compute did not hide), on the PD transfer and on the fixed overhead."""
    from kvscope.tierstore.scenario import ScenarioError
    from kvscope.tierstore.whatif import SweepError, Vary, sweep, table
    from kvscope.tierstore.workloads import TraceError
    from kvscope.validation import read_yaml

    load_scenario(scenario)  # the scenario as written is valid, or exit 2 naming the field
    try:
        data = read_yaml(scenario, "scenario", ScenarioError)
        varies = [Vary.parse(text) for text in vary]
        points = sweep(data, varies, str(scenario), scenario.parent, from_round, arm)
    except (SweepError, ScenarioError, TraceError) as error:
        raise fail(error) from None
    title = f"{scenario.stem}: TTFT per setting (requests of round {from_round} on)"
    console.print(table(points, varies, title))
    if plot:
        from kvscope.tierstore.whatif import plot as draw

        plot.parent.mkdir(parents=True, exist_ok=True)
        draw(points, varies, plot, title)
        console.print(f"wrote {plot}")


@app.command()
def mrc(
    scenario: ScenarioPath,
    json_out: JsonOut = None,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="draw the curve with each arm's tier capacity marked, PNG")
    ] = None,
    points: Annotated[int, typer.Option("--points", min=2, help="capacities of the grid, log-spaced")] = 16,
    check: Annotated[
        bool, typer.Option("--check/--no-check", help="replay each arm's policy on the store at a few capacities")
    ] = True,
) -> None:
    """The hit ratio of SCENARIO's workload against a tier's capacity, every capacity from one pass (exact for an
    LRU), with each arm's first tier marked and its policy replayed on the store there."""
    from kvscope.tierstore.mrc import miss_ratio_curve, summary_lines, table
    from kvscope.tierstore.workloads import TraceError

    spec = load_scenario(scenario)
    try:
        curve = miss_ratio_curve(spec, points, check)
    except TraceError as error:
        raise fail(error) from None
    if json_out:
        write_json(json_out, curve.as_json())
    console.print(table(curve))
    for line in summary_lines(curve):
        console.print(line, highlight=False)
    if plot:
        from kvscope.tierstore.mrc import plot as draw

        plot.parent.mkdir(parents=True, exist_ok=True)
        draw(curve, plot)
        console.print(f"wrote {plot}")


class _ArmProgress:
    """The A/B's listener on the command line: a progress bar per arm, and the recorder when there is one."""

    def __init__(self, progress: Progress, tasks: dict, recorder) -> None:
        self.progress, self.tasks, self.recorder = progress, tasks, recorder

    def arm_started(self, arm) -> None:
        if self.recorder:
            self.recorder.arm_started(arm)

    def round_done(self, arm, row: dict) -> None:
        if self.recorder:
            self.recorder.round_done(arm, row)
        self.progress.advance(self.tasks[arm.name])

    def arm_ended(self, arm) -> None:
        if self.recorder:
            self.recorder.arm_ended(arm)


def _ab_recorder(db: Path, spec, scenario: Path):
    from kvscope.verifier.db import Database, VerifierError
    from kvscope.verifier.recorder import ABRecorder

    try:
        return ABRecorder(Database(db), spec, scenario, prefix=f"{spec.name}/")
    except VerifierError as error:
        raise fail(error) from None


register_verifier(app)
register_service(app)
register_dashboards(app)
