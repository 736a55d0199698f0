"""The TTFT model (kvscope.tierstore.ttft) on hand-worked cases, its calibration on the published lab figures, and
the scenario keys that turn it on (kvscope.tierstore.scenario, the engine emulator)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvscope.tierstore import calibration
from kvscope.tierstore.ab import build_engine, build_store
from kvscope.tierstore.scenario import ScenarioError, load_scenario, parse_scenario
from kvscope.tierstore.ttft import (
    GpuClass,
    Gpus,
    Link,
    ModelCompute,
    TtftModel,
    load_seconds,
    overlapped,
    pd_transfer_seconds,
)
from kvscope.tierstore.workloads import make_workload

EXAMPLES = Path(__file__).parents[2] / "examples"
GBPS = 1e9 / 8
# A GPU of round numbers: 1 TFLOP/s in BF16, 2 in FP8; two of them at efficiency 0.5 make 1x the peak of one.
ROUND_GPU = GpuClass("round", 1.0, 2.0, 80, "hand-worked")
# 1B active parameters, 2 layers of 4 heads of 64 + 64 dims: 2 x 4 x (64 + 64) x 2 layers = 2,048 FLOPs a pair.
SMALL = ModelCompute.of(1e9, layers=2, heads=4, qk_head_dim=64, v_head_dim=64)


def test_one_request_alone_on_a_link():
    # 400 Gb/s = 50e9 B/s; 7e9 B alone on it: 7e9 / 50e9 = 0.14 s
    link = Link(400 * GBPS)
    assert load_seconds({"east_west": [(7_000_000_000, None)]}, {"east_west": link}) == pytest.approx(0.14)


def test_n_requests_share_a_link_and_its_nics():
    # two 400G NICs = 100e9 B/s, 4 requests in flight: 25e9 B/s each; 5e9 B: 5e9 / 25e9 = 0.2 s
    link = Link(400 * GBPS, nics=2, concurrency=4)
    assert link.share == pytest.approx(25e9)
    assert load_seconds({"east_west": [(5_000_000_000, None)]}, {"east_west": link}) == pytest.approx(0.2)


def test_a_slow_medium_and_two_links():
    # the tier's medium (10e9 B/s) is slower than the link (50e9 B/s): 1e9 B / 10e9 = 0.1 s; a second tier on the
    # same link adds 1e9 / 50e9 = 0.02 s (0.12 s); north-south (25e9 B/s at goodput 0.5 of 400G) runs at the same
    # time: 2e9 / 25e9 = 0.08 s, so the load takes the longer, 0.12 s
    links = {"east_west": Link(400 * GBPS), "north_south": Link(400 * GBPS, goodput=0.5)}
    reads = {"east_west": [(1_000_000_000, 10e9), (1_000_000_000, None)], "north_south": [(2_000_000_000, None)]}
    assert load_seconds(reads, links) == pytest.approx(0.12)


def test_overlap_of_loading_with_compute():
    # compute 1.0 s, load 0.5 s, 10 layers. None: 1.5 s. Full: the longer plus one layer of the shorter,
    # 1.0 + 0.5 / 10 = 1.05 s. Half: 0.5 x 1.5 + 0.5 x 1.05 = 1.275 s. Load longer (2.0 s): 2.0 + 1.0 / 10 = 2.1 s
    assert overlapped(1.0, 0.5, 0.0, 10) == pytest.approx(1.5)
    assert overlapped(1.0, 0.5, 1.0, 10) == pytest.approx(1.05)
    assert overlapped(1.0, 0.5, 0.5, 10) == pytest.approx(1.275)
    assert overlapped(1.0, 2.0, 1.0, 10) == pytest.approx(2.1)


def test_full_overlap_leaves_one_layer_of_the_load_exposed():
    # 1,000 new tokens (no hit) on the round GPU: 2 x 1e9 x 1,000 = 2e12 FLOPs at 2e12 FP8 = 1 s, attention
    # 2,048 x 1,000^2 / 2 = 1.024e9 FLOPs at 1e12 BF16 = 1.024 ms: compute 1.001024 s. The hits: 200 tokens of
    # 1e6 B over 1.6 Tb/s (200e9 B/s): 2e8 / 2e11 = 1 ms, under compute but its first layer, 1 ms / 2 = 0.5 ms
    model = TtftModel(1_000_000, {"east_west": Link(1600 * GBPS)}, SMALL, Gpus(ROUND_GPU, 2, 0.5, "fp8"),
                      layers=2, overlap=1.0)  # fmt: skip
    parts = model.parts(1200, 200, {"east_west": [(200_000_000, None)]})
    # 1,000 new tokens after 200 hits: 2e12 FLOPs = 1 s; attention 2,048 x (1,200^2 - 200^2) / 2 = 1.4336e9 FLOPs
    assert parts.compute == pytest.approx(1.0 + 1.4336e-3)
    assert parts.load == pytest.approx(0.0005)
    assert parts.total == pytest.approx(1.0014336 + 0.0005)


def test_prefill_compute_grows_with_context_through_attention():
    # 1,000 tokens, 600 hit: 400 new x 2e9 = 8e11 FLOPs at 2e12 = 0.4 s; attention 2,048 x (1e6 - 3.6e5) / 2 =
    # 6.5536e8 at 1e12 = 0.65536 ms. BF16 matmuls (1e12): 0.8 s
    gpus = Gpus(ROUND_GPU, 2, 0.5, "fp8")
    assert gpus.compute_seconds(SMALL, 1000, 600) == pytest.approx(0.4 + 0.00065536)
    assert Gpus(ROUND_GPU, 2, 0.5, "bf16").compute_seconds(SMALL, 1000, 600) == pytest.approx(0.8 + 0.00065536)
    # ten times the context with the same 400 new tokens: attention 2,048 x (10,000^2 - 9,600^2) / 2 = 8.0282e9
    assert gpus.compute_seconds(SMALL, 10_000, 9_600) == pytest.approx(0.4 + 8.03e-3, rel=1e-3)


def test_a_pd_transfer_sends_the_whole_prompt_over_east_west():
    # Qwen3-235B's KV: 2 x 94 layers x 4 KV heads x 128 x 2 B = 192,512 B a token; 40,000 tokens = 7.7005e9 B over
    # 1.6 Tb/s (200e9 B/s) = 38.5 ms alone, 77.0 ms with two transfers in flight
    assert calibration.QWEN3_235B_KV_ELEMENTS * 2 == 192_512
    assert pd_transfer_seconds(40_000, 192_512, Link(1600 * GBPS)) == pytest.approx(0.0385024)
    assert pd_transfer_seconds(40_000, 192_512, Link(1600 * GBPS, concurrency=2)) == pytest.approx(0.0770048)
    # in a TTFT: overhead 0.1 s + compute of 1 new token at 10,000 tokens/s (0.1 ms) + the load of 39,999 hit tokens
    # (7.70043e9 / 200e9 = 38.5 ms) + the transfer (38.5 ms)
    model = TtftModel(192_512, {"east_west": Link(1600 * GBPS)}, prefill_tokens_per_s=10_000,
                      pd_disaggregated=True, overhead=0.1)  # fmt: skip
    parts = model.of_hit(40_000, 39_999)
    assert (parts.overhead, parts.compute) == (0.1, pytest.approx(1e-4))
    assert parts.load == pytest.approx(39_999 * 192_512 / 200e9)
    assert parts.pd_transfer == pytest.approx(0.0385024)


def test_the_calibration_reproduces_the_published_figures():
    fitted = calibration.calibrate()
    east_west = 1 - calibration.east_west_ttft(fitted.assumptions, 1600, fitted.overhead) / (
        calibration.east_west_ttft(fitted.assumptions, 400, fitted.overhead)
    )
    assert abs(east_west - 0.29) < 0.03  # 400G -> 1.6T east-west at 100K tokens
    assert abs(fitted.north_south_reduction - 0.35) < 0.03  # 200G -> 400G north-south
    assert 0 < fitted.overhead < 1 and 0 < fitted.north_south_goodput <= 1


def test_the_east_west_gain_grows_with_context_length():
    fitted = calibration.calibrate()
    gains = [
        1
        - calibration.east_west_ttft(fitted.assumptions, 1600, fitted.overhead, prompt)
        / calibration.east_west_ttft(fitted.assumptions, 400, fitted.overhead, prompt)
        for prompt in (100, 1_000, 10_000, 40_000, 100_000)
    ]
    assert gains == sorted(gains) and gains[0] < 0.01


def test_the_held_back_predictions_and_their_sensitivity_are_computed_without_tuning():
    held = calibration.predict(calibration.calibrate())
    assert held.mid_over_high > 1  # the mid-range platform is slower, by its compute alone
    assert 0 < held.pd_reduction < 1
    rows = calibration.sensitivity()
    assert len(rows) == len(calibration.VARIATIONS)
    # a prompt 5% recomputed spends more on compute than the 29% leaves to anything but the link: no overhead fits
    assert [name for name, fit, _ in rows if fit is None] == ["5% of the prompt recomputed"]


def test_the_deepseek_example_is_the_calibrated_lab_setup():
    """The shipped example holds the calibration's numbers: its MLA KV size is the model's, and its round 2 (a
    repeated 100K prompt) costs what the calibration's model says."""
    scenario = load_scenario(EXAMPLES / "fabric_400g_vs_1600g.yaml")
    fitted = calibration.calibrate()
    assert scenario.kv.token_bytes == calibration.DEEPSEEK_R1_KV_ELEMENTS * 2 == 70_272
    assert scenario.engine.overhead == pytest.approx(fitted.overhead, abs=1e-4)
    assert scenario.fabric.north_south_goodput == pytest.approx(fitted.north_south_goodput, abs=1e-3)
    arm = scenario.arms["dram_tier"]
    store = build_store(arm, scenario.block_bytes, "dram_tier", None)
    engine = build_engine(scenario, store, None, arm)
    first, second = list(make_workload(scenario).rounds())[:2]
    for request in first:
        engine.serve(request)
    served = engine.serve(second[0])
    expected = calibration.east_west_ttft(fitted.assumptions, 400, scenario.engine.overhead)
    assert served.ttft_s == pytest.approx(expected)
    assert served.ttft_parts.load == pytest.approx(99_840 * 70_272 / 50e9)  # 390 blocks of 256 tokens at 50e9 B/s


