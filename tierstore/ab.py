"""A/B runner: every arm of a scenario served on its own store, reported per round.

The output is the A/B result contract (docs/design.md, 'The A/B result contract'; validated by
`ab_result.schema.json`). Each arm replays the same request stream on its store: kvscope's embedded one, or a real
Mooncake (`store: mooncake`, see kvscope.tierstore.mooncake). Per-round tier figures are deltas of the store's own
counters, the same counters the exporters publish (for Mooncake, its /metrics scraped through the `mooncake`
source), so a simulated run and a recorded one are read the same way.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from kvscope import __version__
from kvscope.tierstore import scenario as spec
from kvscope.tierstore.backends import make_backend
from kvscope.tierstore.engine import EngineEmulator, RequestClock, Served
from kvscope.tierstore.lifecycle import lifecycle_report
from kvscope.tierstore.live import ENGINES
from kvscope.tierstore.misses import causes_between
from kvscope.tierstore.mooncake_tier import MooncakeTier
from kvscope.tierstore.planner import Plan, RoundPlan, plan
from kvscope.tierstore.policies import MooncakePolicy, make_policy
from kvscope.tierstore.store import KVStore, NoStore, TieredStore
from kvscope.tierstore.tier import Tier
from kvscope.tierstore.ttft import TtftModel
from kvscope.tierstore.workloads import make_workload

if TYPE_CHECKING:  # the exporters' scrape machinery loads only with an arm that scrapes (a real store)
    from kvscope.exporters.scrape import TargetState


class ArmListener(Protocol):
    """Told about each arm as it runs (progress bars, the recorder). Calls are never concurrent."""

    def arm_started(self, arm: ArmRun) -> None: ...

    def round_done(self, arm: ArmRun, row: dict) -> None: ...

    def arm_ended(self, arm: ArmRun) -> None: ...


def build_store(
    arm: spec.ArmSpec,
    block_bytes: int,
    arm_name: str,
    workdir: Path | None,
    system: str | None = None,
    seed: int = 0,
) -> KVStore:
    """An arm's store. Embedded: file backends without a path get `<workdir>/<arm>-<tier>.blocks`. Mooncake: the
    real processes are started (and labelled `system` in their metrics, default the arm's name)."""
    if arm.store == "mooncake":
        from kvscope.tierstore.mooncake import MooncakeStore

        return MooncakeStore(arm, block_bytes, system or arm_name)
    if not arm.tiers:
        return NoStore()

    def build_tier(tier: spec.TierSpec) -> Tier:
        path = tier.path
        if tier.backend == "file" and path is None:
            if workdir is None:
                raise ValueError(f"arm {arm_name!r}, tier {tier.name!r}: the file backend needs a path or a workdir")
            path = workdir / f"{arm_name}-{tier.name}.blocks"
        backend = make_backend(tier.backend, tier.capacity, block_bytes, path, tier.o_direct)
        if tier.policy == "mooncake":
            settings = arm.mooncake_settings
            policy = MooncakePolicy(settings.lease_ttl, settings.eviction_high_watermark, settings.eviction_ratio, seed)
            return MooncakeTier(tier.name, tier.capacity, policy, settings.put_retry_budget > 0, backend,
                                tier.read_bandwidth)  # fmt: skip
        return Tier(tier.name, tier.capacity, make_policy(tier.policy), backend, tier.read_bandwidth)

    tiers = [build_tier(tier) for tier in arm.tiers]
    attached = [build_tier(tier) for tier in arm.attached]
    return TieredStore(tiers, arm.placement, arm.promote_on_hit, attached)


def build_engine(
    scenario: spec.Scenario,
    store: KVStore,
    clock: RequestClock | None = None,
    arm: spec.ArmSpec | None = None,
    explains_misses: bool = True,
) -> EngineEmulator:
    """The engine emulator; its GPU tier is `engine.gpu_cache`, or the model of a real vLLM's prefix cache (its
    blocks but the one vLLM keeps back, freed tail first) when a mirror simulates a vLLM arm. `clock` says when its
    requests happen, for a store whose evictions go by time. With `engine.gpu` or a `fabric`, TTFT comes from the
    TTFT model (`ttft_model`), each of `arm`'s tiers loading over its link. A caller that reads no miss causes
    (a what-if sweep) builds it without (`explains_misses`): a tenth to nearly half of a request's time
    (bench/request_cost.py)."""
    gpu_spec, real = scenario.engine.gpu_cache, scenario.engine.vllm
    gpu = Tier("gpu", gpu_spec.capacity, make_policy(gpu_spec.policy)) if gpu_spec else None
    if real is not None:
        gpu = Tier("gpu", (real.gpu_blocks - 1) * scenario.block_bytes, make_policy("tail_first"))
    model = ttft_model(scenario)
    links = [(scenario.tier_link(arm, index) if arm else ("east_west" if index == 0 else "north_south"),
              tier.read_bandwidth) for index, tier in enumerate(store.tiers)]  # fmt: skip
    return EngineEmulator(store, scenario.block_tokens, scenario.block_bytes, scenario.engine.prefill_tokens_per_s, gpu,
                          saves_whole_chain=real is not None, clock=clock, ttft_model=model,
                          tier_links=links, explains_misses=explains_misses)  # fmt: skip


def ttft_model(scenario: spec.Scenario) -> TtftModel | None:
    """The scenario's TTFT model (kvscope.tierstore.ttft), or None where it keeps the simple one (no engine.gpu,
    no fabric)."""
    engine, fabric = scenario.engine, scenario.fabric
    if fabric is None:
        return None
    shape = scenario.kv.model
    return TtftModel(
        scenario.kv.token_bytes,
        fabric.links(engine.concurrency),
        shape.compute() if shape and engine.gpu else None,
        engine.gpu.gpus() if engine.gpu else None,
        engine.prefill_tokens_per_s,
        shape.layers if shape else 1,
        engine.overlap_loading,
        engine.topology == "pd_disaggregated",
        engine.overhead,
    )


def request_clock(arm: spec.ArmSpec, store: KVStore, real_rows: Sequence[dict] = ()) -> RequestClock | None:
    """When each request of an arm does its KV work, for an embedded store (its tiers time their blocks' lifecycle
    on it, a Mooncake segment's model its evictions): the arm's pacing (`request_interval`), or the request times a
    real arm recorded (`real_rows`), with its master's eviction passes; None for a real store, which runs on
    real time."""
    if not isinstance(store, TieredStore | NoStore):
        return None
    clock = RequestClock(arm.mooncake_settings.request_interval, real_rows)
    for tier in store.tiers:
        if isinstance(tier, MooncakeTier) and clock.eviction_passes:
            tier.follow_eviction_passes(clock.eviction_passes)
    return clock


TTFT_PARTS = ("compute", "load", "pd_transfer", "overhead")


@dataclass
class _RoundTally:
    requests: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    gpu_hit_tokens: int = 0
    recompute_tokens: int = 0
    put_bytes: int = 0
    ttft_s: list[float] = field(default_factory=list)
    request_hit_tokens: list[int] = field(default_factory=list)
    ttft_parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TTFT_PARTS, 0.0))

    def add(self, served: Served) -> None:
        self.requests += 1
        self.request_hit_tokens.append(served.hit_tokens)
        self.query_tokens += served.prompt_tokens
        self.hit_tokens += served.hit_tokens
        self.gpu_hit_tokens += served.gpu_hit_tokens
        self.recompute_tokens += served.recompute_tokens
        self.put_bytes += served.put_bytes
        self.ttft_s.append(served.ttft_s)
        if served.ttft_parts is not None:
            for part in TTFT_PARTS:
                self.ttft_parts[part] += getattr(served.ttft_parts, part)


