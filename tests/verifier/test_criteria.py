"""Criteria semantics on hand-worked series: Prometheus' reset rule, tolerance edges, gauges, missing inputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvscope.verifier.criteria import CriteriaError, CriteriaFile, evaluate, load_criteria
from kvscope.verifier.db import VerifierError


def judge(recording, criterion: dict, roles: tuple[str, ...] = ("a", "b")):
    spec = CriteriaFile.model_validate({"runs": list(roles), "criteria": [criterion]})
    runs = spec.bind(recording.db, list(roles))
    return evaluate(recording.db, spec.criteria[0], runs)


def parity(tolerance: float = 0.001) -> dict:
    return {"name": "p", "kind": "parity", "metric": "kv.store.put.bytes", "runs": ["a", "b"], "tolerance": tolerance}


# ------------------------------------------------------------------------------------------------ resets


def test_increase_across_a_reset_counts_the_new_counter_from_zero(recording):
    """0 -> 10 -> 20, restart, 5 -> 15: Prometheus' increase() says 20 + 5 + 10 = 35."""
    recording.add("a", "kv.store.put.bytes", [0, 10, 20, 5, 15], tier="dram")
    recording.add("b", "kv.store.put.bytes", [100, 135], tier="dram")
    outcome = judge(recording, parity(0.0))
    assert outcome.rows[0]["a_value"] == outcome.rows[0]["b_value"] == 35
    assert outcome.passed


def test_a_fixed_width_counter_wraps_instead_of_resetting_and_every_row_counts_it(recording):
    """A 32-bit byte counter 4,294,960,000 -> 4,294,967,000 -> 3,000 rose 7,000 then wrapped: 296 to the top and
    3,000 past it, 10,296 B in all. Read as a reset it counts 10,000 (-2.9%): parity against a 64-bit counter that
    saw the same 10,296 B fails; with counter_bits: 32 it passes, and the rows say which it was."""
    top = 2**32
    recording.add("a", "kv.store.put.bytes", [top - 7296, top - 296, 3000], tier="dram")
    recording.add("b", "kv.store.put.bytes", [0, 7000, 10296], tier="dram")
    as_reset = judge(recording, parity(0.001))
    assert (as_reset.rows[0]["a_value"], as_reset.rows[0]["resets"], as_reset.rows[0]["wraps"]) == (10000, 1, 0)
    assert not as_reset.passed
    wrapping = {**parity(0.001), "metric": {"name": "kv.store.put.bytes", "counter_bits": 32}}
    outcome = judge(recording, wrapping)
    assert (outcome.rows[0]["a_value"], outcome.rows[0]["resets"], outcome.rows[0]["wraps"]) == (10296, 0, 1)
    assert outcome.passed
    written = {"name": "w", "kind": "positive_delta", "run": "a", "expect": ["dram"],
               "metric": {"name": "kv.store.put.bytes", "counter_bits": 32}}  # fmt: skip
    row = judge(recording, written, ("a",)).rows[0]
    assert (row["written"], row["resets"], row["wraps"]) == (10296, 0, 1)
    idle = {"name": "z", "kind": "zero_delta", "run": "a", "metric": "kv.store.put.bytes"}
    row = judge(recording, idle, ("a",)).rows[0]
    assert (row["delta"], row["resets"], row["wraps"]) == (10000, 1, 0)


def test_a_counter_born_during_the_run_counts_from_zero(recording):
    """The target was scraped at 1000 s without the series; it appears at 1002 s with 7 (Mooncake's SSD counters
    appear with the first offload): 7 + 3 happened in the run. A series there from the first scrape does not count
    its first value."""
    recording.add("a", "kv.tier.allocated.bytes", [0, 0, 0, 0], kind="gauge", tier="dram")  # the target's first scrape
    recording.add("a", "kv.tier.written.bytes", [7, 10], start=1002.0, tier="ssd")
    recording.add("a", "kv.tier.written.bytes", [5, 6, 9, 9], tier="dram")
    outcome = judge(
        recording,
        {
            "name": "w",
            "kind": "positive_delta",
            "metric": "kv.tier.written.bytes",
            "run": "a",
            "expect": ["dram", "ssd"],
        },
        ("a",),
    )
    assert {row["tier"]: row["written"] for row in outcome.rows} == {"dram": 4, "ssd": 10}


