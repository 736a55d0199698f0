"""`kvscope dashboards build`: the Grafana JSON from the builders, or a check that the committed JSON is current."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from kvscope.terminal import console, errors

dashboards_app = typer.Typer(help="Grafana dashboards built from code (dashboards/).", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(dashboards_app, name="dashboards")


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
