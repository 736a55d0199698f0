"""Shared helpers for the tierstore tests: small tiers, stores and scenarios with hand-checkable sizes.

Sizes are tiny on purpose: a block is 100 B in store-level tests, and scenarios use 256-token blocks of
1 KB per token (256,000 B per block) so capacities read as "N blocks" in comments.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvscope.tierstore.policies import EvictionPolicy, make_policy
from kvscope.tierstore.scenario import Scenario, parse_scenario
from kvscope.tierstore.store import TieredStore
from kvscope.tierstore.tier import Tier

BLOCK = 100  # bytes per block in store-level tests
SCENARIO_BLOCK_TOKENS = 256
SCENARIO_TOKEN_BYTES = 1000  # "1KB" in a scenario
SCENARIO_BLOCK_BYTES = SCENARIO_BLOCK_TOKENS * SCENARIO_TOKEN_BYTES  # 256,000 B


@pytest.fixture
def block() -> int:
    return BLOCK


@pytest.fixture
def chain() -> Callable[[str, int], list[str]]:
    """`chain("a", 3)` -> ["a0", "a1", "a2"]: readable keys of one chain, head first."""

    def make(prefix: str, length: int) -> list[str]:
        return [f"{prefix}{index}" for index in range(length)]

    return make


@pytest.fixture
def drain() -> Callable[[EvictionPolicy], list]:
    """Pop every victim of a policy: its full eviction order, oldest first."""

    def pop_all(policy: EvictionPolicy) -> list:
        order = []
        while len(policy):
            order.append(policy.pop_victim()[0])
        return order

    return pop_all


@pytest.fixture
def make_tier() -> Callable[..., Tier]:
    """A tier holding `blocks` blocks of BLOCK bytes (accounting backend unless one is given)."""

    def make(name: str, blocks: int, policy: str = "lru", backend=None, read_bandwidth=None) -> Tier:
        return Tier(name, blocks * BLOCK, make_policy(policy), backend, read_bandwidth)

    return make


@pytest.fixture
def make_store(make_tier) -> Callable[..., TieredStore]:
    """`make_store([("dram", 2), ("nof", 10)], placement="demote")`: tiers given as (name, blocks[, policy])."""

    def make(tiers, placement: str = "replicate", promote_on_hit: bool = False) -> TieredStore:
        return TieredStore([make_tier(*spec) for spec in tiers], placement, promote_on_hit)

    return make


def _multi_round(**overrides) -> dict:
    workload = {
        "kind": "multi_round",
        "sessions": 4,
        "rounds": 4,
        "first_prompt_tokens": 600,
        "output_tokens": 300,
    }
    workload.update(overrides)
    return workload


@pytest.fixture
def scenario() -> Callable[..., Scenario]:
    """A validated scenario: multi-round workload overrides as keywords, arms as {name: arm mapping}.

    `arms` defaults to one LRU tier that never fills; `tolerance` sets prediction.collapse_tolerance.
    """

    def make(arms: dict | None = None, workload: dict | None = None, tolerance: float | None = None, **overrides):
        data: dict = {
            "workload": workload if workload is not None else _multi_round(**overrides),
            "kv": {"bytes_per_token": "1KB"},
            "arms": arms or {"big": {"tiers": [{"name": "dram", "capacity": "1GB"}]}},
        }
        if workload is None or workload.get("kind") == "multi_round":
            data["kv"]["block_tokens"] = SCENARIO_BLOCK_TOKENS
        if tolerance is not None:
            data["prediction"] = {"collapse_tolerance": tolerance}
        return parse_scenario(data)

    return make


@pytest.fixture
def one_tier_arm() -> Callable[[str, int], dict]:
    """An arm of one `dram` tier of `blocks` scenario blocks (256,000 B each) under `policy`."""

    def make(policy: str, blocks: int) -> dict:
        return {"tiers": [{"name": "dram", "capacity": blocks * SCENARIO_BLOCK_BYTES, "policy": policy}]}

    return make


# A hand-checked Mooncake-format trace: 16-token blocks, 1-second rounds (see test_workloads.py for the numbers).
TRACE_LINES = [
    '{"timestamp": 0, "input_length": 40, "output_length": 5, "hash_ids": [1, 2, 3]}',
    '{"timestamp": 500, "input_length": 48, "output_length": 5, "hash_ids": [1, 2, 4]}',
    '{"timestamp": 1200, "input_length": 70, "output_length": 5, "hash_ids": [1, 2, 4, 5, 6]}',
    "",
    '{"timestamp": 3500, "input_length": 16, "output_length": 5, "hash_ids": [7]}',
    '{"timestamp": 3999, "input_length": 33, "output_length": 5, "hash_ids": [1, 8, 9]}',
    '{"timestamp": 3999, "input_length": 32, "output_length": 5, "hash_ids": [1, 8]}',
]
TRACE_BLOCK_TOKENS = 16


@pytest.fixture
def write_trace(tmp_path) -> Callable[..., object]:
    """Write lines to `<tmp_path>/<name>` and return the path (defaults to TRACE_LINES)."""

    def write(lines: list[str] | None = None, name: str = "trace.jsonl"):
        path = tmp_path / name
        path.write_text("\n".join(TRACE_LINES if lines is None else lines) + "\n")
        return path

    return write


@pytest.fixture
def trace_workload() -> Callable[..., dict]:
    """The `workload` mapping of a trace scenario over `path`: 16-token blocks, 1-second rounds."""

    def make(path, **overrides) -> dict:
        workload = {"kind": "trace", "path": str(path), "block_tokens": TRACE_BLOCK_TOKENS, "round_seconds": 1}
        workload.update(overrides)
        return workload

    return make
