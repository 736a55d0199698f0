"""What every `kvscope` command shares: the consoles, the exit for input errors, common options."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

console = Console()
if not console.is_terminal:  # piped or captured: keep the per-round table on one line per round
    console.width = max(console.width, 160)
errors = Console(stderr=True)

ScenarioPath = Annotated[Path, typer.Argument(help="scenario YAML (see examples/)", show_default=False)]
JsonOut = Annotated[Path | None, typer.Option("--json", help="write the result as JSON to this file")]
DbPath = Annotated[Path, typer.Option("--db", help="the verifier's DuckDB file (created when missing)")]


def fail(message: object) -> typer.Exit:
    """Print an input error (it names the file, field and reason) and return the exit to raise: code 2."""
    errors.print(f"[red]error:[/red] {escape(str(message))}", highlight=False)
    return typer.Exit(2)


def load_scenario(path: Path):
    """The validated scenario, or exit 2 with the error that names the field."""
    from kvscope.tierstore.scenario import ScenarioError
    from kvscope.tierstore.scenario import load_scenario as load

    try:
        return load(path)
    except ScenarioError as error:
        raise fail(error) from None


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    console.print(f"wrote {path}")