class ArmRun:
    """One arm being served a round at a time: `run_arm` drives it to the end, the service interleaves arms.

    `name` is one of the scenario's `runnable_arms` (a mirrored arm's simulation is `<name>_sim`). With
    `published_as`, the arm's engine is published under that name for the `tierstore` exporter source, and a real
    store's metrics carry it as their `system`. `observed` holds the exporter states of the real store's latest
    scrape (at the start, after each round, at the end), from which the arm's tier figures were taken. A Mooncake
    segment's model draws from `seed` and runs on the arm's request pacing, or for the mirror of a real vLLM arm on
    the request times of `real_rows`, the real arm's (kvscope.tierstore.engine.RequestClock); `hit_ratio_ranges` (a
    mirror's, from `mirror_ranges`) go into its rows. `pause`, called after each request, is where a caller that
    serves other work in the same interpreter lets it run (the service's requests, kvscope.api.yielding).
    """

    def __init__(
        self,
        scenario: spec.Scenario,
        name: str,
        the_plan: Plan,
        workdir: Path | None = None,
        published_as: str | None = None,
        seed: int = 0,
        hit_ratio_ranges: Sequence[tuple[float, float]] | None = None,
        real_rows: Sequence[dict] = (),
        pause: Callable[[], object] | None = None,
    ) -> None:
        started = time.monotonic()
        self.scenario, self.name, self.plan = scenario, name, the_plan
        self.spec = scenario.runnable_arms[name]
        self.system = published_as or f"{scenario.name}/{name}"
        self.store = build_store(self.spec, scenario.block_bytes, name, workdir, self.system, seed)
        self._ranges = hit_ratio_ranges
        self._pause = pause
        self.engine = build_engine(scenario, self.store, request_clock(self.spec, self.store, real_rows), self.spec)
        if published_as:
            ENGINES.publish(published_as, self.engine)
        self._rounds = enumerate(make_workload(scenario).rounds())
        self._last = self._snapshot(self.store.counters())
        self._first_misses = self._last_misses = self.engine.misses.snapshot() if self.engine.misses else None
        self.rows: list[dict] = []
        self.seconds = {"start": time.monotonic() - started, "rounds": 0.0}  # wall time: store start-up, serving

    @property
    def observed(self) -> list[TargetState]:
        return self.store.observed

    def step(self) -> dict | None:
        """Serve the next round; its row, or None when every round has been served."""
        index, requests = next(self._rounds, (None, None))
        if index is None:
            return None
        engine, planned = self.engine, self.plan.rounds[index]
        started = time.monotonic()
        tally = _RoundTally()
        for request in requests:
            tally.add(engine.serve(request))
            if self._pause:
                self._pause()
        engine.counters.rounds += 1
        engine.counters.bound_hit_tokens += planned.ideal_hit_tokens
        after = self._snapshot(self.store.counters())
        row = _round_row(index + 1, tally, planned, self._last, after)
        if self._last_misses is not None:
            misses = self.engine.misses.snapshot()  # type: ignore[union-attr]  # set with _last_misses
            row["miss_causes"] = causes_between(self._last_misses, misses)
            self._last_misses = misses
        if self.scenario.engine.kind == "vllm":  # a mirror: its requests side by side with the real engine's
            row["request_hit_tokens"] = tally.request_hit_tokens
        if self._ranges:
            row["hit_ratio_range"] = list(self._ranges[index])
        self._last = after
        self.rows.append(row)
        self.seconds["rounds"] += time.monotonic() - started
        return row

    def finish(self) -> None:
        """The end of the arm: its counters once the store's background work is done (Mooncake's offload)."""
        self._last = self._snapshot(self.store.settled_counters())

    def result(self) -> dict:
        """The arm's object of the contract, for the rounds served so far."""
        arm = {
            "store": self.store.report(),
            "wall_s": dict(self.seconds),
            "rounds": self.rows,
            "totals": arm_totals(self.rows, self._last, self._run_misses()) | self._lifecycle(),
            "prediction": self.plan.arm_json(self.name),
            "observed_collapse_round": observed_collapse_round(self.rows, self.scenario.prediction.collapse_tolerance),
        }
        if self.name not in self.scenario.arms:
            arm["mirror_of"] = self.name.removesuffix("_sim")
        return arm

    def close(self) -> None:
        self.store.close()

    def _run_misses(self) -> dict | None:
        """The miss causes of the rounds served so far (None for a store whose misses are not classified)."""
        if self._first_misses is None or self._last_misses is None:
            return None
        return causes_between(self._first_misses, self._last_misses)

    def _lifecycle(self) -> dict:
        """The embedded tiers' block lifecycle so far (`block_lifecycle`); none for a store on real time."""
        if self.engine.clock is None:
            return {}
        gpu = self.engine.gpu_cache
        return {"block_lifecycle": lifecycle_report([*([gpu] if gpu else []), *self.store.tiers, *self.store.attached])}

    def _snapshot(self, store_counters: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
        gpu = self.engine.gpu_cache
        return ({gpu.name: gpu.counters.as_dict()} if gpu else {}) | store_counters


def make_arm(
    scenario: spec.Scenario,
    name: str,
    the_plan: Plan,
    workdir: Path | None = None,
    published_as: str | None = None,
    real_rows: Sequence[dict] = (),
    pause: Callable[[], object] | None = None,
):
    """The arm's runner: a real vLLM engine's (kvscope.tierstore.vllm_ab) for an arm of an `engine.kind: vllm`
    scenario, else the engine emulator's (ArmRun, also for the mirrors of vLLM arms: on `real_rows`, the rows of
    the real arm it follows, see `followed_arm`), which calls `pause` after each request it serves."""
    if scenario.engine.kind == "vllm" and name in scenario.arms:
        from kvscope.tierstore.vllm_ab import VllmArm

        return VllmArm(scenario, name, the_plan, workdir, published_as)
    ranges = mirror_ranges(scenario, name, the_plan, real_rows, pause)
    return ArmRun(
        scenario, name, the_plan, workdir, published_as, hit_ratio_ranges=ranges, real_rows=real_rows, pause=pause
    )


def followers(scenario: spec.Scenario) -> dict[str, str]:
    """Each real arm that a mirror follows (`followed_arm`), with that mirror."""
    return {real: name for name in scenario.runnable_arms if (real := followed_arm(scenario, name))}


def followed_arm(scenario: spec.Scenario, name: str) -> str | None:
    """The real arm that mirror `name` follows: a vLLM arm's Mooncake segment model runs on the request times the
    real arm recorded, so it is served once the real arm is done; None for an arm that follows none."""
    real = name.removesuffix("_sim")
    if name in scenario.arms or real not in scenario.arms or scenario.engine.kind != "vllm":
        return None
    return real if any(tier.policy == "mooncake" for tier in scenario.runnable_arms[name].tiers) else None


MIRROR_SEEDS = 128
"""A real Mooncake master visits a batch's keys shard by shard from a random shard (kvscope.tierstore.policies.
MooncakePolicy), so which blocks of a chain outlive an eviction is random, and a real arm's hit ratio after a
collapse differs from run to run. The model draws the same choices from a seed: a mirror runs on this many, enough
to reach the edges of its range (on the vLLM collapse example at its pacing, round 8 of the DRAM-only arm:
.184-.294 on 16 seeds, .169-.294 on 128, .169-.316 on 200, against real runs of .18-.29)."""


def mirror_ranges(
    scenario: spec.Scenario,
    name: str,
    the_plan: Plan,
    real_rows: Sequence[dict] = (),
    pause: Callable[[], object] | None = None,
) -> list[tuple[float, float]] | None:
    """Per round, the lowest and the highest hit ratio of mirror `name` on MIRROR_SEEDS seeds (its rows are the
    first seed's; each runs on `real_rows`' request times, as ArmRun does, calling `pause` after each request); None
    for an arm that is no mirror of a Mooncake segment."""
    arm = scenario.runnable_arms[name]
    if name in scenario.arms or not arm.tiers or arm.tiers[0].policy != "mooncake":
        return None
    curves = []
    for seed in range(MIRROR_SEEDS):
        run = ArmRun(scenario, name, the_plan, seed=seed, real_rows=real_rows, pause=pause)
        try:
            while run.step() is not None:
                pass
        finally:
            run.close()
        curves.append([row["hit_ratio"] for row in run.rows])
    return [(min(ratios), max(ratios)) for ratios in zip(*curves, strict=True)]


def run_arm(
    scenario: spec.Scenario,
    name: str,
    the_plan: Plan,
    listener: ArmListener | None = None,
    workdir: Path | None = None,
    publish: bool = False,
    real_rows: Sequence[dict] = (),
) -> dict:
    """Serve the scenario's requests on arm `name` (a mirror that follows a real arm: on `real_rows`, its rows);
    returns the arm's object of the contract.

    With `publish`, the arm's engine is published as "<scenario>/<arm>" for the `tierstore` exporter source, before
    `listener.arm_started` (a recorder's round-0 scrape).
    """
    arm = make_arm(scenario, name, the_plan, workdir, f"{scenario.name}/{name}" if publish else None, real_rows)
    try:
        if listener:
            listener.arm_started(arm)
        while (row := arm.step()) is not None:
            if listener:
                listener.round_done(arm, row)
        arm.finish()
        if listener:
            listener.arm_ended(arm)
    finally:
        arm.close()
    return arm.result()


def run_ab(
    scenario: spec.Scenario,
    listener: ArmListener | None = None,
    workdir: Path | None = None,
    publish: bool = False,
) -> dict:
    """Every arm of the scenario (mirrors included), in the contract's shape.

    Embedded arms run one after the other; real-store arms run at the same time, each in a thread of its own that
    starts and stops its processes (they spend their time waiting on the store and the request pacing). A mirror
    that follows a real arm (`followed_arm`) runs after it, in its thread, on the rows it recorded.
    """
    the_plan = plan(scenario)
    arms = scenario.runnable_arms
    results: dict[str, dict] = {}
    failures: list[BaseException] = []
    serialized = _Serialized(listener) if listener else None
    following = followers(scenario)

    def run(name: str) -> None:
        try:
            results[name] = run_arm(scenario, name, the_plan, serialized, workdir, publish)
            if mirror := following.get(name):
                rows = results[name]["rounds"]
                results[mirror] = run_arm(scenario, mirror, the_plan, serialized, workdir, publish, rows)
        except BaseException as error:
            failures.append(error)

    threads = [threading.Thread(target=run, args=(name,), name=f"arm {name}") for name in arms
               if scenario.served_apart(name)]  # fmt: skip
    for thread in threads:
        thread.start()
    try:
        for name in arms:
            if not scenario.served_apart(name) and name not in following.values():
                results[name] = run_arm(scenario, name, the_plan, serialized, workdir, publish)
    finally:
        for thread in threads:
            thread.join()
    if failures:
        raise failures[0]
    return {
        "kvscope_version": __version__,
        "scenario": scenario.model_dump(mode="json"),
        "arms": {name: results[name] for name in arms},
    }


class _Serialized:
    """A listener whose calls, from arms running at the same time, never overlap."""

    def __init__(self, listener: ArmListener) -> None:
        self._listener, self._lock = listener, threading.Lock()

    def arm_started(self, arm: ArmRun) -> None:
        with self._lock:
            self._listener.arm_started(arm)

    def round_done(self, arm: ArmRun, row: dict) -> None:
        with self._lock:
            self._listener.round_done(arm, row)

    def arm_ended(self, arm: ArmRun) -> None:
        with self._lock:
            self._listener.arm_ended(arm)


def observed_collapse_round(rows: list[dict], tolerance: float) -> int | None:
    """The first round whose hit ratio fell below (1 - tolerance) x its ideal: hits lost to eviction."""
    return next((r["round"] for r in rows if r["hit_ratio"] < (1 - tolerance) * r["ideal_hit_ratio"]), None)


def tier_delta(before: dict, after: dict, counter: str) -> dict[str, int]:
    return {tier: after[tier][counter] - before[tier][counter] for tier in after}


def excess_recompute_per_request(ideal_hit_tokens: float, hit_tokens: int, requests: int) -> float:
    """Tokens recomputed per request beyond what an infinite cache would have recomputed: the hits the ideal had and
    the cache lost (negative where an engine counts more hits than the ideal allows: a bug worth seeing)."""
    return (ideal_hit_tokens - hit_tokens) / requests if requests else 0.0


def _round_row(number: int, tally: _RoundTally, planned: RoundPlan, before: dict, after: dict) -> dict:
    ttft = sorted(tally.ttft_s)
    return {
        "round": number,
        "requests": tally.requests,
        "query_tokens": tally.query_tokens,
        "hit_tokens": tally.hit_tokens,
        "gpu_hit_tokens": tally.gpu_hit_tokens,
        "hit_ratio": tally.hit_tokens / tally.query_tokens if tally.query_tokens else 0.0,
        "ideal_hit_tokens": planned.ideal_hit_tokens,
        "ideal_hit_ratio": planned.ideal_hit_ratio,
        "recompute_tokens_per_request": tally.recompute_tokens / tally.requests if tally.requests else 0.0,
        "excess_recompute_tokens_per_request": excess_recompute_per_request(
            planned.ideal_hit_tokens, tally.hit_tokens, tally.requests
        ),
        "put_bytes": tally.put_bytes,
        "written_bytes": tier_delta(before, after, "written_bytes"),
        "read_bytes": tier_delta(before, after, "read_bytes"),
        "evictions": tier_delta(before, after, "evictions"),
        "allocated_bytes": {tier: counters["allocated_bytes"] for tier, counters in after.items()},
        "ttft_s": {
            "mean": statistics.fmean(ttft) if ttft else 0.0,
            "p50": ttft[len(ttft) // 2] if ttft else 0.0,
            "p90": ttft[min(len(ttft) - 1, int(len(ttft) * 0.9))] if ttft else 0.0,
            "p99": ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))] if ttft else 0.0,
        },
        "ttft_share": ttft_share(tally.ttft_parts),
    }


