"""SPDK's JSON-RPC through the collector and its mapping, against a real JSON-RPC 2.0 server on a Unix socket.

The peer (tests/support/spdkpeer.py) is a protocol peer, not a patched client: it listens on a Unix socket (or TCP)
under tmp_path, reads the spdk package's JSONRPCClient requests off the stream and answers each method with the
captured bytes in tests/fixtures/spdk/ (live/: a real nvmf_tgt v26.09-pre; top level: SPDK's doc examples), only the
envelope `id` changed to the request's. Answers that are not captures are built in the test and say so (DERIVED).
"""

from __future__ import annotations

import asyncio
import base64
import copy
import itertools
import logging
import re
import struct
import time
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.realservers import served_exposition
from support.spdkpeer import FIXTURES, Answer, SpdkPeer, capture

from kvscope.exporters.base import CollectError, ReadError, collectors
from kvscope.exporters.config import ConfigError, parse_config
from kvscope.exporters.normalizer import mapping_for
from kvscope.exporters.scrape import Scraper
from kvscope.exporters.spdk import SpdkCollector
from kvscope.exporters.spdk_answers import U64_DIGITS, Answers, Memory, Roles, loads
from kvscope.exporters.spdk_answers import samples as answer_samples
from kvscope.samples import Sample, labels_of

NQN = "nqn.2016-06.io.spdk:kvcache1"
LVOL = "6d2078a0-f0f4-4867-b6f3-e06beb3c2cc0"  # lvs0/lvol0: its bdev name is its UUID
TICK_RATE = 2_450_000_000  # every live answer's tick_rate
LIVE_METHODS = (
    "bdev_get_bdevs",
    "bdev_lvol_get_lvstores",
    "framework_get_reactors",
    "nvmf_get_stats",
    "nvmf_get_subsystems",
    "spdk_get_version",
    "thread_get_stats",
)
DOC_METHODS = (*LIVE_METHODS, "bdev_get_iostat")

# -- the targets the peer plays ------------------------------------------------------------------------------------


def live_target(method: str, params: Any) -> Answer:
    """The captured v26.09-pre nvmf_tgt. Its iostat answers: no params -> the full capture; {"names": ["Malloc0"]}
    -> .names; {"name": ...} -> .old_name_param (-32603); any other names -> .unknown_bdev (-19)."""
    if method == "bdev_get_iostat":
        if not params:
            return "live/bdev_get_iostat.json"
        if "name" in params:
            return "live/bdev_get_iostat.old_name_param.json"
        if params.get("names") == ["Malloc0"]:
            return "live/bdev_get_iostat.names.json"
        return "live/bdev_get_iostat.unknown_bdev.json"
    if method == "bdev_get_histogram":
        return (
            "live/bdev_get_histogram.json"
            if params == {"name": "Malloc0"}
            else "live/bdev_get_iostat.unknown_bdev.json"
        )
    if method in LIVE_METHODS:
        return f"live/{method}.json"
    return "live/error.method_not_found.json"


def doc_target(method: str, params: Any) -> Answer:
    """SPDK's doc examples, as an old target (spdk_get_version says 19.04-pre). Before v26.01 bdev_get_iostat took a
    single "name": DERIVED answers filter the doc example to that bdev, and "names" is refused the way the live
    target refuses "name" (-32603 "spdk_json_decode_object failed")."""
    if method == "bdev_get_iostat" and params:
        if "name" not in params:
            return {"error": capture("live/bdev_get_iostat.old_name_param.json")["error"]}
        result = capture("bdev_get_iostat.json")["result"]
        bdevs = [b for b in result["bdevs"] if b["name"] == params["name"]]
        if not bdevs:
            return "live/bdev_get_iostat.unknown_bdev.json"
        return {"result": {**result, "bdevs": bdevs}}
    if method in DOC_METHODS:
        return f"{method}.json"
    return "live/error.method_not_found.json"


def sequence(target: Callable[[str, Any], Answer], iostat: list[str]) -> Callable[[str, Any], Answer]:
    """`target`, but unparameterized bdev_get_iostat answers with `iostat` in turn (the last one repeats)."""
    queue = list(iostat)

    def answer(method: str, params: Any) -> Answer:
        if method == "bdev_get_iostat" and not params:
            return queue.pop(0) if len(queue) > 1 else queue[0]
        return target(method, params)

    return answer


def replacing(target: Callable[[str, Any], Answer], **answers: Answer) -> Callable[[str, Any], Answer]:
    return lambda method, params: answers.get(method, target(method, params))


@pytest.fixture
def peer_factory(tmp_path):
    peers: list[SpdkPeer] = []

    def make(answer=live_target, tcp: bool = False) -> SpdkPeer:
        peer = SpdkPeer(answer, None if tcp else tmp_path / f"spdk{len(peers)}.sock")
        peers.append(peer)
        return peer

    yield make
    for peer in peers:
        peer.close()


# -- helpers -------------------------------------------------------------------------------------------------------


def make_collector(peer: SpdkPeer | None = None, **extra) -> SpdkCollector:
    target = {"name": "spdk-a", "source": "spdk", **extra}
    if peer is not None and "socket" not in extra and "address" not in extra:
        target["socket"] = peer.listener.getsockname()
    config = parse_config({"targets": [target]}).targets[0]
    return SpdkCollector(config)


def scrapes(collector: SpdkCollector, count: int = 1, between: Callable[[int], None] | None = None) -> list:
    async def run():
        out = []
        try:
            for index in range(count):
                if between is not None and index:
                    between(index)
                out.append(await collector.collect())
        finally:
            await collector.close()
        return out

    return asyncio.run(run())


