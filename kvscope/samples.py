"""The one sample type every source, the normalizer, the recorder and the exporters share.

A raw sample keeps the source's own name and labels (what an auditor re-runs against); a normalized sample carries
a KV-tier model instrument name (docs/design.md, 'The KV-tier model': kv.store.put.bytes, kv.tier.written.bytes,
rdma.port.tx.bytes, ...) and the model's labels.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

Kind = Literal["counter", "gauge", "histogram", "summary", "info", "unknown"]
Labels = tuple[tuple[str, str], ...]


def labels_of(mapping: Mapping[str, str]) -> Labels:
    """Canonical (sorted) label pairs, so equal label sets compare and hash equal."""
    return tuple(sorted(zip(map(str, mapping), map(str, mapping.values()), strict=True)))


@dataclass(frozen=True, slots=True)
class Sample:
    source: str  # the collector that produced it (vllm, mooncake, spdk, rdma, tierstore, ...)
    name: str  # raw: the source's own name; normalized: a KV-tier model instrument
    labels: Labels
    value: float
    kind: Kind
    normalized: bool = False

    def __init__(
        self, source: str, name: str, labels: Labels, value: float, kind: Kind, normalized: bool = False
    ) -> None:
        # What dataclass would generate, through the slots' own descriptors: its frozen __init__ sets each field
        # with object.__setattr__, which takes twice as long, and a scrape makes thousands of samples.
        _set_source(self, source)
        _set_name(self, name)
        _set_labels(self, labels)
        _set_value(self, value)
        _set_kind(self, kind)
        _set_normalized(self, normalized)

    @property
    def label_map(self) -> dict[str, str]:
        return dict(self.labels)

    def as_json(self) -> dict:
        """The JSON-lines form of `kvscope scrape --once --format json`."""
        return {
            "source": self.source,
            "name": self.name,
            "labels": self.label_map,
            "value": self.value,
            "kind": self.kind,
            "normalized": self.normalized,
        }


_set_source, _set_name, _set_labels, _set_value, _set_kind, _set_normalized = (
    vars(Sample)[name].__set__ for name in Sample.__slots__
)