def test_a_counter_that_restarts_at_zero_and_stays_there_did_not_move(recording):
    recording.add("a", "kv.tier.written.bytes", [10, 0, 0], tier="nof")
    outcome = judge(
        recording, {"name": "z", "kind": "zero_delta", "metric": "kv.tier.written.bytes", "run": "a"}, ("a",)
    )
    assert (outcome.rows[0]["delta"], outcome.rows[0]["resets"], outcome.passed) == (0, 1, True)


def test_counter_resets_are_listed_with_time_and_target(recording):
    recording.add("a", "kv.store.put.bytes", [0, 10, 3, 8, 1], target="vllm-1", tier="dram")
    recording.add("a", "kv.store.get.bytes", [0, 1, 2], target="vllm-2", tier="dram")
    outcome = judge(recording, {"name": "r", "kind": "counter_resets", "run": "a"}, ("a",))
    assert [(r["target"], r["ts"], r["before"], r["after"]) for r in outcome.rows] == [
        ("vllm-1", 1002.0, 10, 3),
        ("vllm-1", 1004.0, 8, 1),
    ]
    assert not outcome.passed
    allowed = judge(recording, {"name": "r", "kind": "counter_resets", "run": "a", "allow": True}, ("a",))
    assert allowed.passed and len(allowed.rows) == 2


def test_no_resets_is_one_passing_row(recording):
    recording.add("a", "kv.store.put.bytes", [0, 10, 20], tier="dram")
    outcome = judge(recording, {"name": "r", "kind": "counter_resets", "run": "a"}, ("a",))
    assert outcome.passed and len(outcome.rows) == 1 and outcome.rows[0]["target"] is None


# ------------------------------------------------------------------------------------------------ tolerances


@pytest.mark.parametrize(
    ("b_total", "passed"),
    [(1000, True), (1001, True), (999, True), (1001.01, False), (998.99, False)],
)
def test_parity_holds_up_to_the_tolerance_on_either_side(recording, b_total, passed):
    recording.add("a", "kv.store.put.bytes", [0, 1000], tier="dram")
    recording.add("b", "kv.store.put.bytes", [0, b_total], tier="dram")
    outcome = judge(recording, parity(0.001))
    assert outcome.passed is passed
    assert outcome.rows[0]["relative_difference"] == pytest.approx((b_total - 1000) / 1000)


def test_parity_sums_every_series_of_the_metric(recording):
    """Replicated or not, what counts is the run's total: two tiers' puts in A against one in B."""
    recording.add("a", "kv.store.put.bytes", [0, 600], tier="dram")
    recording.add("a", "kv.store.put.bytes", [0, 400], tier="nof")
    recording.add("b", "kv.store.put.bytes", [0, 1000], tier="dram")
    assert judge(recording, parity(0.0)).passed


def test_parity_against_a_run_that_did_no_work_fails_rather_than_dividing_by_zero(recording):
    recording.add("a", "kv.store.put.bytes", [5, 5], tier="dram")
    recording.add("b", "kv.store.put.bytes", [5, 5], tier="dram")
    outcome = judge(recording, parity(0.5))
    assert not outcome.passed and outcome.rows[0]["relative_difference"] is None


def test_cross_source_agreement_within_tolerance(recording):
    recording.add("a", "kv.tier.written.bytes", [0, 1000], tier="nof")
    recording.add("a", "rdma.port.tx.bytes", [0, 600], device="mlx5_0", role="nof")
    recording.add("a", "rdma.port.tx.bytes", [0, 420], device="mlx5_1", role="nof")
    criterion = {
        "name": "x",
        "kind": "cross_source",
        "run": "a",
        "metric": {"name": "kv.tier.written.bytes", "where": {"tier": "nof"}},
        "other": {"name": "rdma.port.tx.bytes", "where": {"role": "nof"}},
    }
    assert judge(recording, {**criterion, "tolerance": 0.02}, ("a",)).passed
    assert not judge(recording, {**criterion, "tolerance": 0.01}, ("a",)).passed


