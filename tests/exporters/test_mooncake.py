"""Mooncake's master and client /metrics through MooncakeCollector and mappings/mooncake.yaml.

Fixtures: tests/fixtures/mooncake/ (real captures from mooncake 0.3.13.post1 on this project's machine; what was
done between them is in its PROVENANCE.md and timings*.json). Expected numbers are worked out by hand from the
fixture text and the listed operations, not from the code under test.
"""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvscope.exporters.base import CollectError
from kvscope.exporters.config import parse_config
from kvscope.exporters.mooncake import MooncakeCollector, parse_mooncake
from kvscope.exporters.normalizer import mapping_for
from kvscope.model import INSTRUMENTS
from kvscope.samples import Sample

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "mooncake"
EXPOSITIONS = sorted(p for p in FIXTURES.rglob("*metrics*.txt") if "summary" not in p.name)
SUMMARIES = sorted(FIXTURES.rglob("*summary*.txt"))
MiB = 1 << 20
TIERS = {"dram", "ssd", "nof"}

Model = dict[tuple[str, str], float]


def fixture_id(path: Path) -> str:
    return str(path.relative_to(FIXTURES))


def normalize(samples: list[Sample], system: str = "mooncake") -> Model:
    """The normalized samples of one scrape keyed by (instrument, tier); each key must occur once."""
    model: Model = {}
    for sample in mapping_for("mooncake").apply(samples, {"system": system}):
        labels = sample.label_map
        assert set(labels) == {"system", "tier"} and labels["system"] == system, sample
        key = (sample.name, labels["tier"])
        assert key not in model, key
        model[key] = sample.value
    return model


def model_of(relative: str) -> Model:
    path = FIXTURES / relative
    return normalize(parse_mooncake(path.read_text(), path.name))


def delta(after: Model, before: Model) -> Model:
    """after - before; a series absent before (Mooncake creates many on first use) started at 0."""
    return {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after.keys() | before.keys()}


def timings(relative: str) -> list[list]:
    """Rows of [op, key, MiB, result, seconds]: what the capture script did, in order (PROVENANCE.md)."""
    return json.loads((FIXTURES / relative).read_text())


# ---------------------------------------------------------------- parsing every fixture
@pytest.mark.parametrize("path", EXPOSITIONS, ids=fixture_id)
def test_every_fixture_parses_under_its_wire_names(path: Path):
    text = path.read_text()
    samples = parse_mooncake(text, "mooncake-x")
    assert samples
    wire = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert {s.name for s in samples} == wire - {n for n in wire if n.endswith("_created")}
    assert all(s.source == "mooncake" and not s.normalized for s in samples)
    for sample in mapping_for("mooncake").apply(samples, {"system": "mooncake"}):
        assert sample.name in INSTRUMENTS and sample.kind == INSTRUMENTS[sample.name].kind
        assert sample.label_map["tier"] in TIERS
        assert sample.value >= 0, sample


@pytest.mark.parametrize("path", SUMMARIES, ids=fixture_id)
def test_summary_pages_are_not_expositions(path: Path):
    with pytest.raises(CollectError, match=r"^mooncake-master: not a Prometheus text exposition"):
        parse_mooncake(path.read_text(), "mooncake-master")


def test_quirk_counters_without_total_keep_their_wire_name():
    text = (FIXTURES / "ssd_offload" / "master_metrics_after.txt").read_text()
    plain = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    fixed = {s.name: s.value for s in parse_mooncake(text, "t")}
    # prometheus_client's OpenMetrics munging invents these names ...
    assert plain["mem_cache_hit_nums__total"] == 27
    assert plain["master_evicted_key_count_total"] == 17
    # ... which Mooncake never exposes; kvscope's parser keeps the names on the wire.
    assert "mem_cache_hit_nums__total" not in fixed and fixed["mem_cache_hit_nums_"] == 27
    assert fixed["master_evicted_key_count"] == 17 and fixed["master_evicted_key_count_mem"] == 17
    assert fixed["master_evicted_size_bytes_mem"] == 272 * MiB
    # names that do end in _total on the wire are untouched
    assert fixed["mem_cache_hit_bytes_total"] == 432 * MiB
    assert fixed["master_put_start_requests_total"] == 24


