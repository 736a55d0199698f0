"""The embedded store's model of Mooncake (`policy: mooncake`, the mirror of a `store: mooncake` arm) against the
real thing, round by round, on three scenarios unlike each other: small blocks in the smallest segment, a lease
longer than a session's turn (the plateau), and many sessions with a lower watermark and larger eviction batches.

The captured real runs (tests/fixtures/mooncake-model, with their provenance) are held against the model
everywhere; a real Mooncake run of the same scenarios wherever one can run (skipped without it, failed under
KVSCOPE_REQUIRE_REAL=1). The example `mooncake_dram_vs_ssd` is the fourth scenario, in tests/test_mooncake_ab.py.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from support.misses import assert_causes_follow

from kvscope.tierstore.ab import run_ab, run_arm
from kvscope.tierstore.mooncake import mooncake_missing, object_key
from kvscope.tierstore.planner import plan
from kvscope.tierstore.scenario import load_scenario

SCENARIOS = sorted((Path(__file__).parent / "fixtures" / "mooncake-model").glob("*.yaml"))
AGREEMENT = 0.05  # absolute hit ratio, every round


def _ratios(rounds: list[dict]) -> list[float]:
    return [row["hit_ratio"] for row in rounds]


def _agree(real: list[float], simulated: list[float]) -> None:
    assert len(real) == len(simulated)
    worst = max(abs(a - b) for a, b in zip(real, simulated, strict=True))
    assert worst <= AGREEMENT, f"real {[round(r, 3) for r in real]}, the model {[round(s, 3) for s in simulated]}"


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda path: path.stem)
def test_the_model_follows_the_captured_real_mooncake_every_round(path):
    scenario = load_scenario(path)
    captured = json.loads(path.with_suffix(".real.json").read_text())
    simulated = run_arm(scenario, "dram_sim", plan(scenario))
    assert [row["query_tokens"] for row in simulated["rounds"]] == [row["query_tokens"] for row in captured["rounds"]]
    _agree(_ratios(captured["rounds"]), _ratios(simulated["rounds"]))


def test_the_model_follows_a_real_mooncake_now(require_real):
    """The three scenarios on real Mooncake stores at once (about 30 s), each beside its mirror."""
    missing = mooncake_missing()
    require_real(missing is None, missing or "")
    results: dict[str, dict] = {}
    failures: list[BaseException] = []

    def run(path: Path) -> None:
        try:
            results[path.stem] = run_ab(load_scenario(path))
        except BaseException as error:  # re-raised below, in the test's thread
            failures.append(error)

    threads = [threading.Thread(target=run, args=(path,)) for path in SCENARIOS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    for name, result in results.items():
        real, mirror = result["arms"]["dram"], result["arms"]["dram_sim"]
        assert real["store"]["kind"] == "mooncake" and mirror["mirror_of"] == "dram", name
        _agree(_ratios(real["rounds"]), _ratios(mirror["rounds"]))
        # why each token missed, from Mooncake's existence checks and put answers, as the model explains it
        assert_causes_follow(real["rounds"], mirror["rounds"], AGREEMENT)


def test_a_vllm_block_hash_is_named_as_vllms_mooncake_connector_names_it():
    """`keys: vllm` objects carry the connector's name (PoolKey.to_string: model, ranks, KV group, the hash in hex);
    integer chain keys stay 16 hex digits."""
    block_hash = bytes(range(32))
    assert object_key(block_hash) == "kvscope@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@" + block_hash.hex()
    assert object_key(2**64 + 5) == "0000000000000005"
