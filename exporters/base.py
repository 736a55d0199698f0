"""The interface every source implements, its target configuration, and how sources are found.

A source is one module in `kvscope.exporters` defining a `Collector` subclass with a `source` name, a `Config`
(pydantic, the fields its targets take) and `collect()`, plus a mapping `mappings/<source>.yaml`. Nothing else
registers it: `collectors()` finds every such subclass by importing the package's modules.

A part of a target that cannot be read (a file, an RPC answer) is not a failed scrape: the collector reports it
with `read_error(reason, what, detail)` and keeps the rest; the scrape loop counts it per target and reason
(`kvscope_source_read_errors_total{target, source, reason}`) and logs it when it starts and when it ends, as
Prometheus' node_exporter counts a collector's errors without dropping the scrape.

Work that blocks (reading files, a blocking RPC client) runs through `await self.blocking(fn, *args)`: on a daemon
thread of the target's own, one call at a time, never on the event loop's shared executor. A read that never
returns holds only that thread: the scrape waiting for it is abandoned at the target's deadline (the call counted
as a `timeout` read error), and while it is still stuck every later scrape of the target fails at once (`<target>:
<what> still blocked after N s`, counted again) instead of starting more threads behind it. Daemon threads are not
joined at exit, so a stuck read never keeps the process from ending. The thread is kept between scrapes (starting
one per call cost about 0.05 ms of CPU a scrape) and ends once idle for WORKER_IDLE_S or its collector is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import importlib
import pkgutil
import queue
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from kvscope.samples import Sample


class CollectError(RuntimeError):
    """A scrape that failed; the message names the target and what went wrong (the scrape loop reports it)."""


ReadErrorReason = Literal[
    "unreadable",  # the file or answer is missing, or the read failed (ENOENT, EACCES, EIO, a dangling link)
    "not_a_file",  # not a regular file (a FIFO or device would block the read)
    "unparseable",  # not what the source writes there (text in a counter, N/A, empty, not UTF-8)
    "out_of_range",  # a number beyond what the counter can hold (negative, above 2^64, thousands of digits)
    "timeout",  # the read did not finish within the target's deadline
]


@dataclass(frozen=True, slots=True)
class ReadError:
    """One part of a target that a scrape could not read; the rest of the scrape stands."""

    reason: ReadErrorReason
    what: str  # the file path or RPC method: what the log names
    detail: str


@dataclass(slots=True)
class _BlockingCall:
    """The blocking call a collector's thread is running (or ran last)."""

    what: str
    started: float  # time.monotonic()
    done: threading.Event = field(default_factory=threading.Event)


T = TypeVar("T")

WORKER_IDLE_S = 60.0  # a target's thread ends after this long without a call; the next call starts another


class _OwnThread:
    """A target's own daemon thread, running its blocking calls in turn (Collector.blocking lets one in at a time)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._calls: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # between a call handed in and the thread ending idle
        self._running = False

    def submit(self, call: Callable[[], None]) -> None:
        with self._lock:
            self._calls.put(call)
            if not self._running:
                self._running = True
                threading.Thread(target=self._serve, name=self._name, daemon=True).start()

    def stop(self) -> None:
        """End the thread after the call it runs (its collector is gone: nothing will be handed in)."""
        self._calls.put(None)

    def _serve(self) -> None:
        while True:
            try:
                call = self._calls.get(timeout=WORKER_IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._calls.empty():
                        self._running = False
                        return
                continue
            if call is None:
                return
            call()
            call = None  # holds the collector (its bound method) while the thread waits for the next


class TargetConfig(BaseModel):
    """Fields every target has; a source's `Config` adds its own."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]+$", description="unique name of the target, e.g. vllm-0")
    source: str
    interval_s: float = Field(5.0, gt=0, description="seconds between scrapes")
    timeout_s: float = Field(2.0, gt=0, description="a scrape slower than this fails")
    labels: dict[str, str] = Field(
        default_factory=dict, description="labels for the mapping, e.g. system, role, host, engine"
    )


class Collector(ABC):
    """Reads one target and returns its raw samples. One instance per target, reused across scrapes."""

    source: ClassVar[str]
    Config: ClassVar[type[TargetConfig]] = TargetConfig
    _blocking: _BlockingCall | None = None  # the call on this target's own thread, the last one started
    _own_thread: _OwnThread | None = None  # that thread, from the first call on

    def __init__(self, config: TargetConfig) -> None:
        self.config = config
        self.read_errors: list[ReadError] = []  # of the scrape in progress; the scrape loop takes them

    @abstractmethod
    async def collect(self) -> list[Sample]:
        """One scrape of the target: raw samples, or CollectError naming what failed."""

    def read_error(self, reason: ReadErrorReason, what: str, detail: str) -> None:
        """Report a part of the target this scrape could not read, and go on with the rest."""
        self.read_errors.append(ReadError(reason, what, detail))

    async def blocking(self, fn: Callable[..., T], /, *args: Any, what: str | None = None) -> T:
        """`fn(*args)` on a daemon thread of this target's own, one call at a time (`what`, e.g. the path or
        address it reads, names it in errors). Cancelled (the scrape's deadline), the wait ends at once and counts
        a `timeout` read error; the thread is left to finish. While a call is still running, another fails at
        once with CollectError and counts a `timeout` read error again: a stuck read holds one thread, never more.
        """
        previous = self._blocking
        if previous is not None and not previous.done.is_set():
            detail = f"still blocked after {time.monotonic() - previous.started:.1f} s"
            self.read_error("timeout", previous.what, f"{detail}; no new read started")
            raise CollectError(f"{self.config.name}: {previous.what} {detail}; no new read started")
        what = what or getattr(fn, "__qualname__", repr(fn))
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        call = self._blocking = _BlockingCall(what, time.monotonic())
        context = contextvars.copy_context()

        def run() -> None:
            try:
                outcome: tuple[Any, BaseException | None] = (context.run(fn, *args), None)
            except BaseException as error:  # handed to the awaiting coroutine, as asyncio.to_thread does
                outcome = (None, error)
            call.done.set()
            with contextlib.suppress(RuntimeError):  # the loop closed while the call was stuck: nobody waits
                loop.call_soon_threadsafe(_settle, future, *outcome)

        if self._own_thread is None:
            self._own_thread = _OwnThread(f"kvscope {self.config.name}")
            weakref.finalize(self, self._own_thread.stop)
        self._own_thread.submit(run)
        try:
            return await future
        except asyncio.CancelledError:
            if not call.done.is_set():
                self.read_error("timeout", what, f"no answer within the target's {self.config.timeout_s:g} s")
            raise

    def take_read_errors(self) -> list[ReadError]:
        """The read errors of the scrape that just ended (each scrape's are counted once)."""
        errors, self.read_errors = self.read_errors, []
        return errors

    async def close(self) -> None:  # noqa: B027 - optional hook: most sources hold nothing between scrapes
        """Release connections held across scrapes."""


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the scrape gave up waiting
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


def collectors() -> dict[str, type[Collector]]:
    """Every source in the package, by name."""
    import kvscope.exporters as package

    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")
    found: dict[str, type[Collector]] = {}
    pending = list(Collector.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if "source" in vars(cls):
            found[cls.source] = cls
    return found