def test_quirk_histograms_are_kept_as_exposed():
    samples = parse_mooncake((FIXTURES / "client_metrics_user_after.txt").read_text(), "t")
    put_latency = {(s.name, s.labels): s.value for s in samples if s.name.startswith("mooncake_transfer_put_latency")}
    # buckets carry client_mode, the _sum and _count carry no label at all
    assert put_latency[("mooncake_transfer_put_latency_sum", ())] == 3470843
    assert put_latency[("mooncake_transfer_put_latency_count", ())] == 12
    assert put_latency[("mooncake_transfer_put_latency_bucket", (("client_mode", "real"), ("le", "+Inf")))] == 12
    master = parse_mooncake((FIXTURES / "master_metrics_after.txt").read_text(), "t")
    buckets = {s.label_map["le"]: s.value for s in master if s.name == "master_value_size_bytes_bucket"}
    assert buckets["4096.000000"] == 1  # six decimals, kept verbatim (the master's start-up observe(0))
    assert buckets["67108864.000000"] == 21 and buckets["+Inf"] == 21


# ---------------------------------------------------------------- hand-checked values
def test_two_clients_after_all_ops_hand_checked():
    # master_metrics_after.txt: master_allocated_bytes 283115520, master_total_capacity_bytes 1073741824,
    # mem_cache_hit_nums_ 20, file_cache_hit_nums_ 0, master_evicted_key_count 0, nof and file gauges 0.
    assert model_of("master_metrics_after.txt") == {
        ("kv.tier.allocated.bytes", "dram"): 283115520,
        ("kv.tier.capacity.bytes", "dram"): 1073741824,
        ("kv.tier.allocated.bytes", "nof"): 0,
        ("kv.tier.capacity.bytes", "nof"): 0,
        ("kv.tier.allocated.bytes", "ssd"): 0,
        ("kv.tier.capacity.bytes", "ssd"): 0,
        ("kv.tier.evictions", "dram"): 0,
        ("kv.tier.evicted.bytes", "dram"): 0,
        ("kv.tier.hits", "dram"): 20,
        ("kv.tier.hits", "ssd"): 0,
    }
    # client_metrics_user_after.txt: write_operation_bytes put 267386880 + put_batch 16777216, counts 12 + 1;
    # read_operation_bytes get_buffer 267386880 + batch_get_buffer 16777216, counts 12 + 1;
    # mooncake_transfer_read_bytes = mooncake_transfer_write_bytes = 284164096; no mooncake_ssd_* series.
    assert model_of("client_metrics_user_after.txt") == {
        ("kv.store.put.bytes", "dram"): 284164096,
        ("kv.store.put.ops", "dram"): 13,
        ("kv.store.get.bytes", "dram"): 284164096,
        ("kv.store.get.ops", "dram"): 13,
        ("kv.tier.written.bytes", "dram"): 284164096,
        ("kv.tier.read.bytes", "dram"): 284164096,
    }
    # the provider only mounted its segment: RPC counts, nothing of the model
    assert model_of("client_metrics_provider_after.txt") == {}


