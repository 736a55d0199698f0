"""A/B runner: every arm of a scenario served on its own embedded store, reported per round.

The output is DESIGN.md's simulation contract (validated by `ab_result.schema.json`). Each arm replays the
same request stream; per-round tier figures are deltas of the store's own counters, the same counters the
exporters publish, so a simulated run and a recorded one are read the same way.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvscope import __version__
from kvscope.tierstore import scenario as spec
from kvscope.tierstore.backends import make_backend
from kvscope.tierstore.engine import EngineEmulator, Served
from kvscope.tierstore.live import ENGINES
from kvscope.tierstore.planner import Plan, plan
from kvscope.tierstore.policies import make_policy
from kvscope.tierstore.store import TieredStore
from kvscope.tierstore.tier import Tier
from kvscope.tierstore.workloads import make_workload

RoundCallback = Callable[[str, dict], None]
ArmCallback = Callable[[str], None]


def build_store(arm: spec.ArmSpec, block_bytes: int, arm_name: str, workdir: Path | None) -> TieredStore:
    """An arm's store; file backends without a path get `<workdir>/<arm>-<tier>.blocks`."""

    def build_tier(tier: spec.TierSpec) -> Tier:
        path = tier.path
        if tier.backend == "file" and path is None:
            if workdir is None:
                raise ValueError(f"arm {arm_name!r}, tier {tier.name!r}: the file backend needs a path or a workdir")
            path = workdir / f"{arm_name}-{tier.name}.blocks"
        backend = make_backend(tier.backend, tier.capacity, block_bytes, path, tier.o_direct)
        return Tier(tier.name, tier.capacity, make_policy(tier.policy), backend, tier.read_bandwidth)

    tiers = [build_tier(tier) for tier in arm.tiers]
    attached = [build_tier(tier) for tier in arm.attached]
    return TieredStore(tiers, arm.placement, arm.promote_on_hit, attached)


def build_engine(scenario: spec.Scenario, store: TieredStore) -> EngineEmulator:
    gpu_spec = scenario.engine.gpu_cache
    gpu = Tier("gpu", gpu_spec.capacity, make_policy(gpu_spec.policy)) if gpu_spec else None
    return EngineEmulator(store, scenario.block_tokens, scenario.block_bytes, scenario.engine.prefill_tokens_per_s, gpu)


@dataclass
class _RoundTally:
    requests: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    gpu_hit_tokens: int = 0
    recompute_tokens: int = 0
    put_bytes: int = 0
    ttft_s: list[float] = field(default_factory=list)

    def add(self, served: Served) -> None:
        self.requests += 1
        self.query_tokens += served.prompt_tokens
        self.hit_tokens += served.hit_tokens
        self.gpu_hit_tokens += served.gpu_hit_tokens
        self.recompute_tokens += served.recompute_tokens
        self.put_bytes += served.put_bytes
        self.ttft_s.append(served.ttft_s)


class ArmRun:
    """One arm being served a round at a time: `run_arm` drives it to the end, the service interleaves arms.

    With `published_as`, the arm's engine is published under that name for the `tierstore` exporter source.
    """

    def __init__(
        self,
        scenario: spec.Scenario,
        name: str,
        the_plan: Plan,
        workdir: Path | None = None,
        published_as: str | None = None,
    ) -> None:
        self.scenario, self.name, self.plan = scenario, name, the_plan
        self.store = build_store(scenario.arms[name], scenario.block_bytes, name, workdir)
        self.engine = build_engine(scenario, self.store)
        if published_as:
            ENGINES.publish(published_as, self.engine)
        gpu = [self.engine.gpu_cache] if self.engine.gpu_cache else []
        self._tiers = gpu + self.store.tiers + self.store.attached
        self._rounds = enumerate(make_workload(scenario).rounds())
        self._before = _snapshot(self._tiers)
        self.rows: list[dict] = []

    def step(self) -> dict | None:
        """Serve the next round; its row, or None when every round has been served."""
        index, requests = next(self._rounds, (None, None))
        if index is None:
            return None
        engine, planned = self.engine, self.plan.rounds[index]
        tally = _RoundTally()
        for request in requests:
            tally.add(engine.serve(request))
        engine.counters.rounds += 1
        engine.counters.bound_hit_tokens += planned.ideal_hit_tokens
        after = _snapshot(self._tiers)
        row = _round_row(index + 1, tally, planned.ideal_hit_ratio, self._before, after)
        self._before = after
        self.rows.append(row)
        return row

    def result(self) -> dict:
        """The arm's object of the contract, for the rounds served so far."""
        return {
            "rounds": self.rows,
            "totals": _totals(self.rows, _snapshot(self._tiers)),
            "prediction": self.plan.arm_json(self.name),
            "observed_collapse_round": observed_collapse_round(self.rows, self.scenario.prediction.collapse_tolerance),
        }

    def close(self) -> None:
        self.store.close()


