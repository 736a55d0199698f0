"""The interface every source implements, its target configuration, and how sources are found.

A source is one module in `kvscope.exporters` defining a `Collector` subclass with a `source` name, a `Config`
(pydantic, the fields its targets take) and `collect()`, plus a mapping `mappings/<source>.yaml`. Nothing else
registers it: `collectors()` finds every such subclass by importing the package's modules.
"""

from __future__ import annotations

import importlib
import pkgutil
from abc import ABC, abstractmethod
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from kvscope.samples import Sample


class CollectError(RuntimeError):
    """A scrape that failed; the message names the target and what went wrong (the scrape loop reports it)."""


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

    @abstractmethod
    async def collect(self) -> list[Sample]:
        """One scrape of the target: raw samples, or CollectError naming what failed."""

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