def test_ssd_offload_after_hand_checked():
    # ssd_offload/master_metrics_after.txt: allocated 117440512 of 134217728 (DRAM), file 335544320 of
    # 2199023255552, evicted 17 keys / 285212672 bytes (no _nof series), hits mem 27 / file 13.
    assert model_of("ssd_offload/master_metrics_after.txt") == {
        ("kv.tier.allocated.bytes", "dram"): 117440512,
        ("kv.tier.capacity.bytes", "dram"): 134217728,
        ("kv.tier.allocated.bytes", "ssd"): 335544320,
        ("kv.tier.capacity.bytes", "ssd"): 2199023255552,
        ("kv.tier.allocated.bytes", "nof"): 0,
        ("kv.tier.capacity.bytes", "nof"): 0,
        ("kv.tier.evictions", "dram"): 17,
        ("kv.tier.evicted.bytes", "dram"): 285212672,
        ("kv.tier.hits", "dram"): 27,
        ("kv.tier.hits", "ssd"): 13,
    }
    # ssd_offload/client_metrics_after.txt: put 402653184 in 24 ops, get_buffer 335544320 in 20 ops,
    # transfer read 117440512 / write 402653184, ssd read 218103808 / write 335544320 (ssd_total_* unmapped).
    assert model_of("ssd_offload/client_metrics_after.txt") == {
        ("kv.store.put.bytes", "dram"): 402653184,
        ("kv.store.put.ops", "dram"): 24,
        ("kv.store.get.bytes", "dram"): 335544320,
        ("kv.store.get.ops", "dram"): 20,
        ("kv.tier.written.bytes", "dram"): 402653184,
        ("kv.tier.read.bytes", "dram"): 117440512,
        ("kv.tier.written.bytes", "ssd"): 335544320,
        ("kv.tier.read.bytes", "ssd"): 218103808,
    }


def test_system_label_comes_from_the_target():
    samples = parse_mooncake((FIXTURES / "master_metrics_after.txt").read_text(), "t")
    assert normalize(samples, system="mooncake-prod")[("kv.tier.hits", "dram")] == 20


def test_evictions_split_total_into_dram_and_nof():
    # SYNTHETIC (hand-written in Mooncake's format): the per-medium series a NoF eviction creates
    # (master_evicted_key_count_nof, master_evicted_size_bytes_nof; names from Mooncake's master_metric_manager).
    # The totals count every eviction once more, so dram = total - nof.
    text = """\
# TYPE master_evicted_key_count counter
master_evicted_key_count 10
# TYPE master_evicted_size_bytes counter
master_evicted_size_bytes 1000
# TYPE master_evicted_key_count_mem counter
master_evicted_key_count_mem 6
# TYPE master_evicted_size_bytes_mem counter
master_evicted_size_bytes_mem 600
# TYPE master_evicted_key_count_nof counter
master_evicted_key_count_nof 4
# TYPE master_evicted_size_bytes_nof counter
master_evicted_size_bytes_nof 400
"""
    assert normalize(parse_mooncake(text, "t")) == {
        ("kv.tier.evictions", "dram"): 6,
        ("kv.tier.evictions", "nof"): 4,
        ("kv.tier.evicted.bytes", "dram"): 600,
        ("kv.tier.evicted.bytes", "nof"): 400,
    }


# ---------------------------------------------------------------- deltas = the operations in PROVENANCE.md
def test_two_clients_deltas_match_the_operations():
    rows = timings("timings_tcp_two_clients.json")
    # 12 puts of 3 x (1 + 4 + 16 + 64) MiB, then put_batch 8 x 2 MiB; all succeeded (result 0).
    puts = [row for row in rows if row[0] in ("put", "put_batch")]
    assert all(row[3] == 0 for row in puts)
    put_bytes = sum(row[2] for row in puts) * MiB
    assert put_bytes == (3 * (1 + 4 + 16 + 64) + 8 * 2) * MiB == 284164096
    # 12 gets and one get_batch of the same objects; get("no_such_key") missed.
    gets = [row for row in rows if row[0] in ("get", "get_batch") and row[3] is True]
    get_bytes = sum(row[2] for row in gets) * MiB
    assert get_bytes == put_bytes

    # The user client is a fresh process: its series start at 0 (and most appear only on first use).
    client = model_of("client_metrics_user_after.txt")
    assert client[("kv.store.put.bytes", "dram")] == put_bytes
    assert client[("kv.store.put.ops", "dram")] == len(puts) == 13  # API calls: the batch is one
    assert client[("kv.store.get.bytes", "dram")] == get_bytes
    assert client[("kv.store.get.ops", "dram")] == len(gets) == 13  # the miss is not counted
    assert client[("kv.tier.written.bytes", "dram")] == put_bytes  # one replica each
    assert client[("kv.tier.read.bytes", "dram")] == get_bytes

    before, mounted, after = (model_of(f"master_metrics_{name}.txt") for name in ("before", "after_mount", "after"))
    assert delta(mounted, before) == {
        **{key: 0 for key in before},
        ("kv.tier.capacity.bytes", "dram"): 1024 * MiB,  # the provider's 1 GiB segment (the user mounts 0)
    }
    change = delta(after, mounted)
    # everything put, less the 1 MiB object removed at the end (remove("obj_1MB_2") succeeded after the lease)
    assert change[("kv.tier.allocated.bytes", "dram")] == put_bytes - 1 * MiB
    # a lookup per key got: 12 single + 8 in the batch; the miss and is_exist count nothing
    assert change[("kv.tier.hits", "dram")] == 12 + 8
    assert {key: value for key, value in change.items() if value} == {
        ("kv.tier.allocated.bytes", "dram"): put_bytes - 1 * MiB,
        ("kv.tier.hits", "dram"): 20,
    }