# ------------------------------------------------------------------------------------------------ gauges, tiers


def test_a_gauge_that_moved_and_came_back_changed_by_max_minus_min(recording):
    recording.add("a", "kv.tier.allocated.bytes", [5, 7, 5], kind="gauge", tier="nof")
    default = {"name": "z", "kind": "zero_delta", "metric": "kv.tier.allocated.bytes", "run": "a"}
    moved = judge(recording, default, ("a",))
    assert (moved.rows[0]["delta"], moved.passed) == (2, False)
    assert judge(recording, {**default, "measure": "last_minus_first"}, ("a",)).passed


def test_positive_delta_fails_an_expected_tier_that_has_no_series_and_one_that_wrote_less_than_it_was_put(recording):
    recording.add("a", "kv.tier.written.bytes", [0, 100], tier="dram")
    recording.add("a", "kv.tier.written.bytes", [0, 50], tier="ssd")
    recording.add("a", "kv.store.put.bytes", [0, 100], tier="dram")
    recording.add("a", "kv.store.put.bytes", [0, 80], tier="ssd")
    criterion = {
        "name": "w",
        "kind": "positive_delta",
        "run": "a",
        "expect": ["dram", "nof", "ssd"],
        "consistent_with": "kv.store.put.bytes",
    }
    outcome = judge(recording, criterion, ("a",))
    rows = {row["tier"]: (row["written"], row["logical"], row["passed"]) for row in outcome.rows}
    assert rows == {"dram": (100, 100, True), "nof": (None, None, False), "ssd": (50, 80, False)}


def test_positive_delta_over_all_puts_catches_one_byte_on_a_tier_no_put_is_addressed_to(recording):
    """The puts are labelled with the top tier only (a client addresses the memory pool): against its own tier's
    puts the NoF tier's one byte passes; against all of them (consistent_scope: all) it fails, and a NoF tier
    that wrote every save passes."""
    recording.add("a", "kv.tier.written.bytes", [0, 100], tier="dram")
    recording.add("a", "kv.tier.written.bytes", [0, 1], tier="nof")
    recording.add("b", "kv.tier.written.bytes", [0, 100], tier="dram")
    recording.add("b", "kv.tier.written.bytes", [0, 100], tier="nof")
    for run in ("a", "b"):
        recording.add(run, "kv.store.put.bytes", [0, 100], tier="dram")
    criterion = {"name": "w", "kind": "positive_delta", "run": "a", "expect": ["dram", "nof"],
                 "consistent_with": "kv.store.put.bytes"}  # fmt: skip
    rows = lambda outcome: {row["tier"]: (row["logical"], row["passed"]) for row in outcome.rows}  # noqa: E731
    assert rows(judge(recording, criterion, ("a",))) == {"dram": (100, True), "nof": (None, True)}
    everything = {**criterion, "consistent_scope": "all"}
    one_byte = judge(recording, everything, ("a",))
    assert rows(one_byte) == {"dram": (100, True), "nof": (100, False)} and not one_byte.passed
    assert judge(recording, {**everything, "run": "b"}, ("b",)).passed


# ------------------------------------------------------------------------------------------------ missing inputs


def test_a_metric_the_run_does_not_have_is_an_error_never_a_pass(recording):
    recording.add("a", "kv.store.put.bytes", [0, 1], tier="dram")
    with pytest.raises(CriteriaError, match=r"run 'a' has no series kv\.tier\.written\.bytes\{tier=nof\}"):
        judge(
            recording,
            {
                "name": "z",
                "kind": "zero_delta",
                "run": "a",
                "metric": {"name": "kv.tier.written.bytes", "where": {"tier": "nof"}},
            },
            ("a",),
        )


