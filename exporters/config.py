"""The exporter's configuration file (targets.yaml): where to listen, where to push, which targets to scrape.

Each target is validated by its source's own `Config`, so a bad field is named with its place in the file
(`targets.2.url: ...`) before anything is scraped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvscope.exporters.base import TargetConfig, collectors
from kvscope.validation import describe, read_yaml


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the file, the field and the reason."""


class OtlpConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    endpoint: str = Field(description="e.g. http://127.0.0.1:4318/v1/metrics (http) or 127.0.0.1:4317 (grpc)")
    protocol: Literal["http", "grpc"] = "http"
    interval_s: float = Field(10.0, gt=0)
    insecure: bool = True


class ExporterSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    listen_host: str = "127.0.0.1"
    listen_port: int = Field(9464, ge=0, le=65535, description="Prometheus endpoint; 0 picks a free port")
    otlp: OtlpConfig | None = None


class _File(BaseModel):
    model_config = ConfigDict(extra="forbid")

    exporter: ExporterSettings = ExporterSettings()
    targets: list[dict] = Field(min_length=1)


class ExporterConfig(BaseModel):
    exporter: ExporterSettings
    targets: list[TargetConfig]


def parse_config(data: object, origin: str = "config") -> ExporterConfig:
    """Validate a configuration mapping: the common fields, then each target with its source's Config."""
    try:
        raw = _File.model_validate(data)
    except ValidationError as error:
        raise ConfigError("\n".join(describe(error, origin, "configuration"))) from None
    sources = collectors()
    targets: list[TargetConfig] = []
    problems: list[str] = []
    for index, target in enumerate(raw.targets):
        source = target.get("source") if isinstance(target, dict) else None
        if source not in sources:
            problems.append(f"  targets.{index}.source: {source!r} is not one of {', '.join(sorted(sources))}")
            continue
        try:
            targets.append(sources[source].Config.model_validate(target))
        except ValidationError as error:
            problems += describe(error, origin, "configuration", prefix=f"targets.{index}.")[1:]
    names = [target.name for target in targets]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        problems.append(f"  targets: names must be unique, repeated: {', '.join(duplicates)}")
    if problems:
        raise ConfigError("\n".join([f"{origin}: invalid configuration", *problems]))
    return ExporterConfig(exporter=raw.exporter, targets=targets)


def load_config(path: str | Path) -> ExporterConfig:
    path = Path(path)
    return parse_config(read_yaml(path, "configuration", ConfigError), str(path))
