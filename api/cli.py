"""The service's commands: serve, and demo (the service with a live A/B already running)."""

from __future__ import annotations

import contextlib
from importlib import resources
from pathlib import Path
from typing import Annotated

import typer

from kvscope.terminal import console, fail, load_scenario


def register(app: typer.Typer) -> None:
    for command in (serve, demo):
        app.command()(command)


ServeHost = Annotated[str | None, typer.Option("--host", help="address to bind (default 127.0.0.1)")]
ServePort = Annotated[int | None, typer.Option("--port", help="port (default 8321)")]
ServeDb = Annotated[Path | None, typer.Option("--db", help="verifier database (default kvscope.duckdb)")]


def _settings(host: str | None, port: int | None, db: Path | None, **more):
    """Settings from the environment (KVSCOPE_*), overridden by the options given."""
    from pydantic import ValidationError

    from kvscope.api.settings import Settings
    from kvscope.validation import describe

    given = {"host": host, "port": port, "db": db, **more}
    try:
        return Settings(**{key: value for key, value in given.items() if value is not None})
    except ValidationError as error:
        raise fail("\n".join(describe(error, "kvscope service", "settings"))) from None


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


def demo(
    scenario: Annotated[
        Path | None,
        typer.Option(
            "--scenario", help="the A/B to run live (default: examples/long_output.yaml, shipped with kvscope)"
        ),
    ] = None,
    criteria: Annotated[
        list[Path] | None,
        typer.Option(
            "--criteria", help="criteria files judged when the A/B ends (repeat; default: criteria/media.yaml, shipped)"
        ),
    ] = None,
    rounds_per_minute: Annotated[float, typer.Option("--rounds-per-minute", help="pace of the live A/B")] = 12.0,
    host: ServeHost = None,
    port: ServePort = None,
    db: Annotated[Path, typer.Option("--db", help="verifier database")] = Path("out/demo.duckdb"),
) -> None:
    """The service with a live A/B already running (`make run`): watch the DRAM-only arm collapse on the page.
    The example and the criteria ship with kvscope (package data): it runs from any directory."""
    with contextlib.ExitStack() as shipped:
        if scenario is None:
            scenario = shipped.enter_context(_shipped("kvscope.examples", "long_output.yaml"))
        if criteria is None:
            criteria = [shipped.enter_context(_shipped("kvscope.criteria", "media.yaml"))]
        spec = load_scenario(scenario)
        settings = _settings(host, port, db, criteria=criteria, scrape_interval_s=2.0)

        def start_ab(services) -> None:
            test = services.ab.start(spec, rounds_per_minute)
            console.print(
                f"started A/B {test.id}: {scenario} at {rounds_per_minute:g} rounds a minute", highlight=False
            )

        _serve(settings, start_ab)


def _shipped(package: str, name: str) -> contextlib.AbstractContextManager[Path]:
    """A file of kvscope's package data as a path, for as long as the context lasts (importlib.resources)."""
    return resources.as_file(resources.files(package) / name)