def _scenario(engine: dict | None = None, fabric: dict | None = None, **kv) -> dict:
    data: dict = {
        "workload": {"kind": "multi_round", "sessions": 1, "rounds": 2, "first_prompt_tokens": 1000},
        "kv": {"block_tokens": 100, **(kv or {"bytes_per_token": "1KB"})},
        "arms": {"a": {"tiers": [{"name": "dram", "capacity": "1GB"}, {"name": "nof", "capacity": "1GB"}]}},
    }
    if engine:
        data["engine"] = engine
    if fabric:
        data["fabric"] = fabric
    return data


def test_without_the_new_keys_ttft_is_the_simple_model():
    scenario = parse_scenario(_scenario({"prefill_tokens_per_s": 1000}))
    arm = scenario.arms["a"]
    engine = build_engine(scenario, build_store(arm, scenario.block_bytes, "a", None), None, arm)
    assert engine.ttft_model is None
    requests = [request for round_ in make_workload(scenario).rounds() for request in round_]
    assert engine.serve(requests[0]).ttft_s == 1.0  # 1,000 tokens at 1,000 tokens/s, nothing loaded
    # round 2: 900 tokens hit (9 blocks), 100 recomputed: 0.1 s; no read bandwidth, so loading is free
    assert engine.serve(requests[1]).ttft_s == pytest.approx(0.1)