def value(samples: list[Sample], name: str, **labels: str) -> float:
    found = [s for s in samples if s.name == name and all(s.label_map.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0].value


def named(samples: list[Sample], name: str) -> list[Sample]:
    return [s for s in samples if s.name == name]


def errors(samples: list[Sample]) -> dict[tuple[str, str, str], float]:
    found = named(samples, "spdk_rpc_errors")
    return {(s.label_map["method"], s.label_map["code"], s.label_map["message"]): s.value for s in found}


def approx(x: float):
    return pytest.approx(x, rel=1e-12)


# -- the live target -----------------------------------------------------------------------------------------------


def test_the_collector_is_found_by_its_source():
    assert collectors()["spdk"] is SpdkCollector


def test_live_iostat_every_field_with_latency_in_seconds(peer_factory):
    (raw,) = scrapes(make_collector(peer_factory(), labels={"role": "nof"}))
    assert all(s.source == "spdk" and not s.normalized for s in raw)
    m0 = {"bdev": "Malloc0", "subsystem": NQN, "role": "nof"}
    assert value(raw, "spdk_bdev_bytes_read", **m0) == 2227339264
    assert value(raw, "spdk_bdev_num_read_ops", **m0) == 543777
    assert value(raw, "spdk_bdev_bytes_written", **m0) == 951566336
    assert value(raw, "spdk_bdev_num_write_ops", **m0) == 232316
    # read_latency_ticks 14478332463 / tick_rate 2450000000 = 5.909523454285714 s
    assert value(raw, "spdk_bdev_read_latency_seconds", **m0) == approx(5.909523454285714)
    # write 6273910350 / 2.45e9 = 2.5607797346938774 s; max read 10184160 / 2.45e9 = 4.1568 ms; min 2352 -> 0.96 us
    assert value(raw, "spdk_bdev_write_latency_seconds", **m0) == approx(2.5607797346938774)
    assert value(raw, "spdk_bdev_max_read_latency_seconds", **m0) == approx(0.0041568)
    assert value(raw, "spdk_bdev_min_read_latency_seconds", **m0) == approx(9.6e-07)
    # qd sampling (period 10) fields appear for Malloc0 only, as SPDK reports them
    assert value(raw, "spdk_bdev_queue_depth", **m0) == 5
    assert value(raw, "spdk_bdev_io_time", **m0) == 1494270
    assert value(raw, "spdk_bdev_weighted_io_time", **m0) == 7755170
    assert value(raw, "spdk_bdev_iostat_tick_rate", **m0) == TICK_RATE
    assert value(raw, "spdk_bdev_iostat_ticks", **m0) == 4409687276247
    assert not named(raw, "spdk_bdev_queue_depth")[1:]
    # Malloc1 (base of lvs0) is exported by no subsystem; lvstore creation unmapped it once:
    # unmap_latency_ticks 451506702 / 2.45e9 = 0.18428844979591838 s
    m1 = {"bdev": "Malloc1", "subsystem": "", "role": "nof"}
    assert value(raw, "spdk_bdev_bytes_unmapped", **m1) == 134070272
    assert value(raw, "spdk_bdev_num_unmap_ops", **m1) == 1
    assert value(raw, "spdk_bdev_unmap_latency_seconds", **m1) == approx(0.18428844979591838)
    assert value(raw, "spdk_bdev_bytes_read", bdev=LVOL, subsystem=NQN) == 1750532096

    # Every numeric field of every bdev in the capture is a raw sample (ticks renamed to seconds).
    for entry in capture("live/bdev_get_iostat.json")["result"]["bdevs"]:
        for key, number in entry.items():
            if key in ("name", "io_error"):
                continue
            name = f"spdk_bdev_{key.removesuffix('_ticks')}_seconds" if key.endswith("_ticks") else f"spdk_bdev_{key}"
            expected = number / TICK_RATE if key.endswith("_ticks") else number
            assert value(raw, name, bdev=entry["name"]) == approx(expected), (entry["name"], key)
    kinds = {s.name: s.kind for s in raw}
    assert kinds["spdk_bdev_bytes_read"] == kinds["spdk_bdev_read_latency_seconds"] == "counter"
    assert kinds["spdk_bdev_max_read_latency_seconds"] == kinds["spdk_bdev_queue_depth"] == "gauge"
    assert errors(raw) == {}
    assert not [s for s in raw if s.name.endswith("_per_second")]  # one answer: no window yet
    assert value(raw, "spdk_version_info", version="SPDK v26.09-pre", major="26", minor="9") == 1


def test_live_capacity_lvstore_poll_groups_threads_reactors(peer_factory):
    (raw,) = scrapes(make_collector(peer_factory()))
    # capacity = block_size x num_blocks: Malloc0 4096 x 16384 = 67108864 (64 MiB), Malloc1 4096 x 32768 =
    # 134217728, lvol0 4096 x 8192 = 33554432 (32 MiB)
    assert value(raw, "spdk_bdev_capacity_bytes", bdev="Malloc0", subsystem=NQN) == 67108864
    assert value(raw, "spdk_bdev_capacity_bytes", bdev="Malloc1", subsystem="") == 134217728
    assert value(raw, "spdk_bdev_capacity_bytes", bdev=LVOL) == 33554432
    assert value(raw, "spdk_bdev_info", bdev=LVOL, aliases="lvs0/lvol0", product_name="Logical Volume") == 1
    # lvs0: allocated = (total_data_clusters 31 - free_clusters 23) x cluster_size 4194304 = 8 x 4 MiB = 33554432
    # (the thick 32 MiB lvol0); capacity 31 x 4194304 = 130023424; free 23 x 4194304 = 96468992
    lvs = {"lvstore": "lvs0", "uuid": "978017c3-c4be-420d-936e-9f062bddd801", "base_bdev": "Malloc1"}
    assert value(raw, "spdk_lvstore_allocated_bytes", **lvs) == 33554432
    assert value(raw, "spdk_lvstore_capacity_bytes", **lvs) == 130023424
    assert value(raw, "spdk_lvstore_free_bytes", **lvs) == 96468992
    assert value(raw, "spdk_lvstore_free_clusters", **lvs) == 23
    # nvmf_get_stats: one poll group; its TCP transport carries no stats, only its name
    group = {"poll_group": "nvmf_tgt_poll_group_000"}
    assert value(raw, "spdk_nvmf_poll_group_completed_nvme_io", **group) == 1390076
    assert value(raw, "spdk_nvmf_poll_group_io_qpairs", **group) == 4
    assert value(raw, "spdk_nvmf_poll_group_current_io_qpairs", **group) == 2
    assert value(raw, "spdk_nvmf_poll_group_transport", trtype="TCP", **group) == 1
    kinds = {s.name: s.kind for s in raw}
    assert kinds["spdk_nvmf_poll_group_completed_nvme_io"] == "counter"
    assert kinds["spdk_nvmf_poll_group_current_io_qpairs"] == "gauge"
    # thread_get_stats, ticks / 2.45e9: app_thread busy 3109110400 -> 1.2690246530612246 s, idle 30050617531 ->
    # 12.265558175918367 s; the poll group thread busy 21549736781 -> 8.795810931020409 s
    assert value(raw, "spdk_thread_busy_seconds", thread="app_thread", id="1") == approx(1.2690246530612246)
    assert value(raw, "spdk_thread_idle_seconds", thread="app_thread") == approx(12.265558175918367)
    assert value(raw, "spdk_thread_busy_seconds", thread="nvmf_tgt_poll_group_000") == approx(8.795810931020409)
    assert value(raw, "spdk_thread_active_pollers_count", thread="nvmf_tgt_poll_group_000") == 3
    # framework_get_reactors: busy 24639920196 -> 10.057110284081633 s, idle 58028910781 -> 23.68526970653061 s
    assert value(raw, "spdk_reactor_busy_seconds", lcore="0") == approx(10.057110284081633)
    assert value(raw, "spdk_reactor_idle_seconds", lcore="0") == approx(23.68526970653061)
    assert value(raw, "spdk_reactor_usr", lcore="0") == 2705
    assert value(raw, "spdk_reactor_in_interrupt", lcore="0") == 0
    # lw_thread elapsed 82669022273 / 2.45e9 = 33.742458070612244 s
    assert value(raw, "spdk_reactor_thread_elapsed_seconds", thread="app_thread") == approx(33.742458070612244)


def test_live_subsystem_io_joins_namespaces_to_iostat(peer_factory):
    (raw,) = scrapes(make_collector(peer_factory()))
    sub = {"subsystem": NQN}
    # kvcache1 exports ns1 = Malloc0 (by bdev_name) and ns2 = the lvol (its bdev name is its UUID)
    assert value(raw, "spdk_nvmf_subsystem_namespace", nsid="1", bdev="Malloc0", **sub) == 1
    assert value(raw, "spdk_nvmf_subsystem_namespace", nsid="2", bdev=LVOL, **sub) == 1
    assert value(raw, "spdk_nvmf_subsystem_namespaces", **sub) == 2
    assert value(raw, "spdk_nvmf_subsystem_namespaces_unresolved", **sub) == 0
    # sums over the namespaces: bytes_read 2227339264 + 1750532096 = 3977871360; reads 543777 + 427369 = 971146;
    # read latency (14478332463 + 13967450783) / 2.45e9 = 28445783246 / 2.45e9 = 11.610523773877551 s
    assert value(raw, "spdk_nvmf_subsystem_bytes_read", **sub) == 3977871360
    assert value(raw, "spdk_nvmf_subsystem_num_read_ops", **sub) == 971146
    assert value(raw, "spdk_nvmf_subsystem_read_latency_seconds", **sub) == approx(11.610523773877551)
    # writes 951566336 + 752439296 = 1704005632 B
    assert value(raw, "spdk_nvmf_subsystem_bytes_written", **sub) == 1704005632
    assert not [s for s in raw if s.label_map.get("subsystem", "").endswith("discovery")]


def test_live_mapping_onto_the_kv_tier_model(peer_factory):
    extra = {"labels": {"role": "nof"}, "role_by_bdev": {"lvs0/lvol0": "nof-lvol", "Malloc1": "nof-base"}}
    collector = make_collector(peer_factory(), **extra)
    (raw,) = scrapes(collector)
    normalized = mapping_for("spdk").apply(raw, collector.config.labels)
    got = {(s.name, tuple(sorted(s.label_map.items()))): s.value for s in normalized}
    assert all(s.normalized and s.source == "spdk" for s in normalized)
    tier = {k: v for k, v in got.items() if k[0].startswith("kv.tier.")}
    # the NoF tier's occupancy, from the lvstores (the target's role names the tier); media bytes per tier, each
    # bdev under the tier its role names (Malloc0, exported and named by none, under the target's)
    nof, lvol, base = ((("system", ""), ("tier", name)) for name in ("nof", "nof-lvol", "nof-base"))
    assert tier == {
        ("kv.tier.allocated.bytes", nof): sum(s.value for s in raw if s.name == "spdk_lvstore_allocated_bytes"),
        ("kv.tier.capacity.bytes", nof): sum(s.value for s in raw if s.name == "spdk_lvstore_capacity_bytes"),
        ("kv.tier.written.bytes", nof): 951566336,
        ("kv.tier.read.bytes", nof): 2227339264,
        ("kv.tier.written.bytes", lvol): value(raw, "spdk_bdev_bytes_written", bdev=LVOL),
        ("kv.tier.read.bytes", lvol): 1750532096,
        ("kv.tier.written.bytes", base): 752467968,
        ("kv.tier.read.bytes", base): value(raw, "spdk_bdev_bytes_read", bdev="Malloc1"),
    }
    assert tier[("kv.tier.allocated.bytes", nof)] > 0
    # the reactor of lcore 0, its busy and idle ticks in seconds (as test_live_capacity_... reads them raw); the
    # role is the target's, role_by_bdev names bdevs only
    reactor = {k: v for k, v in got.items() if k[0].startswith("storage.reactor.")}
    lcore0 = (("lcore", "0"), ("role", "nof"))
    assert reactor == {
        ("storage.reactor.busy", lcore0): approx(24639920196 / TICK_RATE),  # 10.057110284081633 s
        ("storage.reactor.idle", lcore0): approx(58028910781 / TICK_RATE),  # 23.68526970653061 s
    }
    assert reactor[("storage.reactor.busy", lcore0)] == value(raw, "spdk_reactor_busy_seconds", lcore="0")
    assert reactor[("storage.reactor.idle", lcore0)] == value(raw, "spdk_reactor_idle_seconds", lcore="0")
    assert {s.kind for s in normalized if s.name.startswith("storage.reactor.")} == {"counter"}
    got = {k: v for k, v in got.items() if k not in tier and k not in reactor}
    assert len(got) == 3 * 10  # 3 bdevs x (read + written bytes, 4 ops, 4 latencies): each bdev exactly once

    def key(name: str, bdev: str, subsystem: str, role: str, op: str | None = None):
        labels = {"bdev": bdev, "subsystem": subsystem, "role": role, **({"op": op} if op else {})}
        return name, tuple(sorted(labels.items()))

    m0 = ("Malloc0", NQN, "nof")
    assert {k: v for k, v in got.items() if dict(k[1])["bdev"] == "Malloc0"} == {
        key("storage.bdev.read.bytes", *m0): 2227339264,
        key("storage.bdev.written.bytes", *m0): 951566336,
        key("storage.bdev.ops", *m0, "read"): 543777,
        key("storage.bdev.ops", *m0, "write"): 232316,
        key("storage.bdev.ops", *m0, "unmap"): 0,
        key("storage.bdev.ops", *m0, "copy"): 0,
        key("storage.bdev.latency", *m0, "read"): approx(5.909523454285714),
        key("storage.bdev.latency", *m0, "write"): approx(2.5607797346938774),
        key("storage.bdev.latency", *m0, "unmap"): 0,
        key("storage.bdev.latency", *m0, "copy"): 0,
    }
    # role_by_bdev by alias (lvs0/lvol0 -> the UUID-named lvol) and by name
    assert got[key("storage.bdev.read.bytes", LVOL, NQN, "nof-lvol")] == 1750532096
    assert got[key("storage.bdev.ops", "Malloc1", "", "nof-base", "unmap")] == 1
    # 451506702 / 2.45e9 = 0.18428844979591838 s
    assert got[key("storage.bdev.latency", "Malloc1", "", "nof-base", "unmap")] == approx(0.18428844979591838)
    # unmapped bytes are not written bytes: Malloc1 wrote 752467968 B, not + 134070272
    assert got[key("storage.bdev.written.bytes", "Malloc1", "", "nof-base")] == 752467968
    # per subsystem = sum by subsystem of the model series = the raw per-subsystem sum (no double count)
    by_subsystem = sum(
        v for (name, labels), v in got.items() if name == "storage.bdev.read.bytes" and dict(labels)["subsystem"] == NQN
    )
    assert by_subsystem == value(raw, "spdk_nvmf_subsystem_bytes_read", subsystem=NQN) == 3977871360


@pytest.mark.parametrize(
    ("extra", "tiers"),
    [
        # the exported bdevs (Malloc0 and the lvol) back the target's tier; the lvstore's base Malloc1, which no
        # client addresses, backs none: its bytes are the lvol's again
        ({"labels": {"role": "nof"}}, {"nof": ("Malloc0", LVOL)}),
        # a subsystem's role names the tier of the bdevs it exports, a bdev's own role wins over it
        (
            {"role_by_subsystem": {NQN: "nof"}, "role_by_bdev": {"Malloc0": "scratch"}},
            {"nof": (LVOL,), "scratch": ("Malloc0",)},
        ),
        # no role anywhere: no tier (the bdevs' bytes stay storage.bdev.*)
        ({}, {}),
    ],
)
def test_the_nof_tiers_media_bytes_are_the_bdevs_its_role_names_each_counted_once(peer_factory, extra, tiers):
    collector = make_collector(peer_factory(), **extra)
    (raw,) = scrapes(collector)
    normalized = mapping_for("spdk").apply(raw, collector.config.labels)
    for direction in ("written", "read"):
        got = {s.label_map["tier"]: s.value for s in normalized if s.name == f"kv.tier.{direction}.bytes"}
        expected = {
            tier: sum(value(raw, f"spdk_bdev_bytes_{direction}", bdev=bdev) for bdev in bdevs)
            for tier, bdevs in tiers.items()
        }
        assert got == expected and all(got.values()) if tiers else got == {}


def test_an_lvstores_role_names_the_tier_of_its_allocation(peer_factory):
    """role_by_lvstore by name or UUID; without one, the target's role; without either, no tier."""
    for extra, tier in [
        ({"labels": {"role": "nof"}, "role_by_lvstore": {"lvs0": "nof-pool"}}, "nof-pool"),
        ({"role_by_lvstore": {"978017c3-c4be-420d-936e-9f062bddd801": "nof"}}, "nof"),
        ({"labels": {"role": "nof"}}, "nof"),
    ]:
        collector = make_collector(peer_factory(), **extra)
        (raw,) = scrapes(collector)
        normalized = mapping_for("spdk").apply(raw, collector.config.labels)
        allocated = {s.label_map["tier"]: s.value for s in normalized if s.name == "kv.tier.allocated.bytes"}
        assert allocated == {tier: 8 * 4194304}  # 31 - 23 free clusters of 4 MiB
    (raw,) = scrapes(make_collector(peer_factory()))
    assert not [s for s in mapping_for("spdk").apply(raw, {}) if s.name.startswith("kv.tier.")]


def test_promtool_accepts_the_exported_reactors(peer_factory, check_metrics):
    target = {"name": "spdk-a", "source": "spdk", "socket": peer_factory().listener.getsockname()}
    text = served_exposition(
        parse_config({"exporter": {"listen_port": 0}, "targets": [{**target, "labels": {"role": "nof"}}]})
    )
    assert "\nstorage_reactor_busy_seconds_total{" in text and "\nstorage_reactor_idle_seconds_total{" in text
    check_metrics(text)


def test_rates_are_windowed_on_the_answers_own_ticks(peer_factory):
    peer = peer_factory(
        sequence(
            live_target,
            [
                "live/bdev_get_iostat.json",
                "live/bdev_get_iostat.names.json",  # 9739608 ticks later, Malloc0 only
                "live/bdev_get_iostat.names.json",  # the same ticks again: no window
                "live/bdev_get_iostat.json",  # ticks back (a reset or another target): no window
            ],
        )
    )
    # 0.3 s of wall clock pass between scrapes; a wall-clock rate would be ~780 reads/s, not ~58.6k
    first, second, third, fourth = scrapes(make_collector(peer), 4, between=lambda _: time.sleep(0.3))
    assert not [s for s in first if s.name.endswith("_per_second")]
    m0 = {"bdev": "Malloc0"}
    # window = (4409697015855 - 4409687276247) / 2.45e9 = 9739608 / 2.45e9 = 0.0039753502040816326 s
    assert value(second, "spdk_bdev_iostat_window_seconds", **m0) == approx(0.0039753502040816326)
    # reads 544010 - 543777 = 233 -> 233 / 0.0039753502040816326 = 58611.188458508805 /s
    assert value(second, "spdk_bdev_num_read_ops_per_second", **m0) == approx(58611.188458508805)
    # bytes read 2228293632 - 2227339264 = 954368 (= 233 x 4096) -> 240071427.92605206 B/s
    assert value(second, "spdk_bdev_bytes_read_per_second", **m0) == approx(240071427.92605206)
    # writes 232420 - 232316 = 104 -> 26161.21716602968 /s; bytes 951992320 - 951566336 = 425984 -> 107156345.51 B/s
    assert value(second, "spdk_bdev_num_write_ops_per_second", **m0) == approx(26161.21716602968)
    assert value(second, "spdk_bdev_bytes_written_per_second", **m0) == approx(107156345.51205757)
    assert value(second, "spdk_bdev_num_unmap_ops_per_second", **m0) == 0
    assert {s.label_map["bdev"] for s in second if s.name.endswith("_per_second")} == {"Malloc0"}
    assert not [s for s in third if s.name.endswith("_per_second") or s.name.endswith("_window_seconds")]
    assert not [s for s in fourth if s.name.endswith("_per_second") or s.name.endswith("_window_seconds")]


def test_histogram_cumulative_by_range_in_seconds(peer_factory):
    peer = peer_factory()
    (raw,) = scrapes(make_collector(peer, bdevs=["Malloc0"], histograms=True))
    assert ("bdev_get_histogram", {"name": "Malloc0"}) in peer.requests
    # The capture: granularity 7, ranges 5..28, 24 x 128 = 3072 little-endian uint64 buckets, tsc_rate 2.45e9.
    # Range r ends at 2^(r+7) ticks. Per-range counts: r6 106, r7 2072, r8 2835, r9 1341, r10 457, r11 48, r12 3,
    # r13 59, r14 18, r16 3; total 6942. The last range (28) also holds everything above: +Inf.
    hist = capture("live/bdev_get_histogram.json")["result"]
    counts = struct.unpack("<3072Q", base64.b64decode(hist["histogram"]))
    assert sum(counts) == 6942
    bucket = {s.label_map["le"]: s.value for s in named(raw, "spdk_bdev_histogram_bucket")}
    assert len(bucket) == 24
    assert bucket[repr(2**12 / TICK_RATE)] == 0  # range 5 ends at 4096 ticks = 1.67 us
    assert bucket[repr(2**13 / TICK_RATE)] == 106  # 8192 ticks = 3.3436734693877552e-06 s
    assert bucket[repr(2**14 / TICK_RATE)] == 106 + 2072  # 6.687 us
    assert bucket[repr(2**15 / TICK_RATE)] == 2178 + 2835  # 13.37 us: 5013
    assert bucket[repr(2**20 / TICK_RATE)] == 6921  # 0.428 ms
    assert bucket[repr(2**22 / TICK_RATE)] == 6939  # 1.71 ms: range 15 is empty
    assert bucket[repr(2**23 / TICK_RATE)] == 6942  # 3.42 ms
    assert bucket["+Inf"] == 6942
    assert value(raw, "spdk_bdev_histogram_count", bdev="Malloc0", subsystem=NQN) == 6942


# -- versions and parameters ---------------------------------------------------------------------------------------


def test_v26_target_is_asked_names_never_the_removed_name(peer_factory):
    peer = peer_factory()
    (raw,) = scrapes(make_collector(peer, bdevs=["Malloc0"]))
    iostat = [params for method, params in peer.requests if method == "bdev_get_iostat"]
    assert iostat == [{"names": ["Malloc0"]}]
    documented = capture("bdev_get_iostat.request.json")["params"]  # the doc's own request: names, per_channel
    assert set(iostat[0]) <= set(documented)
    assert value(raw, "spdk_bdev_bytes_read", bdev="Malloc0") == 2228293632  # the .names capture
    assert {s.label_map["bdev"] for s in named(raw, "spdk_bdev_bytes_read")} == {"Malloc0"}
    assert errors(raw) == {}
    # the subsystem's lvol namespace has no iostat in this scrape: its sums are withheld, not partial
    assert value(raw, "spdk_nvmf_subsystem_namespaces_unresolved", subsystem=NQN) == 1
    assert not named(raw, "spdk_nvmf_subsystem_bytes_read")


def test_old_target_is_asked_name_per_bdev(peer_factory):
    peer = peer_factory(doc_target)
    (raw,) = scrapes(make_collector(peer, bdevs=["Nvme0n1", "Nvme0n2"]))
    iostat = [params for method, params in peer.requests if method == "bdev_get_iostat"]
    assert iostat == [{"name": "Nvme0n1"}, {"name": "Nvme0n2"}]  # 19.04-pre: before "names" (v26.01)
    # read_latency_ticks 178904 / tick_rate 2200000000 = 8.132e-05 s
    assert value(raw, "spdk_bdev_read_latency_seconds", bdev="Nvme0n2") == approx(8.132e-05)
    assert errors(raw) == {}


def test_a_bdev_asked_twice_is_counted_once(peer_factory):
    peer = peer_factory(doc_target)
    (raw,) = scrapes(make_collector(peer, bdevs=["Nvme0n1", "Nvme0n1"]))
    assert [p for m, p in peer.requests if m == "bdev_get_iostat"] == [{"name": "Nvme0n1"}] * 2
    assert value(raw, "spdk_bdev_bytes_read", bdev="Nvme0n1") == 36864  # one sample, not two summed


def test_unknown_version_tries_names_then_name_and_remembers(peer_factory):
    target = replacing(doc_target, spdk_get_version="live/error.method_not_found.json")
    peer = peer_factory(target)
    first, second = scrapes(make_collector(peer, bdevs=["Nvme0n1"]), 2)
    iostat = [params for method, params in peer.requests if method == "bdev_get_iostat"]
    assert iostat == [{"names": ["Nvme0n1"]}, {"name": "Nvme0n1"}, {"name": "Nvme0n1"}]
    assert value(second, "spdk_bdev_bytes_read", bdev="Nvme0n1") == 36864
    # the refused probe is not an error; the missing method is, in every scrape
    for raw in (first, second):
        assert errors(raw) == {("spdk_get_version", "-32601", "Method not found"): 1}
    assert peer.methods().count("spdk_get_version") == 1  # once per connection


def test_an_unknown_bdev_is_reported_and_the_others_still_read(peer_factory):
    peer = peer_factory()
    (raw,) = scrapes(make_collector(peer, bdevs=["Malloc0", "Nope"]))
    iostat = [params for method, params in peer.requests if method == "bdev_get_iostat"]
    assert iostat == [{"names": ["Malloc0", "Nope"]}, {"names": ["Malloc0"]}, {"names": ["Nope"]}]
    assert value(raw, "spdk_bdev_num_read_ops", bdev="Malloc0") == 544010
    assert errors(raw) == {("bdev_get_iostat", "-19", "Nope: No such device"): 1}


def test_methods_an_older_target_lacks_are_skipped_and_counted(peer_factory):
    missing = "live/error.method_not_found.json"
    target = replacing(live_target, framework_get_reactors=missing, thread_get_stats=missing)
    collector = make_collector(peer_factory(target))
    (raw,) = scrapes(collector)
    assert errors(raw) == {
        ("framework_get_reactors", "-32601", "Method not found"): 1,
        ("thread_get_stats", "-32601", "Method not found"): 1,
    }
    assert not [s for s in raw if s.name.startswith(("spdk_reactor_", "spdk_thread_"))]
    normalized = mapping_for("spdk").apply(raw, collector.config.labels)
    assert not [s for s in normalized if s.name.startswith("storage.reactor.")]  # no reactors, no reactor series
    assert value(raw, "spdk_bdev_bytes_read", bdev="Malloc0") == 2227339264
    assert value(raw, "spdk_lvstore_allocated_bytes", lvstore="lvs0") == 33554432


def test_doc_examples_older_shapes(peer_factory):
    first, second = scrapes(make_collector(peer_factory(doc_target), labels={"role": "nof"}), 2)
    # No top-level ticks in the doc's iostat: no rate, ever (and none from the wall clock).
    assert not [s for s in second if s.name.endswith(("_per_second", "_window_seconds", "iostat_ticks"))]
    # cnode1 exports Malloc2 (no such bdev in bdev_get_bdevs or iostat) and Nvme0n1 (matched by name)
    cnode1 = "nqn.2016-06.io.spdk:cnode1"
    assert value(first, "spdk_bdev_bytes_read", bdev="Nvme0n1", subsystem=cnode1, role="nof") == 36864
    assert value(first, "spdk_bdev_bytes_read", bdev="Nvme0n2", subsystem="") == 36864
    assert value(first, "spdk_nvmf_subsystem_namespace", subsystem=cnode1, nsid="1", bdev="", ref="Malloc2") == 1
    assert value(first, "spdk_nvmf_subsystem_namespaces_unresolved", subsystem=cnode1) == 1
    assert not named(first, "spdk_nvmf_subsystem_bytes_read")  # a sum missing Malloc2 would be wrong
    assert value(first, "spdk_bdev_capacity_bytes", bdev="Malloc0") == 512 * 20480  # 10485760
    # RDMA device stats: request_latency 1249323766184 ticks / 2.4e9 = 520.5515692433333 s
    dev = {"poll_group": "app_thread", "trtype": "RDMA", "device": "mlx5_0"}
    assert value(first, "spdk_nvmf_transport_device_request_latency_seconds", **dev) == approx(520.5515692433333)
    assert value(first, "spdk_nvmf_transport_device_completions", **dev) == 15165875
    assert value(first, "spdk_nvmf_transport_device_pending_rdma_read", **dev) == 337602
    assert value(first, "spdk_nvmf_transport_pending_data_buffer", poll_group="app_thread") == 12131888
    assert value(first, "spdk_nvmf_poll_group_pending_bdev_io", poll_group="app_thread") == 1721
    # the doc's lvstore is empty: (31 - 31) x 4194304 = 0 allocated
    assert value(first, "spdk_lvstore_allocated_bytes", lvstore="LVS0") == 0
    # reactor busy 41289723495 / 2.4e9 = 17.20405145625 s; thread busy 139223208 / 2.4e9 = 0.05800967 s
    assert value(first, "spdk_reactor_busy_seconds", lcore="0") == approx(17.20405145625)
    assert value(first, "spdk_thread_busy_seconds", thread="app_thread") == approx(0.05800967)
    assert value(first, "spdk_version_info", version="19.04-pre") == 1
    assert errors(first) == {}
    # the reactor on the model: busy as above; idle 3624832946 / 2.4e9 = 1.5103470608333334 s
    normalized = mapping_for("spdk").apply(first, {"role": "nof"})
    reactor = {
        (s.name, s.label_map["lcore"], s.label_map["role"]): s.value for s in normalized if "lcore" in s.label_map
    }
    assert reactor == {
        ("storage.reactor.busy", "0", "nof"): approx(17.20405145625),
        ("storage.reactor.idle", "0", "nof"): approx(1.5103470608333334),
    }


def test_subsystem_join_by_alias_and_uuid(peer_factory):
    # DERIVED from live/nvmf_get_subsystems.json: kvcache1's namespaces name their bdevs by alias and by UUID
    # (upper case), the way older targets wrote them ("name" only); a second subsystem's namespace names no bdev
    # but carries Malloc1's UUID, and another names a bdev that does not exist.
    result = capture("live/nvmf_get_subsystems.json")["result"]
    kvcache1 = {**result[1], "namespaces": [{"nsid": 1, "name": "F1FE21C1-C7FD-48B5-A6CA-90495D5B57AF"}]}
    kvcache1["namespaces"].append({"nsid": 2, "name": "lvs0/lvol0"})
    partial = {
        "nqn": "nqn.2016-06.io.spdk:partial",
        "subtype": "NVMe",
        "namespaces": [
            {"nsid": 1, "bdev_name": "gone", "uuid": "c63f7906-8a9b-4a37-87e7-6b30cb0016cf"},
            {"nsid": 2, "bdev_name": "Malloc9"},
        ],
    }
    target = replacing(live_target, nvmf_get_subsystems={"result": [result[0], kvcache1, partial]})
    (raw,) = scrapes(make_collector(peer_factory(target)))
    assert value(raw, "spdk_nvmf_subsystem_namespace", subsystem=NQN, nsid="1", bdev="Malloc0") == 1
    assert value(raw, "spdk_nvmf_subsystem_namespace", subsystem=NQN, nsid="2", bdev=LVOL, ref="lvs0/lvol0") == 1
    assert value(raw, "spdk_nvmf_subsystem_bytes_read", subsystem=NQN) == 2227339264 + 1750532096
    assert value(raw, "spdk_bdev_bytes_read", bdev="Malloc1", subsystem="nqn.2016-06.io.spdk:partial") == 1750597632
    assert value(raw, "spdk_nvmf_subsystem_namespaces_unresolved", subsystem="nqn.2016-06.io.spdk:partial") == 1
    assert not named(raw, "spdk_nvmf_subsystem_bytes_read")[1:]  # only kvcache1 has a complete sum


def test_subsystem_membership_survives_a_failed_nvmf_get_subsystems(peer_factory):
    calls = {"n": 0}

    def target(method: str, params: Any) -> Answer:
        if method == "nvmf_get_subsystems":
            calls["n"] += 1
            if calls["n"] == 2:
                return "live/error.method_not_found.json"
        return live_target(method, params)

    first, second = scrapes(make_collector(peer_factory(target)), 2)
    for raw in (first, second):
        assert value(raw, "spdk_bdev_bytes_read", bdev="Malloc0", subsystem=NQN) == 2227339264
    assert errors(second) == {("nvmf_get_subsystems", "-32601", "Method not found"): 1}


# -- the connection ------------------------------------------------------------------------------------------------


def test_one_connection_reused_and_reopened_after_a_restart(peer_factory):
    peer = peer_factory()
    collector = make_collector(peer)

    def between(index: int) -> None:
        if index == 3:
            peer.hang_up_all()  # the target restarted: the kept connection is dead
            time.sleep(0.05)

    results = scrapes(collector, 5, between=between)
    assert all(value(raw, "spdk_bdev_bytes_read", bdev="Malloc0") == 2227339264 for raw in results)
    assert peer.connections == 2
    assert peer.methods().count("spdk_get_version") == 2  # asked once per connection
    assert peer.methods().count("bdev_get_iostat") == 5


def test_tcp_target(peer_factory):
    peer = peer_factory(tcp=True)
    (raw,) = scrapes(make_collector(address="localhost", port=peer.port))
    assert value(raw, "spdk_bdev_bytes_read", bdev="Malloc0") == 2227339264
    assert peer.connections == 1


def test_missing_socket_names_the_target(tmp_path):
    path = tmp_path / "nothing.sock"
    with pytest.raises(CollectError, match=re.escape(f"spdk-a (unix:{path}): cannot connect")):
        scrapes(make_collector(socket=str(path)))


def test_dead_socket_names_the_target(peer_factory):
    peer = peer_factory()
    path = peer.listener.getsockname()
    peer.close()  # the socket file stays, nothing listens: connection refused
    with pytest.raises(CollectError, match=re.escape(f"spdk-a (unix:{path}): cannot connect")):
        scrapes(make_collector(socket=path))


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("garbage", r"spdk-a \(unix:.*\): spdk_get_version: Timeout while waiting for response: this is not"),
        ("garbage_close", r"spdk-a \(unix:.*\): spdk_get_version: Connection closed with partial response: <html>"),
        ("not_jsonrpc", r"spdk-a \(unix:.*\): spdk_get_version: not a JSON-RPC answer to request 1: \[1, 2, 3\]"),
        ("wrong_id", r"spdk-a \(unix:.*\): spdk_get_version: not a JSON-RPC answer to request 1: "),
    ],
)
def test_garbage_replies_raise_collect_error_naming_the_target(peer_factory, mode, message):
    peer = peer_factory()
    peer.mode = mode
    started = time.monotonic()
    with pytest.raises(CollectError, match=message):
        scrapes(make_collector(peer, timeout_s=0.5))
    assert time.monotonic() - started < 1.5  # bounded by the timeout (slack for a loaded CI machine)