def ttft_share(parts: dict[str, float]) -> dict[str, float]:
    """The share of the round's TTFT (summed over its requests) spent on each part: compute, the loading compute
    did not hide, the PD transfer and the fixed overhead; they add up to 1 (all 0 for a round without time)."""
    total = sum(parts.values())
    return {part: seconds / total if total else 0.0 for part, seconds in parts.items()}


def arm_totals(rows: list[dict], counters: dict[str, dict[str, int]], miss_causes: dict | None = None) -> dict:
    """The arm's whole run: sums of its rows, the tiers' counters at the end and the miss causes so far."""
    query = sum(r["query_tokens"] for r in rows)
    hits = sum(r["hit_tokens"] for r in rows)
    requests = sum(r["requests"] for r in rows)
    ideal_hits = sum(r["ideal_hit_tokens"] for r in rows)
    return {
        "requests": requests,
        "query_tokens": query,
        "hit_tokens": hits,
        "hit_ratio": hits / query if query else 0.0,
        "excess_recompute_tokens_per_request": excess_recompute_per_request(ideal_hits, hits, requests),
        "put_bytes": sum(r["put_bytes"] for r in rows),
        "ttft_s_mean": sum(r["ttft_s"]["mean"] * r["requests"] for r in rows) / requests if requests else 0.0,
        "written_bytes": {tier: c["written_bytes"] for tier, c in counters.items()},
        "evictions": {tier: c["evictions"] for tier, c in counters.items()},
        "tiers": counters,
    } | ({"miss_causes": miss_causes} if miss_causes is not None else {})
