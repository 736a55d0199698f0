"""Request streams: multi-round chat (prompt growth, stable chained keys, shared prefix, cached output) and
Mooncake trace replay (round windows, keys from hash_ids, errors that name file:line and field)."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest
import yaml

from kvscope.tierstore.ab import run_ab
from kvscope.tierstore.blockhash import BlockHasher
from kvscope.tierstore.scenario import Scenario
from kvscope.tierstore.workloads import (
    SHARED_SESSION,
    MultiRoundWorkload,
    TraceError,
    TraceWorkload,
    make_workload,
    token_ids,
)


def rounds_of(scenario) -> list:
    return list(make_workload(scenario).rounds())


def keys_by_session(requests) -> dict[int, list]:
    return {request.session: list(request.keys) for request in requests}


# --------------------------------------------------------------------------- multi_round


def test_prompt_grows_by_output_plus_user_tokens(scenario):
    """Round r's prompt is first + (r - 1) x (output + user): 600, 850, 1100; blocks 2, 3, 4 of 256."""
    workload = make_workload(scenario(sessions=3, rounds=3, first_prompt_tokens=600, output_tokens=200, user_tokens=50))
    assert isinstance(workload, MultiRoundWorkload)
    rounds = list(workload.rounds())
    assert [workload.prompt_tokens(r) for r in (1, 2, 3)] == [600, 850, 1100]
    assert len(rounds) == 3
    for number, (requests, prompt, blocks) in enumerate(zip(rounds, (600, 850, 1100), (2, 3, 4), strict=True), 1):
        assert [r.round for r in requests] == [number] * 3
        assert [r.session for r in requests] == [0, 1, 2]  # round robin
        assert {r.prompt_tokens for r in requests} == {prompt}
        assert {len(r.keys) for r in requests} == {blocks}  # full blocks only
        assert all(len(r.output_keys) == 0 for r in requests)  # output not cached


def test_session_keys_are_stable_across_rounds(scenario):
    """Round r's keys for a session are a prefix of round r + 1's: the conversation only grows."""
    rounds = rounds_of(scenario(sessions=3, rounds=4, first_prompt_tokens=600, output_tokens=300))
    for earlier, later in pairwise(rounds):
        before, after = keys_by_session(earlier), keys_by_session(later)
        for session in range(3):
            assert after[session][: len(before[session])] == before[session]
            assert len(after[session]) > len(before[session])


def test_sessions_without_shared_prefix_share_no_block(scenario):
    """Different sessions must never collide on a key, not even block 0."""
    (requests,) = rounds_of(scenario(sessions=3, rounds=1, first_prompt_tokens=1100))
    all_keys = [key for request in requests for key in request.keys]
    assert len(all_keys) == 3 * 4
    assert len(set(all_keys)) == len(all_keys)


@pytest.mark.parametrize(("shared_tokens", "shared_blocks"), [(512, 2), (300, 1), (255, 0)])
def test_shared_prefix_blocks_equal_and_first_own_block_differs(scenario, shared_tokens, shared_blocks):
    """Only blocks wholly inside the shared prefix are shared; the block it ends in holds own tokens."""
    rounds = rounds_of(
        scenario(sessions=3, rounds=2, first_prompt_tokens=600, output_tokens=300, shared_prefix_tokens=shared_tokens)
    )
    keys = keys_by_session(rounds[1])  # 900 tokens: 3 blocks each
    assert all(len(k) == 3 for k in keys.values())
    for index in range(shared_blocks):
        assert keys[0][index] == keys[1][index] == keys[2][index]
    own = [k[shared_blocks] for k in keys.values()]
    assert len(set(own)) == 3
    # after diverging the chains never meet again
    assert len({k[2] for k in keys.values()}) == 3