@pytest.mark.parametrize("mode", ["slow", "trickle"])
def test_a_slow_reply_fails_within_the_timeout_and_the_next_scrape_reconnects(peer_factory, mode):
    peer = peer_factory()
    collector = make_collector(peer, timeout_s=0.5)

    async def run():
        try:
            await collector.collect()  # the first connection is healthy
            peer.mode, peer.delay_s = mode, 2.0
            started = time.monotonic()
            with pytest.raises(CollectError, match=r"^spdk-a \(unix:.*\): .*(Timeout|no complete answer within)"):
                await collector.collect()
            elapsed = time.monotonic() - started
            peer.mode = "answer"
            await asyncio.sleep(0.1)
            assert collector._worker is not None and collector._worker.done()  # the thread did not stay blocked
            return elapsed, await collector.collect()
        finally:
            await collector.close()

    elapsed, raw = asyncio.run(run())
    # the collector's own timeout answered (the CollectError above), long before the 2 s reply; the slack over
    # timeout_s is for a loaded machine, not a tolerance of the design
    assert elapsed < 1.5
    assert value(raw, "spdk_bdev_bytes_read", bdev="Malloc0") == 2227339264
    assert peer.connections == 2


def test_the_clients_reads_wait_in_wall_time_not_cpu_time(peer_factory, monkeypatch):
    # spdk 26.9's JSONRPCClient.recv computes each wait as timeout - (time.process_time() - start): CPU time of
    # the whole process. Once that is negative, socket.settimeout raises ValueError, which its loop swallows and
    # retries without ever reading again. kvscope's client waits in wall time: with process CPU time running fast
    # (1 s per look at the clock) the scrape still reads every answer, well within its time.
    clock = itertools.count()
    monkeypatch.setattr(time, "process_time", lambda: float(next(clock)))
    collector = make_collector(peer_factory(), timeout_s=0.5)

    async def run():
        try:
            started = time.monotonic()
            raw = await collector.collect()
            return raw, time.monotonic() - started
        finally:
            await collector.close()

    raw, elapsed = asyncio.run(run())
    assert value(raw, "spdk_bdev_bytes_read", bdev="Malloc0") == 2227339264
    assert elapsed < 0.5


