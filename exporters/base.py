"""The interface every source implements, its target configuration, and how sources are found.

A source is one module in `kvscope.exporters` defining a `Collector` subclass with a `source` name, a `Config`
(pydantic, the fields its targets take) and `collect()`, plus a mapping `mappings/<source>.yaml`. Nothing else
registers it: `collectors()` finds every such subclass by importing the package's modules.

A part of a target that cannot be read (a file, an RPC answer) is not a failed scrape: the collector reports it
with `read_error(reason, what, detail)` and keeps the rest; the scrape loop counts it per target and reason
(`kvscope_source_read_errors_total{target, source, reason}`) and logs it when it starts and when it ends, as
Prometheus' node_exporter counts a collector's errors without dropping the scrape.
"""

from __future__ import annotations

import importlib
import pkgutil
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal

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

    def __init__(self, config: TargetConfig) -> None:
        self.config = config
        self.read_errors: list[ReadError] = []  # of the scrape in progress; the scrape loop takes them

    @abstractmethod
    async def collect(self) -> list[Sample]:
        """One scrape of the target: raw samples, or CollectError naming what failed."""

    def read_error(self, reason: ReadErrorReason, what: str, detail: str) -> None:
        """Report a part of the target this scrape could not read, and go on with the rest."""
        self.read_errors.append(ReadError(reason, what, detail))

    def take_read_errors(self) -> list[ReadError]:
        """The read errors of the scrape that just ended (each scrape's are counted once)."""
        errors, self.read_errors = self.read_errors, []
        return errors

    async def close(self) -> None:  # noqa: B027 - optional hook: most sources hold nothing between scrapes
        """Release connections held across scrapes."""


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