def test_output_cached_adds_output_keys_that_next_round_reuses(scenario):
    """600-token prompt + 200 output = 800 tokens: 3 full blocks stored, the 3rd is the output block.

    Round 2's prompt (850 tokens, 3 blocks) then starts with exactly those 3 keys.
    """
    rounds = rounds_of(
        scenario(sessions=2, rounds=3, first_prompt_tokens=600, output_tokens=200, user_tokens=50, output_cached=True)
    )
    for earlier, later in pairwise(rounds):
        for request, following in zip(earlier, later, strict=True):
            assert len(request.output_keys) == 1
            stored = [*request.keys, *request.output_keys]
            assert list(following.keys[: len(stored)]) == stored
    assert [len(r.keys) for r in rounds[0]] == [2, 2]
    assert [len(r.output_keys) for r in rounds[2]] == [1, 1]  # 1100 + 200 = 1300 -> 5 blocks, 4 in prompt


def test_output_cached_with_no_full_output_block_adds_none(scenario):
    """600 + 100 = 700 tokens is still 2 full blocks: nothing extra to store."""
    workload = scenario(sessions=2, rounds=1, first_prompt_tokens=600, output_tokens=100, output_cached=True)
    (requests,) = rounds_of(workload)
    assert [len(r.output_keys) for r in requests] == [0, 0]


def test_shuffled_order_is_a_seeded_permutation_with_the_same_keys(scenario):
    """Shuffling changes who goes first, never a session's keys; the same seed gives the same order."""
    base = dict(sessions=5, rounds=4, first_prompt_tokens=600, output_tokens=300)
    robin = rounds_of(scenario(**base))
    shuffled = rounds_of(scenario(order="shuffled", seed=7, **base))
    again = rounds_of(scenario(order="shuffled", seed=7, **base))
    orders = [[r.session for r in requests] for requests in shuffled]
    assert orders == [[r.session for r in requests] for requests in again]
    assert all(sorted(order) == [0, 1, 2, 3, 4] for order in orders)
    assert any(order != [0, 1, 2, 3, 4] for order in orders)
    for plain, mixed in zip(robin, shuffled, strict=True):
        assert keys_by_session(plain) == keys_by_session(mixed)


# --------------------------------------------------------------------------- trace


def test_trace_rounds_are_time_windows_and_keys_are_full_block_hash_ids(scenario, write_trace, trace_workload):
    """16-token blocks, 1 s rounds over timestamps 0, 500 | 1200 | (none) | 3500, 3999 ms.

    keys = hash_ids[: input_length // 16]: 40 -> [1, 2] (partial 3rd block dropped), 48 -> [1, 2, 4],
    70 -> [1, 2, 4, 5], 16 -> [7], 33 -> [1, 8], 32 -> [1, 8]. The blank line is skipped.
    """
    workload = make_workload(scenario(workload=trace_workload(write_trace())))
    assert isinstance(workload, TraceWorkload)
    assert workload.round_count == 4
    rounds = list(workload.rounds())
    assert len(rounds) == 4
    summary = [[(r.round, r.session, r.prompt_tokens, list(r.keys)) for r in requests] for requests in rounds]
    assert summary == [
        [(1, 0, 40, [1, 2]), (1, 1, 48, [1, 2, 4])],
        [(2, 2, 70, [1, 2, 4, 5])],
        [],
        [(4, 3, 16, [7]), (4, 4, 33, [1, 8]), (4, 5, 32, [1, 8])],
    ]
    assert all(r.output_keys == () for requests in rounds for r in requests)


def test_trace_limit_replays_only_the_first_requests(scenario, write_trace, trace_workload):
    """limit: 3 keeps requests at 0, 500, 1200 ms: two rounds."""
    workload = make_workload(scenario(workload=trace_workload(write_trace(), limit=3)))
    assert workload.round_count == 2
    assert [len(requests) for requests in workload.rounds()] == [2, 1]


def test_trace_round_boundary_is_inclusive_of_the_next_window(scenario, write_trace, trace_workload):
    """A request at exactly 1000 ms opens round 2 (windows are [0, 1000), [1000, 2000))."""
    path = write_trace(
        [
            '{"timestamp": 999, "input_length": 16, "hash_ids": [1]}',
            '{"timestamp": 1000, "input_length": 16, "hash_ids": [1]}',
        ]
    )
    rounds = rounds_of(scenario(workload=trace_workload(path)))
    assert [[r.session for r in requests] for requests in rounds] == [[0], [1]]