def test_the_scrape_loop_runs_it(peer_factory):
    peer = peer_factory()
    path = peer.listener.getsockname()
    config = parse_config(
        {"targets": [{"name": "spdk-a", "source": "spdk", "socket": path, "labels": {"role": "nof"}}]}
    )
    scraper = Scraper(config.targets)

    async def run():
        try:
            return await scraper.scrape("spdk-a")
        finally:
            await scraper.close()

    state = asyncio.run(run())
    assert state.up, state.last_error
    model = {(s.name, s.label_map.get("bdev"), s.label_map.get("op")): s.value for s in state.normalized}
    assert model[("storage.bdev.read.bytes", "Malloc0", None)] == 2227339264
    assert model[("storage.bdev.ops", LVOL, "write")] == 183701


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ({}, "set exactly one of socket"),
        ({"socket": "/tmp/a.sock", "address": "127.0.0.1"}, "set exactly one of socket"),
        ({"socket": "/tmp/a.sock", "bdevs": []}, "targets.0.bdevs"),
        ({"address": "127.0.0.1", "port": 0}, "targets.0.port"),
    ],
)
def test_bad_configs_are_named(target, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"targets": [{"name": "spdk-a", "source": "spdk", **target}]})


# -- answers SPDK would not write: read errors of their method, the rest exported ----------------------------------