def test_a_single_sample_cannot_show_a_delta(recording):
    recording.add("a", "kv.tier.written.bytes", [7], tier="nof")
    with pytest.raises(CriteriaError, match="fewer than 2 samples"):
        judge(recording, {"name": "z", "kind": "zero_delta", "run": "a", "metric": "kv.tier.written.bytes"}, ("a",))


def test_raw_and_normalized_series_are_told_apart(recording):
    recording.add("a", "vllm:prefix_cache_hits", [0, 5], normalized=False)
    with pytest.raises(CriteriaError, match="has no series"):
        judge(recording, {"name": "z", "kind": "zero_delta", "run": "a", "metric": "vllm:prefix_cache_hits"}, ("a",))
    raw = {"name": "vllm:prefix_cache_hits", "raw": True}
    assert not judge(recording, {"name": "z", "kind": "zero_delta", "run": "a", "metric": raw}, ("a",)).passed


def test_binding_checks_the_number_of_runs_and_their_names(recording):
    recording.add("a", "kv.store.put.bytes", [0, 1], tier="dram")
    spec = CriteriaFile.model_validate({"runs": ["x", "y"], "criteria": [parity() | {"runs": ["x", "y"]}]})
    with pytest.raises(CriteriaError, match=r"compare 2 run\(s\) \(x, y\): pass --run 2 time\(s\), got 1"):
        spec.bind(recording.db, ["a"])
    with pytest.raises(VerifierError, match=r"no run named 'nope' \(runs recorded: a\)"):
        spec.bind(recording.db, ["a", "nope"])
    # one run in both roles would pass every parity with itself
    with pytest.raises(CriteriaError, match=r"run 'a' is bound to roles x and y: each role needs a run of its own"):
        spec.bind(recording.db, ["a", "a"])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("runs: [a]\ncriteria:\n  - {name: x, kind: median, metric: m, run: a}\n", "criteria.0"),
        ("runs: [a]\ncriteria:\n  - {name: x, kind: zero_delta, metric: m, run: b}\n", "names run 'b', not one of"),
        ("runs: [a]\ncriteria:\n  - {name: x, kind: parity, metric: m, runs: [a, a]}\n", "tolerance: Field required"),
        ("runs: [a]\ncriteria: []\n", "criteria: List should have at least 1 item"),
        (
            "runs: [a, b]\ncriteria:\n  - {name: x, kind: parity, metric: m, runs: [a, b], tolerance: .inf}\n",
            "criteria.0.parity.tolerance: Input should be a finite number",
        ),
        (
            "runs: [a, b]\ncriteria:\n  - {name: x, kind: parity, metric: m, runs: [a, b], tolerance: .nan}\n",
            "criteria.0.parity.tolerance: Input should be a finite number",
        ),
        ("runs: [a\n", "not valid YAML"),
    ],
)
def test_criteria_files_that_do_not_validate_name_the_field(tmp_path, text, message):
    path = tmp_path / "criteria.yaml"
    path.write_text(text)
    with pytest.raises(CriteriaError, match=message) as error:
        load_criteria(path)
    assert str(path) in str(error.value)


def test_the_shipped_media_criteria_carry_the_published_tolerances():
    from pathlib import Path

    media = load_criteria(Path(__file__).resolve().parents[2] / "criteria" / "media.yaml")
    by_name = {criterion.name: criterion for criterion in media.criteria}
    assert media.runs == ["dram_only", "tiered"]
    assert (by_name["save_parity"].tolerance, by_name["load_parity"].tolerance) == (0.001, 0.003)
    assert by_name["nof_delta_zero"].run == "dram_only" and by_name["both_tiers_written"].expect == ["dram", "nof"]