def run_arm(
    scenario: spec.Scenario,
    name: str,
    the_plan: Plan,
    on_round: RoundCallback | None = None,
    workdir: Path | None = None,
    publish: bool = False,
    on_start: ArmCallback | None = None,
) -> dict:
    """Serve the scenario's requests on arm `name`; returns the arm's object of the contract.

    With `publish`, the arm's engine is published as "<scenario>/<arm>" for the `tierstore` exporter source;
    `on_start(arm)` runs once it is published, before the first request (a recorder's round-0 scrape).
    """
    arm = ArmRun(scenario, name, the_plan, workdir, f"{scenario.name}/{name}" if publish else None)
    try:
        if on_start:
            on_start(name)
        while (row := arm.step()) is not None:
            if on_round:
                on_round(name, row)
    finally:
        arm.close()
    return arm.result()


def run_ab(
    scenario: spec.Scenario,
    on_round: RoundCallback | None = None,
    workdir: Path | None = None,
    publish: bool = False,
    on_start: ArmCallback | None = None,
) -> dict:
    """Every arm of the scenario, in the contract's shape."""
    the_plan = plan(scenario)
    return {
        "kvscope_version": __version__,
        "scenario": scenario.model_dump(mode="json"),
        "arms": {
            name: run_arm(scenario, name, the_plan, on_round, workdir, publish, on_start) for name in scenario.arms
        },
    }


def observed_collapse_round(rows: list[dict], tolerance: float) -> int | None:
    """The first round whose hit ratio fell below (1 - tolerance) x its ideal: hits lost to eviction."""
    return next((r["round"] for r in rows if r["hit_ratio"] < (1 - tolerance) * r["ideal_hit_ratio"]), None)


def _snapshot(tiers: list[Tier]) -> dict[str, dict[str, int]]:
    return {tier.name: tier.counters.as_dict() for tier in tiers}


def _delta(before: dict, after: dict, counter: str) -> dict[str, int]:
    return {tier: after[tier][counter] - before[tier][counter] for tier in after}


def _round_row(number: int, tally: _RoundTally, ideal: float, before: dict, after: dict) -> dict:
    ttft = sorted(tally.ttft_s)
    return {
        "round": number,
        "requests": tally.requests,
        "query_tokens": tally.query_tokens,
        "hit_tokens": tally.hit_tokens,
        "gpu_hit_tokens": tally.gpu_hit_tokens,
        "hit_ratio": tally.hit_tokens / tally.query_tokens if tally.query_tokens else 0.0,
        "ideal_hit_ratio": ideal,
        "recompute_tokens_per_request": tally.recompute_tokens / tally.requests if tally.requests else 0.0,
        "put_bytes": tally.put_bytes,
        "written_bytes": _delta(before, after, "written_bytes"),
        "read_bytes": _delta(before, after, "read_bytes"),
        "evictions": _delta(before, after, "evictions"),
        "allocated_bytes": {tier: counters["allocated_bytes"] for tier, counters in after.items()},
        "ttft_s": {
            "mean": statistics.fmean(ttft) if ttft else 0.0,
            "p50": ttft[len(ttft) // 2] if ttft else 0.0,
            "p99": ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))] if ttft else 0.0,
        },
    }


def _totals(rows: list[dict], counters: dict[str, dict[str, int]]) -> dict:
    query = sum(r["query_tokens"] for r in rows)
    hits = sum(r["hit_tokens"] for r in rows)
    requests = sum(r["requests"] for r in rows)
    return {
        "requests": requests,
        "query_tokens": query,
        "hit_tokens": hits,
        "hit_ratio": hits / query if query else 0.0,
        "put_bytes": sum(r["put_bytes"] for r in rows),
        "ttft_s_mean": sum(r["ttft_s"]["mean"] * r["requests"] for r in rows) / requests if requests else 0.0,
        "written_bytes": {tier: c["written_bytes"] for tier, c in counters.items()},
        "evictions": {tier: c["evictions"] for tier, c in counters.items()},
        "tiers": counters,
    }
