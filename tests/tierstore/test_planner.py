"""Planner (analytic model) on hand-worked cases, KV geometry from a model, and agreement with the simulation.

Unless a test says otherwise: 256-token blocks of 1 KB per token, so one block is 256,000 B and capacities
are given in blocks. The base workload is 4 sessions x 4 rounds, a 600-token first prompt and 300 output
tokens per round (not cached):

    round r                 1      2      3      4
    prompt P_r            600    900   1200   1500     (600 + (r - 1) x 300)
    full blocks P_r//256    2      3      4      5      (cached per session after the round)
    hittable (P_r-1)//256   2      3      4      5
    ideal blocks/session    0      2      3      4      (min(blocks cached before, hittable))
    ideal hit ratio         0  512/900 768/1200 1024/1500
    footprint (blocks)      8     12     16     20      (4 sessions x full blocks)
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvscope.tierstore.ab import observed_collapse_round, run_ab
from kvscope.tierstore.planner import plan
from kvscope.tierstore.policies import POLICIES
from kvscope.tierstore.scenario import load_scenario, parse_scenario

BB = 256_000  # bytes per block


def arm(policy: str, blocks: int) -> dict:
    return {"tiers": [{"name": "dram", "capacity": blocks * BB, "policy": policy}]}


def simulate(scenario) -> dict:
    return run_ab(scenario)["arms"]


# --------------------------------------------------------------------------- hand-worked plan


def test_base_workload_rounds_by_hand(scenario):
    """Query tokens, ideal hit tokens and footprint per round, as in the module docstring."""
    the_plan = plan(scenario())
    assert (the_plan.block_tokens, the_plan.bytes_per_token, the_plan.block_bytes) == (256, 1000, BB)
    assert [r.requests for r in the_plan.rounds] == [4, 4, 4, 4]
    assert [r.query_tokens for r in the_plan.rounds] == [2400, 3600, 4800, 6000]
    assert [r.ideal_hit_tokens for r in the_plan.rounds] == [0, 2048, 3072, 4096]
    assert [r.ideal_hit_ratio for r in the_plan.rounds] == [0.0, 2048 / 3600, 3072 / 4800, 4096 / 6000]
    assert [r.footprint_bytes for r in the_plan.rounds] == [8 * BB, 12 * BB, 16 * BB, 20 * BB]


def test_shared_prefix_plan_by_hand(scenario):
    """512 shared tokens = 2 blocks held once: footprint 2 + 4 x (own blocks) = 2, 6, 10, 14 blocks.

    Round 1: session 0 writes the shared blocks, the 3 others hit min(2, hittable 2) = 2 blocks each:
    3 x 512 = 1536 of 2400 tokens. Later rounds as without sharing.
    """
    the_plan = plan(scenario(shared_prefix_tokens=512))
    assert [r.ideal_hit_tokens for r in the_plan.rounds] == [1536, 2048, 3072, 4096]
    assert [r.footprint_bytes for r in the_plan.rounds] == [2 * BB, 6 * BB, 10 * BB, 14 * BB]


def test_output_cached_and_user_tokens_plan_by_hand(scenario):
    """output cached, 100 user tokens: P = 600, 1000, 1400, 1800; cached (P + 300)//256 = 3, 5, 6, 8 blocks.

    hittable (P-1)//256 = 2, 3, 5, 7 -> ideal blocks/session 0, min(3,3)=3, min(5,5)=5, min(6,7)=6.
    """
    the_plan = plan(scenario(output_cached=True, user_tokens=100))
    assert [r.query_tokens for r in the_plan.rounds] == [2400, 4000, 5600, 7200]
    assert [r.ideal_hit_tokens for r in the_plan.rounds] == [0, 4 * 3 * 256, 4 * 5 * 256, 4 * 6 * 256]
    assert [r.footprint_bytes for r in the_plan.rounds] == [12 * BB, 20 * BB, 24 * BB, 32 * BB]


def test_ideal_never_counts_the_last_token_block(scenario):
    """600 tokens + 168 cached output = 768 = 3 full blocks stored; round 2's prompt is those 768 tokens, but
    only (768 - 1) // 256 = 2 blocks are hittable: ideal 4 x 2 x 256 = 2048 of 3072, not 3 blocks."""
    the_plan = plan(scenario(rounds=2, output_tokens=168, output_cached=True))
    assert [r.query_tokens for r in the_plan.rounds] == [2400, 3072]
    assert [r.ideal_hit_tokens for r in the_plan.rounds] == [0, 2048]
    assert [r.footprint_bytes for r in the_plan.rounds] == [12 * BB, 12 * BB]  # 936 // 256 = 3 blocks in round 2


