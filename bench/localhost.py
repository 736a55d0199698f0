"""What the bench scripts share for their servers on 127.0.0.1: waiting for a server to come up (a free port is
kvscope.processes.free_port).

The scripts run as `python bench/<script>.py`, so this folder is sys.path[0] and they import it as `localhost`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx


def wait_for(check: Callable[[], bool], what: str, seconds: float) -> None:
    """Call `check` every 0.1 s until it is true (connection errors count as not yet); exit naming `what` after
    `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (OSError, httpx.TransportError):
            pass
        time.sleep(0.1)
    raise SystemExit(f"{what} did not come up within {seconds:.0f} s")
