"""The exposition parser's reuse of its last parse: on every captured exposition, a scrape whose series are the
last one's gives what a whole parse by prometheus_client gives, values included; anything else is parsed whole."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvscope.exporters.base import CollectError
from kvscope.exporters.promtext import ExpositionParser, parse_exposition

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
CAPTURES = sorted(
    [
        *(FIXTURES / "vllm").rglob("*.txt"),
        *(FIXTURES / "vllm").rglob("*.prom"),
        *(FIXTURES / "mooncake").rglob("*metrics*.txt"),
    ]
)
CAPTURES = [path for path in CAPTURES if "summary" not in path.name]  # the Mooncake summaries are prose
VALUE = re.compile(r"(?m)^([^#\n][^\n]*?[} ]) ?([-+0-9.eE]+|NaN|[+-]?Inf)$")


def _scaled(text: str, factor: float) -> str:
    """The same exposition with every finite sample value multiplied by `factor` (the next scrape of a busy target)."""

    def scale(match: re.Match) -> str:
        value = float(match.group(2))
        head = match.group(1) if match.group(1).endswith(" ") else match.group(1) + " "
        return f"{head}{value * factor!r}" if value == value and abs(value) != float("inf") else match.group(0)

    return VALUE.sub(scale, text)


@pytest.mark.parametrize("capture", CAPTURES, ids=lambda p: str(p.relative_to(FIXTURES)))
def test_a_scrape_with_the_last_series_reads_as_a_whole_parse(capture):
    source = "vllm" if "vllm" in capture.name or "vllm" in str(capture.parent) else "mooncake"
    text = capture.read_text()
    parser = ExpositionParser(source, "t")
    assert parser.parse(text) == parse_exposition(source, text, "t")
    later = _scaled(text, 3.0)
    assert later != text
    assert parser.parse(later) == parse_exposition(source, later, "t")
    assert parser.parse(text) == parse_exposition(source, text, "t")


def test_series_that_change_are_parsed_whole():
    parser = ExpositionParser("mooncake", "t")
    first = "# TYPE hits_ counter\nhits_ 1\n"
    assert [(s.name, s.value, s.kind) for s in parser.parse(first)] == [("hits_", 1.0, "counter")]
    second = '# TYPE hits_ counter\nhits_ 2\n# TYPE used gauge\nused{tier="dram"} 5 1700000000000\n'
    assert [(s.name, s.labels, s.value, s.kind) for s in parser.parse(second)] == [
        ("hits_", (), 2.0, "counter"),
        ("used", (("tier", "dram"),), 5.0, "gauge"),
    ]
    # the same series with a new timestamp: the last parse is reused, the value read
    assert [s.value for s in parser.parse(second.replace("5 1700000000000", "7 1700000005000"))] == [2.0, 7.0]


@pytest.mark.parametrize("garbage", ["hits_ one\n", "hits_\n", 'hits_{a="b" 1\n'])
def test_a_bad_value_after_a_good_scrape_is_a_collect_error(garbage):
    parser = ExpositionParser("mooncake", "t")
    parser.parse("hits_ 1\n")
    with pytest.raises(CollectError, match="t: not a Prometheus text exposition"):
        parser.parse(garbage)


def test_a_line_that_did_not_change_keeps_its_sample_and_one_that_did_is_read_again():
    parser = ExpositionParser("vllm", "t")
    text = '# TYPE hits counter\nhits_total{engine="0"} 1\nhits_total{engine="1"} 2\n# TYPE used gauge\nused 5\n'
    first = parser.parse(text)
    first.append(first[0])  # the caller's list: the parser keeps its own
    second = parser.parse(text.replace('"1"} 2', '"1"} 3'))
    assert [s.value for s in second] == [1.0, 3.0, 5.0]
    assert second[0] is first[0] and second[2] is first[2]
    assert second == parse_exposition("vllm", text.replace('"1"} 2', '"1"} 3'), "t")


@pytest.mark.parametrize(
    "change",
    [
        lambda text: text + "\n",  # a line more
        lambda text: text.replace('engine="1"', 'engine="2"'),  # another series
        lambda text: text.replace("# TYPE used gauge", "# TYPE used counter"),  # another kind
    ],
    ids=["a line more", "another series", "another kind"],
)
def test_any_other_change_is_parsed_whole(change):
    parser = ExpositionParser("vllm", "t")
    text = '# TYPE hits counter\nhits_total{engine="0"} 1\nhits_total{engine="1"} 2\n# TYPE used gauge\nused 5\n'
    parser.parse(text)
    assert parser.parse(change(text)) == parse_exposition("vllm", change(text), "t")