def test_single_client_memcpy_deltas_match_the_operations():
    rows = timings("single_client_memcpy/timings.json")
    put_bytes = sum(row[2] for row in rows if row[0] == "put" and row[3] == 0) * MiB
    assert put_bytes == 3 * (1 + 4 + 16 + 64) * MiB
    assert rows[-1][:4] == ["remove", "obj_1MB_2", 0, -706]  # lease still held: nothing removed
    client = model_of("single_client_memcpy/client_metrics_after.txt")
    assert client == {
        ("kv.store.put.bytes", "dram"): put_bytes,
        ("kv.store.put.ops", "dram"): 12,
        ("kv.store.get.bytes", "dram"): put_bytes,
        ("kv.store.get.ops", "dram"): 12,
        ("kv.tier.written.bytes", "dram"): put_bytes,  # memcpy into its own segment still counts
        ("kv.tier.read.bytes", "dram"): put_bytes,
    }
    change = delta(
        model_of("single_client_memcpy/master_metrics_after.txt"),
        model_of("single_client_memcpy/master_metrics_before.txt"),
    )
    assert {key: value for key, value in change.items() if value} == {
        ("kv.tier.allocated.bytes", "dram"): put_bytes,
        ("kv.tier.capacity.bytes", "dram"): 512 * MiB,
        ("kv.tier.hits", "dram"): 12,
    }


def test_ssd_offload_deltas_match_the_operations():
    rows = timings("ssd_offload/timings.json")
    puts = [row for row in rows if row[0] == "put"]
    gets_ok = [row for row in rows if row[0] == "get" and row[3] is True]
    assert len(puts) == 24 and all(row[2] == 16 and row[3] == 0 for row in puts)
    assert len(gets_ok) == 20  # 4 keys were evicted before they were offloaded: misses
    object_ = 16 * MiB

    before, mounted, after_puts, after = (
        model_of(f"ssd_offload/master_metrics_{name}.txt") for name in ("before", "after_mount", "after_puts", "after")
    )
    assert delta(mounted, before)[("kv.tier.capacity.bytes", "dram")] == 128 * MiB
    assert delta(mounted, before)[("kv.tier.capacity.bytes", "ssd")] == 2 * 1024 * 1024 * MiB  # reported 2 TiB

    puts_done = delta(after_puts, mounted)
    # 20 objects (320 MiB) reached the disk; 17 were evicted from DRAM; 7 are left in DRAM.
    assert puts_done[("kv.tier.allocated.bytes", "ssd")] == 20 * object_
    assert puts_done[("kv.tier.evictions", "dram")] == 17
    assert puts_done[("kv.tier.evicted.bytes", "dram")] == 17 * object_
    assert puts_done[("kv.tier.allocated.bytes", "dram")] == (24 - 17) * object_
    # Quirk: no application get yet, but the offload worker's 20 reads counted as DRAM hits.
    assert puts_done[("kv.tier.hits", "dram")] == 20
    assert puts_done[("kv.tier.hits", "ssd")] == 0

    gets_done = delta(after, after_puts)
    assert {key: value for key, value in gets_done.items() if value} == {
        ("kv.tier.hits", "dram"): 7,  # the 7 objects still in DRAM
        ("kv.tier.hits", "ssd"): 13,  # the 13 offloaded objects DRAM had evicted
    }

    # The client is a fresh process (zero baseline): its logical and per-medium bytes.
    client = model_of("ssd_offload/client_metrics_after.txt")
    assert client[("kv.store.put.bytes", "dram")] == len(puts) * object_
    assert client[("kv.store.put.ops", "dram")] == len(puts)
    assert client[("kv.store.get.bytes", "dram")] == len(gets_ok) * object_
    assert client[("kv.store.get.ops", "dram")] == len(gets_ok)
    assert client[("kv.tier.written.bytes", "ssd")] == after[("kv.tier.allocated.bytes", "ssd")] == 20 * object_
    # each successful get was served by one medium, the offload worker's reads are in neither
    assert client[("kv.tier.read.bytes", "dram")] == 7 * object_
    assert client[("kv.tier.read.bytes", "ssd")] == 13 * object_
    assert client[("kv.tier.read.bytes", "dram")] + client[("kv.tier.read.bytes", "ssd")] == len(gets_ok) * object_


