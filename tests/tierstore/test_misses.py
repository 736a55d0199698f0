"""Miss causes: each cause on a hand-worked chain, exact in tokens; the causes add up to the misses in every round of
every example the embedded store runs; the long-output collapse explained; the planner's expected cause.

Blocks are 10 tokens of 100 B, so a tier of capacity N x 100 B holds N blocks and a prompt of 10 x k + 1 tokens has k
hittable blocks and one token no cache serves (the engine computes the last token).
"""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import yaml

from kvscope.tierstore.ab import run_ab
from kvscope.tierstore.contract import MissCause
from kvscope.tierstore.engine import EngineEmulator
from kvscope.tierstore.misses import CAUSES, ReportedMissLedger, dominant_cause, lost_hit_causes
from kvscope.tierstore.mooncake_tier import MooncakeTier
from kvscope.tierstore.planner import plan
from kvscope.tierstore.policies import MooncakePolicy, make_policy
from kvscope.tierstore.scenario import load_scenario
from kvscope.tierstore.store import TieredStore
from kvscope.tierstore.tier import Tier
from kvscope.tierstore.workloads import Request

EXAMPLES = Path(__file__).parents[2] / "examples"
TOKENS, BLOCK_BYTES = 10, 100


def lru(name: str, blocks: int) -> Tier:
    return Tier(name, blocks * BLOCK_BYTES, make_policy("lru"))


def serve(engine: EngineEmulator, keys: list[str]) -> dict:
    """Serve one request over `keys` (a prompt of len(keys) x 10 + 1 tokens); the causes of its misses."""
    before = engine.misses.snapshot()
    engine.serve(Request(1, 0, len(keys) * TOKENS + 1, keys))
    after = engine.misses.snapshot()
    causes = {cause: after[cause] - before[cause] for cause in CAUSES}
    causes["evicted_by_tier"] = {
        tier: tokens - before["evicted_by_tier"][tier] for tier, tokens in after["evicted_by_tier"].items()
    }
    return causes


def causes(by_tier: dict[str, int], **tokens: int) -> dict:
    return dict.fromkeys(CAUSES, 0) | {"evicted": sum(by_tier.values())} | tokens | {"evicted_by_tier": by_tier}


def test_a_never_seen_chain_is_cold_to_its_last_token():
    engine = EngineEmulator(TieredStore([lru("dram", 8)]), TOKENS, BLOCK_BYTES, 1000.0)
    assert serve(engine, ["a1", "a2", "a3"]) == causes({"dram": 0}, cold=31)


def test_a_chain_whose_head_was_evicted_misses_its_later_blocks_as_chain_broken():
    """The tier holds 4 blocks: a1-a4, then b1 evicts a1 (the oldest); a2-a4 are still there but unreachable."""
    engine = EngineEmulator(TieredStore([lru("dram", 4)]), TOKENS, BLOCK_BYTES, 1000.0)
    serve(engine, ["a1", "a2", "a3", "a4"])
    assert serve(engine, ["b1"]) == causes({"dram": 0}, cold=11)
    assert serve(engine, ["a1", "a2", "a3", "a4"]) == causes({"dram": 10}, cold=1, chain_broken=30)


def test_an_evicted_block_names_the_tier_that_evicted_it_last():
    """Replicate over dram (2 blocks) and nof (3): b1-b2 push a1-a2 out of dram, and a1 out of nof too; a1 missed
    is nof's eviction (dram dropped its copy first), a2 is still in nof behind it."""
    engine = EngineEmulator(TieredStore([lru("dram", 2), lru("nof", 3)]), TOKENS, BLOCK_BYTES, 1000.0)
    serve(engine, ["a1", "a2"])
    serve(engine, ["b1", "b2"])
    assert serve(engine, ["a1", "a2"]) == causes({"dram": 0, "nof": 10}, cold=1, chain_broken=10)


def test_an_eviction_from_the_gpu_cache_in_front_counts_when_it_came_last():
    """A request saves to the store, then fills the GPU cache: b1-b2 push a2 out of dram (a1 had overrun it), then
    a1-a2 out of the GPU cache (2 blocks), which dropped them last."""
    engine = EngineEmulator(TieredStore([lru("dram", 1)]), TOKENS, BLOCK_BYTES, 1000.0, gpu_cache=lru("gpu", 2))
    serve(engine, ["a1", "a2"])
    serve(engine, ["b1", "b2"])
    assert serve(engine, ["a1", "a2"]) == causes({"gpu": 20, "dram": 0}, cold=1)


