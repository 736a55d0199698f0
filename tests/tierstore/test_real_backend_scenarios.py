"""What a scenario may ask of a real backend (`store: mooncake`, `engine.kind: vllm`), refused with the field and the
reason before anything starts; and what the planner and the criteria make of it. No real component is needed."""

from __future__ import annotations

import copy

import pytest

from kvscope.tierstore.ab import ArmRun, followed_arm
from kvscope.tierstore.engine import RequestTimes
from kvscope.tierstore.planner import plan
from kvscope.tierstore.scenario import ScenarioError, parse_scenario
from kvscope.tierstore.vllm import cpu_share

MOONCAKE = {
    "name": "s",
    "workload": {"kind": "multi_round", "sessions": 16, "rounds": 10, "first_prompt_tokens": 2048,
                 "user_tokens": 256, "output_tokens": 256},
    "kv": {"block_tokens": 256, "bytes_per_token": "1KiB"},
    "arms": {"a": {"store": "mooncake", "tiers": [{"name": "dram", "capacity": "64MiB"}]}},
}  # fmt: skip
VLLM = {
    "name": "v",
    "workload": {"kind": "multi_round", "sessions": 8, "rounds": 4, "first_prompt_tokens": 96,
                 "user_tokens": 56, "output_tokens": 8, "output_cached": True},
    "kv": {"block_tokens": 32, "model": {"layers": 8, "kv_heads": 2, "head_dim": 64, "dtype": "bf16"}},
    "engine": {"kind": "vllm", "vllm": {"gpu_blocks": 40}},
    "arms": {"a": {"store": "mooncake", "mooncake": {"lease_ttl": "2s"},
                   "tiers": [{"name": "dram", "capacity": "16MiB"}]}},
}  # fmt: skip


def changed(base: dict, change) -> dict:
    scenario = copy.deepcopy(base)
    change(scenario)
    return scenario


def arm(scenario: dict) -> dict:
    return scenario["arms"]["a"]


@pytest.mark.parametrize(
    ("base", "change", "reason"),
    [
        (MOONCAKE, lambda s: arm(s)["tiers"][0].update(name="hbm"), "tiers are dram"),
        (MOONCAKE, lambda s: arm(s)["tiers"].append({"name": "nof", "capacity": "1GiB"}), "tiers are dram"),
        (MOONCAKE, lambda s: arm(s)["tiers"][0].update(capacity="8MiB"), "at least 16,777,216"),
        (MOONCAKE, lambda s: arm(s)["tiers"][0].update(backend="file"), "do not apply to Mooncake"),
        (MOONCAKE, lambda s: arm(s)["tiers"][0].update(read_bandwidth="400Gb/s"), "do not apply to Mooncake"),
        (MOONCAKE, lambda s: arm(s).update(promote_on_hit=True), "promote_on_hit"),
        (MOONCAKE, lambda s: arm(s).update(tiers=[{"name": "dram", "capacity": "64MiB"},
                                                  {"name": "ssd", "capacity": "1GiB"}],
                                           attached=[{"name": "ssd2", "capacity": "1GiB"}]), "attach only an ssd"),
        (MOONCAKE, lambda s: s["kv"].update(bytes_per_token="1MiB"), "larger than the dram segment"),
        (MOONCAKE, lambda s: s["arms"].update(b={"tiers": [{"name": "dram", "capacity": "1GB"}], "mirror": True}),
         "mirror applies to store: mooncake or none"),
        (MOONCAKE, lambda s: s["arms"].update(b={"store": "none"}), "only a vLLM engine serves an arm alone"),
        (VLLM, lambda s: s["arms"].update(b={"store": "none", "mooncake": {"lease_ttl": "2s"}}),
         "has no attached tiers or mooncake"),
        (VLLM, lambda s: s["arms"].update(b={"store": "none", "tiers": [{"name": "dram", "capacity": "1GB"}]}),
         "at most 0 items"),
        (MOONCAKE, lambda s: (arm(s).update(mirror=True), s["arms"].update(a_sim=copy.deepcopy(arm(s)))),
         "names another arm"),
        (VLLM, lambda s: s["kv"].update(block_tokens=48), "multiple of 32"),
        (VLLM, lambda s: s["kv"].update(model=None, bytes_per_token=1024), "kv.model"),
        (VLLM, lambda s: arm(s).update(store="embedded", mooncake=None), "must be store: mooncake"),
        (VLLM, lambda s: arm(s).update(mooncake={"lease_ttl": "100ms"}), "-707"),
        (VLLM, lambda s: s["engine"]["vllm"].update(gpu_blocks=4), "cannot hold one request"),
        (VLLM, lambda s: s["engine"].update(vllm=None), "needs vllm"),
        (VLLM, lambda s: s["engine"].update(gpu_cache={"capacity": "1MB"}), "vLLM's own prefix cache"),
    ],
)  # fmt: skip
def test_what_a_real_backend_cannot_do_is_refused_naming_why(base, change, reason):
    with pytest.raises(ScenarioError) as refused:
        parse_scenario(changed(base, change))
    assert reason in " ".join(str(refused.value).split())