def _result_of(path: str, edit: Callable[[Any], None]) -> dict:
    """DERIVED: the capture's result, changed by `edit` (in place)."""
    result = copy.deepcopy(capture(path)["result"])
    edit(result)
    return {"result": result}


def _iostat_field(bdev: str, key: str, new: Any) -> dict:
    def edit(result: dict) -> None:
        next(b for b in result["bdevs"] if b["name"] == bdev)[key] = new

    return _result_of("live/bdev_get_iostat.json", edit)


def _long_digits() -> bytes:
    """DERIVED bytes: the iostat capture with Malloc0's bytes_written written with 5000 digits (json.dumps and
    int() refuse more than 4300)."""
    raw = (FIXTURES / "live/bdev_get_iostat.json").read_bytes()
    assert raw.count(b'"bytes_written":951566336,') == 1  # Malloc0's
    return raw.replace(b'"bytes_written":951566336,', b'"bytes_written":' + b"9" * 5000 + b",")


def _without(path: str, key: str, pick: Callable[[Any], dict]) -> dict:
    return _result_of(path, lambda result: pick(result).pop(key))


def _served_series(text: str) -> dict[tuple[str, frozenset], float]:
    return {
        (s.name, frozenset((k, v) for k, v in s.labels.items() if not k.startswith("otel_scope"))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _one(found: dict[tuple[str, frozenset], float], name: str, **labels: str) -> list[float]:
    return [v for (n, ls), v in found.items() if n == name and set(labels.items()) <= ls]


def series_key(name: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return name, tuple(sorted(labels.items()))


M0_READ = series_key("storage_bdev_read_bytes_total", bdev="Malloc0")
M0_WRITTEN = series_key("storage_bdev_written_bytes_total", bdev="Malloc0")
LVOL_READ = series_key("storage_bdev_read_bytes_total", bdev=LVOL)
LVOL_WRITTEN = series_key("storage_bdev_written_bytes_total", bdev=LVOL)
TIER_READ = series_key("kv_tier_read_bytes_total", tier="nof")
TIER_WRITTEN = series_key("kv_tier_written_bytes_total", tier="nof")
TIER_ALLOCATED = series_key("kv_tier_allocated_bytes", tier="nof")
TIER_CAPACITY = series_key("kv_tier_capacity_bytes", tier="nof")
BUSY = series_key("storage_reactor_busy_seconds_total", lcore="0")
IDLE = series_key("storage_reactor_idle_seconds_total", lcore="0")
EXPORTED = {  # the live target's values (see the tests above); tier nof = Malloc0 + the lvol (what kvcache1 exports)
    M0_READ: 2227339264,
    M0_WRITTEN: 951566336,
    LVOL_READ: 1750532096,
    LVOL_WRITTEN: 752439296,
    TIER_READ: 3977871360,
    TIER_WRITTEN: 1704005632,
    TIER_ALLOCATED: 33554432,
    TIER_CAPACITY: 130023424,
    BUSY: approx(24639920196 / TICK_RATE),
    IDLE: approx(58028910781 / TICK_RATE),
}


@pytest.mark.parametrize(
    ("method", "answer", "reason", "absent"),
    [
        # a counter of the wrong type: its series is absent, and so is the tier's sum it is part of (not partial)
        ("bdev_get_iostat", _iostat_field("Malloc0", "bytes_read", "2227339264"), "unparseable", [M0_READ, TIER_READ]),
        ("bdev_get_iostat", _iostat_field(LVOL, "bytes_written", None), "unparseable", [LVOL_WRITTEN, TIER_WRITTEN]),
        # out of a uint64 counter's range: negative, 2^64, 5000 digits (which used to stall the client to the deadline)
        ("bdev_get_iostat", _iostat_field("Malloc0", "bytes_read", -1), "out_of_range", [M0_READ, TIER_READ]),
        ("bdev_get_iostat", _iostat_field(LVOL, "bytes_written", 2**64), "out_of_range", [LVOL_WRITTEN, TIER_WRITTEN]),
        ("bdev_get_iostat", _long_digits(), "out_of_range", [M0_WRITTEN, TIER_WRITTEN]),
        # a field SPDK always writes, missing
        (
            "framework_get_reactors",
            _without("live/framework_get_reactors.json", "busy", lambda result: result["reactors"][0]),
            "unparseable",
            [BUSY],
        ),
        (
            "bdev_lvol_get_lvstores",
            _without("live/bdev_lvol_get_lvstores.json", "free_clusters", lambda result: result[0]),
            "unparseable",
            [TIER_ALLOCATED, TIER_CAPACITY],
        ),
        # a result of the wrong shape (the reactors' list without its object)
        (
            "framework_get_reactors",
            {"result": capture("live/framework_get_reactors.json")["result"]["reactors"]},
            "unparseable",
            [BUSY, IDLE],
        ),
    ],
    ids=[
        "string",
        "null",
        "negative",
        "2^64",
        "5000-digits",
        "no-reactor-busy",
        "no-free-clusters",
        "reactors-not-an-object",
    ],
)
def test_a_bad_answer_is_a_read_error_of_its_method_and_the_rest_is_exported(
    peer_factory, caplog, method, answer, reason, absent
):
    """Captures mutated one way each, served through the scrape loop and the OpenTelemetry bridge: the series the
    bad value would have given are absent, the read error is counted with its reason and logged naming the RPC
    method, the target stays up and everything else is exported as the live target reports it."""
    peer = peer_factory(replacing(live_target, **{method: answer}))
    target = {"name": "spdk-a", "source": "spdk", "socket": peer.listener.getsockname(), "labels": {"role": "nof"}}
    with caplog.at_level(logging.WARNING, logger="kvscope.exporters.scrape"):
        text = served_exposition(parse_config({"exporter": {"listen_port": 0}, "targets": [target]}))
    found = _served_series(text)
    health = {"target": "spdk-a", "source": "spdk"}
    assert _one(found, "kvscope_target_up", **health) == [1]
    assert _one(found, "kvscope_scrape_errors_total", **health) == [0]
    errors_by_reason = {
        dict(ls)["reason"]: v for (n, ls), v in found.items() if n == "kvscope_source_read_errors_total"
    }
    assert errors_by_reason == {reason: 1}
    warnings = [r.getMessage() for r in caplog.records if r.name == "kvscope.exporters.scrape"]
    assert len(warnings) == 1 and warnings[0].startswith(f"spdk-a: {method}: ") and warnings[0].endswith(f"({reason})")
    for name, labels in absent:
        assert _one(found, name, **dict(labels)) == [], (name, labels)
    for (name, labels), expected in EXPORTED.items():
        if (name, labels) not in absent:
            assert _one(found, name, **dict(labels)) == [expected], (name, labels)


def test_the_parsers_read_the_captures_alone(peer_factory):
    """spdk_answers.samples on the live captures, no socket: exactly the samples the collector gives over the wire."""
    results = {method: loads((FIXTURES / f"live/{method}.json").read_bytes())["result"] for method in LIVE_METHODS}
    version = results.pop("spdk_get_version")
    answers = Answers(version=version, iostat=[capture("live/bdev_get_iostat.json")["result"]], results=results)
    parsed, read_errors = answer_samples(answers, Roles(default="nof"), Memory())
    assert read_errors == []
    (scraped,) = scrapes(make_collector(peer_factory(), labels={"role": "nof"}))
    assert sorted(parsed, key=repr) == sorted(scraped, key=repr)
    m0 = labels_of({"bdev": "Malloc0", "subsystem": NQN, "role": "nof", "tier": "nof"})
    assert [s.value for s in parsed if (s.name, s.labels) == ("spdk_bdev_bytes_read", m0)] == [2227339264]


def test_a_counter_written_with_more_digits_than_any_uint64_is_never_given_to_int():
    assert U64_DIGITS == 20
    top = b'{"tick_rate":2450000000,"ticks":1,"bdevs":[{"name":"Malloc0","bytes_read":%s,"num_read_ops":%s}]}'
    for digits, expected in [
        (b"18446744073709551615", ("ok", 18446744073709551615)),  # 2^64-1: the largest counter
        (b"18446744073709551616", ("out_of_range", "18446744073709551616 is outside 0..2^64-1")),
        (b"1" * 21, ("out_of_range", "<21-digit integer> is beyond 2^64-1")),
        (b"7" * 100_000, ("out_of_range", "<100000-digit integer> is beyond 2^64-1")),
    ]:
        result = loads(top % (digits, b"5"))
        samples, read_errors = answer_samples(Answers(iostat=[result]), Roles(), Memory())
        got = [s.value for s in samples if s.name == "spdk_bdev_bytes_read"]
        assert [s.value for s in samples if s.name == "spdk_bdev_num_read_ops"] == [5]  # the rest of the bdev stays
        if expected[0] == "ok":
            assert got == [float(expected[1])] and read_errors == []
        else:
            assert got == []
            assert read_errors == [ReadError("out_of_range", "bdev_get_iostat", f"Malloc0: bytes_read: {expected[1]}")]


def _parsed(**results: Any) -> tuple[list[Sample], list[ReadError]]:
    """spdk_answers.samples on the given results alone (bdev_get_iostat: one answer), target role nof."""
    iostat = [results.pop("bdev_get_iostat")] if "bdev_get_iostat" in results else []
    version = results.pop("spdk_get_version", None)
    return answer_samples(Answers(version=version, iostat=iostat, results=results), Roles(default="nof"), Memory())


@pytest.mark.parametrize(
    ("method", "prefixes"),
    [
        ("nvmf_get_stats", ("spdk_nvmf_poll_group_", "spdk_nvmf_transport")),
        ("bdev_lvol_get_lvstores", ("spdk_lvstore_",)),
        ("thread_get_stats", ("spdk_thread_",)),
        ("framework_get_reactors", ("spdk_reactor_",)),
        ("spdk_get_version", ("spdk_version_",)),
    ],
)
def test_each_parser_reads_its_capture_alone(method, prefixes):
    """One method's live capture, nothing else: no read error, and exactly its area's samples of the whole scrape."""
    alone, read_errors = _parsed(**{method: capture(f"live/{method}.json")["result"]})
    assert read_errors == [] and alone
    everything, _ = _parsed(
        bdev_get_iostat=capture("live/bdev_get_iostat.json")["result"],
        **{m: capture(f"live/{m}.json")["result"] for m in LIVE_METHODS},
    )
    assert sorted(alone, key=repr) == sorted((s for s in everything if s.name.startswith(prefixes)), key=repr)


def test_a_subsystems_sum_of_a_field_one_namespace_could_not_read_is_withheld():
    """kvcache1 = Malloc0 + the lvol: Malloc0's bytes_read unreadable, the subsystem's bytes_read is not reported
    (it would be the lvol's alone), its other sums are: bytes written 951566336 + 752439296 = 1704005632."""
    results = {m: capture(f"live/{m}.json")["result"] for m in LIVE_METHODS}
    iostat = _iostat_field("Malloc0", "bytes_read", "2227339264")["result"]
    raw, read_errors = _parsed(bdev_get_iostat=iostat, **results)
    assert [(e.reason, e.what) for e in read_errors] == [("unparseable", "bdev_get_iostat")]
    assert read_errors[0].detail == "Malloc0: bytes_read: 2227339264 is not a number"
    assert not named(raw, "spdk_nvmf_subsystem_bytes_read")
    assert value(raw, "spdk_nvmf_subsystem_bytes_written", subsystem=NQN) == 1704005632
    assert value(raw, "spdk_nvmf_subsystem_num_read_ops", subsystem=NQN) == 543777 + 427369
    assert not named(raw, "spdk_bdev_bytes_read")[2:]  # the lvol's and Malloc1's, not Malloc0's
    # the tier's read bytes are withheld (the lvol's sample of it carries no tier), its written bytes are not
    assert {s.label_map["tier"] for s in named(raw, "spdk_bdev_bytes_read")} == {""}
    assert value(raw, "spdk_bdev_bytes_written", bdev="Malloc0", tier="nof") == 951566336


@pytest.mark.parametrize(
    ("method", "edit", "error"),
    [
        (
            "thread_get_stats",
            lambda r: r["threads"][0].pop("idle"),
            ("unparseable", "app_thread: no idle"),
        ),
        (
            "thread_get_stats",
            lambda r: r.pop("tick_rate"),
            ("unparseable", "no tick_rate for the fields in ticks"),
        ),
        (
            "bdev_get_bdevs",
            lambda r: r[0].pop("num_blocks"),
            ("unparseable", "Malloc0: no num_blocks"),
        ),
        (
            "bdev_get_bdevs",
            lambda r: r[0].update(block_size=-4096),
            ("out_of_range", "Malloc0: block_size: -4096 is outside 0..2^64-1"),
        ),
        (
            "bdev_lvol_get_lvstores",
            lambda r: r[0].update(free_clusters=32),
            ("out_of_range", "lvs0: 32 free of 31 clusters"),
        ),
        (
            "nvmf_get_stats",
            lambda r: r["poll_groups"][0].update(completed_nvme_io=1.5e20),
            ("out_of_range", "nvmf_tgt_poll_group_000: completed_nvme_io: 1.5e+20 is outside 0..2^64-1"),
        ),
        (
            "framework_get_reactors",
            lambda r: r["reactors"][0]["lw_threads"][0].update(elapsed=True),
            ("unparseable", "lcore 0: app_thread: elapsed: True is not a number"),
        ),
    ],
    ids=["no-idle", "no-tick-rate", "no-num-blocks", "negative-size", "more-free-than-total", "1.5e20", "bool"],
)
def test_each_parser_counts_a_bad_value_of_its_capture_as_a_read_error_of_its_method(method, edit, error):
    result = copy.deepcopy(capture(f"live/{method}.json")["result"])
    edit(result)
    good, _ = _parsed(**{method: capture(f"live/{method}.json")["result"]})
    raw, read_errors = _parsed(**{method: result})
    assert [(e.reason, e.what, e.detail) for e in read_errors] == [(error[0], method, error[1])]
    assert raw and len(raw) < len(good)  # what the bad value gave is missing, the rest of the answer is read