# ---------------------------------------------------------------- over HTTP, through the configuration
def collect(url: str, **extra) -> tuple[MooncakeCollector, list[Sample]]:
    config = parse_config({"targets": [{"name": "mooncake-master", "source": "mooncake", "url": url, **extra}]})
    collector = MooncakeCollector(config.targets[0])

    async def once():
        try:
            return await collector.collect()
        finally:
            await collector.close()

    return collector, asyncio.run(once())


@pytest.mark.parametrize(
    "relative", ["master_metrics_after.txt", "client_metrics_user_after.txt", "ssd_offload/client_metrics_after.txt"]
)
def test_collects_over_http(metrics_server, relative):
    body = (FIXTURES / relative).read_bytes()
    collector, samples = collect(metrics_server.serve("/metrics", body))
    assert isinstance(collector.config, MooncakeCollector.Config)
    assert collector.config.labels == {"system": "mooncake"}  # the default system
    assert samples == parse_mooncake(body.decode(), "mooncake-master")
    assert normalize(samples) == model_of(relative)


def test_target_labels_keep_a_default_system(metrics_server):
    url = metrics_server.serve("/metrics", (FIXTURES / "master_metrics_after.txt").read_bytes())
    collector, samples = collect(url, labels={"system": "mooncake-a", "host": "h1"})
    assert collector.config.labels == {"system": "mooncake-a", "host": "h1"}
    collector, _ = collect(url, labels={"host": "h1"})
    assert collector.config.labels == {"system": "mooncake", "host": "h1"}
    normalized = mapping_for("mooncake").apply(samples, {"system": "mooncake-a", "host": "h1"})
    assert {s.label_map["system"] for s in normalized} == {"mooncake-a"}


def test_summary_page_over_http_is_a_collect_error(metrics_server):
    url = metrics_server.serve("/metrics/summary", (FIXTURES / "master_metrics_summary_after.txt").read_bytes())
    with pytest.raises(CollectError, match=r"^mooncake-master: not a Prometheus text exposition"):
        collect(url)


@pytest.mark.parametrize(
    ("body", "status"), [(b"<html>oops</html>", 200), (b"garbage {{{", 200), (b"internal error", 500)]
)
def test_garbage_is_a_collect_error_naming_the_target(metrics_server, body, status):
    url = metrics_server.serve("/metrics", body, status=status)
    with pytest.raises(CollectError, match=r"^mooncake-master: "):
        collect(url)


def test_unreachable_target_is_a_collect_error_naming_the_target():
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(CollectError, match=rf"^mooncake-master: GET http://127\.0\.0\.1:{port}/metrics failed"):
        collect(f"http://127.0.0.1:{port}/metrics", timeout_s=1)
