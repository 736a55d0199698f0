"""Engines of running or finished A/B arms, published by name so the exporters can read their counters.

The `tierstore` source scrapes what is published here, which is how an A/B run on the embedded store is observed
through the same exporters, dashboards and alerts as production.
"""

from __future__ import annotations

import threading

from kvscope.tierstore.engine import EngineEmulator


class LiveEngines:
    def __init__(self) -> None:
        self._engines: dict[str, EngineEmulator] = {}
        self._lock = threading.Lock()

    def publish(self, name: str, engine: EngineEmulator) -> None:
        """Make `engine` visible as `name`, replacing what was published under that name."""
        with self._lock:
            self._engines[name] = engine

    def withdraw(self, name: str) -> None:
        with self._lock:
            self._engines.pop(name, None)

    def snapshot(self) -> dict[str, EngineEmulator]:
        with self._lock:
            return dict(self._engines)


ENGINES = LiveEngines()
