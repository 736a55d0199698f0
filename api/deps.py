"""Dependencies: the running services, a database cursor per request, and the bearer token for mutations."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request, Response, status
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from kvscope.api.abmanager import ABManager
from kvscope.api.alerts import AlertBook
from kvscope.api.settings import Settings
from kvscope.verifier.db import Database


@dataclass
class Services:
    """What the lifespan starts and every request may use."""

    settings: Settings
    db: Database
    alerts: AlertBook
    ab: ABManager


# These three are coroutines although none awaits: FastAPI runs a plain function in its thread pool, a hop there
# and back per dependency and request, each waiting for the GIL (kvscope.api.yielding). Opening and closing a
# DuckDB cursor takes microseconds, so the event loop does it.


async def services(request: Request) -> Services:
    return request.app.state.services


async def settings(request: Request) -> Settings:
    return request.app.state.services.settings


async def database(request: Request) -> AsyncIterator[Database]:
    """A cursor of the service's database for this request (DuckDB connections are not shared across threads)."""
    cursor = request.app.state.services.db.cursor()
    try:
        yield cursor
    finally:
        cursor.con.close()


_bearer = HTTPBearer(auto_error=False, description="the service's token (settings: KVSCOPE_TOKEN)")


def require_token(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    """Mutating endpoints need `Authorization: Bearer <token>`."""
    expected = request.app.state.services.settings.token.get_secret_value()
    if credentials is None or not secrets.compare_digest(credentials.credentials.encode(), expected.encode()):
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED, "a valid bearer token is required", headers={"WWW-Authenticate": "Bearer"}
        )


class TokenFirst(APIRoute):
    """A route that needs the token checks it before its body is read: a caller without the token gets a 401,
    whatever the body (malformed JSON was a 422 that told a stranger how the body would have been judged)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if not any(dependency.call is require_token for dependency in self.dependant.dependencies):
            return handler

        async def token_first(request: Request) -> Response:
            require_token(request, await _bearer(request))
            return await handler(request)

        return token_first


ServicesDep = Annotated[Services, Depends(services)]
DatabaseDep = Annotated[Database, Depends(database)]
SettingsDep = Annotated[Settings, Depends(settings)]
Authorized = Depends(require_token)
