"""A/B threads yield to the service's requests.

An embedded arm's rounds are pure-Python CPU work in a thread of the service. Serving a request needs the
interpreter (the GIL) for a moment at each of its steps: its socket events in the event loop, the hop to a worker
thread and back, each DuckDB call. CPython takes the GIL from a busy thread only after its switch interval (5 ms),
so while a round ran, every one of those steps waited up to 5 ms: a round's 100 ms of work held requests up for
100-200 ms, and the backlog it left took as long again to drain.

So the A/B threads pause between the requests they serve and between the steps of a round (serving, recording,
persisting the row): after each `slice_s` of A/B work, they wait until no request is in flight, at most
`max_wait_s`. The slice is shared by every A/B thread, so however many tests run, A/B work takes at most
slice_s / (slice_s + max_wait_s) of the time while requests keep arriving, and all of it while none does.
"""

from __future__ import annotations

import threading
import time


class InFlight:
    """The HTTP requests being served, counted by the middleware in the event loop's thread; `idle` is set while
    there are none, for A/B threads to wait on."""

    def __init__(self) -> None:
        self.count = 0
        self.idle = threading.Event()
        self.idle.set()

    def started(self) -> None:
        self.count += 1
        self.idle.clear()

    def ended(self) -> None:
        self.count -= 1
        if not self.count:
            self.idle.set()


class YieldToRequests:
    """The A/B threads' pauses: called between pieces of A/B work, it waits for the requests in flight once
    `slice_s` passed since the last wait of any A/B thread."""

    def __init__(self, requests: InFlight, slice_s: float = 0.001, max_wait_s: float = 0.005) -> None:
        self.requests, self.slice_s, self.max_wait_s = requests, slice_s, max_wait_s
        self._since = time.perf_counter()

    def __call__(self) -> None:
        if time.perf_counter() - self._since < self.slice_s:
            return
        if not self.requests.idle.is_set():
            self.requests.idle.wait(self.max_wait_s)
        self._since = time.perf_counter()