def test_criteria_params_are_bound_into_every_string_and_unknown_ones_refused(tmp_path):
    from kvscope.verifier.criteria import CriteriaError, load_criteria

    path = tmp_path / "c.yaml"
    path.write_text(
        "runs: [a]\nparams: {lower_tier: nof}\ncriteria:\n"
        "  - {name: z, kind: zero_delta, run: a, description: 'the {lower_tier} tier',\n"
        "     metric: {name: kv.tier.allocated.bytes, where: {tier: '{lower_tier}'}}}\n"
    )
    default, bound = load_criteria(path), load_criteria(path, {"lower_tier": "ssd"})
    assert default.criteria[0].metric.where == {"tier": "nof"} and default.params == {"lower_tier": "nof"}
    assert bound.criteria[0].metric.where == {"tier": "ssd"} and bound.criteria[0].description == "the ssd tier"
    assert bound.params == {"lower_tier": "ssd"}  # the evidence keeps what was bound
    with pytest.raises(CriteriaError, match="no parameter 'upper'"):
        load_criteria(path, {"upper": "x"})


# ------------------------------------------------------------------------------------------------ balance

PROMPT_TOKENS_CONSERVED = {
    "name": "conserved",
    "kind": "balance",
    "runs": ["a"],
    "parts": [
        {"name": "kv.prompt.tokens", "where": {"source": "computed"}},
        {"name": "kv.prefix.hit.tokens", "where": {"layer": "gpu"}},
        {"name": "kv.prefix.hit.tokens", "where": {"layer": "external"}},
    ],
    "total": {"name": "kv.prefix.query.tokens", "where": {"layer": "gpu"}},
}


def three_rounds(recording, run: str, computed: list[float]) -> None:
    """Scrapes at 1000..1006 s; the round counter reaches 1, 2, 3 at 1002, 1004, 1006 s. Prompt tokens per round:
    100, 150, 200, of which the GPU hit 0, 50, 100 and the store 0, 30, 60 (cumulative series below)."""
    recording.add(run, "tierstore_engine_rounds_total", [0, 0, 1, 1, 2, 2, 3], normalized=False, store=run)
    recording.add(run, "kv.prefix.query.tokens", [0, 40, 100, 160, 250, 400, 450], layer="gpu")
    recording.add(run, "kv.prefix.hit.tokens", [0, 0, 0, 20, 50, 100, 150], layer="gpu")
    recording.add(run, "kv.prefix.hit.tokens", [0, 0, 0, 10, 30, 60, 90], layer="external")
    recording.add(run, "kv.prompt.tokens", computed, source="computed")


def test_balance_holds_exactly_in_every_round(recording):
    three_rounds(recording, "a", [0, 40, 100, 130, 170, 190, 210])
    outcome = judge(recording, PROMPT_TOKENS_CONSERVED, ("a",))
    assert [(r["round"], r["parts_sum"], r["total"]) for r in outcome.rows] == [
        (1, 100, 100),
        (2, 150, 150),
        (3, 200, 200),
    ]
    assert outcome.passed


def test_one_token_out_of_balance_in_one_round_fails_that_round(recording):
    """Round 2 recomputes one token more than its misses: the engine counted a token twice."""
    three_rounds(recording, "a", [0, 40, 100, 130, 171, 191, 211])
    outcome = judge(recording, PROMPT_TOKENS_CONSERVED, ("a",))
    assert [(r["round"], r["difference"], r["passed"]) for r in outcome.rows] == [
        (1, 0, True),
        (2, 1, False),
        (3, 0, True),
    ]
    assert not outcome.passed


def test_a_fixed_width_counter_wraps_within_a_round(recording):
    """The computed tokens' counter is 16 bits wide here and wraps in round 2 (65,500 -> 65,536 + 34): read as a
    wrap every round balances; read as a reset, round 2 loses the 36 tokens before the top."""
    three_rounds(recording, "a", [65_400, 65_440, 65_500, 65_530, 34, 54, 74])
    computed = {"name": "kv.prompt.tokens", "where": {"source": "computed"}}
    as_reset = judge(recording, PROMPT_TOKENS_CONSERVED, ("a",)).rows
    assert [(row["passed"], row["resets"], row["wraps"]) for row in as_reset] == [(True, 0, 0), (False, 1, 0),
                                                                                   (True, 0, 0)]  # fmt: skip
    wrapping = {**PROMPT_TOKENS_CONSERVED,
                "parts": [{**computed, "counter_bits": 16}, *PROMPT_TOKENS_CONSERVED["parts"][1:]]}  # fmt: skip
    outcome = judge(recording, wrapping, ("a",))
    assert [(r["round"], r["parts_sum"], r["total"], r["wraps"]) for r in outcome.rows] == [
        (1, 100, 100, 0), (2, 150, 150, 1), (3, 200, 200, 0)]  # fmt: skip
    assert outcome.passed


