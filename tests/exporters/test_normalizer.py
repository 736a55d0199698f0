"""A target's Normalizer, which keeps what each raw position adds to between scrapes, gives what a fresh
normalizing of the same scrape gives, scrape after scrape, whether values, series or their order change."""

from __future__ import annotations

import re
from pathlib import Path

from kvscope.exporters.normalizer import Normalizer, mapping_for
from kvscope.exporters.promtext import parse_exposition
from kvscope.samples import Sample

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
VLLM = FIXTURES / "vllm" / "metrics_rendered_v0.33.0_offloading_kvcachemetrics_SYNTHETIC.txt"
LABELS = {"system": "mooncake", "role": "dram"}


def scaled(samples: list[Sample], factor: float) -> list[Sample]:
    return [Sample(s.source, s.name, s.labels, s.value * factor, s.kind) for s in samples]


def fresh(samples: list[Sample]) -> list[Sample]:
    return Normalizer(mapping_for("vllm"), LABELS).apply(samples)


def test_scrape_after_scrape_it_gives_what_a_fresh_normalizing_gives():
    text = VLLM.read_text().replace('num_gpu_blocks="None"', 'num_gpu_blocks="4096"', 1)  # one engine's capacity
    raw = parse_exposition("vllm", text, "t")
    engine_1 = [s for s in raw if ("engine", "1") not in s.labels]
    scrapes = [
        raw,
        scaled(raw, 3.0),  # every value changed
        raw[::-1],  # the same series in another order
        engine_1,  # series gone
        raw,  # and back
        [Sample(s.source, s.name, s.labels, float("nan"), s.kind) for s in raw],
        scaled(raw, 0.5),
    ]
    kept = Normalizer(mapping_for("vllm"), LABELS)
    for samples in scrapes:
        normalized = kept.apply(samples)
        assert [(s.name, s.labels, s.kind) for s in normalized] == [(s.name, s.labels, s.kind) for s in fresh(samples)]
        assert [repr(s.value) for s in normalized] == [repr(s.value) for s in fresh(samples)]  # NaN, -0.0 as well
    assert any(s.name == "kv.prefix.capacity.tokens" for s in normalized), "value_labels (cache_config_info) are read"


def test_a_model_series_whose_value_did_not_change_keeps_its_sample():
    raw = parse_exposition("vllm", VLLM.read_text(), "t")
    kept = Normalizer(mapping_for("vllm"), LABELS)
    first = kept.apply(raw)
    queries = re.compile(r"vllm:prefix_cache_queries(_total)?")
    busier = [Sample(s.source, s.name, s.labels, s.value + 1, s.kind) if queries.fullmatch(s.name) else s for s in raw]
    second = kept.apply(busier)
    changed = [a.name for a, b in zip(first, second, strict=True) if a is not b]
    assert changed and set(changed) <= {"kv.prefix.query.tokens"}