@pytest.mark.parametrize(
    ("arm_spec", "capacity", "policy", "overflow", "collapse"),
    [
        # 14 blocks: round 3 (16) is the first over; before it 12 -> room 2 blocks, each session adds 1:
        # the 3rd session's save evicts the 4th session's head (3 x 1 > 2) -> collapse in round 3.
        (arm("lru", 14), 14 * BB, "lru", 3, 3),
        (arm("tail_first", 14), 14 * BB, "tail_first", 3, 3),
        # 15 blocks: room 3 -> only the 4th (last) session's save evicts -> round 4 is the first to lose.
        (arm("lru", 15), 15 * BB, "lru", 3, 4),
        # fifo, 14 blocks: evictions (1 then 2 blocks) take session 0's round-1 blocks (2): no waiting
        # session loses its head in round 3, session 0 misses in round 4.
        (arm("fifo", 14), 14 * BB, "fifo", 3, 4),
        # exactly 20 blocks holds round 4's working set: never overflows.
        (arm("lru", 20), 20 * BB, "lru", None, None),
        # replicate: the largest tier (nof, 15 blocks) bounds it, with nof's policy.
        (
            {
                "tiers": [
                    {"name": "dram", "capacity": 4 * BB, "policy": "lru"},
                    {"name": "nof", "capacity": 15 * BB, "policy": "fifo"},
                ]
            },
            15 * BB,
            "fifo",
            3,
            4,
        ),
        # demote: exclusive tiers add up, 6 + 8 = 14 blocks, evictions by the last tier's policy.
        (
            {
                "placement": "demote",
                "tiers": [
                    {"name": "dram", "capacity": 6 * BB, "policy": "fifo"},
                    {"name": "nof", "capacity": 8 * BB, "policy": "lru"},
                ],
            },
            14 * BB,
            "lru",
            3,
            3,
        ),
    ],
    ids=["lru14", "tail_first14", "lru15", "fifo14", "lru20", "replicate", "demote"],
)
def test_arm_prediction_by_hand(scenario, arm_spec, capacity, policy, overflow, collapse):
    prediction = plan(scenario({"a": arm_spec})).arms["a"]
    assert prediction.capacity_bytes == capacity
    assert prediction.holding_policy == policy
    assert (prediction.overflow_round, prediction.collapse_round) == (overflow, collapse)


def test_collapse_after_last_round_is_none(scenario):
    """lru15 collapses in round 4; with only 3 rounds it overflows in 3 but no round loses hits."""
    prediction = plan(scenario({"a": arm("lru", 15)}, rounds=3)).arms["a"]
    assert (prediction.overflow_round, prediction.collapse_round) == (3, None)


def test_arm_json_is_the_contract_prediction(scenario):
    the_plan = plan(scenario({"a": arm("lru", 14)}))
    prediction = the_plan.arm_json("a")
    assert prediction["collapse_round"] == 3
    assert prediction["overflow_round"] == 3
    assert prediction["footprint_bytes_by_round"] == [8 * BB, 12 * BB, 16 * BB, 20 * BB]
    assert prediction["ideal_hit_ratio_by_round"] == [0.0, 2048 / 3600, 0.64, 4096 / 6000]


# --------------------------------------------------------------------------- KV geometry from a model