def test_balance_judges_every_run_it_names(recording):
    three_rounds(recording, "a", [0, 40, 100, 130, 170, 190, 210])
    three_rounds(recording, "b", [0, 40, 100, 130, 170, 190, 209])
    outcome = judge(recording, {**PROMPT_TOKENS_CONSERVED, "runs": ["a", "b"]}, ("a", "b"))
    assert [(r["run"], r["round"], r["passed"]) for r in outcome.rows if not r["passed"]] == [("b", 3, False)]


# ------------------------------------------------------------------------------------------------ coverage

NOF_IDLE = {"name": "nof_idle", "kind": "zero_delta", "run": "a",
            "metric": {"name": "kv.tier.allocated.bytes", "where": {"tier": "nof"}}}  # fmt: skip


def a_100_s_run(recording) -> None:
    """Run a: target t0 scraped every second for 100 s (its DRAM puts)."""
    recording.add("a", "kv.store.put.bytes", [float(i) for i in range(100)], tier="dram")


def test_a_nof_target_that_went_silent_mid_run_cannot_pass_zero_delta(recording):
    """Its allocation stayed at 0 for the 10 s it answered: nothing is known of the other 90."""
    a_100_s_run(recording)
    recording.add("a", "kv.tier.allocated.bytes", [0.0] * 10, kind="gauge", target="nof-target", tier="nof")
    with pytest.raises(CriteriaError, match=r"target nof-target stops 90\.000 s before the run's last scrape"):
        judge(recording, NOF_IDLE, ("a",))


def test_a_gauge_that_appears_mid_run_already_allocated_cannot_pass(recording):
    """First seen at 50 s with 64 MB allocated: a zero delta from there on says nothing of the first 50 s."""
    a_100_s_run(recording)
    recording.add("a", "kv.tier.allocated.bytes", [64e6] * 50, kind="gauge", start=1050.0, tier="nof")
    with pytest.raises(CriteriaError, match="first appears at scrape 51 of its target: a gauge that joined"):
        judge(recording, NOF_IDLE, ("a",))


def test_a_series_with_a_gap_longer_than_the_bound_is_named_with_the_gap(recording):
    a_100_s_run(recording)
    recording.add("a", "kv.tier.allocated.bytes", [0.0] * 20, kind="gauge", tier="nof")
    recording.add("a", "kv.tier.allocated.bytes", [0.0] * 69, kind="gauge", start=1031.0, tier="nof")
    with pytest.raises(
        CriteriaError, match=r"no samples for 11 scrapes of its target in a row \(from 1019\.000 to 1031\.000"
    ):
        judge(recording, NOF_IDLE, ("a",))
    loose = {**NOF_IDLE, "max_missed_scrapes": 11}  # a bound the criterion states
    assert judge(recording, loose, ("a",)).passed


def test_one_missed_scrape_and_a_counter_born_during_the_run_are_covered(recording):
    a_100_s_run(recording)
    recording.add("a", "kv.tier.allocated.bytes", [0.0] * 50, kind="gauge", tier="nof")
    recording.add("a", "kv.tier.allocated.bytes", [0.0] * 49, kind="gauge", start=1051.0, tier="nof")
    assert judge(recording, NOF_IDLE, ("a",)).passed
    recording.add("a", "kv.tier.written.bytes", [5.0, 9.0, 12.0], start=1097.0, tier="nof")  # born at 97 s
    written = {"name": "w", "kind": "positive_delta", "metric": "kv.tier.written.bytes", "run": "a", "expect": ["nof"]}
    assert judge(recording, written, ("a",)).passed


