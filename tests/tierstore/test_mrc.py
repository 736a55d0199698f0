"""Miss-ratio curves: the one-pass stack distances against per-capacity LRU replays, hand-worked prefix cases, and
the store's own policies replayed where the curve is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvscope.cli import app
from kvscope.tierstore.mrc import capacity_grid, lru_replay, miss_ratio_curve, replay_store, stack_distances
from kvscope.tierstore.scenario import load_scenario, parse_scenario
from kvscope.tierstore.workloads import Request, make_workload

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
FIVE_CAPACITIES = (1, 37, 150, 260, 400)


def requests(*chains: list[str], prompt_tokens: int = 100) -> list[list[Request]]:
    """One round, a request per chain (one token a block, prompts long enough that every block may hit)."""
    return [[Request(1, number, prompt_tokens, chain) for number, chain in enumerate(chains)]]


def multi_round(**workload) -> object:
    base = {"kind": "multi_round", "sessions": 6, "rounds": 7, "first_prompt_tokens": 700, "user_tokens": 100,
            "output_tokens": 300, "output_cached": True, "shared_prefix_tokens": 512, "order": "shuffled"}  # fmt: skip
    return parse_scenario(
        {
            "workload": {**base, **workload},
            "kv": {"block_tokens": 64, "bytes_per_token": 1000},
            "arms": {"small": {"tiers": [{"name": "dram", "capacity": 100 * 64_000}]}},
        }
    )


def test_a_chain_read_again_hits_from_the_distinct_blocks_referenced_since():
    # a b c, then x y, then a b c: each of a, b, c has 5 distinct blocks since (b c x y and itself)
    distances = stack_distances(requests(["a", "b", "c"], ["x", "y"], ["a", "b", "c"]), 1)
    assert distances.hits_from == [{5: 3}]
    assert [distances.hit_blocks(capacity)[0] for capacity in (4, 5)] == [0, 3]
    assert (distances.distinct_blocks, distances.references) == (5, 8)


def test_a_prefix_hits_only_from_the_largest_distance_before_it():
    # b, then a, then a b: a is 1 back, b 2 back, so one block hits from capacity 1 and both from 2
    assert stack_distances(requests(["b"], ["a"], ["a", "b"]), 1).hits_from == [{1: 1, 2: 1}]
    # b a: b misses at capacity 1, and a, though present, is past the first miss
    assert stack_distances(requests(["b"], ["a"], ["b", "a"]), 1).hits_from == [{2: 2}]


def test_a_new_block_ends_the_prefix_and_the_last_token_is_never_hit():
    distances = stack_distances(requests(["a", "b"], ["a", "new", "b"]), 1)
    assert distances.hits_from == [{2: 1}]  # a hits from 2 (b, a); b lies past the new block
    # a 3-token prompt of 3 blocks may hit 2: the last token is computed to produce logits
    assert stack_distances(requests(["a", "b", "c"], ["a", "b", "c"], prompt_tokens=3), 1).hits_from == [{3: 2}]


@pytest.mark.parametrize("order", ["round_robin", "shuffled"])
def test_the_curve_equals_per_capacity_lru_runs_of_a_multi_round_chat_in_every_round(order):
    scenario = multi_round(order=order)
    rounds = [list(r) for r in make_workload(scenario).rounds()]
    distances = stack_distances(rounds, scenario.block_tokens)
    for capacity in FIVE_CAPACITIES:
        assert distances.hit_blocks(capacity) == lru_replay(rounds, scenario.block_tokens, capacity)
    assert 0 < sum(distances.hit_blocks(150)) < sum(distances.hit_blocks(400))  # the capacities tell apart


def test_the_curve_equals_per_capacity_lru_runs_of_the_conversation_trace():
    scenario = load_scenario(EXAMPLES / "trace.yaml")
    scenario = scenario.model_copy(update={"workload": scenario.workload.model_copy(update={"limit": 1500})})
    rounds = [list(r) for r in make_workload(scenario).rounds()]
    distances = stack_distances(rounds, scenario.block_tokens)
    for capacity in (10, 300, 3_000, 12_000, distances.distinct_blocks):
        assert distances.hit_blocks(capacity) == lru_replay(rounds, scenario.block_tokens, capacity)
    assert sum(distances.hit_blocks(10)) < sum(distances.hit_blocks(12_000))


def test_the_stores_lru_is_no_stack_algorithm_and_its_gap_is_measured():
    # capacity 2. a b, then c evicts a. a b again: the store's lookup misses a, its save adds a and evicts b (the
    # save skips b, present, without refreshing it); a textbook LRU refreshes b too and keeps it. a b once more:
    # the store hits a only, the curve both.
    scenario = parse_scenario(
        {
            "workload": {"kind": "multi_round", "sessions": 1, "rounds": 1, "first_prompt_tokens": 1},
            "kv": {"block_tokens": 1, "bytes_per_token": 1},
            "arms": {"lru": {"tiers": [{"name": "dram", "capacity": 2}]}},
        }
    )
    rounds = requests(["a", "b"], ["c"], ["a", "b"], ["a", "b"], prompt_tokens=3)
    assert replay_store(scenario, "lru", 2, rounds) == [1]
    assert stack_distances(rounds, 1).hit_blocks(2) == [2] == lru_replay(rounds, 1, 2)


def test_the_scenario_curve_replays_each_arms_policy_at_its_capacity():
    scenario = load_scenario(EXAMPLES / "policies.yaml")
    curve = miss_ratio_curve(scenario, points=8)
    assert {(arm.arm, arm.policy, arm.capacity_blocks) for arm in curve.arms} == {
        ("lru", "lru", 256), ("mooncake", "mooncake", 256), ("lmcache", "lmcache", 256)}  # fmt: skip
    assert 256 in curve.grid
    rounds = [list(r) for r in make_workload(scenario).rounds()]
    prompt = sum(curve.distances.prompt_tokens)
    for check in curve.checks:
        arm = check.policy  # each arm of this example is named after its policy
        hits = sum(replay_store(scenario, arm, check.capacity_blocks, rounds))
        assert check.store_hit_ratio == hits * scenario.block_tokens / prompt
        assert check.gap == check.store_hit_ratio - curve.distances.hit_ratio(check.capacity_blocks)
    assert {check.policy for check in curve.checks if check.capacity_blocks == 256} == {"lru", "mooncake", "lmcache"}


def test_the_grid_runs_from_one_block_to_the_footprint_with_the_arms_capacities():
    assert capacity_grid(1000, 4, [37]) == [1, 10, 37, 100, 1000]


def test_kvscope_mrc_writes_the_table_the_json_and_the_plot(tmp_path):
    out, plot = tmp_path / "mrc.json", tmp_path / "mrc.png"
    result = CliRunner().invoke(
        app, ["mrc", str(EXAMPLES / "policies.yaml"), "--json", str(out), "--plot", str(plot), "--points", "6"]
    )
    assert result.exit_code == 0, result.output
    assert "50% of ideal" in result.output and "lru (dram)" in result.output
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(out.read_text())
    ratios = [point["hit_ratio"] for point in data["curve"]]
    assert ratios == sorted(ratios) and ratios[-1] == pytest.approx(data["ideal_hit_ratio"])
    assert data["arms"]["lru"]["capacity_bytes"] == 64 * 1024**2
    assert data["distinct_blocks"] == 416 and data["references"] == 2720
