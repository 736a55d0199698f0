"""The block lifecycle instruments (kvscope.model, kv.block.*) and a check that a source's raw histogram of one of
them is mapped bucket by bucket, for the source tests."""

from __future__ import annotations

from kvscope.samples import Sample, labels_of
from support.scrape import raw_value

# A lifecycle quantity (the A/B contract's name) -> its buckets' and its sum's instruments
LIFECYCLE = {
    "lifetime": ("kv.block.lifetime.blocks", "kv.block.lifetime"),
    "idle_before_evict": ("kv.block.idle.blocks", "kv.block.idle"),
    "reuse_gap": ("kv.block.reuse.accesses", "kv.block.reuse.gap"),
}


def mapped_histogram(raw: list[Sample], got: dict, histogram: str, quantity: str, labels: dict[str, str]) -> float:
    """Every `_bucket` of the raw `histogram` is the quantity's bucket series at its bound (`upper_bound`), the +Inf
    one its `_count`, and its `_sum` the sum's series, all with the model `labels`; returns the count."""
    buckets, seconds = LIFECYCLE[quantity]
    bounds = {sample.label_map["le"] for sample in raw if sample.name == f"{histogram}_bucket"}
    assert "+Inf" in bounds and len(bounds) > 5, (histogram, bounds)
    for le in bounds:
        assert got[(buckets, labels_of({**labels, "upper_bound": le}))] == raw_value(raw, f"{histogram}_bucket", le=le)
    count = raw_value(raw, f"{histogram}_count")
    assert got[(buckets, labels_of({**labels, "upper_bound": "+Inf"}))] == count
    assert got[(seconds, labels_of(labels))] == raw_value(raw, f"{histogram}_sum")
    return count