# ------------------------------------------------------------------------------------------------ sources_sum

TOKENS_CONSERVED = {"name": "tokens", "kind": "sources_sum", "run": "a", "sources": ["computed", "gpu", "host"]}


def two_engines(recording, host_on_engine_1: list[float] | None) -> None:
    """Engine 0: 300 prompt tokens = 100 computed + 150 gpu + 50 host. Engine 1: 200 = 120 + 80 (+ its host)."""
    recording.add("a", "kv.engine.prompt.tokens", [0, 300], engine="0")
    recording.add("a", "kv.prompt.tokens", [0, 100], engine="0", source="computed")
    recording.add("a", "kv.prompt.tokens", [0, 150], engine="0", source="gpu")
    recording.add("a", "kv.prompt.tokens", [0, 50], engine="0", source="host")
    recording.add("a", "kv.engine.prompt.tokens", [0, 200], engine="1")
    recording.add("a", "kv.prompt.tokens", [0, 120], engine="1", source="computed")
    recording.add("a", "kv.prompt.tokens", [0, 80], engine="1", source="gpu")
    if host_on_engine_1 is not None:
        recording.add("a", "kv.prompt.tokens", host_on_engine_1, engine="1", source="host")


def test_sources_sum_per_engine_exactly_and_a_stray_token_fails_its_engine(recording):
    two_engines(recording, [0, 0])
    outcome = judge(recording, TOKENS_CONSERVED, ("a",))
    assert [(r["group"], r["parts_sum"], r["total"], r["passed"]) for r in outcome.rows] == [
        ("0", 300, 300, True),
        ("1", 200, 200, True),
    ]
    assert outcome.rows[0]["sources"] == "computed=100.0, gpu=150.0, host=50.0" and outcome.passed
    recording.add("b", "kv.engine.prompt.tokens", [0, 300], engine="0")
    for source, tokens in (("computed", 101), ("gpu", 150), ("host", 50)):
        recording.add("b", "kv.prompt.tokens", [0, tokens], engine="0", source=source)
    outcome = judge(recording, {**TOKENS_CONSERVED, "run": "b"}, ("b",))
    assert [(r["difference"], r["passed"]) for r in outcome.rows] == [(1, False)]
    assert judge(recording, {**TOKENS_CONSERVED, "run": "b", "tolerance": 1 / 300}, ("b",)).passed


def test_a_source_missing_for_one_engine_is_an_input_error_naming_the_engine_and_the_source(recording):
    two_engines(recording, None)
    with pytest.raises(CriteriaError, match=r"engine '1' has no series kv.prompt.tokens\{source=host\}"):
        judge(recording, TOKENS_CONSERVED, ("a",))


def test_an_engine_that_served_no_prompt_tokens_proves_nothing(recording):
    recording.add("a", "kv.engine.prompt.tokens", [0, 0], engine="0")
    for source in ("computed", "gpu", "host"):
        recording.add("a", "kv.prompt.tokens", [0, 0], engine="0", source=source)
    assert not judge(recording, TOKENS_CONSERVED, ("a",)).passed


def test_the_shipped_tokens_criteria_are_exact_over_vllm_s_sources_and_take_others_as_a_list():
    (tokens,) = load_criteria(Path(__file__).resolve().parents[2] / "criteria" / "tokens.yaml").criteria
    assert (tokens.name, tokens.sources, tokens.tolerance) == ("tokens_conserved", ["computed", "gpu", "external"], 0)
    bound = load_criteria(
        Path(__file__).resolve().parents[2] / "criteria" / "tokens.yaml",
        {"sources": "computed, gpu,host,storage", "tolerance": "0.01"},
    ).criteria[0]
    assert (bound.sources, bound.tolerance) == (["computed", "gpu", "host", "storage"], 0.01)