def test_a_refused_put_is_not_admitted():
    """A Mooncake segment of 2 blocks whose client does not retry: a1 and a2 fit, a3 is refused; the refusal flags
    the eviction thread, which evicts ceil(2 x 0.15) = 1 block of those whose lease ran out (all, at time 0), the
    first put: a1. Looked up again, a1 was evicted, a2 is held behind it, a3 was never admitted."""
    segment = MooncakeTier("dram", 2 * BLOCK_BYTES, MooncakePolicy(), retries_refused=False)
    engine = EngineEmulator(TieredStore([segment]), TOKENS, BLOCK_BYTES, 1000.0)
    assert serve(engine, ["a1", "a2", "a3"]) == causes({"dram": 0}, cold=31)
    assert segment.refused == 1 and "a2" in segment and "a1" not in segment
    assert serve(engine, ["a1", "a2", "a3"]) == causes({"dram": 10}, cold=1, chain_broken=10, not_admitted=10)


def reported(ledger: ReportedMissLedger, keys: list[str], first_miss: int) -> dict:
    """The causes of one request's misses as ReportedMissLedger gives them (a prompt of len(keys) x 10 + 1 tokens)."""
    before = ledger.snapshot()
    ledger.classify(keys, first_miss, len(keys), len(keys) * TOKENS + 1)
    after = ledger.snapshot()
    delta = {cause: after[cause] - before[cause] for cause in CAUSES}
    delta["evicted_by_tier"] = {
        tier: tokens - before["evicted_by_tier"][tier] for tier, tokens in after["evicted_by_tier"].items()
    }
    return delta


def test_a_real_stores_misses_come_from_its_existence_checks_and_put_answers():
    """What a real store reports, block by block: a3 refused (not_admitted), a1 put and now gone (evicted, credited
    to the write path's last tier), a2 found by the check behind it (chain_broken), a4 never put (cold)."""
    ledger = ReportedMissLedger(None, "ssd", TOKENS)
    ledger.put(["a1", "a2", "a3"], refused=[2])
    ledger.checked(0, [False, True, False, False])
    assert reported(ledger, ["a1", "a2", "a3", "a4"], 0) == causes(
        {"ssd": 10}, cold=11, chain_broken=10, not_admitted=10
    )
    ledger.put(["a3", "a4"], refused=[])  # admitted later: a miss on a3 now is an eviction
    ledger.checked(1, [True, False, True])  # from block 1 (a GPU served a1): a2 served, a3 gone, a4 held
    assert reported(ledger, ["a1", "a2", "a3", "a4"], 2) == causes({"ssd": 10}, cold=1, chain_broken=10)
    ledger.checked(0, [True, True])  # found, but a2's get failed: the lookup stopped there, a2 counts as not held
    assert reported(ledger, ["a1", "a2"], 1) == causes({"ssd": 10}, cold=1)


def test_a_real_stores_gpu_tier_is_in_view():
    """The engine's GPU tier is kvscope's: a block it evicted and the store never held is `evicted` by the GPU, one
    it holds behind the first miss is `chain_broken`."""
    gpu = lru("gpu", 1)
    ledger = ReportedMissLedger(gpu, "dram", TOKENS)
    gpu.write(["b1"], BLOCK_BYTES, is_put=False)
    gpu.write(["b2"], BLOCK_BYTES, is_put=False)  # evicts b1
    assert reported(ledger, ["b1", "b2"], 0) == causes({"gpu": 10, "dram": 0}, cold=1, chain_broken=10)


def test_the_contract_names_the_same_causes_in_the_same_order():
    assert typing.get_args(MissCause) == CAUSES
    assert dominant_cause(dict.fromkeys(CAUSES, 0)) is None
    assert dominant_cause(dict.fromkeys(CAUSES, 0) | {"evicted": 5, "chain_broken": 5}) == "evicted"  # a tie: order


def embedded_examples() -> list[Path]:
    """The examples the embedded store serves alone: no real vLLM engine, no real Mooncake store."""
    chosen = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        if "workload" not in data:  # exporter targets, not a scenario
            continue
        real_engine = data.get("engine", {}).get("kind") == "vllm"
        if not real_engine and all(arm.get("store", "embedded") != "mooncake" for arm in data["arms"].values()):
            chosen.append(path)
    return chosen


def test_the_embedded_examples_are_the_ones_without_real_components():
    names = {path.stem for path in embedded_examples()}
    assert {"long_output", "policies", "trace", "shared_prompt"} <= names
    assert not names & {"mooncake_dram_vs_ssd", "vllm_mooncake_dram_vs_ssd"}


@pytest.mark.parametrize("path", embedded_examples(), ids=lambda path: path.stem)
def test_the_causes_add_up_to_the_misses_in_every_round(path: Path):
    result = run_ab(load_scenario(path))
    for name, arm in result["arms"].items():
        for row in arm["rounds"]:
            mc = row["miss_causes"]
            assert sum(mc[cause] for cause in CAUSES) == row["query_tokens"] - row["hit_tokens"], (name, row["round"])
            assert mc["evicted"] == sum(mc["evicted_by_tier"].values()) and all(mc["evicted_by_tier"].values())
            assert mc["elsewhere"] == 0
        totals = arm["totals"]["miss_causes"]
        assert totals == {cause: sum(row["miss_causes"][cause] for row in arm["rounds"]) for cause in CAUSES} | {
            "evicted_by_tier": {
                tier: sum(row["miss_causes"]["evicted_by_tier"].get(tier, 0) for row in arm["rounds"])
                for tier in totals["evicted_by_tier"]
            }
        }


