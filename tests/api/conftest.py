"""Service helpers: an app factory whose defaults keep every file the service writes under a test's folder."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi import FastAPI
from pydantic import SecretStr

from kvscope.api.app import create_app
from kvscope.api.settings import Settings

TOKEN = "test-token"


@pytest.fixture(scope="session")
def app_factory() -> Callable[..., FastAPI]:
    """`app_factory(folder, **settings)`: an app (not started: use it in `with TestClient(app)`) with its database,
    A/B workdir and dashboards under `folder` and the bearer token `test-token`; `settings` override any of them.
    Session-scoped, so module-scoped fixtures can start one app for a whole module."""

    def make(folder: Path, **settings: object) -> FastAPI:
        defaults = {
            "db": folder / "kvscope.duckdb",
            "token": SecretStr(TOKEN),
            "workdir": folder / "ab",
            "dashboards_dir": folder / "dashboards",
        }
        return create_app(Settings(**{**defaults, **settings}))

    return make