def test_a_vllm_arm_may_offload_every_put_to_its_ssd():
    """placement replicate (Mooncake's offload after every put) with an SSD tier behind a vLLM engine: accepted."""
    tiers = [{"name": "dram", "capacity": "16MiB"}, {"name": "ssd", "capacity": "64MiB"}]
    spec = parse_scenario(changed(VLLM, lambda s: arm(s).update(placement="replicate", tiers=tiers)))
    assert [arm.placement for arm in spec.arms.values()] == ["replicate"]


def test_a_mooncake_arm_and_its_mirror_hold_the_eviction_watermark_of_the_segment():
    scenario = parse_scenario(changed(MOONCAKE, lambda s: arm(s).update(mirror=True)))
    assert list(scenario.runnable_arms) == ["a", "a_sim"]
    mirror = scenario.runnable_arms["a_sim"]
    assert mirror.store == "embedded" and mirror.tiers[0].policy == "mooncake"
    assert mirror.mooncake == scenario.arms["a"].mooncake_settings  # the same lease, pacing and watermark
    predicted = plan(scenario).arms
    assert predicted["a"].capacity_bytes == predicted["a_sim"].capacity_bytes == int(0.9 * 64 * 2**20)
    assert predicted["a"].collapse_round == predicted["a_sim"].collapse_round == 5


def test_the_mirror_of_a_vllm_arm_puts_as_its_connector_does_without_retrying():
    scenario = parse_scenario(changed(VLLM, lambda s: arm(s).update(mirror=True)))
    assert scenario.runnable_arms["a_sim"].mooncake.put_retry_budget == 0
    assert scenario.arms["a"].mooncake_settings.put_retry_budget > 0


def test_the_mirror_of_a_vllm_arm_with_a_mooncake_segment_follows_it_on_its_recorded_request_times():
    """Only a Mooncake segment's model runs on the real arm's clock (and so after it): vLLM alone has no leases (its
    model's GPU cache times its blocks' lifecycle on the scenario's pacing), and kvscope's own Mooncake client keeps
    the scenario's pacing."""
    both = {"mirror": True}
    scenario = parse_scenario(
        changed(VLLM, lambda s: s["arms"].update(a=arm(s) | both, alone={"store": "none"} | both))
    )
    assert {name: followed_arm(scenario, name) for name in scenario.runnable_arms} == {
        "a": None,
        "a_sim": "a",
        "alone": None,
        "alone_sim": None,
    }
    own_client = parse_scenario(changed(MOONCAKE, lambda s: arm(s).update(mirror=True)))
    assert followed_arm(own_client, "a_sim") is None
    rows = [{"request_start_s": [0.0, 0.9], "request_first_token_s": [0.4, 0.1], "request_s": [0.6, 0.2]}]
    mirror = ArmRun(scenario, "a_sim", plan(scenario), real_rows=rows)
    assert mirror.engine.clock(1) == RequestTimes(0.9, 1.0, 1.1)
    interval = scenario.runnable_arms["alone_sim"].mooncake_settings.request_interval
    assert ArmRun(scenario, "alone_sim", plan(scenario)).engine.clock(1) == RequestTimes(*[interval] * 3)


def test_a_vllm_arm_without_tiers_is_vllm_alone_predicted_on_its_prefix_cache():
    scenario = parse_scenario(changed(VLLM, lambda s: s["arms"].update(alone={"store": "none", "mirror": True})))
    assert scenario.served_apart("alone") and not scenario.served_apart("alone_sim")
    assert scenario.runnable_arms["alone_sim"].tiers == []
    predicted = plan(scenario).arms["alone"]
    assert predicted.capacity_bytes == 39 * scenario.block_bytes and predicted.holding_policy == "tail_first"


def test_a_vllm_engine_takes_its_model_and_length_from_the_scenario():
    scenario = parse_scenario(VLLM)
    assert scenario.kv.token_bytes == 2 * 8 * 2 * 64 * 2  # the tiny model's KV bytes per token
    # the longest prompt and output (96 + 4 x 64 = 352 tokens) in whole blocks
    assert scenario.vllm_max_model_len == 352


@pytest.mark.parametrize(
    ("cpus", "count", "shares"),
    [({0, 1}, 2, ["0", "1"]), ({0, 1, 2, 3}, 2, ["0,1", "2,3"]), ({0, 1}, 3, ["0", "1", "0"]), ({4, 5}, 1, ["4,5"])],
)
def test_servers_running_at_once_compute_on_disjoint_cpus_where_there_are_enough(monkeypatch, cpus, count, shares):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: cpus)
    assert [cpu_share(index, count) for index in range(count)] == shares