def test_the_long_output_collapse_is_chain_broken_and_evicted_never_cold():
    """The DRAM-only arm collapses in round 8. In every round from there, the cold tokens are exactly what an
    infinite cache misses (the ~5,150 new tokens a session brings), every hit lost against it is chain_broken or
    evicted, and those two dominate the hits lost in every collapse round (chain_broken while heads go and tails
    stay, evicted once whole chains go), as predicted. Of all missed tokens they dominate from round 9: in the onset
    round the new tokens still outnumber the first losses."""
    result = run_ab(load_scenario(EXAMPLES / "long_output.yaml"))
    arm = result["arms"]["dram_only"]
    collapse = arm["observed_collapse_round"]
    assert collapse == 8
    dominant = []
    for row in arm["rounds"][collapse - 1 :]:
        mc = row["miss_causes"]
        assert mc["cold"] == row["query_tokens"] - row["ideal_hit_tokens"]
        assert mc["chain_broken"] + mc["evicted"] == row["ideal_hit_tokens"] - row["hit_tokens"] > 0
        assert mc["not_admitted"] == 0 and mc["evicted_by_tier"] == {"dram": mc["evicted"]}
        dominant.append(dominant_cause(mc))
    assert dominant == ["cold", "chain_broken"] + ["evicted"] * 11
    lost = [dominant_cause(lost_hit_causes(row["miss_causes"])) for row in arm["rounds"]]
    assert lost == [None] * 7 + ["chain_broken"] * 2 + ["evicted"] * 11  # the onset: heads gone, tails held
    observed = [dominant_cause(row["miss_causes"]) for row in arm["rounds"]]
    assert arm["prediction"]["dominant_miss_cause_by_round"] == observed
    assert arm["prediction"]["dominant_lost_hit_cause_by_round"] == lost
    assert result["arms"]["tiered"]["prediction"]["dominant_lost_hit_cause_by_round"] == [None] * 20


def test_the_planner_names_the_cold_cause_where_nothing_collapses():
    the_plan = plan(load_scenario(EXAMPLES / "long_output.yaml"))
    assert the_plan.arms["tiered"].dominant_miss_causes == ["cold"] * 20
    assert the_plan.arms["dram_only"].dominant_miss_causes[:7] == ["cold"] * 7


def test_the_table_and_the_lines_say_the_causes():
    """The long-output A/B: round 9 of the DRAM-only arm missed most as chain_broken (742k of 1.77M missed tokens:
    42%), as expected; the verdict gives each cause's share of the run's misses; predict names them per round."""
    from rich.console import Console

    from kvscope.tierstore.report import miss_cause_line, plan_lines, rounds_table, verdict_lines

    result = run_ab(load_scenario(EXAMPLES / "long_output.yaml"))
    console = Console(width=400, record=True)
    console.print(rounds_table(result))
    rows = [line.split("│") for line in console.export_text().splitlines() if line.startswith("│")]
    row_9 = "│".join(next(cells for cells in rows if cells[1].strip() == "9"))
    assert "chain_broken 42%" in row_9 and "(" not in row_9.split("chain_broken 42%")[1].split("│")[0]
    row_8 = [cell.strip() for cell in next(cells for cells in rows if cells[1].strip() == "8")]
    assert row_8[8:10] == ["cold 67%", "chain_broken 90%"], row_8  # missed most; hits lost most (as expected)
    assert row_8[-3:-1] == ["cold 100%", "none"], row_8  # the tiered arm lost none
    causes = dict.fromkeys(CAUSES, 0) | {"cold": 1, "evicted": 2, "chain_broken": 1, "evicted_by_tier": {"nof": 2}}
    assert miss_cause_line(causes) == "cold 25%, evicted 50% (nof), chain_broken 25%"
    dram_only = next(line for line in verdict_lines(result) if line.startswith("dram_only"))
    run_causes = result["arms"]["dram_only"]["totals"]["miss_causes"]
    assert f"missed tokens: {miss_cause_line(run_causes)}; " in dram_only
    assert dram_only.endswith("hits lost against the ideal: evicted 98% (dram), chain_broken 2%")  # never cold
    tiered = next(line for line in verdict_lines(result) if line.startswith("tiered"))
    assert tiered.endswith("missed tokens: cold 100%")  # nothing lost against the ideal: no such part
    assert any(
        "expected to miss most: cold in rounds 1-8, chain_broken in round 9, evicted in rounds 10-20" in line
        for line in plan_lines(plan(load_scenario(EXAMPLES / "long_output.yaml")))
    )
    assert (
        "  the cause expected to dominate the hits lost against the ideal: chain_broken in rounds 8-9, evicted in "
        "rounds 10-20" in plan_lines(plan(load_scenario(EXAMPLES / "long_output.yaml")))
    )