@pytest.mark.parametrize(
    ("lines", "line", "expected"),
    [
        (['{"timestamp": 0, "input_length": 16, "hash_ids": [1]}', '{"timestamp": 5,'], 2, "not valid JSON"),
        (['{"timestamp": 0, "hash_ids": [1]}'], 1, "input_length must be a positive integer, got None"),
        (['{"input_length": 16, "hash_ids": [1]}'], 1, "timestamp must be a non-negative number of ms, got None"),
        (['{"timestamp": 0, "input_length": 16}'], 1, "hash_ids must be a list of integers"),
        (
            [
                '{"timestamp": 200, "input_length": 16, "hash_ids": [1]}',
                "",
                '{"timestamp": 100, "input_length": 16, "hash_ids": [1]}',
            ],
            3,
            "timestamp 100 goes back in time (previous 200)",
        ),
        (
            ['{"timestamp": 0, "input_length": 40, "hash_ids": [1]}'],
            1,
            "hash_ids has 1 blocks, fewer than the 2 full 16-token blocks of input_length 40",
        ),
    ],
    ids=["bad-json", "missing-input_length", "missing-timestamp", "missing-hash_ids", "backwards", "few-hash_ids"],
)
def test_trace_errors_name_file_line_and_field(scenario, write_trace, trace_workload, lines, line, expected):
    path = write_trace(lines)
    with pytest.raises(TraceError) as caught:
        make_workload(scenario(workload=trace_workload(path)))
    message = str(caught.value)
    assert message.startswith(f"{path}:{line}: "), message
    assert expected in message


def test_trace_without_requests_or_file_is_an_error(scenario, write_trace, trace_workload, tmp_path):
    empty = write_trace(["", "  "], name="empty.jsonl")
    with pytest.raises(TraceError, match="holds no requests"):
        make_workload(scenario(workload=trace_workload(empty)))
    missing = tmp_path / "absent.jsonl"
    with pytest.raises(TraceError, match=f"{missing}: cannot read trace"):
        make_workload(scenario(workload=trace_workload(missing)))


def test_vllm_keys_are_vllms_own_over_each_sessions_token_stream(scenario):
    """`keys: vllm`: each block's key is vLLM's chained SHA-256 of its token ids (PYTHONHASHSEED=0), the same as
    hashing the session's whole token stream at once; the shared prefix's blocks are one chain for everyone."""
    block = 256  # the scenario fixture's block
    s = scenario(
        workload={"kind": "multi_round", "sessions": 3, "rounds": 3, "first_prompt_tokens": 5 * block,
                  "shared_prefix_tokens": 2 * block, "user_tokens": block, "output_tokens": block, "keys": "vllm"},
    )  # fmt: skip
    assert s.block_tokens == block
    last = list(make_workload(s).rounds())[-1]
    hasher = BlockHasher(block, seed=0)
    for request in last:
        stream = [token for index in range(len(request.keys))
                  for token in token_ids(SHARED_SESSION if index < 2 else request.session, index, block)]  # fmt: skip
        assert list(request.keys) == hasher.block_keys(stream)
        assert all(isinstance(key, bytes) and len(key) == 32 for key in request.keys)
    assert len({request.keys[1] for request in last}) == 1 and len({request.keys[2] for request in last}) == 3


def test_vllm_keys_serve_the_same_hits_as_integer_keys():
    """The keys' shape changes nothing a store does: the three policies of examples/policies.yaml give the same
    rounds with either."""
    document = yaml.safe_load((Path(__file__).parents[2] / "examples" / "policies.yaml").read_text())
    curves = []
    for keys in ("int", "vllm"):
        document["workload"]["keys"] = keys
        result = run_ab(Scenario.model_validate(document))
        curves.append({name: [row["hit_tokens"] for row in arm["rounds"]] for name, arm in result["arms"].items()})
    assert curves[0] == curves[1]
    assert len({tuple(curve) for curve in curves[0].values()}) == 3  # and the three policies differ
