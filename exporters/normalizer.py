"""Maps a source's raw samples onto the KV-tier model, by rules kept as data (`mappings/<source>.yaml`).

A rule names the raw series it reads (`match`, newest name first: when a scrape holds both a current and a
deprecated name, only the first present is used, so nothing is counted twice), optional label filters (`where`:
values a series must have; `unless`: values that reject it), the model instrument, the model labels as templates
over the raw labels and the target's labels (`"{engine}"`), and a `scale` (RDMA port counters count 4-byte words);
for an info metric, `value_labels` take the value from its labels. Raw series that land on the same model series
are summed.
"""

from __future__ import annotations

import string
from collections.abc import Iterable
from functools import cache, cached_property
from importlib import resources
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvscope.model import INSTRUMENTS
from kvscope.samples import Labels, Sample, labels_of

# Mapping._series is emptied past this many entries: a source whose label values churn must not grow it forever.
MAX_CACHED_SERIES = 1 << 16


class MappingError(ValueError):
    """A mapping file that cannot be used; the message names the file, the rule and the field."""


class Rule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    match: tuple[str, ...] = Field(min_length=1, description="raw names, newest first; the first present wins")
    where: dict[str, str] = Field(default_factory=dict, description="raw labels a series must have")
    unless: dict[str, str] = Field(default_factory=dict, description="raw label values a series must not have")
    instrument: str
    labels: dict[str, str] = Field(default_factory=dict, description="model labels: literals or {label} templates")
    scale: float = 1.0
    value_labels: tuple[str, ...] = Field(
        (),
        description="the value is the product of these raw labels, not the sample's (an info metric's settings, "
        "e.g. num_gpu_blocks x block_size); a series where one is not a number adds nothing",
    )
    kind: Literal["counter", "gauge"] | None = Field(None, description="default: the instrument's kind")

    @field_validator("instrument")
    @classmethod
    def _known_instrument(cls, name: str) -> str:
        if name not in INSTRUMENTS:
            raise ValueError(f"{name!r} is not an instrument of the KV-tier model ({', '.join(INSTRUMENTS)})")
        return name


class Mapping(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str
    rules: tuple[Rule, ...]

    def apply(self, samples: Iterable[Sample], target_labels: dict[str, str]) -> list[Sample]:
        """The normalized samples of one scrape."""
        wanted = self._wanted
        by_name: dict[str, list[Sample]] = {}
        for sample in samples:
            if sample.name in wanted:
                by_name.setdefault(sample.name, []).append(sample)
        target = tuple(target_labels.items())
        series = self._series
        if len(series) > MAX_CACHED_SERIES:
            series.clear()
        totals: dict[tuple[str, Labels], float] = {}
        for rule in self.rules:
            name = next((n for n in rule.match if n in by_name), None)
            if name is None:
                continue
            rule_key = (
                rule.instrument,
                tuple(rule.where.items()),
                tuple(rule.unless.items()),
                tuple(rule.labels.items()),
            )
            for sample in by_name[name]:
                key = (rule_key, sample.labels, target)
                if key not in series:
                    series[key] = _model_series(rule, sample.label_map, target_labels)
                if (model := series[key]) is not None:
                    value = _label_product(rule.value_labels, sample.label_map) if rule.value_labels else sample.value
                    if value is not None:
                        totals[model] = totals.get(model, 0.0) + value * rule.scale
        return [
            Sample(self.source, name, labels, value, INSTRUMENTS[name].kind, normalized=True)
            for (name, labels), value in totals.items()
        ]

    @cached_property
    def _wanted(self) -> frozenset[str]:
        """Every raw name some rule reads; the rest of a scrape is not looked at."""
        return frozenset(name for rule in self.rules for name in rule.match)

    @cached_property
    def _series(self) -> dict[tuple, tuple[str, Labels] | None]:
        """What a rule makes of a raw series, worked out once: a source's series are the same scrape after scrape.
        (rule's instrument, where, unless and labels; raw labels; target labels) -> the model series the raw series adds
        to, or None when `where` rejects it. Keyed by content, not position, so a copy of the mapping with other
        rules can share it."""
        return {}


def _model_series(rule: Rule, raw: dict[str, str], target_labels: dict[str, str]) -> tuple[str, Labels] | None:
    """The model series `rule` makes of a raw series' labels; None when its `where` or `unless` rejects them (a
    label the series lacks has the value "")."""
    if any(raw.get(key) != value for key, value in rule.where.items()):
        return None
    if any(raw.get(key, "") == value for key, value in rule.unless.items()):
        return None
    context = {**target_labels, **raw}
    return rule.instrument, labels_of({key: _fill(template, context) for key, template in rule.labels.items()})


def _label_product(names: tuple[str, ...], raw: dict[str, str]) -> float | None:
    """The product of raw labels read as numbers; None when one is missing or not a number ("None")."""
    product = 1.0
    for name in names:
        try:
            product *= float(raw[name])
        except (KeyError, ValueError):
            return None
    return product


def _fill(template: str, context: dict[str, str]) -> str:
    """`"{engine}"` with the label's value; a label neither the series nor the target has becomes ""."""
    fields = [field for _, field, _, _ in string.Formatter().parse(template) if field]
    return template.format(**{field: context.get(field, "") for field in fields})


@cache
def mapping_for(source: str) -> Mapping:
    """The shipped mapping of a source (`mappings/<source>.yaml` beside this module)."""
    path = resources.files("kvscope.exporters").joinpath("mappings", f"{source}.yaml")
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise MappingError(f"no mapping for source {source!r}: expected mappings/{source}.yaml") from None
    except yaml.YAMLError as error:
        raise MappingError(f"mappings/{source}.yaml: not valid YAML: {error}") from None
    try:
        mapping = Mapping.model_validate(data)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        raise MappingError(f"mappings/{source}.yaml: {problems}") from None
    if mapping.source != source:
        raise MappingError(f"mappings/{source}.yaml: says source {mapping.source!r}")
    return mapping