def test_a_fabric_alone_times_the_loads_and_keeps_the_token_rate():
    # 900 hit tokens x 1,000 B = 9e5 B over 8e6 B/s (64 Mb/s) with 2 in flight: 9e5 x 2 / 8e6 = 0.225 s; 100
    # tokens at 1,000 tokens/s: 0.1 s (the hits come from dram, the top tier: north-south carries nothing)
    data = _scenario({"prefill_tokens_per_s": 1000, "concurrency": 2}, {"east_west": "64Mb/s", "north_south": "8Mb/s"})
    scenario = parse_scenario(data)
    arm = scenario.arms["a"]
    engine = build_engine(scenario, build_store(arm, scenario.block_bytes, "a", None), None, arm)
    first, second = (request for round_ in make_workload(scenario).rounds() for request in round_)
    engine.serve(first)
    served = engine.serve(second)
    assert (served.ttft_parts.compute, served.ttft_parts.load) == (pytest.approx(0.1), pytest.approx(0.225))


@pytest.mark.parametrize(
    ("engine", "fabric", "kv", "message"),
    [
        ({"concurrency": 4}, None, {}, "engine.concurrency is part of the TTFT model"),
        ({"gpu": {"class": "h100"}}, {"east_west": "400Gb/s"}, {}, "engine.gpu needs kv.model with active_params"),
        ({"gpu": {"class": "h999"}}, None, {}, "class 'h999' is not one of"),
        ({"topology": "pd_disaggregated"}, None, {}, "engine.topology is part of the TTFT model"),
    ],
)
def test_the_ttft_keys_are_refused_where_they_cannot_apply(engine, fabric, kv, message):
    with pytest.raises(ScenarioError, match=message):
        parse_scenario(_scenario(engine, fabric, **kv))


def test_a_storage_tier_needs_a_north_south_link():
    # the second tier loads over north_south by default
    with pytest.raises(ScenarioError, match=r"loads over north_south: give fabric\.north_south"):
        parse_scenario(_scenario(None, {"east_west": "400Gb/s"}))


def test_gpu_class_is_written_as_class_and_echoed_so():
    model = {"layers": 2, "kv_heads": 1, "head_dim": 4, "active_params": 1e9, "attention_heads": 4}
    engine = {"gpu": {"class": "h200", "dtype": "fp8"}, "overlap_loading": True}
    data = _scenario(engine, {"east_west": "1.6Tb/s", "north_south": "400Gb/s", "nics": 8}, model=model)
    scenario = parse_scenario(data)
    echoed = scenario.model_dump(mode="json")
    assert echoed["engine"]["gpu"]["class"] == "h200" and echoed["engine"]["overlap_loading"] == 1.0
    assert parse_scenario(echoed) == scenario