@pytest.mark.parametrize(
    ("model", "token_bytes"),
    [
        # Llama-3-70B-like GQA: 2 (K,V) x 80 layers x 8 KV heads x 128 head dim x 2 B
        ({"layers": 80, "kv_heads": 8, "head_dim": 128, "dtype": "bf16"}, 327_680),
        # DeepSeek-V3 MLA: 61 layers x (512 latent + 64 rope) x 2 B
        ({"layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "dtype": "bf16"}, 70_272),
        # same GQA shape in fp8 halves it
        ({"layers": 80, "kv_heads": 8, "head_dim": 128, "dtype": "fp8"}, 163_840),
    ],
    ids=["llama3-70b-gqa", "deepseek-v3-mla", "gqa-fp8"],
)
def test_bytes_per_token_from_a_model(model, token_bytes):
    scenario = parse_scenario(
        {
            "workload": {"kind": "multi_round", "sessions": 1, "rounds": 1, "first_prompt_tokens": 600},
            "kv": {"model": model},  # block_tokens defaults to 256
            "arms": {"a": arm("lru", 10)},
        }
    )
    the_plan = plan(scenario)
    assert the_plan.bytes_per_token == token_bytes
    assert the_plan.block_bytes == 256 * token_bytes
    assert the_plan.rounds[0].footprint_bytes == 2 * 256 * token_bytes


# --------------------------------------------------------------------------- trace


def test_trace_plan_by_hand(scenario, write_trace, trace_workload):
    """conftest.TRACE_LINES, 16-token blocks of 16,000 B, infinite cache seen in request order.

    round 1: [1,2] cold; [1,2,4] hittable min(3, 47//16=2) = 2, both seen -> 32 of 88 tokens; seen {1,2,4}
    round 2: [1,2,4,5] hittable 4, run 1,2,4 -> 48 of 70; seen {1,2,4,5}
    round 3: no requests -> 0 of 0
    round 4: [7] hittable 15//16 = 0; [1,8] (33 tokens) hittable 2, run 1; seen + {7, 8};
             [1,8] again (32 tokens, exactly 2 blocks) hittable 31//16 = 1 -> 16 + 16 of 16 + 33 + 32 = 81
    footprint 3, 4, 4, 6 blocks; a 4-block arm first overflows in round 4; a trace predicts no collapse round.
    """
    arms = {"a": {"tiers": [{"name": "dram", "capacity": 4 * 16_000}]}}
    the_plan = plan(scenario(arms, trace_workload(write_trace())))
    assert [(r.requests, r.query_tokens, r.ideal_hit_tokens) for r in the_plan.rounds] == [
        (2, 88, 32),
        (1, 70, 48),
        (0, 0, 0),
        (3, 81, 32),
    ]
    assert [r.ideal_hit_ratio for r in the_plan.rounds] == [32 / 88, 48 / 70, 0.0, 32 / 81]
    assert [r.footprint_bytes for r in the_plan.rounds] == [3 * 16_000, 4 * 16_000, 4 * 16_000, 6 * 16_000]
    prediction = the_plan.arms["a"]
    assert (prediction.capacity_bytes, prediction.overflow_round, prediction.collapse_round) == (64_000, 4, None)


def test_trace_simulation_with_room_reaches_the_ideal(scenario, write_trace, trace_workload):
    rows = simulate(scenario(workload=trace_workload(write_trace())))["big"]["rounds"]
    assert [r["hit_tokens"] for r in rows] == [32, 48, 0, 32]
    assert [r["hit_ratio"] for r in rows] == [r["ideal_hit_ratio"] for r in rows]


# --------------------------------------------------------------------------- planner vs simulation


@pytest.mark.parametrize(
    "workload",
    [
        {},
        {"shared_prefix_tokens": 512},
        {"shared_prefix_tokens": 300, "user_tokens": 100},
        {"output_cached": True},
        {"output_cached": True, "user_tokens": 100, "shared_prefix_tokens": 256},
        {"first_prompt_tokens": 1024, "output_tokens": 256},  # prompts of exactly k blocks
        {"first_prompt_tokens": 600, "output_tokens": 168, "output_cached": True},  # cached > hittable
        {"first_prompt_tokens": 512, "output_tokens": 0},  # the same 2-block prompt every round
        {"order": "shuffled", "seed": 3, "sessions": 5, "user_tokens": 50},
        {"sessions": 1, "rounds": 6, "output_tokens": 0, "user_tokens": 128},
    ],
    ids=[
        "plain",
        "shared",
        "shared-unaligned-user",
        "output-cached",
        "cached-user-shared",
        "exact",
        "cached-beyond-hittable",
        "static",
        "shuffled",
        "one",
    ],
)
def test_arm_with_room_hits_exactly_the_ideal(scenario, workload):
    """Nothing is evicted, so every round's simulated hit ratio is the planner's bound, exactly."""
    rows = simulate(scenario(**workload))["big"]["rounds"]
    the_plan = plan(scenario(**workload))
    assert [r["hit_tokens"] for r in rows] == [r.ideal_hit_tokens for r in the_plan.rounds]
    assert [r["hit_ratio"] for r in rows] == [r.ideal_hit_ratio for r in the_plan.rounds]
    assert all(r["evictions"]["dram"] == 0 for r in rows)


def test_observed_collapse_is_the_first_round_below_tolerance_of_its_ideal():
    """Round 1 counts too; a ratio at exactly (1 - tolerance) x ideal has not collapsed."""

    def rows(*pairs):
        return [{"round": n, "hit_ratio": hit, "ideal_hit_ratio": ideal} for n, (hit, ideal) in enumerate(pairs, 1)]

    assert observed_collapse_round(rows((0.4, 0.5), (0.0, 0.5)), 0.01) == 1
    assert observed_collapse_round(rows((0.0, 0.0), (0.495, 0.5), (0.494, 0.5)), 0.01) == 3
    assert observed_collapse_round(rows((0.0, 0.0), (0.5, 0.5)), 0.01) is None


COLLAPSE_CASES = {
    # name: (workload overrides, {policy: capacity in blocks}, expected collapse round)
    # base workload, see the module docstring and test_arm_prediction_by_hand
    "base-14": ({}, 14, {"lru": 3, "tail_first": 3, "fifo": 4}),
    "base-15": ({}, 15, {"lru": 4, "tail_first": 4, "fifo": 4}),
    # 3 sessions, 300-token first prompt (1 block), 768 output tokens (3 blocks a round): footprint 3, 12 blocks.
    # Capacity 3: round 2 overflows with no room; session 0's 3 new blocks evict session 1's head under
    # every policy (fifo: the 3 oldest are s0b0, s1b0, s2b0) -> collapse 2.
    "big-growth": (
        {"sessions": 3, "first_prompt_tokens": 300, "output_tokens": 768},
        3,
        {"lru": 2, "tail_first": 2, "fifo": 2},
    ),
    # shared 512 tokens: footprint 2, 6, 10, 14; capacity 8: round 3 over, room 2, 3 x 1 > 2 -> 3
    # (fifo: its first eviction takes shared block 0, so the next session misses everything).
    "shared-8": ({"shared_prefix_tokens": 512}, 8, {"lru": 3, "tail_first": 3, "fifo": 3}),
    # output cached + 100 user tokens: footprint 12, 20 blocks; capacity 16: round 2 over, room 4, each
    # session adds 2. Recency: s2's save (3 x 2 > 4) evicts s3's blocks -> round 2. fifo: s2's save evicts
    # s0b0, s0b1 and s3's save s0b2, s1b0 (s1 already served): nobody waiting loses -> round 3.
    "cached-16": ({"output_cached": True, "user_tokens": 100}, 16, {"lru": 2, "tail_first": 2, "fifo": 3}),
}


@pytest.mark.parametrize(("name", "policy"), [(n, p) for n in COLLAPSE_CASES for p in ("lru", "fifo", "tail_first")])
def test_observed_collapse_round_matches_the_planner(scenario, name, policy):
    workload, blocks, expected = COLLAPSE_CASES[name]
    arm_result = simulate(scenario({"a": arm(policy, blocks)}, **workload))["a"]
    assert arm_result["prediction"]["collapse_round"] == expected[policy]
    assert arm_result["observed_collapse_round"] == expected[policy]


# --------------------------------------------------------------------------- planner edge cases (once bugs)


def test_fifo_overflow_reaching_a_waiting_session_head_collapses_now(scenario):
    """2 sessions, 522-token first prompt (2 blocks), 768 output tokens (3 blocks a round), capacity 4 blocks.

    Footprint 4 then 10 blocks: round 2 overflows with room 0. Session 0 hits its 2 blocks and saves 3 new
    ones; FIFO evicts the 3 oldest: s0b0, s0b1 and s1b0, the head of session 1, which then misses entirely:
    round 2 loses hits (eviction, 1 x 3 - 0 blocks, outran the 1 x 2 blocks session 0 wrote in round 1).
    """
    result = simulate(scenario({"a": arm("fifo", 4)}, sessions=2, first_prompt_tokens=522, output_tokens=768))["a"]
    assert result["observed_collapse_round"] == 2
    assert result["prediction"]["collapse_round"] == 2


def test_fifo_round_one_overflow_evicts_the_shared_prefix(scenario):
    """4 sessions, 778-token first prompt (3 blocks) of which 512 shared (2 blocks), capacity 4 blocks.

    Round 1: s0 writes sh0, sh1, a2 (3); s1 hits sh0, sh1 and writes b2 (4, full); s2 writes c2 and FIFO
    evicts sh0; s3 misses the shared prefix (0 of its 512 ideal tokens) -> round 1 loses hits.
    """
    result = simulate(
        scenario({"a": arm("fifo", 4)}, first_prompt_tokens=778, shared_prefix_tokens=512, output_tokens=256)
    )["a"]
    assert result["observed_collapse_round"] == 1
    assert result["prediction"]["collapse_round"] == 1


@pytest.mark.parametrize("policy", ["lru", "fifo", "tail_first"])
def test_round_one_session_larger_than_capacity_loses_the_shared_prefix(scenario, policy):
    """2 sessions, 300-token prompt = the 256-token shared block, 700 output tokens cached, capacity 2 blocks.

    Session 0 stores (300 + 700) // 256 = 3 blocks: sh, then its 2 output blocks, which evict sh. Session 1
    should hit sh (ideal 256 tokens) but finds nothing -> round 1 loses hits.
    """
    result = simulate(
        scenario(
            {"a": arm(policy, 2)},
            sessions=2,
            first_prompt_tokens=300,
            shared_prefix_tokens=256,
            output_tokens=700,
            output_cached=True,
        )
    )["a"]
    assert result["observed_collapse_round"] == 1
    assert result["prediction"]["collapse_round"] == 1


@pytest.mark.parametrize("policy", ["lru", "tail_first"])
def test_recency_overflow_when_waiting_sessions_hold_only_the_shared_prefix(scenario, policy):
    """3 sessions, 5 rounds, 300-token first prompt (its 1 full block is the 256-token shared prefix),
    100 user tokens a round, no output, capacity 2 blocks.

    P = 300, 400, 500, 600, 700 -> full blocks 1, 1, 1, 2, 2; footprint 1, 1, 1, 4, 4 blocks: round 4
    overflows (room 1, growth 1 a session). But in round 4 the waiting sessions
    hold only the shared block, which every session touches: s1's save evicts s0's new block, s2's save s1's.
    Round 4 reaches its ideal (each session hits the shared block); round 5 is the first to lose hits.
    """
    result = simulate(
        scenario(
            {"a": arm(policy, 2)},
            sessions=3,
            rounds=5,
            first_prompt_tokens=300,
            shared_prefix_tokens=256,
            output_tokens=0,
            user_tokens=100,
        )
    )["a"]
    assert result["observed_collapse_round"] == 5
    assert result["prediction"]["collapse_round"] == 5


def test_collapse_round_matches_simulation_on_random_round_robin_scenarios():
    """The planner's arithmetic against the simulator on 1,000 seeded random single-tier scenarios.

    Catches any model gap the hand-worked cases above miss (each edge case there was first found this way).
    """
    rng = random.Random(20261130)
    mismatches = []
    for _ in range(1000):
        first = rng.randint(60, 1500)
        workload = {
            "kind": "multi_round",
            "sessions": rng.randint(1, 7),
            "rounds": rng.randint(2, 7),
            "first_prompt_tokens": first,
            "shared_prefix_tokens": rng.choice([0, 0, rng.randint(0, first)]),
            "user_tokens": rng.choice([0, rng.randint(0, 400)]),
            "output_tokens": rng.choice([0, rng.randint(0, 900)]),
            "output_cached": rng.random() < 0.4,
        }
        tier = {"name": "t", "capacity": rng.randint(1, 40) * 64 * 16, "policy": rng.choice(sorted(POLICIES))}
        spec = {
            "workload": workload,
            "kv": {"block_tokens": 64, "bytes_per_token": 16},
            "arms": {"a": {"tiers": [tier]}},
        }
        arm_result = run_ab(parse_scenario(spec))["arms"]["a"]
        predicted, observed = arm_result["prediction"]["collapse_round"], arm_result["observed_collapse_round"]
        if predicted != observed:
            mismatches.append((tier, workload, predicted, observed))
    assert mismatches == []


# --------------------------------------------------------------------------- depth of the collapse

DEPTH_BY_HAND = {
    # Base workload, 14 blocks (collapse round 3: see test_arm_prediction_by_hand). Round 3: 4 blocks a prompt, 3
    # cached; round 4: 5 and 4. sN:b is block b of session N; orders are oldest first.
    #
    # lru. After round 2: s0[0 1 2] s1[..] s2[..] s3[..], 12 blocks. Round 3: s0 and s1 hit 3 and write b3 (14);
    # s2 hits 3, its b3 evicts s3:0; s3 hits 0 and writes b0, b3, which evict its own untouched s3:1, s3:2.
    # 3+3+3+0 = 9 blocks: 2304 / 4800 = .48. Order: s0[0-3] s1[0-3] s2[0-3] s3[0 3]. Round 4: s0 hits 4, its b4
    # evicts s1:0; s1 hits 0, rewrites b0 and b4, evicting s1:1, s1:2; s2 hits 4, its b4 evicts s1:3; s3 hits 1
    # (b1 is gone). 4+0+4+1 = 9 blocks: 2304 / 6000 = .384.
    "lru": [(3, 0.48), (4, 0.384)],
    # tail_first: a finished request's chain goes to the recent end tail first: after round 2 s0[2 1 0] ... s3.
    # Round 3: s0, s1 hit 3 (14); s2's b3 evicts s3:2; s3 hits 2 and writes b2, b3, evicting s0:3, s0:2: 11 blocks,
    # 2816 / 4800. Order: s0[1 0] s1[3-0] s2[3-0] s3[3-0]. Round 4: s0 hits 2, writes 3 (s1:3, s1:2, s1:1 go); s1
    # hits 1, writes 4 (all of s2 goes); s2 hits 0, writes 5 (s3 and s0:4); s3 hits 0: 3 blocks, 768 / 6000.
    "tail_first": [(3, 2816 / 4800), (4, 768 / 6000)],
    # lmcache: a lookup's chunks go to the recent end tail first, pinned; new chunks after them: after round 2
    # s0[1 0 2] ... s3. Round 3: s0, s1 hit 3 (14); s2's b3 evicts s3:1; s3 hits 1 (s3:0, pinned) and writes b1,
    # b3, evicting s3:2 and s0:2: 10 blocks, 2560 / 4800. Order: s0[1 0 3] s1[2 1 0 3] s2[..] s3[0 1 3]. Round 4:
    # s0 hits 2 and writes b2, b4 (s0:3, s1:2 go); s1 hits 2, writes b2, b4 (s1:3, s2:2); s2 hits 2 (s2:3, s3:0
    # go); s3 hits 0: 6 blocks, 1536 / 6000.
    "lmcache": [(3, 2560 / 4800), (4, 1536 / 6000)],
    # fifo collapses in round 4 (round 3 evicts s0:0, s0:1, blocks of a session already served), the last round:
    # no round after. Round 4: s0 misses (s0:0 is gone) and writes b0, b1, b4, evicting s1:0, s1:1, s2:0; each
    # later session finds its head gone in turn: 0.
    "fifo": [(4, 0.0)],
    # mooncake, a 14-block segment evicting above 12.6 blocks. Rounds 1-2 fill 12. Round 3: s0 hits 3, writes 1:
    # 13 blocks, .929 full: the thread evicts ceil(13 x (.929 - .9 + .05)) = 2, the oldest leases: s1's new b2,
    # then one of s1:0, s1:1 at random (their leases are ordered as their shards): s1 hits 1 or 0, expected 1/2.
    # s1 rewrites 3 (full: 3 go, all of s2), s2 and s3 hit 0: 3.5 blocks, 896 / 4800. Round 4: every put is
    # refused until the thread evicts, and each pass takes the next chains: 0.
    "mooncake": [(3, 896 / 4800), (4, 0.0)],
}


@pytest.mark.parametrize("policy", sorted(DEPTH_BY_HAND))
def test_collapse_depth_by_hand(scenario, policy):
    """The hit ratio of the collapse round and the round after, as worked out in DEPTH_BY_HAND's comments."""
    the_plan = plan(scenario({"a": arm(policy, 14)}))
    depth = the_plan.arms["a"].collapse_depth
    assert [number for number, _ in depth] == [number for number, _ in DEPTH_BY_HAND[policy]]
    assert [ratio for _, ratio in depth] == pytest.approx([ratio for _, ratio in DEPTH_BY_HAND[policy]])
    assert the_plan.arm_json("a")["collapse_depth"] == [{"round": n, "hit_ratio": r} for n, r in depth]


def test_no_collapse_has_no_depth(scenario):
    assert plan(scenario({"a": arm("lru", 20)})).arm_json("a")["collapse_depth"] == []


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SMALL = {
    "shared-8": ({"shared_prefix_tokens": 512}, 8),
    "cached-16": ({"output_cached": True, "user_tokens": 100}, 16),
    "eight-sessions-40": (
        {"sessions": 8, "rounds": 6, "first_prompt_tokens": 1024, "output_tokens": 256, "user_tokens": 256},
        40,
    ),
}


def _depth_gaps(result: dict) -> dict[str, list[float]]:
    """Per arm, predicted minus observed hit ratio in the collapse round and the round after."""
    return {
        name: [entry["hit_ratio"] - arm["rounds"][entry["round"] - 1]["hit_ratio"]
               for entry in arm["prediction"]["collapse_depth"]]
        for name, arm in result["arms"].items()
    }  # fmt: skip


@pytest.mark.parametrize("example", ["policies.yaml", "shared_prompt.yaml"])
def test_predicted_depth_is_the_embedded_stores_on_the_examples(example):
    """policies.yaml: lru .722, .575; mooncake .219, 0; lmcache .681, .512 (README, Policies), predicted and
    observed alike; shared_prompt.yaml likewise for lru and tail_first."""
    gaps = _depth_gaps(run_ab(load_scenario(EXAMPLES / example)))
    assert all(abs(gap) <= 0.05 for arm_gaps in gaps.values() for gap in arm_gaps), gaps
    if example == "policies.yaml":
        assert all(len(arm_gaps) == 2 for arm_gaps in gaps.values())


@pytest.mark.parametrize("name", sorted(SMALL))
def test_predicted_depth_is_within_005_of_the_embedded_store(scenario, name):
    """Every policy on small scenarios: exact for the deterministic ones; Mooncake's is the expectation over the
    random order of its leases, which seed 0 of the store draws one way."""
    workload, blocks = SMALL[name]
    arms = {policy: arm(policy, blocks) for policy in sorted(POLICIES)}
    gaps = _depth_gaps(run_ab(scenario(arms, **workload)))
    assert all(len(arm_gaps) == 2 for arm_gaps in gaps.values()), gaps
    assert all(abs(gap) <= 0.05 for arm_gaps in gaps.values() for gap in arm_gaps), gaps
    assert all(gap == pytest.approx(0) for policy, arm_gaps in gaps.items() if policy != "mooncake" for gap in arm_gaps)
